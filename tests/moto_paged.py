"""moto's S3 server with ListMultipartUploads paged as S3 pages it (moto itself returns every upload
at once and ignores max-uploads): at most ANDREA_TEST_S3_UPLOADS_PAGE (default 2) uploads a page,
ordered by key and upload id, with key-marker / upload-id-marker, NextKeyMarker / NextUploadIdMarker
and IsTruncated. Its writes are atomic as in moto_s3.py.
The store still holds and aborts the uploads for real; only the page size is forced small, so that a
client that reads one page sees a truncated listing.

    python tests/moto_paged.py -H 127.0.0.1 -p PORT
"""

from __future__ import annotations

import os
import sys

import moto_s3  # noqa: F401  (its atomic writes too)
from moto.core.responses import ActionResult
from moto.s3.responses import S3Response
from moto.server import main

PAGE = int(os.environ.get("ANDREA_TEST_S3_UPLOADS_PAGE", "2"))


def list_multipart_uploads(self):
    qs = self.querystring
    arg = lambda name, default="": qs.get(name, [default])[0]  # noqa: E731
    prefix, key_marker, id_marker = arg("prefix"), arg("key-marker"), arg("upload-id-marker")
    page = min(int(arg("max-uploads", "1000")), PAGE)
    uploads = [
        u
        for u in self.backend.list_multipart_uploads(self.bucket_name).values()
        if u.key_name.startswith(prefix)
    ]
    # S3's order: by key, and within a key by upload id; the markers are positions in that order
    # (valid even when the marker's own upload has been aborted meanwhile).
    uploads.sort(key=lambda u: (u.key_name, u.id))
    if key_marker:
        uploads = [u for u in uploads if (u.key_name, u.id) > (key_marker, id_marker or "\uffff")]
    shown, truncated = uploads[:page], len(uploads) > page
    result = {
        "Bucket": self.bucket_name,
        "KeyMarker": key_marker,
        "UploadIdMarker": id_marker,
        "MaxUploads": page,
        "IsTruncated": truncated,
        "Uploads": [
            {
                "Key": u.key_name,
                "UploadId": u.id,
                "StorageClass": "STANDARD",
                "Initiated": "2010-11-10T20:48:33.000Z",
            }
            for u in shown
        ],
    }
    if truncated:
        result["NextKeyMarker"], result["NextUploadIdMarker"] = shown[-1].key_name, shown[-1].id
    self.data["Action"] = "ListMultipartUploads"
    return self.serialized(ActionResult(result))


S3Response.list_multipart_uploads = list_multipart_uploads

if __name__ == "__main__":
    main(sys.argv[1:])
