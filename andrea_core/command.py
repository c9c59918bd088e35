"""The `andrea train` command line: built once (trainer_command) and parsed once (trainer_run_dir,
trainer_max_steps), for the supervisor, the lock's identity check and `andrea status`.

Stdlib only."""

from __future__ import annotations

import os
import sys


def trainer_command(
    run_dir: str,
    *,
    config: str | None = None,
    max_steps: int | None = None,
    device: str = "auto",
    pace: float = 0.0,
    python: str = sys.executable,
    nproc_per_node: int = 1,
) -> list[str]:
    """argv of `python -m andrea_core train ...`, behind the parent-death guard (andrea_core.pdeathsig).
    With nproc_per_node > 1 the trainer execs the torchrun agent (same pid) and that starts the ranks."""
    argv = [python, "-m", "andrea_core", "train", "--run-dir", run_dir, "--device", device]
    if nproc_per_node > 1:
        argv += ["--nproc-per-node", str(nproc_per_node)]
    if config:
        argv += ["--config", config]
    if max_steps is not None:
        argv += ["--max-steps", str(max_steps)]
    if pace > 0:
        argv += ["--pace", str(pace)]
    return [python, "-m", "andrea_core.pdeathsig", str(os.getpid()), *argv]


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
