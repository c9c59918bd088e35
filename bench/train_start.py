"""Benchmark: how long a CPU trainer takes to start, with andrea's AdamW (train/adamw.py: torch's, its
methods' torch._dynamo import skipped) against torch.optim.AdamW itself, in the same run.

Each repetition is a fresh `andrea train` process creating an andrea-tiny run and training it for one
step (one checkpoint, one audit): the time from exec to exit. The baseline is the same command with
`andrea_core.train.adamw.AdamW` set to torch.optim.AdamW before the CLI starts. `import torch` alone is
timed too, the floor no start goes under. Repetitions alternate so that a drifting machine favours
neither; medians are printed. Prints figures; asserts nothing.

    .venv/bin/python bench/train_start.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

CLI = """import runpy, sys
if sys.argv.pop(1) == "torch":
    import torch, andrea_core.train.adamw as adamw
    adamw.AdamW = torch.optim.AdamW
sys.argv = ["andrea", *sys.argv[1:]]
runpy.run_module("andrea_core", run_name="__main__")
"""


def timed(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True, env=env, cwd=REPO)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    from tiny import tiny_config

    work = Path(tempfile.mkdtemp(prefix="andrea-start-"))
    config = tiny_config(work, train__max_steps=1, train__checkpoint_every=1)
    env = {**os.environ, "PYTHONPATH": str(REPO), "ANDREA_CACHE_DIR": str(work / "cache")}
    times: dict[str, list[float]] = {"import torch": [], "torch.optim.AdamW": [], "andrea AdamW": []}
    start = [sys.executable, "-c", CLI]
    for i in range(args.repeats + 1):  # the first round builds the token cache: not counted
        run = ["train", "--config", config, "--device", "cpu", "--run-dir"]
        t = {
            "import torch": timed([sys.executable, "-c", "import torch"], env),
            "torch.optim.AdamW": timed([*start, "torch", *run, str(work / f"torch-{i}")], env),
            "andrea AdamW": timed([*start, "andrea", *run, str(work / f"andrea-{i}")], env),
        }
        if i:
            for k, v in t.items():
                times[k].append(v)
    shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"andrea-tiny CPU trainer start to a 1-step run's exit, median of {args.repeats} fresh processes")
    for k, v in med.items():
        print(f"  {k:18s} {v:6.2f} s   (min {min(times[k]):.2f}, max {max(times[k]):.2f})")
    base, ours, floor = med["torch.optim.AdamW"], med["andrea AdamW"], med["import torch"]
    print(
        f"andrea's AdamW: {base - ours:.2f} s less a start, {ours / base:.2f}x the baseline's time; "
        f"above import torch: {base - floor:.2f} s -> {ours - floor:.2f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
