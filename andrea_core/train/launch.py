"""What `andrea train --nproc-per-node N` decides before it becomes the torchrun agent (train/distributed.py
`run_agent`): the world size's bound and the agent's argv. Torch is imported only to count GPUs: a
launcher of a CPU job that then replaces itself with the agent must not import it for nothing (each
import is seconds of CPU, paid again by the agent).
"""

from __future__ import annotations

import os
import sys

from andrea_core.config import ConfigError

LOOPBACK = "127.0.0.1"


def max_world_size(device: str = "auto") -> int:
    """The most ranks this machine can hold: its GPUs under CUDA (unless `device` is "cpu"), else its
    CPU cores."""
    if device != "cpu":
        import torch

        if torch.cuda.is_available():
            return max(1, torch.cuda.device_count())
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def check_world_size(n: object, where: str, device: str = "auto") -> int:
    """`n` ranks if it is a whole number from 1 to max_world_size(device), else ConfigError naming
    `where`: a world size is an operator's choice, bounded by the devices present, never a run file's."""
    most = max_world_size(device)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= most:
        raise ConfigError(
            f"{where}: {n!r} ranks; expected a whole number from 1 to {most} (the devices here)"
        )
    return n


def torchrun_argv(nproc_per_node: int, train_args: list[str]) -> list[str]:
    """argv of the torchrun agent for one machine: a free rendezvous port of its own (--standalone),
    every rank reaching it at 127.0.0.1 (--local-addr), and its stores listening there alone
    (run_agent): torch unpickles what its store holds, so no other host may reach it."""
    return [
        sys.executable,
        "-m",
        "andrea_core.train.distributed",
        "--standalone",
        f"--local-addr={LOOPBACK}",
        f"--nproc-per-node={nproc_per_node}",
        "-m",
        "andrea_core",
        "train",
        *train_args,
    ]
