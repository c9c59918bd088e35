""".state.json: the bandit of every checkpoint, so that a resume continues exactly the same mixer.

The file holds the newest state at its top level (the step it describes, the policy's name and hash,
the phase counters and per-arm pulls, EMA rewards, baselines, weights and probabilities; for EXP3
also `drawn`, the arm and probability of step S's draw) and, under `previous`, the states of a few
earlier checkpoints. The state of step S is the bandit that draws batch S+1: the trainer reads each
step's loss one step late, so it has heard the losses of steps up to S-1, and on resume the trainer
hands it the loss of S from .loss.json, as the uninterrupted run did.

Write order. The trainer writes the state of step S before the checkpoint of step S, each atomically.
A crash between the two leaves a state for S and no checkpoint S: the resume then takes checkpoint P,
the one before, and finds P's state under `previous`, because a save always keeps the state it
replaces. Besides, the file keeps the state of every checkpoint that retention keeps once S is
written (retention.py: the newest keep_last, multiples of keep_every, pivot boundaries, fork points,
the guard's rollback point and the checkpoints that may become it), so that a fork, a resume or a
rollback to any checkpoint on disk restores that checkpoint's bandit, and no state outlives its
checkpoint for more than one save.

On load (docs/design.md "Data mixer"): a state written under another policy hash is not loaded (the bandit
starts fresh, as at a pivot) and is moved aside into archive/, never overwritten; an arm of the state
that the mixer does not have (no longer listed, or its source unavailable or empty now) is a zombie:
reported by name with its old weight and pulls, dropped, never pulled, its floor released (the mixer
was built over the live arms only, their caps scaled up to sum to 1 where they fell short:
policy.live_caps, recorded by changes.py); arms new to the state start at the prior.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from andrea_core.config import ConfigError, GuardConfig, RetentionConfig
from andrea_core.data.mixer import Mixer
from andrea_core.data.policy import Policy
from andrea_core.run.lineage import phases
from andrea_core.run.record import read_run
from andrea_core.run.retention import plan_retention, protected_steps, run_reach
from andrea_core.run.rundir import ARCHIVE, RUN_YAML, STATE, RunDir

FORMAT = 1


@dataclass
class Phase:
    number: int  # 1 for a run's first policy, +1 at every pivot
    start_step: int  # the step the bandit started from (fresh) in this phase


class BanditStore:
    """Reads and writes the run's .state.json for one trainer start."""

    def __init__(
        self,
        run: RunDir,
        policy: Policy,
        checkpoint_every: int,
        unavailable: dict[str, str] | None = None,
        warn: Callable[[str], None] = print,
        retention: RetentionConfig | None = None,
        guard: GuardConfig | None = None,
    ):
        self.run = run
        self.policy = policy
        self.every = checkpoint_every
        # The retention the trainer applies after each checkpoint, the guard's rollback point included
        # (its frozen run.yaml's, read once at its start); None reads the run's own at each save (a
        # bare directory: retention's defaults, no guard).
        self.retention, self.guard = retention, guard
        self.unavailable = unavailable or {}  # arm -> why its source is unavailable here
        self.warn = warn
        self.phase = Phase(1, 0)
        self.history: list[dict[str, Any]] = []  # states kept in the file, newest first
        self._dropped: dict[int, dict[str, Any]] = {}  # step -> a state dropped, its checkpoint on disk
        # save() runs on the training thread, keep_states() after retention on the checkpoint writer's.
        self._lock = threading.Lock()
        self.restored = False  # restore() loaded the resume checkpoint's bandit (not a fresh one)

    # --- load ------------------------------------------------------------------------------------

    def restore(self, mixer: Mixer, step: int) -> None:
        """Load the bandit of checkpoint `step` into `mixer`, or start a fresh one (and say why).
        `restored` says which, for this call: a guard rollback calls it again in the same process."""
        self._dropped = {}
        self.restored = False
        doc = self._read()
        if doc is None:
            self._fresh(step)
            if step > 0:  # a pivot's new phase, or a fork branch under a policy of its own
                self.warn(f"bandit: no {STATE}: a fresh bandit from step {step} (phase {self.phase.number})")
            return
        if doc.get("policy_hash") != self.policy.hash:
            moved = self._set_aside(step)
            self._fresh(
                step,
                f"{STATE} belongs to policy {doc.get('policy')!r} (hash {doc.get('policy_hash')}), "
                f"not to the policy in force {self.policy.name!r} (hash {self.policy.hash}); "
                f"it was moved to {moved}",
            )
            return
        entries = [doc, *doc.get("previous", [])]
        entry = next((e for e in entries if e["step"] == step), None)
        if entry is None and {int(e["phase"]["start_step"]) for e in entries} == {step}:
            # Back to the step this phase's bandit started fresh from (a guard rollback or a fallback to
            # a pivot's checkpoint): a fresh bandit is exactly this phase's state there, not an anomaly.
            # Its states past `step` are a timeline to be retrained, dropped as below.
            self.phase = Phase(int(doc["phase"]["number"]), step)
            self.history = []
            self.warn(f"bandit: back to step {step}, where phase {self.phase.number} began: a fresh bandit")
            return
        if entry is None:
            kept = sorted(e["step"] for e in entries)
            moved = self._set_aside(step)
            self._fresh(step, f"{STATE} has no state for step {step} (it has {kept}); moved to {moved}")
            return
        self._report_zombies(entry, mixer)
        for arm in mixer.arms:
            if arm not in entry["arms"]:
                self.warn(f"bandit: arm {arm!r} is new to the bandit and starts at the prior")
        mixer.load_state_dict(entry)
        self.restored = True
        self.phase = Phase(int(entry["phase"]["number"]), int(entry["phase"]["start_step"]))
        # States past `step` belong to a timeline that died before its checkpoint became the resume
        # point; they must never be resumed from.
        self.history = [_strip(e) for e in entries if e["step"] <= step]

    def _read(self) -> dict[str, Any] | None:
        if not self.run.exists(STATE):
            return None
        where = self.run.path(STATE)
        try:
            doc = self.run.read_json(STATE)
            for e in [doc, *doc.get("previous", [])]:
                int(e["step"]), dict(e["arms"]), int(e["phase"]["number"])
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as e:
            raise ConfigError(
                f"{where}: not a bandit state this trainer can read ({type(e).__name__}: {e}); "
                f"move it aside to start a fresh bandit"
            ) from None
        if doc.get("format") != FORMAT:
            raise ConfigError(f"{where}: format {doc.get('format')!r}, expected {FORMAT}")
        return doc

    def _fresh(self, step: int, why: str | None = None) -> None:
        self.phase = Phase(len(phases(self.run)) + 1, step)
        self.history = []
        if why is not None:
            self.warn(f"warning: a fresh bandit from step {step} (phase {self.phase.number}): {why}")

    def _set_aside(self, step: int) -> str:
        """Keep a state we will not load: the next save would otherwise overwrite it."""
        name = f"{ARCHIVE}/unloaded_state_step_{step:06d}_{int(time.time())}.json"
        self.run.move(STATE, name)
        return name

    def _report_zombies(self, entry: dict[str, Any], mixer: Mixer) -> None:
        listed = {a.name: a for a in self.policy.arms}
        for arm, s in entry["arms"].items():
            if arm in mixer.arms:
                continue
            if arm in listed:
                why = f"its source is unavailable ({self.unavailable.get(arm, 'not loaded')})"
                floor = f", its floor {listed[arm].floor:g} is released"
            else:
                why, floor = f"the policy {self.policy.name!r} no longer lists it", ""
            weight = s.get("weight")
            self.warn(
                f"warning: zombie arm {arm!r} dropped: {why}; its state (weight "
                f"{'n/a' if weight is None else f'{weight:.4g}'}, {s.get('pulls', 0)} pulls) is not "
                f"loaded and it will never be pulled{floor}; the distribution is re-projected over "
                f"{', '.join(mixer.arms)}"
            )

    # --- save ------------------------------------------------------------------------------------

    def snapshot(self, mixer: Mixer, step: int) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "step": step,
            "policy": self.policy.name,
            "policy_hash": self.policy.hash,
            "mixer": mixer.kind,
            "phase": {
                "number": self.phase.number,
                "start_step": self.phase.start_step,
                "steps": step - self.phase.start_step,
            },
            **mixer.state_dict(),
        }

    def save(self, mixer: Mixer, step: int) -> None:
        """Publish the state of `step` atomically; call it before writing checkpoint `step`."""
        with self._lock:
            entry = self.snapshot(mixer, step)
            older = [e for e in self.history if e["step"] < step]
            on_disk = set(self.run.checkpoint_steps())
            kept = self.kept_checkpoints(step, on_disk)
            self.history = [entry, *older[:1], *(e for e in older[1:] if e["step"] in kept)]
            # Dropped while their checkpoints are still on disk: retention, which runs after the
            # checkpoint, may yet keep one of them (keep_states).
            dropped = (*older[1:], *self._dropped.values())
            self._dropped = {e["step"]: e for e in dropped if e["step"] not in kept and e["step"] in on_disk}
            self.run.write_json(STATE, {**entry, "previous": self.history[1:]})

    def keep_states(self, kept: set[int]) -> None:
        """After retention kept the checkpoints `kept`: the state of any of them that a save dropped
        goes back into the file. A pivot's intent (pivot.json) can protect a checkpoint between the
        save that dropped its state, which did not see the intent, and the retention that follows the
        checkpoint, which does: without this the checkpoint stays and its bandit is lost (the chaos
        soak's finding: an archived phase without its boundary's state)."""
        with self._lock:
            back = [e for step, e in self._dropped.items() if step in kept]
            self._dropped = {}
            if not back or not self.history:
                return
            head, *rest = self.history
            self.history = [head, *sorted([*rest, *back], key=lambda e: -e["step"])]
            self.run.write_json(STATE, {**head, "previous": self.history[1:]})

    def kept_checkpoints(self, step: int, on_disk: set[int]) -> set[int]:
        """The checkpoints on disk (`on_disk`: listed by the caller) that retention keeps once
        checkpoint `step` is written: the states to keep with them."""
        retention = self.retention or read_run_retention(self.run)
        steps, reach = sorted({*on_disk, step}), run_reach(self.run, self.guard)  # as apply_retention
        rules = plan_retention(steps, retention, {}, step, reach)
        if not rules.delete:  # the rules alone keep them all: no protection to read (as apply_retention)
            return set(rules.keep)
        return set(plan_retention(steps, retention, protected_steps(self.run, steps), step, reach).keep)


def read_run_retention(run: RunDir) -> RetentionConfig:
    """The run's retention settings (the defaults for a bare directory without run.yaml)."""
    if not run.exists(RUN_YAML):
        return RetentionConfig()
    return read_run(run).config.retention


def _strip(entry: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in entry.items() if k != "previous"}
