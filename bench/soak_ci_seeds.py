"""The CI soak rounds' seeds (tests/test_soak.py SEEDS, issue 45.5): for each store, the seeds whose
schedule of every kind once (bench/soak.py draw_schedule with --kinds) waits least, by a model of what
a round waits on besides its CPU: the drawn sleeps, pauses, outages and hangs, a kill's rerun or restart
(START_S), and the steps a fault waits for (its gap, a guard spike's steps to D and the retraining from
its rollback, cache-full's 13), each STEP_S[store]. Only schedules that kill every pivot, fork, remote
pivot and guard rollback partway (as seed 1's did) are kept. A model for ranking, not a figure.

    python bench/soak_ci_seeds.py [--seeds 20000] [--top 5]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "bench")]

START_S = 1.5  # a warm start of a trainer or a command
STEP_S = {"local": 0.08, "s3": 0.25}  # a trained step, a checkpoint every 5 (on S3: uploads to moto)
STEPS_A_FAULT = {"local": 17, "s3": 18}  # a round's final step over its faults (seed 1, 2026-12-06)
KILLED = ("pivot", "fork", "guard-rollback", "pivot-remote")
EVENTS = ("pivot", "pivot-remote", "fork", "data-change")


def fault_s(f: dict) -> float:
    """The seconds fault `f` waits by the clock or on extra starts, whatever the machine's speed."""
    k, s = f["kind"], 0.0
    if k in ("sigkill", "sigkill-startup", "oom-trainer", "s3-partition"):
        s += f["after_s"]
    elif k == "power-cut":
        s += f["after_s"] + (3 + START_S if f["at"] in ("pivot", "fork") else 0)
    elif k == "sigstop-short":
        s += f["stop_s"]
    elif k in ("sigstop-long", "suspend"):
        s += max(f["stop_s"], 6.0)  # a takeover takes the ttl and more
    elif k in ("disk-full", "s3-deny", "s3-slow", "s3-503"):
        s += f["for_s"]
    elif k == "s3-hang":
        s += f["hang_s"] + (START_S + 4 if f["waiter"] else 0)
    elif k == "pivot" and f["kill"]:
        s += f["kill_s"] + 3
    elif k == "pivot-remote":
        s += (f["kill_s"] + START_S if f["kill"] else 0) + (START_S if f["restart"] else 0)
    elif k == "fork" and f["kill"]:
        s += (f["kill_s"] if f["kill"] == "random" else 0) + 2
    elif k == "guard-rollback":
        s += (f["after_s"] if f["kill"] == "after" else 0) + (START_S if f["kill"] else 0)
    elif k == "clock-step" and f["waiter"]:
        s += START_S
    return s


def schedule_s(schedule: list[dict], store: str) -> float:
    """The model's seconds for a whole schedule on `store`."""
    step, per = STEP_S[store], STEPS_A_FAULT[store]
    total, pivot_at = 0.0, None
    for i, f in enumerate(schedule):
        k = f["kind"]
        total += fault_s(f) + f["gap_steps"] * step
        if k == "guard-rollback":  # D at least rollback_margin (50) past the phase's start, then back
            floor = (per * pivot_at if pivot_at is not None else 50) + 50 + f["ahead"]
            total += (max(f["ahead"], floor - per * i) + 75) * step
        elif k == "cache-full":
            total += 13 * step
        elif k == "data-change" and not any(g["kind"] in EVENTS for g in schedule[max(0, i - 3) : i]):
            total += 3.0  # the reference far behind: it stops at the change's step
        if k in ("pivot", "pivot-remote"):
            pivot_at = i
    return total


def main() -> int:
    import soak
    from test_soak import KINDS, SEEDS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=20000)
    ap.add_argument("--top", type=int, default=5)
    args = ap.parse_args()
    for store, kinds in KINDS.items():
        ranked = []
        for seed in range(1, args.seeds + 1):
            schedule = soak.draw_schedule(seed, len(kinds), store, 5, kinds)
            if seed in (1, SEEDS[store]) or all(f["kill"] for f in schedule if f["kind"] in KILLED):
                ranked.append((round(schedule_s(schedule, store), 1), seed))
        ranked.sort()
        mark = {1: "seed 1", SEEDS[store]: "SEEDS"}
        shown = ", ".join(f"{seed} {s:g}" for s, seed in ranked[: args.top])
        known = ", ".join(f"{mark[seed]} ({seed}) {s:g}" for s, seed in ranked if seed in mark)
        print(f"{store}: {len(ranked)} schedules kept; best {shown}; {known}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
