"""Benchmark: the project's trainer against a plain training loop, and what its checkpoints cost.

In one process, on the same model class, batch shape and device, it measures tokens/s and MFU of
  (a) a plain reference loop written here, nanoGPT-style: AdamW with the same hyper-parameters, and on
      CUDA bf16 autocast, fused AdamW, TF32 and torch.compile (when the config asks for it); random
      token batches of the config's vocabulary, no checkpoints, no logging, no per-step sync;
  (b) the project's Trainer (its data pipeline, loss log, mixer, signals), no checkpoint while timed;
  (c) the Trainer with a checkpoint every --checkpoint-every steps (100), written as configured
      (asynchronously unless the config says otherwise);
  (d) with --with-sync, (c) with the synchronous writer, for comparison;
  (v) with --variant LABEL:KEY=VALUE[,KEY=VALUE], (b) under those config overrides (issue 10's MFU
      trials: `train.loss_chunk_tokens=8192`, `train.compile_mode=max-autotune-no-cudagraphs`); a
      variant that fails is reported with its error and the others go on.
and prints the three, the ratios b/a and c/b, the loop's stall per checkpoint and the write time, and
what one sample audit costs (timed on its own, after the rounds: it runs at every checkpoint by default).

The arms run in rounds, in the order a b c, then c b a, and so on, so that a machine whose speed drifts
(a shared CPU, turbo) favours none of them; an even number of rounds cancels a linear drift. Round r of
every arm covers the steps (offset + L(r-1), offset + L r] (round 1 starts at step 1), L = --round-steps,
a multiple of the checkpoint interval E: each trainer round of (c) holds L/E checkpoints on the E-step
grid, inside its timed window. Between rounds the trainers stop (their exit checkpoint falls outside the
timed window) and resume from their own run directories, as a real run would.
The first --skip steps of every round are not timed (compilation, allocator warm-up). Trainer steps are
timed from .loss.json's "time" field (stamped when a loss is read: one step late, except at a
save), the reference loop with a device sync at the edges of its window only. The checkpoint stall is
measured two ways: the time the loop spent inside save() (waiting for the previous write, taking the
snapshot), and how much longer the two steps around a checkpoint took than two median steps (which also
catches costs outside save(), such as the snapshot's device copies or the writer thread's share of a CPU).

    .venv/bin/python bench/train_throughput.py --device cpu --config andrea-12m --rounds 2
    .venv/bin/python bench/train_throughput.py --device cuda --config gpt2-124m-bench --rounds 3
    python3 bench/train_throughput.py --device cuda --config gpt2-124m-bench --rounds 1 \
        --variant fused-loss:train.loss_chunk_tokens=8192 \
        --variant autotune:train.compile_mode=max-autotune-no-cudagraphs
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import yaml  # noqa: E402

from andrea_core.checkpoint import expected_size  # noqa: E402
from andrea_core.config import RunConfig, load_run_config  # noqa: E402
from andrea_core.data.pipeline import DataPipeline  # noqa: E402
from andrea_core.data.policy import load_policy  # noqa: E402
from andrea_core.data.tokens import train_run_bpe  # noqa: E402
from andrea_core.model.gpt import GPT  # noqa: E402
from andrea_core.run.loss_log import read_history  # noqa: E402
from andrea_core.run.rundir import RunDir  # noqa: E402
from andrea_core.train.audit import run_audit  # noqa: E402
from andrea_core.train.optim import lr_at  # noqa: E402
from andrea_core.train.progress import Progress  # noqa: E402
from andrea_core.train.setup import create_run  # noqa: E402
from andrea_core.train.trainer import Trainer  # noqa: E402

# Dense bf16 tensor-core peaks (TFLOP/s) from the vendors' data sheets, by device-name fragment.
CUDA_PEAK_TFLOPS = {"H200": 989.5, "H100": 989.5, "A100": 312.0, "L40S": 362.0, "A10G": 70.0, "L4": 121.0}
NEVER = 10**9  # an interval that never comes: (b) checkpoints only when a round ends


@dataclass
class Arm:
    label: str
    steps: int = 0
    seconds: float = 0.0
    step_times: list[float] = field(default_factory=list)  # (c): every timed step, for the stall
    stalls: list[float] = field(default_factory=list)  # host-side time in save() of grid checkpoints
    loop_stalls: list[float] = field(default_factory=list)  # the checkpoint step's excess time
    writes: list[float] = field(default_factory=list)  # background write time of grid checkpoints
    failed: str | None = None  # a variant that could not run: its error

    def tokens_per_s(self, tokens_per_step: int) -> float:
        return self.steps * tokens_per_step / self.seconds if self.seconds else math.nan


def flops_per_token(model: GPT) -> float:
    """6 N + 12 L T C (PaLM's accounting, as nanoGPT's MFU): N counts the parameters that take part in
    matmuls, i.e. all but the token and position embeddings (lookups), which is GPT-2's 124M for the
    124M shape whatever the head's tying."""
    c = model.cfg
    n = model.n_params - model.tok_emb.weight.numel() - model.pos_emb.weight.numel()
    return 6 * n + 12 * c.n_layer * c.block_size * c.n_embd


