"""The pivot's steps as Prefect tasks, for the UI (docs/design.md "Pivot sequence"): the driver is
andrea_core.ops.pivot.run_pivot, the one `andrea pivot` runs too; `as_task` runs each of its named
steps as a task of that name. Also here what only Prefect has: the check that the train deployment
exists, and how a resumed `train` deployment run or subflow is seen to end."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from andrea_core.config import ConfigError
from andrea_core.data.policy import read_policy
from andrea_core.ops import pivot
from andrea_core.run.rundir import RunDir

T = TypeVar("T")


def as_task(name: str, fn: Callable[[], T]) -> T:
    """One step of the driver (pivot.PIVOT_STEP_NAMES) as a task run named `name`: its arguments stay
    the driver's (nothing is converted), its log is the flow run's."""
    return task(name=name, cache_policy=NO_CACHE)(fn)()


@task(name="check-new-policy", cache_policy=NO_CACHE)
def check_new_policy(
    run_dir: str,
    policy: str,
    restart: str = "none",
    max_steps: int | None = None,
    device: str = "auto",
    train_deployment: str | None = None,
    request_id: str | None = None,
) -> pivot.PivotCheck:
    """Refuse a pivot before anything is touched (pivot.check_pivot) and, with restart="deployment",
    one whose `train_deployment` does not exist."""
    logger = get_run_logger()
    run = RunDir(run_dir)
    checked = pivot.check_pivot(
        run,
        policy,
        max_steps=max_steps,
        device=device,
        restart=restart != "none",
        warn=logger.warning,
        request_id=request_id,
    )
    if restart == "deployment":
        _require_deployment(train_deployment)
    parsed = checked.policy
    if parsed.hash == read_policy(run).hash:
        logger.warning(
            f"policy {parsed.name!r} is the one in force: a pivot to it only starts a fresh bandit, and "
            "where a pivot installed it is done already unless given a request id of its own"
        )
    logger.info(
        f"new policy {parsed.name!r} (hash {parsed.hash}): arms {', '.join(a.name for a in parsed.arms)}"
    )
    return checked


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


def flow_run_ended(flow_run_id: str, every_s: float = 2.0) -> Callable[[], str | None]:
    """How the resumed `train` flow run ended, once it has (asked of the API at most every `every_s`)."""
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
    """How the resumed `train` subflow ended, once it has."""

    def ended() -> str | None:
        if not future.done():
            return None
        error = future.exception()
        if error is not None:
            return f"the train subflow raised {type(error).__name__}: {error}"
        outcome = future.result()
        return outcome.get("summary", str(outcome)) if isinstance(outcome, dict) else str(outcome)

    return ended
