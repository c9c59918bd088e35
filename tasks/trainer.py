"""Tasks over trainer processes. The trainer is its own OS process (docs/design.md "Processes"): these start
and follow one, signal the trainer of a run directory, wait for its checkpoints and stop it."""

from __future__ import annotations

import signal
import time

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.context import FlowRunContext
from prefect.exceptions import TerminationSignal
from prefect.logging.handlers import APILogWorker
from prefect.states import Cancelled, Failed, State

from andrea_core.ops import supervise
from andrea_core.ops.supervise import TrainerProcess
from andrea_core.run.rundir import RunDir
from tasks.artifacts import TrainingProgress, publish_dashboard, publish_status, run_name

CONTRACT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")  # what a trainer understands (docs/design.md "Signals")


def _trainer_task_name() -> str:
    from prefect.runtime import task_run

    return f"trainer {run_name(task_run.parameters['run_dir'])}"


@task(name="run-trainer", task_run_name=_trainer_task_name, cache_policy=NO_CACHE)
def run_trainer(
    run_dir: str,
    config: str | None = None,
    max_steps: int | None = None,
    device: str = "auto",
    pace: float = 0.0,
    stop_grace_s: float = 25.0,
    nproc_per_node: int = 1,
    settings: dict | None = None,
    policy: str | None = None,
) -> dict | State:
    """Start a trainer for `run_dir` in this flow run's process group and follow it to its end: each
    of its lines goes to the Prefect log, its step/total to a progress artifact. Returns its outcome
    (TrainerOutcome.to_dict()).

    Cancelling the flow run makes Prefect's worker SIGTERM the flow run's whole process group. The
    trainer gets that SIGTERM itself and checkpoints the step in flight; this task waits for it (well
    inside the worker's 30 s before SIGKILL) and returns a Cancelled state whose message names the
    checkpoint (Failed if the trainer could not write one), the outcome as its data; the flow then
    ends with `end_cancelled`. Any other end of this task (Ctrl-C, a SIGTERM that is no cancellation)
    stops the trainer the same way and is raised on."""
    logger = get_run_logger()
    trainer = TrainerProcess(
        run_dir,
        config=config,
        max_steps=max_steps,
        device=device,
        pace=pace,
        nproc_per_node=nproc_per_node,
        settings=settings,
        policy=policy,
    )
    # The progress artifact before the start: if creating it fails, there is no trainer to clean up.
    progress = TrainingProgress(trainer.run.url, max_steps)
    trainer.start()
    try:
        logger.info(f"trainer pid {trainer.pid}: {' '.join(trainer.argv[4:])}")
        _dashboard(trainer.run.url)
        # Its events (train/events.py), not its log lines, say where it is: the dashboard is redrawn at
        # its start and at each checkpoint it publishes, here in the flow's process (none of it on the
        # trainer's).
        trainer.on_event = lambda e: e["event"] in ("started", "checkpoint") and _dashboard(trainer.run.url)
        for line in trainer.lines():
            logger.info(line)
            progress.update(trainer.step, trainer.total, loss=trainer.loss, tokens_per_s=trainer.tokens_per_s)
    except BaseException as exc:
        # A cancellation (TerminationSignal), Ctrl-C, or anything else that ends this task early: the
        # trainer must end with a checkpoint of the step in flight before we do.
        t0 = time.monotonic()
        outcome = trainer.stop(stop_grace_s, on_line=logger.info)
        took = f"{time.monotonic() - t0:.1f}s after the stop request"
        if isinstance(exc, TerminationSignal) and _cancellation_requested():
            _finish(trainer, progress, outcome, "cancelled")
            return _cancelled(outcome, took)
        why = "SIGTERM, not a cancellation" if isinstance(exc, TerminationSignal) else type(exc).__name__
        logger.warning(f"{why}: {outcome.describe()} ({took})")
        _finish(trainer, progress, outcome, why)
        # Prefect may end this process with a bare SIGTERM once the signal propagates: ship the log now.
        APILogWorker.drain_all(timeout=5)
        raise
    outcome = trainer.outcome()
    if outcome.reason in ("SIGTERM", "SIGINT") and _cancellation_requested():
        # The cancellation's SIGTERM reached the trainer but not this loop: Prefect's handler raises
        # TerminationSignal, and Python drops an exception raised while a finalizer (__del__) runs
        # ("Exception ignored in ...": a loaded machine, 2026-12-07). The flow run is cancelling, so
        # this stop is its cancellation, as if the exception had come.
        _finish(trainer, progress, outcome, "cancelled")
        return _cancelled(outcome, "its flow run cancelling")
    result = outcome.to_dict()
    if outcome.reason in ("SIGTERM", "SIGINT"):
        result["summary"] += (
            " (the signal came from outside this flow run: a pivot, an operator or the system)"
        )
    _finish(trainer, progress, outcome, "finished")
    (logger.info if outcome.ok else logger.error)(result["summary"])
    return result


