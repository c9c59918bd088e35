"""Data-parallel training on torchrun (issue 13): CPU, gloo, 2 ranks of andrea-tiny.

The contract under test: batch_size is the global batch, so N ranks compute what one process does (to
float32 rounding: the gradient of 8 rows summed as 4 + 4); rank 0 alone writes the run directory; a
signal to the agent or to one rank stops or checkpoints every rank at the same step; a checkpoint
resumes at any world size; a resume at the same world size is bit-exact.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from andrea_core.checkpoint import checkpoint_name
from andrea_core.run.lock import read_lock
from andrea_core.run.rundir import RunDir
from andrea_core.signals import TrainerSignals
from andrea_core.train.distributed import World, share_flags, world_from_env
from tests.conftest import REPO, _env, andrea, last_logged_step, lock_released, start_trainer, wait_for
from tests.tiny import tiny_config

CPU = ("--device", "cpu")


def _config(tmp_path: Path, steps: int, every: int, **overrides) -> str:
    return tiny_config(tmp_path, train__max_steps=steps, train__checkpoint_every=every, **overrides)


def _train(config: str, run: Path, nproc: int = 1, *extra: str, env: dict[str, str] | None = None) -> None:
    args = ["train", "--config", config, "--run-dir", str(run), *CPU, *extra]
    andrea(*args, *(["--nproc-per-node", str(nproc)] if nproc > 1 else []), timeout=300, env=env)


def _losses(run: Path) -> dict[int, tuple[float, str]]:
    """The canonical history: each step's entry of the newest segment."""
    out = {}
    for line in (run / ".loss.json").read_text().splitlines():
        e = json.loads(line)
        out[e["step"]] = (e["loss"], e["arm"])
    return out


def _regions(path: Path) -> np.ndarray:
    data = path.read_bytes()
    return np.frombuffer(data[8:-8], dtype="<f4").reshape(3, -1)  # weights, m, v (the trailer off)


def _ranks_of(agent_pid: int) -> dict[int, int]:
    """rank -> pid of the workers a torchrun agent started (its children, by their RANK variable)."""
    ranks = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) != agent_pid:
                continue
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        for var in env:
            if var.startswith(b"RANK="):
                ranks[int(var[5:])] = int(entry)
    return ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- fast: the pieces without processes ------------------------------------------------------------


