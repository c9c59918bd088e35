"""The parent run of the guard's tests (test_guard_rules, test_guard_continuity): andrea-tiny on one
intra-op thread (tests/tiny.py) trained to step 300, checkpoints 100, 200, 300, built once per test
session (conftest.built_once). The shape of conftest's tiny_reference on tests/tiny.py's config (500 kB
a source, so its data and bytes are its own)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import andrea, built_once
from tiny import tiny_config


@pytest.fixture(scope="session", name="guard_parent")
def guard_parent_fixture(tmp_path_factory) -> Path:
    def build(folder: Path) -> dict:
        cfg = tiny_config(folder, train__checkpoint_every=100, train__log_every=100, train__max_steps=300)
        andrea("train", "--config", cfg, "--run-dir", str(folder / "run"), "--device", "cpu")
        return {}

    return built_once(tmp_path_factory, "guard-parent", build)[0] / "run"
