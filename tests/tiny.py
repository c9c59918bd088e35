"""andrea-tiny with overrides, written as a config file for the trainer's --config."""

from __future__ import annotations

from pathlib import Path

import yaml

from andrea_core.config import load_run_config
from tests.conftest import TINY


def tiny_config(folder: Path, name: str = "andrea-tiny-1t", **overrides) -> str:
    """500 kB of text per arm: a pivot to a policy with new arms tokenizes them first, in the test's
    time. One intra-op thread, as the andrea-tiny configs now say themselves (two spin-wait on each other
    on a small shared machine: 37 ms/step with one, 264 with two, measured here)."""
    defaults = {"train.num_threads": 1, "data.max_source_bytes": 500_000}
    overrides = {**defaults, **{k.replace("__", "."): v for k, v in overrides.items()}}
    cfg = load_run_config(TINY).with_overrides(overrides, "tests/tiny.py")
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return str(path)
