"""Issue 24, finding 5: `andrea train --nproc-per-node N` runs torchrun's stores on 127.0.0.1 only (torch
unpickles the rendezvous state kept there: a store another host can reach is a way in)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.conftest import start_trainer, wait_for
from tests.tiny import tiny_config


def listening(pids: set[int]) -> list[str]:
    """host:port of every TCP socket in LISTEN held by one of `pids` (from /proc: what ss -ltnp shows)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # TCP_LISTEN
                addr, port = local.split(":")
                if width == 8:
                    host = ".".join(str(int(addr[i : i + 2], 16)) for i in (6, 4, 2, 0))
                else:
                    host = "::" if set(addr) == {"0"} else addr
                found.append(f"{host}:{int(port, 16)}")
    return found


def tree_pids(root: int) -> set[int]:
    pids, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            pids.add(child)
            frontier.append(child)
    return pids


@pytest.mark.slow
def test_a_two_rank_job_listens_on_loopback_only(tmp_path):
    cfg = tiny_config(tmp_path, train__checkpoint_every=10, train__sample_every=10**6)
    run = tmp_path / "run"
    log = tmp_path / "train.log"
    agent = start_trainer(
        "--config",
        cfg,
        "--run-dir",
        str(run),
        "--device",
        "cpu",
        "--max-steps",
        "400",
        "--pace",
        "0.05",
        "--nproc-per-node",
        "2",
        log=log,
    )
    try:
        wait_for(
            lambda: (run / ".loss.json").exists() or agent.poll() is not None, timeout=300, what="step 1"
        )
        assert agent.poll() is None, log.read_text()
        time.sleep(1)
        sockets = listening(tree_pids(agent.pid))
        assert sockets, "the job holds no listening socket: the check below would be empty"
        assert all(s.startswith("127.0.0.1:") for s in sockets), sockets
    finally:
        agent.terminate()
        agent.wait(timeout=120)


# --- 6: a world size is the operator's, bounded by the devices here -------------------------------


@pytest.mark.parametrize("n", ["100000", "0", "-3"])
def test_a_world_size_beyond_the_devices_here_is_refused_before_torchrun(tmp_path, n):
    from tests.conftest import andrea

    proc = andrea(
        "train", "--run-dir", str(tmp_path / "run"), "--nproc-per-node", n, check=False, timeout=120
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"--nproc-per-node: {int(n)} ranks; expected a whole number from 1 to" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_pivot_rerun_never_takes_its_world_size_from_the_journal(tmp_path):
    """A forged journal's stopped_world_size was the resumed job's --nproc-per-node."""
    from andrea_core.ops.pivot import PivotJournal, job_world_size, stop_trainer
    from andrea_core.run.rundir import RunDir

    doc = {"step": "installed", "stopped_pid": 1, "stopped_step": 20, "stopped_world_size": 3}
    journal = PivotJournal.from_doc(RunDir(str(tmp_path)), doc | {"policy_text": "name: p"})
    assert stop_trainer(RunDir(str(tmp_path)), journal)["world_size"] == 1
    assert job_world_size(os.getpid()) == 1  # no WORLD_SIZE in this process's environment


def test_a_pivot_restart_never_takes_its_world_size_from_the_lock(tmp_path):
    """The lock is a run file: its world_size and a --nproc-per-node in its train_args are not the
    operator's choice, so the restart's options keep 1 rank (a live job's own WORLD_SIZE is read from
    the process the pivot verified and signalled instead)."""
    from dataclasses import replace

    from andrea_core.ops.pivot import recorded_train_options
    from andrea_core.run import lock
    from andrea_core.run.rundir import LOCK, RunDir

    run = RunDir(str(tmp_path / "run"))
    run.makedirs()
    me = lock.acquire(run, log=lambda m: None)
    forged = replace(me, world_size=3, train_args=["--device", "cpu", "--nproc-per-node", "4"])
    run.write_atomic(LOCK, forged.encode())
    options = recorded_train_options(run)
    assert options["nproc_per_node"] == 1 and options["device"] == "cpu"
