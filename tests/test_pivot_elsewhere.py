"""A trainer that cannot be checked from here is a live trainer elsewhere (issue 23.1, 23.7): one verdict,
lock.trainer_liveness, for every caller. Run from another pid namespace (unshare, real) or another
host (ANDREA_TEST_HOST): a gc and a fork of the newest checkpoint refuse, naming the host, the lease
generation and how recently it was renewed, and touch nothing; `andrea status` says the trainer cannot
be checked instead of calling it crashed; and a pivot asks the trainer through the run directory (a
request file it reads at each lease renewal), so it works from any machine that shares the storage."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    REPO,
    _env,
    andrea,
    last_logged_step,
    library_run,
    start_trainer,
    wait_for,
    warm_launcher,
)

from andrea_core.run.lock import REQUEST
from andrea_core.run.rundir import LOCK, LOSS_LOG, RunDir
from tests.tiny import tiny_config

EVERY = 20
FAST_LEASE = {"ANDREA_LEASE_RENEW_S": "1", "ANDREA_LEASE_TTL_S": "3"}
# A lease unrenewed for twice its ttl is a dead trainer's (a pivot then stops waiting): 60 s here, time
# for a restart to take it over.
SLOW_LEASE = {"ANDREA_LEASE_RENEW_S": "1", "ANDREA_LEASE_TTL_S": "30"}


def run_files(run: RunDir) -> dict[str, str]:
    """Every file of the run but the ones a live trainer keeps writing, with its bytes' hash."""
    found = run.fs.find(run.root)
    skip = (".loss.json", ".trainer.json", "trainer.log", ".samples.json", ".state.json")
    names = [p.removeprefix(run.root + "/") for p in found if ".tmp." not in p]  # a write in flight
    # Checkpoints and TensorBoard's event files (appended at each checkpoint) are the live trainer's too,
    # left unread: retention may delete a listed checkpoint before it is read.
    names = [n for n in names if not n.endswith(skip) and not n.startswith(("step_", "tensorboard/"))]
    return {n: hashlib.sha256(run.read_bytes(n)).hexdigest()[:12] for n in names}


def elsewhere(how: str) -> tuple[list[str], dict[str, str]]:
    """The command prefix and environment of a process that cannot check the trainer's pid."""
    if how == "pid-namespace":
        if shutil.which("unshare") is None:
            pytest.skip("no unshare(1) here")
        probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
        if probe.returncode != 0:
            pytest.skip(f"unshare --pid is not permitted here: {probe.stderr.decode().strip()}")
        return ["unshare", "--pid", "--fork", "--mount-proc"], _env() | FAST_LEASE
    return [], _env() | FAST_LEASE | {"ANDREA_TEST_HOST": "host-b"}


