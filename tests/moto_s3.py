"""moto's S3 server as the tests run it: its writes made atomic, as S3 makes them.

moto checks a conditional write's precondition (If-Match, If-None-Match) and then writes, in two steps,
on a threaded server: two racing requests can both pass the check and both "win". S3 itself applies a
conditional write atomically, and the lock and the lease rely on exactly that. Here every write to a
key (put, multipart complete, copy, delete) runs under one lock, so the check and the write are one
step; the bodies are read before the lock is taken, and an upload's abort is one step too (a complete
and an abort racing: one of them wins, never both). And moto checks a multipart upload's complete
against If-None-Match only: S3 checks If-Match there too (a conditional put of a file over twice the
part size is one, objstore.s3_put), so it is checked here as moto checks a put's. A part uploaded to
an upload that is gone (aborted, completed) is answered 404 NoSuchUpload, as S3 answers it (moto: 500),
and so is a complete of an aborted upload (a taker aborted it while the holder's complete was in flight).
Nothing else changes: the store is moto's.

    python tests/moto_s3.py -H 127.0.0.1 -p PORT
"""

from __future__ import annotations

import functools
import sys
import threading

from moto.s3.exceptions import MissingKey, NoSuchUpload, PreconditionFailed
from moto.s3.models import S3Backend
from moto.s3.responses import S3Response
from moto.server import main

_WRITES = threading.Lock()


def _atomic(handler):
    @functools.wraps(handler)
    def run(self, *args, **kwargs):
        with _WRITES:
            return handler(self, *args, **kwargs)

    return run


def _complete_if_match(handler):
    """A multipart complete with If-Match, refused as S3 refuses it: 404 with no object, 412 over another
    version. A retried complete of an upload that already made the object is moto's idempotent case."""

    @functools.wraps(handler)
    def run(self, request, body, bucket_name, query, key_name):
        if_match = self.headers.get("If-Match")
        if if_match and query.get("uploadId"):
            held = self.backend.get_object(bucket_name, key_name)
            if not (held is not None and held.multipart and held.multipart.id == query["uploadId"][0]):
                if held is None:
                    raise MissingKey
                if if_match.replace('"', "") != held.etag.replace('"', ""):
                    raise PreconditionFailed("If-Match")
        return handler(self, request, body, bucket_name, query, key_name)

    return run


def _known_upload(method):
    @functools.wraps(method)
    def run(self, bucket_name, multipart_id, *args, **kwargs):
        if multipart_id not in self.get_bucket(bucket_name).multiparts:
            raise NoSuchUpload(upload_id=multipart_id)
        return method(self, bucket_name, multipart_id, *args, **kwargs)

    return run


S3Backend.upload_part = _known_upload(S3Backend.upload_part)
S3Backend.upload_part_copy = _known_upload(S3Backend.upload_part_copy)
S3Backend.complete_multipart_upload = _known_upload(S3Backend.complete_multipart_upload)
S3Response._key_response_post = _complete_if_match(S3Response._key_response_post)
for _name in ("put_object", "_key_response_post", "copy_object", "delete_object", "abort_multipart_upload"):
    setattr(S3Response, _name, _atomic(getattr(S3Response, _name)))

if __name__ == "__main__":
    main(sys.argv[1:])
