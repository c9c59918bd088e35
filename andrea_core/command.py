"""The `andrea train` command line: built once (trainer_command) and parsed once (trainer_run_dir,
trainer_max_steps), for the supervisor, the lock's identity check and `andrea status`.

Stdlib only, but for config.setting_arg (the one spelling of a `--set`)."""

from __future__ import annotations

import os
import re
import sys


def train_argv(
    run_dir: str,
    *,
    config: str | None = None,
    max_steps: int | None = None,
    device: str = "auto",
    pace: float = 0.0,
    python: str = sys.executable,
    nproc_per_node: int = 1,
    settings: dict | None = None,
    policy: str | None = None,
) -> list[str]:
    """argv of `python -m andrea_core train ...` with these options (the one place that spells them).
    With nproc_per_node > 1 the trainer execs the torchrun agent (same pid) and that starts the ranks.
    settings (dotted keys and values) and policy: a new run's `--set` and `--policy`."""
    from andrea_core.config import setting_arg

    argv = [python, "-m", "andrea_core", "train", "--run-dir", run_dir, "--device", device]
    if nproc_per_node > 1:
        argv += ["--nproc-per-node", str(nproc_per_node)]
    if config:
        argv += ["--config", config]
    for key, value in (settings or {}).items():
        argv += ["--set", setting_arg(key, value)]
    if policy is not None:
        argv += ["--policy", policy]
    if max_steps is not None:
        argv += ["--max-steps", str(max_steps)]
    if pace > 0:
        argv += ["--pace", str(pace)]
    return argv


def trainer_command(run_dir: str, *, python: str = sys.executable, **options) -> list[str]:
    """train_argv behind the parent-death guard (andrea_core.pdeathsig): a trainer that dies with the
    process that started it (a flow run)."""
    argv = train_argv(run_dir, python=python, **options)
    return [python, "-m", "andrea_core.pdeathsig", str(os.getpid()), *argv]


DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d{1,3})?)$")
MAX_PACE_S, MAX_NPROC = 3600.0, 1024


def train_options(args: list[str]) -> dict:
    """The restartable options of a recorded `andrea train` command line (what follows `train`, as the
    lock's train_args keeps it): device, max_steps, pace and nproc_per_node, each checked; --run-dir and
    --config are left out (a restart resumes the run it is given). It comes from a run directory, so it
    is parsed, never executed: ValueError names an option that is unknown or out of range."""
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ValueError(f"expected a list of strings, got {type(args).__name__}")
    opts: dict = {"device": "auto", "max_steps": None, "pace": 0.0, "nproc_per_node": 1}
    known = {
        "--device": "device",
        "--max-steps": "max_steps",
        "--pace": "pace",
        "--nproc-per-node": "nproc_per_node",
    }
    skipped = {"--run-dir", "--config", *CREATION_OPTIONS}
    i = 0
    while i < len(args):
        flag, eq, value = args[i].partition("=")
        if flag not in known and flag not in skipped:
            raise ValueError(f"option {args[i][:40]!r} is not one of andrea train's")
        if not eq:
            if i + 1 >= len(args):
                raise ValueError(f"option {flag} has no value")
            i, value = i + 1, args[i + 1]
        i += 1
        if flag in skipped:
            continue
        name = known[flag]
        try:
            if name == "device":
                if not DEVICE_RE.match(value):
                    raise ValueError
                opts[name] = value
            elif name == "pace":
                pace = float(value)
                if not 0 <= pace <= MAX_PACE_S:
                    raise ValueError
                opts[name] = pace
            else:
                number = int(value)
                if not 1 <= number <= (MAX_NPROC if name == "nproc_per_node" else 10**12):
                    raise ValueError
                opts[name] = number
        except ValueError:
            raise ValueError(f"option {flag} {value[:40]!r} is not a valid value") from None
    return opts


CREATION_OPTIONS = ("--set", "--policy")  # a new run's settings: frozen in its run.yaml, never restarted


def restart_args(args: list[str]) -> list[str]:
    """An `andrea train` command line's options without the new run's settings (CREATION_OPTIONS):
    what the lock records for a pivot's restart, which resumes the run (and a lock keeps 64 words)."""
    out, i = [], 0
    while i < len(args):
        flag = args[i].partition("=")[0]
        if flag in CREATION_OPTIONS:
            i += 1 if "=" in args[i] else 2
            continue
        out.append(args[i])
        i += 1
    return out


def trainer_run_dir(argv: list[str]) -> str | None:
    """The --run-dir of an `andrea train` / `python -m andrea_core train` command line, else None."""
    is_andrea = any(
        a == "andrea_core" or os.path.basename(a) == "andrea" or a.endswith("andrea_core/__main__.py")
        for a in argv
    )
    if not is_andrea or "train" not in argv:
        return None
    for i, a in enumerate(argv):
        if a == "--run-dir" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--run-dir="):
            return a.split("=", 1)[1]
    return None


def trainer_max_steps(argv: list[str]) -> int | None:
    """--max-steps of an `andrea train` command line, or None when it gives none (or not a number)."""
    for i, arg in enumerate(argv):
        value = argv[i + 1] if arg == "--max-steps" and i + 1 < len(argv) else None
        if arg.startswith("--max-steps="):
            value = arg.split("=", 1)[1]
        if value is not None:
            try:
                return int(value)
            except ValueError:
                return None
    return None


def process_argv(pid: int) -> list[str] | None:
    """The command line of process `pid` on this host, or None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return None
