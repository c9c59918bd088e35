"""Benchmark: one sample audit against one training step of the same config, before and after.

  before  the audit as it was: each arm's validation loss in its own forward pass, then the prompts
          (left-padded with newline tokens, no mask) generated without a KV cache: every new token a
          forward pass over the whole sequence so far (reimplemented here: `old_validation`,
          `old_generation`);
  after   andrea_core.train.audit.run_audit: all arms' validation losses in one forward pass, all prompts in
          one batch with a KV cache (GPT.generate).
Both on the same untrained-but-initialised model, the same data, the same device; each timed as the
median of --repeats runs after one untimed warm-up. The training step is the trainer's own
(Trainer._step on a batch of the config's shape: forward, backward, clip, AdamW), median of --steps.
The data sources are capped at --source-bytes per arm (the audit's cost does not depend on them).

    .venv/bin/python bench/audit.py --config andrea-12m
    python3 bench/audit.py --device cuda --config andrea-120m
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from andrea_core.config import load_run_config  # noqa: E402
from andrea_core.data.pipeline import DataPipeline  # noqa: E402
from andrea_core.data.policy import load_policy  # noqa: E402
from andrea_core.data.tokens import BPETokenizer, train_run_bpe  # noqa: E402
from andrea_core.model.gpt import GPT  # noqa: E402
from andrea_core.train import distributed  # noqa: E402
from andrea_core.train.audit import (  # noqa: E402
    NEW_TOKENS,
    PROMPTS,
    TEMPERATURE,
    VAL_SEQS,
    generate_samples,
    run_audit,
    validation_losses,
)
from andrea_core.train.optim import build_optimizer  # noqa: E402
from andrea_core.train.trainer import Trainer  # noqa: E402


@torch.no_grad()
def old_validation(model: GPT, data: DataPipeline, device: str) -> None:
    """Before: one forward and one host sync per arm."""
    for arm in data.arms:
        x, y = data.val_batch(arm, VAL_SEQS)
        logits, _ = model(x.to(device))
        F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten()).item()


@torch.no_grad()
def old_generation(model: GPT, data: DataPipeline, seed: int, device: str) -> None:
    """Before: prompts left-padded with newline tokens (no mask), one generator for the batch, and a
    forward pass over the whole sequence for every new token, at the run's thread count."""
    tok = data.tokenizer
    encoded = [tok.encode(p) for p in PROMPTS]
    pad = tok.encode("\n")[0]
    width = max(len(e) for e in encoded)
    idx = torch.tensor([[pad] * (width - len(e)) + e for e in encoded], device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    for _ in range(NEW_TOKENS):
        logits, _ = model(idx[:, -model.cfg.block_size :])
        probs = F.softmax(logits[:, -1, :].float() / TEMPERATURE, dim=-1)
        idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
    [tok.decode(row[width:].tolist()) for row in idx]


def timed(fn, repeats: int, device: str) -> float:
    fn()  # warm-up: allocator, kernels, lazy initialisation
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--config", default="andrea-12m")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="training steps timed (after one warm-up)")
    p.add_argument("--source-bytes", type=int, default=2_000_000, help="data per arm (caps the config's)")
    p.add_argument("--threads", type=int, help="override the config's num_threads")
    args = p.parse_args()

    overrides = {"data.max_source_bytes": args.source_bytes}
    if args.threads:
        overrides["train.num_threads"] = args.threads
    cfg = load_run_config(args.config).with_overrides(overrides, "bench")
    device = args.device
    torch.set_num_threads(cfg.train.num_threads)
    policy, _ = load_policy(cfg.data.policy)
    tokenizer = BPETokenizer(train_run_bpe(policy, cfg)) if cfg.data.tokenizer == "bpe" else None
    data = DataPipeline(cfg, policy, warn=lambda line: None, tokenizer=tokenizer)
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model).to(device)

    # The trainer's step, on the trainer's objects, without a run directory.
    trainer = Trainer.__new__(Trainer)
    trainer.cfg, trainer.device, trainer.model, trainer.forward = cfg, device, model, model
    trainer.world = distributed.world_from_env()  # one process
    trainer.optimizer = build_optimizer(model, cfg.train, device)
    trainer.autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.startswith("cuda")
        else contextlib.nullcontext()
    )
    batch = data.batch(1)
    x, y = batch.x.to(device), batch.y.to(device)
    step_s = timed(lambda: trainer._step(x, y), args.steps, device)

    model.eval()  # as run_audit does
    parts = {
        "validation, before (a forward per arm)": lambda: old_validation(model, data, device),
        "validation, after (one forward)": lambda: validation_losses(model, data, device),
        "generation, before (no cache)": lambda: old_generation(model, data, cfg.train.seed, device),
        "generation, after (KV cache)": lambda: generate_samples(model, data, cfg.train.seed, device),
    }
    times = {label: timed(fn, args.repeats, device) for label, fn in parts.items()}
    model.train()
    after = timed(lambda: run_audit(model, data, cfg, 0, device), args.repeats, device)
    labels = list(times)
    before = times[labels[0]] + times[labels[2]]

    print(
        f"sample audit: config {cfg.name} on {device}, torch {torch.__version__}, "
        f"{cfg.train.num_threads} threads"
    )
    print(
        f"  model {model.n_params:,} parameters; {len(data.arms)} arms x {VAL_SEQS} validation windows of "
        f"{cfg.model.block_size} tokens; {len(PROMPTS)} prompts x {NEW_TOKENS} new tokens"
    )
    print(f"  load average (1 min): {os.getloadavg()[0]:.2f}, {os.cpu_count()} cores")
    print(f"  {'training step (batch ' + str(cfg.train.batch_size) + ')':<42} {step_s * 1e3:10,.1f} ms")
    for label, seconds in times.items():
        print(f"  {label:<42} {seconds * 1e3:10,.1f} ms = {seconds / step_s:6.3f} steps")
    totals = {"audit before (the two befores)": before, "audit after (run_audit)": after}
    for label, seconds in totals.items():
        print(f"  {label:<42} {seconds * 1e3:10,.1f} ms = {seconds / step_s:6.3f} steps")
    print(
        f"  speed-up: audit {before / after:.2f}x, generation {times[labels[2]] / times[labels[3]]:.2f}x, "
        f"validation {times[labels[0]] / times[labels[1]]:.2f}x"
    )


if __name__ == "__main__":
    main()