def test_single_process_world_needs_no_torch_distributed(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    world = world_from_env()
    assert (world.rank, world.world_size, world.is_main, world.distributed) == (0, 1, True, False)
    flags = TrainerSignals()
    flags.checkpoint = True
    # No process group: the loop gets the live flags themselves, as a single trainer always did.
    assert share_flags(world, flags) is flags
    assert flags.checkpoint and flags.stop is None


def _share_flags_rank(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    world, received = World(rank, 2), TrainerSignals()
    if rank == 1:
        received.checkpoint = True  # SIGUSR1 to rank 1 alone
    first = share_flags(world, received)
    consumed = received.checkpoint
    if rank == 0:
        received.stop = "SIGTERM"  # lands after the all-reduce (during the checkpoint): the next step's
    result = [first.stop, first.checkpoint, consumed]
    second = share_flags(world, received)
    result += [second.stop, second.checkpoint]
    dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def test_flags_are_all_reduced_into_a_snapshot_every_rank_shares(tmp_path):
    """A checkpoint sent to rank 1 reaches both ranks at the same step; a stop sent to rank 0 after that
    step's all-reduce acts at the next one, on every rank (the race a pivot hit: a
    SIGTERM during the SIGUSR1 checkpoint made rank 0 alone stop one step early)."""
    import torch.multiprocessing as mp

    mp.spawn(_share_flags_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results == [[None, True, False, "SIGTERM", False]] * 2


def test_batch_that_does_not_split_evenly_is_refused_naming_the_fields():
    from andrea_core.config import ConfigError
    from andrea_core.train.distributed import check_batch

    check_batch(World(0, 2), 8, 2)
    with pytest.raises(
        ConfigError, match=r"train.batch_size 8 .* train.grad_accum_steps \(2\) x world size \(3\)"
    ):
        check_batch(World(0, 3), 8, 2)


# --- slow: real torchrun jobs ----------------------------------------------------------------------


STEPS, EVERY = 60, 20  # the shared pair's length and checkpoint grid


@pytest.fixture(scope="module")
def runs_60(tmp_path_factory) -> tuple[str, Path, Path]:
    """The module's shared pair: andrea-tiny, 60 steps, checkpoint_every 20, trained once by one process
    and once by two ranks (the uninterrupted 2-rank run the signal test's resumes must equal, byte for
    byte). A progress line (and event) every step: TrainerProcess follows that test's first start by
    them. Its config and the two run directories; read them, never train them on."""
    folder = tmp_path_factory.mktemp("distributed-60")
    config = _config(folder, STEPS, EVERY, train__log_every=1)
    one, two = folder / "one", folder / "two"
    _train(config, one)
    _train(config, two, 2)
    return config, one, two


@pytest.mark.slow
@pytest.mark.parametrize("accum", [1, 2])
def test_two_ranks_compute_what_one_process_does(tmp_path, accum, runs_60):
    """Same global batch, same maths: the same arm at every step, losses and the final weights, m and v
    equal to float32 rounding (measured: loss within 1 ulp, 4.8e-7; weights within 1.2e-7)."""
    if accum == 1:
        (_, one, two), steps, every = runs_60, STEPS, EVERY
    else:
        steps, every = 30, 10
        config = _config(tmp_path, steps, every, train__grad_accum_steps=accum)
        one, two = tmp_path / "one", tmp_path / "two"
        _train(config, one)
        # The job's temporary folder of its own: the agent's log folder (torchrun's `torchelastic_*`,
        # never removed by torch) is gone when the job ends; torch's compile cache may stay.
        (tmp := tmp_path / "tmp").mkdir()
        _train(config, two, 2, env=_env() | {"TMPDIR": str(tmp)})
        assert {p.name for p in tmp.iterdir()} <= {"torchinductor_root"}, list(tmp.iterdir())
    a, b = _losses(one), _losses(two)
    assert sorted(a) == sorted(b) == list(range(1, steps + 1))
    assert [a[s][1] for s in a] == [b[s][1] for s in a]  # one mixer decision per step, on every rank
    assert max(abs(a[s][0] - b[s][0]) for s in a) < 2e-6
    wa, wb = _regions(one / checkpoint_name(steps)), _regions(two / checkpoint_name(steps))
    for region in range(3):
        assert np.abs(wa[region] - wb[region]).max() < 1e-5, f"region {region}"
    # Rank 0 alone wrote: one checkpoint per grid step, one segment of losses, no stray files.
    grid = [checkpoint_name(s) for s in range(every, steps + 1, every)]
    assert sorted(p.name for p in two.glob("step_*.bin")) == grid
    assert len((two / ".loss.json").read_text().splitlines()) == steps
    assert lock_released(two)


@pytest.mark.slow
def test_signals_reach_every_rank_and_resume_is_bit_exact(tmp_path, runs_60):
    """SIGTERM to the agent; resume; SIGUSR1, then SIGTERM, to rank 0 only; resume; SIGKILL of rank 1;
    resume: the final checkpoint is byte-identical to that of an uninterrupted 2-rank run (the module's
    shared one, same config).

    The first start is the run-trainer task's view of a 2-rank job (TrainerProcess, as Prefect's train
    flow runs it): one process (the agent), rank 0's lines, and a SIGTERM to it (a Prefect cancellation)
    that ends in a checkpoint of the step in flight and exit 0."""
    from andrea_core.ops.supervise import TrainerProcess

    config, _, reference = runs_60
    run = tmp_path / "run"
    rd = RunDir(str(run))
    train = ["--run-dir", str(run), *CPU, "--pace", "0.15", "--nproc-per-node", "2"]

    # 1. SIGTERM to the torchrun agent (the pid `andrea train` execs into), through TrainerProcess.stop:
    #    every rank stops after the same step, one checkpoint of it, exit 0.
    trainer = TrainerProcess(rd.url, config=config, device="cpu", pace=0.15, nproc_per_node=2).start()
    for _ in trainer.lines():
        if trainer.step is not None and trainer.step >= 5:
            break
    held = read_lock(rd)
    ranks = _ranks_of(trainer.pid)
    assert (held.world_size, held.agent_pid, held.pid) == (2, trainer.pid, ranks[0])
    outcome = trainer.stop(timeout=120)
    assert (outcome.reason, outcome.returncode, outcome.ok) == ("SIGTERM", 0, True), outcome.describe()
    stopped = last_logged_step(rd)
    assert outcome.step == stopped >= 5
    assert stopped < EVERY and rd.checkpoint_steps() == [stopped]

    # 2. SIGUSR1 to rank 0 only: every rank checkpoints the same step and trains on.
    agent = start_trainer(*train, log=tmp_path / "second.log")
    wait_for(lambda: last_logged_step(rd) >= stopped + 3, 180, "the resumed trainer to train")
    rank0 = read_lock(rd).pid
    os.kill(rank0, signal.SIGUSR1)
    wait_for(lambda: len(rd.checkpoint_steps()) == 2, 120, "the SIGUSR1 checkpoint")
    usr1 = rd.checkpoint_steps()[-1]
    assert usr1 % EVERY != 0
    # 3. SIGTERM to rank 0 only (as the pivot sends it): rank 1 hears of it through the flag
    #    all-reduce, both stop after the same step, one checkpoint, the agent exits 0.
    wait_for(lambda: last_logged_step(rd) >= usr1 + 3, 120, "training past the SIGUSR1 checkpoint")
    os.kill(rank0, signal.SIGTERM)
    assert agent.wait(120) == 0, (tmp_path / "second.log").read_text()
    log = (tmp_path / "second.log").read_text()
    assert f"SIGUSR1: checkpoint of step {usr1} requested" in log
    term = last_logged_step(rd)
    assert rd.checkpoint_steps()[-1] == term and f"SIGTERM: checkpointing step {term}, then exiting" in log

    # 4. SIGKILL of rank 1, mid-run: torchrun tears the job down (exit non-zero); nothing is lost beyond
    #    the steps since the newest checkpoint.
    agent = start_trainer(*train, log=tmp_path / "third.log")
    wait_for(lambda: last_logged_step(rd) >= term + 5, 180, "the third start to train")
    os.kill(_ranks_of(agent.pid)[1], signal.SIGKILL)
    assert agent.wait(120) != 0
    assert read_lock(rd) is None or not read_lock(rd).is_alive()

    # 5. Resume once more, to the end.
    andrea("train", "--run-dir", str(run), *CPU, "--nproc-per-node", "2", timeout=300)
    final = checkpoint_name(STEPS)
    assert (run / final).read_bytes() == (reference / final).read_bytes()
    a, b = _losses(reference), _losses(run)
    assert all(a[s] == b[s] for s in a)  # the canonical history too, bit for bit


@pytest.mark.slow
def test_checkpoint_resumes_at_another_world_size(tmp_path, runs_60):
    """2 ranks -> 1 -> 2, one run: the file holds the full weights, m and v, whoever wrote it (rank 0 of
    two at the grid step 20, a single process at its last step 30); after each leg the loss runs on as
    in an uninterrupted run (to float32 rounding: the world size changes how a gradient is summed).
    One run of three legs, not two of two: the same two changes of world size, one start fewer."""
    config, straight, _ = runs_60  # 60 steps; the legs here stop at 20, 30 and 40
    ref = _losses(straight)
    run = tmp_path / "run"
    for world, target in ((2, 20), (1, 30), (2, 40)):
        _train(config, run, world, "--max-steps", str(target))  # the run's target is the last leg's
        got = _losses(run)
        assert sorted(got) == list(range(1, target + 1)), (world, target)
        assert [got[s][1] for s in got] == [ref[s][1] for s in got], (world, target)
        assert max(abs(got[s][0] - ref[s][0]) for s in got) < 1e-5, (world, target)
        assert run.joinpath(checkpoint_name(target)).exists(), (world, target)


@pytest.mark.slow
def test_two_node_stand_in(tmp_path, runs_60):
    """Two torchrun agents with --nnodes 2 on 127.0.0.1 (c10d rendezvous, gloo), one rank each: the
    same checkpoint, byte for byte, as one agent with two ranks."""
    config, _, single = runs_60
    run = tmp_path / "two-nodes"
    port = _free_port()
    agents = []
    for node in range(2):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
        argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "andrea"]
        argv += ["--log-dir", str(tmp_path / f"node{node}-logs")]  # plain torchrun's: not in /tmp for good
        argv += ["-m", "andrea_core", "train", "--config", config, "--run-dir", str(run), *CPU]
        log = open(tmp_path / f"node{node}.log", "wb")  # noqa: SIM115
        agents.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=REPO))
    for node, agent in enumerate(agents):
        assert agent.wait(300) == 0, (tmp_path / f"node{node}.log").read_text()
    final = checkpoint_name(STEPS)
    assert (run / final).read_bytes() == (single / final).read_bytes()
    grid = [checkpoint_name(s) for s in range(EVERY, STEPS + 1, EVERY)]
    assert sorted(p.name for p in run.glob("step_*.bin")) == grid


