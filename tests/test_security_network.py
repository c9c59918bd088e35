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
