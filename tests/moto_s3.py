"""moto's S3 server as the tests run it: its writes made atomic, as S3 makes them.

moto checks a conditional write's precondition (If-Match, If-None-Match) and then writes, in two steps,
on a threaded server: two racing requests can both pass the check and both "win". S3 itself applies a
conditional write atomically, and the lock and the lease rely on exactly that. Here every write to a
key (put, multipart complete, copy, delete) runs under one lock, so the check and the write are one
step; the bodies are read before the lock is taken. Nothing else changes: the store is moto's.

    python tests/moto_s3.py -H 127.0.0.1 -p PORT
"""

from __future__ import annotations

import functools
import sys
import threading

from moto.s3.responses import S3Response
from moto.server import main

_WRITES = threading.Lock()


def _atomic(handler):
    @functools.wraps(handler)
    def run(self, *args, **kwargs):
        with _WRITES:
            return handler(self, *args, **kwargs)

    return run


for _name in ("put_object", "_key_response_post", "copy_object", "delete_object"):
    setattr(S3Response, _name, _atomic(getattr(S3Response, _name)))

if __name__ == "__main__":
    main(sys.argv[1:])