def device_peak(device: str, threads: int, override: float | None) -> tuple[float | None, str]:
    if override:
        return override * 1e12, f"{override:g} TFLOP/s (given)"
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device))
        for fragment, tflops in CUDA_PEAK_TFLOPS.items():
            if fragment in name:
                return tflops * 1e12, f"{tflops:g} TFLOP/s, dense bf16 peak of the {name}"
        return None, f"unknown for {name}: pass --peak-tflops"
    # A CPU has no data-sheet figure here: measure its float32 matmul rate at the run's thread count.
    torch.set_num_threads(threads)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        best = min(best, (time.perf_counter() - t0) / 4)
    rate = 2 * 1024**3 / best
    return rate, f"{rate / 1e9:.1f} GFLOP/s, this CPU's measured float32 matmul rate at {threads} threads"


class Reference:
    """The plain loop: what a careful person writes from scratch (nanoGPT's train.py, trimmed)."""

    def __init__(self, cfg: RunConfig, device: str):
        self.cfg, self.device = cfg, device
        cuda = device.startswith("cuda")
        torch.manual_seed(cfg.train.seed)
        if cuda:
            torch.backends.cuda.matmul.allow_tf32 = True
        self.model = GPT(cfg.model).to(device)
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        rest = [p for p in self.model.parameters() if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": cfg.train.weight_decay},
            {"params": rest, "weight_decay": 0.0},
        ]
        betas = (cfg.train.beta1, cfg.train.beta2)
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.train.lr, betas=betas, fused=cuda)
        self.forward = torch.compile(self.model) if cfg.train.compile else self.model
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
        self.generator = torch.Generator().manual_seed(cfg.train.seed)
        self.step = 0

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        B, T = self.cfg.train.batch_size, self.cfg.model.block_size
        chunk = torch.randint(0, self.cfg.model.vocab_size, (B, T + 1), generator=self.generator)
        x, y = chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()
        if self.device.startswith("cuda"):
            return (t.pin_memory().to(self.device, non_blocking=True) for t in (x, y))
        return x, y

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step += 1
            for group in self.optimizer.param_groups:
                group["lr"] = lr_at(self.step, self.cfg.train)
            x, y = self.batch()
            with self.autocast:
                _, loss = self.forward(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()


def round_bounds(r: int, offset: int, length: int) -> tuple[int, int]:
    return (0 if r == 1 else offset + length * (r - 1)), offset + length * r


def time_reference(ref: Reference, arm: Arm, start: int, end: int, skip: int) -> None:
    ref.run(skip)
    ref.sync()
    t0 = time.perf_counter()
    ref.run(end - start - skip)
    ref.sync()
    arm.seconds += time.perf_counter() - t0
    arm.steps += end - start - skip


def create_runs(configs: dict[str, RunConfig], root: str) -> None:
    """The trainers' run directories, sharing one BPE (trained once: not what is measured here)."""
    first = next(iter(configs.values()))
    tokenizer = None
    if first.data.tokenizer == "bpe":
        tokenizer = train_run_bpe(load_policy(first.data.policy)[0], first)
    for key, cfg in configs.items():
        create_run(RunDir(f"{root}/{key}"), cfg, tokenizer=tokenizer)


def time_trainer(run_url: str, device: str, arm: Arm, start: int, end: int, skip: int, log_file) -> Trainer:
    def log(message: str) -> None:
        log_file.write(f"[{arm.label}] {message}\n")

    trainer = Trainer(run_url, max_steps=end, device=device, log=log)
    trainer.progress = Progress(end, trainer.cfg.train.log_every, stream=log_file)  # as under a service
    result = trainer.train()
    if result.reason != "completed":
        raise RuntimeError(f"{arm.label}: the trainer stopped with {result.reason} at step {result.step}")
    # A step's loss is read (and its entry stamped) one step late, at the end of the next step, except
    # at a save (a checkpoint, the round's last step), where it is read first. So the window from the
    # entry of step start+skip (never a save) to the entry of step `end` (always one) holds the steps
    # start+skip+2 .. end, and the stamps of steps E and E+1 around a checkpoint at E are the ends of
    # steps E (as the step before's) and E+2: those two intervals hold two steps and the save.
    times = {e.step: e.time for e in read_history(RunDir(run_url)) if start + skip <= e.step <= end}
    arm.seconds += times[end] - times[start + skip]
    arm.steps += end - start - skip - 1
    dts = {s: times[s] - times[s - 1] for s in range(start + skip + 1, end + 1)}
    every = trainer.cfg.train.checkpoint_every
    # Grid checkpoints whose following step is timed (not the one a round ends with).
    grid = [r for r in trainer.checkpointer.records if r.step % every == 0 and r.step + 1 in dts]
    # The median interval away from any checkpoint: what a step costs without one.
    plain = [dt for s, dt in dts.items() if s % every not in (0, 1) and s != end]
    for record in grid:
        arm.stalls.append(record.stall_s)
        arm.writes.append(record.write_s)
        around = dts[record.step] + dts[record.step + 1]
        arm.loop_stalls.append(around - 2 * statistics.median(plain) if plain else math.nan)
    arm.step_times.extend(dts.values())
    return trainer


def time_audit(run_url: str, model: GPT, cfg: RunConfig, device: str, repeats: int = 3) -> float:
    """Seconds one sample audit takes (the trainer's run_audit on the trainers' data and tokenizer, on
    the plain loop's model: same shape, trained as far), median of `repeats` after a warm-up."""
    data = DataPipeline.for_run(RunDir(run_url), cfg, warn=lambda line: None)
    times = []
    for i in range(repeats + 1):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        run_audit(model, data, cfg, 0, device)  # ends in a host read: nothing left queued
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def describe_data(trainer: Trainer) -> str:
    data, vocab = trainer.data, trainer.cfg.model.vocab_size
    return (
        f"tokenizer {data.tokenizer.id!r} (vocabulary {data.tokenizer.vocab_size:,} inside the model's "
        f"{vocab:,}), policy {data.policy.name!r}, arms {list(data.arms)}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--config", default="andrea-12m", help="a config name under configs/ or a YAML path")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per arm")
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--round-steps", type=int, help="steps per round (default: --checkpoint-every)")
    p.add_argument(
        "--offset", type=int, default=5, help="steps before the first round's grid checkpoint ends"
    )
    p.add_argument("--skip", type=int, default=3, help="untimed steps at the start of every round")
    p.add_argument("--batch-size", type=int, help="override the config's batch size (all arms alike)")
    p.add_argument("--threads", type=int, help="override the config's num_threads (all arms alike)")
    p.add_argument("--peak-tflops", type=float, help="the device's peak, for MFU (default: known GPUs)")
    p.add_argument("--with-sync", action="store_true", help="add (d): (c) with synchronous checkpoints")
    p.add_argument("--run-root", help="where the trainers' run directories go (default: beside the repo)")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL:KEY=VALUE[,KEY=VALUE]",
        help="add an arm: (b) under these config overrides (repeatable)",
    )
    args = p.parse_args()
    variants = {}
    for spec in args.variant:
        label, _, assignments = spec.partition(":")
        pairs = [a.partition("=") for a in assignments.split(",") if a]
        if not label or not pairs or any(not k or not eq for k, eq, _ in pairs):
            p.error(f"--variant {spec!r}: expected LABEL:KEY=VALUE[,KEY=VALUE]")
        variants[label] = {k: yaml.safe_load(v) for k, _, v in pairs}
    length = args.round_steps or args.checkpoint_every
    if not 0 <= args.skip < args.offset or length % args.checkpoint_every:
        p.error(
            "need --skip < --offset and --round-steps a multiple of --checkpoint-every, so that every "
            "round holds the same number of grid checkpoints, each inside its timed window"
        )

    # The sample audit (every checkpoint by default) is its own feature with its own cost: kept out of
    # every timed window, so that (c) - (b) is what checkpoints cost.
    overrides = {"train.checkpoint_every": args.checkpoint_every, "train.sample_every": NEVER}
    if args.batch_size:
        overrides["train.batch_size"] = args.batch_size
    if args.threads:
        overrides["train.num_threads"] = args.threads
    cfg = load_run_config(args.config).with_overrides(overrides, "bench")
    device = args.device
    t = cfg.train
    tokens_per_step = t.batch_size * cfg.model.block_size
    load_before = os.getloadavg()[0]
    peak, peak_note = device_peak(device, t.num_threads, args.peak_tflops)
    torch.set_num_threads(t.num_threads)

    ref = Reference(cfg, device)
    per_token = flops_per_token(ref.model)
    arms = {"a": Arm("(a) plain loop"), "b": Arm("(b) trainer"), "c": Arm("(c) trainer + checkpoints")}
    configs = {
        "b": cfg.with_overrides({"train.checkpoint_every": NEVER}, "bench (b)"),
        "c": cfg.with_overrides({"train.async_checkpoint": True}, "bench (c)"),
    }
    if args.with_sync:
        arms["d"] = Arm("(d) trainer + sync checkpoints")
        configs["d"] = cfg.with_overrides({"train.async_checkpoint": False}, "bench (d)")
    for i, (label, overrides) in enumerate(variants.items()):
        arms[f"v{i}"] = Arm(f"(v) {label}")
        configs[f"v{i}"] = configs["b"].with_overrides(overrides, f"--variant {label}")  # refused early
    root = Path(args.run_root) if args.run_root else REPO
    fed = None
    with tempfile.TemporaryDirectory(dir=root, prefix=".bench-throughput-") as tmp:
        log_file = open(Path(tmp) / "trainers.log", "w", buffering=1)  # noqa: SIM115
        create_runs(configs, tmp)
        for r in range(1, args.rounds + 1):
            start, end = round_bounds(r, args.offset, length)
            # a b c, then c b a: a drift in the machine's speed (turbo, a neighbour) cancels out in pairs.
            order = ["a", *configs] if r % 2 else [*reversed(configs), "a"]
            for key in order:
                if key == "a":
                    time_reference(ref, arms["a"], start, end, args.skip)
                    continue
                if arms[key].failed:
                    continue
                try:
                    trainer = time_trainer(f"{tmp}/{key}", device, arms[key], start, end, args.skip, log_file)
                except Exception as e:
                    if not key.startswith("v"):
                        raise
                    arms[key].failed = f"{type(e).__name__}: {e}"  # a trial that fails is a finding
                    print(f"{arms[key].label} failed: {arms[key].failed}", file=sys.stderr)
                    continue
                fed = fed or describe_data(trainer)
                del trainer
                gc.collect()
            print(f"round {r}/{args.rounds} done (steps {start + 1}..{end})", file=sys.stderr)
        log_file.close()
        audit_s = time_audit(f"{tmp}/b", ref.model, cfg, device)

    load_after = os.getloadavg()[0]
    n = ref.model.n_params
    print(
        f"train throughput: config {cfg.name} on {device}, torch {torch.__version__}, {t.num_threads} threads"
    )
    print(
        f"  model {n:,} parameters ({expected_size(n) / 1e6:,.1f} MB checkpoints), "
        f"batch {t.batch_size} x {cfg.model.block_size} = {tokens_per_step:,} tokens/step, "
        f"compile {t.compile}, {per_token / 1e6:,.1f} MFLOP/token"
    )
    print(f"  fed to (a): uniform random token ids in [0, {cfg.model.vocab_size:,}), a fixed generator")
    print(f"  fed to (b), (c): the trainer's own DataPipeline: {fed}")
    print(
        f"  {args.rounds} round(s) of {length} steps per arm, interleaved; the first "
        f"{args.skip} steps of every round untimed; (c) checkpoints every {args.checkpoint_every} steps"
    )
    print("  the sample audit (every checkpoint by default) is off in (b), (c), (d): timed on its own below")
    print(f"  MFU against {peak_note}")
    print(
        f"  load average (1 min) before / after: {load_before:.2f} / {load_after:.2f}, {os.cpu_count()} cores"
    )
    print()
    print(f"  {'':34} {'tokens/s':>12} {'MFU':>8} {'steps timed':>12} {'s/step':>9}")
    for arm in arms.values():
        if arm.failed:
            print(f"  {arm.label:<34} failed: {arm.failed[:300]}")
            continue
        tps = arm.tokens_per_s(tokens_per_step)
        mfu = f"{tps * per_token / peak:8.1%}" if peak else f"{'n/a':>8}"
        print(f"  {arm.label:<34} {tps:12,.0f} {mfu} {arm.steps:12d} {arm.seconds / arm.steps:9.4f}")
    a, b, c = (arms[k].tokens_per_s(tokens_per_step) for k in "abc")
    print()
    print(f"  b/a = {b / a:.4f}   (target >= 0.98: the pipeline adds nothing measurable to the step)")
    print(f"  c/b = {c / b:.4f}   (target >= 0.99 on CUDA with 124M; >= 0.97 on a CPU with andrea-12m)")
    if "d" in arms:
        print(f"  d/b = {arms['d'].tokens_per_s(tokens_per_step) / b:.4f}   (synchronous checkpoints)")
    for key, arm in arms.items():
        if key.startswith("v") and not arm.failed:
            label = arm.label[4:]
            print(f"  v/b = {arm.tokens_per_s(tokens_per_step) / b:.4f}   ({label}: {variants[label]})")
    step_b = arms["b"].seconds / arms["b"].steps
    every = args.checkpoint_every
    share = audit_s / (audit_s + every * step_b)
    print(
        f"  sample audit: {audit_s * 1e3:,.1f} ms = {audit_s / step_b:.3f} steps of (b); at the default "
        f"cadence (one per checkpoint, every {every} steps) {share:.2%} of a run's time"
    )
    for key in [k for k in arms if k in "cd"]:
        arm = arms[key]
        if not arm.stalls:
            continue
        step_s = statistics.median(arm.step_times)
        print(
            f"  {arm.label}: {len(arm.stalls)} checkpoints; per checkpoint: loop blocked in save() "
            f"{statistics.mean(arm.stalls) * 1e3:,.1f} ms (max {max(arm.stalls) * 1e3:,.1f}), "
            f"the steps around it took {statistics.mean(arm.loop_stalls) * 1e3:,.1f} ms over the median, "
            f"write {statistics.mean(arm.writes):.2f} s; median step {step_s * 1e3:,.1f} ms"
        )


if __name__ == "__main__":
    main()
