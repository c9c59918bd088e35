"""run.yaml (contract): the frozen run config, its lineage and the environment it was created in; and a
run's validated checkpoint weights for the commands that read them (`andrea sample`, `andrea export`).

Takes a RunDir; creating a run (which trains its tokenizer) is train/setup.py's."""

from __future__ import annotations

import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import yaml

from andrea_core.checkpoint import INT32_MAX, Checkpoint, CheckpointError
from andrea_core.config import ConfigError, RunConfig, estimated_n_params, load_yaml, parse_run_config
from andrea_core.document import DocumentError, Field, check
from andrea_core.model_config import ModelConfig
from andrea_core.run.rundir import RUN_YAML, RunDir


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict[str, str]:
    """What bit-exact CPU results depend on besides the thread count (which is in the config): the
    kernels torch picks (its version and the CPU's instruction set) and numpy's random streams."""
    import torch  # here only: reading a run's record (lineage, gc) needs no torch

    return {
        "torch": str(torch.__version__),
        "numpy": str(np.__version__),
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


@dataclass
class RunRecord:
    config: RunConfig
    lineage: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, str] = field(default_factory=dict)

    def to_yaml(self) -> str:
        doc = {**self.config.to_dict(), "lineage": self.lineage, "environment": self.environment}
        return yaml.safe_dump(doc, sort_keys=False)


# What readers of a lineage rely on (fork points, retention, compare): a forged or damaged run.yaml is
# refused here, naming the field, not deep inside one of them. Other lineage keys are left alone.
def _optional(*types: type, **bounds: float) -> Field:
    return Field(types, null=True, required=False, **bounds)


LINEAGE_SCHEMA: dict[str, Field] = {
    "parent": _optional(str),
    "parent_step": _optional(int, low=0, high=INT32_MAX),  # a checkpoint's step is an int32
    "branch": _optional(str),
    "overrides": _optional(dict),
    "created_at": _optional(int, float),
    # A fork's replicates (lineage.branch_of checks replicate < replicates and the branch's name).
    "replicates": Field((int,), required=False, low=1, high=64),
    "replicate": Field((int,), required=False, low=0, high=63),
}
# run.yaml's own sections beside the config's (config.py checks those): each a mapping (null: empty).
RECORD_SCHEMA: dict[str, Field] = {
    "lineage": Field((dict,), kind="a mapping", fields=LINEAGE_SCHEMA),
    "environment": Field((dict,), kind="a mapping"),
}


def read_run(run: RunDir) -> RunRecord:
    source = run.path(RUN_YAML)
    raw = load_yaml(run.read_text(RUN_YAML), source)
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: not a mapping")
    record = {key: raw.pop(key, None) or {} for key in RECORD_SCHEMA}
    try:
        check(record, RECORD_SCHEMA)
    except DocumentError as e:
        raise ConfigError(f"{source}: {e}") from None
    return RunRecord(parse_run_config(raw, source), record["lineage"], record["environment"])


def config_differences(a: RunConfig, b: RunConfig) -> list[str]:
    """Dotted names of the fields where two configs differ."""

    def flat(d: dict, prefix: str = "") -> dict[str, Any]:
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    fa, fb = flat(a.to_dict()), flat(b.to_dict())
    return sorted(k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k))


def open_run(url: str) -> tuple[RunDir, RunRecord]:
    """The run directory at `url` and its run.yaml; ConfigError naming it when there is no run there."""
    run = RunDir(url)
    if not run.exists(RUN_YAML):
        raise ConfigError(f"{run.url}: not a run directory (no {RUN_YAML})")
    return run, read_run(run)


def run_n_params(record) -> int:
    """The parameter count of a run's model, by arithmetic (config.estimated_n_params, equal to
    GPT(...).n_params for every shape: tests/test_model.py), so that readers need no torch."""
    return estimated_n_params(record.config.model)


@dataclass
class RunWeights:
    run: RunDir
    record: RunRecord
    checkpoint: Checkpoint

    @property
    def model_config(self) -> ModelConfig:
        return self.record.config.model


def read_weights(url: str, step: int | None = None, warn: Callable[[str], None] | None = None) -> RunWeights:
    """The checkpoint of `step` (default: the newest valid one) of the run at `url`, validated against
    the run's model; CheckpointError naming the file and the problem when it cannot be used."""
    run, record = open_run(url)
    n_params = run_n_params(record)
    if step is not None:
        return RunWeights(run, record, run.read_checkpoint(step, n_params))
    ckpt = run.newest_valid_checkpoint(n_params, warn=warn)
    if ckpt is None:
        found = len(run.checkpoint_steps())
        why = f"all {found} checkpoint(s) fail validation" if found else "no checkpoint yet"
        raise CheckpointError(run.url, f"no valid checkpoint ({why})")
    return RunWeights(run, record, ckpt)
