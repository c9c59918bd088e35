"""A trainer killed by the kernel's OOM killer inside a memory-limited cgroup (issue 48, memory): the
supervisor's error names it ("killed by the kernel: out of memory", the group and its limit, the kernel
log's record) rather than a bare SIGKILL, `andrea status` says CRASHED, and the run resumes from its
newest valid checkpoint. A real cgroup and the kernel's own kill (tests/memcg.py); skipped, naming why,
without root or a memory controller."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from conftest import andrea, library_run
from memcg import MemoryGroup, unavailable

from andrea_core.oom import OomWatch
from andrea_core.ops.supervise import TrainerProcess
from andrea_core.run.loss_log import read_history
from andrea_core.run.rundir import RunDir


def test_a_process_we_killed_is_not_said_to_be_out_of_memory():
    """No false claim: a SIGKILL that was not the kernel's (an operator's kill -9) says nothing."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    watch = OomWatch(proc.pid)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert watch.why() is None


@pytest.mark.skipif(bool(unavailable()), reason=f"memory cgroup: {unavailable()}")
def test_a_trainer_killed_by_the_oom_killer_is_named_as_such_and_resumes(tmp_path, tmp_path_factory):
    run = RunDir(library_run(tmp_path_factory, tmp_path / "run", 20))  # andrea-tiny at step 20
    with MemoryGroup("test-oom") as group:
        with group.joined():  # born in the group, as a trainer under a unit's MemoryMax is
            trainer = TrainerProcess(run.url, max_steps=100_000, pace=0.02).start()
        for _ in trainer.lines():
            if trainer.step is not None and trainer.step >= 24:
                break
        assert group.oom_kill(trainer.pid), "the kernel did not kill the trainer"
        for _ in trainer.lines():
            pass
        outcome = trainer.outcome()  # while its group is there, as a systemd unit's is
    assert outcome.returncode == -signal.SIGKILL and outcome.reason == "killed"
    text = outcome.describe()
    assert "trainer was killed (signal SIGKILL, killed by the kernel: out of memory (memory cgroup " in text
    assert str(group.path) in text and "limit " in text, text
    if os.geteuid() == 0:  # the kernel log is root's here (dmesg_restrict)
        assert f"Killed process {trainer.pid} (" in text, text

    # What status says of it, and the resume from the newest valid checkpoint.
    (st,) = json.loads(andrea("status", run.url, "--json").stdout)
    assert st["state"] == "crashed", st
    newest = st["newest_checkpoint"]
    assert newest is not None and newest >= 20
    logged = read_history(run)[-1].step
    again = TrainerProcess(run.url, max_steps=logged + 4).start()
    for _ in again.lines():
        pass
    done = again.outcome()
    assert done.reason == "completed" and done.step == logged + 4, done.describe()
    steps = [e.step for e in read_history(run)]
    assert steps == list(range(1, logged + 5)), "the canonical history: every step once, none lost"
