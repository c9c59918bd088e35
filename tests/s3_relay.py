"""An HTTP relay in front of the tests' moto server that makes the store slow, throttled, hung,
partitioned from one host, or loses replies (issue 48, item 3): bench/soak.py's S3 faults and the
object-store tests that need a real transport fault.

Every fault is one the store or the network really makes, applied to the real requests of real clients
(s3fs through FSSPEC_S3_ENDPOINT_URL), and counted so that a soak can show it did what it claims:

- a lost PUT reply (`armed`): the put is forwarded and committed, its reply dropped (the connection
  closed): the client sees a reply lost after the write, and retries;
- a lost CompleteMultipartUpload reply (`lost_complete`): the complete is applied by the server, the
  relay reads the object back (it exists, with the ETag the dropped reply named) and drops the reply;
  the SDK's identical retry is then forwarded (moto answers a complete of a completed upload 200: its
  idempotent case) or, with retry "gone", answered 404 NoSuchUpload, as S3 answers once it has
  forgotten the completed upload: the writer must find out that the object is its own;
- latency (`latency`): every request held a drawn time before it is forwarded;
- 503 SlowDown (`slowdown`): a fraction of requests answered 503 SlowDown, not forwarded (S3 throttles
  before it applies anything);
- a hang (`hang`): the next request matching a pattern (of one host) held for a time, then forwarded:
  a request in flight past the lease's ttl that still lands;
- a partition (`partition`): every request of one host, reads included, refused (the connection closed
  unanswered) or held until the partition heals and then delivered late, while other hosts reach the
  store.

A host is a relay endpoint: each "machine" of a test gets its own (`Relay(faults, host=...)`), all
sharing one `RelayFaults`. Binds 127.0.0.1 only.
"""

from __future__ import annotations

import http.client
import http.server
import random
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class RelayFaults:
    """What the relays of one store do, and what they did (counted under `lock`)."""

    armed: str | None = None  # a key substring: the next PUT of it has its reply dropped
    dropped: list[tuple[float, str, int]] = field(default_factory=list)  # (when, path, status)
    # {"key": substring, "retry": "idempotent" | "gone"}: the next complete of it has its reply dropped
    lost_complete: dict | None = None
    completes_lost: list[dict] = field(default_factory=list)  # one record a dropped Complete reply
    latency: tuple[float, float] | None = None  # (least, most) seconds before each request is forwarded
    delays: list[float] = field(default_factory=list)
    slowdown: float = 0.0  # the fraction of requests answered 503 SlowDown
    throttled: Counter = field(default_factory=Counter)  # by method
    hang: dict | None = None  # {"host", "match" (a regular expression on "METHOD path?query"), "for_s",
    # and optionally "until": a threading.Event that ends the hold before for_s}
    hung: list[dict] = field(default_factory=list)
    partition: dict | None = None  # {"host", "mode": "refuse" | "hang"}
    partitioned: Counter = field(default_factory=Counter)  # "mode METHOD" -> requests cut off
    late: Counter = field(default_factory=Counter)  # held by a partition, delivered after it: status
    healed: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    # The object's ETag as the store holds it now, or None (a client of the relay's owner: the server may
    # check signatures); None here: an unsigned HEAD (moto without IAM checks).
    head: Callable[[str], str | None] | None = None

    def __post_init__(self) -> None:
        self.healed.set()
        self._gone: dict[str, dict] = {}  # upload id -> its record: retries answered NoSuchUpload

    def cut_off(self, host: str, mode: str) -> None:
        with self.lock:
            self.healed.clear()
            self.partition = {"host": host, "mode": mode}

    def heal(self) -> None:
        with self.lock:
            self.partition = None
            self.healed.set()


_SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message><RequestId>relay</RequestId></Error>"
)


def _no_such_upload(upload_id: str) -> bytes:
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>NoSuchUpload</Code><Message>The specified '
        "upload does not exist. The upload ID may be invalid, or the upload may have been aborted or "
        f"completed.</Message><UploadId>{upload_id}</UploadId><RequestId>relay</RequestId></Error>"
    ).encode()


