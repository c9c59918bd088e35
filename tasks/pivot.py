"""The pivot's run-directory steps as tasks (DESIGN.md "Pivot sequence"). Stopping and restarting the
trainer are in trainer.py and flows/pivot.py; the moves themselves are andrea_core.pivot's."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from andrea_core import pivot, supervise
from andrea_core.config import ConfigError
from andrea_core.fork import run_n_params
from andrea_core.lock import live_trainer
from andrea_core.rundir import SAMPLES, STATE, RunDir
from andrea_core.runs import read_policy, read_run
from andrea_core.supervise import LossLogSnapshot, SupervisionError


@task(name="check-new-policy", cache_policy=NO_CACHE)
def check_new_policy(
    run_dir: str,
    policy: str,
    restart: str = "none",
    max_steps: int | None = None,
    device: str = "auto",
    train_deployment: str | None = None,
) -> dict:
    """Refuse a pivot before anything is touched (pivot.check_pivot): the run must exist; the new policy
    must parse, be feasible and pass the trainer's own data check on this machine; for a restart, the
    device must exist here, max_steps must lie beyond the run's newest checkpoint and, with
    restart="deployment", `train_deployment` must exist. Returns the policy's exact YAML text,
    installed verbatim."""
    logger = get_run_logger()
    run = RunDir(run_dir)
    checked = pivot.check_pivot(
        run, policy, max_steps=max_steps, device=device, restart=restart != "none", warn=logger.warning
    )
    if restart == "deployment":
        _require_deployment(train_deployment)
    parsed = checked.policy
    if parsed.hash == read_policy(run).hash:
        logger.warning(f"policy {parsed.name!r} is the one in force: the pivot only starts a fresh bandit")
    logger.info(
        f"new policy {parsed.name!r} (hash {parsed.hash}): arms {', '.join(a.name for a in parsed.arms)}"
    )
    return {
        "name": parsed.name,
        "hash": parsed.hash,
        "text": checked.text,
        "source": policy,
        "max_steps": checked.max_steps,
    }


def _require_deployment(name: str | None) -> None:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    if not name or "/" not in name:
        raise ConfigError(f"train_deployment {name!r}: expected FLOW/DEPLOYMENT, e.g. 'train/train'")
    try:
        with get_client(sync_client=True) as client:
            client.read_deployment_by_name(name)
    except ObjectNotFound:
        raise ConfigError(
            f"train_deployment {name!r} does not exist on this Prefect server: the resumed trainer could "
            "not be started (prefect deploy --all creates 'train/train'); not pivoting"
        ) from None


@task(name="protect-pivot-point", cache_policy=NO_CACHE)
def protect_pivot_point(
    run_dir: str, policy_text: str, step: str, boundary: int | None, from_logged_step: bool = False
) -> dict:
    """Record the pivot under way in pivot.json before its next step: retention keeps its checkpoint
    (or, before the checkpoint a SIGUSR1 asks for exists, every checkpoint from the trainer's step on)."""
    run = RunDir(run_dir)
    policy = pivot.parse_policy_text(policy_text, "new policy")
    not_before = (supervise.logged_step(run) or 0) if from_logged_step else None
    return pivot.record_pivot(run, policy, step, boundary, not_before)


@task(name="clear-pivot-intent", cache_policy=NO_CACHE)
def clear_pivot_intent(run_dir: str) -> None:
    """Remove pivot.json: the pivot is installed (its phase folder protects the boundary now), or it
    stopped before it changed anything."""
    pivot.clear_pivot(RunDir(run_dir))


@task(name="check-restart-steps", cache_policy=NO_CACHE)
def check_restart_steps(max_steps: int, boundary: int) -> None:
    """The resumed trainer must have steps to train past the pivot point."""
    pivot.require_steps_after(max_steps, boundary)


@task(name="choose-pivot-boundary", cache_policy=NO_CACHE)
def choose_pivot_boundary(run_dir: str) -> dict:
    """The next checkpoint on the grid after the step the live trainer is at (a pivot decided at step
    112,619 pivots at step_112700.bin), so pivot points stay on the checkpoint and audit grid."""
    run = RunDir(run_dir)
    every = read_run(run).config.train.checkpoint_every
    decided_at = supervise.logged_step(run) or 0
    boundary = pivot.boundary_after(decided_at, every)
    get_run_logger().info(f"pivot decided at step {decided_at}: pivoting at step {boundary}")
    return {"decided_at": decided_at, "boundary": boundary}


@task(name="newest-checkpoint", cache_policy=NO_CACHE)
def newest_checkpoint(run_dir: str) -> int:
    """With no trainer running, the pivot point is the newest valid checkpoint."""
    run = RunDir(run_dir)
    if live_trainer(run) is not None:
        raise SupervisionError(f"{run.url}: a trainer is running; pivot it from its boundary instead")
    ckpt = run.newest_valid_checkpoint(run_n_params(read_run(run)), warn=get_run_logger().warning)
    if ckpt is None:
        raise SupervisionError(f"{run.url}: no valid checkpoint to pivot from")
    get_run_logger().info(f"no trainer running: pivoting at the newest checkpoint, step {ckpt.step}")
    return ckpt.step


@task(name="archive-phase", cache_policy=NO_CACHE)
def archive_phase(run_dir: str, boundary: int) -> dict:
    """Step 3: move .samples.json, .state.json, (a copy of) policy.yaml and the checkpoints past the
    boundary into archive/phase_NNN_step_SSSSSS/. Afterwards the run holds no bandit state or sample log,
    so the next trainer necessarily starts a fresh bandit."""
    run = RunDir(run_dir)
    archived = pivot.archive_phase(run, boundary)
    left = [name for name in (SAMPLES, STATE) if run.exists(name)]
    if left:
        raise SupervisionError(f"{run.url}: {', '.join(left)} still present after archiving")
    newest = run.checkpoint_steps()[-1]
    if newest != boundary:
        raise SupervisionError(
            f"{run.url}: newest checkpoint is step {newest}, not the pivot point {boundary}"
        )
    get_run_logger().info(f"archived {', '.join(archived.moved) or 'nothing'} into {archived.folder}")
    return {"folder": run.path(archived.folder), "moved": archived.moved}


@task(name="keep-loss-log", cache_policy=NO_CACHE)
def keep_loss_log(run_dir: str, snapshot: LossLogSnapshot) -> dict:
    """Step 4: .loss.json stays exactly where and as it is: checked byte for byte against its state
    when the trainer stopped."""
    run = RunDir(run_dir)
    snapshot.check_unchanged(run)
    get_run_logger().info(f".loss.json untouched: {snapshot.size} bytes, sha256 {snapshot.sha256[:16]}")
    return {"bytes": snapshot.size, "sha256": snapshot.sha256}


@task(name="install-policy", cache_policy=NO_CACHE)
def install_policy(run_dir: str, policy_text: str, source: str) -> str:
    """Step 5: the new policy.yaml (validated again: what is installed is what was checked)."""
    installed = pivot.install_policy(RunDir(run_dir), policy_text, source)
    get_run_logger().info(f"installed policy {installed.name!r} (hash {installed.hash})")
    return installed.hash


@task(name="confirm-resumed-trainer", cache_policy=NO_CACHE)
def confirm_resumed_trainer(
    run_dir: str,
    boundary: int,
    snapshot: LossLogSnapshot,
    old_pid: int | None,
    timeout_s: float,
    ended: Callable[[], str | None] | None = None,
) -> dict:
    """Step 6's proof: the new trainer's first loss is for step boundary+1 (it resumed from the pivot
    checkpoint), the old history is a byte-for-byte prefix of .loss.json, and it is a new process.
    `ended` reports the resumed trainer's end (its flow run's final state): a trainer that died is
    reported at once with its error, not after timeout_s."""
    run = RunDir(run_dir)
    entry = supervise.wait_for_first_entry_after(run, snapshot, timeout_s, ended=ended)
    if entry["step"] != boundary + 1:
        raise SupervisionError(
            f"{run.url}: the resumed trainer logged step {entry['step']} first; expected {boundary + 1} "
            f"(a resume from step_{boundary:06d}.bin)"
        )
    snapshot.check_prefix_of(run)
    trainer = live_trainer(run)
    if trainer is not None and trainer.pid == old_pid:
        raise SupervisionError(f"{run.url}: trainer pid {old_pid} is still the one running")
    result = {
        "first_step": entry["step"],
        "first_loss": entry["loss"],
        "segment": entry["segment"],
        "arm": entry.get("arm"),
        "pid": trainer.pid if trainer else None,
    }
    get_run_logger().info(
        f"resumed trainer logged step {entry['step']} loss {entry['loss']:.4f} (segment {entry['segment']}); "
        f".loss.json still starts with its {snapshot.size} old bytes"
    )
    return result


def flow_run_ended(flow_run_id: str, every_s: float = 2.0) -> Callable[[], str | None]:
    """For confirm_resumed_trainer: how the resumed `train` flow run ended, once it has (asked of the
    API at most every `every_s` seconds)."""
    from uuid import UUID

    from prefect.client.orchestration import get_client

    last = [0.0]

    def ended() -> str | None:
        if time.monotonic() - last[0] < every_s:
            return None
        last[0] = time.monotonic()
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(UUID(flow_run_id)).state
        if state is None or not state.is_final():
            return None
        return f"its flow run {flow_run_id} ended {state.type.value}: {state.message}"

    return ended


def subflow_ended(future: Future) -> Callable[[], str | None]:
    """For confirm_resumed_trainer: how the resumed `train` subflow ended, once it has."""

    def ended() -> str | None:
        if not future.done():
            return None
        error = future.exception()
        if error is not None:
            return f"the train subflow raised {type(error).__name__}: {error}"
        outcome = future.result()
        return outcome.get("summary", str(outcome)) if isinstance(outcome, dict) else str(outcome)

    return ended
