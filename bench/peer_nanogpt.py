"""Benchmark: `andrea train` against nanoGPT's own CPU recipe ("baby GPT" on shakespeare_char), side by side.

nanoGPT's README trains a 4-layer, 4-head, 128-wide GPT with a 64-character context on the CPU:
  python train.py config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20
      --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128
      --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0
(lr 1e-3 -> 1e-4, warmup 100, beta2 0.99). This program runs that command from a checkout of nanoGPT
that the user points at (--nanogpt DIR; it contains none of nanoGPT's code and writes nothing into the
checkout), and the same recipe through `andrea train` (a config and a policy written here: the bytes
tokenizer, checkpoints and sample audits at their defaults, every 100 steps).

The text: tiny Shakespeare cannot be downloaded here, so both read text every machine has, the Python
standard library's top-level modules (sorted by name, non-ASCII characters dropped, cut at tiny
Shakespeare's 1,115,394 characters). It is split and encoded as nanoGPT's data/shakespeare_char/prepare.py
does (the first 90% train, the rest validation; ids are the indices of the sorted distinct characters;
train.bin, val.bin, meta.pkl). andrea gets the same two splits as the same characters' bytes, as a
`tokens` arm of nanoGPT-named train.bin/val.bin (ASCII: one byte per character), so both train on the
same characters and validate on the same held-out 10%.

Rounds: A B A B ..., A = nanoGPT, B = andrea, each a fresh process training from scratch for
--round-steps steps (the first steps of the 2000-step schedule). A round's figure is the median step
time after its first --skip steps, over windows of --window steps (.loss.json stamps steps to the
millisecond; the same windows are used for nanoGPT's per-iteration times), and its mean step time
(checkpoints, audits and nanoGPT's evaluations included). Each pair gives the ratio nanoGPT / andrea of
median step times (> 1: andrea is faster); the median of the ratios and their spread (min..max) are the
result. Then one pair of --final-steps (default 2000) prints both validation losses: nanoGPT's own final
estimate (its estimate_loss: 20 batches of 12 x 64), and andrea's final checkpoint evaluated the same
way on the same validation text (and the run's own audit figure).

--profile N instead runs N steps of the andrea trainer in this process with a timer around each part
of its step (main thread wall time and CPU time; the batch builder on its own thread), a torch.profiler
table of the step, and (with --nanogpt) the forward, backward, clip and optimizer step of andrea's GPT
against nanoGPT's model.py at the same shape, alternated in blocks.

    .venv/bin/python bench/peer_nanogpt.py --nanogpt /path/to/nanoGPT                 # ~10 min, quiet CPU
    .venv/bin/python bench/peer_nanogpt.py --nanogpt /path/to/nanoGPT --profile 300
    .venv/bin/python bench/peer_nanogpt.py --pairs 1 --round-steps 30 --final-steps 0  # andrea side only
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import importlib.util
import math
import os
import pickle
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TINY_SHAKESPEARE_CHARS = 1_115_394
# nanoGPT's CPU recipe (its README), as config overrides of its train.py; --max_iters per round.
NANOGPT_RECIPE = [
    "--device=cpu",
    "--compile=False",
    "--eval_iters=20",
    "--log_interval=1",
    "--block_size=64",
    "--batch_size=12",
    "--n_layer=4",
    "--n_head=4",
    "--n_embd=128",
    "--dropout=0.0",
    "--wandb_log=False",
]
BLOCK, BATCH, EVAL_ITERS = 64, 12, 20
ITER_RE = re.compile(r"^iter (\d+): loss ([\d.]+), time ([\d.]+)ms", re.M)
EVAL_RE = re.compile(r"^step (\d+): train loss ([\d.]+), val loss ([\d.]+)", re.M)

ANDREA_CONFIG = """\
# nanoGPT's CPU "baby GPT" recipe, as an andrea run (written by bench/peer_nanogpt.py).
name: peer-baby-gpt
model:
  vocab_size: 256      # raw bytes
  block_size: 64
  n_layer: 4
  n_head: 4
  n_embd: 128
  dropout: 0.0
train:
  seed: 1337
  batch_size: 12
  max_steps: {steps}
  lr: 1.0e-3
  min_lr: 1.0e-4
  warmup_steps: 100
  lr_decay_steps: {decay}
  beta2: 0.99
  num_threads: {threads}