# --- what Prefect's train flow runs: TrainerProcess over an agent of 2 ranks -------------------------


def test_train_flow_and_trainer_command_take_nproc_per_node():
    from andrea_core.command import trainer_command
    from andrea_core.ops.supervise import gpu_slot_names
    from flows.train import train

    argv = trainer_command("/runs/x", device="cpu", nproc_per_node=2)
    assert argv[argv.index("--nproc-per-node") + 1] == "2"
    assert "--nproc-per-node" not in trainer_command("/runs/x", device="cpu")
    assert "nproc_per_node" in train.parameters.properties  # so the deployment takes it too
    assert gpu_slot_names("auto", "cpu", 2) == []  # no GPU, no slot
    assert gpu_slot_names("gpu-7", "cpu", 2) == ["gpu-7"]  # an explicit slot is held as named


@pytest.mark.slow
def test_bandit_state_of_another_policy_is_set_aside_once_by_rank_0(tmp_path, tmp_path_factory):
    """A resume under a policy the .state.json does not belong to: rank 0 moves the state aside (one
    file in archive/), every rank starts the same fresh bandit, no rank writes or trips over the move.
    The run at step 10 (its checkpoint and .state.json) is a copy of the library's (conftest.library_run,
    trained by one process: a checkpoint resumes at any world size, test_checkpoint_resumes_at_another_
    world_size); the 2-rank resume is this test's."""
    from andrea_core.ops.pivot import install_policy
    from tests.conftest import TINY, library_run

    run = library_run(tmp_path_factory, tmp_path / "run", 10)  # andrea-tiny at step 10
    assert json.loads((run / ".state.json").read_text())["step"] == 10
    install_policy(RunDir(str(run)), (Path(TINY).parent / "policies" / "default.yaml").read_text())
    andrea("train", "--run-dir", str(run), *CPU, "--nproc-per-node", "2", "--max-steps", "20", timeout=300)
    assert len(list((run / "archive").glob("unloaded_state_step_000010_*.json"))) == 1
    assert sorted(_losses(run)) == list(range(1, 21))
    assert json.loads((run / ".state.json").read_text())["step"] == 20


