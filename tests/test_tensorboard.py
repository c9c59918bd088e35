"""TensorBoard events of a run (issue 26.4), read back with tensorboard's own event reader: across a
resume and a pivot (one event file per segment) they equal .loss.json's canonical history."""

from __future__ import annotations

import re
import shutil
import signal

import numpy as np
import pytest
from conftest import andrea, last_logged_step, start_trainer, wait_for
from tiny import tiny_config

from andrea_core.run.lock import live_trainer
from andrea_core.run.loss_log import read_history
from andrea_core.run.rundir import RunDir
from andrea_core.run.samples import read_audits


def accumulated(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


@pytest.mark.slow
def test_tensorboard_events_equal_the_canonical_history_across_a_resume_and_a_pivot(tmp_path):
    run_dir = tmp_path / "run"
    run = RunDir(str(run_dir))
    cfg = tiny_config(tmp_path, train__checkpoint_every=10)
    andrea("train", "--config", cfg, "--run-dir", str(run_dir), "--max-steps", "10")
    andrea("data", "prepare", "tiny-mix", "--config", cfg)  # the pivot's check then takes no time
    # A live trainer pivoted now (SIGUSR1): the SIGTERM checkpoint past the pivot point is archived with
    # its phase, and the resumed trainer logs those steps again (a third segment, over the second's tail).
    trainer = start_trainer("--run-dir", str(run_dir), "--max-steps", "100000", "--pace", "0.2")
    try:
        wait_for(lambda: last_logged_step(run) >= 15, timeout=300, what="step 15")
        out = andrea(
            "pivot", str(run_dir), "--policy", "tiny-mix", "--at", "now", "--max-steps", "100000"
        ).stdout
        boundary = int(re.search(r"pivoted \S+ at step (\d+)", out)[1])
        assert trainer.wait(timeout=300) == 0
    finally:
        if trainer.poll() is None:
            trainer.send_signal(signal.SIGTERM)
            trainer.wait(timeout=300)
    wait_for(lambda: last_logged_step(run) >= boundary + 5, timeout=600, what="the resumed trainer")
    live_trainer(run).stop()  # SIGTERM: a checkpoint of the step in flight
    wait_for(lambda: live_trainer(run) is None, timeout=300, what="the resumed trainer to stop")

    history = read_history(run)
    n = history[-1].step
    assert [e.step for e in history] == list(range(1, n + 1)) and {e.segment for e in history} == {1, 2, 3}
    files = sorted(p.name for p in (run_dir / "tensorboard").iterdir())
    assert [f.rsplit(".", 1)[1] for f in files] == ["segment0001", "segment0002", "segment0003"]
    # The second segment's file holds steps past the pivot point that the run's history dropped.
    alone = tmp_path / "segment2"
    alone.mkdir()
    shutil.copy(run_dir / "tensorboard" / files[1], alone)
    assert max(e.step for e in accumulated(alone).Scalars("train/loss")) > boundary

    acc = accumulated(run_dir / "tensorboard")
    loss = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert loss == [(e.step, float(np.float32(e.loss))) for e in history]
    lr = [(e.step, e.value) for e in acc.Scalars("train/lr")]
    assert lr == [(e.step, float(np.float32(e.lr))) for e in history]
    # The audits of the phase in force, per arm; the bandit's probability per arm at its checkpoints.
    audits = read_audits(run)
    for arm in audits[-1]["metrics"]["val_loss"]:
        got = {e.step: e.value for e in acc.Scalars(f"val_loss/{arm}")}
        for a in audits:
            assert got[a["step"]] == float(np.float32(a["metrics"]["val_loss"][arm]))
        assert [p.step for p in acc.Scalars(f"bandit/p/{arm}")][-1] == n
    (text,) = [e for e in acc.Tensors("audit/samples") if e.step == audits[-1]["step"]]
    assert audits[-1]["samples"][0]["prompt"][:4] in text.tensor_proto.string_val[0].decode()
