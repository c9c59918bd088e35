"""Benchmark: what the checkpoint's checksum trailer costs, and which hash to take for it.

For checkpoints of andrea-12m's size (12,705,920 parameters, 152.5 MB) and andrea-120m's (120,362,496,
1.44 GB), all in one process and one folder:
  hashes     the candidate checksums over the same bytes (stdlib, numpy; torch has none on CPU): zlib's
             crc32 and adler32, hashlib's blake2b, sha256, sha1, md5, numpy's uint64 sum and xor;
  encode     the legacy form (header + the floats' bytes) against the checksummed one (checkpoint.encode);
  decode     checkpoint.decode of each form (size, header, name, checksum, non-finite and negative-v scan);
  write      RunDir.write_atomic (temporary, fsync, rename, folder fsync) of each form: the legacy writer
             handed [header, the buffer], the checksummed one encode_parts (CRC-32 of each piece as the
             store writes it: the buffer is read once);
  read       RunDir.read_checkpoint of each form, cold (the file's pages dropped first) and warm.
Repetitions alternate the two forms so that a drifting machine favours neither; medians. The floats are
random normals (v made non-negative), the bytes a real checkpoint of that size would have. Prints
figures; asserts nothing.

    .venv/bin/python bench/checkpoint_checksum.py [--params 12705920,120362496] [--repeats 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from andrea_core.checkpoint import (  # noqa: E402
    checkpoint_name,
    decode,
    encode,
    encode_header,
    encode_parts,
)
from andrea_core.run.rundir import RunDir  # noqa: E402

sys.path.insert(0, str(REPO / "bench"))
from checkpoint_io import drop_from_page_cache  # noqa: E402  (one copy: the checkpoint I/O bench's)


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    return timed_out(fn)[0]


def timed_out(fn: Callable[[], object]) -> tuple[tuple[float, float], object]:
    """((wall seconds, CPU seconds of this process), what fn returned). On a shared CPU the wall time
    grows with the load; the CPU time of a CPU-bound step much less."""
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0, time.process_time() - c0), out


def legacy_encode(step: int, flat: np.ndarray) -> bytes:
    """The format before the trailer (what checkpoint.encode was): header + floats."""
    return encode_header(step, flat.size // 3) + flat.tobytes()


HASHES: dict[str, Callable[[memoryview], object]] = {
    "zlib.crc32": zlib.crc32,
    "zlib.adler32": zlib.adler32,
    "hashlib.blake2b": lambda b: hashlib.blake2b(b).digest(),
    "hashlib.sha256": lambda b: hashlib.sha256(b).digest(),
    "hashlib.sha1": lambda b: hashlib.sha1(b).digest(),
    "hashlib.md5": lambda b: hashlib.md5(b).digest(),
    "numpy sum of uint64": lambda b: np.frombuffer(b, dtype="<u8").sum(dtype=np.uint64),
    "numpy xor of uint64": lambda b: np.bitwise_xor.reduce(np.frombuffer(b, dtype="<u8")),
}


def one_size(n: int, repeats: int, root: Path) -> None:
    rng = np.random.default_rng(0)
    flat = rng.standard_normal(3 * n, dtype=np.float32)
    np.abs(flat[2 * n :], out=flat[2 * n :])
    step, name = 100, checkpoint_name(100)
    size = 8 + 12 * n
    times: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}

    def add(key: str, seconds: tuple[float, float]) -> None:
        times.setdefault(key, []).append(seconds[0])
        cpu.setdefault(key, []).append(seconds[1])

    body = memoryview(flat).cast("B")[: 12 * n - 8]  # a multiple of 8 bytes, for the uint64 views
    for _ in range(repeats):
        for key, fn in HASHES.items():
            add(f"hash {key}", timed(lambda fn=fn: fn(body)))

    legacy = checked = b""
    for _ in range(repeats):
        legacy = checked = b""  # freed before the next pair is made
        seconds, legacy = timed_out(lambda: legacy_encode(step, flat))
        add("encode legacy", seconds)
        seconds, checked = timed_out(lambda: encode(step, flat))
        add("encode checksummed", seconds)
    for _ in range(repeats):
        add("decode legacy", timed(lambda: decode(legacy, name, n)))
        add("decode checksummed", timed(lambda: decode(checked, name, n)))

    with tempfile.TemporaryDirectory(dir=root, prefix=".bench-checkpoint-checksum-") as tmp:
        runs = {form: RunDir(f"{tmp}/{form}") for form in ("legacy", "checksummed")}
        for run in runs.values():
            run.makedirs()
        parts = {
            "legacy": lambda: [encode_header(step, n), memoryview(flat)],
            "checksummed": lambda: encode_parts(step, flat),
        }
        for _ in range(repeats):
            for form, run in runs.items():
                path = Path(tmp) / form / name
                path.unlink(missing_ok=True)  # a new file each time, as in training
                add(f"write {form}", timed(lambda run=run, form=form: run.write_atomic(name, parts[form]())))
            for form, run in runs.items():
                drop_from_page_cache(Path(tmp) / form / name)
                add(f"read (cold) {form}", timed(lambda run=run: run.read_checkpoint(step, n)))
                add(f"read (warm) {form}", timed(lambda run=run: run.read_checkpoint(step, n)))
        assert (Path(tmp) / "checksummed" / name).read_bytes() == checked, "encode_parts != encode"

    median = {k: statistics.median(v) for k, v in times.items()}
    on_cpu = {k: max(statistics.median(v), 1e-9) for k, v in cpu.items()}
    print(f"\n{n:,} parameters: {size:,} bytes legacy, {size + 8:,} with the trailer; {repeats} repeats")
    print("  medians; GB/s of wall time, and (cpu) of this process's CPU time")
    for key, seconds in median.items():
        if key.startswith("hash "):
            print(
                f"  {key:<28} {seconds * 1e3:9.1f} ms  {body.nbytes / seconds / 1e9:7.2f} GB/s"
                f"  (cpu {body.nbytes / on_cpu[key] / 1e9:6.2f} GB/s)"
            )
    for what in ("encode", "decode", "write", "read (cold)", "read (warm)"):
        a, b = median[f"{what} legacy"], median[f"{what} checksummed"]
        ca, cb = on_cpu[f"{what} legacy"], on_cpu[f"{what} checksummed"]
        print(
            f"  {what:<12} legacy {a * 1e3:8.1f} ms {size / a / 1e9:6.2f} GB/s   checksummed "
            f"{b * 1e3:8.1f} ms {(size + 8) / b / 1e9:6.2f} GB/s   time ratio {b / a:5.2f}"
            f"  cpu ratio {cb / ca:5.2f}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", default="12705920,120362496", help="parameter counts, comma-separated")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", help="where to write (default: a temporary folder beside the repository)")
    args = p.parse_args()
    root = Path(args.dir) if args.dir else REPO
    load = os.getloadavg()[0]
    print(f"checkpoint checksum: {os.cpu_count()} CPUs, load {load:.1f}, zlib {zlib.ZLIB_RUNTIME_VERSION}")
    print(f"  disk: the folder {root}")
    for n in (int(x) for x in args.params.split(",")):
        one_size(n, args.repeats, root)


if __name__ == "__main__":
    main()
