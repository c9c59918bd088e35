"""One real Prefect server per test worker (issue 45.3): `prefect server start --host 127.0.0.1` on a free
port, its PREFECT_HOME and database in the worker's temporary folder, started by the first module of
that worker that needs it (tests/conftest.py's session fixture `prefect_server`) and stopped at the
session's end. Modules whose flows run in this process take it through `ephemeral_prefect` (the name of
the ephemeral mode it replaces: the same API, one database start a worker, not one a module); the
deployment modules (tests/test_prefect_flows.py's Stack) add a worker of their own to it.

A module must not count on an empty server: every test filters by its own deployment, flow-run ids or
run directory."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PREFECT = str(Path(sys.executable).parent / "prefect")
REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PrefectServer:
    """A live server: its home, API and UI addresses, the environment of a process that talks to it."""

    home: Path
    port: int
    process: subprocess.Popen
    start_s: float  # start to healthy
    # What a module's Stack set up on it (tests/test_prefect_flows.py): prefect_setup.py's and
    # `prefect deploy --all`'s output, for a later module of this worker to reuse.
    deployed: dict[str, str] = field(default_factory=dict)

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    @property
    def ui(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        return {**os.environ, **server_env(self.home), "PREFECT_API_URL": self.api}

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def server_env(home: Path) -> dict[str, str]:
    return {
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        # The GPU slots' leases on disk: a flow-run process killed outright leaves its lease to run out.
        "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": "prefect.server.concurrency.lease_storage.filesystem",
        # The server's loop services that no test uses, off: late runs and pause expirations (no test
        # schedules or pauses a run), the scheduler (the audit fork's schedule is read, never due),
        # the foreman (workers are checked ONLINE, never marked offline), the cleanup reconciler (the
        # worker channel's cleanup queue) and the database vacuum. Kept: triggers (the crash
        # automation), the event persister and task run recorder (events, heartbeats and task runs
        # read back), the repossessor (a dead flow run's GPU slot lease runs out) and the cancellation
        # cleanup. An idle server: 1.7-2.2 % of a core with them all.
        **{
            f"PREFECT_SERVER_SERVICES_{name}_ENABLED": "false"
            for name in ("LATE_RUNS", "PAUSE_EXPIRATIONS", "SCHEDULER", "FOREMAN", "CLEANUP_RECONCILER")
        },
        "PREFECT_SERVER_SERVICES_DB_VACUUM_ENABLED": "[]",
    }


def start_prefect_server(home: Path, log: Path, timeout: float = 240) -> PrefectServer:
    """A server on a free port of 127.0.0.1, healthy (its database migrated) when this returns."""
    import httpx

    log.parent.mkdir(parents=True, exist_ok=True)
    port = free_port()
    t0 = time.monotonic()
    process = subprocess.Popen(
        [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        # Its own address as the UI's API (PREFECT_UI_API_URL follows it): else the UI asks :4200.
        env={**os.environ, **server_env(home), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"},
        cwd=REPO,
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
    )
    server = PrefectServer(home, port, process, 0.0)
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{server.api}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise AssertionError(f"the Prefect server did not become healthy:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    server.start_s = time.monotonic() - t0
    return server


@pytest.fixture(scope="module")
def ephemeral_prefect(prefect_server):
    """This process's flows talk to the worker's shared server while the module runs."""
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    settings = {PREFECT_API_URL: prefect_server.api, PREFECT_HOME: str(prefect_server.home)}
    with temporary_settings(updates=settings):
        try:
            yield prefect_server
        finally:
            APILogWorker.drain_all(timeout=30)  # the flows' logs sent while this module's settings hold