@pytest.mark.slow
def test_andrea_pivot_of_a_two_rank_job_restarts_it_at_two_ranks_from_the_boundary(tmp_path):
    """`andrea pivot --at now --restart` against a 2-rank job, through what the pivot tasks use: SIGUSR1
    to the lock's pid (rank 0) for the pivot checkpoint, SIGTERM to it to stop the job (the agent exits
    0), the run directory's steps 3-5 (the closed phase's tail archived), and a restart from the boundary
    that is a 2-rank job again (the world size the stopped trainer's lock recorded, not a single
    process), under the new policy with a fresh bandit, every step from boundary+1 on until it is
    stopped. 400 steps at --pace 0.1: room for the pivot's checks (a new policy's arms are tokenized
    first) before the job could reach its end; the resumed job is stopped 30 steps on."""
    from andrea_core.run.lock import live_trainer

    run = tmp_path / "run"
    rd = RunDir(str(run))
    config = _config(tmp_path, 400, 1000)  # no grid checkpoint: the pivot's and the stops' alone
    agent = start_trainer(
        "--config", config, "--run-dir", str(run), *CPU, "--nproc-per-node", "2", "--pace", "0.1",
        log=tmp_path / "before.log",
    )  # fmt: skip
    try:
        wait_for(lambda: last_logged_step(rd) >= 5, 180, "the 2-rank trainer to train")
        before = read_lock(rd)
        assert (before.world_size, before.agent_pid) == (2, agent.pid)
        out = andrea("pivot", str(run), "--policy", "default", "--at", "now", "--restart", "--timeout", "300")
        log = out.stdout
        assert agent.wait(120) == 0, (tmp_path / "before.log").read_text()
        # The pivot checkpoint and the stop went to rank 0 (the lock's pid), the job's agent exited 0.
        assert f"sent SIGUSR1 to trainer pid {before.pid} " in log, log
        boundary = int(re.search(r"pivot checkpoint step_(\d+)\.bin is valid", log)[1])
        stop = rf"trainer pid {before.pid} on \S+ exited .*; newest checkpoint (\d+)"
        stopped = int(re.search(stop, log)[1])
        assert stopped >= boundary >= 5
        pivoted = f"pivoted {rd.url} at step {boundary} to policy 'default'; resumed at step {boundary + 1}"
        assert pivoted in log, log
        resumed = live_trainer(rd)
        assert resumed is not None and resumed.world_size == 2, log + (run / "trainer.log").read_text()
        assert resumed.generation > before.generation
        wait_for(lambda: last_logged_step(rd) >= boundary + 30, 300, "the resumed job to train 30 steps")
        resumed.stop()
        wait_for(lambda: read_lock(rd).released, 180, "the resumed 2-rank job to stop")
    finally:
        if agent.poll() is None:
            agent.kill()
        leftover = live_trainer(rd)
        if leftover is not None:
            leftover.stop()
    # The closed phase's tail (the stop's checkpoint, past the boundary) is archived; the new phase
    # resumed from the boundary and trained every step to its own stop's checkpoint.
    (folder,) = rd.listdir("archive")
    assert int(folder.rsplit("_", 1)[1]) == boundary
    tail = sorted(n for n in rd.listdir(f"archive/{folder}") if n.startswith("step_"))
    assert tail == ([checkpoint_name(stopped)] if stopped > boundary else [])
    final = rd.checkpoint_steps()[-1]
    assert rd.checkpoint_steps() == [boundary, final] and final >= boundary + 30
    assert f"resuming {rd.url} from {checkpoint_name(boundary)}" in (run / "trainer.log").read_text()
    entries = [json.loads(line) for line in (run / ".loss.json").read_text().splitlines()]
    resumed_entries = [e for e in entries if e["segment"] == entries[-1]["segment"]]
    assert [e["step"] for e in resumed_entries] == list(range(boundary + 1, final + 1))
    assert {e["arm"] for e in resumed_entries} > {"stdlib-code"}  # the new policy's arms are drawn