def _runner_cancels() -> bool:
    """Whether Prefect's runner told this process, on its control channel before the SIGTERM, that the
    signal is a cancellation (the intent Prefect's own flow engine reads; absent where the runner's
    request was not acknowledged in time, or the channel has moved in another Prefect version)."""
    try:
        from prefect._internal.control_listener import get_intent
    except ImportError:
        return False
    return get_intent() == "cancel"


def _cancellation_requested() -> bool:
    """Whether the SIGTERM this flow run got is its cancellation: Prefect's runner said so, or the flow
    run is Cancelling (the UI, `prefect flow-run cancel` and the API all set that state before the
    worker signals; a worker shutting down cancels its runs without it)."""
    if _runner_cancels():
        return True
    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return False
    try:
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(context.flow_run.id).state
    except Exception as e:
        get_run_logger().warning(f"could not read this flow run's state: {type(e).__name__}: {e}")
        return False
    return state is not None and (state.is_cancelling() or state.is_cancelled())


def _cancelled(outcome: supervise.TrainerOutcome, took: str) -> State:
    """The trainer task's end when its flow run is cancelled: Cancelled, naming the checkpoint the
    trainer wrote, if it wrote one; Failed, saying what went wrong, if it did not."""
    if outcome.reason in ("SIGTERM", "SIGINT") and outcome.checkpoint is not None:
        text = f"trainer checkpointed at step {outcome.step} ({outcome.checkpoint}) and stopped as asked"
        text += f" ({outcome.detail})" if outcome.detail else ""
        message = f"cancelled from Prefect: {outcome.run_dir}: {text} ({took})"
    else:
        message = f"cancelled from Prefect: {outcome.describe()} ({took})"
    result = {**outcome.to_dict(), "summary": message, "cancelled": True}
    if outcome.ok:
        get_run_logger().info(message)
        return Cancelled(message=message, data=result)
    get_run_logger().error(message)
    return Failed(message=message, data=result)


def trainer_outcome(state: State) -> dict:
    """What `run_trainer(..., return_state=True)` returned: the trainer's outcome, with "cancelled":
    True when the flow run's cancellation stopped it (then end the flow with `end_cancelled`). A task
    run that raised raises here, as it would have in the flow without return_state."""
    outcome = state.result(raise_on_failure=False)
    return outcome if isinstance(outcome, dict) else state.result()


def end_cancelled(outcome: dict) -> State:
    """End a flow run whose cancellation stopped its trainer (`outcome` from `trainer_outcome`).

    The termination signal goes back to Prefect's flow engine, as if the trainer task had never held
    it: with the runner's cancel intent, the engine ends the run as cancelled (no Crashed state, no
    ERROR line) and the runner sets Cancelled ("Flow run was cancelled successfully."). Just before,
    a Cancelled state of ours names the checkpoint in the run's state history. Without that intent the
    engine would report a crash: this returns a Cancelled state for the flow to return instead."""
    if not _runner_cancels():
        return Cancelled(message=outcome["summary"])
    _record_cancellation(outcome["summary"])
    APILogWorker.drain_all(timeout=5)  # the log so far, while the API certainly answers
    raise TerminationSignal(signal=signal.SIGTERM)