class Relay(http.server.ThreadingHTTPServer):
    """One host's endpoint of the relay in front of the server on `upstream_port`."""

    daemon_threads = True

    def __init__(self, upstream_port: int, faults: RelayFaults | None = None, host: str = ""):
        self.upstream_port = upstream_port
        self.faults = faults or RelayFaults()
        self.host = host
        super().__init__(("127.0.0.1", 0), _Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client killed mid-request: normal here
            super().handle_error(request, client_address)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # An answer's headers and body leave in one write (buffered, flushed at the end): written apart,
    # a small body waits on the client's delayed ACK (Nagle), 40 ms a reply (a listing: 51 ms, 12 direct).
    wbufsize = -1
    disable_nagle_algorithm = True
    server: Relay

    def handle_expect_100(self) -> bool:
        ok = super().handle_expect_100()
        self.wfile.flush()  # buffered above: a client waiting for its 100 Continue would wait forever
        return ok

    def log_message(self, *args) -> None:
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            raw = b""
            while True:
                line = self.rfile.readline()
                raw += line
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while True:  # trailers, then the blank line
                        t = self.rfile.readline()
                        raw += t
                        if t in (b"\r\n", b"\n", b""):
                            return raw
                raw += self.rfile.read(size + 2)
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _upstream(self, method: str, path: str, body: bytes = b"", headers=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.server.upstream_port, timeout=120)
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        for k, v in headers if headers is not None else self.headers.items():
            conn.putheader(k, v)
        if headers is not None:
            conn.putheader("Host", f"127.0.0.1:{self.server.upstream_port}")
        conn.endheaders(body or None)  # with the headers: apart, the body would wait on an ACK too
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        return resp, data

    def _answer(self, status: int, reason: str, headers: list[tuple[str, str]], data: bytes) -> None:
        self.send_response_only(status, reason)
        for k, v in headers:
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(k, v)
        if self.command == "HEAD":
            self.send_header(
                "Content-Length", dict((k.lower(), v) for k, v in headers).get("content-length", "0")
            )
        else:
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _error(self, status: int, reason: str, xml: bytes) -> None:
        self._answer(status, reason, [("Content-Type", "application/xml")], xml)

    def _relay(self) -> None:
        body = self._body()
        st, host = self.server.faults, self.server.host
        key, _, query = self.path.partition("?")
        what = f"{self.command} {self.path}"
        complete = self.command == "POST" and "uploadId=" in query
        upload_id = m.group(1) if (m := re.search(r"uploadId=([^&]+)", query)) else ""

        with st.lock:
            part = st.partition if st.partition and st.partition["host"] == host else None
            if part:
                st.partitioned[f"{part['mode']} {self.command}"] += 1
        if part and part["mode"] == "refuse":
            self.close_connection = True  # the connection closed unanswered: nothing reached the store
            return
        if part:  # held until the partition heals, then delivered late
            st.healed.wait()
        with st.lock:
            hang = (
                st.hang if st.hang and st.hang["host"] == host and re.search(st.hang["match"], what) else None
            )
            if hang:
                st.hang = None
                st.hung.append({"what": what, "for_s": hang["for_s"], "at": time.time()})
            gone = st._gone.get(upload_id) if complete else None
            if gone is not None:
                gone["retries"].append(404)
            # The writer's read back (objstore._failed), after its retry was answered NoSuchUpload: counted
            # once, and the upload then forgotten by the relay too.
            if self.command in ("GET", "HEAD"):
                for uid, r in list(st._gone.items()):
                    if r["key"] == key and r["retries"]:
                        r["read_back"] += 1
                        del st._gone[uid]
            throttle = st.slowdown and st.rng.random() < st.slowdown
            if throttle:
                st.throttled[self.command] += 1
            delay = st.rng.uniform(*st.latency) if st.latency else 0.0
            if delay:
                st.delays.append(delay)
        if hang:  # for its for_s, or until its "until" (a threading.Event) is set: the test's next move
            until = hang.get("until")
            until.wait(hang["for_s"]) if until is not None else time.sleep(hang["for_s"])
        if gone is not None:  # S3 once it forgot the completed upload: never forwarded
            self._error(404, "Not Found", _no_such_upload(upload_id))
            return
        if throttle:
            self._error(503, "Slow Down", _SLOWDOWN)
            return
        if delay:
            time.sleep(delay)

        resp, data = self._upstream(self.command, self.path, body)
        if part:
            with st.lock:
                st.late[resp.status] += 1

        with st.lock:
            lose = st.lost_complete if complete and st.lost_complete else None
            lose = lose if lose and lose["key"] in key and resp.status == 200 else None
            if lose:
                st.lost_complete = None
            drop = st.armed is not None and self.command == "PUT" and st.armed in key
            if drop:
                st.dropped.append((time.time(), key, resp.status))
                st.armed = None
        if lose:
            etag = m.group(1) if (m := re.search(rb"<ETag>([^<]*)</ETag>", data)) else b""
            etag = etag.decode().replace("&quot;", '"').strip('"')
            if st.head is not None:
                held = st.head(key.lstrip("/").split("/", 1)[1])
            else:
                head, _ = self._upstream("HEAD", key, headers=[])
                held = (head.getheader("ETag") or "").strip('"') if head.status == 200 else None
            rec = {
                "at": time.time(),
                "key": key,
                "upload_id": upload_id,
                "retry": lose["retry"],
                "etag": etag,
                "held": held == etag,  # the object exists, made by the complete whose reply is dropped
                "retries": [],
                "read_back": 0,
            }
            with st.lock:
                st.completes_lost.append(rec)
                if lose["retry"] == "gone":
                    st._gone[upload_id] = rec
        if drop or lose:
            self.close_connection = True
            return
        if complete and not lose:
            with st.lock:
                for r in st.completes_lost:
                    if r["upload_id"] == upload_id:
                        r["retries"].append(resp.status)
        self._answer(resp.status, resp.reason, resp.getheaders(), data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay
