"""Audit-fork tasks: copy a checkpoint into branch runs, and compare the branches."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from andrea_core import compare, fork
from andrea_core.checkpoint import CheckpointError
from andrea_core.config import ConfigError
from andrea_core.rundir import RunDir


def branch_specs(branches: list[dict]) -> list[fork.BranchSpec]:
    """Deployment parameters ([{"name": ..., "overrides": {...}, "url": ...}]) as BranchSpecs."""
    if not isinstance(branches, list) or len(branches) < 2:
        raise ConfigError(f"branches: an audit fork needs two or more branches, got {branches!r}")
    specs = []
    for i, b in enumerate(branches):
        if not isinstance(b, dict) or not isinstance(b.get("name"), str) or not b["name"]:
            raise ConfigError(f"branches[{i}]: expected {{name: ..., overrides: {{...}}}}, got {b!r}")
        fork.check_branch_name(b["name"], f"branches[{i}]")
        unknown = set(b) - {"name", "overrides", "url"}
        if unknown:
            raise ConfigError(f"branches[{i}] ({b['name']}): unknown key(s) {', '.join(sorted(unknown))}")
        if not isinstance(b.get("overrides") or {}, dict):
            raise ConfigError(f"branches[{i}] ({b['name']}).overrides: expected a mapping of dotted keys")
        if b.get("url") is not None:
            fork.check_destination(b["url"], f"branches[{i}] ({b['name']}).url")
        specs.append(fork.BranchSpec(b["name"], dict(b.get("overrides") or {}), b.get("url")))
    return specs


@task(name="check-audit-parameters", cache_policy=NO_CACHE)
def check_audit_parameters(
    run_dir: str, branches: list[dict], steps: int, val_sequences: int, report_dir: str | None
) -> None:
    """Refuse bad parameters before anything is written (compare.check_audit)."""
    compare.check_audit(run_dir, branch_specs(branches), steps, val_sequences, report_dir)


@task(name="copy-checkpoint-into-branches", cache_policy=NO_CACHE)
def copy_checkpoint_into_branches(run_dir: str, branches: list[dict], step: int | None = None) -> dict:
    """One branch run directory per spec from the parent's checkpoint at `step` (default: the newest
    valid one), lineage in each run.yaml. The parent only gains a line in forks.jsonl. A fork that was
    already made (same step, same branch names) is not made twice: whatever it left unfinished is
    completed (fork.fork), and `already` says so."""
    logger = get_run_logger()
    specs = branch_specs(branches)
    parent = RunDir(run_dir)
    if step is None:
        newest = parent.newest_valid_checkpoint(warn=logger.warning)
        if newest is None:
            raise CheckpointError(parent.url, "no valid checkpoint to fork from")
        step = newest.step
    names = [s.name for s in specs]
    already = any(r.get("step") == step and r.get("names") == names for r in fork.fork_records(parent))
    urls = fork.fork(parent.url, specs, step)
    for name, url in zip(names, urls, strict=True):
        logger.info(f"branch {name}: {url} (from step {step}{', made before' if already else ''})")
    return {"step": step, "branches": urls, "names": names, "already": already}


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
