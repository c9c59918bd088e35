"""TensorBoard events of a run (issue 26.4), read back with tensorboard's own event reader: across a
resume and a pivot (one event file per segment) they equal .loss.json's canonical history."""

from __future__ import annotations

import json
import shutil
import time

import numpy as np
import pytest
from conftest import _env, andrea
from tiny import tiny_config

from andrea_core.run.loss_log import read_history
from andrea_core.run.rundir import RunDir
from andrea_core.run.samples import read_audits
from andrea_core.train.tensorboard import TensorBoardLog


def accumulated(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


@pytest.mark.slow
def test_tensorboard_events_equal_the_canonical_history_across_a_resume_and_a_pivot(tmp_path):
    run_dir = tmp_path / "run"
    run = RunDir(str(run_dir))
    cfg = tiny_config(tmp_path, train__checkpoint_every=10, train__log_every=5)
    # The trainers' own records of their speed (train/events.py), to read train/tokens_per_s against.
    events = tmp_path / "events.jsonl"
    events.touch()
    env = _env() | {"ANDREA_EVENTS": str(events)}
    andrea("train", "--config", cfg, "--run-dir", str(run_dir), "--max-steps", "10", env=env)
    andrea("train", "--run-dir", str(run_dir), "--max-steps", "25", env=env)  # checkpoints 20 and 25
    # A torn newest checkpoint: the next start refuses it and resumes from step 20, logging 21..25 again
    # over what the second segment's events hold (its file stays; TensorBoard must drop that tail).
    ckpt = run_dir / "step_000025.bin"
    ckpt.write_bytes(ckpt.read_bytes()[:1000])
    andrea("train", "--run-dir", str(run_dir), "--max-steps", "30", env=env)
    andrea("pivot", str(run_dir), "--policy", "tiny-mix", "--no-restart")  # at step 30
    andrea("train", "--run-dir", str(run_dir), "--max-steps", "50", env=env)  # checkpoints 40 and 50

    history = read_history(run)
    assert [e.step for e in history] == list(range(1, 51)) and {e.segment for e in history} == {1, 2, 3, 4}
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
    # tokens/s at every log_every step, as the trainer that logged the step measured it (the last
    # record of a step: 21..25 were logged twice, the second timeline's are canonical).
    speed = {}
    for line in events.read_text().splitlines():
        record = json.loads(line)
        if record["event"] == "progress":
            speed[record["step"]] = float(np.float32(record["tokens_per_s"]))
    got = [(e.step, e.value) for e in acc.Scalars("train/tokens_per_s")]
    assert got == [(s, speed[s]) for s in range(5, 51, 5)] and all(v > 0 for _, v in got), (got, speed)
    # The audits of the phase in force, per arm, and their text metrics.
    audits = read_audits(run)
    assert [a["step"] for a in audits] and audits[-1]["step"] == 50
    for arm in audits[-1]["metrics"]["val_loss"]:
        got = {e.step: e.value for e in acc.Scalars(f"val_loss/{arm}")}
        for a in audits:
            assert got[a["step"]] == float(np.float32(a["metrics"]["val_loss"][arm]))
    for key in ("distinct_1", "distinct_2", "repetition", "gzip_ratio"):
        got = {e.step: e.value for e in acc.Scalars(f"audit/{key}")}
        assert {a["step"]: float(np.float32(a["metrics"][key])) for a in audits}.items() <= got.items(), key
    # The bandit's probability per arm at each of its checkpoints, as its state file holds it: the
    # phase in force (tiny-mix's three arms, checkpoints 40 and 50) and the archived one (one arm).
    (phase,) = (run_dir / "archive").iterdir()
    seen = 0
    for state_file in (run_dir / ".state.json", phase / ".state.json"):
        head = json.loads(state_file.read_text())
        for state in (head, *head["previous"]):
            for arm, bandit in state["arms"].items():
                got = {e.step: e.value for e in acc.Scalars(f"bandit/p/{arm}")}
                assert got[state["step"]] == float(np.float32(bandit["p"])), (arm, state["step"])
                seen += 1
    assert seen >= 3 * 2 + 1 and [p.step for p in acc.Scalars("bandit/p/docs-prose")] == [40, 50]
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


def test_andrea_tensorboard_0_writes_no_events(tmp_path):
    """ANDREA_TENSORBOARD=0 turns the view off: no RUN/tensorboard, and the run trains as ever."""
    run_dir = tmp_path / "run"
    cfg = tiny_config(tmp_path, train__checkpoint_every=10, train__log_every=5)
    env = _env() | {"ANDREA_TENSORBOARD": "0"}
    andrea("train", "--config", cfg, "--run-dir", str(run_dir), "--max-steps", "10", env=env)
    assert not (run_dir / "tensorboard").exists()
    assert [e.step for e in read_history(RunDir(str(run_dir)))] == list(range(1, 11))
    assert RunDir(str(run_dir)).checkpoint_steps() == [10]


def test_a_segment_after_a_wall_clock_step_back_sorts_after_the_older_files(tmp_path):
    """TensorBoard reads a folder's event files in name order, and a segment's START drops the older
    segments' events from its step on only if it comes after them. Its file was named by the wall
    clock: after a step back of an hour, the new segment's file sorted first (issue 48, clocks), and
    TensorBoard kept the superseded tail instead. Now one past the newest file's time."""
    run = RunDir(str(tmp_path / "run"))
    run.makedirs()
    (tmp_path / "run" / "tensorboard").mkdir()
    ahead = int(time.time()) + 3600  # segment 1, logged before the clock went back an hour
    old = f"events.out.tfevents.{ahead:010d}.andrea.segment0001"
    (tmp_path / "run" / "tensorboard" / old).write_bytes(b"")
    new = TensorBoardLog(run, 2, 11).name.split("/")[-1]
    assert (
        sorted([new, old]) == [old, new] and new == f"events.out.tfevents.{ahead + 1:010d}.andrea.segment0002"
    )


def test_a_segment_drops_the_older_files_tail_before_its_first_flush(tmp_path):
    """Issue 48's soak (pivot-remote, seed 1): a trainer SIGKILLed right after publishing its first
    checkpoint, before it flushed its events, left no event file, and the next segment, resuming past
    that checkpoint, could not drop what an older file showed for those steps: a pivot's archived
    tail (466 and 467 of the closed phase) stood in for the new phase's. A segment's START is now on
    disk as it opens, before its first step."""
    run_dir = tmp_path / "run"
    run = RunDir(str(run_dir))
    run.makedirs()
    old = TensorBoardLog(run, 1, 1)  # the closed phase, steps 1..15 (its tail past 10 archived)
    for step in range(1, 16):
        old.scalar(step, "train/loss", float(step))
    old.flush()
    TensorBoardLog(run, 2, 11)  # the new phase from 11: killed before its first flush
    later = TensorBoardLog(run, 3, 14)  # resumed from that trainer's checkpoint 13
    later.scalar(14, "train/loss", 140.0)
    later.flush()
    shown = [(e.step, e.value) for e in accumulated(run_dir / "tensorboard").Scalars("train/loss")]
    assert shown == [(s, float(s)) for s in range(1, 11)] + [(14, 140.0)], shown


def test_events_a_full_disk_tore_are_finished_at_the_next_flush_and_none_is_lost(tmp_path):
    """Issue 48's 1000-fault round: 1,028 of 29,375 steps missing from TensorBoard. A flush on a full
    disk lands a prefix (a short write ends mid-record) and dropped the rest; the next flush appended
    whole records after the torn one, and TensorBoard's reader stops at a torn record: every later event
    of that segment's file was lost. On a real tmpfs filled but for two pages: the failed flush's
    events are kept, the next flush goes on from the byte where the file ends, and every step is shown
    once with its value."""
    from full import fill
    from test_full_disk import tmpfs_disk

    with tmpfs_disk(tmp_path / "disk") as disk:
        run = RunDir(str(disk / "run"))
        run.makedirs()
        log = TensorBoardLog(run, 1, 1, log=lambda _: None)
        name = disk / "run" / log.name
        started = name.stat().st_size
        filler = fill(disk, leave=8192)
        for step in range(1, 2001):
            log.scalar(step, "train/loss", step / 7)
            log.scalar(step, "train/lr", step / 11)
        log.flush()  # ENOSPC after a short write: part of it on disk, the rest kept
        torn = name.stat().st_size
        assert started < torn < started + 2000 * 2 * 30, (started, torn)
        log.flush()  # still full: nothing more lands, nothing lost
        assert name.stat().st_size == torn
        filler.unlink()
        for step in range(2001, 2101):
            log.scalar(step, "train/loss", step / 7)
            log.scalar(step, "train/lr", step / 11)
        log.flush()
        acc = accumulated(disk / "run" / "tensorboard")
        for tag, div in (("train/loss", 7), ("train/lr", 11)):
            shown = [(e.step, e.value) for e in acc.Scalars(tag)]
            assert shown == [(s, float(np.float32(s / div))) for s in range(1, 2101)], (tag, len(shown))


def test_the_event_files_checksum_is_tfrecords_masked_crc32c():
    """andrea's masked CRC-32C (the TFRecord framing of every event) is bit-equal to tensorboard's own,
    on CRC-32C's check value and on data of every length up to two tables' worth and a large one."""
    import random

    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import crc32c
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as theirs

    from andrea_core.train.tensorboard import masked_crc32c

    assert crc32c(b"123456789") == 0xE3069283  # the reference is CRC-32C (Castagnoli)
    rng = random.Random(1)
    cases = [b"", b"123456789", bytes(range(256)) * 2, b"\xff" * 1000]
    cases += [rng.randbytes(n) for n in (*range(1, 520), 70_000)]
    assert [masked_crc32c(d) for d in cases] == [theirs(d) for d in cases]
