"""S3 requests a checkpoint: what a trainer asks of the store at each checkpoint, by kind of request.

    python bench/s3_requests.py [--every 5] [--checkpoints 10]

andrea-tiny with the soak's settings (tiny-mix, a checkpoint every 5 steps, an audit every 4th,
retention keep_last 3 / keep_every 50) trains on moto's server (tests/s3_server.py), which logs one line
a request. Two runs resume the same run directory, one of 2 checkpoints and one of 2 + N: each has one
start (a resume), so their difference is N checkpoints' requests alone. On a real store each request is
a round trip (tens of ms) and a billed call; the kinds say where they go.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from s3_server import start_s3_server  # noqa: E402
from tiny import tiny_config  # noqa: E402

# moto's request log: "METHOD /bucket/key?query HTTP/1.1" STATUS
REQUEST = re.compile(r'"([A-Z]+) (/[^ ?]*)(\?\S*)? HTTP/1\.[01]" (\d{3})')


def kind(method: str, path: str, query: str) -> str:
    """A request's S3 operation, from its method and query string."""
    q = query or ""
    if method == "GET":
        return "list" if ("list-type" in q or "prefix=" in q or path.count("/") < 2) else "get"
    if method == "PUT":
        return "upload part" if "partNumber" in q else "put"
    if method == "POST":
        return "create upload" if "uploads" in q else "complete upload" if "uploadId" in q else "post"
    if method == "DELETE":
        return "abort upload" if "uploadId" in q else "delete"
    return method.lower()  # HEAD


def count(log: Path) -> collections.Counter:
    kinds: collections.Counter = collections.Counter()
    for m in REQUEST.finditer(log.read_text(errors="replace")):
        if m.group(2).startswith("/moto-api"):
            continue
        kinds[kind(m.group(1), m.group(2), m.group(3))] += 1
    return kinds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--every", type=int, default=5, help="steps between checkpoints")
    ap.add_argument("--checkpoints", type=int, default=10, help="checkpoints measured")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="s3-requests-"))
    log = work / "moto.log"
    server = start_s3_server(log=log)
    try:
        server.client().mkdir("requests")
        policy = REPO / "configs" / "policies" / "tiny-mix.yaml"
        cfg = tiny_config(
            work,
            name="requests",
            **{
                "train__checkpoint_every": args.every,
                "train__sample_every": 4 * args.every,
                "train__log_every": 1,
                "data__policy": str(policy),
                "retention__keep_last": 3,
                "retention__keep_every": 10 * args.every,
            },
        )
        env = {**os.environ, **server.env()}

        def train_to(step: int) -> collections.Counter:
            before = count(log)
            argv = ["train", "--config", cfg, "--run-dir", "s3://requests/run", "--device", "cpu"]
            subprocess.run(
                [sys.executable, "-m", "andrea_core", *argv, "--max-steps", str(step)],
                env=env, cwd=REPO, check=True, capture_output=True,
            )  # fmt: skip
            return count(log) - before

        first = 10 * args.every
        train_to(first)  # a run to resume: its creation is not measured
        short = train_to(first + 2 * args.every)
        long = train_to(first + (4 + args.checkpoints) * args.every)
        n = args.checkpoints
        per = {k: (long[k] - short[k]) / n for k in set(long) | set(short)}
        print(f"S3 requests a checkpoint ({n} checkpoints every {args.every} steps, andrea-tiny, tiny-mix):")
        for k, v in sorted(per.items(), key=lambda kv: (-kv[1], kv[0])):
            if v:
                print(f"  {k:16s} {v:6.1f}")
        print(f"  {'all':16s} {sum(per.values()):6.1f}")
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)  # the moto log and two run configs: nothing to keep


if __name__ == "__main__":
    main()
