"""Publishing a growing append-only file (a run's .loss.json) on S3 at every checkpoint: the whole file
each time (RunDir._put over the version it replaces, what MirroredAppendFile did before 2026-12-05)
against an extension (RunDir._extend: the store copies the published prefix, only the new tail travels).

    python bench/append_publish.py [--start-mb 24] [--tail-kb 12] [--publishes 20] [--link-mb-s 100]

A 200,000-step run logs about 24 MB of .loss.json (about 120 bytes a step) and checkpoints every 100
steps: 12 KB of new lines a publish. The server is moto in its own process (tests/s3_server.py) behind a
relay that passes --link-mb-s per connection and direction (a network link; 0: loopback, unthrottled)
and counts the bytes sent to the store. Figures: the median seconds of a publish and the bytes it sent,
for each way, and their ratios; the absolute figures are this machine's loopback and moto's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import fsspec.config  # noqa: E402
from s3_server import ThrottledLink, start_s3_server  # noqa: E402

from andrea_core.run.rundir import LOSS_LOG, RunDir  # noqa: E402


def lines(n_bytes: int, first: int) -> bytes:
    """About `n_bytes` of loss-log-like lines (120 bytes each), numbered from `first`."""
    line = (
        b'{"step":%09d,"loss":3.141592,"lr":0.0003,"arm":"stdlib-code","tokens":8192,"segment":1,'
        b'"time":1.7e9}\n'
    )
    return b"".join(line % (first + i) for i in range(max(1, n_bytes // len(line % 0))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--start-mb", type=float, default=24.0)
    ap.add_argument("--tail-kb", type=float, default=12.0)
    ap.add_argument("--publishes", type=int, default=20)
    ap.add_argument("--link-mb-s", type=float, default=100.0, help="0: loopback, unthrottled")
    args = ap.parse_args()

    server = start_s3_server()
    link = ThrottledLink(server.port, args.link_mb_s * 1e6)  # and counts the bytes sent to the store
    results: dict[str, tuple[float, float]] = {}
    try:
        server.use_in_this_process()
        fsspec.config.conf["s3"]["endpoint_url"] = link.endpoint
        server.client().mkdir("bench")
        start = lines(int(args.start_mb * 1e6), 0)
        for way in ("whole", "extend"):
            run = RunDir(f"s3://bench/{way}")
            data = start
            version = run._put(LOSS_LOG, data)
            times, sent = [], []
            for _ in range(args.publishes):
                data += lines(int(args.tail_kb * 1e3), len(data))
                before = link.sent
                t0 = time.perf_counter()
                if way == "whole":
                    version = run._put(LOSS_LOG, data, expect=version)
                else:
                    version = run._extend(LOSS_LOG, data, version)
                times.append(time.perf_counter() - t0)
                sent.append(link.sent - before)
            if run.read_bytes(LOSS_LOG) != data:
                raise SystemExit(f"bench: the {way} publishes did not leave the file's bytes")
            results[way] = (statistics.median(times), statistics.median(sent))
    finally:
        link.close()
        server.stop()

    link_said = f"a {args.link_mb_s:g} MB/s link" if args.link_mb_s else "loopback"
    print(
        f".loss.json of {len(start) / 1e6:.1f} MB growing {args.tail_kb:g} KB a publish, {args.publishes} "
        f"publishes over {link_said}; medians:"
    )
    for way, (seconds, sent) in results.items():
        print(f"  {way:<7} {seconds * 1e3:8.1f} ms a publish  {sent / 1e3:10.1f} KB sent")
    (tw, bw), (te, be) = results["whole"], results["extend"]
    print(f"ratios, extension / whole file: time {te / tw:.3f}, bytes sent {be / bw:.4f}")


if __name__ == "__main__":
    main()
