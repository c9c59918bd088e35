"""The parent run of the guard's tests (test_guard, test_guard_rules, test_guard_continuity, test_mlflow):
andrea-tiny on one intra-op thread (tests/tiny.py) trained to step 300, checkpoints 100, 200, 300: the
library's run of that recipe (conftest.library_run, 300 steps, `--device cpu`), which test_object_store's
bit-exact S3 resume reads too, so the session trains it once for all of them. The shape of conftest's
tiny_reference on tests/tiny.py's config (500 kB a source, so its data and bytes are its own)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import library_run


@pytest.fixture(scope="session", name="guard_parent")
def guard_parent_fixture(tmp_path_factory) -> Path:
    """This worker's copy of the library's run (read it; copy it before changing anything)."""
    return library_run(
        tmp_path_factory, tmp_path_factory.mktemp("guard-parent") / "run", 300, "--device", "cpu"
    )
