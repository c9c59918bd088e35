"""Benchmark: .loss.json at the length of a long run (issue 6's targets: append 200,000 entries in under
2 s in total, read the canonical history of 200,000 entries in under 1 s).

Appends exactly as the trainer does (LossWriter.log, then flush, once per step; durable at close), then
reads back through read_history, the reader every tool uses. Prints the figures; asserts nothing.

    .venv/bin/python bench/loss_log.py [--entries 200000] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from andrea_core.loss_log import LossWriter, read_history  # noqa: E402
from andrea_core.rundir import LOSS_LOG, RunDir  # noqa: E402

ARMS = ["stdlib-code", "repo-docstrings", "docs-prose"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--entries", type=int, default=200_000)
    p.add_argument("--dir", help="where to write (default: a temporary folder beside the repository)")
    args = p.parse_args()
    root = Path(args.dir) if args.dir else Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(dir=root, prefix=".bench-loss-log-") as tmp:
        run = RunDir(tmp)
        n = args.entries
        loss, t_wall = 10.8, 1.7e9
        t0, c0 = time.perf_counter(), time.process_time()
        writer = LossWriter(run)
        for step in range(1, n + 1):
            loss = 0.999 * loss + 0.001 * 2.5  # a plausible curve: real floats, full repr
            writer.log(step, loss, 6e-4 * (1 - step / (n + 1)), ARMS[step % 3], 32768, t_wall + 0.0643 * step)
            writer.flush()
        writer.close()
        append_s, append_cpu = time.perf_counter() - t0, time.process_time() - c0
        size = run.size(LOSS_LOG)

        t0, c0 = time.perf_counter(), time.process_time()
        history = read_history(run)
        read_s, read_cpu = time.perf_counter() - t0, time.process_time() - c0
        assert len(history) == n and history[-1].step == n, "the history read back is not the one written"

    print(f"loss log benchmark: {n:,} entries, {size / 1e6:.1f} MB of JSON Lines")
    print(f"  load average (1 min): {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    for what, seconds, cpu, target in (
        ("append (log + flush per step, fsync at close)", append_s, append_cpu, 2.0),
        ("read the canonical history", read_s, read_cpu, 1.0),
    ):
        verdict = "met" if seconds < target else "MISSED"
        per_entry = f"{seconds / n * 1e6:5.2f} us/entry"
        print(
            f"  {what:<48} {seconds:6.3f} s  ({per_entry}, CPU {cpu:.3f} s)  target < {target:g} s: {verdict}"
        )


if __name__ == "__main__":
    main()
