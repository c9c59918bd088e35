"""Prefect's ephemeral mode for flow tests run in this process (a temporary local server Prefect starts
itself), with a home of its own and a start-up timeout for a loaded machine."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ephemeral_prefect(tmp_path_factory):
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_HOME,
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
        temporary_settings,
    )

    home = str(tmp_path_factory.mktemp("prefect-home"))
    updates = {PREFECT_HOME: home, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: 600}
    with temporary_settings(updates=updates, restore_defaults={PREFECT_API_URL}):
        yield