def _record_cancellation(message: str) -> None:
    """Put `message` into a Cancelled state of this flow run. Prefect's runner then adds its own
    generic "Flow run was cancelled successfully." state on top (3.9.1 always does): ours stays in the
    state history, in the log and in the trainer task run's state."""
    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return
    try:
        with get_client(sync_client=True) as client:
            result = client.set_flow_run_state(context.flow_run.id, Cancelled(message=message), force=True)
        if result.state is not None and result.state.is_cancelled():
            # The flow engine's own copy of the run (the context's): its closing line, "Finished in
            # state ...", then says Cancelled instead of Running.
            context.flow_run.state = result.state
    except Exception as e:  # the API may already be going away with this process: the log has it too
        get_run_logger().warning(f"could not record the cancellation state: {type(e).__name__}: {e}")


def _dashboard(run_dir: str) -> None:
    """Publish the run's dashboard; a failure is a warning: it must never end the training it shows."""
    try:
        publish_dashboard(run_dir)
    except Exception as e:
        get_run_logger().warning(f"the dashboard of {run_dir} was not updated: {type(e).__name__}: {e}")


def _this_flow_run() -> str:
    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return "none (called outside a flow run)"
    return f"{context.flow_run.name} ({context.flow_run.id})"


def _finish(trainer: TrainerProcess, progress: TrainingProgress, outcome: supervise.TrainerOutcome, how: str):
    progress.update(outcome.step, trainer.total, force=True, loss=trainer.loss)
    _dashboard(outcome.run_dir)
    # When and by whom: a flow-run process killed outright publishes nothing, so the run directory's
    # status may be older than its newest checkpoint; these two rows say how old and from which run.
    publish_status(
        outcome.run_dir,
        f"trainer of {run_name(outcome.run_dir)}: {outcome.reason}",
        {
            "run": outcome.run_dir,
            "ended": how,
            "reason": outcome.reason,
            "step": outcome.step,
            "loss": "n/a" if trainer.loss is None else f"{trainer.loss:.4f}",
            "checkpoint": outcome.checkpoint or "none",
            "exit code": outcome.returncode,
            "summary": outcome.describe(),
            "written": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "flow run": _this_flow_run(),
        },
    )


@task(name="signal-trainer", cache_policy=NO_CACHE)
def signal_trainer(run_dir: str, signal_name: str) -> dict:
    """Signal the trainer that holds `run_dir`'s lock (.trainer.json), after checking that its pid still
    belongs to that very process (boot id and kernel start time): a recycled pid is never signalled.
    Returns what the run looked like just before, for waiting on the signal's effect."""
    if signal_name not in CONTRACT_SIGNALS:
        raise ValueError(f"signal {signal_name!r}: a trainer understands only {', '.join(CONTRACT_SIGNALS)}")
    from andrea_core.ops.pivot import signal_live_trainer

    run = RunDir(run_dir)
    receipt = {**signal_live_trainer(run, signal_name), "time": time.time()}
    get_run_logger().info(f"sent {signal_name} to trainer pid {receipt['pid']} of {run.url}")
    return receipt


@task(name="stop-trainer", cache_policy=NO_CACHE)
def stop_trainer(run_dir: str, timeout_s: float = 300.0) -> dict:
    """SIGTERM the trainer of `run_dir` (identity-checked) and wait until it has exited: by then it has
    checkpointed the step in flight. A run with no live trainer is left alone."""
    from andrea_core.ops.pivot import stop_live_trainer

    return stop_live_trainer(RunDir(run_dir), timeout_s, get_run_logger().info)
