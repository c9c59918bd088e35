"""TensorBoard events of a run (issue 26.4), read back with tensorboard's own event reader: across a
resume and a pivot (one event file per segment) they equal .loss.json's canonical history."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from conftest import andrea
from tiny import tiny_config

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
    andrea("train", "--run-dir", str(run_dir), "--max-steps", "25")  # checkpoints 20 and 25
    # A torn newest checkpoint: the next start refuses it and resumes from step 20, logging 21..25 again
    # over what the second segment's events hold (its file stays; TensorBoard must drop that tail).
    ckpt = run_dir / "step_000025.bin"
    ckpt.write_bytes(ckpt.read_bytes()[:1000])
    andrea("train", "--run-dir", str(run_dir), "--max-steps", "30")
    andrea("pivot", str(run_dir), "--policy", "tiny-mix", "--no-restart")  # at step 30
    andrea("train", "--run-dir", str(run_dir), "--max-steps", "40")

    history = read_history(run)
    assert [e.step for e in history] == list(range(1, 41)) and {e.segment for e in history} == {1, 2, 3, 4}
    assert [e.segment for e in history if e.step in (20, 21, 30, 31)] == [2, 3, 3, 4]
    files = sorted(p.name for p in (run_dir / "tensorboard").iterdir())
    assert [f.rsplit(".", 1)[1] for f in files] == [f"segment000{k}" for k in (1, 2, 3, 4)]
    # The second segment's file holds steps 21..25 of the abandoned timeline, which the history dropped.
    alone = tmp_path / "segment2"
    alone.mkdir()
    shutil.copy(run_dir / "tensorboard" / files[1], alone)
    assert max(e.step for e in accumulated(alone).Scalars("train/loss")) == 25

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
        assert [p.step for p in acc.Scalars(f"bandit/p/{arm}")][-1] == 40
    (text,) = [e for e in acc.Tensors("audit/samples") if e.step == audits[-1]["step"]]
    assert repr(audits[-1]["samples"][0]["prompt"]) in text.tensor_proto.string_val[0].decode()
