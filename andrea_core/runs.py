"""run.yaml (contract): the frozen run config, its lineage and the environment it was created in."""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import yaml

from andrea_core.config import ConfigError, RunConfig, load_yaml, parse_run_config
from andrea_core.data.policy import Policy, load_policy, parse_policy
from andrea_core.data.tokens import BPETokenizer, new_run_tokenizer
from andrea_core.rundir import POLICY_YAML, RUN_YAML, TOKENIZER_JSON, RunDir


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
# refused here, naming the field, not deep inside one of them.
LINEAGE_TYPES: dict[str, tuple[type, ...]] = {
    "parent": (str,),
    "parent_step": (int,),
    "branch": (str,),
    "overrides": (dict,),
    "created_at": (int, float),
}


def read_run(run: RunDir) -> RunRecord:
    source = run.path(RUN_YAML)
    raw = load_yaml(run.read_text(RUN_YAML), source)
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: not a mapping")
    lineage = raw.pop("lineage", None) or {}
    env = raw.pop("environment", None) or {}
    for key, value in (("lineage", lineage), ("environment", env)):
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key}: expected a mapping, got {type(value).__name__}")
    for key, types in LINEAGE_TYPES.items():
        value = lineage.get(key)
        if value is not None and (not isinstance(value, types) or isinstance(value, bool)):
            want = " or ".join(t.__name__ for t in types)
            raise ConfigError(f"{source}: lineage.{key}: expected {want} or null, got {type(value).__name__}")
    if lineage.get("parent_step") is not None and lineage["parent_step"] < 0:
        raise ConfigError(f"{source}: lineage.parent_step: must be >= 0, got {lineage['parent_step']}")
    return RunRecord(parse_run_config(raw, source), lineage, env)


def create_run(
    run: RunDir,
    cfg: RunConfig,
    policy_text: str | None = None,
    lineage: dict | None = None,
    tokenizer: bytes | None = None,
) -> RunRecord:
    """Freeze `cfg` into a new run directory and install its data policy and, for a BPE run, its
    tokenizer: `tokenizer` (a fork keeps its parent's) or one trained now on the policy's sources."""
    if run.exists(RUN_YAML):
        raise ConfigError(f"{run.url} already holds a run ({RUN_YAML} exists)")
    if policy_text is None:
        policy, policy_text = load_policy(cfg.data.policy)
    else:
        policy = parse_policy(load_yaml(policy_text, "policy"), "policy")
    if cfg.data.tokenizer != "bytes":
        if tokenizer is None:
            tokenizer = new_run_tokenizer(policy, cfg)  # before any write: a failure leaves no half-made run
        vocab = BPETokenizer(tokenizer).vocab_size
        if vocab > cfg.model.vocab_size:
            raise ConfigError(f"{run.url}: a tokenizer of {vocab} tokens exceeds model.vocab_size")
    record = RunRecord(
        cfg,
        {"parent": None, "parent_step": None, "created_at": time.time(), **(lineage or {})},
        environment(),
    )
    run.makedirs()
    if cfg.data.tokenizer != "bytes":
        run.write_atomic(TOKENIZER_JSON, tokenizer)
    run.write_text(POLICY_YAML, policy_text)
    run.write_text(RUN_YAML, record.to_yaml())
    return record


def read_policy(run: RunDir) -> Policy:
    source = run.path(POLICY_YAML)
    return parse_policy(load_yaml(run.read_text(POLICY_YAML), source), source)


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
