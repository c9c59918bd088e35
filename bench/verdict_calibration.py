"""Calibration of the audit fork's verdict (issue 42): how often it names a winner between branches
that differ only in their data order (A/A), and how often it tells a real difference (A/B) the right
way round, at 32 and 256 held-out sequences an arm (256: compare's default, DEFAULT_VAL_SEQUENCES);
beside today's rule (one run a branch, the held-out paired standard error alone, a winner above 2.0).

One andrea-tiny parent trained to --parent-steps; each fork copies its checkpoint into two branches of
--replicates runs each (ops/fork.fork), every run trained --steps more in this process (train/trainer),
then scored by ops/compare.compare_branches. A/A fork i: branches "a" (train.seed 1000+2i) and "b"
(1001+2i), nothing else changed. A/B fork j: "base" (the config's lr) and "low-lr" (train.lr 1e-4), both
train.seed 5000+j (replicate r of both shares one data order). Forks are made in the order A/A, A/A,
A/B, ... and each fork's figures are appended to <workdir>/forks.jsonl as it ends, so a run cut short
still reports what it made; a rerun goes on from there. Every fork's runs are its own: the forks are
independent, and the rates' intervals (Wilson, 95%) are binomial. A held-out size in --val that the
forks made were not scored at is scored from their runs on disk (compare only, no training).

    nice -n 5 .venv/bin/python bench/verdict_calibration.py --aa 40 --ab 20   # about 360 runs x 100 steps
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from andrea_core.config import load_run_config  # noqa: E402
from andrea_core.ops import compare  # noqa: E402
from andrea_core.ops.fork import BranchSpec, fork  # noqa: E402
from andrea_core.run.rundir import RunDir  # noqa: E402

TINY = REPO / "configs" / "andrea-tiny.yaml"
TODAY_SIGNIFICANCE = 2.0  # today's rule: paired held-out standard errors, one run a branch


def train(url: str, cfg=None, max_steps: int | None = None) -> float:
    from andrea_core.train.trainer import Trainer

    t0 = time.perf_counter()
    result = Trainer(url, cfg, max_steps=max_steps, device="cpu", log=lambda m: None).train()
    assert result.reason in ("completed", "already-complete"), (url, result)
    return time.perf_counter() - t0


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def today(c: compare.Comparison, lo: str, hi: str) -> str | None:
    """Today's verdict from replicate 0 of each branch: the winner's name or None."""
    a, b = c.branch(lo).runs[0], c.branch(hi).runs[0]
    diff = b.per_sequence - a.per_sequence  # positive: lo is better
    margin, se = float(diff.mean()), float(diff.std(ddof=1) / math.sqrt(diff.size))
    if abs(margin) > TODAY_SIGNIFICANCE * se:
        return lo if margin > 0 else hi
    return None


def specs_of(work: Path, kind: str, i: int) -> list[BranchSpec]:
    specs = (
        [BranchSpec("a", {"train.seed": 1000 + 2 * i}), BranchSpec("b", {"train.seed": 1001 + 2 * i})]
        if kind == "AA"
        else [
            BranchSpec("base", {"train.seed": 5000 + i}),
            BranchSpec("low-lr", {"train.seed": 5000 + i, "train.lr": 1e-4}),
        ]
    )
    for s in specs:  # a fork is known by its step and names: each fork's own
        s.name = f"{kind}{i:03d}-{s.name}"
        s.url = str(work / s.name)
    return specs


def one_fork(work: Path, parent: str, kind: str, i: int, a: dict) -> dict:
    specs = specs_of(work, kind, i)
    urls = fork(parent, specs, a.parent_steps, log=lambda m: None, replicates=a.replicates)
    seconds = [train(u, max_steps=a.parent_steps + a.steps) for u in urls]
    out = {"kind": kind, "index": i, "train_s": seconds, "runs": len(urls)}
    for n in a.val:
        out[str(n)] = score(parent, specs, a, n)
    return out


def score(parent: str, specs: list[BranchSpec], a, n: int) -> dict:
    """One fork's verdict at `n` held-out sequences an arm, from its runs as they are on disk: a fork
    made earlier is scored at a held-out size it lacks without training again."""
    role = lambda name: None if name is None else name.split("-", 1)[1]  # noqa: E731
    t0 = time.perf_counter()
    c = compare.compare_branches(
        parent, [s.url for s in specs], a.parent_steps, val_sequences=n, warn=lambda m: None
    )
    names = [s.name for s in specs]
    return {
        "winner": role(c.winner),
        "leader": role(c.leader),
        "margin": c.margin,
        "noise": c.noise,
        "noise_training": c.noise_training,
        "noise_held_out": c.noise_held_out,
        "critical": c.critical,
        "df": c.df,
        "df_held_out": c.df_held_out,
        "step": c.step,
        "today": role(today(c, *names)),
        "compare_s": time.perf_counter() - t0,
        "val": {role(b.name): b.replicate_val for b in c.branches},
    }


def rescore(rows: list[dict], a) -> None:
    """Each fork's verdict under the rule in ops/compare.py now (verdict_test), from its stored parts:
    forks made by an earlier version of the rule are judged as the present one would judge them."""
    for r in rows:
        for n in a.val:
            x = r[str(n)]
            if x["noise_training"] is None:
                continue
            df = x.get("df") or 2 * (a.replicates - 1)
            df_held_out = x.get("df_held_out") or n - 1
            x["noise"], x["df_effective"], x["critical"], significant = compare.verdict_test(
                x["margin"], x["noise_training"], df, x["noise_held_out"], df_held_out
            )
            x["winner"] = x["leader"] if significant else None


def summarize(rows: list[dict], a) -> str:
    rescore(rows, a)
    lines = []
    aa = [r for r in rows if r["kind"] == "AA"]
    ab = [r for r in rows if r["kind"] == "AB"]
    lines.append(
        f"parent: andrea-tiny trained to {a.parent_steps}; each branch +{a.steps} steps; "
        f"{a.replicates} replicates a branch; {len(aa)} A/A forks (seeds 1000+2i / 1001+2i), "
        f"{len(ab)} A/B forks (lr default vs 1e-4, seed 5000+j)"
    )
    lines.append(
        "| held-out seqs an arm | rule | A/A false winners | 95% interval | A/B right way | 95% interval "
        "| A/B wrong way |"
    )
    lines.append("|---|---|---|---|---|---|---|")
    for n in a.val:
        default = " (default)" if n == compare.DEFAULT_VAL_SEQUENCES else ""
        for rule, key in (("new (replicates, t-test)", "winner"), ("today (1 run, held-out SE x2)", "today")):
            fw = sum(1 for r in aa if r[str(n)][key] is not None)
            right = sum(1 for r in ab if r[str(n)][key] == "base")
            wrong = sum(1 for r in ab if r[str(n)][key] == "low-lr")
            lo, hi = wilson(fw, len(aa))
            plo, phi = wilson(right, len(ab))
            lines.append(
                f"| {n}{default} | {rule} | {fw}/{len(aa)} ({fw / max(len(aa), 1):.1%}) "
                f"| {lo:.1%}-{hi:.1%} | "
                f"{right}/{len(ab)} ({right / max(len(ab), 1):.1%}) | {plo:.1%}-{phi:.1%} | {wrong} |"
            )
    if rows:
        per_run = sum(sum(r["train_s"]) for r in rows) / sum(r["runs"] for r in rows)
        k = a.replicates
        lines.append(
            f"training: {per_run:.1f} s a run ({a.steps} steps); a 2-branch fork trains {2 * k} runs, "
            f"{k}x today's 2 ({2 * k * per_run:.0f} s vs {2 * per_run:.0f} s)"
        )
        for n in a.val:
            cs = sum(r[str(n)]["compare_s"] for r in rows) / len(rows)
            lines.append(f"compare at {n} held-out seqs: {cs:.2f} s ({2 * k} checkpoints scored; today 2)")
        for n in a.val:
            tr = [r[str(n)]["noise_training"] for r in rows if r[str(n)]["noise_training"] is not None]
            ho = [r[str(n)]["noise_held_out"] for r in rows if r[str(n)]["noise_held_out"] is not None]
            if tr:
                lines.append(
                    f"noise parts at {n}: training ±{sum(tr) / len(tr):.4f}, "
                    f"held-out ±{sum(ho) / len(ho):.4f} (mean)"
                )
        margins = [abs(r[str(a.val[-1])]["margin"] or 0) for r in aa]
        abm = [r[str(a.val[-1])]["margin"] for r in ab]
        if margins:
            lines.append(
                f"A/A |margin| at {a.val[-1]}: median {sorted(margins)[len(margins) // 2]:.4f}, "
                f"max {max(margins):.4f}"
            )
        if abm:
            lines.append(
                f"A/B margin at {a.val[-1]}: min {min(abm):.4f}, median {sorted(abm)[len(abm) // 2]:.4f}"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="/tmp/verdict-calibration")
    p.add_argument("--aa", type=int, default=40)
    p.add_argument("--ab", type=int, default=20)
    p.add_argument("--replicates", type=int, default=3)
    p.add_argument("--parent-steps", type=int, default=120)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--val", type=lambda s: [int(v) for v in s.split(",")], default=[32, 128, 256])
    p.add_argument("--report", action="store_true", help="only print the figures of the forks made")
    a = p.parse_args()
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("ANDREA_CACHE_DIR", str(work / "cache"))
    log = work / "forks.jsonl"
    rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    if not a.report:
        import torch

        torch.set_num_threads(1)
        parent = str(work / "parent")
        if not RunDir(parent).exists("run.yaml"):
            cfg = load_run_config(str(TINY)).with_overrides({"train.num_threads": 1}, "bench")
            train(parent, cfg, max_steps=a.parent_steps)
        done = {(r["kind"], r["index"]) for r in rows}
        order = []
        aa, ab = iter(range(a.aa)), iter(range(a.ab))
        while len(order) < a.aa + a.ab:
            for kind, it in (("AA", aa), ("AA", aa), ("AB", ab)):
                i = next(it, None)
                if i is not None:
                    order.append((kind, i))
        lacking = [r for r in rows if any(str(n) not in r for n in a.val)]
        for r in lacking:  # a held-out size these forks were not scored at: from their runs on disk
            specs = specs_of(work, r["kind"], r["index"])
            r.update({str(n): score(parent, specs, a, n) for n in a.val if str(n) not in r})
            print(f"{r['kind']} {r['index']}: scored at " + ", ".join(map(str, a.val)), flush=True)
        if lacking:
            tmp = log.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
            tmp.replace(log)
        for kind, i in order:
            if (kind, i) in done:
                continue
            row = one_fork(work, parent, kind, i, a)
            rows.append(row)
            with log.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(
                f"{kind} {i}: "
                + ", ".join(
                    f"{n}: winner {row[str(n)]['winner']} today {row[str(n)]['today']}" for n in a.val
                ),
                flush=True,
            )
    print(summarize(rows, a))


if __name__ == "__main__":
    main()
