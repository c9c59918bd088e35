"""`audit-fork`: copy one checkpoint of a run into two or more branches with their own config overrides,
train each K steps, compare them on the same held-out data and report which converges.

The parent is never disturbed: the fork reads its checkpoint and appends one line to its forks.jsonl.
The branch trainers hold the GPU's concurrency slot, so a scheduled audit fork waits for (or, after
slot_timeout_s, refuses) a GPU the main run is using instead of silently sharing it.

Every parameter is checked before anything is written. A rerun of the same fork (same step and branch
names) finishes what an earlier run left undone: it completes unfinished branches, trains each branch
that is short of its target, and writes the report. An audit in which no branch could be evaluated ends
Failed, naming each branch's error. A cancelled audit ends as a cancelled `train` run does (flows/train.py),
once the branch in training has checkpointed; a rerun finishes it."""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.states import Completed, Failed, State

from andrea_core.ops.compare import DEFAULT_VAL_SEQUENCES, default_report_dir
from andrea_core.ops.fork import DEFAULT_REPLICATES
from andrea_core.run.rundir import RunDir
from tasks.artifacts import publish_fork_report, run_name
from tasks.fork import (
    Branch,
    branch_specs,
    check_audit_parameters,
    compare_branches,
    copy_checkpoint_into_branches,
    trained_to,
)
from tasks.gpu import holding_gpu_slot
from tasks.trainer import end_cancelled, run_trainer, trainer_outcome


def _flow_run_name() -> str:
    from prefect.runtime import flow_run

    return f"audit-fork-{run_name(flow_run.parameters['run_dir'])}"


@flow(name="audit-fork", flow_run_name=_flow_run_name)
def audit_fork(
    run_dir: str,
    branches: list[Branch],
    steps: int = 200,
    step: int | None = None,
    device: str = "auto",
    pace: float = 0.0,
    gpu_slot: str | None = "auto",
    slot_timeout_s: float | None = 60.0,
    val_sequences: int = DEFAULT_VAL_SEQUENCES,
    report_dir: str | None = None,
    replicates: int = DEFAULT_REPLICATES,
) -> State:
    """Fork `run_dir` at `step` (default: its newest valid checkpoint) into `branches` (tasks.fork.Branch),
    e.g. [{"name": "base"}, {"name": "low-lr", "overrides": {"train.lr": 3e-4}}], train each `steps` steps
    and publish the comparison (markdown report with the plot, and the plot) as artifacts and files
    in `report_dir` (default: beside the parent, "<run>-fork<step>-report"). Each branch is
    `replicates` runs over other data orders: the verdict's training noise (ops/compare.py); 1 trains
    a branch once and names no winner."""
    parent = RunDir(run_dir)
    # A malformed parameter fails here, before anything is written (a misspelled key or a bad branch
    # name earlier still: Prefect validates `branches` against Branch before the flow starts).
    specs = branch_specs(branches)
    check_audit_parameters(parent.url, specs, steps, val_sequences, report_dir, replicates)
    with holding_gpu_slot(gpu_slot, device, slot_timeout_s):
        forked = copy_checkpoint_into_branches(parent.url, specs, step, replicates)
        target = forked["step"] + steps
        report_dir = report_dir or default_report_dir(parent.url, forked["step"])
        short = [u for u in forked["branches"] if (trained_to(u) or 0) < target]
        if forked["already"] and not short and RunDir(report_dir).exists("report.md"):
            return Completed(
                message=f"step {forked['step']} of {parent.url} was already audited: report "
                f"{RunDir(report_dir).path('report.md')}",
                data=forked,
            )
        failed = {}
        for name, branch, url in zip(forked["names"], forked["of"], forked["branches"], strict=True):
            if url not in short:
                get_run_logger().info(f"branch {name} is already trained to step {trained_to(url)}")
                continue
            if branch in failed:  # one run of a branch failed: the branch is out, its others untrained
                get_run_logger().info(f"{name} not trained: branch {branch} failed ({failed[branch]})")
                continue
            outcome = trainer_outcome(
                run_trainer(url, max_steps=target, device=device, pace=pace, return_state=True)
            )
            if outcome.get("cancelled"):  # the audit is cancelled: no other branch, no comparison
                return end_cancelled(outcome)
            if not outcome["ok"]:  # its summary names the run (the replicate's folder)
                failed[branch] = outcome["summary"]
    comparison = compare_branches(parent.url, forked["branches"], forked["step"], val_sequences, failed)
    where = publish_fork_report(comparison, report_dir)
    message = f"{comparison.verdict}. Report {where['report']}, plot {where['plot']}"
    if comparison.leader is None:  # not one branch could be evaluated: the audit failed
        return Failed(message=message, data={**comparison.to_dict(), **where})
    return Completed(message=message, data={**comparison.to_dict(), **where})
