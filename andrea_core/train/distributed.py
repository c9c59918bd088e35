"""Data-parallel training under torchrun: who this process is, and the few collectives the trainer needs.

The contract (docs/design.md "Distributed"): `batch_size` is the global batch. Every rank builds the same
batch of a step (batch selection is a pure function of seed, step and mixer state, and the mixer hears
the same all-reduced loss on every rank), then trains on its own rows of it; DDP averages the gradients.
Rank 0 alone owns the run directory: lock, sidecars, checkpoints. Every rank holds the full model, so a
checkpoint is the same file at any world size. The signal flags are all-reduced (MAX) after every step,
so a signal that reached one rank only stops or checkpoints every rank at the same step.

Without torchrun's environment (no WORLD_SIZE, or 1) nothing here touches torch.distributed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from andrea_core.config import ConfigError
from andrea_core.signals import TrainerSignals
from andrea_core.train.launch import LOOPBACK

# The stop flag travels as a number so that MAX picks one signal for every rank; SIGTERM outranks SIGINT.
_STOP_CODES = {None: 0, "SIGINT": 1, "SIGTERM": 2}
_STOP_NAMES = {code: name for name, code in _STOP_CODES.items()}
_flag_group = None  # the gloo group of the flags under NCCL (None: the default group, gloo on the CPU)


@dataclass(frozen=True)
class World:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    agent_pid: int | None = None  # the torchrun agent that launched this rank (its parent), if any

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def world_from_env() -> World:
    """This process's place in a torchrun job, from the variables torchrun sets (none: a single process)."""
    size = int(os.environ.get("WORLD_SIZE") or 1)
    if size <= 1:
        return World()
    launched = "TORCHELASTIC_RUN_ID" in os.environ  # torchrun's agent is our parent
    return World(
        rank=int(os.environ["RANK"]),
        world_size=size,
        local_rank=int(os.environ.get("LOCAL_RANK") or 0),
        agent_pid=os.getppid() if launched else None,
    )


def rank_device(world: World, device: str) -> str:
    """One GPU per rank: `cuda` (auto on a CUDA machine, or any cuda:N) becomes cuda:LOCAL_RANK."""
    if world.distributed and device.startswith("cuda"):
        return f"cuda:{world.local_rank}"
    return device


def init(world: World, device: str) -> None:
    """Join the job's process group: NCCL for CUDA ranks, gloo on the CPU."""
    if not world.distributed or torch.distributed.is_initialized():
        return
    global _flag_group
    if device.startswith("cuda"):
        torch.distributed.init_process_group("nccl", device_id=torch.device(device))
        # The flags go through gloo on the host: an NCCL all-reduce would queue behind the step on the
        # GPU, and reading its result would make the loop wait for the step (the loop never waits for
        # the device except to read the previous step's loss).
        _flag_group = torch.distributed.new_group(backend="gloo")
    else:
        torch.distributed.init_process_group("gloo")


def shutdown(world: World, clean: bool = True) -> None:
    """Leave the process group. After a clean run every rank first waits for the others (rank 0 is
    still writing the last checkpoint when the others are done): a rank that tears down its gloo
    connections while a peer still holds them can abort in gloo's threads at exit (seen once under
    load: "terminate called without an active exception"). After an error no rank waits: torchrun
    ends the others."""
    global _flag_group
    if world.distributed and torch.distributed.is_initialized():
        if clean:
            torch.distributed.barrier(group=_flag_group)
        torch.distributed.destroy_process_group()
    _flag_group = None


def exit_follower(world: World, code: int) -> None:
    """A rank > 0 whose trainer has ended exits here, without the interpreter's teardown. It has left
    the process group (shutdown) and writes nothing of the run, so nothing is lost; what is skipped is
    the teardown of torch's C++ objects, where a gloo thread still holding a tensor can abort the process
    ("terminate called without an active exception", SIGABRT, seen under load after a clean run) and
    turn a completed job into a failed one. Rank 0 (and a single process) returns and exits normally."""
    if world.rank > 0:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def barrier(world: World) -> None:
    if world.distributed:
        torch.distributed.barrier()


@contextlib.contextmanager
def main_first(world: World) -> Iterator[None]:
    """Rank 0 runs the block first (creating the run, tokenizing the arms into the cache), the others
    after it, so that they only ever read what rank 0 has finished writing."""
    if world.is_main:
        yield
        barrier(world)
    else:
        barrier(world)
        yield


def check_batch(world: World, batch_size: int, grad_accum_steps: int) -> None:
    if batch_size % (grad_accum_steps * world.world_size):
        raise ConfigError(
            f"train.batch_size {batch_size} is the global batch: it must divide into "
            f"train.grad_accum_steps ({grad_accum_steps}) x world size ({world.world_size}) equal parts"
        )


