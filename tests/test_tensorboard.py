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


def test_a_symlink_or_a_file_at_run_tensorboard_is_one_warning_and_training_goes_on(tmp_path):
    """Issue 43.13: a symlink or a file at RUN/tensorboard stopped the trainer with exit 2 after its
    next checkpoint. A view never stops training: one warning, and the run trains to its target."""
    from andrea_core.config import load_run_config
    from andrea_core.train.setup import create_run

    cfg = load_run_config(tiny_config(tmp_path, train__checkpoint_every=10))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for kind in ("symlink", "file"):
        run_dir = tmp_path / kind
        create_run(RunDir(str(run_dir)), cfg)
        if kind == "symlink":
            (run_dir / "tensorboard").symlink_to(elsewhere, target_is_directory=True)
        else:
            (run_dir / "tensorboard").write_text("not a folder")
        proc = andrea("train", "--run-dir", str(run_dir), "--max-steps", "30", check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        warned = [
            x for x in (proc.stdout + proc.stderr).splitlines() if "TensorBoard event(s) not written" in x
        ]
        assert len(warned) == 1 and "a symlink or a file where a folder of the run should be" in warned[0]
        assert "training goes on" in warned[0]
        assert [e.step for e in read_history(RunDir(str(run_dir)))] == list(range(1, 31))
        assert RunDir(str(run_dir)).checkpoint_steps() == [10, 20, 30]
    assert (
        list(elsewhere.iterdir()) == [] and (tmp_path / "file" / "tensorboard").read_text() == "not a folder"
    )


@pytest.mark.filterwarnings("ignore:html5lib's sanitizer is deprecated:DeprecationWarning")
def test_an_audit_prompt_cannot_put_links_or_images_into_tensorboards_text_plugin(tmp_path):
    """Issue 43.14: a backtick inside the repr of a prompt (a held-out document) ended the code span:
    TensorBoard's text plugin then rendered the rest as markdown, links and images included."""
    from tensorboard.plugin_util import markdown_to_safe_html

    from andrea_core.train.tensorboard import TensorBoardLog

    run = RunDir(str(tmp_path / "run"))
    run.makedirs()
    prompt = "x` [sign in again](https://evil.example/login) ![i](https://evil.example/i.png) `y"
    completion = "`` <img src=https://evil.example/c.png> https://evil.example ``"
    tb = TensorBoardLog(run, 1, 1)
    samples = [{"arm": "prose", "prompt": prompt, "completion": completion}]
    tb.audit({"step": 5, "metrics": {"val_loss": {"prose": 2.0}}, "samples": samples})
    tb.flush()
    (event,) = accumulated(tmp_path / "run" / "tensorboard").Tensors("audit/samples")
    html = markdown_to_safe_html(event.tensor_proto.string_val[0])  # what the text plugin shows
    assert "<a " not in html and "<img" not in html, html
    assert html.count("<code>") == 2 and "<strong>prose</strong>" in html
    from html import unescape

    codes = [unescape(c.split("</code>")[0]).strip() for c in html.split("<code>")[1:]]
    assert codes == [repr(prompt), repr(completion)]


@pytest.mark.slow
def test_a_fork_branchs_tensorboard_holds_the_history_its_loss_log_holds(tmp_path):
    """Issue 43.16: a branch's TensorBoard started at the fork step while its .loss.json holds 1..N."""
    parent = tmp_path / "parent"
    cfg = tiny_config(tmp_path, train__checkpoint_every=10)
    andrea("train", "--config", cfg, "--run-dir", str(parent), "--max-steps", "20")
    out = andrea("fork", str(parent), "--step", "10", "--branch", "b")
    (url,) = [line.split(": ", 1)[1] for line in out.stdout.strip().splitlines()]
    andrea("train", "--run-dir", url, "--max-steps", "25")
    branch = RunDir(url)
    history = read_history(branch)
    assert [e.step for e in history] == list(range(1, 26))
    parents = {e.step: e.loss for e in read_history(RunDir(str(parent)))}
    assert [e.loss for e in history[:10]] == [parents[s] for s in range(1, 11)]
    acc = accumulated(branch.path("tensorboard"))
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [
        (e.step, float(np.float32(e.loss))) for e in history
    ]
    assert [(e.step, e.value) for e in acc.Scalars("train/lr")] == [
        (e.step, float(np.float32(e.lr))) for e in history
    ]
    assert [e.wall_time for e in acc.Scalars("train/loss")][:10] == [e.time for e in history[:10]]
