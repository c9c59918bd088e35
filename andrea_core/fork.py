"""Audit forks: copy one checkpoint of a run into branch run directories with their own configs.

A fork never writes into the parent except one line appended to its forks.jsonl: the parent's
checkpoints and sidecars stay byte-identical.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from andrea_core.checkpoint import CheckpointError, checkpoint_name, encode
from andrea_core.config import ConfigError
from andrea_core.data.policy import load_policy
from andrea_core.loss_log import json_lines
from andrea_core.rundir import FORKS, LOSS_LOG, RUN_YAML, STATE, TOKENIZER_JSON, RunDir
from andrea_core.runs import create_run, read_run


@dataclass
class BranchSpec:
    name: str
    overrides: dict[str, Any] = field(default_factory=dict)  # dotted run-config keys: {"train.lr": 1e-3}
    url: str | None = None  # default: beside the parent, "<parent>-<name>"


def default_branch_url(parent: RunDir, step: int, name: str) -> str:
    return f"{parent.url.rstrip('/')}-fork{step}-{name}"


def fork(parent_url: str, branches: list[BranchSpec], step: int | None = None) -> list[str]:
    """Create one branch run directory per spec from the parent's checkpoint at `step` (default:
    newest valid). Returns the branch URLs. Everything is validated before the first write."""
    parent = RunDir(parent_url)
    record = read_run(parent)
    n_params = run_n_params(record)
    # Read once (a 1.44 GB download on an object store) and validated (raises naming the file).
    ckpt = (
        parent.newest_valid_checkpoint(n_params) if step is None else parent.read_checkpoint(step, n_params)
    )
    if ckpt is None:
        raise CheckpointError(parent.url, "no valid checkpoint to fork from")
    step, data = ckpt.step, encode(ckpt.step, ckpt.flat)  # the file's bytes: header + floats
    if len({b.name for b in branches}) != len(branches) or len(branches) < 1:
        raise ConfigError(
            f"fork of {parent.url}: branch names must be unique, got {[b.name for b in branches]}"
        )

    plans = []
    for spec in branches:
        cfg = record.config.with_overrides(spec.overrides, f"branch {spec.name!r}")
        if cfg.model != record.config.model or cfg.data.tokenizer != record.config.data.tokenizer:
            raise ConfigError(
                f"branch {spec.name!r}: a fork cannot change the model architecture or tokenizer"
            )
        branch = RunDir(spec.url or default_branch_url(parent, step, spec.name))
        if branch.exists(RUN_YAML):
            raise ConfigError(f"branch {spec.name!r}: {branch.url} already holds a run")
        if cfg.data.policy != record.config.data.policy:
            _, policy_text = load_policy(cfg.data.policy)
        else:
            policy_text = parent.read_text("policy.yaml")
        plans.append((spec, cfg, branch, policy_text))

    urls = []
    for spec, cfg, branch, policy_text in plans:
        lineage = {
            "parent": parent.url,
            "parent_step": step,
            "branch": spec.name,
            "overrides": spec.overrides,
        }
        # The weights only mean something with the parent's frozen tokenizer.
        tokenizer = parent.read_bytes(TOKENIZER_JSON) if parent.exists(TOKENIZER_JSON) else None
        create_run(branch, cfg, policy_text, lineage, tokenizer)
        branch.write_atomic(checkpoint_name(step), data)
        # The branch's history starts as the parent's; its own trainer opens a new segment at step+1,
        # which drops whatever the parent logged past the fork point from the branch's canonical view.
        if parent.exists(LOSS_LOG):
            branch.write_atomic(LOSS_LOG, _complete_lines(parent.read_bytes(LOSS_LOG)))
        if parent.exists(STATE) and policy_text == parent.read_text("policy.yaml"):
            branch.write_atomic(STATE, parent.read_bytes(STATE))
        urls.append(branch.url)

    line = {"step": step, "branches": urls, "names": [b.name for b in branches], "time": time.time()}
    parent.append(FORKS, (json.dumps(line) + "\n").encode(), durable=True)
    return urls


def fork_records(run: RunDir, warn: Callable[[str], None] | None = None) -> list[dict]:
    """The well-formed lines of the run's forks.jsonl, in order. A malformed line (torn by a crash,
    junk, the wrong shape) is skipped, and reported through `warn`, like a torn .loss.json line: it
    must not break lineage, retention or the next fork."""
    if not run.exists(FORKS):
        return []
    parsed, bad = json_lines(run.read_bounded(FORKS))
    records = []
    for number, record in parsed:
        if _is_fork_record(record):
            records.append(record)
        else:
            bad.append(number)
    if bad and warn is not None:
        lines = ", ".join(map(str, sorted(bad)))
        warn(f"{run.path(FORKS)}: skipped {len(bad)} malformed line(s): lines {lines}")
    return records


def _is_fork_record(record: Any) -> bool:
    def text(v: Any) -> bool:
        # JSON can escape a lone surrogate (\ud800), which no path or URL can hold.
        return isinstance(v, str) and not any("\ud800" <= c <= "\udfff" for c in v)

    def strings(value: Any) -> bool:
        return isinstance(value, list) and all(text(v) for v in value)

    return (
        isinstance(record, dict)
        and type(record.get("step")) is int
        and record["step"] >= 0
        and strings(record.get("branches"))
        and ("names" not in record or strings(record["names"]))
        and isinstance(record.get("time", 0.0), (int, float))
    )


def _complete_lines(data: bytes) -> bytes:
    return data[: data.rfind(b"\n") + 1]


def run_n_params(record) -> int:
    """The parameter count of a run's model, without allocating it."""
    import torch

    from andrea_core.model import GPT

    with torch.device("meta"):
        return GPT(record.config.model).n_params
