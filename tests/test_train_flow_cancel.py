"""A train flow run cancelled whose own process never hears the SIGTERM: Prefect's handler raises
TerminationSignal, and Python drops an exception raised while a finalizer runs (a loaded machine,
2026-12-07). The trainer still stops with a checkpoint of the step in flight, and the flow run's record
is still a cancellation naming it (tasks/trainer.py), not a trainer stopped from outside."""

from __future__ import annotations

import contextvars
import os
import signal
import threading

import pytest
from prefect_ephemeral import ephemeral_prefect  # noqa: F401

from andrea_core.checkpoint import checkpoint_name
from andrea_core.run.lock import read_lock
from andrea_core.run.loss_log import read_history
from andrea_core.run.rundir import RunDir
from tests.conftest import TINY, last_logged_step, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ephemeral_prefect")]


def test_a_cancellation_whose_sigterm_only_the_trainer_heard_is_recorded_as_one(tmp_path):
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.states import Cancelling

    from flows.train import train

    run = RunDir(str(tmp_path / "run"))
    ended: dict = {}
    run_flow = lambda: ended.update(  # noqa: E731
        state=train(run.url, TINY, max_steps=100_000, device="cpu", pace=0.05, return_state=True)
    )
    # On a thread of its own, with this one's Prefect settings (the module's server: a context variable).
    flow = threading.Thread(target=contextvars.copy_context().run, args=(run_flow,))
    flow.start()
    try:
        wait_for(lambda: last_logged_step(run) >= 5, timeout=300, what="the trainer to train")
        with get_client(sync_client=True) as c:
            (flow_run,) = [r for r in c.read_flow_runs() if r.state is not None and r.state.is_running()]
            c.set_flow_run_state(flow_run.id, Cancelling(), force=True)  # the API's cancel
        os.kill(read_lock(run).pid, signal.SIGTERM)  # the trainer alone: this process hears nothing
        flow.join(300)
    finally:
        holder = read_lock(run)
        if flow.is_alive() and holder is not None:
            os.kill(holder.pid, signal.SIGKILL)
            flow.join(60)
    assert ended["state"].is_cancelled(), ended["state"]
    stopped = read_history(run)[-1].step
    assert run.checkpoint_steps()[-1] == stopped
    with get_client(sync_client=True) as c:
        tasks = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))
    (trainer,) = [t for t in tasks if t.name.startswith("trainer")]
    assert trainer.state.type.value == "CANCELLED", trainer.state
    assert (
        f"trainer checkpointed at step {stopped} ({checkpoint_name(stopped)}) and stopped as asked "
        "(its flow run cancelling)"
    ) in trainer.state.message
