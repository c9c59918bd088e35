"""Benchmark: checkpoint I/O through the project's code against raw file I/O of the same bytes, same disk.

A 12.8M-parameter checkpoint (andrea-12m: 12,705,920 parameters, 152.5 MB) is
  written through Checkpointer.save: snapshot of the live model and AdamW, then RunDir.write_atomic
    (temporary name, write, flush, fsync, rename, directory fsync); synchronously, and asynchronously
    (how long the caller is blocked, and when the file is published);
  read through RunDir.read_checkpoint: read, check size, header and name, non-finite and negative-v scan;
and, in the same run and folder, the same bytes are written raw (open, write, fsync) and read raw.
Reads are cold: the file's pages are dropped from the page cache (posix_fadvise DONTNEED after fsync)
before each read, for both; warm reads are printed too. Repetitions alternate project and raw so that
a drifting machine favours neither; medians are printed. Prints figures; asserts nothing.

    .venv/bin/python bench/checkpoint_io.py [--config andrea-12m] [--repeats 5] [--dir DIR]
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
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from andrea_core.checkpoint import checkpoint_name, restore, snapshot  # noqa: E402
from andrea_core.config import load_run_config  # noqa: E402
from andrea_core.model.gpt import GPT  # noqa: E402
from andrea_core.run.rundir import RunDir  # noqa: E402
from andrea_core.train.checkpoint_writer import Checkpointer  # noqa: E402
from andrea_core.train.optim import build_optimizer  # noqa: E402


def drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def raw_write(path: Path, data: bytes) -> float:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def raw_read(path: Path) -> tuple[float, bytes]:
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        data = f.read()
    return time.perf_counter() - t0, data


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="andrea-12m")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", help="where to write (default: a temporary folder beside the repository)")
    args = p.parse_args()
    cfg = load_run_config(args.config)
    torch.set_num_threads(cfg.train.num_threads)
    torch.manual_seed(0)
    model = GPT(cfg.model)
    optimizer = build_optimizer(model, cfg.train, "cpu")
    x = torch.randint(0, cfg.model.vocab_size, (1, 8))
    model(x, x)[1].backward()  # one small step, so that Adam m and v are real, non-zero numbers
    optimizer.step()
    n = model.n_params
    step = 100

    root = Path(args.dir) if args.dir else REPO
    times: dict[str, list[float]] = {}

    def add(key: str, seconds: float) -> None:
        times.setdefault(key, []).append(seconds)

    with tempfile.TemporaryDirectory(dir=root, prefix=".bench-checkpoint-io-") as tmp:
        run = RunDir(f"{tmp}/run")
        run.makedirs()
        final = Path(tmp) / "run" / checkpoint_name(step)
        raw = Path(tmp) / "raw.bin"
        sync = Checkpointer(run, model, optimizer, asynchronous=False, log=lambda _: None)
        background = Checkpointer(run, model, optimizer, log=lambda _: None)
        host = snapshot(model, optimizer)
        for _ in range(args.repeats):
            add("of which snapshot", timed(lambda: snapshot(model, optimizer, out=host))[0])
            # Every write makes a new file, as in training (a new name each checkpoint): replacing an
            # old file would add the freeing of its blocks to the write.
            add("project write (sync save)", timed(lambda: sync.save(step))[0])
            data = final.read_bytes()
            add("raw write + fsync", raw_write(raw, data))

            final.unlink()
            t0 = time.perf_counter()
            background.save(step)
            add("async save: caller blocked", time.perf_counter() - t0)
            background.wait()
            add("async save: published after", time.perf_counter() - t0)
            assert final.read_bytes() == data, "the asynchronous writer wrote other bytes"

            drop_from_page_cache(final)
            seconds, ckpt = timed(lambda: run.read_checkpoint(step, n))
            add("project read (cold)", seconds)
            drop_from_page_cache(raw)
            add("raw read (cold)", raw_read(raw)[0])
            add("project read (warm)", timed(lambda: run.read_checkpoint(step, n))[0])
            add("raw read (warm)", raw_read(raw)[0])
            add("restore into model + AdamW", timed(lambda c=ckpt: restore(c, model, optimizer))[0])
            raw.unlink()
            final.unlink()

    size = len(data)
    median = {k: statistics.median(v) for k, v in times.items()}
    rate = {k: size / s / 1e6 for k, s in median.items()}
    print(
        f"checkpoint I/O: {cfg.name}, {n:,} parameters, {size:,} bytes per checkpoint, {args.repeats} repeats"
    )
    print(f"  disk: the folder {root} ({os.statvfs(root).f_bsize}-byte blocks); medians")
    for key, seconds in median.items():
        print(f"  {key:<30} {seconds * 1e3:9.1f} ms  {rate[key]:9.1f} MB/s")
    for what, project, raw_key in (
        ("write", "project write (sync save)", "raw write + fsync"),
        ("read (cold)", "project read (cold)", "raw read (cold)"),
        ("read (warm)", "project read (warm)", "raw read (warm)"),
    ):
        print(
            f"  {what}: project {rate[project]:.1f} MB/s vs raw {rate[raw_key]:.1f} MB/s, "
            f"ratio {rate[project] / rate[raw_key]:.3f}"
        )


if __name__ == "__main__":
    main()
