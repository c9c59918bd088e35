"""Benchmark: the divergence guard (train.guard) on a learning rate far too high, and on clean runs.

diverging  the same config three times, each a real `andrea train` process: at --lr (far too high)
           with the guard on, the same without it (train.guard.enabled false), and at the config's
           own (sane) learning rate with the guard on. For each: its exit status, the steps it
           trained (every line of .loss.json: a trained step logs one), the steps lost to rollbacks
           (trained, then abandoned), its rollbacks, and its final loss (the mean of the last 20
           steps of the canonical history).
--clean N  one clean run of N steps with the guard on: the events it fired (the false positives;
           there must be none) and the headroom of the worst step against each of the guard's
           thresholds, measured from .loss.json (loss and gradient norm against the running median
           of the steps before, as the guard judges them). These are the figures the defaults were
           chosen from (README "When a run diverges").

  .venv/bin/python bench/divergence.py                      # andrea-tiny, 300 steps, lr 1.0
  .venv/bin/python bench/divergence.py --clean 10000        # andrea-tiny, 10,000 clean steps
  .venv/bin/python bench/divergence.py --config andrea-12m --clean 2000 --threads 2
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
from andrea_core.run.rundir import LOSS_LOG, RunDir  # noqa: E402
from andrea_core.train.guard import _median  # noqa: E402


def write_config(folder: Path, name: str, base: str, overrides: dict) -> str:
    cfg = load_run_config(base).with_overrides(overrides, "bench/divergence.py")
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return str(path)


def train(config: str, run: Path, device: str) -> int:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "andrea_core", "train", "--config", config, "--run-dir", str(run)]
    proc = subprocess.run([*argv, "--device", device], env=env, cwd=REPO, capture_output=True, text=True)
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
    overrides = {
        "train.max_steps": args.clean,
        "train.checkpoint_every": max(args.clean // 4, 1),
        "train.log_every": max(args.clean // 10, 1),
        "train.num_threads": args.threads,
        "train.lr_decay_steps": max(args.clean, load_run_config(args.config).train.lr_decay_steps),
    }
    cfg = write_config(root, "clean", args.config, overrides)
    rc = train(cfg, root / "clean", args.device)
    run = RunDir(str(root / "clean"))
    history = read_history(run)
    events = read_events(run)
    g = load_run_config(cfg).train.guard
    print(f"clean: {args.config}, {len(history)} steps with the guard on (exit {rc}): {len(events)} events")
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="andrea-tiny")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--lr", type=float, default=1.0, help="the learning rate far too high")
    p.add_argument("--clean", type=int, default=0, help="instead: one clean run of this many steps")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--run-root", help="where the runs go (default: a temporary folder, removed)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-divergence-") as tmp:
        root = Path(args.run_root or tmp)
        root.mkdir(parents=True, exist_ok=True)
        (clean if args.clean else diverging)(args, root)


if __name__ == "__main__":
    main()
