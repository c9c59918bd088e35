"""A trainer killed by the kernel's OOM killer inside a memory-limited cgroup (issue 48, memory): the
supervisor's error names it ("killed by the kernel: out of memory", the group and its limit, the kernel
log's record) rather than a bare SIGKILL, `andrea status` says CRASHED, and the run resumes from its
newest valid checkpoint; and the kernel takes the trainer, not its supervisor, though the supervisor is
the larger (a Prefect flow-run process is), so that the supervisor lives to restart it. A real cgroup
and the kernel's own kill (tests/memcg.py); skipped, naming why, without root or a memory controller."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO, _env, andrea, library_run
from memcg import MemoryGroup, unavailable
from tiny import tiny_config

from andrea_core.oom import TRAINER_OOM_BIAS, OomWatch
from andrea_core.ops.supervise import TrainerProcess, wait_for_logged_step
from andrea_core.run.lock import read_lock
from andrea_core.run.loss_log import read_history
from andrea_core.run.rundir import RunDir

# The supervisor's ballast: it must be the group's larger process for the kernel's choice to show the
# bias. Rank 0 of a 2-rank job held 420,676 kB after 3 steps in a fresh clone's CI under load
# (2026-12-07), past a 320 MiB ballast's supervisor (374,664 kB).
BALLAST = 512 << 20


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


# A supervisor as the Prefect task is one (supervise.TrainerProcess), as large as a flow-run process
# (about 330 MB resident; the CPU trainer here about 285 MB): it follows its trainer to its end, says how
# it ended, and starts the next one, which resumes and trains 4 steps.
SUPERVISOR = textwrap.dedent(
    """
    import sys
    from andrea_core.ops.supervise import TrainerProcess
    from andrea_core.run.loss_log import read_history
    from andrea_core.run.rundir import RunDir
    ballast = b"x" * int(sys.argv[2])
    t = TrainerProcess(sys.argv[1], max_steps=100_000, pace=0.02).start()
    print("TRAINER", t.pid, flush=True)
    for _ in t.lines():
        pass
    print("OUTCOME", t.outcome().describe(), flush=True)
    last = read_history(RunDir(sys.argv[1]))[-1].step
    again = TrainerProcess(sys.argv[1], max_steps=last + 4).start()
    for _ in again.lines():
        pass
    done = again.outcome()
    print("RESTARTED", done.reason, done.step, last, flush=True)
    """
)


@pytest.mark.skipif(bool(unavailable()), reason=f"memory cgroup: {unavailable()}")
def test_the_oom_killer_takes_the_trainer_not_its_larger_supervisor_which_restarts_it(
    tmp_path, tmp_path_factory
):
    """Without the trainer's raised oom_score_adj (andrea_core.pdeathsig) the kernel kills the larger
    process of the group: the supervisor, and nobody restarts the trainer (it gets its parent-death
    SIGTERM). The kernel may follow its first kill with a second one in the same episode, while the
    victim is still charged to the group (the hog's charge retried, 4-9 ms later: often on this VM's
    kernel 6.18, an artifact of a third process allocating); the claim is the kernel's first choice,
    so such a run, its first victim the trainer, is thrown again in a fresh group, and after three
    the test is skipped, naming the victims; a first victim other than the trainer fails at once."""
    twice: list[list[int]] = []  # the kernel's victims of each episode it killed twice in
    for attempt in range(3):
        run = RunDir(library_run(tmp_path_factory, tmp_path / f"run{attempt}", 20))
        with MemoryGroup("test-oom-sup") as group:
            sup, trainer = _supervise(group, SUPERVISOR, run.url, str(BALLAST))
            try:
                wait_for_logged_step(run, 24, timeout=120)
                assert _score(trainer) == min(1000, _score(sup.pid) + TRAINER_OOM_BIAS)
                rss = {p: _resident(p) for p in (sup.pid, trainer)}
                assert rss[sup.pid] > rss[trainer], (
                    f"the supervisor must be the larger to show anything: {rss}"
                )
                kills = group.kills()
                assert group.oom_kill(trainer), "the kernel did not kill the trainer"
                if group.victims is not None:  # the kernel log is root's here (dmesg_restrict)
                    assert group.victims[:1] == [trainer], (group.victims, trainer, sup.pid)
                    if len(group.victims) > 1:
                        twice.append(group.victims)
                        continue  # the second kill of one episode (above): thrown again
                assert group.kills() == kills + 1, "one fault, one kill"
                out = sup.communicate(timeout=300)[0]
            finally:
                if sup.poll() is None:
                    sup.kill()
                    sup.wait()
        break
    else:  # its first victim the trainer each time: the claim holds, the restart was not reached
        pytest.skip(
            f"the kernel killed twice in each of 3 OOM episodes (victims, the trainer first: {twice})"
        )
    assert sup.returncode == 0, out
    said = dict(line.split(" ", 1) for line in out.splitlines() if line.split(" ", 1)[0].isupper())
    assert "killed by the kernel: out of memory (memory cgroup " in said["OUTCOME"], out
    reason, step, last = said["RESTARTED"].split()
    assert reason == "completed" and int(step) == int(last) + 4, out
    steps = [e.step for e in read_history(run)]
    assert steps == list(range(1, int(step) + 1)), "the canonical history: every step once, none lost"


def _supervise(group: MemoryGroup, script: str, *args: str) -> tuple[subprocess.Popen, int]:
    """A supervisor `script` born in `group`, and the pid of the trainer it printed it started."""
    with group.joined():
        sup = subprocess.Popen(
            [sys.executable, "-c", script, *args],
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=_env(), cwd=REPO,
        )  # fmt: skip
    first = sup.stdout.readline().split()
    if first[:1] != ["TRAINER"]:
        sup.kill()
        sup.wait()
        raise AssertionError(first)
    return sup, int(first[1])


def _score(pid: int) -> int:
    """Its oom_score_adj."""
    return int(open(f"/proc/{pid}/oom_score_adj").read())


def _resident(pid: int) -> int:
    """Its resident set in kB (what the OOM killer weighs, with its page tables)."""
    status = open(f"/proc/{pid}/status").read()
    return int(status.split("VmRSS:")[1].split()[0])


RANKS_SUPERVISOR = textwrap.dedent(
    """
    import sys
    from andrea_core.ops.supervise import TrainerProcess
    ballast = b"x" * int(sys.argv[2])
    t = TrainerProcess(sys.argv[1], config=sys.argv[3], device="cpu", pace=0.05, nproc_per_node=2).start()
    print("TRAINER", t.pid, flush=True)
    for _ in t.lines():
        pass
    print("OUTCOME", t.outcome().describe(), flush=True)
    """
)


@pytest.mark.slow
@pytest.mark.skipif(bool(unavailable()), reason=f"memory cgroup: {unavailable()}")
def test_a_torchrun_rank_not_its_supervisor_is_killed_and_the_supervisor_says_so(tmp_path):
    """A child of the trainer (a torchrun rank, the agent's child) inherits the raised oom_score_adj:
    the kernel takes rank 0, not the larger supervisor; the agent ends with exit 1 and the supervisor,
    alive, says "killed by the kernel: out of memory" (the group's count: the rank is not its child)."""
    run = RunDir(str(tmp_path / "run"))
    config = tiny_config(tmp_path, train__max_steps=100_000, train__checkpoint_every=1000)
    with MemoryGroup("test-oom-rank") as group:
        sup, agent = _supervise(group, RANKS_SUPERVISOR, run.url, str(BALLAST), config)
        try:
            wait_for_logged_step(run, 3, timeout=240)
            lock = read_lock(run)
            assert lock.agent_pid == agent and lock.pid != agent
            for pid in (agent, lock.pid):
                assert _score(pid) == min(1000, _score(sup.pid) + TRAINER_OOM_BIAS)
            assert _resident(sup.pid) > _resident(lock.pid)
            kills = group.kills()
            assert group.oom_kill(lock.pid), "the kernel did not kill rank 0"
            if group.victims is not None:
                assert group.victims[:1] == [lock.pid], (group.victims, lock.pid, agent, sup.pid)
                if len(group.victims) > 1:  # the kernel's second kill of one episode (the test above)
                    pytest.skip(f"the kernel killed twice in the OOM episode: {group.victims}")
            assert group.kills() == kills + 1, "one fault, one kill"
            out = sup.communicate(timeout=300)[0]
        finally:
            if sup.poll() is None:
                sup.kill()
                sup.wait()
    assert sup.returncode == 0, out
    assert "killed by the kernel: out of memory (memory cgroup " in out, out
