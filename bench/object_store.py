"""Checkpoint write and read throughput with the run directory on an S3 server, against a raw s3fs
put/get of the same bytes in the same run, and against local disk.

    python bench/object_store.py [--config andrea-12m] [--repeats 3]

The S3 server is moto's server mode in its own process on 127.0.0.1 (tests/s3_server.py), so the
absolute figures measure this machine's loopback and moto, not a cloud store; the ratios are the point:
what RunDir's atomic, aborting, streaming put (and validated read) costs over s3fs doing the bare
transfer, and what the object store costs over local disk.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import torch  # noqa: E402
from s3_server import start_s3_server  # noqa: E402

from andrea_core.checkpoint import checkpoint_name  # noqa: E402
from andrea_core.config import load_run_config  # noqa: E402
from andrea_core.model.gpt import GPT  # noqa: E402
from andrea_core.run.rundir import RunDir  # noqa: E402
from andrea_core.train.checkpoint_writer import Checkpointer  # noqa: E402
from andrea_core.train.optim import build_optimizer  # noqa: E402


def timed(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="andrea-12m", help="model whose checkpoint is written")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    cfg = load_run_config(args.config)
    torch.manual_seed(0)
    model = GPT(cfg.model)
    optimizer = build_optimizer(model, cfg.train, "cpu")
    n = model.n_params
    size_mb = (8 + 12 * n) / 1e6
    print(f"checkpoint of {args.config}: {n:,} parameters, {size_mb:.1f} MB; median of {args.repeats}")

    server = start_s3_server()
    try:
        server.use_in_this_process()
        raw = server.client()
        raw.mkdir("bench")
        with tempfile.TemporaryDirectory() as tmp:
            runs = {"s3": RunDir("s3://bench/run"), "local": RunDir(os.path.join(tmp, "run"))}
            results: dict[str, float] = {}
            for where, run in runs.items():
                run.makedirs()
                ckpt = Checkpointer(run, model, optimizer)
                results[f"{where} checkpoint write"] = timed(lambda c=ckpt: c.save(100), args.repeats)
                results[f"{where} checkpoint read"] = timed(
                    lambda r=run: r.read_checkpoint(100, n), args.repeats
                )
            data = runs["s3"].read_bytes(checkpoint_name(100))
            results["s3 raw s3fs put"] = timed(lambda: raw.pipe_file("bench/raw.bin", data), args.repeats)
            results["s3 raw s3fs get"] = timed(lambda: raw.cat_file("bench/raw.bin"), args.repeats)
            local_raw = os.path.join(tmp, "raw.bin")
            results["local raw write"] = timed(lambda: Path(local_raw).write_bytes(data), args.repeats)
            results["local raw read"] = timed(lambda: Path(local_raw).read_bytes(), args.repeats)
    finally:
        server.stop()

    for name, seconds in results.items():
        print(f"  {name:<24} {seconds:7.3f} s  {size_mb / seconds:8.1f} MB/s")
    print("ratios of times (1.00: as fast as the baseline):")
    for what, slow, base in [
        ("checkpoint write on S3 / raw s3fs put", "s3 checkpoint write", "s3 raw s3fs put"),
        ("checkpoint read on S3 / raw s3fs get", "s3 checkpoint read", "s3 raw s3fs get"),
        ("checkpoint write on S3 / on local disk", "s3 checkpoint write", "local checkpoint write"),
        ("checkpoint read on S3 / on local disk", "s3 checkpoint read", "local checkpoint read"),
        ("local checkpoint write / raw local write", "local checkpoint write", "local raw write"),
    ]:
        print(f"  {what:<42} {results[slow] / results[base]:6.2f}")


if __name__ == "__main__":
    main()
