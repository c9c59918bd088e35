"""Benchmark: what listing a built-in arm's files costs a trainer's start (andrea_core/data/sources.py).

Every trainer start lists each built-in arm's files and fingerprints them (path, size, mtime of each):
the token cache's key and data.jsonl's record. For each arm kind on this machine (the stdlib; the
docstrings of the default packages and of tiny-mix's two; the prose of all site-packages), in one
process, the same trees:
  rglob      one Path.rglob per pattern, a stat per name (the listing tests/test_data_sources.py
             compares with, and the product's before 6a0048d);
  os.walk    one os.walk and one compiled pattern, then a stat per name to keep the files (6a0048d);
  scandir    sources._files_for: one scandir walk, a name's type from its directory entry, a stat
             only for a link (and prose's size floor);
and, after each listing, the fingerprint as a start takes it: the cache's key, then data.jsonl's record
(computed twice in the two baselines, as before; cached on the Source after its first). Repetitions
alternate the three so that a drifting machine favours none; medians of CPU seconds (wall beside).
Checks the three listings equal; prints figures.

    .venv/bin/python bench/source_listing.py [--repeats 9]
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import re
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from andrea_core.data import sources  # noqa: E402
from andrea_core.data.policy import ArmSpec  # noqa: E402

ARMS = {
    "stdlib": ArmSpec(name="code", kind="python-stdlib"),
    "docstrings (default packages)": ArmSpec(name="docs", kind="docstrings"),
    "docstrings (tiny-mix: fsspec, _pytest)": ArmSpec(
        name="docs", kind="docstrings", packages=["fsspec", "_pytest"]
    ),
    "prose (all site-packages)": ArmSpec(name="prose", kind="prose"),
}
PATTERNS = {"python-stdlib": ("*.py",), "docstrings": ("*.py",), "prose": sources.PROSE_PATTERNS}


def _walk_find(root: Path, patterns: tuple[str, ...], skip: frozenset[str] = frozenset()) -> list[Path]:
    """6a0048d's _find: os.walk, one compiled pattern; the caller stat-ed each name to keep files."""
    match = re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in patterns)).match
    found = []
    for folder, subfolders, names in os.walk(root):
        if skip:
            subfolders[:] = [d for d in subfolders if d not in skip]
        found.extend(Path(folder, n) for n in names if match(n))
    return found


def _listing(arm: ArmSpec, find) -> list[Path]:
    """The arm's files as `find` (a list of candidate paths per root) and a stat per name give them."""
    pats = PATTERNS[arm.kind]
    if arm.kind == "python-stdlib":
        stdlib = Path(sources.sysconfig.get_paths()["stdlib"])
        files = find(stdlib, pats, frozenset({"site-packages"}))
        return sorted(p for p in files if "site-packages" not in p.parts and p.is_file())
    if arm.kind == "docstrings":
        files = []
        for pkg in arm.packages or sources.DEFAULT_DOCSTRING_PACKAGES:
            root = sources._package_dir(pkg)
            if root is not None:
                files.extend(sorted(p for p in find(root, pats, frozenset()) if p.is_file()))
        return files
    files = []
    for root in sources._site_packages():
        files.extend(find(root, pats, frozenset()))
    return sorted({f for f in files if f.is_file() and f.stat().st_size > sources.PROSE_MIN_BYTES})


def _rglob_find(root: Path, patterns: tuple[str, ...], skip: frozenset[str]) -> list[Path]:
    """An rglob per pattern: it walks into `skip`'s folders too (the stdlib's filter drops them)."""
    return [p for pattern in patterns for p in root.rglob(pattern)]


FINGERPRINT = sources.Source.fingerprint.func  # uncached, as the property was before
WAYS = {
    "rglob": lambda arm: _listing(arm, _rglob_find),
    "os.walk": lambda arm: _listing(arm, _walk_find),
    "scandir": sources._files_for,
}


def measure(arm: ArmSpec, repeats: int) -> dict[str, tuple[float, float, int]]:
    """way -> (median CPU s, median wall s, files) of a listing and its fingerprint."""
    samples: dict[str, list[tuple[float, float]]] = {w: [] for w in WAYS}
    listed = {}
    for i in range(repeats):
        order = list(WAYS)[i % len(WAYS) :] + list(WAYS)[: i % len(WAYS)]
        for way in order:
            c0, t0 = time.process_time(), time.perf_counter()
            files = WAYS[way](arm)
            source = sources.Source(arm, files, 1)
            fingerprint = FINGERPRINT if way != "scandir" else (lambda s: s.fingerprint)
            assert fingerprint(source) == fingerprint(source)  # the cache's key, then data.jsonl's record
            samples[way].append((time.process_time() - c0, time.perf_counter() - t0))
            listed[way] = files
    assert listed["rglob"] == listed["os.walk"] == listed["scandir"], f"{arm}: the listings differ"
    return {
        w: (statistics.median(c for c, _ in s), statistics.median(t for _, t in s), len(listed[w]))
        for w, s in samples.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    print(f"source listing: median of {args.repeats}, CPU ms (wall ms), one listing and its fingerprint")
    print(f"{'arm':<40} {'files':>6} {'rglob':>16} {'os.walk':>16} {'scandir':>16} {'x os.walk':>9}")
    for name, arm in ARMS.items():
        got = measure(arm, args.repeats)
        cells = " ".join(f"{got[w][0] * 1e3:7.1f} ({got[w][1] * 1e3:6.1f})" for w in WAYS)
        ratio = got["os.walk"][0] / got["scandir"][0]
        print(f"{name:<40} {got['scandir'][2]:>6} {cells} {ratio:>8.2f}x")


if __name__ == "__main__":
    main()
