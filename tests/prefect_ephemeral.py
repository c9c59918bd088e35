"""Prefect's ephemeral mode for flow tests run in this process (a temporary local server Prefect starts
itself), with a home of its own and a start-up timeout for a loaded machine."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ephemeral_prefect(tmp_path_factory):
    from prefect.logging.handlers import APILogWorker
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_HOME,
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
        temporary_settings,
    )

    home = str(tmp_path_factory.mktemp("prefect-home"))
    updates = {PREFECT_HOME: home, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: 600}
    with temporary_settings(updates=updates, restore_defaults={PREFECT_API_URL}):
        try:
            yield
        finally:
            # Prefect keeps one temporary server a process (port None) until the process exits: stopped
            # here, the next module of this worker gets its own (its own home and database), and the
            # server's "Stopping" line is not logged at exit to a stream pytest has closed (CI's
            # "--- Logging error --- ... I/O operation on closed file").
            APILogWorker.drain_all(timeout=30)  # the flows' logs sent while the server still answers
            SubprocessASGIServer().stop()
