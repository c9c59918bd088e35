"""`andrea status` of a live, a stopped and a crashed (SIGKILLed) run, from real trainer processes."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import REPO, _env, andrea, last_logged_step, start_trainer, wait_for
from test_retention import fabricated_run
from tiny import tiny_config

from andrea_core.checkpoint import checkpoint_name
from andrea_core.config import load_run_config
from andrea_core.ops.status import run_status, throughput
from andrea_core.run import lock
from andrea_core.run.lock import read_lock
from andrea_core.run.loss_log import LossEntry
from andrea_core.run.rundir import LOCK, POLICY_YAML, RunDir
from andrea_core.train.setup import create_run

EVERY = 20
MAX = 5000  # run.yaml's max_steps, never reached: the trainer is stopped or killed first
CMDLINE_MAX = 4000  # the live trainer's --max-steps
PACE = 0.05  # seconds per step at least: at most 20 steps/s
TOKENS_PER_STEP = 8 * 64  # andrea-tiny: batch_size x block_size


def status(*runs: str) -> list[dict]:
    return json.loads(andrea("status", *runs, "--json").stdout)


@pytest.mark.slow
def test_status_of_a_live_then_stopped_then_crashed_run(tmp_path):
    run_dir = tmp_path / "run"
    run = RunDir(str(run_dir))
    cfg = tiny_config(tmp_path, train__checkpoint_every=EVERY, train__max_steps=MAX)
    args = ("--config", cfg, "--run-dir", str(run_dir), "--max-steps", str(CMDLINE_MAX), "--pace", str(PACE))

    # --- live ---
    trainer = start_trainer(*args, log=tmp_path / "live.log")
    try:
        wait_for(lambda: last_logged_step(run) >= 2 * EVERY + 5, timeout=300, what="step 45")
        (st,) = status(str(run_dir))
        assert st["state"] == "training", st
        assert st["trainer"]["pid"] == trainer.pid and st["trainer"]["host"] == socket.gethostname()
        assert st["stale_lock"] is None
        assert (st["max_steps"], st["max_steps_from"]) == (CMDLINE_MAX, "trainer command line")
        assert st["step"] >= 2 * EVERY + 5
        assert 0 < st["steps_per_s"] <= 1.1 / PACE
        assert st["tokens_per_s"] == pytest.approx(TOKENS_PER_STEP * st["steps_per_s"])
        assert st["eta_s"] == pytest.approx((CMDLINE_MAX - st["step"]) / st["steps_per_s"])
        assert st["next_checkpoint"] == (st["step"] // EVERY + 1) * EVERY
        assert st["newest_checkpoint"] % EVERY == 0 and st["newest_checkpoint"] >= 2 * EVERY
        assert (st["phase"], st["phase_start"], st["policy"]) == (1, 0, "stdlib-only")
        assert st["audit"]["step"] % EVERY == 0 and st["audit"]["val_loss_mean"] > 0

        text = andrea("status", str(run_dir)).stdout
        assert f"{run_dir}: TRAINING: trainer pid {trainer.pid} on {socket.gethostname()}" in text
        assert "(newest valid)" in text
        # The text's speed and ETA are the run's own figures, not words: tokens/s is the steps/s times
        # the tokens of a step, within the pace, and the ETA the steps left at that speed (this call's
        # reading, a moment after the JSON's: a step or two later).
        shown = re.search(r"^  step +(\d+) of (\d+) ", text, re.M)
        speed = re.search(r"^  speed +([\d,]+) tokens/s, ([\d.]+) steps/s over the last minute$", text, re.M)
        eta = re.search(r"^  ETA +([\d.]+) (s|min|h) \(step (\d+) at ", text, re.M)
        assert shown and speed and eta, text
        step, tokens_per_s, steps_per_s = int(shown[1]), int(speed[1].replace(",", "")), float(speed[2])
        assert int(shown[2]) == int(eta[3]) == CMDLINE_MAX and step >= st["step"], text
        assert 0 < steps_per_s <= 1.1 / PACE, text
        assert abs(tokens_per_s - TOKENS_PER_STEP * steps_per_s) <= TOKENS_PER_STEP * 0.005 + 1, text
        eta_s = float(eta[1]) * {"s": 1, "min": 60, "h": 3600}[eta[2]]
        expected = (CMDLINE_MAX - step) / steps_per_s
        assert abs(eta_s - expected) <= 0.05 * expected + 60, (eta_s, expected, text)  # shown in whole min
    finally:
        trainer.send_signal(signal.SIGTERM)
        assert trainer.wait(timeout=300) == 0

    # --- stopped (SIGTERM: a checkpoint of the step in flight, the lock released) ---
    (st,) = status(str(run_dir))
    assert st["state"] == "stopped", st
    assert st["trainer"] is None and st["stale_lock"] is None and st["eta_s"] is None
    assert st["newest_checkpoint"] == st["step"] == last_logged_step(run)
    # A stopped trainer's --max-steps stays the run's target (target.jsonl): a plain resume trains to it.
    assert (st["max_steps"], st["max_steps_from"]) == (
        CMDLINE_MAX,
        "target.jsonl (andrea train --max-steps, at step 0)",
    )
    text = andrea("status", str(run_dir)).stdout
    assert (
        f"STOPPED: no trainer running, before its target (step {CMDLINE_MAX}); "
        f"`andrea train --run-dir {run_dir}` resumes from " in text
    )
    assert checkpoint_name(st["step"]) in text

    # --- crashed (SIGKILL: no checkpoint, the lock left behind) ---
    stopped_at = st["step"]
    trainer = start_trainer(*args, log=tmp_path / "crash.log")
    try:
        wait_for(
            lambda: last_logged_step(run) >= stopped_at + EVERY + 5,
            timeout=300,
            what="a checkpoint past the stop",
        )
        # Killed with steps logged after its newest checkpoint (frozen first, so that what it wrote is
        # what status reads): the steps a crash loses are then always there to be named.
        while True:
            trainer.send_signal(signal.SIGSTOP)
            if last_logged_step(run) > max(run.checkpoint_steps()):
                break
            trainer.send_signal(signal.SIGCONT)
            wait_for(lambda: last_logged_step(run) % EVERY, timeout=60, what="a step past a checkpoint")
        trainer.send_signal(signal.SIGKILL)
        assert trainer.wait(timeout=60) == -signal.SIGKILL
    finally:
        if trainer.poll() is None:
            trainer.kill()
    assert run.exists(LOCK)
    (st,) = status(str(run_dir))
    assert st["state"] == "crashed", st
    assert st["trainer"] is None and st["stale_lock"]["pid"] == trainer.pid
    assert st["step"] == last_logged_step(run)
    assert st["newest_checkpoint"] > stopped_at and st["newest_checkpoint"] % EVERY == 0
    text = andrea("status", str(run_dir)).stdout
    assert f"CRASHED: trainer pid {trainer.pid} (started " in text
    assert "is dead but its lock remains" in text and "takes over the stale lock" in text
    assert st["step"] > st["newest_checkpoint"], st
    lost = f"steps {st['newest_checkpoint'] + 1}..{st['step']} logged after "
    assert f"{lost}{checkpoint_name(st['newest_checkpoint'])} are lost; " in text, text

    # A closed phase (as a pivot leaves it) and the policy now in force.
    boundary = st["newest_checkpoint"]
    run.makedirs(f"archive/phase_001_step_{boundary:06d}")
    run.write_text(POLICY_YAML, (REPO / "configs" / "policies" / "polish.yaml").read_text())
    (st,) = status(str(run_dir))
    assert (st["phase"], st["phase_start"], st["policy"]) == (2, boundary, "polish")


def test_status_of_several_runs_and_bad_input(tmp_path):
    fresh = tmp_path / "fresh"
    cfg = tiny_config(tmp_path)
    create_run(RunDir(str(fresh)), load_run_config(cfg))  # a run that has not trained yet
    docs = status(str(fresh), str(fresh))
    assert [d["state"] for d in docs] == ["stopped", "stopped"]
    assert docs[0]["newest_checkpoint"] is None and docs[0]["step"] == 0
    assert "not trained yet" in docs[0]["summary"]

    proc = andrea("status", str(fresh), str(tmp_path / "missing"), check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"andrea: error: {tmp_path / 'missing'}: not a run directory (no run.yaml)"
    ]


def entry(step: int, t: float, segment: int = 1) -> LossEntry:
    return LossEntry(step, 2.0, 1e-3, "stdlib-code", TOKENS_PER_STEP, segment, t)


def test_throughput_is_the_last_minute_of_the_newest_segment():
    # Segment 1: a step a second for 100 s; segment 2 resumes from step 50 after a 1000 s gap, at
    # four steps a second for 30 s: only its own steps count, not the gap nor the old segment.
    old = [entry(s, 1000.0 + s) for s in range(1, 101)]
    new = [entry(50 + k, 2100.0 + k / 4, segment=2) for k in range(1, 121)]
    assert throughput(old) == pytest.approx((TOKENS_PER_STEP, 1.0))  # 60 steps in the last 60 s
    assert throughput(old + new) == pytest.approx((4 * TOKENS_PER_STEP, 4.0))
    assert throughput(old[:1]) is None


def test_a_wall_clock_step_does_not_change_the_speed(tmp_path):
    """`.loss.json`'s times are the trainer's wall clock (issue 48, clocks): stepped back 30 s mid-window
    its last minute held 60 s of steps before the step and 5 after it in 35 s of clock (a speed 1.9x
    too high, an ETA half as long); stepped back an hour its last entry was older than the rest (no
    speed at all). Measured after the step only, as read_recent reads the log from its end; a step
    forward leaves a gap outside the window."""
    from andrea_core.run.loss_log import read_recent

    before = [entry(s, 5000.0 + s) for s in range(1, 101)]  # a step a second up to t = 5100
    for shift in (-30.0, -3600.0, 3600.0):
        after = [entry(100 + k, 5100.0 + shift + k) for k in range(1, 11)]
        assert throughput(before + after) == pytest.approx((TOKENS_PER_STEP, 1.0)), shift
        run = RunDir(str(tmp_path / f"run{shift:+.0f}"))
        run.makedirs()
        lines = [json.dumps({"step": e.step, "loss": 2.0, "segment": 1, "time": e.time, "tokens": 64}) + "\n"
                 for e in before + after]  # fmt: skip
        (tmp_path / f"run{shift:+.0f}" / ".loss.json").write_text("".join(lines))
        got = read_recent(run, 60.0, chunk=64)
        assert [e.step for e in got] == list(range(101, 111)), shift
    assert throughput(before + [entry(101, 5100.0 - 30.0)]) is None  # one step since: no speed yet


def test_a_wall_clock_step_forward_in_a_young_segment_does_not_change_the_speed(tmp_path):
    """Issue 48 (the 1000-fault soak, seed 1, faults 90 and 153): a trainer restarted 2 s before its
    clock stepped +30 s. Its segment's last minute of wall clock held 2 s of steps and the 30 s gap:
    status said 0.61 steps/s where it trained 24. Each line now carries "elapsed", its segment's age on
    the trainer's awake clock, and the speed is measured on it: a step of any size changes nothing."""
    from andrea_core.run.loss_log import LossWriter, read_history

    def timed(step: int, t: float, elapsed: float) -> LossEntry:
        return entry(step, t)._replace(elapsed=elapsed)

    young = [timed(s, 5000.0 + s, float(s)) for s in range(1, 11)]  # a step a second, 10 s old
    for shift in (30.0, 50.0, 3600.0, -30.0):
        after = [timed(10 + k, 5010.0 + shift + k, 10.0 + k) for k in range(1, 11)]
        assert throughput(young + after) == pytest.approx((TOKENS_PER_STEP, 1.0)), shift
    # A log from before "elapsed": the wall clock, as before.
    assert throughput([entry(s, 5000.0 + s) for s in range(1, 11)]) == pytest.approx((TOKENS_PER_STEP, 1.0))
    # The writer stamps each line with its segment's age, whatever wall time it is given.
    run = RunDir(str(tmp_path / "run"))
    run.makedirs()
    writer = LossWriter(run)
    for step, t in ((1, 5000.0), (2, 5030.0), (3, 1000.0), (4, 90000.0)):
        writer.log(step, 2.0, 1e-3, "stdlib-code", TOKENS_PER_STEP, t, grad_norm=0.5)
    writer.close()
    got = read_history(run)
    assert [(e.step, e.time, e.grad_norm) for e in got] == [
        (1, 5000.0, 0.5), (2, 5030.0, 0.5), (3, 1000.0, 0.5), (4, 90000.0, 0.5)
    ]  # fmt: skip
    ages = [e.elapsed for e in got]
    assert ages == sorted(ages) and 0.0 <= ages[0] and ages[-1] < 5.0, ages
    assert b'"time":5030.0,"elapsed":' in run.read_bytes(".loss.json")


