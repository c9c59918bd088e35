"""Audit-fork tasks: copy a checkpoint into branch runs, and compare the branches."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, ConfigDict, Field, field_validator

from andrea_core.checkpoint import CheckpointError
from andrea_core.config import ConfigError
from andrea_core.ops import compare, fork
from andrea_core.run.rundir import RunDir


class Branch(BaseModel):
    """One branch of an audit fork, as the `audit-fork` flow takes it: Prefect validates a run's
    parameters against this model when the run is submitted (a deployment run) or called, and the UI
    renders it as a form."""

    model_config = ConfigDict(extra="forbid")  # a misspelled key is an error, not a silently default branch

    # The pattern travels in the parameter schema (the server checks it at submission); the validator
    # gives a direct call fork.check_branch_name's own words. One rule: fork.BRANCH_NAME_RE.
    name: str = Field(
        json_schema_extra={"pattern": fork.BRANCH_NAME_SCHEMA},
        description="letters, digits, '-', '_' and '.' (not first), at most 100 characters: it becomes "
        "part of the branch's path",
    )
    overrides: dict[str, Any] = Field(
        default_factory=dict, description='dotted run-config keys, e.g. {"train.lr": 3e-4}'
    )
    url: str | None = Field(default=None, description='default: beside the parent, "<run>-fork<step>-<name>"')

    @field_validator("name")
    @classmethod
    def _allowed_name(cls, name: str) -> str:
        return fork.check_branch_name(name)


def branch_specs(branches: list[Branch]) -> list[fork.BranchSpec]:
    """The flow's validated branches as andrea_core's BranchSpecs (the one conversion, at the flow)."""
    if len(branches) < 2:
        raise ConfigError(f"branches: an audit fork needs two or more branches, got {branches!r}")
    for i, b in enumerate(branches):
        if b.url is not None:
            fork.check_destination(b.url, f"branches[{i}] ({b.name}).url")
    return [fork.BranchSpec(b.name, dict(b.overrides), b.url) for b in branches]


@task(name="check-audit-parameters", cache_policy=NO_CACHE)
def check_audit_parameters(
    run_dir: str,
    branches: list[fork.BranchSpec],
    steps: int,
    val_sequences: int,
    report_dir: str | None,
    replicates: int = fork.DEFAULT_REPLICATES,
) -> None:
    """Refuse bad parameters before anything is written (compare.check_audit)."""
    fork.check_replicates(replicates)
    compare.check_audit(run_dir, branches, steps, val_sequences, report_dir)


@task(name="copy-checkpoint-into-branches", cache_policy=NO_CACHE)
def copy_checkpoint_into_branches(
    run_dir: str, specs: list[fork.BranchSpec], step: int | None = None, replicates: int = 1
) -> dict:
    """`replicates` run directories per spec from the parent's checkpoint at `step` (default: the
    newest valid one), lineage in each run.yaml; `branches`, `names` and `of` (its branch) list every
    run. The parent only gains a line in forks.jsonl. A fork that was already made (same step, same
    branch names) is not made twice: whatever it left unfinished is completed (fork.fork), and
    `already` says so."""
    logger = get_run_logger()
    parent = RunDir(run_dir)
    if step is None:
        newest = parent.newest_valid_checkpoint(warn=logger.warning)
        if newest is None:
            raise CheckpointError(parent.url, "no valid checkpoint to fork from")
        step = newest.step
    names = [fork.replicate_label(s.name, r) for s in specs for r in range(replicates)]
    already = any(r.get("step") == step and r.get("names") == names for r in fork.fork_records(parent))
    urls = fork.fork(
        parent.url,
        specs,
        step,
        log=lambda m: (logger.warning if m.startswith("warning") else logger.info)(m),
        replicates=replicates,
    )
    for name, url in zip(names, urls, strict=True):
        logger.info(f"branch {name}: {url} (from step {step}{', made before' if already else ''})")
    of = [s.name for s in specs for _ in range(replicates)]  # each run's branch
    return {"step": step, "branches": urls, "names": names, "of": of, "already": already}


def trained_to(url: str) -> int | None:
    """The newest checkpoint step of a branch (valid or not: its trainer decides on resume)."""
    steps = RunDir(url).checkpoint_steps()
    return steps[-1] if steps else None


@task(name="compare-branches", cache_policy=NO_CACHE)
def compare_branches(
    run_dir: str, branch_urls: list[str], fork_step: int, val_sequences: int, failed: dict[str, str]
) -> compare.Comparison:
    """Score every branch on the same held-out batches per arm and name the one that converges."""
    logger = get_run_logger()
    result = compare.compare_branches(
        run_dir, branch_urls, fork_step, val_sequences=val_sequences, failed=failed, warn=logger.warning
    )
    logger.info(result.verdict)
    return result