def andrea_from(prefix: list[str], env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """`andrea ARGS` under `prefix` (another pid namespace: a cold start under unshare) or, with none,
    as another host (its env: forked warm by the worker's launcher, conftest.andrea)."""
    if not prefix:
        return andrea(*args, env=env, check=False, timeout=300)
    return subprocess.run(
        [*prefix, sys.executable, "-m", "andrea_core", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )


def _answer(log: Path, line: str, grid_after: int) -> tuple[str, int] | None:
    """How the trainer answered the checkpoint request it logged as `line`: the first checkpoint N >
    `grid_after` written after that line, ("in flight", N) off the grid (only a request makes one:
    its "SIGUSR1: checkpoint of step N requested" precedes it), ("grid", N) on it (the step in flight
    was a grid one). The SIGUSR1 line may precede `line`: an earlier request whose flag landed just
    after a grid step cleared it asks again at the next step, while this one is taken."""
    text = log.read_text()
    if line not in text:
        return None
    rest = text[text.index(line) :]
    written = [int(n) for n in re.findall(r"checkpoint step_(\d+)\.bin \(", rest) if int(n) > grid_after]
    if not written:
        return None
    step = written[0]
    if step % EVERY == 0:
        return ("grid", step)
    asked = text.index(f"SIGUSR1: checkpoint of step {step} requested")
    assert asked < text.index(f"checkpoint step_{step:06d}.bin ("), text[max(0, asked - 2000) :]
    return ("in flight", step)


@pytest.mark.parametrize(
    "how, at", [("pid-namespace", "now"), pytest.param("another-host-s3", "boundary", marks=pytest.mark.slow)]
)
def test_nothing_is_pivoted_abandoned_collected_or_forked_under_a_trainer_that_cannot_be_checked(
    how, at, tmp_path, request
):
    if how == "pid-namespace":
        url, host = str(tmp_path / "run"), None
    else:
        url, host = f"{request.getfixturevalue('s3_bucket')}/run", "host-a"
    run = RunDir(url)
    prefix, env = elsewhere(how)
    cfg = tiny_config(tmp_path, train__checkpoint_every=EVERY)
    trainer_env = _env() | FAST_LEASE | ({"ANDREA_TEST_HOST": host} if host else {})
    trainer = start_trainer(
        "--config", cfg, "--run-dir", url, "--device", "cpu", "--max-steps", "100000", "--pace", "0.05",
        env=trainer_env, log=tmp_path / "trainer.log",
    )  # fmt: skip
    try:
        wait_for(lambda: len(run.checkpoint_steps()) >= 2 and run.exists(".state.json"), 300, "checkpoints")
        before = run_files(run)
        where = "another pid namespace" if how == "pid-namespace" else "host host-a"
        for args, doing in (
            (["fork", url, "--branch", "x"], "not forking its newest checkpoint"),
            (["pivot", url, "--abandon"], "no pivot under way"),
        ):
            proc = andrea_from(prefix, env, *args)
            assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
            err = proc.stderr
            assert err.startswith("andrea: error: ") and err.count("\n") == 1, err
            assert doing in err, err
            if args[0] == "fork":
                assert "cannot be checked from here" in err and where in err, err
                assert "its lease (generation 1," in err and "was last renewed at" in err, err
            assert run_files(run) == before, f"andrea {' '.join(args)} touched the run"
        gc = andrea_from(prefix, env, "gc", url, "--keep-last", "2")
        assert gc.returncode == 2 and "its lease (generation 1) was renewed" in gc.stderr, gc.stderr
        assert "deleted" not in gc.stdout + gc.stderr, "gc deleted a checkpoint under a live trainer"
        # 23.7: status from there says it cannot be checked; it never calls a live trainer crashed.
        status = andrea_from(prefix, env, "status", url)
        assert status.returncode == 0, status.stderr
        assert ": REMOTE: " in status.stdout and "cannot be checked from here" in status.stdout, status.stdout
        assert "CRASHED" not in status.stdout
        assert trainer.poll() is None and not run.exists("pivot.json") and not run.exists("archive")

        # A request addressed to another lease generation (one left behind, or forged) is not this
        # trainer's: two renewals later it still trains, having taken none.
        held = json.loads(run.read_bytes(LOCK))
        stale = {"format": 1, "request": "stop", "generation": held["generation"] + 1, "id": "not-yours"}
        run.write_json(REQUEST, stale | {"by": "host-z", "at": time.time()})
        renewals = []
        wait_for(lambda: renewals.append(run.read_bytes(LOCK)) or len(set(renewals)) >= 3, 60, "two renewals")
        assert trainer.poll() is None and "requested by" not in (tmp_path / "trainer.log").read_text()

        # A checkpoint request of its own generation is taken at the next renewal and written at the
        # end of the step in flight, as SIGUSR1's, and the trainer trains on. Asked again (a new id)
        # while the answer could be a grid checkpoint: a trainer ignoring the request gives only those.
        for attempt in range(5):
            line, newest = f"checkpoint requested by test-asker-{attempt} ", max(run.checkpoint_steps())
            ask = {"format": 1, "request": "checkpoint", "generation": held["generation"], "id": str(attempt)}
            run.write_json(REQUEST, ask | {"by": f"test-asker-{attempt}", "at": time.time()})
            answer = functools.partial(_answer, tmp_path / "trainer.log", line, newest)
            how, step = wait_for(answer, 60, f"the trainer's answer to {line!r}")
            assert how == "in flight" or step % EVERY == 0, (how, step)
            if how == "in flight":
                assert run.read_checkpoint(step).step == step
                break
        else:
            raise AssertionError("5 checkpoint requests taken, and no checkpoint off the grid for any")
        assert trainer.poll() is None and "stop requested by" not in (tmp_path / "trainer.log").read_text()

        # The pivot itself asks that trainer through the run directory: at "now" a checkpoint request
        # (as SIGUSR1: the step in flight), at "boundary" none (the next checkpoint on the grid); then
        # it stops at the stop request as on SIGTERM (exit 0), and the pivot completes from here.
        newest, logged = max(run.checkpoint_steps()), last_logged_step(run)
        loss_log = run.read_bytes(LOSS_LOG)
        pivot = andrea_from(prefix, env, "pivot", url, "--policy", "tiny-mix", "--no-restart", "--at", at)
        assert pivot.returncode == 0, pivot.stdout + pivot.stderr
        assert "to stop (" in pivot.stdout and ".trainer-request.json" in pivot.stdout, pivot.stdout
        assert trainer.wait(120) == 0
        log = (tmp_path / "trainer.log").read_text()
        assert "stop requested by" in log and "(as SIGTERM)" in log, log[-2000:]
        boundary = int(re.search(r"pivot checkpoint step_(\d+)\.bin is valid", pivot.stdout)[1])
        pivot_asks = [x for x in log.splitlines() if "checkpoint requested by" in x and "test-asker" not in x]
        if at == "now":
            assert "asked (.trainer-request.json)" in pivot.stdout, pivot.stdout
            assert boundary > logged and boundary > newest, (boundary, logged, newest)
            # The request is read at a renewal; a grid checkpoint written before that is the one the
            # pivot takes, and its stop request may then replace the checkpoint request unread (the file
            # holds one request; the stop checkpoints too). Either the trainer took the checkpoint
            # request before the stop, or it never saw it and the pivot checkpoint is a grid one.
            assert len(pivot_asks) <= 1, log[-2000:]
            if pivot_asks:
                assert log.index(pivot_asks[0]) < log.index("stop requested by"), log[-2000:]
            else:
                assert boundary % EVERY == 0, (boundary, log[-2000:])
        else:
            assert not pivot_asks, log[-2000:]
            assert boundary % EVERY == 0 and boundary > newest, (boundary, newest)
        folder = run.listdir("archive")
        assert folder == [f"phase_001_step_{boundary:06d}"] and run.exists(f"archive/{folder[0]}/.state.json")
        assert not run.exists(".state.json") and not run.exists("pivot.json")
        assert "name: tiny-mix" in run.read_text("policy.yaml")
        # The audit trail only grew, and the new phase starts at the pivot checkpoint.
        assert run.read_bytes(LOSS_LOG).startswith(loss_log)
        assert max(run.checkpoint_steps()) >= boundary and run.read_checkpoint(boundary).step == boundary
    finally:
        trainer.send_signal(signal.SIGTERM)
        trainer.wait(120)
    assert Path(tmp_path / "trainer.log").read_text().count("lost its lease") == 0


def past(log: Path, boundary: int) -> list[int]:
    """The checkpoints past `boundary` a trainer's log says it published."""
    text = log.read_text() if log.exists() else ""
    return [s for s in map(int, re.findall(r"checkpoint step_(\d+)\.bin \(", text)) if s > boundary]


def _run_at_20(tmp_path: Path, tmp_path_factory) -> RunDir:
    """The library's andrea-tiny at step 20 (a checkpoint every 10, no sample audit), a copy of its own."""
    every = dict(train__checkpoint_every=10, train__sample_every=10**6)
    return RunDir(str(library_run(tmp_path_factory, tmp_path / "run", 20, "--device", "cpu", **every)))


def _trainer_of_host_a(run: RunDir, tmp_path: Path) -> tuple[subprocess.Popen, tuple[str, ...], dict]:
    """A trainer of host-a training `run` on SLOW_LEASE (log: tmp_path/first.log), its args and env."""
    host_a = _env() | SLOW_LEASE | {"ANDREA_TEST_HOST": "host-a"}
    args = ("--run-dir", run.url, "--device", "cpu", "--max-steps", "100000", "--pace", "0.05")
    return start_trainer(*args, env=host_a, log=tmp_path / "first.log"), args, host_a


def test_a_trainer_restarted_while_a_remote_pivot_waits_for_the_stop_is_stopped_too(
    tmp_path, tmp_path_factory
):
    """Issue 48 (the soak's pivot-remote, seed 1): the trainer a pivot from another host asked to stop
    dies before it reads the request, and one restarted in its place (as systemd would) takes the lease
    over. The pivot used to take the takeover for the stop, record "stopped" under the new trainer and
    fail ("appended unexpectedly"), a half-done pivot every later trainer refused. Now it asks the new
    holder to stop as well, then completes: that trainer's steps are the closed phase's tail, archived,
    and the next trainer trains the new phase from boundary + 1."""
    run = _run_at_20(tmp_path, tmp_path_factory)
    first, args, host_a = _trainer_of_host_a(run, tmp_path)
    second = pivot = None
    try:
        wait_for(lambda: last_logged_step(run) > 20, 300, "the first trainer's step 21")
        generation = json.loads(run.read_bytes(LOCK))["generation"]
        loss_log = run.read_bytes(LOSS_LOG)
        loss_log = loss_log[: loss_log.rfind(b"\n") + 1]  # whole lines: one may be being appended
        launcher = warm_launcher()  # a real process, forked warm (stopped and continued below)
        pivot = (launcher.popen if launcher else subprocess.Popen)(
            [sys.executable, "-m", "andrea_core", "pivot", run.url, "--policy", "tiny-mix", "--no-restart"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=_env() | SLOW_LEASE | {"ANDREA_TEST_HOST": "host-b"},
            cwd=REPO,
        )
        boundary = wait_for(
            lambda: (json.loads(run.read_bytes("pivot.json")) if run.exists("pivot.json") else {}).get(
                "boundary"
            ),
            300,
            "the pivot's intent",
        )
        wait_for(lambda: run.exists(f"step_{boundary:06d}.bin"), 300, "the boundary checkpoint")
        first.send_signal(signal.SIGSTOP)  # it reads requests after a renewal (each second): none now
        stop = wait_for(
            lambda: run.exists(REQUEST) and json.loads(run.read_bytes(REQUEST)), 300, "the stop request"
        )
        assert stop["request"] == "stop" and stop["generation"] == generation, stop
        pivot.send_signal(signal.SIGSTOP)  # the restart trains a checkpoint's worth before it looks
        first.kill()  # dead before it read the request
        assert first.wait(60) == -signal.SIGKILL
        second = start_trainer(*args, env=host_a, log=tmp_path / "second.log")  # as systemd would
        wait_for(lambda: past(tmp_path / "second.log", boundary), 300, "the restart's checkpoint")
        pivot.send_signal(signal.SIGCONT)
        out, _ = pivot.communicate(timeout=600)
        assert pivot.returncode == 0, out
        assert f"asked trainer pid {first.pid} on host-a to stop" in out, out
        assert f"took the run over (lease generation {generation + 1})" in out, out
        assert f"asked trainer pid {second.pid} on host-a to stop" in out, out
        assert second.wait(120) == 0
        log = (tmp_path / "second.log").read_text()
        assert "taking over the stale lock of dead trainer" in log and "stop requested by host-b" in log, log
        # The restarted trainer's steps are the closed phase's: its checkpoints past the boundary (the
        # stop's the last) are in the archive with the old phase's state, its steps in .loss.json after
        # the bytes before the pivot, and the run's newest checkpoint is the boundary.
        folder = f"archive/phase_001_step_{boundary:06d}"
        tail = sorted(int(n[5:11]) for n in run.listdir(folder) if n.startswith("step_"))
        wrote = past(tmp_path / "second.log", boundary)
        assert set(wrote) <= set(tail) and tail[-1] == max(wrote) and min(tail) > boundary, (tail, log)
        logged = [json.loads(x)["step"] for x in run.read_bytes(LOSS_LOG)[len(loss_log) :].splitlines()]
        assert max(wrote) in logged, (wrote, logged)
        assert max(run.checkpoint_steps()) == boundary and not run.exists("pivot.json")
        assert run.exists(f"{folder}/.state.json") and not run.exists(".state.json")
        assert "name: tiny-mix" in run.read_text("policy.yaml")
        assert run.read_bytes(LOSS_LOG).startswith(loss_log)
        # Nothing is wedged: the next trainer trains the new phase from the pivot point.
        size = len(run.read_bytes(LOSS_LOG))
        trainer = andrea_from([], host_a, "train", *args[:4], "--max-steps", str(boundary + 2))
        assert trainer.returncode == 0, trainer.stdout + trainer.stderr
        new = [json.loads(x)["step"] for x in run.read_bytes(LOSS_LOG)[size:].splitlines() if x.strip()]
        assert new == [boundary + 1, boundary + 2], new
    finally:
        for p in (first, second, pivot):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def _pivot_journal(run: RunDir) -> dict:
    return json.loads(run.read_bytes("pivot.json")) if run.exists("pivot.json") else {}


@pytest.mark.parametrize("at", ["boundary", pytest.param("now", marks=pytest.mark.slow)])
def test_a_trainer_killed_before_the_stop_request_and_restarted_is_pivoted_not_a_failed_pivot(
    at, tmp_path, tmp_path_factory
):
    """Issue 48 (the soak's pivot-remote, a kill landing before the pivot asked the trainer to stop): the
    trainer a pivot from another host waits on for its pivot checkpoint is killed before it wrote it, and
    one restarted in its place (as systemd would) takes the lease over. The pivot used to fail (exit 1,
    "exited before writing step_N.bin" / "before checkpointing"); now it decides again against the new
    holder, takes its pivot checkpoint, stops it and completes: one phase folder, the boundary the
    newest checkpoint, written by the restarted trainer, .loss.json's bytes before it a prefix."""
    run = _run_at_20(tmp_path, tmp_path_factory)
    first, args, host_a = _trainer_of_host_a(run, tmp_path)
    second = pivot = None
    try:
        wait_for(lambda: last_logged_step(run) > 20, 300, "the first trainer's step 21")
        generation = json.loads(run.read_bytes(LOCK))["generation"]
        first.send_signal(signal.SIGSTOP)  # it writes nothing more, reads no request: killed below
        loss_log = run.read_bytes(LOSS_LOG)
        loss_log = loss_log[: loss_log.rfind(b"\n") + 1]
        launcher = warm_launcher()  # a real process, forked warm (not a test of start-up)
        pivot = (launcher.popen if launcher else subprocess.Popen)(
            [sys.executable, "-m", "andrea_core", "pivot", run.url, "--policy", "tiny-mix", "--no-restart",
             "--at", at],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=_env() | SLOW_LEASE | {"ANDREA_TEST_HOST": "host-b"}, cwd=REPO,
        )  # fmt: skip
        # The pivot waits on the first trainer: its intent is on disk (at "now" its checkpoint request).
        wait_for(lambda: _pivot_journal(run).get("step") == "intent", 300, "the pivot's intent")
        if at == "now":
            wait_for(lambda: run.exists(REQUEST), 300, "the pivot's checkpoint request")
            assert json.loads(run.read_bytes(REQUEST))["request"] == "checkpoint"
        newest = max(run.checkpoint_steps())
        first.kill()  # before the pivot asked it to stop
        assert first.wait(60) == -signal.SIGKILL
        second = start_trainer(*args, env=host_a, log=tmp_path / "second.log")  # as systemd would
        out, _ = pivot.communicate(timeout=600)
        assert pivot.returncode == 0, out
        assert f"trainer pid {first.pid} no longer holds the run" in out and "deciding again" in out, out
        assert f"asked trainer pid {second.pid} on host-a to stop" in out, out
        assert f"trainer pid {first.pid} on host-a to stop" not in out, out  # never asked: it was dead
        assert second.wait(120) == 0
        log = (tmp_path / "second.log").read_text()
        assert "taking over the stale lock of dead trainer" in log and "stop requested by host-b" in log, log
        assert f"generation {generation + 1})" in log, log
        boundary = int(re.search(r"pivot checkpoint step_(\d+)\.bin is valid", out)[1])
        # The pivot checkpoint is the restarted trainer's, past what the killed one had written.
        assert boundary > newest and f"checkpoint step_{boundary:06d}.bin (" in log, (boundary, newest, log)
        if at == "boundary":
            assert boundary % 10 == 0, boundary
        else:
            assert f"asked (.trainer-request.json) trainer pid {second.pid} on host-a" in out, out
        assert run.listdir("archive") == [f"phase_001_step_{boundary:06d}"]
        assert max(run.checkpoint_steps()) == boundary and not run.exists("pivot.json")
        assert run.read_checkpoint(boundary).step == boundary
        assert run.read_bytes(LOSS_LOG).startswith(loss_log)
    finally:
        for p in (first, second, pivot):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.slow
def test_a_trainer_that_takes_the_run_after_the_stop_is_waited_for_not_a_trainer_elsewhere(
    tmp_path, s3_bucket, s3_server
):
    """Issue 48 (the soak's pivot-remote, seed 2: a rerun exited 2, "cannot be checked from here"): a
    trainer that started before a pivot stopped the run, and takes the released run once the stop is on
    disk, holds the lock for a moment while it reads the journal, finds the pivot half done and refuses.
    A pivot (here the rerun of one killed mid-archive) that met it there refused to archive under "a live
    trainer elsewhere" and exited 2, a half-done pivot left. Now step 3 waits for it to release the run,
    and completes. The moment is made long for certain: the second trainer's read of pivot.json is held
    by its link to the store (tests/s3_relay.py) and the trainer frozen while it holds the lock."""
    from s3_relay import Relay, RelayFaults

    url = f"{s3_bucket}/run"
    run = RunDir(url)
    cfg = tiny_config(tmp_path, train__checkpoint_every=10, train__sample_every=10**6)
    lease = SLOW_LEASE
    faults = RelayFaults()
    link = Relay(s3_server.port, faults, host="host-c")
    args = ("--run-dir", url, "--device", "cpu", "--max-steps", "100000", "--pace", "0.05")
    host_a = _env() | lease | {"ANDREA_TEST_HOST": "host-a"}
    host_b = _env() | lease | {"ANDREA_TEST_HOST": "host-b"}
    host_c = _env() | lease | s3_server.env(link.endpoint)
    host_c |= {"ANDREA_TEST_HOST": "host-c", "ANDREA_LEASE_WAIT_S": "600"}
    first = start_trainer("--config", cfg, *args, env=host_a, log=tmp_path / "first.log")
    second = rerun = None
    try:
        wait_for(lambda: run.checkpoint_steps() and last_logged_step(run) > 12, 300, "a checkpoint")
        # The second trainer starts while no pivot is under way, and waits for the first one's lease.
        second = start_trainer(*args, env=host_c, log=tmp_path / "second.log")
        wait_for(
            lambda: "watching whether it renews" in (tmp_path / "second.log").read_text(), 300, "the wait"
        )
        second.send_signal(signal.SIGSTOP)  # it takes the run only once the stop is on disk
        killed = andrea_from(
            [], host_b | {"ANDREA_TEST_PIVOT_KILL_AFTER": "archive-move-1"},
            "pivot", url, "--policy", "tiny-mix", "--no-restart",
        )  # fmt: skip
        assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
        assert first.wait(120) == 0
        journal = _pivot_journal(run)
        assert journal["step"] == "archiving", journal
        boundary, loss_log = journal["boundary"], run.read_bytes(LOSS_LOG)
        faults.hang = {"host": "host-c", "match": r"pivot\.json", "for_s": 6.0}
        second.send_signal(signal.SIGCONT)
        wait_for(lambda: faults.hung, 120, "the second trainer's read of pivot.json")
        second.send_signal(signal.SIGSTOP)  # holding the lock, its read of the journal in flight
        held = json.loads(run.read_bytes(LOCK))
        assert held["pid"] == second.pid and not held["released"], (held, faults.hung)
        log = tmp_path / "rerun.log"
        with open(log, "wb") as out:
            launcher = warm_launcher()  # a real process, forked warm (not a test of start-up)
            rerun = (launcher.popen if launcher else subprocess.Popen)(
                [sys.executable, "-m", "andrea_core", "pivot", url, "--policy", "tiny-mix", "--no-restart"],
                stdout=out, stderr=subprocess.STDOUT, env=host_b, cwd=REPO,
            )  # fmt: skip
        waits = f"trainer pid {second.pid} on host-c took the run (lease generation"
        at_archive = lambda: waits in log.read_text() or rerun.poll() is not None  # noqa: E731
        wait_for(at_archive, 300, "the rerun at the archive")
        second.send_signal(signal.SIGCONT)
        assert rerun.wait(300) == 0, log.read_text()
        said = log.read_text()
        assert "cannot be checked from here" not in said and "after the stop was recorded" in said, said
        assert second.wait(120) == 2
        refused = (tmp_path / "second.log").read_text()
        assert "taking the released lock" in refused and "is half done" in refused, refused
        assert "training steps" not in refused, refused
        # The pivot is complete and the refusing trainer wrote nothing: the loss log as at the stop.
        assert run.listdir("archive") == [f"phase_001_step_{boundary:06d}"]
        assert max(run.checkpoint_steps()) == boundary and not run.exists("pivot.json")
        assert run.read_bytes(LOSS_LOG) == loss_log
        assert json.loads(run.read_bytes(LOCK))["released"] is True
    finally:
        for p in (first, second, rerun):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait()
        link.shutdown()


def test_a_rerun_pivot_finds_the_new_phase_trained_on_another_host_and_starts_no_second_trainer(
    tmp_path, tmp_path_factory
):
    """A pivot killed before its restart, and a trainer started on another host meanwhile (systemd
    there) that trains the new phase: the rerun confirms that trainer's first step and starts none of
    its own. It used to ask only whether a trainer was alive *here*, start a detached one, and leave it
    waiting on the other host's lease, to take the run over once that one stopped."""
    run = _run_at_20(tmp_path, tmp_path_factory)
    pivot = ("pivot", run.url, "--policy", "tiny-mix", "--max-steps", "100000", "--timeout", "300")
    killed = andrea_from([], _env() | {"ANDREA_TEST_PIVOT_KILL_AFTER": "installed"}, *pivot)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    assert _pivot_journal(run)["step"] == "installed" and _pivot_journal(run)["boundary"] == 20
    prefix, host_b = elsewhere("another-host")
    args = ("--run-dir", run.url, "--device", "cpu", "--max-steps", "100000", "--pace", "0.05")
    other = start_trainer(*args, env=host_b, log=tmp_path / "host-b.log")
    rerun = None
    try:
        wait_for(lambda: last_logged_step(run) > 20, 300, "host-b's first step of the new phase")
        rerun = andrea_from([], _env() | FAST_LEASE, *pivot)
        assert rerun.returncode == 0, rerun.stdout + rerun.stderr
        assert "resumed trainer pid" not in rerun.stdout, rerun.stdout
        assert f"resumed at step 21, trainer pid {other.pid} on host-b (cannot be checked from here)" in (
            rerun.stdout
        ), rerun.stdout
        assert not run.exists("pivot.json") and not Path(run.log_path("trainer.log")).exists()
        assert other.poll() is None  # still the run's one trainer
    finally:
        if rerun is not None and (started := re.search(r"resumed trainer pid (\d+)", rerun.stdout)):
            subprocess.run(["kill", "-9", started[1]], check=False)  # the old code's second trainer
        other.send_signal(signal.SIGTERM)
        assert other.wait(120) == 0, (tmp_path / "host-b.log").read_text()
    steps = [json.loads(x)["step"] for x in run.read_bytes(LOSS_LOG).splitlines() if x.strip()]
    assert steps[:21] == list(range(1, 22)) and steps == sorted(set(steps)), steps


@pytest.mark.parametrize("own", ["ended", "waiting"])
def test_a_trainer_restarted_elsewhere_that_takes_the_run_before_the_pivots_own_is_the_one_named(
    tmp_path, tmp_path_factory, own
):
    """Issue 48 (the soak's pivot-remote, seed 1, fault 144): after the install, a trainer restarted on
    another host (systemd there) took the released lock before the trainer `pivot --restart` had just
    started could, and trained the new phase. The pivot confirmed that trainer's first step but named
    its own trainer's pid with the other's host ("trainer pid P on soak-b"), a process that host never
    had; and had its own trainer been refused before the other's first step, it failed the pivot ("the
    trainer ended before logging a step"). Now the holder is named with its own host, the started one
    apart with how it ended (or that it waits), and the pivot waits for the holder's first step."""
    run = _run_at_20(tmp_path, tmp_path_factory)
    # The pivot's trainer (it inherits this env) holds its start-up until the test ends it: host-b's
    # trainer takes the run first, for certain.
    env = _env() | FAST_LEASE | {"ANDREA_TEST_STARTUP_DELAY": "300"}
    argv = ["pivot", run.url, "--policy", "tiny-mix", "--max-steps", "100000", "--timeout", "300"]
    launcher = warm_launcher()
    pivot = (launcher.popen if launcher else subprocess.Popen)(
        [sys.executable, "-m", "andrea_core", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=REPO,
    )
    other = None
    lines: list[str] = []
    try:
        for line in pivot.stdout:
            lines.append(line)
            if started := re.search(r"resumed trainer pid (\d+) ", line):
                break
        assert started, "".join(lines)
        mine = int(started[1])
        _, host_b = elsewhere("another-host")
        # Its first loss entry (logged with the next step) comes seconds after it took the lock.
        args = ("--run-dir", run.url, "--device", "cpu", "--max-steps", "100000", "--pace", "3")
        other = start_trainer(*args, env=host_b, log=tmp_path / "host-b.log")
        wait_for(lambda: json.loads(run.read_bytes(LOCK))["pid"] == other.pid, 300, "host-b's lock")
        assert b"train" in Path(f"/proc/{mine}/cmdline").read_bytes()  # the pivot's trainer, still held
        if own == "ended":
            os.kill(mine, signal.SIGTERM)  # it ends before host-b's trainer logs its first step
        out, _ = pivot.communicate(timeout=600)
        out = "".join(lines) + out
        assert pivot.returncode == 0, out
        assert last_logged_step(run) >= 21
        named = rf"resumed at step 21, trainer pid {other.pid} on host-b \(cannot be checked from here\); "
        if own == "ended":
            named += rf"the one this pivot started found the run taken: trainer pid {mine} exited with "
        else:
            named += rf"the one this pivot started, pid {mine}, waits for the run \(output in "
            assert Path(f"/proc/{mine}").exists()
            os.kill(mine, signal.SIGTERM)  # still held in start-up: it ends there
        assert re.search(named, out), out
        holder = json.loads(run.read_bytes(LOCK))
        assert (holder["pid"], holder["host"]) == (other.pid, "host-b")
    finally:
        if pivot.poll() is None:
            pivot.kill()
            pivot.wait()
        if other is not None:
            other.send_signal(signal.SIGTERM)
            assert other.wait(120) == 0, (tmp_path / "host-b.log").read_text()
    steps = [json.loads(x)["step"] for x in run.read_bytes(LOSS_LOG).splitlines() if x.strip()]
    assert steps[:21] == list(range(1, 22)) and steps == sorted(set(steps)), steps
