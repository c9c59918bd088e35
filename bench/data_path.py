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

With --shape-120m: the data path alone at ANDREA-120M's batch (32 x 1024 tokens) from sharded caches
of the user's-corpus kinds: a generated JSON Lines corpus (--corpus-mb, built by the cache builder in
shards of --shard-mb) and an llm.c tokens arm made from it, mixed by EXP3. Its batches/s are set against
what the 120M trainer consumes on an H200 (measured: 59 ms a step); the target is >= 20x.

    python bench/data_path.py --shape-120m [--corpus-mb 128] [--shard-mb 16] [--batches 2000]
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
from andrea_core.run.record import cpu_model  # noqa: E402
from andrea_core.run.rundir import RunDir  # noqa: E402
from andrea_core.train.setup import create_run
from andrea_core.train.trainer import Trainer  # noqa: E402

H200_120M_STEP_S = 0.059  # ANDREA-120M's trainer step on an H200, measured (issue 9)


def main_120m(args: argparse.Namespace) -> None:
    """The data path at the 120M shape from sharded caches (no model: the trainer's rate is the H200's)."""
    import os

    import numpy as np

    from andrea_core.config import load_yaml
    from andrea_core.data.pipeline import DataPipeline
    from andrea_core.data.policy import parse_policy
    from andrea_core.data.tokens import ByteTokenizer
    from bench.data_prepare import generate

    with tempfile.TemporaryDirectory(prefix="andrea-bench-120m-") as tmp:  # ~10 MB a run: never left
        work = Path(tmp)
        os.environ["ANDREA_CACHE_DIR"] = str(work / "cache")
        os.environ["ANDREA_SHARD_TOKENS"] = str(args.shard_mb << 20)
        generate(work / "corpus", args.corpus_mb)
        cfg = load_run_config("andrea-120m").with_overrides(
            {"data.tokenizer": "bytes", "model.vocab_size": 256}
        )
        quiet = lambda line: None  # noqa: E731
        one = f"name: one\narms:\n  - {{name: posts, kind: jsonl, paths: [{work / 'corpus'}]}}\n"
        t0 = time.perf_counter()
        posts = DataPipeline(cfg, parse_policy(load_yaml(one, "p"), "p"), quiet, ByteTokenizer()).arms[
            "posts"
        ]
        built = time.perf_counter() - t0
        # An llm.c arm of the same tokens, in 4 shards plus a val shard, as another tool would have written.
        (work / "llmc").mkdir()
        train = np.concatenate(posts.train.parts)
        for i, part in enumerate(np.array_split(train, 4)):
            header = np.zeros(256, "<i4")
            header[:3] = (20240520, 1, len(part))
            (work / "llmc" / f"c_train_{i:06d}.bin").write_bytes(
                header.tobytes() + part.astype("<u2").tobytes()
            )
        val = np.concatenate(posts.val.parts)
        header = np.zeros(256, "<i4")
        header[:3] = (20240520, 1, len(val))
        (work / "llmc" / "c_val_000000.bin").write_bytes(header.tobytes() + val.astype("<u2").tobytes())
        del train, val
        text = (
            f"name: two\nmixer: exp3\narms:\n  - {{name: posts, kind: jsonl, paths: [{work / 'corpus'}]}}\n"
            f"  - {{name: llmc, kind: tokens, tokenizer: bytes, paths: [{work / 'llmc'}]}}\n"
        )
        data = DataPipeline(cfg, parse_policy(load_yaml(text, "p"), "p"), quiet, ByteTokenizer())
        for step in range(1, 51):  # warm the page cache the way a running trainer has it warm
            data.observe(step, data.batch(step).arm, 3.0)
        t0 = time.perf_counter()
        for step in range(51, 51 + args.batches):
            batch = data.batch(step)
            data.observe(step, batch.arm, 3.0 + (step % 7) * 0.01)
        data_s = (time.perf_counter() - t0) / args.batches
        B, T = cfg.train.batch_size, cfg.model.block_size
        shards = {a: len(arm.train.parts) for a, arm in data.arms.items()}
        print(
            f"120M shape: batch {B}x{T}; corpus {args.corpus_mb} MB of JSON Lines, "
            f"cache built in {built:.1f}s"
        )
        print(
            "arms (train tokens, shards): "
            + ", ".join(f"{a} {len(x.train):,} in {shards[a]}" for a, x in data.arms.items())
        )
        print(
            f"data path: {1 / data_s:,.0f} batches/s ({data_s * 1e6:,.0f} us/batch, "
            f"{B * T / data_s:,.0f} tokens/s)"
        )
        print(
            f"against the 120M trainer on an H200 ({H200_120M_STEP_S * 1e3:.0f} ms/step): "
            f"the data path delivers {H200_120M_STEP_S / data_s:,.1f}x the batches it consumes "
            "(target >= 20x)"
        )
        print(f"{cpu_model()}, load average {os.getloadavg()[0]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--shape-120m", action="store_true", help="the data path alone at 32x1024, sharded caches"
    )
    ap.add_argument("--corpus-mb", type=int, default=128, help="--shape-120m: generated corpus size")
    ap.add_argument("--shard-mb", type=int, default=16, help="--shape-120m: cache shard size (M tokens)")
    ap.add_argument("--config", default="andrea-12m")
    ap.add_argument("--batches", type=int, default=2000, help="data-path batches to time")
    ap.add_argument("--steps", type=int, default=10, help="trainer steps to time (after 2 warm-up steps)")
    ap.add_argument("--max-source-bytes", type=int, help="override data.max_source_bytes (cache size)")
    ap.add_argument("--run-dir", help="reuse this run directory (default: a fresh temporary one)")
    args = ap.parse_args()
    if args.shape_120m:
        main_120m(args)
        return

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
