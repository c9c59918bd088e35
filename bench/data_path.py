"""Is the data path ever what the trainer waits on? Batches/s of the mixer against the trainer's step rate.

In one process, on a fresh andrea-12m run (its BPE trained at creation, its token caches built or
reused from the cache directory):
  (a) the data path: DataPipeline.batch(step) + observe(step): the EXP3 bandit's draw and update, the
      projection onto floors and caps, and the window gather from the memory-mapped token cache;
  (b) the trainer's step: Trainer._step (forward, backward, clip, AdamW) on those batches;
and prints both rates, their ratio, the share of a step the data path costs (it runs inline, so the
trainer waits on it for exactly that long), and what a checkpoint adds: writing .state.json, and the
sample audit (by default at every checkpoint).

    python bench/data_path.py [--config andrea-12m] [--batches 2000] [--steps 10] [--max-source-bytes N]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from andrea_core.config import load_run_config  # noqa: E402
from andrea_core.data.pipeline import step_rng  # noqa: E402
from andrea_core.rundir import RunDir  # noqa: E402
from andrea_core.runs import cpu_model, create_run  # noqa: E402
from andrea_core.trainer import Trainer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="andrea-12m")
    ap.add_argument("--batches", type=int, default=2000, help="data-path batches to time")
    ap.add_argument("--steps", type=int, default=10, help="trainer steps to time (after 2 warm-up steps)")
    ap.add_argument("--max-source-bytes", type=int, help="override data.max_source_bytes (cache size)")
    ap.add_argument("--run-dir", help="reuse this run directory (default: a fresh temporary one)")
    args = ap.parse_args()

    cfg = load_run_config(args.config)
    if args.max_source_bytes:
        cfg = cfg.with_overrides({"data.max_source_bytes": args.max_source_bytes})
    url = args.run_dir or str(Path(tempfile.mkdtemp(prefix="andrea-bench-")) / "run")
    t0 = time.perf_counter()
    if not RunDir(url).exists("run.yaml"):
        create_run(RunDir(url), cfg)
    created = time.perf_counter() - t0

    trainer = Trainer(url, device="cpu", log=lambda line: None)
    t0 = time.perf_counter()
    trainer._build()  # model, AdamW, the data pipeline (token caches), the bandit, the step-0 audit
    built = time.perf_counter() - t0
    data = trainer.data
    T, B = cfg.model.block_size, cfg.train.batch_size

    # (a) the data path, as the trainer drives it: one batch and one observation per step.
    t0 = time.perf_counter()
    for step in range(1, args.batches + 1):
        batch = data.batch(step)
        data.observe(step, batch.arm, 3.0 + (step % 7) * 0.01)
    data_s = (time.perf_counter() - t0) / args.batches
    t0 = time.perf_counter()
    for step in range(args.batches + 1, 2 * args.batches + 1):
        data.mixer.observe(step, data.mixer.choose(step, step_rng(cfg.train.seed, step)), 3.0)
    mixer_s = (time.perf_counter() - t0) / args.batches
    t0 = time.perf_counter()
    for _ in range(20):
        data.save_state(100)
    state_s = (time.perf_counter() - t0) / 20

    # (b) the trainer's step on real batches of the run.
    batches = [data.batch(s) for s in range(1, args.steps + 3)]
    for b in batches[:2]:
        trainer._step(b.x, b.y)
    t0 = time.perf_counter()
    for b in batches[2:]:
        trainer._step(b.x, b.y).item()
    step_s = (time.perf_counter() - t0) / args.steps
    t0 = time.perf_counter()
    trainer.auditor.record(100)  # not the data path, but also paid at every checkpoint by default
    audit_s = time.perf_counter() - t0

    every = cfg.train.checkpoint_every
    arms = ", ".join(f"{a} {len(arm.train):,}" for a, arm in data.arms.items())
    print(
        f"{cfg.name}: {trainer.model.n_params:,} params, batch {B}x{T}, {cfg.train.num_threads} threads, "
        f"{cpu_model()}, torch {torch.__version__}"
    )
    print(f"setup: run created (BPE trained) in {created:.1f}s, trainer built (caches) in {built:.1f}s")
    print(f"token caches (train tokens): {arms}; mixer {data.mixer.kind}")
    print(
        f"(a) data path: {1 / data_s:,.0f} batches/s ({data_s * 1e6:,.0f} us/batch, of which the bandit's "
        f"draw + update {mixer_s * 1e6:,.0f} us)"
    )
    print(f"(b) trainer:   {1 / step_s:,.2f} steps/s ({step_s * 1e3:,.0f} ms/step)")
    print(
        f"ratio a/b: the data path delivers {step_s / data_s:,.0f}x the batches the trainer consumes; "
        f"it costs {100 * data_s / step_s:.3f}% of a step"
    )
    print(
        f".state.json write per checkpoint: {state_s * 1e3:.2f} ms "
        f"({100 * state_s / (step_s * every):.4f}% of the {every} steps between checkpoints)"
    )

    print(
        f"sample audit per checkpoint: {audit_s:.2f} s ({100 * audit_s / (step_s * every):.2f}% of the "
        f"{every} steps between checkpoints)"
    )


if __name__ == "__main__":
    main()