data:
  policy: {policy}
  tokenizer: bytes
"""
ANDREA_POLICY = """\
# One arm: the benchmark's text, as nanoGPT-named byte shards (train.bin, val.bin).
name: peer-text
mixer: uniform
arms:
  - name: text
    kind: tokens
    paths: [{folder}]
    tokenizer: bytes
"""


def load_note() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.2f} (5 min {five:.2f}) on {os.cpu_count()} cores"


# --- the text, both ways -------------------------------------------------------------------------


def benchmark_text(chars: int) -> str:
    """The standard library's top-level modules, sorted by name, ASCII only, cut at `chars`."""
    parts, n = [], 0
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = f.read_text(encoding="utf-8", errors="replace").encode("ascii", "ignore").decode()
        parts.append(text)
        n += len(text)
        if n >= chars:
            break
    return "".join(parts)[:chars]


def prepare(work: Path, chars: int) -> tuple[Path, Path, str]:
    """nanoGPT's data folder (prepare.py's encoding) and andrea's byte shards of the same splits."""
    data = benchmark_text(chars)
    vocab = sorted(set(data))
    stoi = {ch: i for i, ch in enumerate(vocab)}
    n = len(data)
    train, val = data[: int(n * 0.9)], data[int(n * 0.9) :]
    ng, an = work / "nanogpt-data", work / "andrea-data"
    for folder in (ng, an):
        folder.mkdir(parents=True, exist_ok=True)
    for name, split in (("train.bin", train), ("val.bin", val)):
        np.array([stoi[c] for c in split], dtype=np.uint16).tofile(ng / name)
        np.frombuffer(split.encode("ascii"), dtype=np.uint8).astype(np.uint16).tofile(an / name)
    meta = {"vocab_size": len(vocab), "itos": dict(enumerate(vocab)), "stoi": stoi}
    with open(ng / "meta.pkl", "wb") as f:  # nanoGPT reads its vocabulary size from it (our own file)
        pickle.dump(meta, f)
    digest = hashlib.sha256(data.encode()).hexdigest()[:12]
    note = (
        f"text: {n:,} characters of Python {sys.version.split()[0]}'s standard library (sha256 {digest}), "
        f"{len(vocab)} distinct; train {len(train):,}, val {len(val):,}"
    )
    return ng, an, note


def write_andrea_config(work: Path, andrea_data: Path, steps: int, decay: int, threads: int) -> Path:
    policy = work / "peer-policy.yaml"
    policy.write_text(ANDREA_POLICY.format(folder=andrea_data))
    config = work / f"peer-{steps}.yaml"
    config.write_text(ANDREA_CONFIG.format(steps=steps, decay=decay, threads=threads, policy=policy))
    return config


# --- one round of each ---------------------------------------------------------------------------


def windowed_median(ends: list[float], skip: int, window: int) -> float:
    """Median step time from step end stamps: (end[i + w] - end[i]) / w over the steps after `skip`."""
    ends = ends[skip:]
    spans = [(ends[i + window] - ends[i]) / window for i in range(len(ends) - window)]
    return statistics.median(spans) if spans else math.nan


def mean_step(ends: list[float], skip: int) -> float:
    ends = ends[skip:]
    return (ends[-1] - ends[0]) / (len(ends) - 1) if len(ends) > 1 else math.nan


