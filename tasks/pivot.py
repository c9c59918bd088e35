"""The pivot's steps as tasks (docs/design.md "Pivot sequence"): thin wrappers over andrea_core.ops.pivot, the
journaled steps `andrea pivot` runs too. Starting the resumed trainer as a deployment run or a subflow
is Prefect's own, in flows/pivot.py."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from andrea_core.config import ConfigError
from andrea_core.data.policy import read_policy
from andrea_core.ops import pivot
from andrea_core.run.rundir import RunDir


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


@task(name="check-not-already-pivoted", cache_policy=NO_CACHE)
def already_pivoted(run_dir: str, policy: str, checked: dict, restart: str) -> dict | None:
    """A completed pivot to this policy that nothing has trained after (a rerun of it): its result, and
    nothing is done again (pivot.already_pivoted)."""
    check = _pivot_check(policy, checked)
    return pivot.already_pivoted(RunDir(run_dir), check, restart != "none", get_run_logger().info)


def _pivot_check(policy: str, checked: dict) -> pivot.PivotCheck:
    """check_new_policy's result (a flow's data) as the PivotCheck the ops functions take."""
    parsed = pivot.parse_policy_text(checked["text"], policy)
    return pivot.PivotCheck(parsed, checked["text"], policy, checked["max_steps"], "auto")


@task(name="begin-pivot", cache_policy=NO_CACHE)
def begin_pivot(run_dir: str, policy: str, checked: dict, at: str, restart: str) -> dict:
    """The pivot journal: the one a crash left of this same pivot (resumed from its last step), or a
    new one (pivot.begin_pivot)."""
    return pivot.begin_pivot(
        RunDir(run_dir), _pivot_check(policy, checked), at, restart, get_run_logger().info
    )


@task(name="take-pivot-checkpoint", cache_policy=NO_CACHE)
def take_pivot_checkpoint(run_dir: str, journal: dict, timeout_s: float) -> dict:
    """Step 1 (pivot.take_pivot_checkpoint): the pivot checkpoint, protected by pivot.json."""
    pivot.take_pivot_checkpoint(RunDir(run_dir), journal, timeout_s, get_run_logger().info)
    return journal


@task(name="stop-trainer", cache_policy=NO_CACHE)
def stop_trainer(run_dir: str, journal: dict) -> dict:
    """Step 2 (pivot.stop_trainer): SIGTERM the trainer and wait for its exit."""
    stopped = pivot.stop_trainer(RunDir(run_dir), journal, log=get_run_logger().info)
    return {"journal": journal, "stopped": stopped}


@task(name="archive-phase", cache_policy=NO_CACHE)
def archive_phase(run_dir: str, journal: dict) -> dict:
    """Step 3 (pivot.archive): the closed phase's sidecars, policy and tail into its folder."""
    archived = pivot.archive(RunDir(run_dir), journal, get_run_logger().info)
    return {"journal": journal, "archived": archived}


@task(name="keep-loss-log", cache_policy=NO_CACHE)
def keep_loss_log(run_dir: str, journal: dict) -> dict:
    """Step 4 (pivot.keep_loss_log): .loss.json checked byte for byte against the stop."""
    kept = pivot.keep_loss_log(RunDir(run_dir), journal)
    get_run_logger().info(f".loss.json untouched: {kept['bytes']} bytes, sha256 {kept['sha256'][:16]}")
    return journal


@task(name="install-policy", cache_policy=NO_CACHE)
def install_policy(run_dir: str, journal: dict) -> dict:
    """Step 5 (pivot.install): the new policy.yaml."""
    installed = pivot.install(RunDir(run_dir), journal)
    get_run_logger().info(f"installed policy {journal['policy']!r} (hash {installed})")
    return journal


@task(name="confirm-resumed-trainer", cache_policy=NO_CACHE)
def confirm_resumed_trainer(
    run_dir: str, journal: dict, timeout_s: float, ended: Callable[[], str | None] | None = None
) -> dict:
    """Step 6's proof (pivot.confirm_resumed): the first new step is boundary+1, the old history an
    untouched prefix, a new process. `ended` reports a resumed trainer that died, at once."""
    confirmed = pivot.confirm_resumed(RunDir(run_dir), journal, timeout_s, ended)
    get_run_logger().info(
        f"resumed trainer logged step {confirmed['first_step']} loss {confirmed['first_loss']:.4f} "
        f"(segment {confirmed['segment']}); .loss.json still starts with its old bytes"
    )
    return confirmed


@task(name="finish-pivot", cache_policy=NO_CACHE)
def finish_pivot(run_dir: str) -> None:
    """The pivot is complete: its journal (pivot.json) goes."""
    pivot.finish_pivot(RunDir(run_dir))


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
