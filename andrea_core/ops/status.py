"""`andrea status`: where a run stands, read from its run directory alone (and /proc for a live trainer).

The state is one of
  training    a live trainer holds the lock (its pid, host and start time checked, not just the pid);
  crashed     a lock remains but its trainer is dead: it was killed (SIGKILL, out of memory, power
              loss) before it could checkpoint and release the lock; the steps since its newest
              checkpoint are lost, and the next `andrea train` takes the stale lock over;
  remote      the lock names a trainer that cannot be checked from here (another machine or pid
              namespace: lock.trainer_liveness): a live trainer elsewhere, as far as this host can tell;
  creating    a live trainer holds the lock of a directory with no run.yaml yet: it is creating the
              run (a new run's tokenizer can take minutes);
  pivoting    a pivot journal (pivot.json) exists: a pivot is under way, or was left half done;
  completed   no trainer, and the run has reached its target;
  stopped     no trainer, before its target: a clean stop (SIGTERM, Ctrl-C) or a run not started yet.
The target is the run's own (target.jsonl, else run.yaml's max_steps; andrea_core/run/target.py): the
percentage and the ETA are of it, as a resume without --max-steps trains to it.
Speeds are measured on `.loss.json`'s times: tokens per second over the last minute of logging.
Every line printed goes through andrea_core.untrusted.shown: a `by`, a host or a policy name read from a
run file is shown, never lets a forged string start a line of its own or drive the terminal.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from andrea_core.checkpoint import checkpoint_name
from andrea_core.command import process_argv, trainer_max_steps
from andrea_core.config import ConfigError
from andrea_core.run.guard_events import event_of, read_events, remedy_text
from andrea_core.run.lock import (
    ALIVE,
    UNKNOWN,
    Liveness,
    LockError,
    TrainerIdentity,
    lease_said,
    trainer_liveness,
)
from andrea_core.run.loss_log import LossEntry, read_recent, recent_window
from andrea_core.run.resume_check import describe as describe_check
from andrea_core.run.resume_check import newest_check
from andrea_core.run.rundir import GUARD_LOG, RunDir
from andrea_core.untrusted import shown

if TYPE_CHECKING:
    from andrea_core.data.policy import Policy

WINDOW_S = 60.0


@dataclass
class RunStatus:
    run: str
    state: str
    summary: str  # one plain sentence: what is going on and, if anything is wrong, what to do
    trainer: dict | None = None  # the live trainer: pid, host, started_at
    stale_lock: dict | None = None  # a dead trainer's lock (state crashed)
    remote_trainer: dict | None = None  # a trainer that cannot be checked from here (state remote)
    step: int = 0  # the newest step of the canonical loss history
    max_steps: int = 0
    max_steps_from: str = "run.yaml"  # or "target.jsonl (...)", or "trainer command line" (a live one's)
    pivot: dict | None = None  # the pivot journal's policy, step and boundary, while one exists
    last_logged_at: float | None = None
    tokens_per_s: float | None = None
    steps_per_s: float | None = None
    eta_s: float | None = None
    next_checkpoint: int | None = None
    next_checkpoint_eta_s: float | None = None
    newest_checkpoint: int | None = None  # the newest checkpoint that passes validation
    refused_checkpoints: list[str] = field(default_factory=list)  # newer files that fail validation
    phase: int = 1
    phase_start: int = 0
    policy: str | None = None
    mixer: str | None = None
    audit: dict | None = None  # the newest sample audit's headline numbers
    guard: dict | None = None  # the divergence guard's last event (guard.jsonl), and how many there are
    resume: dict | None = None  # the newest resume check (segments.jsonl): steps trained again, compared
    problems: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def throughput(history: list[LossEntry], window_s: float = WINDOW_S) -> tuple[float, float] | None:
    """(tokens/s, steps/s) over the last `window_s` seconds of the newest segment's logging."""
    if not history:
        return None
    recent = recent_window(history, window_s)[0]
    if len(recent) < 2:
        return None
    first, last = recent[0], recent[-1]
    timed = math.isfinite(first.elapsed) and math.isfinite(last.elapsed)  # else a log from before it
    span = last.elapsed - first.elapsed if timed else last.time - first.time
    if span <= 0:
        return None
    # The first entry's step ended at the window's start: only the steps after it ran inside it.
    return sum(e.tokens for e in recent[1:]) / span, (len(recent) - 1) / span


def _identity(ident: TrainerIdentity) -> dict:
    return {"pid": ident.pid, "host": ident.host, "started_at": ident.started_at}


