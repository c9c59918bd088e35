"""The run's target: the step it trains to, part of the run and not of one trainer's command line.

`target.jsonl` (append-only, like forks.jsonl) holds one line per change of target:
{"max_steps", "step" (the run's newest checkpoint when it was set), "by" (who set it), "time"}.
The newest well-formed line is the target; without one it is run.yaml's train.max_steps (frozen with
the run, so never the place for a target that changes). `--max-steps` given to `andrea train` (by hand,
by the train deployment, by systemd's arguments) or to `andrea pivot` appends a line when it differs
from the target in force, so a resume without `--max-steps` trains on to it and `andrea status` reads
its percentage against it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from andrea_core.config import ConfigError
from andrea_core.document import Field, check
from andrea_core.run.loss_log import well_formed_lines
from andrea_core.run.rundir import RUN_YAML, TARGET, RunDir

MAX_TARGET = 2**31 - 1  # a checkpoint's step is an int32


@dataclass(frozen=True)
class Target:
    max_steps: int
    source: str  # "run.yaml", or "target.jsonl (<by>, at step S)"
    history: tuple[dict, ...] = ()  # the well-formed lines, oldest first


def check_max_steps(value: object, what: str = "--max-steps") -> int:
    """A target a trainer can reach: a positive integer a checkpoint's int32 step can hold."""
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_TARGET:
        raise ConfigError(f"{what} {value!r}: expected a whole number of steps from 1 to {MAX_TARGET}")
    return value


LINE_SCHEMA = {  # a target.jsonl line ("time" is for people, not checked)
    "max_steps": Field((int,), low=1, high=MAX_TARGET),
    "step": Field((int,), low=0, high=MAX_TARGET),
    "by": Field((str,), high=200),
}


def read_target(run: RunDir, default: int, warn: Callable[[str], None] | None = None) -> Target:
    """The target in force: target.jsonl's newest well-formed line, else `default` (run.yaml's).
    A torn or malformed line is skipped (and reported through `warn`), never fatal."""
    if not run.exists(TARGET):
        return Target(default, RUN_YAML)
    lines = well_formed_lines(
        run.read_bounded(TARGET), lambda obj: check(obj, LINE_SCHEMA), run.path(TARGET), warn
    )
    if not lines:
        return Target(default, RUN_YAML)
    last = lines[-1]
    return Target(last["max_steps"], f"{TARGET} ({last['by']}, at step {last['step']})", tuple(lines))


def set_target(
    run: RunDir, max_steps: int, default: int, step: int, by: str, warn: Callable[[str], None] | None = None
) -> Target:
    """Make `max_steps` the run's target: one line appended (durably) if it differs from the one in
    force. The caller holds the run (the trainer's lock, or a pivot with its trainer stopped)."""
    check_max_steps(max_steps)
    now = read_target(run, default, warn)
    if now.max_steps == max_steps:
        return now
    line = {"max_steps": max_steps, "step": step, "by": by, "time": time.time()}
    run.append(TARGET, (json.dumps(line) + "\n").encode(), durable=True)
    return read_target(run, default, warn)
