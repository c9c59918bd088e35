"""Benchmark: .loss.json at the length of a long run (issue 6's targets: append 200,000 entries in under
2 s in total, read the canonical history of 200,000 entries in under 1 s).

Appends exactly as the trainer does (LossWriter.log, then flush, once per step; durable at close), then
reads back through read_history, the reader every tool uses, and the pivot's LossLogSnapshot.take.
Then parse_entries (orjson, json.loads for the lines orjson refuses) against json.loads on every line,
best of three each, after checking both give the same entries. Prints the figures; asserts only that.

    .venv/bin/python bench/loss_log.py [--entries 200000] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from andrea_core.ops.supervise import LossLogSnapshot  # noqa: E402
from andrea_core.run.loss_log import LossWriter, _entry, parse_entries, read_history  # noqa: E402
from andrea_core.run.rundir import LOSS_LOG, RunDir  # noqa: E402

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
        t0 = time.perf_counter()
        LossLogSnapshot.take(run)
        snapshot_s = time.perf_counter() - t0

        data = run.read_bytes(LOSS_LOG)
        fast, plain = best_of(3, parse_entries, data), best_of(3, json_loads_reader, data)
        assert same(parse_entries(data), json_loads_reader(data)), "orjson and json.loads disagree"

    print(f"loss log benchmark: {n:,} entries, {size / 1e6:.1f} MB of JSON Lines")
    print(f"  LossLogSnapshot.take (the pivot's, twice per pivot) {snapshot_s:6.3f} s")
    print(
        f"  parse_entries (orjson) {fast:.3f} s, json.loads per line {plain:6.3f} s: ratio {fast / plain:.2f}"
    )
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


def json_loads_reader(data: bytes) -> tuple[list, int]:
    """The reader without orjson: json.loads on every line, a bad line skipped and counted."""
    entries, skipped = [], 0
    for line in data.split(b"\n"):
        if line.strip():
            try:
                entries.append(_entry(json.loads(line)))
            except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
                skipped += 1
    return entries, skipped


def same(a: tuple[list, int], b: tuple[list, int]) -> bool:
    """Equal entries and skip counts, NaN equal to NaN."""

    def key(e):
        return tuple("nan" if isinstance(x, float) and math.isnan(x) else x for x in e)

    return a[1] == b[1] and [key(e) for e in a[0]] == [key(e) for e in b[0]]


def best_of(rounds: int, fn, data: bytes) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn(data)
        times.append(time.perf_counter() - t0)
    return min(times)


if __name__ == "__main__":
    main()
