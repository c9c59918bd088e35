"""Publishing to object stores: the versions a conditional put relies on, and S3's atomic put.

s3fs's own pipe_file needs the whole file as one bytes object (a second copy of a 1.44 GB checkpoint)
and aborts a failed multipart upload only on Exception, not on cancellation. `s3_put` streams the parts
with bounded memory (at most max_concurrency parts in flight) and aborts on any failure whatsoever, so
that a failed upload leaves neither an object under the final name nor stored, billed parts; a writer
killed outright leaves parts that `s3_abort_uploads` clears at the next start.

A fenced publish (the lease holder's: `fence` given) is always a multipart upload, and its fence is
checked after the upload is created, before any byte: S3 cannot make a write conditional on another
object (the lock), but an upload can be aborted by someone else. A trainer taking over an expired lease
aborts every unfinished upload of the run right before its takeover write (lock.acquire_lease), so an
upload of the holder it replaces either completed before the takeover or never completes; and an upload
created after that sweep meets a fence that is past its free window and must renew the lease, which
either blocks the takeover or fails (LeaseLost). A holder paused mid-upload (SIGSTOP, a frozen VM, a
partitioned network) therefore never publishes after its lease was taken over.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

S3_MIN_PART = 5 * 2**20  # S3 refuses smaller parts (except the last)
Fence = Callable[[], None]  # the lease holder's check before a publish (RunDir._fence_of): raises to refuse


class ConcurrentWriteError(OSError):
    """A published append-only file was replaced by someone else since this process last saw it."""


@dataclass(frozen=True)
class Version:
    """A published file as this process last saw it: the next publication must replace exactly it."""

    size: int
    etag: str | None = None  # S3: the store itself then refuses a put over any other version
    exists: bool = True


ABSENT = Version(0, None, exists=False)


def _conditions(expect: Version | None) -> dict[str, str]:
    if expect is None:
        return {}
    if not expect.exists:
        return {"IfNoneMatch": "*"}
    if expect.etag is None:
        raise ValueError("an S3 conditional put needs the ETag of the version it replaces")
    return {"IfMatch": expect.etag}


def _error_code(e: BaseException) -> str | None:
    """The S3 error code of `e` (s3fs raises OSErrors from the SDK's ClientError, its cause)."""
    for err in (e, e.__cause__):
        code = getattr(err, "response", {}).get("Error", {}).get("Code")
        if code:
            return code
    return None


def _is_precondition_failure(e: BaseException) -> bool:
    return isinstance(e, FileExistsError) or _error_code(e) in ("PreconditionFailed", "412")


def _is_aborted_upload(e: BaseException) -> bool:
    return _error_code(e) == "NoSuchUpload"


async def _fence_after_create(fence: Fence | None) -> None:
    # The fence may renew the lease: a put of the lock through this same event loop, from a thread of its
    # own (a coroutine of the loop cannot wait for the loop).
    if fence is not None:
        await asyncio.to_thread(fence)


async def s3_put(
    fs,
    path: str,
    views: Iterable[memoryview],
    expect: Version | None,
    fence: Fence | None = None,
) -> Version:
    """Publish `views` as `path` whole (one PUT, or a multipart upload completed or aborted); with
    `expect`, only over that version (If-Match / If-None-Match), else ConcurrentWriteError. With
    `fence` (the lease holder's check, which raises to refuse): a multipart upload, whatever its size,
    fenced once it exists (see the module's docstring).

    A conditional put is ambiguous when its reply is lost: the store may have committed it, and the
    SDK's identical retry then fails its own precondition (412). So a refused put reads back what the
    store holds: exactly our bytes means it was ours, and its version is adopted; anything else is a
    true concurrent write."""
    bucket, key, _ = fs.split_path(path)
    conditions = _conditions(expect)
    digest = hashlib.sha256() if conditions else None
    part_size = max(fs.default_block_size, S3_MIN_PART)
    pending: collections.deque[memoryview] = collections.deque()
    pending_size = size = 0
    upload_id = None
    parts: list[dict] | None = None  # the completed parts, once the complete is sent
    uploads: list[asyncio.Task] = []
    slots = asyncio.Semaphore(max(1, fs.max_concurrency))

    def take(n: int) -> bytes:
        nonlocal pending_size
        out = []
        while n:
            head = pending.popleft()
            if head.nbytes > n:
                pending.appendleft(head[n:])
                head = head[:n]
            out.append(head)
            n -= head.nbytes
            pending_size -= head.nbytes
        return b"".join(out)

    async def upload_part(number: int, body: bytes) -> dict:
        try:
            r = await fs._call_s3(
                "upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body
            )
            return {"PartNumber": number, "ETag": r["ETag"]}
        finally:
            slots.release()

    async def send_part(body_size: int) -> None:
        await slots.acquire()  # back-pressure: at most max_concurrency parts held in memory
        uploads.append(asyncio.create_task(upload_part(len(uploads) + 1, take(body_size))))

    try:
        if fence is not None:
            mpu = await fs._call_s3("create_multipart_upload", Bucket=bucket, Key=key)
            upload_id = mpu["UploadId"]
            await _fence_after_create(fence)
        for view in views:
            if digest is not None:
                digest.update(view)
            pending.append(view)
            pending_size += view.nbytes
            size += view.nbytes
            # Keep at least one part's worth back: the last part may be up to twice the part size,
            # never under S3's minimum.
            while pending_size >= 2 * part_size:
                if upload_id is None:
                    mpu = await fs._call_s3("create_multipart_upload", Bucket=bucket, Key=key)
                    upload_id = mpu["UploadId"]
                await send_part(part_size)
        if upload_id is None:
            r = await fs._call_s3("put_object", Bucket=bucket, Key=key, Body=take(pending_size), **conditions)
        else:
            await send_part(pending_size)
            parts = await asyncio.gather(*uploads)
            r = await fs._call_s3(
                "complete_multipart_upload",
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
                **conditions,
            )
    except BaseException as e:
        for task in uploads:
            task.cancel()
        await asyncio.gather(*uploads, return_exceptions=True)
        sha256 = None if digest is None else digest.digest()
        return await _failed(fs, path, upload_id, e, size, sha256, parts, fence)
    finally:
        fs.invalidate_cache(path)
    return Version(size, r["ETag"])


async def _failed(
    fs,
    path: str,
    upload_id: str | None,
    e: BaseException,
    size: int,
    sha256: bytes | None,
    parts: list[dict] | None = None,
    fence: Fence | None = None,
) -> Version:
    """After a failed publish (raised from `e`): abort its multipart upload, if any. A refused
    conditional write whose bytes the store holds anyway (`size`, `sha256`) was our own, committed
    before its reply was lost, and its version is returned; so is an upload found gone (NoSuchUpload:
    the SDK's retry of a complete that went through may be answered so) whose object the store holds:
    by its bytes (`sha256`), or, for an unconditional publish (no digest kept), by the ETag S3 gives
    the object a complete of exactly these `parts` makes. A fenced upload found gone is adopted only if
    the fence then passes: a taker aborts the uploads right before its takeover, and its own identical
    bytes (a bit-exact run retrains the same step) are not this writer's publish. Any other refusal is
    a ConcurrentWriteError, an upload aborted by someone else (a trainer taking the run over) too;
    anything else is `e` itself."""
    bucket, key, _ = fs.split_path(path)
    aborted = _is_aborted_upload(e)
    if upload_id is not None and not aborted:
        # If even the abort fails, the next trainer start aborts it (discard_incomplete_writes); the
        # error that matters is the upload's.
        with contextlib.suppress(Exception):
            await asyncio.shield(
                fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
            )
    if not (aborted or _is_precondition_failure(e)):
        raise e
    if sha256 is not None:
        etag = await s3_etag_if_holding(fs, path, size, sha256)
    elif aborted and parts:
        etag = await s3_etag_if_made_of(fs, path, size, parts)
    else:
        etag = None
    if etag is not None:
        if aborted:
            # Seen after the object: a lease still ours now was nobody else's since (LeaseLost otherwise).
            await _fence_after_create(fence)
        return Version(size, etag)
    if aborted:
        raise ConcurrentWriteError(
            f"s3://{path}: its upload was aborted before it completed (a trainer taking the run over aborts "
            "the uploads of the holder it replaces): not published"
        ) from e
    raise ConcurrentWriteError(f"s3://{path} changed since this process read it; not replacing it") from e


def extendable(expect: Version, size: int) -> bool:
    """Whether a file of version `expect`, grown to `size` bytes, can be published by s3_extend: a
    published prefix of at least a part's worth (a copied part must be one), its ETag, and a tail."""
    return expect.exists and bool(expect.etag) and S3_MIN_PART <= expect.size < size


async def s3_extend(fs, path: str, data: bytes, expect: Version, fence: Fence | None = None) -> Version:
    """Publish `data` as `path`, which holds version `expect`: the first expect.size bytes of `data`, at
    least a part's worth (an append-only file, grown since). The store copies that prefix into the
    first part itself (UploadPartCopy of exactly those bytes of exactly that version) and only the new
    tail travels: a long loss log published at every checkpoint costs its growth, not its size. The
    upload is completed only over `expect` (If-Match), and fails as s3_put's does: aborted, a lost
    reply resolved by reading back, anything else a ConcurrentWriteError; `fence` as s3_put's."""
    bucket, key, _ = fs.split_path(path)
    part_size = max(fs.default_block_size, S3_MIN_PART)
    tail = memoryview(data)[expect.size :]
    if not extendable(expect, len(data)):
        raise ValueError(f"s3://{path}: an extension needs a published prefix of a part's worth and a tail")
    upload_id = None
    try:
        mpu = await fs._call_s3("create_multipart_upload", Bucket=bucket, Key=key)
        upload_id = mpu["UploadId"]
        await _fence_after_create(fence)
        copied = await fs._call_s3(
            "upload_part_copy",
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            PartNumber=1,
            CopySource={"Bucket": bucket, "Key": key},
            CopySourceIfMatch=expect.etag,
            CopySourceRange=f"bytes=0-{expect.size - 1}",
        )
        parts = [{"PartNumber": 1, "ETag": copied["CopyPartResult"]["ETag"]}]
        # Parts of part_size, the last one whatever is left (only the last may be under S3's minimum).
        starts = list(range(0, tail.nbytes, part_size))
        if len(starts) > 1 and tail.nbytes - starts[-1] < S3_MIN_PART:
            starts.pop()  # a short remainder joins the part before it
        for i, start in enumerate(starts):
            end = starts[i + 1] if i + 1 < len(starts) else tail.nbytes
            r = await fs._call_s3(
                "upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=i + 2,
                Body=bytes(tail[start:end]),
            )  # fmt: skip
            parts.append({"PartNumber": i + 2, "ETag": r["ETag"]})
        r = await fs._call_s3(
            "complete_multipart_upload",
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            MultipartUpload={"Parts": parts},
            IfMatch=expect.etag,
        )
    except BaseException as e:
        sha256 = hashlib.sha256(data).digest()
        return await _failed(fs, path, upload_id, e, len(data), sha256, None, fence)
    finally:
        fs.invalidate_cache(path)
    return Version(len(data), r["ETag"])


async def s3_etag_if_holding(fs, path: str, size: int, sha256: bytes) -> str | None:
    """The ETag of `path` if the store holds exactly `size` bytes with this SHA-256, else None."""
    bucket, key, _ = fs.split_path(path)
    try:
        r = await fs._call_s3("get_object", Bucket=bucket, Key=key)
    except FileNotFoundError:
        return None
    if r.get("ContentLength") not in (None, size):
        r["Body"].close()
        return None
    held = hashlib.sha256()
    async with r["Body"] as body:
        while chunk := await body.read(2**20):
            held.update(chunk)
    return r["ETag"] if held.digest() == sha256 else None


def multipart_etag(parts: list[dict]) -> str | None:
    """The ETag S3 gives the object a complete of `parts` makes: the MD5 of their MD5s (each part's
    ETag), then "-" and their count. None if a part's ETag is no MD5 (a store that encrypts with KMS)."""
    try:
        md5s = b"".join(bytes.fromhex(p["ETag"].strip('"')) for p in parts)
    except ValueError:
        return None
    if len(md5s) != 16 * len(parts):
        return None
    return f"{hashlib.md5(md5s, usedforsecurity=False).hexdigest()}-{len(parts)}"


async def s3_etag_if_made_of(fs, path: str, size: int, parts: list[dict]) -> str | None:
    """The ETag of `path` if the store holds the `size`-byte object a complete of `parts` made (one
    HEAD; a checkpoint's bytes are not read back), else None."""
    expect = multipart_etag(parts)
    if expect is None:
        return None
    bucket, key, _ = fs.split_path(path)
    try:
        r = await fs._call_s3("head_object", Bucket=bucket, Key=key)
    except FileNotFoundError:
        return None
    etag = r.get("ETag") or ""
    return etag if etag.strip('"') == expect and r.get("ContentLength") == size else None


async def _body(r: dict, most: int, path: str) -> bytes:
    """The body of GET answer `r`, counted as it arrives: OSError as soon as more than `most` bytes
    came (what the request's range and the answer's Content-Range allow). A store that lies (a range
    answered "bytes 0-99/100" with 300 MiB) costs at most `most` + one chunk, never the body it sends."""
    parts: list[bytes] = []
    size = 0
    async with r["Body"] as body:
        while chunk := await body.read(min(BODY_CHUNK, most + 1 - size)):
            size += len(chunk)
            if size > most:
                raise OSError(
                    f"s3://{path}: the store sent more than the {most} bytes it answered for; not read"
                )
            parts.append(chunk)
    return b"".join(parts)


BODY_CHUNK = 1 << 20


def _whole_size(r: dict) -> int:
    """The whole object's size from a ranged GET's answer: its Content-Range, "bytes A-B/SIZE" (none:
    the answer is the whole object)."""
    content_range = r.get("ContentRange") or ""
    return int(content_range.rsplit("/", 1)[1]) if "/" in content_range else int(r["ContentLength"])


async def s3_get(fs, path: str, most: int) -> tuple[bytes, str | None, int]:
    """(bytes, ETag, size) of `path` in one GET of at most `most` + 1 bytes; an object over `most`
    bytes is not read at all (its size says so: b"" is returned with it). The range's answer names the
    whole object's size (Content-Range) before its body is read, so the bound costs no HEAD."""
    bucket, key, _ = fs.split_path(path)
    try:
        r = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes=0-{most}")
    except OSError as e:
        if _error_code(e) == "InvalidRange":  # any range of an empty object (416)
            head = await fs._call_s3("head_object", Bucket=bucket, Key=key)
            return b"", head.get("ETag"), 0
        raise
    size = _whole_size(r)
    if size > most:
        r["Body"].close()
        return b"", r.get("ETag"), size
    return await _body(r, size, path), r.get("ETag"), size


async def s3_get_checked(fs, path: str, head: int, check: Callable[[bytes, int], None]) -> bytes:
    """`path` whole in two GETs, the second only if `check` lets it be read: the first `head` bytes,
    whose answer names the object's size (Content-Range), go to `check(first, size)`, which raises to
    refuse it unread (a checkpoint whose header promises another size); then the rest, pinned to the
    first answer's ETag (If-Match), so the two halves are one version of the object. A HEAD for the size
    first cost a third request and the header twice."""
    bucket, key, _ = fs.split_path(path)
    try:
        r = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes=0-{head - 1}")
    except OSError as e:
        if _error_code(e) == "InvalidRange":  # any range of an empty object (416)
            check(b"", 0)
            return b""
        raise
    if not r.get("ContentRange") and int(r["ContentLength"]) > head:
        r["Body"].close()  # a store that ignored the range: not read whole before the check
        raise OSError(f"s3://{bucket}/{key}: the store answered a range with the whole object")
    size = _whole_size(r)
    first = await _body(r, min(head, size), path)
    check(first, size)
    if size <= len(first):
        return first
    try:
        r = await fs._call_s3(
            "get_object", Bucket=bucket, Key=key, Range=f"bytes={len(first)}-{size - 1}", IfMatch=r["ETag"]
        )
    except OSError as e:
        if _is_precondition_failure(e):
            raise ConcurrentWriteError(f"{path}: replaced while it was read") from e
        raise
    return first + await _body(r, size - len(first), path)


async def s3_list(fs, path: str) -> list[str]:
    """The names in folder `path` (its objects' and its subfolders'), one request a thousand names.
    A folder with nothing in it is not there: []. (s3fs's ls lists the parent as well then, to tell a
    file of that name: a second request at every listing of a folder a run does not have yet.)"""
    bucket, key, _ = fs.split_path(path)
    prefix = key.rstrip("/") + "/" if key else ""
    names: list[str] = []
    more: dict[str, str] = {}
    while True:
        r = await fs._call_s3("list_objects_v2", Bucket=bucket, Prefix=prefix, Delimiter="/", **more)
        names += [p["Prefix"][len(prefix) :].rstrip("/") for p in r.get("CommonPrefixes", [])]
        names += [o["Key"][len(prefix) :] for o in r.get("Contents", []) if o["Key"] != prefix]
        if not r.get("IsTruncated"):
            return [n for n in names if n]  # "run//x" is no name of the run's
        more = {"ContinuationToken": r["NextContinuationToken"]}


async def s3_tail(fs, path: str, most: int) -> tuple[bytes, int]:
    """(the last `most` bytes of `path`, the offset they start at) in one GET of a suffix range: its
    answer's Content-Range names where the bytes start, so no HEAD for the size first."""
    bucket, key, _ = fs.split_path(path)
    try:
        r = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes=-{most}")
    except OSError as e:
        if _error_code(e) == "InvalidRange":  # any range of an empty object (416)
            return b"", 0
        raise
    content_range = r.get("ContentRange") or ""  # "bytes START-END/SIZE"; none: the whole object
    if not content_range and int(r["ContentLength"]) > most:
        r["Body"].close()  # a store that ignored the range: not read whole past the bound
        raise OSError(f"s3://{bucket}/{key}: the store answered a suffix range with the whole object")
    start = int(content_range.split(" ", 1)[1].split("-", 1)[0]) if content_range else 0
    return await _body(r, most, path), start


async def s3_abort_uploads(
    fs, root: str, log: Callable[[str], None], whose: str = "its writer died"
) -> list[str]:
    bucket, prefix, _ = fs.split_path(root)
    prefix = f"{prefix}/" if prefix else ""
    aborted = []
    page: dict[str, str] = {}
    while True:  # S3 lists at most 1,000 uploads a page
        listing = await fs._call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **page)
        uploads = listing.get("Uploads", [])
        for upload in uploads:
            await fs._call_s3(
                "abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"]
            )
            aborted.append(upload["Key"])
            log(f"aborted an unfinished upload of s3://{bucket}/{upload['Key']} ({whose})")
        if not listing.get("IsTruncated") or not uploads:
            return aborted
        # The markers are positions in the listing's order: valid although those uploads are gone now.
        page = {
            "KeyMarker": listing.get("NextKeyMarker") or uploads[-1]["Key"],
            "UploadIdMarker": listing.get("NextUploadIdMarker") or uploads[-1]["UploadId"],
        }