def child_env(threads: int, work: Path) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), ANDREA_CACHE_DIR=str(work / "cache"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("WANDB_MODE", None)
    return env


def run_nanogpt(nanogpt: Path, data: Path, out: Path, steps: int, decay: int, threads: int, work: Path):
    """nanoGPT's train.py in its checkout, our data folder and output folder given as absolute paths
    (os.path.join('data', '/abs') is '/abs'): nothing is written into the checkout."""
    argv = [
        sys.executable,
        "train.py",
        "config/train_shakespeare_char.py",
        *NANOGPT_RECIPE,
        f"--max_iters={steps}",
        f"--lr_decay_iters={decay}",
        f"--dataset={data}",
        f"--out_dir={out}",
    ]
    proc = subprocess.run(argv, cwd=nanogpt, env=child_env(threads, work), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(
            f"nanoGPT's train.py exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        )
    iters = [(int(i), float(ms) / 1000) for i, _, ms in ITER_RE.findall(proc.stdout)]
    ends = list(np.cumsum([dt for _, dt in iters]))
    evals = EVAL_RE.findall(proc.stdout)
    val = float(evals[-1][2]) if evals else math.nan
    return ends, val


def run_andrea(config: Path, run: Path, steps: int, threads: int, work: Path):
    from andrea_core.run.loss_log import read_history
    from andrea_core.run.rundir import RunDir

    argv = [
        sys.executable,
        "-m",
        "andrea_core",
        "train",
        "--config",
        str(config),
        "--run-dir",
        str(run),
        "--max-steps",
        str(steps),
        "--device",
        "cpu",
    ]
    proc = subprocess.run(argv, cwd=REPO, env=child_env(threads, work), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(
            f"andrea train exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        )
    history = read_history(RunDir(str(run)))
    if [e.step for e in history] != list(range(1, steps + 1)):
        raise SystemExit(f"{run}: .loss.json does not hold every step 1..{steps}")
    return [e.time for e in history]


def andrea_val_loss(run: Path, andrea_data: Path, threads: int) -> tuple[float, float | None]:
    """The run's final checkpoint on nanoGPT's estimator: EVAL_ITERS batches of BATCH x BLOCK windows
    of the validation split (a fixed seed); and the run's own last audit figure."""
    import torch

    from andrea_core.model.weights import load_model
    from andrea_core.run.record import read_weights
    from andrea_core.run.rundir import RunDir
    from andrea_core.run.samples import read_audits

    torch.set_num_threads(threads)
    weights = read_weights(str(run))  # the newest valid checkpoint, validated against run.yaml
    model = load_model(weights.model_config, weights.checkpoint)
    val = np.fromfile(andrea_data / "val.bin", dtype=np.uint16).astype(np.int64)
    rng = np.random.default_rng(1337)
    losses = []
    with torch.no_grad():
        for _ in range(EVAL_ITERS):
            ix = rng.integers(0, len(val) - BLOCK, size=BATCH)
            x = torch.from_numpy(np.stack([val[i : i + BLOCK] for i in ix]))
            y = torch.from_numpy(np.stack([val[i + 1 : i + 1 + BLOCK] for i in ix]))
            losses.append(model(x, y)[1].item())
    audits = read_audits(RunDir(str(run)))
    audit = audits[-1]["metrics"]["val_loss"]["text"] if audits else math.nan
    return statistics.mean(losses), audit


def rounds(args, ng_data: Path, an_data: Path, work: Path) -> None:
    config = write_andrea_config(work, an_data, args.round_steps, args.decay, args.threads)
    print(
        f"\nrounds of {args.round_steps} steps, first {args.skip} not timed, {args.window}-step windows, "
        f"{args.threads} threads; A = nanoGPT, B = andrea"
    )
    ratios = []
    for pair in range(1, args.pairs + 1):
        a = None
        if args.nanogpt:
            load = load_note()
            ends, _ = run_nanogpt(
                args.nanogpt, ng_data, work / f"ng-{pair}", args.round_steps, args.decay, args.threads, work
            )
            a = windowed_median(ends, args.skip, args.window)
            print(
                f"  A{pair} nanoGPT  median {a * 1e3:7.2f} ms  "
                f"mean {mean_step(ends, args.skip) * 1e3:7.2f} ms  ({load})"
            )
        load = load_note()
        ends = run_andrea(config, work / f"an-{pair}", args.round_steps, args.threads, work)
        b = windowed_median(ends, args.skip, args.window)
        print(
            f"  B{pair} andrea   median {b * 1e3:7.2f} ms  mean {mean_step(ends, args.skip) * 1e3:7.2f} ms"
            f"  ({load})"
        )
        if a is not None:
            ratios.append(a / b)
            print(f"  pair {pair}: nanoGPT / andrea = {a / b:.3f}")
        shutil.rmtree(work / f"an-{pair}", ignore_errors=True)  # 10 MB a checkpoint
        shutil.rmtree(work / f"ng-{pair}", ignore_errors=True)
    if ratios:
        print(
            f"ratio nanoGPT / andrea (> 1: andrea faster): median {statistics.median(ratios):.3f}, "
            f"spread {min(ratios):.3f}..{max(ratios):.3f} over {len(ratios)} pairs  ({load_note()})"
        )
    else:
        print("SKIPPED the nanoGPT side: no --nanogpt DIR given; no ratio (andrea's side ran alone)")


def final(args, ng_data: Path, an_data: Path, work: Path) -> None:
    steps = args.final_steps
    print(f"\nfinal pair of {steps} steps, validation losses:")
    if args.nanogpt:
        load = load_note()
        ends, val = run_nanogpt(
            args.nanogpt, ng_data, work / "ng-final", steps, args.decay, args.threads, work
        )
        a = windowed_median(ends, args.skip, args.window)
        print(f"  nanoGPT  val loss {val:.4f} (its estimate_loss)   median step {a * 1e3:.2f} ms  ({load})")
    else:
        a = None
        print("  nanoGPT  SKIPPED: no --nanogpt DIR given")
    load = load_note()
    config = write_andrea_config(work, an_data, steps, args.decay, args.threads)
    ends = run_andrea(config, work / "an-final", steps, args.threads, work)
    b = windowed_median(ends, args.skip, args.window)
    val, audit = andrea_val_loss(work / "an-final", an_data, args.threads)
    print(
        f"  andrea   val loss {val:.4f} (the same estimator)  median step {b * 1e3:.2f} ms  ({load}); "
        f"its audit's val loss {audit:.4f}"
    )
    if a is not None:
        print(f"  final pair: nanoGPT / andrea = {a / b:.3f}")
    shutil.rmtree(work / "an-final", ignore_errors=True)
    shutil.rmtree(work / "ng-final", ignore_errors=True)


# --- profile -------------------------------------------------------------------------------------


STEP_PART = "fwd + bwd + clip + optimizer (_step)"


class Timers:
    """Wall and this-thread CPU time per named part, per call."""

    def __init__(self):
        self.wall: dict[str, list[float]] = defaultdict(list)
        self.cpu: dict[str, list[float]] = defaultdict(list)

    def wrap(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*a, **k):
            w, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                self.wall[name].append(time.perf_counter() - w)
                self.cpu[name].append(time.thread_time() - c)

        return timed

    def patch(self, owner, attr: str, name: str) -> None:
        setattr(owner, attr, self.wrap(name, getattr(owner, attr)))

    def table(self, steps: int, step_s: float) -> None:
        print(f"  {'part':<46} {'calls':>6} {'wall ms/step':>12} {'cpu ms/step':>12} {'% of step':>9}")
        for name in self.wall:
            wall, cpu = sum(self.wall[name]) / steps, sum(self.cpu[name]) / steps
            print(
                f"  {name:<46} {len(self.wall[name]):>6} {wall * 1e3:>12.3f} {cpu * 1e3:>12.3f} "
                f"{100 * wall / step_s:>8.1f}%"
            )


def profile(args, an_data: Path, work: Path) -> None:
    import torch

    from andrea_core.train import distributed
    from andrea_core.train import trainer as trainer_module
    from andrea_core.train.trainer import Trainer

    steps = args.profile
    config = write_andrea_config(work, an_data, steps, args.decay, args.threads)
    os.environ["ANDREA_CACHE_DIR"] = str(work / "cache")
    from andrea_core.config import load_run_config

    tr = Trainer(str(work / "profile-run"), load_run_config(str(config)), device="cpu", log=lambda m: None)
    tr.progress.stream = open(os.devnull, "w")  # noqa: SIM115 (as under a service: plain lines, not a tty)
    t = Timers()
    build = tr._build

    def build_and_patch():
        build()
        t.patch(tr.batches, "take", "batch: take (wait for the prefetch thread)")
        t.patch(tr.batches, "start", "batch: start the prefetch thread")
        t.patch(tr.data, "batch", "  draw the batch (data.batch; CUDA: own thread)")
        t.patch(tr.data.mixer, "choose", "    bandit choose (in the draw)")
        t.patch(tr.data, "observe", "bandit observe")
        t.patch(tr, "forward", "  forward")
        t.patch(tr.optimizer, "step", "  optimizer step")
        t.patch(tr.optimizer, "zero_grad", "  zero_grad")
        t.patch(tr.loss_log, "log", "  loss log: format the line")
        t.patch(tr.loss_log, "flush", "  loss log: write (+ fence)")
        t.patch(tr.run.fence, "check", "    lease check before the append")
        t.patch(tr.progress, "step", "  progress output")
        t.patch(tr, "save", "checkpoint (save(): snapshot, hand-off)")
        t.patch(tr, "_audit", "sample audit")

    tr._build = build_and_patch
    t.patch(tr, "_step", STEP_PART)
    t.patch(tr, "_read", "loss read + log + progress (_read)")
    t.patch(tr, "_check_lease", "lease check at the step's start")
    t.patch(trainer_module, "lr_at", "lr schedule")
    t.patch(distributed, "share_flags", "signal flags (share_flags)")
    t.patch(torch.nn.utils, "clip_grad_norm_", "  clip_grad_norm_")
    t.patch(trainer_module, "seed_step", "step seed (seed_step)")
    loop = tr._loop
    span = {}

    def timed_loop(flags):
        span["t0"] = time.perf_counter()
        try:
            return loop(flags)
        finally:
            span["t1"] = time.perf_counter()

    tr._loop = timed_loop
    load = load_note()
    tr.train()
    step_s = (span["t1"] - span["t0"]) / steps
    print(
        f"\nandrea trainer, {steps} steps in this process: {step_s * 1e3:.2f} ms a step "
        f"(wall, the loop)  ({load})"
    )
    t.table(steps, step_s)
    parts = ("  forward", "  clip_grad_norm_", "  optimizer step", "  zero_grad")
    backward = sum(t.wall[STEP_PART]) - sum(sum(t.wall[q]) for q in parts)
    print(
        f"  (backward = _step - forward - clip - optimizer - zero_grad: {backward / steps * 1e3:.3f} ms/step)"
    )


def load_nanogpt_model(nanogpt: Path):
    spec = importlib.util.spec_from_file_location("nanogpt_model", nanogpt / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compare_models(args, ng_data: Path, an_data: Path, blocks: int = 10, per_block: int = 20) -> None:
    """andrea's GPT + AdamW against nanoGPT's model.py + configure_optimizers, same shape and batches,
    alternated in blocks of `per_block` steps; median per part."""
    import torch
    import torch.nn.functional as F  # noqa: F401

    from andrea_core.config import load_run_config
    from andrea_core.model.gpt import GPT
    from andrea_core.train.optim import build_optimizer

    torch.set_num_threads(args.threads)
    ngm = load_nanogpt_model(args.nanogpt)
    vocab = int(max(np.fromfile(ng_data / s, np.uint16).max() for s in ("train.bin", "val.bin"))) + 1
    torch.manual_seed(1337)
    ng = ngm.GPT(
        ngm.GPTConfig(
            block_size=BLOCK,
            vocab_size=vocab,
            n_layer=4,
            n_head=4,
            n_embd=128,
            dropout=0.0,
            bias=False,
        )
    )
    ng_opt = ng.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu")
    cfg = load_run_config(
        str(write_andrea_config(Path(tempfile.mkdtemp()), an_data, 100, 2000, args.threads))
    )
    an = GPT(cfg.model)
    an_opt = build_optimizer(an, cfg.train, "cpu")
    data = {
        "A nanoGPT": np.fromfile(ng_data / "train.bin", np.uint16),
        "B andrea": np.fromfile(an_data / "train.bin", np.uint16),
    }
    sides = {"A nanoGPT": (ng, ng_opt), "B andrea": (an, an_opt)}
    parts = ("forward", "backward", "clip", "optimizer", "zero_grad")
    times = {s: {p: [] for p in parts} for s in sides}
    rng = np.random.default_rng(0)
    print(
        f"\nfwd/bwd/optimizer in this process, {blocks} blocks of {per_block} steps each, alternated, "
        f"{args.threads} threads  ({load_note()})"
    )
    for b in range(blocks):
        for side, (model, opt) in sides.items():
            tokens = data[side].astype(np.int64)
            for i in range(per_block):
                ix = rng.integers(0, len(tokens) - BLOCK - 1, size=BATCH)
                x = torch.from_numpy(np.stack([tokens[j : j + BLOCK] for j in ix]))
                y = torch.from_numpy(np.stack([tokens[j + 1 : j + 1 + BLOCK] for j in ix]))
                t0 = time.perf_counter()
                _, loss = model(x, y)
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                t3 = time.perf_counter()
                opt.step()
                t4 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                t5 = time.perf_counter()
                if b or i >= 5:
                    for p, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
                        times[side][p].append(dt)
    print(f"  {'part (median ms)':<16}" + "".join(f"{s:>12}" for s in sides) + f"{'A/B':>8}")
    for p in (*parts, "total"):
        med = {
            s: (
                statistics.median(times[s][p])
                if p != "total"
                else sum(statistics.median(times[s][q]) for q in parts)
            )
            for s in sides
        }
        a, b = med["A nanoGPT"], med["B andrea"]
        print(f"  {p:<16}{a * 1e3:>12.3f}{b * 1e3:>12.3f}{a / b:>8.3f}")
    for s, (model, _) in sides.items():
        n = sum(p.numel() for p in model.parameters())
        print(f"  {s}: {n:,} parameters in {len(list(model.parameters()))} tensors")


def torch_profile(args, an_data: Path, work: Path, steps: int = 20) -> None:
    """torch.profiler over `steps` trainer steps (after 10 untimed): the ops by self CPU time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profiler

    from andrea_core.config import load_run_config
    from andrea_core.train.trainer import Trainer

    config = write_andrea_config(work, an_data, 10 + steps, args.decay, args.threads)
    tr = Trainer(
        str(work / "torch-profile-run"), load_run_config(str(config)), device="cpu", log=lambda m: None
    )
    tr.progress.stream = open(os.devnull, "w")  # noqa: SIM115
    step = tr._step
    prof = torch_profiler(activities=[ProfilerActivity.CPU])
    calls = {"n": 0}

    def profiled(x, y):
        calls["n"] += 1
        if calls["n"] == 11:
            prof.__enter__()
        return step(x, y)

    tr._step = profiled
    tr.train()
    prof.__exit__(None, None, None)
    print(f"\ntorch.profiler, {steps} andrea steps: the ops by self CPU time (ms over the {steps} steps)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nanogpt", type=Path, help="a checkout of github.com/karpathy/nanoGPT (its train.py)")
    p.add_argument("--pairs", type=int, default=4, help="A B pairs of rounds")
    p.add_argument("--round-steps", type=int, default=300, help="steps per round (each from scratch)")
    p.add_argument("--skip", type=int, default=20, help="first steps of each round not timed")
    p.add_argument("--window", type=int, default=5, help="steps per timing window")
    p.add_argument("--final-steps", type=int, default=2000, help="steps of the final pair (0: none)")
    p.add_argument("--decay", type=int, default=2000, help="lr decay steps of the schedule (the recipe's)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads of both (the recipe's machine: 2)")
    p.add_argument("--chars", type=int, default=TINY_SHAKESPEARE_CHARS, help="characters of text")
    p.add_argument("--workdir", type=Path, help="scratch folder (default: a temporary one, removed)")
    p.add_argument("--profile", type=int, metavar="N", help="profile N andrea steps instead of the rounds")
    args = p.parse_args()
    if args.nanogpt is not None:
        args.nanogpt = args.nanogpt.resolve()
        if (
            not (args.nanogpt / "train.py").is_file()
            or not (args.nanogpt / "config/train_shakespeare_char.py").is_file()
        ):
            p.error(f"--nanogpt {args.nanogpt}: no train.py and config/train_shakespeare_char.py there")
    if args.round_steps <= args.skip + args.window:
        p.error("--round-steps must exceed --skip + --window")
    with contextlib.ExitStack() as stack:
        work = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="peer-nanogpt-")))
        work = work.resolve()
        work.mkdir(parents=True, exist_ok=True)
        ng_data, an_data, note = prepare(work, args.chars)
        print(f"peer benchmark: nanoGPT's CPU baby-GPT recipe vs andrea train  ({load_note()})")
        print(note)
        print("WARNING: on a shared machine these figures move with its load; rerun on a quiet one.")
        if args.profile:
            profile(args, an_data, work)
            torch_profile(args, an_data, work)
            if args.nanogpt:
                compare_models(args, ng_data, an_data)
            return
        rounds(args, ng_data, an_data, work)
        if args.final_steps:
            final(args, ng_data, an_data, work)


if __name__ == "__main__":
    main()
