"""Benchmark: the divergence guard (train.guard) on a learning rate far too high, and on clean runs.

diverging  the same config three times, each a real `andrea train` process: at --lr (far too high)
           with the guard on, the same without it (train.guard.enabled false), and at the config's
           own (sane) learning rate with the guard on. For each: its exit status, the steps it
           trained (every line of .loss.json: a trained step logs one), the steps lost to rollbacks
           (trained, then abandoned), its rollbacks, and its final loss (the mean of the last 20
           steps of the canonical history).
--scenarios  the table of where runs diverge (issue 41), each a real `andrea train` on andrea-tiny: a
           learning rate 300x from the start, after a fork (the branch stops: its result), after a
           pivot (ANDREA_TEST_GUARD_LR_TIMES: a pivot cannot set it); oscillation and drift (real steps
           on corrupted targets: ANDREA_TEST_GUARD_NOISE); a non-finite step under checkpoints every
           10 and the default retention; a pivot to other data (tiny-mix). For each: the step its first
           event was detected at (or none), the spike's first step, the checkpoint it went back to,
           the steps lost (trained, then abandoned) and its exit status.
--clean N  one clean run of N steps with the guard on: the events it fired (the false positives;
           there must be none) and the headroom of the worst step against each of the guard's
           thresholds, measured from .loss.json (loss and gradient norm against the running median
           of the steps before, as the guard judges them). These are the figures the defaults were
           chosen from (README "When a run diverges").

  .venv/bin/python bench/divergence.py                      # andrea-tiny, 300 steps, lr 1.0
  .venv/bin/python bench/divergence.py --clean 10000        # andrea-tiny, 10,000 clean steps
  .venv/bin/python bench/divergence.py --config andrea-12m --clean 2000 --threads 2 --run-root DIR
      # a rerun resumes DIR/clean; with --no-train, only the figures of the steps it has
  .venv/bin/python bench/divergence.py --scenarios          # the scenario table
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from andrea_core.config import load_run_config  # noqa: E402
from andrea_core.run.guard_events import read_events  # noqa: E402
from andrea_core.run.loss_log import parse_entries, read_history  # noqa: E402
from andrea_core.run.record import read_run  # noqa: E402
from andrea_core.run.rundir import LOSS_LOG, RunDir  # noqa: E402
from andrea_core.train.guard import _median  # noqa: E402


def write_config(folder: Path, name: str, base: str, overrides: dict) -> str:
    cfg = load_run_config(base).with_overrides(overrides, "bench/divergence.py")
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return str(path)


def andrea(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    argv = [sys.executable, "-m", "andrea_core", *args]
    return subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True)


def train(config: str | None, run: Path, device: str, *more: str, env: dict | None = None) -> int:
    given = ["--config", config] if config else []
    proc = andrea("train", *given, "--run-dir", str(run), "--device", device, *more, env=env)
    if proc.returncode not in (0, 1, 3):
        sys.exit(f"andrea train exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc.returncode


def figures(run: Path) -> dict:
    r = RunDir(str(run))
    trained = len(parse_entries(r.read_bytes(LOSS_LOG))[0]) if r.exists(LOSS_LOG) else 0
    history = read_history(r)
    tail = history[-20:]
    events = read_events(r)
    return {
        "trained": trained,
        "reached": history[-1].step if history else 0,
        "lost": trained - len(history),
        "rollbacks": sum(e.action == "rollback" for e in events),
        "stops": sum(e.action == "stop" for e in events),
        "final": sum(e.loss for e in tail) / len(tail) if tail else float("nan"),
    }


def diverging(args: argparse.Namespace, root: Path) -> None:
    base = {
        "train.max_steps": args.steps,
        "train.checkpoint_every": args.checkpoint_every,
        "train.log_every": max(args.steps // 4, 1),
        "train.num_threads": args.threads,
    }
    sane_lr = load_run_config(args.config).train.lr
    arms = [
        (f"lr {args.lr:g}, guard on", {"train.lr": args.lr}),
        (f"lr {args.lr:g}, guard off", {"train.lr": args.lr, "train.guard.enabled": False}),
        (f"lr {sane_lr:g} (sane), guard on", {}),
    ]
    print(f"divergence: {args.config}, {args.steps} steps, checkpoints every {args.checkpoint_every}")
    print(f"{'run':<28}{'exit':>5}{'trained':>9}{'reached':>9}{'lost':>6}{'rollbacks':>11}{'final loss':>12}")
    for i, (name, overrides) in enumerate(arms):
        cfg = write_config(root, f"arm{i}", args.config, {**base, **overrides})
        rc = train(cfg, root / f"run{i}", args.device)
        f = figures(root / f"run{i}")
        rollbacks = f"{f['rollbacks']}" + (" +stop" if f["stops"] else "")
        print(
            f"{name:<28}{rc:>5}{f['trained']:>9}{f['reached']:>9}{f['lost']:>6}{rollbacks:>11}{f['final']:>12.4f}"
        )
    print("trained: steps run (lines in .loss.json); reached: the last step of the canonical history;")
    print("lost: trained, then abandoned by a rollback; final loss: mean of the last 20 canonical steps")


def scenarios(args: argparse.Namespace, root: Path) -> None:
    """The scenario table: each a real run; the shared parent is andrea-tiny trained to 300 steps."""
    import shutil

    base = {"train.num_threads": args.threads, "train.checkpoint_every": 10, "train.log_every": 100}
    sane = load_run_config(args.config).train.lr
    parent = root / "parent"
    every = {**base, "train.max_steps": 300, "retention.keep_last": None}  # the fork point 200 kept
    train(write_config(root, "parent", args.config, every), parent, args.device)

    def copy(name: str) -> Path:
        shutil.copytree(parent, root / name)
        return root / name

    def pivoted(name: str) -> Path:
        run = copy(name)
        proc = andrea("pivot", str(run), "--policy", "tiny-mix", "--no-restart")
        if proc.returncode:
            sys.exit(f"andrea pivot exited {proc.returncode}: {proc.stderr[-2000:]}")
        return run

    rows = []

    def row(name: str, run: Path, rc: int, start: int) -> None:
        f, events = figures(run), read_events(RunDir(str(run)))
        first = events[0] if events else None
        rows.append(
            (
                name,
                rc,
                f"{first.step} ({first.kind})" if first else "none",
                f"+{first.spike_start - start}" if first else "",
                "stop" if first and first.action == "stop" else (str(first.rolled_back_to) if first else ""),
                f["lost"],
                len(events),
            )
        )

    high = {"train.lr": sane * 300}
    cfg = write_config(root, "lr300", args.config, {**base, **high, "train.max_steps": 300})
    row("lr 300x from the start", root / "lr300", train(cfg, root / "lr300", args.device), 0)

    proc = andrea("fork", str(parent), "--step", "200", "--branch", "hot", "--set", f"train.lr={sane * 300}")
    if proc.returncode:
        sys.exit(f"andrea fork exited {proc.returncode}: {proc.stderr[-2000:]}")
    branch = root / "parent-fork200-hot"
    row("lr 300x after a fork at 200", branch, train(None, branch, args.device, "--max-steps", "300"), 200)

    run = pivoted("pivot300")
    rc = train(None, run, args.device, "--max-steps", "400", env={"ANDREA_TEST_GUARD_LR_TIMES": "300@300"})
    row("lr 300x after a pivot at 300", run, rc, 300)

    for name, noise, steps in [("oscillation", "oscillate@300", 400), ("drift", "drift@300:1000", 900)]:
        run = copy(name)
        rc = train(None, run, args.device, "--max-steps", str(steps), env={"ANDREA_TEST_GUARD_NOISE": noise})
        row(f"{name} from 300 ({noise})", run, rc, 300)

    cfg = write_config(root, "nan", args.config, {**base, "train.max_steps": 100})
    rc = train(cfg, root / "nan", args.device, env={"ANDREA_TEST_GUARD_NAN_AT": "85"})
    row("non-finite at 85, keep_last 5", root / "nan", rc, 0)

    run = pivoted("pivot-data")
    row("pivot at 300 to tiny-mix", run, train(None, run, args.device, "--max-steps", "1300"), 300)

    print(f"scenarios: {args.config}, checkpoints every 10, the guard's defaults")
    head = ("scenario", "exit", "detected at", "after", "back to", "lost", "events")
    widths = (38, 5, 26, 7, 8, 6, 7)
    for r in (head, *rows):
        cells = enumerate(zip(r, widths, strict=True))
        print("".join(f"{v!s:<{w}}" if i == 0 else f"{v!s:>{w}}" for i, (v, w) in cells))
    print("detected at: the step whose reading completed the first event; after: steps after the change")
    print("(the fork, the pivot, the noise's start); back to: the checkpoint rolled back to, or stop;")
    print("lost: steps trained, then abandoned by rollbacks; events: guard.jsonl's lines in all")


def headroom(values: list[tuple[str | None, float]], window: int, skip: int) -> dict:
    """The worst step's ratio to, excess over and MADs above the running median of its series' last
    `window` values (per arm for the loss, as the guard judges it), ignoring the first `skip` steps."""
    series: dict[str | None, list[float]] = {}
    worst = {"ratio": (0.0, 0), "excess": (0.0, 0), "mads": (0.0, 0)}
    for i, (key, v) in enumerate(values, start=1):
        past = series.setdefault(key, [])
        if len(past) >= 4 and i > skip:
            win = past[-window:]
            med = _median(win)
            mad = _median(abs(x - med) for x in win)
            mads = (v - med) / mad if mad else 0.0
            for name, x in (("ratio", v / med), ("excess", v - med), ("mads", mads)):
                worst[name] = max(worst[name], (x, i))
        past.append(v)
        del past[:-window]
    return worst


def clean(args: argparse.Namespace, root: Path) -> None:
    """A run already in <run-root>/clean (one stopped by a signal: it checkpoints and exits 0) is
    resumed; with --no-train its figures are those of the steps it has."""
    run = RunDir(str(root / "clean"))
    if args.no_train:
        rc = "not run: --no-train"
    elif run.exists("run.yaml"):
        rc = train(None, root / "clean", args.device)
    else:
        overrides = {
            "train.max_steps": args.clean,
            "train.checkpoint_every": max(args.clean // 4, 1),
            "train.log_every": max(args.clean // 10, 1),
            "train.num_threads": args.threads,
            "train.lr_decay_steps": max(args.clean, load_run_config(args.config).train.lr_decay_steps),
        }
        rc = train(write_config(root, "clean", args.config, overrides), root / "clean", args.device)
    history = read_history(run)
    events = read_events(run)
    record = read_run(run)
    g = record.config.train.guard
    span = (
        f" ({(history[-1].time - history[0].time) / 3600:.2f} h from the first to the last)"
        if history
        else ""
    )
    print(
        f"clean: {record.config.name}, {len(history)} of {record.config.train.max_steps} steps with the "
        f"guard on{span} (exit {rc}): {len(events)} events"
    )
    print(f"false-positive rate: {len(events)} / {len(history)} steps")
    for skip in (0, g.window):
        loss = headroom([(e.arm, e.loss) for e in history], g.window, skip)
        grad = headroom([(None, e.grad_norm) for e in history], g.window, skip)
        after = f"after step {skip}" if skip else "from the first step"
        print(f"worst step {after} (value, step):")
        print(
            f"  loss       x{loss['ratio'][0]:.3f} of its median at step {loss['ratio'][1]} "
            f"(loss_ratio {g.loss_ratio}), +{loss['excess'][0]:.3f} nats at {loss['excess'][1]} "
            f"(loss_floor {g.loss_floor}), {loss['mads'][0]:.1f} MADs at {loss['mads'][1]} "
            f"(loss_mads {g.loss_mads})"
        )
        print(
            f"  grad norm  x{grad['ratio'][0]:.3f} at step {grad['ratio'][1]} (grad_ratio {g.grad_ratio}), "
            f"+{grad['excess'][0]:.3f} at {grad['excess'][1]} (grad_floor {g.grad_floor}), "
            f"{grad['mads'][0]:.1f} MADs at {grad['mads'][1]} (grad_mads {g.grad_mads})"
        )
    print(f"  highest loss {max(e.loss for e in history):.3f} (loss_ceiling: {g.loss_ceiling} x ln(vocab))")
    rise, at = rise_headroom([(e.arm, e.loss) for e in history], g)
    print(
        f"  loss level (mean of {g.rise_span}) at most +{rise:.3f} nats above its best of the last "
        f"{g.rise_horizon} steps, at step {at} (rise_margin {g.rise_margin}, for {g.rise_steps} steps)"
    )


def rise_headroom(values: list[tuple[str | None, float]], g) -> tuple[float, int]:
    """The sustained-rise rule's worst step: the largest excess of an arm's level over its best, and where."""
    from collections import deque

    values_by: dict = {}
    levels_by: dict = {}
    worst = (0.0, 0)
    for i, (arm, v) in enumerate(values, start=1):
        vals = values_by.setdefault(arm, deque(maxlen=g.rise_span))
        levels = levels_by.setdefault(arm, deque(maxlen=g.rise_horizon))
        vals.append(v)
        if len(vals) < g.rise_span:
            continue
        level = sum(vals) / len(vals)
        if levels:
            worst = max(worst, (level - min(levels), i))
        levels.append(level)
    return worst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="andrea-tiny")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--lr", type=float, default=1.0, help="the learning rate far too high")
    p.add_argument("--clean", type=int, default=0, help="instead: one clean run of this many steps")
    p.add_argument("--scenarios", action="store_true", help="instead: the table of where runs diverge")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--run-root", help="where the runs go (default: a temporary folder, removed)")
    p.add_argument("--no-train", action="store_true", help="with --clean: the figures of the run there")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-divergence-") as tmp:
        root = Path(args.run_root or tmp)
        root.mkdir(parents=True, exist_ok=True)
        (scenarios if args.scenarios else clean if args.clean else diverging)(args, root)


if __name__ == "__main__":
    main()
