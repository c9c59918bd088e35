"""The divergence guard (train.guard): notices a diverging step, decides the rollback and its remedy,
and stops the run at its bound (in a fork branch, by default, at its first divergence: its result).

The trainer consults it at three points: `check` when a step's loss and gradient norm reach the host
(one step late), `data_step` and `lr_factor` for every step it trains. A divergence is a non-finite
loss or gradient norm; or `consecutive` steps whose loss (or norm) is far above a robust running
statistic of the steps before: the median of the last `window`, plus `loss_mads` median absolute
deviations, and at least `loss_ratio` times the median and `loss_floor` above it (a loss above the
ceiling is such a spike whatever came before); or a sustained rise: the loss's level (the mean of its
last `rise_span` steps) above the best level of its last `rise_horizon` by `rise_margin` for
`rise_steps` steps in a row (oscillation, drift). What the guard decides is appended to guard.jsonl
(guard_events.py) before it takes effect, and the detector's state is rebuilt from .loss.json's
canonical history (a fork's parent's and a closed phase's steps included) at every start and rollback,
so that a resume, whatever moment it came at, replays the same decisions: the run stays bit-exact.
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import torch

from andrea_core import faults
from andrea_core.checkpoint import Checkpoint, CheckpointError, checkpoint_name, restore
from andrea_core.config import GuardConfig
from andrea_core.run.guard_events import (
    GuardEvent,
    Remedies,
    append_event,
    describe_event,
    read_events,
    remedy_clauses,
    replayable_events,
)
from andrea_core.run.loss_log import read_history
from andrea_core.run.record import read_run
from andrea_core.run.rundir import GUARD_LOG, RunDir

EXIT_DIVERGED = 3  # `andrea train` stopped by the guard's bound; systemd's unit does not restart on it


class Divergence(Exception):
    """A step the guard judged diverging (raised from the trainer's read of that step)."""

    def __init__(
        self,
        kind: str,
        step: int,
        spike_start: int,
        value: float,
        statistic: float | None,
        threshold: float | None,
    ):
        self.kind, self.step, self.spike_start = kind, step, spike_start
        self.value, self.statistic, self.threshold = value, statistic, threshold
        super().__init__(f"{kind} at step {step}: {describe(kind, value, statistic, threshold)}")


class DivergedTooOften(Exception):
    """The bound: `max_rollbacks` rollbacks in one region and a divergence again. The trainer stops."""


def describe(kind: str, value: float, statistic: float | None, threshold: float | None) -> str:
    if kind == "loss-rise":
        return f"loss level {value:.4g} > threshold {threshold:.4g} (its best level {statistic:.4g})"
    what = "loss" if kind.endswith("loss") or kind == "loss-spike" else "gradient norm"
    if statistic is None:
        return f"{what} {value}"
    return f"{what} {value:.4g} > threshold {threshold:.4g} (running median {statistic:.4g})"


def _median(values: Iterable[float]) -> float:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


class _Series:
    """One watched quantity (loss or gradient norm): its last `window` values and its thresholds."""

    def __init__(self, window: int, mads: float, ratio: float, floor: float, min_history: int):
        self.values: deque[float] = deque(maxlen=window)
        self.mads, self.ratio, self.floor, self.min_history = mads, ratio, floor, min_history

    def threshold(self) -> tuple[float, float] | None:
        """(median, threshold) of the values so far; None before `min_history` of them."""
        if len(self.values) < self.min_history:
            return None
        med = _median(self.values)
        mad = _median(abs(v - med) for v in self.values)
        return med, max(med + self.mads * mad, med * self.ratio, med + self.floor)

    def judge(self, value: float, against: _Series | None = None) -> tuple[float, float] | None:
        """(median, threshold) if `value` spikes above the values before it (or `against`'s, when
        given); then remember it."""
        bound = (against or self).threshold()
        self.values.append(value)
        return bound if bound is not None and value > bound[1] else None


class _Level:
    """The sustained-rise rule for one arm's loss: its level (the mean of its last `span` values), the
    lowest level of its last `horizon` steps, and the steps in a row the level has been above that
    best by more than `margin`. A function of the arm's last span + horizon + steps values."""

    def __init__(self, span: int, horizon: int, margin: float, steps: int):
        self.values: deque[float] = deque(maxlen=span)
        self.levels: deque[float] = deque(maxlen=horizon)
        self.margin, self.steps = margin, steps
        self.streak, self.streak_start = 0, 0

    def judge(self, step: int, value: float) -> tuple[float, float, float, int] | None:
        """(level, best, threshold, first step above it) once the level has stayed above its best for
        `steps` steps in a row; then remember `value`."""
        self.values.append(value)
        if len(self.values) < (self.values.maxlen or 0):
            return None
        level = math.fsum(self.values) / len(self.values)
        best = min(self.levels, default=level)
        self.levels.append(level)
        if level <= best + self.margin:
            self.streak = 0
            return None
        if self.streak == 0:
            self.streak_start = step
        self.streak += 1
        return (level, best, best + self.margin, self.streak_start) if self.streak >= self.steps else None


class Detector:
    """The guard's running statistics. Its state after a history is a function of each arm's last
    `window + consecutive` steps (`rise_span + rise_horizon + rise_steps` when longer) and the last
    `window + consecutive` steps overall (`replay`)."""

    def __init__(self, cfg: GuardConfig, vocab_size: int):
        self.cfg = cfg
        self.uniform = math.log(vocab_size)  # the loss of a uniform guess
        self.ceiling = cfg.loss_ceiling * self.uniform
        self.reset()

    def reset(self) -> None:
        c = self.cfg
        self.loss: dict[str | None, _Series] = {}  # per arm
        self.level: dict[str | None, _Level] = {}  # per arm: the sustained-rise rule
        # Every arm's losses together: what an arm with too little history of its own (a new arm after a
        # pivot) is judged against. A pivot's new data may move the loss: above the spike threshold of
        # this window but no worse than a uniform guess (ln vocab_size) it is a level shift, not a spike
        # (docs/design.md "The divergence guard": continuity and level shifts).
        self.pooled = _Series(c.window, c.loss_mads, c.loss_ratio, c.loss_floor, c.min_history)
        self.grad = _Series(c.window, c.grad_mads, c.grad_ratio, c.grad_floor, c.min_history)
        self.streak = 0  # spiking steps in a row, so far
        self.streak_start = 0
        self.rise_from = 0  # the sustained-rise rule judges only the steps after it (replay's floor)

    def keep(self) -> int:
        """How many of an arm's newest steps (and of all arms') its state depends on."""
        c = self.cfg
        rise = c.rise_span + c.rise_horizon + c.rise_steps if c.rise_steps else 0
        return max(c.window, rise) + c.consecutive

    def replay(self, history: list[tuple[int, float, float, str | None]], floor: int = 0) -> None:
        """Rebuild the state the live run had after the last of `history` ((step, loss, grad norm, arm)
        of the canonical history, oldest first); a NaN grad norm (not logged) is left out. The spike
        rules carry on across `floor` (a fork point, a pivot boundary); the sustained-rise rule starts
        again after it (`rise_from`): a pivot's new data may settle at another level."""
        self.reset()
        self.rise_from = floor
        keep = self.keep()
        chosen = set(range(max(0, len(history) - keep), len(history)))
        per_arm: dict[str | None, int] = {}
        for i in range(len(history) - 1, -1, -1):
            arm = history[i][3]
            if per_arm.get(arm, 0) < keep:
                per_arm[arm] = per_arm.get(arm, 0) + 1
                chosen.add(i)
        for i in sorted(chosen):
            step, loss, grad_norm, arm = history[i]
            self.observe(step, loss, None if math.isnan(grad_norm) else grad_norm, arm)

    def observe(
        self, step: int, loss: float, grad_norm: float | None, arm: str | None = None
    ) -> Divergence | None:
        if not math.isfinite(loss):
            return Divergence("non-finite-loss", step, step, loss, None, None)
        if grad_norm is not None and not math.isfinite(grad_norm):
            return Divergence("non-finite-grad-norm", step, step, grad_norm, None, None)
        c = self.cfg
        series = self.loss.get(arm)
        if series is None:
            series = self.loss[arm] = _Series(
                c.window, c.loss_mads, c.loss_ratio, c.loss_floor, c.min_history
            )
        spikes = []
        young = len(series.values) < c.min_history
        judged = series.judge(loss, self.pooled if young else None)
        self.pooled.judge(loss)
        if young and judged is not None and loss <= self.uniform:
            judged = None  # new data may be harder, not worse than a guess: a level shift, not a spike
        if judged is None and loss > self.ceiling:
            judged = (_median(series.values), self.ceiling)
        if judged is not None:
            spikes.append(("loss-spike", loss, *judged))
        if grad_norm is not None and not math.isnan(grad_norm):
            judged = self.grad.judge(grad_norm)
            if judged is not None:
                spikes.append(("grad-norm-spike", grad_norm, *judged))
        rise = None
        if c.rise_steps and step > self.rise_from:
            level = self.level.get(arm)
            if level is None:
                level = self.level[arm] = _Level(c.rise_span, c.rise_horizon, c.rise_margin, c.rise_steps)
            rise = level.judge(step, loss)
        if not spikes:
            self.streak = 0
        else:
            if self.streak == 0:
                self.streak_start = step
            self.streak += 1
            if self.streak >= c.consecutive:
                kind, value, med, threshold = spikes[0]
                return Divergence(kind, step, self.streak_start, value, med, threshold)
        if rise is not None:
            value, best, threshold, since = rise
            return Divergence("loss-rise", step, since, value, best, threshold)
        return None


class Guard:
    """The guard of one trainer: its events so far, their remedies, the detector, the bound."""

    def __init__(
        self,
        run: RunDir,
        cfg: GuardConfig,
        vocab_size: int,
        log: Callable[[str], None] = print,
        writes: bool = True,
        horizon: int | None = None,
        start_step: int = 0,
    ):
        """`horizon` (the run's length: its target, or its schedule's when longer) and `start_step`
        (the checkpoint it starts from): the trainer's replay of guard.jsonl, each line checked against
        the run and each obeyed one logged (guard_events.replayable_events); None reads the events as a
        report does."""
        self.run, self.cfg, self.log = run, cfg, log
        self.writes = writes  # rank 0 records events; the other ranks decide the same, in memory
        if horizon is None:
            self.events: list[GuardEvent] = read_events(run, warn=log)
        else:
            self.events = replayable_events(run, max(horizon, cfg.cooldown_steps), start_step, warn=log)
            for e in self.events:
                log(f"guard: replaying {describe_event(e)} ({GUARD_LOG})")
        self.remedies = Remedies(self.events)
        self.detector = Detector(cfg, vocab_size)
        self.floor = 0  # the oldest step this run may roll back to (restart)
        self.branch: dict | None = None  # a fork branch's lineage (restart): its divergence is its result
        # ANDREA_TEST_GUARD_NAN_AT=P[,P...] (tests only): the batches at these data positions make the
        # step's gradient NaN, a poisoned batch; the guard then skips it like any other.
        raw = faults.value(faults.GUARD_NAN_AT) or ""
        self.poisoned = {int(p) for p in raw.split(",") if p.strip()}
        # ANDREA_TEST_GUARD_LR_TIMES=F@S (tests only): the learning rate times F for the steps after S,
        # as a pivot or a fork that set it F times higher would train (a pivot cannot set it).
        factor, _, after = (faults.value(faults.GUARD_LR_TIMES) or "").partition("@")
        self.test_lr = (float(factor), int(after or 0)) if factor else None
        # ANDREA_TEST_GUARD_NOISE=oscillate@S or drift@S:L (tests only): after step S the batch's targets
        # are replaced by uniformly random tokens, on 2 of every 3 steps (a loss that oscillates) or for
        # a share of the tokens rising from 0 to 1 over L steps (a loss that drifts up): real steps on
        # corrupted data, deterministic in the step.
        kind, _, at = (faults.value(faults.GUARD_NOISE) or "").partition("@")
        start, _, length = at.partition(":")
        self.test_noise = (kind, int(start), int(length or 1)) if kind else None

    @property
    def enabled(self) -> bool:
        return self.cfg.enabled

    def data_step(self, step: int) -> int:
        return self.remedies.data_step(step)

    def lr_factor(self, step: int) -> float:
        factor = self.remedies.lr_factor(step)
        if self.test_lr is not None and step > self.test_lr[1]:
            factor *= self.test_lr[0]
        return factor

    def restart(self, step: int, phase_start: int) -> None:
        """At a start from checkpoint `step` (or a rollback to it): the detector as the uninterrupted
        run had it, from .loss.json's canonical history up to `step`: a fork's parent's steps and a
        closed phase's too, so that the first steps after a fork, a pivot or a rollback are judged
        against what came before. `floor` is where this run's own timeline begins (its fork point or
        its phase's start): it never rolls back past it."""
        lineage = read_run(self.run).lineage
        parent_step = lineage.get("parent_step") or 0
        self.floor = max(phase_start, parent_step)
        self.branch = lineage if lineage.get("parent") is not None else None
        history = [(e.step, e.loss, e.grad_norm, e.arm) for e in read_history(self.run) if e.step <= step]
        self.detector.replay(history, self.floor)

    def branch_stops(self, d: Divergence) -> bool:
        """A divergence in a fork branch, past its fork point, under train.guard.in_branch "stop"."""
        parent_step = (self.branch or {}).get("parent_step") or 0
        return self.branch is not None and self.cfg.in_branch == "stop" and d.step > parent_step

    def corrupt(self, step: int, y: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """The test hook ANDREA_TEST_GUARD_NOISE: the targets of `step`, some replaced by random tokens."""
        if self.test_noise is None or step <= self.test_noise[1]:
            return y
        kind, start, length = self.test_noise
        share = (
            (1.0 if (step - start) % 3 else 0.0) if kind == "oscillate" else min(1.0, (step - start) / length)
        )
        g = torch.Generator().manual_seed(step)
        noise = torch.randint(0, vocab_size, y.shape, generator=g)
        mask = torch.rand(y.shape, generator=g) < share
        return torch.where(mask.to(y.device), noise.to(y.device, y.dtype), y)

    def poison(self, step: int, model: torch.nn.Module) -> None:
        """The test hook: a NaN in the first gradient when step's batch is a poisoned one."""
        if self.poisoned and self.data_step(step) in self.poisoned:
            p = next(model.parameters())
            if p.grad is not None:
                p.grad.view(-1)[0] = math.nan

    def check(self, step: int, loss: float, grad_norm: float | None, arm: str | None) -> None:
        """Raise Divergence if this step completes one (with the guard off, the trainer itself stops at
        a non-finite loss, as it did before the guard)."""
        if not self.cfg.enabled:
            return
        divergence = self.detector.observe(step, loss, grad_norm, arm)
        if divergence is not None:
            raise divergence

    def plan(self, d: Divergence, checkpoints: list[int], floor: int) -> GuardEvent:
        """The event answering `d`: a rollback to the newest of `checkpoints` (valid, oldest first), or
        of the initial weights in a run from step 0, at least rollback_margin steps before the spike
        began, but not before `floor` (the oldest step this run may go back to: its fork point or its
        phase's start; before it the run was another); escalated by the rollbacks before it in its
        region; or the stop, past the bound, in a fork branch under in_branch "stop", or with nothing to
        roll back to. The remedy acts after `remedy_from` = max(target, spike_start - rollback_margin),
        not after the target: which checkpoints a fault left changes what is retrained, never the
        remedy."""
        c = self.cfg
        region = [e for e in self.events if e.action == "rollback" and e.step >= d.step - c.rollback_window]
        level = len(region)
        allowed = [s for s in checkpoints if floor <= s < d.spike_start]
        # The initial weights are a pure function of the seed: a checkpoint at step 0 that no fault can
        # leave unwritten, so a young run's rollback honours the margin too (docs/design.md "A rollback
        # point always exists").
        candidates = ([0] if floor == 0 and 0 not in allowed else []) + allowed
        far = [s for s in candidates if s <= max(d.spike_start - c.rollback_margin, floor)]
        target: int | None
        if far:
            target = far[-1]
        elif allowed:
            target = allowed[0]  # the floor's own checkpoint refused (torn): the oldest after it
        else:
            target = None
        stop = level >= c.max_rollbacks or target is None or self.branch_stops(d)
        # The anchor: the bound `far` is judged against (a margin of 0 still leaves the spike's step to
        # the remedy), or the target where none is that far back.
        remedy_from = None if stop else max(target, d.spike_start - max(c.rollback_margin, 1))
        return GuardEvent(
            number=max((e.number for e in self.events), default=0) + 1,
            action="stop" if stop else "rollback",
            step=d.step,
            spike_start=d.spike_start,
            kind=d.kind,
            value=d.value,
            statistic=d.statistic,
            threshold=d.threshold,
            rolled_back_to=None if stop else target,
            level=level,
            skip=0 if stop or not c.skip_batches else (d.step - remedy_from) * 2**level,
            lr_scale=1.0 if stop else c.lr_scale ** (level + 1),
            cooldown=0 if stop or c.lr_scale == 1 else c.cooldown_steps * 2**level,
            time=0.0,
            remedy_from=remedy_from,
        )

    def record(self, event: GuardEvent, now: float) -> None:
        """Append `event` durably (rank 0), then let it take effect."""
        event = GuardEvent(**{**event.__dict__, "time": round(now, 3)})
        if self.writes:
            append_event(self.run, event)
        self.events.append(event)
        self.remedies = Remedies(self.events)

    def rollback_line(self, e: GuardEvent) -> str:
        to = checkpoint_name(e.rolled_back_to) if e.rolled_back_to else "the initial weights (step 0)"
        return (
            f"guard: {e.kind} at step {e.step} (since step {e.spike_start}: "
            f"{describe(e.kind, e.value, e.statistic, e.threshold)}); rollback {e.level + 1} of "
            f"{self.cfg.max_rollbacks} in its region: {', '.join([f'back to {to}', *remedy_clauses(e)])} "
            f"(event {e.number} in {GUARD_LOG})"
        )

    def stop_line(self, e: GuardEvent) -> str:
        if self.branch is not None and self.cfg.in_branch == "stop" and e.step > self.floor:
            overrides = self.branch.get("overrides") or {}
            under = ", ".join(f"{k}={v}" for k, v in overrides.items()) or "no overrides"
            return (
                f"diverged at step {e.step} under {under} "
                f"({e.kind}: {describe(e.kind, e.value, e.statistic, e.threshold)}; since step "
                f"{e.spike_start}, a branch of {self.branch.get('parent')} at step "
                f"{self.branch.get('parent_step')}): in a fork branch the divergence is the result, "
                f"nothing is remedied; stopping (exit {EXIT_DIVERGED}, event {e.number} in "
                f"{self.run.path(GUARD_LOG)}). To let the guard roll back and remedy instead: "
                f"--set train.guard.in_branch=remedy when forking"
            )
        region = [
            x for x in self.events if x.action == "rollback" and x.step >= e.step - self.cfg.rollback_window
        ]
        done = "; ".join(
            f"event {x.number}: {x.kind} at step {x.step}, back to {x.rolled_back_to}" for x in region
        )
        why = (
            f"after {len(region)} rollbacks within {self.cfg.rollback_window} steps ({done})"
            if region
            else "with no checkpoint of this phase to roll back to"
        )
        return (
            f"diverged again at step {e.step} "
            f"({e.kind}: {describe(e.kind, e.value, e.statistic, e.threshold)}) "
            f"{why}; stopping (exit {EXIT_DIVERGED}, event {e.number} in {self.run.path(GUARD_LOG)}). "
            f"Try a lower train.lr or a stronger remedy (train.guard.lr_scale, cooldown_steps, "
            f"max_rollbacks) in a fork: andrea fork {self.run.url} --branch NAME --set train.lr=..."
        )


def roll_back(trainer: Any, d: Divergence) -> int:
    """The recovery, in the process of `trainer` (a train.trainer.Trainer, whose module imports this
    one): quiesce, decide, record, restore; returns the step the loop goes on from. Raises
    DivergedTooOften at the bound (the event is recorded first).

    Crash-safe by order. The checkpoints past the target (a timeline now abandoned) are moved aside
    into refused/ before the event is appended: a crash between the two resumes from the target without
    the event, trains into the same divergence (resume is bit-exact) and decides again, against the
    checkpoints then on disk: the same event, or where this timeline lacked one that the replay writes
    (a full disk's unwritten checkpoint) the newer one, as the run without that fault decides (docs/
    design.md "A crash inside a rollback"); a crash after the append resumes from the target with the
    event, exactly as this process goes on."""
    from andrea_core.model.gpt import GPT

    g, run, main = trainer.guard, trainer.run, trainer.world.is_main
    trainer.batches.discard()  # the batch of a step that will not come
    trainer.auditor.wait()
    trainer.auditor.flush()  # audits a full disk kept out: the next Auditor reads the file
    trainer.checkpointer.wait()  # the write in flight belongs to the steps before the divergence
    trainer.loss_log.flush(durable=True)  # the diverging steps stay in .loss.json, in their segment
    steps = run.checkpoint_steps()
    ckpt: Checkpoint | None = None
    while True:
        event = g.plan(d, steps, g.floor)
        target = event.rolled_back_to
        if event.action == "stop" or (target == 0 and 0 not in steps):
            break
        try:
            ckpt = run.read_checkpoint(target, trainer.model.n_params)
            break
        except CheckpointError as e:
            trainer.log(f"guard: cannot roll back to {e}; trying an older checkpoint")
            steps.remove(target)
    if event.action == "stop":
        g.record(event, time.time())
        raise DivergedTooOften(g.stop_line(g.events[-1]))
    if main:
        trainer._set_aside_refused(newer_than=target)
    _test_signal("set-aside")
    g.record(event, time.time())
    trainer.log(g.rollback_line(g.events[-1]))
    _test_signal("recorded")
    if ckpt is not None:
        restore(ckpt, trainer.model, trainer.optimizer)
    else:  # the initial weights and a fresh AdamW, exactly as a new run builds them
        torch.manual_seed(trainer.cfg.train.seed)
        fresh = GPT(trainer.cfg.model).to(trainer.device)
        with torch.no_grad():
            for p, q in zip(trainer.model.parameters(), fresh.parameters(), strict=True):
                p.copy_(q)
        trainer.optimizer.state.clear()
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.data.rewind(target)
    trainer.start_step = target
    if main:
        trainer.loss_log.close()
        trainer.tensorboard.flush()  # the old segment's events out
        trainer._open_segment(target)  # a new segment, as at any resume
    g.restart(target, trainer.data.store.phase.start_step)
    _test_signal("restored")
    return target


def _test_signal(point: str) -> None:
    """ANDREA_TEST_GUARD_SIGNAL=<point>:<SIGNAL> (tests only): this process sends itself SIGNAL at that
    moment of a rollback (set-aside, recorded, restored), as a kill or a stop would land there."""
    raw = faults.value(faults.GUARD_SIGNAL) or ""
    where, _, name = raw.partition(":")
    if where == point:
        os.kill(os.getpid(), getattr(signal, name))
