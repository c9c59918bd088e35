"""A real S3-compatible server for the tests and the benchmark: moto's server mode in its own process on
127.0.0.1, reached through s3fs exactly as a real store is (endpoint and credentials from the
environment, so that trainer subprocesses reach it too). Nothing in the filesystem layer is mocked.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

MOTO_S3 = Path(__file__).with_name("moto_s3.py")
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "andrea-test",
    "AWS_SECRET_ACCESS_KEY": "andrea-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class S3Server:
    proc: subprocess.Popen
    port: int

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """What a process needs to reach this server through fsspec/s3fs (fsspec reads FSSPEC_S3_*)."""
        return {**CREDENTIALS, "FSSPEC_S3_ENDPOINT_URL": endpoint or self.endpoint}

    def use_in_this_process(self) -> None:
        """Point this process's s3fs at the server: fsspec read FSSPEC_S3_* when it was imported."""
        import fsspec.config

        os.environ.update(self.env())
        fsspec.config.conf.setdefault("s3", {})["endpoint_url"] = self.endpoint

    def client(self, **options):
        """A fresh s3fs client (no listing cache: other processes write to the same buckets), on this
        process's one botocore session: a session of its own parses botocore's endpoint and S3 models
        again (0.07-0.13 CPU-s a client, 0.005 on a shared session)."""
        import s3fs

        return s3fs.S3FileSystem(
            endpoint_url=self.endpoint,
            key=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            secret=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            use_listings_cache=False,
            skip_instance_cache=True,
            session=_botocore_session(),
            **options,
        )

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_s3_server(
    timeout: float = 60, server: list[str] | None = None, log: Path | None = None
) -> S3Server:
    """Start moto's server with atomic conditional writes (moto_s3.py; or `server`, a command line to
    which -H and -p are added) on a free 127.0.0.1 port and wait until it answers. `log`: a file for
    its output, one line a request (bench/s3_requests.py counts them)."""
    for _ in range(3):  # the port is free when picked; another process may take it before moto binds
        port = free_port()
        out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115 (the child's)
        proc = subprocess.Popen(
            [*(server or [sys.executable, str(MOTO_S3)]), "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=out,
        )
        if log is not None:
            out.close()  # the child holds its own copy
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=2).close()
                return S3Server(proc, port)
            except OSError:
                time.sleep(0.05)
        proc.kill()
        proc.wait()
    raise RuntimeError("moto S3 server did not start on 127.0.0.1")


_sessions: dict[int, object] = {}


def _botocore_session():
    """This process's aiobotocore session (a forked child makes its own)."""
    import aiobotocore.session

    if os.getpid() not in _sessions:
        _sessions[os.getpid()] = aiobotocore.session.AioSession()
    return _sessions[os.getpid()]


class ThrottledLink:
    """A TCP relay in front of the server that passes at most `rate` bytes per second per connection
    and direction: a slow network link, so that an upload stays in flight long enough to be observed
    and interrupted (`rate` 0: unthrottled). Bytes are relayed unchanged; `sent` counts those the
    clients sent to the server (bench/append_publish.py), `received` those the relay took from it.
    `pause` holds every byte in both directions until `resume` (a partitioned network: the client's
    requests stay in flight, unanswered)."""

    def __init__(self, target_port: int, rate: float, chunk: int = 64 * 1024):
        self.target_port = target_port
        self.rate = rate
        self.chunk = chunk
        self.sent = self.received = 0
        self._counting = threading.Lock()
        self._open = threading.Event()
        self._open.set()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            for src, dst, to_server in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pump, args=(src, dst, to_server), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, to_server: bool) -> None:
        try:
            while data := src.recv(self.chunk):
                self._open.wait()
                with self._counting:
                    if to_server:
                        self.sent += len(data)
                    else:
                        self.received += len(data)
                dst.sendall(data)
                if self.rate:
                    time.sleep(len(data) / self.rate)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def pause(self) -> None:
        self._open.clear()

    def resume(self) -> None:
        self._open.set()

    def close(self) -> None:
        self.closed = True
        self._open.set()
        self.listener.close()
