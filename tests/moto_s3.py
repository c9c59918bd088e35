"""moto's S3 server as the tests run it: its writes made atomic, as S3 makes them.

moto checks a conditional write's precondition (If-Match, If-None-Match) and then writes, in two steps,
on a threaded server: two racing requests can both pass the check and both "win". S3 itself applies a
conditional write atomically, and the lock and the lease rely on exactly that. Here every write to a
key (put, multipart complete, copy, delete) runs under one lock, so the check and the write are one
step; the bodies are read before the lock is taken. And moto checks a multipart upload's complete
against If-None-Match only: S3 checks If-Match there too (a conditional put of a file over twice the
part size is one, objstore.s3_put), so it is checked here as moto checks a put's. Nothing else
changes: the store is moto's.

    python tests/moto_s3.py -H 127.0.0.1 -p PORT
"""

from __future__ import annotations

import functools
import sys
import threading

from moto.s3.exceptions import MissingKey, PreconditionFailed
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


S3Response._key_response_post = _complete_if_match(S3Response._key_response_post)
for _name in ("put_object", "_key_response_post", "copy_object", "delete_object"):
    setattr(S3Response, _name, _atomic(getattr(S3Response, _name)))

if __name__ == "__main__":
    main(sys.argv[1:])