def test_a_live_trainer_silent_for_a_minute_shows_no_speed(tmp_path):
    run = RunDir(str(tmp_path / "run"))
    create_run(run, load_run_config(tiny_config(tmp_path)))
    t0 = time.time() - 600
    lines = [json.dumps(entry(s, t0 + s)._asdict()) for s in range(1, 31)]
    run.write_text(".loss.json", "\n".join(lines) + "\n")
    me = lock.acquire(run, log=lambda msg: None)  # this process stands in for the live trainer
    try:
        busy = run_status(run.url, now=t0 + 31)
        assert busy.state == "training" and busy.steps_per_s == pytest.approx(1.0)
        assert busy.eta_s == pytest.approx(300 - 30)  # andrea-tiny's max_steps
        silent = run_status(run.url, now=t0 + 30 + 61)
        assert silent.state == "training" and (silent.tokens_per_s, silent.steps_per_s) == (0.0, 0.0)
        assert silent.eta_s is None and "last step logged 61.0 s ago" in silent.summary
    finally:
        lock.release(run, me)


# --- `andrea status` REMOTE (issue 30: a promise no test held the code to)


def test_status_says_remote_for_a_lock_of_another_host_and_names_a_newer_checkpoint_that_fails(tmp_path):
    run = fabricated_run(str(tmp_path / "run"), [100, 200])
    (tmp_path / "run" / checkpoint_name(300)).write_bytes(b"torn by a lost upload")
    holder = subprocess.Popen(
        [sys.executable, "-c", "from andrea_core.run import lock; from andrea_core.run.rundir import RunDir; "
         f"import time; lock.Lease.take(RunDir({run.url!r})); print('held', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True, cwd=REPO,
        env=_env() | {"ANDREA_TEST_HOST": "host-b", "ANDREA_LEASE_RENEW_S": "1", "ANDREA_LEASE_TTL_S": "30"},
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        (st,) = json.loads(andrea("status", run.url, "--json").stdout)
        assert st["state"] == "remote" and st["trainer"] is None
        assert (
            f"locked by trainer pid {holder.pid} on host host-b, which cannot be checked from here"
            in (st["summary"])
        )
        assert st["newest_checkpoint"] == 200
        (why,) = st["refused_checkpoints"]
        assert checkpoint_name(300) in why
        text = andrea("status", run.url).stdout
        assert text.startswith(f"{run.url}: REMOTE: locked by trainer pid {holder.pid} on host host-b")
        assert f"  checkpoint  {checkpoint_name(200)} (newest valid)\n" in text
        assert f"  REFUSED     {why}\n" in text
        assert read_lock(run).host == "host-b"  # status only looked
    finally:
        holder.kill()
        holder.wait()


# --- a small friction a new user met (issue 26.6): a reader that goes away


def test_a_reader_gone_ends_the_command_quietly(tmp_path):
    run = RunDir(str(tmp_path / "run"))
    create_run(run, load_run_config(tiny_config(tmp_path)))
    # `andrea status RUN ... | head -c 100`: far more output than a pipe holds, the reader gone early.
    proc = subprocess.Popen(
        [sys.executable, "-m", "andrea_core", "status", *[run.url] * 200],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
        cwd=REPO,
    )
    assert proc.stdout.read(100).startswith(run.url.encode())
    proc.stdout.close()
    stderr = proc.stderr.read()
    assert (proc.wait(timeout=120), stderr) == (128 + 13, b"")  # as if ended by SIGPIPE, no traceback