def run_status(url: str, now: float | None = None, history: list[LossEntry] | None = None) -> RunStatus:
    """Where the run stands. `history`: its canonical loss history when the caller has read it already
    (the dashboard draws the same one), else the end of the log that this report needs is read here."""
    from andrea_core.data.policy import read_policy
    from andrea_core.run.lineage import phases
    from andrea_core.run.pivot_journal import read_pivot
    from andrea_core.run.record import open_run, run_n_params
    from andrea_core.run.rundir import RUN_YAML
    from andrea_core.run.samples import read_audits
    from andrea_core.run.target import read_target

    now = time.time() if now is None else now
    run = RunDir(url)
    try:
        verdict, lock_problem = trainer_liveness(run), None
    except LockError as e:
        verdict, lock_problem = Liveness(None, None, str(e)), str(e)
    lock = verdict.holder
    if lock is not None and lock.released:
        lock = None  # left at a clean exit (it keeps the lease's generation): nobody holds the run
    live = lock is not None and verdict.state == ALIVE
    if live and not run.exists(RUN_YAML):
        # A live lock and no run.yaml: a trainer is creating the run (or a tool holds the directory).
        st = RunStatus(
            run.url, "creating", "", trainer=_identity(lock), max_steps_from="trainer command line"
        )
        st.max_steps = trainer_max_steps(process_argv(lock.pid) or []) or 0
        st.summary = (
            f"trainer pid {lock.pid} on {lock.host} is creating the run (no {RUN_YAML} yet: its "
            f"config, policy and tokenizer are being made), started {_when(lock.started_at)}"
        )
        return st
    run, record = open_run(url)
    cfg = record.config
    st = RunStatus(run.url, "stopped", "", max_steps=cfg.train.max_steps)
    if lock_problem:
        st.problems.append(lock_problem)
    target = read_target(run, cfg.train.max_steps, warn=st.problems.append)
    st.max_steps, st.max_steps_from = target.max_steps, target.source
    if live:
        st.trainer = _identity(lock)
        cmdline_max = trainer_max_steps(process_argv(lock.pid) or [])
        if cmdline_max is not None:
            st.max_steps, st.max_steps_from = cmdline_max, "trainer command line"
    elif lock is not None and verdict.state == UNKNOWN:
        st.remote_trainer = _identity(lock)  # live elsewhere, as far as this host can tell: not stale
    elif lock is not None:
        st.stale_lock = _identity(lock)

    # The readers keep a line's integers whole, however large; this report does float arithmetic on
    # them (rates, ETA, percent), where a step or token count past 2**53 is no trainer's anyway.
    # Its newest step and speed need only the log's last minute (recent_window), not millions of steps.
    history = read_recent(run, WINDOW_S) if history is None else recent_window(history, WINDOW_S)[0]
    history = [e for e in history if max(abs(e.step), abs(e.tokens)) < 2**53]
    if history:
        st.step, st.last_logged_at = history[-1].step, history[-1].time
    rates = throughput(history)
    if live and st.last_logged_at is not None and now - st.last_logged_at > WINDOW_S:
        rates = (0.0, 0.0)  # a live trainer that logged nothing for a minute (starting up, or stuck)
    if rates is not None:
        st.tokens_per_s, st.steps_per_s = rates

    refused: list[str] = []
    ckpt = run.newest_valid_checkpoint(run_n_params(record), warn=refused.append)
    st.newest_checkpoint = ckpt.step if ckpt is not None else None
    st.refused_checkpoints = refused

    every = cfg.train.checkpoint_every
    if st.step < st.max_steps:
        st.next_checkpoint = min(st.max_steps, (st.step // every + 1) * every)
        if live and st.steps_per_s:
            st.eta_s = (st.max_steps - st.step) / st.steps_per_s
            st.next_checkpoint_eta_s = (st.next_checkpoint - st.step) / st.steps_per_s

    closed = phases(run)
    st.phase = len(closed) + 1
    st.phase_start = closed[-1][1] if closed else (record.lineage.get("parent_step") or 0)
    try:
        policy = read_policy(run)
        st.policy, st.mixer = policy.name, policy.mixer
    except (ConfigError, FileNotFoundError) as e:
        policy = None
        st.problems.append(f"policy: {e}")
    if policy is not None:
        try:
            _data_problems(run, policy, st.problems)
        except ConfigError as e:  # data.jsonl past its bound, say: the rest of the report stands
            st.problems.append(f"data: {e}")
    try:
        audits = read_audits(run)
    except ConfigError as e:
        audits = []
        st.problems.append(str(e))
    if audits:
        a = audits[-1]
        m = a["metrics"]
        val = m.get("val_loss") or {}
        st.audit = {
            "step": a["step"],
            "val_loss_mean": sum(val.values()) / len(val) if val else None,
            "val_loss": val,
            **{k: m.get(k) for k in ("distinct_2", "repetition", "gzip_ratio")},
        }

    events = read_events(run, warn=st.problems.append)
    if events:
        st.guard = {**asdict(events[-1]), "events": len(events)}
        if events[-1].action == "stop" and not live:
            st.problems.append(
                f"the divergence guard stopped the run at step {events[-1].step} "
                f"(event {events[-1].number} in {GUARD_LOG}): see README, 'When a run diverges'"
            )

    st.resume = newest_check(run, warn=st.problems.append)
    if st.resume is not None and st.resume["promised"] and not st.resume["equal"]:
        st.problems.append(describe_check(st.resume))

    journal = read_pivot(run)
    if journal is not None:
        st.pivot = {k: journal.get(k) for k in ("policy", "step", "boundary", "unreadable", "source")}
    st.state, st.summary = _verdict(st, lock, verdict, run, now)
    return st


def _data_problems(run: RunDir, policy: Policy, problems: list[str]) -> None:
    """The policy's arms unavailable at the trainer's last start, and the caps scaled for their
    absence (data.jsonl: data/changes.py), as problem lines: the run trains on without them."""
    from andrea_core.data.changes import DATA_LOG, caps_in_force, read_data_log, unavailable_arms

    entries = read_data_log(run, warn=problems.append)
    listed = {a.name for a in policy.arms}
    for arm, e in unavailable_arms(entries).items():
        if arm in listed:
            problems.append(
                f"arm {arm!r} unavailable since step {e['step']} ({e.get('why')}): not drawn, its floor "
                f"released, until its source is back at a trainer start ({DATA_LOG})"
            )
    scaled = caps_in_force(entries)
    if scaled is not None and set(scaled["caps"]) <= listed:
        caps = ", ".join(f"{a} {c:.4g}" for a, c in scaled["caps"].items())
        problems.append(
            f"caps scaled x{scaled['scale']:.4g} since step {scaled['step']} to sum to 1 without arm(s) "
            f"{scaled['arm']}: {caps}; the policy's caps hold again when they return ({DATA_LOG})"
        )


def _verdict(
    st: RunStatus, lock: TrainerIdentity | None, verdict: Liveness, run: RunDir, now: float
) -> tuple[str, str]:
    newest = checkpoint_name(st.newest_checkpoint) if st.newest_checkpoint is not None else None
    resume = f"`andrea train --run-dir {run.url}`"
    if st.pivot is not None:
        return "pivoting", _pivoting(st, lock, lock is not None and verdict.state == ALIVE, run)
    if lock is not None and verdict.state == ALIVE:
        since = f"{_ago(now - st.last_logged_at)} ago" if st.last_logged_at else "not yet"
        return "training", f"trainer pid {lock.pid} on {lock.host} is training; last step logged {since}"
    if lock is not None and verdict.state == UNKNOWN:
        return "remote", (
            f"locked by trainer pid {lock.pid} on host {lock.host}, which cannot be checked from here: "
            f"{verdict.why}; {lease_said(lock)} (started {_when(lock.started_at)})"
        )
    if lock is not None:
        base = st.newest_checkpoint or 0
        lost = (
            f"steps {base + 1}..{st.step} logged after {newest or 'the start'} are lost; "
            if st.step > base
            else ""
        )
        return "crashed", (
            f"trainer pid {lock.pid} (started {_when(lock.started_at)}) is dead but its lock remains: it was "
            f"killed or crashed (SIGKILL, out of memory, power loss) before a clean exit; {lost}"
            f"{resume} resumes from {newest or 'scratch'} and takes over the stale lock"
        )
    if st.step >= st.max_steps and st.newest_checkpoint == st.step:
        return "completed", (
            f"no trainer running; trained to step {st.step} ({newest}), its target; "
            f"`andrea train --run-dir {run.url} --max-steps N` trains further"
        )
    if st.newest_checkpoint is None and not st.step:
        return "stopped", f"no trainer running; not trained yet: {resume} starts it"
    return "stopped", (
        f"no trainer running, before its target (step {st.max_steps}); {resume} resumes from "
        f"{newest or 'scratch'} and trains to it"
    )


def _pivoting(st: RunStatus, lock: TrainerIdentity | None, live: bool, run: RunDir) -> str:
    from andrea_core.run.pivot_journal import HALF_DONE_STEPS, half_done_message

    p = st.pivot
    if p.get("unreadable"):
        return f"{p['unreadable']}: an unreadable pivot journal; no trainer starts until it is repaired"
    where = (
        f"boundary {checkpoint_name(p['boundary'])}"
        if p.get("boundary") is not None
        else "boundary not yet chosen"
    )
    who = f"trainer pid {lock.pid} is live" if live else "no trainer running"
    if p.get("step") in HALF_DONE_STEPS and not live:
        return f"a pivot to policy {p.get('policy')!r} is half done ({who}): {half_done_message(run, p)}"
    return f"a pivot to policy {p.get('policy')!r} is under way (last step {p.get('step')!r}, {where}; {who})"


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def format_status(st: RunStatus, now: float | None = None) -> str:
    now = time.time() if now is None else now
    lines = [shown(f"{st.run}: {st.state.upper()}: {st.summary}")]

    def row(label: str, text: str) -> None:
        lines.append(f"  {label:<12}{shown(text)}")

    if st.trainer:
        t = st.trainer
        since = f"since {_when(t['started_at'])} ({_ago(now - t['started_at'])} ago)"
        row("trainer", f"pid {t['pid']} on {t['host']}, {since}")
    if st.remote_trainer:
        t = st.remote_trainer
        row(
            "trainer",
            f"pid {t['pid']} on {t['host']}, started {_when(t['started_at'])} (not checked from here)",
        )
    if st.stale_lock:
        t = st.stale_lock
        row("stale lock", f"pid {t['pid']} on {t['host']}, started {_when(t['started_at'])}")
    pct = f" ({100 * st.step / st.max_steps:.0f}%)" if st.max_steps else ""
    row("step", f"{st.step} of {st.max_steps}{pct}  (target from {st.max_steps_from})")
    if st.tokens_per_s is not None:
        what = "the last minute" if st.trainer else "its last minute of training"
        row("speed", f"{st.tokens_per_s:,.0f} tokens/s, {st.steps_per_s:.2f} steps/s over {what}")
    if st.eta_s is not None:
        row("ETA", f"{_ago(st.eta_s)} (step {st.max_steps} at {_when(now + st.eta_s)})")
    if st.next_checkpoint is not None:
        eta = f" in ~{_ago(st.next_checkpoint_eta_s)}" if st.next_checkpoint_eta_s is not None else ""
        row("next ckpt", f"{checkpoint_name(st.next_checkpoint)}{eta}")
    row(
        "checkpoint",
        f"{checkpoint_name(st.newest_checkpoint)} (newest valid)"
        if st.newest_checkpoint is not None
        else "none valid",
    )
    for refused in st.refused_checkpoints:
        row("REFUSED", refused)
    row(
        "phase",
        f"{st.phase} since step {st.phase_start}, policy {st.policy or '?'} ({st.mixer or '?'} mixer)",
    )
    if st.audit:
        a = st.audit
        arms = ", ".join(f"{k} {v:.4f}" for k, v in a["val_loss"].items())
        mean = f"{a['val_loss_mean']:.4f}" if a["val_loss_mean"] is not None else "n/a"
        row(
            "audit",
            f"step {a['step']}: val loss {mean} ({arms}), distinct-2 {a['distinct_2']:.3f}, "
            f"repetition {a['repetition']:.3f}",
        )
    if st.guard:
        row("guard", guard_summary(st.guard, now))
    if st.resume and (st.resume["equal"] or not st.resume["promised"]):  # a failed one is a PROBLEM row
        row("resume", describe_check(st.resume))
    for problem in st.problems:
        row("PROBLEM", problem)
    return "\n".join(lines)


def guard_summary(event: dict, now: float) -> str:
    """The divergence guard's last event, in one row."""
    e = event
    what = f"{e['kind']} at step {e['step']} (since step {e['spike_start']})"
    if e["action"] == "stop":
        done = "stopped the run (its bound, train.guard.max_rollbacks)"
    else:
        to = checkpoint_name(e["rolled_back_to"]) if e["rolled_back_to"] else "the initial weights"
        done = f"rolled back to {to}, {remedy_text(event_of(e))}"
    return f"event {e['number']} of {e['events']}, {_ago(now - e['time'])} ago: {what}; {done}"
