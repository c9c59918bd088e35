"""Benchmark: what data parallelism on torchrun costs a step (issue 13).

  (a) one trainer process, batch B;
  (b) `andrea train --nproc-per-node N` (torchrun, gloo on the CPU, NCCL on CUDA), global batch N x B:
      every rank does the work of (a), plus DDP's gradient all-reduce, the loss all-reduce and the flag
      all-reduce. b/a - 1 is the communication's share of a step (on a CPU shared by the ranks it also
      holds the ranks' competition for cores: run it with N x threads <= cores);
  (c) the flag all-reduce alone (two int32 through MAX, every step), timed in a loop of N gloo ranks.

Step times come from .loss.json's "time" field (stamped when a step's loss is read), median over the
steps after --skip. Both runs use the config's architecture with train.num_threads = --threads.

    .venv/bin/python bench/ddp_overhead.py --config andrea-tiny --nproc 2 --steps 80 --threads 1
    .venv/bin/python bench/ddp_overhead.py --config andrea-12m --device cuda --nproc 8 --steps 200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _config(folder: Path, name: str, base: str, batch: int, steps: int, threads: int) -> str:
    from andrea_core.config import load_run_config

    overrides = {
        "train.batch_size": batch,
        "train.max_steps": steps,
        "train.checkpoint_every": steps,
        "train.sample_every": 10 * steps,
        "train.num_threads": threads,
    }
    cfg = load_run_config(base).with_overrides(overrides, "bench/ddp_overhead.py")
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return str(path)


def _median_step(run: Path, skip: int) -> float:
    times = [json.loads(line)["time"] for line in (run / ".loss.json").read_text().splitlines()]
    gaps = [b - a for a, b in zip(times[skip:], times[skip + 1 :], strict=False)]
    return statistics.median(gaps)


def _train(config: str, run: Path, device: str, nproc: int) -> None:
    argv = [sys.executable, "-m", "andrea_core", "train", "--config", config, "--run-dir", str(run)]
    argv += ["--device", device] + (["--nproc-per-node", str(nproc)] if nproc > 1 else [])
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run(argv, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)


def flag_allreduce_worker(iterations: int, device: str) -> None:
    """Run under torchrun: time `iterations` flag all-reduces (gloo on the CPU, NCCL on CUDA, as the
    trainer does); rank 0 prints microseconds per call."""
    import torch

    from andrea_core.signals import TrainerSignals
    from andrea_core.train import distributed

    world = distributed.world_from_env()
    torch.set_num_threads(1)
    device = distributed.rank_device(world, device)
    distributed.init(world, device)
    flags = TrainerSignals()
    for _ in range(50):
        distributed.share_flags(world, flags)
    distributed.barrier(world)
    t0 = time.perf_counter()
    for _ in range(iterations):
        distributed.share_flags(world, flags)  # on the host (gloo), as in the trainer
    per_call = (time.perf_counter() - t0) / iterations
    if world.is_main:
        print(json.dumps({"flag_allreduce_us": per_call * 1e6}))
    distributed.shutdown(world)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="andrea-tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--batch", type=int, default=8, help="rows per rank (B)")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--skip", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--flag-iterations", type=int, default=2000)
    p.add_argument("--flag-worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.flag_worker:
        flag_allreduce_worker(a.flag_iterations, a.device)
        return
    with tempfile.TemporaryDirectory(prefix="ddp-bench-") as tmp:
        folder = Path(tmp)
        one = _config(folder, "one", a.config, a.batch, a.steps, a.threads)
        many = _config(folder, "many", a.config, a.batch * a.nproc, a.steps, a.threads)
        _train(one, folder / "one", a.device, 1)
        _train(many, folder / "many", a.device, a.nproc)
        t1, tn = _median_step(folder / "one", a.skip), _median_step(folder / "many", a.skip)
        flags = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.nproc}"]
            + [f"--log-dir={folder / 'torchrun-logs'}"]  # plain torchrun's, else left in /tmp for good
            + [__file__, "--flag-worker", "--flag-iterations", str(a.flag_iterations), "--device", a.device],
            check=True,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        flag_us = json.loads(flags.stdout.strip().splitlines()[-1])["flag_allreduce_us"]
    print(
        f"{a.config} on {a.device}, {a.batch} rows per rank, {a.threads} thread(s) per rank, "
        f"median of steps {a.skip + 1}..{a.steps}:"
    )
    print(f"  (a) 1 process, batch {a.batch}:            {t1 * 1e3:8.2f} ms/step")
    print(f"  (b) {a.nproc} ranks, global batch {a.batch * a.nproc}:      {tn * 1e3:8.2f} ms/step")
    print(f"  b/a = {tn / t1:.3f}: communication (and core sharing) is {1 - t1 / tn:.1%} of a step")
    print(
        f"  (c) flag all-reduce: {flag_us:.1f} us per step = {flag_us / 1e3 / (tn * 1e3):.2%} of (b)'s step"
    )


if __name__ == "__main__":
    main()