def my_rows(world: World, micro_batch: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a (micro-)batch that every rank built whole: contiguous, equal shares."""
    if not world.distributed:
        return micro_batch
    return micro_batch.chunk(world.world_size)[world.rank]


def global_mean(world: World, value: torch.Tensor) -> torch.Tensor:
    """The mean of a scalar over the ranks (each rank's loss is the mean of an equal share of rows)."""
    if not world.distributed:
        return value
    total = value.detach().clone()
    torch.distributed.all_reduce(total)
    return total / world.world_size


def share_flags(world: World, received: TrainerSignals, consume: bool = True) -> TrainerSignals:
    """The flags every rank acts on at this step: `received` (what this process's handlers set) all-
    reduced (MAX) over the ranks, so that a signal any rank received acts on every rank at the same step.

    The answer is a snapshot: a signal that lands after the all-reduce (during this step's checkpoint)
    stays in `received` for the next step's all-reduce, instead of making this rank alone act on it now.
    With `consume`, a checkpoint request is taken out of `received` into the snapshot. A single process
    gets `received` itself back: its loop reads the live flags, as it always has."""
    if not world.distributed:
        return received
    stop, checkpoint = received.stop, received.checkpoint
    if consume:
        received.checkpoint = False
    mine = torch.tensor([_STOP_CODES[stop], int(checkpoint)], dtype=torch.int32)  # on the host, always
    torch.distributed.all_reduce(mine, op=torch.distributed.ReduceOp.MAX, group=_flag_group)
    agreed = TrainerSignals()
    agreed.stop = _STOP_NAMES[int(mine[0])]
    agreed.checkpoint = bool(mine[1])
    return agreed


# --- the agent: `andrea train --nproc-per-node N` (its argv and world size: train/launch.py) ----------


def run_agent(argv: list[str]) -> int:
    """torchrun's agent in this process, with two differences: a SIGTERM (or SIGINT) to the agent, which
    it forwards to every rank, ends in exit 0 when every rank then exited 0 (each checkpointed the same
    step), as a single trainer's SIGTERM does (plain torchrun reports its own signal as a failure); and
    the log folder torchrun makes for every job (a `torchelastic_*` in the temporary folder, never
    removed, empty unless a rank left an error file) is one of ours, removed at the end when empty."""
    if any(a.split("=")[0] in ("--log-dir", "--log_dir") for a in argv):
        return _run_agent(argv)
    logs = tempfile.mkdtemp(prefix="andrea-torchrun-")
    try:
        return _run_agent([f"--log-dir={logs}", *argv])
    finally:
        if any(files for _, _, files in os.walk(logs)):
            print(f"andrea: torchrun's files kept in {logs}", file=sys.stderr, flush=True)
        else:
            shutil.rmtree(logs, ignore_errors=True)


def _run_agent(argv: list[str]) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.agent.server import local_elastic_agent
    from torch.distributed.elastic.multiprocessing import SignalException

    contexts = []
    start_processes = local_elastic_agent.start_processes

    def recording(*args, **kwargs):
        context = start_processes(*args, **kwargs)
        contexts.append(context)
        return context

    local_elastic_agent.start_processes = recording
    if "--standalone" in argv:
        _bind_stores_to_loopback()
    try:
        torchrun.main(argv)
    except SignalException as e:
        if e.sigval not in (signal.SIGTERM, signal.SIGINT) or not contexts:
            raise
        # By now the agent has passed the signal to every rank and waited for them to exit.
        handlers = getattr(contexts[-1], "subprocess_handlers", {})
        codes = [h.proc.returncode for h in handlers.values()]
        print(
            f"andrea: torchrun agent got {e.sigval.name}; ranks exited {codes}", file=sys.stderr, flush=True
        )
        return 0 if codes and all(c == 0 for c in codes) else 1
    return 0


def _bind_stores_to_loopback() -> None:
    """Make every TCPStore this agent hosts listen on 127.0.0.1 only. torch's store server binds all
    interfaces whatever host it is given; handed a socket already listening on loopback
    (master_listen_fd) it serves that one. Both stores of a standalone job go through here: the
    rendezvous's (c10d backend) and the one the ranks join (MASTER_ADDR)."""
    import socket

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend

    original = dist.TCPStore

    def loopback_store(host_name, port, world_size=None, is_master=False, *args, **kwargs):
        if is_master and kwargs.get("master_listen_fd") is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((LOOPBACK, port))
            sock.listen(128)
            host_name, port = LOOPBACK, sock.getsockname()[1]
            kwargs["master_listen_fd"] = sock.detach()  # the store owns (and closes) it now
        return original(host_name, port, world_size, is_master, *args, **kwargs)

    dist.TCPStore = loopback_store
    c10d_rendezvous_backend.TCPStore = loopback_store


if __name__ == "__main__":
    sys.exit(run_agent(sys.argv[1:]))
