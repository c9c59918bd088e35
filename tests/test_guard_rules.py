"""The divergence guard's rules, unit by unit (issue 41): the Detector fed loss sequences (measured ones
from a real andrea-tiny run, and the issue's oscillation and drift), the rollback plan and its
escalation, the remedies' cooldown, retention's rollback point and guard.jsonl read as checked input.
Each test names the defect or the mutation it catches."""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import andrea
from guard_parent import guard_parent_fixture  # noqa: F401 (the guard_parent fixture)

from andrea_core.config import GuardConfig, RetentionConfig
from andrea_core.run.guard_events import (
    FORMAT,
    GuardEvent,
    Remedies,
    events_up_to,
    lr_changes,
    parse_events,
    replayable_events,
)
from andrea_core.run.loss_log import read_history
from andrea_core.run.retention import plan_retention, rollback_reach
from andrea_core.run.rundir import GUARD_LOG, RunDir
from andrea_core.train.guard import Detector, Divergence, Guard

G = GuardConfig()
VOCAB = 256  # ceiling 1.5 x ln(256) = 8.32


def flat(n: int = 200, level: float = 3.0, seed: int = 0) -> list[float]:
    """The issue's clean run: `n` steps at level +- 0.05."""
    rnd = random.Random(seed)
    return [level + rnd.uniform(-0.05, 0.05) for _ in range(n)]


def first_divergence(
    losses: list[float], cfg: GuardConfig = G, grads: list[float] | None = None, history=(), first_step=None
) -> Divergence | None:
    d = Detector(cfg, VOCAB)
    d.replay(list(history))
    step = first_step or (history[-1][0] + 1 if history else 1)
    for i, loss in enumerate(losses):
        found = d.observe(step + i, loss, None if grads is None else grads[i])
        if found is not None:
            return found
    return None


def as_history(losses: list[float], grad: float = 0.5) -> list[tuple[int, float, float, None]]:
    return [(i + 1, v, grad, None) for i, v in enumerate(losses)]


# --- item 2: detection that matches its rule -----------------------------------------------------


@pytest.mark.parametrize(
    "name, tail",
    [
        ("9.0 on 2 of every 3 steps", [9.0 if i % 3 != 2 else 3.0 for i in range(400)]),
        ("9.0 and 3.0 alternating", [9.0 if i % 2 == 0 else 3.0 for i in range(400)]),
        ("3.0 to 8.0 over 1,000 steps", [3.0 + 5.0 * i / 1000 for i in range(1000)]),
    ],
)
def test_oscillation_and_drift_are_caught(name, tail):
    """The issue's sequences (today: never detected, whatever their length)."""
    d = first_divergence(flat() + tail)
    assert d is not None, name
    assert d.kind == "loss-rise" and 200 < d.spike_start <= d.step
    # Soon enough: oscillation within 40 steps; the drift before it has risen 1.5 nats (step ~300 of it).
    assert d.step - 200 <= (300 if "over 1,000" in name else 40), (name, d.step)
    assert d.statistic == pytest.approx(3.0, abs=0.05) and d.value > d.threshold == d.statistic + 1.0


def test_the_rise_rule_off_is_the_old_detector():
    """rise_steps 0 turns the rule off: the 2-of-3 oscillation then passes (3 in a row needed)."""
    tail = [9.0 if i % 3 != 2 else 3.0 for i in range(400)]
    assert first_divergence(flat() + tail, replace(G, rise_steps=0)) is None


def test_a_spike_below_the_ceiling_is_judged_against_the_running_median():
    """Kills `_Series.judge` never firing for the loss: 7.0 is below the ceiling (8.32), x2.3 the median."""
    d = first_divergence(flat() + [7.0, 7.0, 7.0])
    assert (d.kind, d.step, d.spike_start, d.value) == ("loss-spike", 203, 201, 7.0)
    assert d.statistic == pytest.approx(3.0, abs=0.05) and d.threshold == pytest.approx(d.statistic * 2)


def test_a_gradient_norm_spike():
    """Kills `_Series.judge` never firing for the gradient norm: the loss stays flat, the norm goes from
    0.5 to 4.0 (x8, above grad_ratio 5 and grad_floor 1.0) for three steps."""
    losses = flat(203)
    grads = [0.5 + 0.01 * (i % 5) for i in range(200)] + [4.0, 4.0, 4.0]
    d = first_divergence(losses, grads=grads)
    assert (d.kind, d.step, d.spike_start, d.value) == ("grad-norm-spike", 203, 201, 4.0)
    assert d.threshold == pytest.approx(d.statistic * 5)
    assert first_divergence(losses, grads=grads[:-1] + [0.5]) is None  # two spikes are not three


def test_the_consecutive_rule():
    """`consecutive` spiking steps in a row make a divergence, dated from the first; a normal step
    between them resets the count (the sustained-rise rule off, to see this rule alone)."""
    cfg = replace(G, rise_steps=0)
    assert first_divergence(flat() + [7.0, 7.0, 3.0, 7.0, 7.0, 3.0] * 3, cfg) is None
    d = first_divergence(flat() + [7.0, 7.0, 3.0, 7.0, 7.0, 7.0], cfg)
    assert (d.step, d.spike_start) == (206, 204)
    one = first_divergence(flat() + [7.0], replace(cfg, consecutive=1))
    assert (one.step, one.spike_start) == (201, 201)
    five = replace(cfg, consecutive=5)
    assert first_divergence(flat() + [7.0] * 4, five) is None
    assert first_divergence(flat() + [7.0] * 5, five).step == 205


def test_a_loss_above_the_ceiling_is_a_spike_with_no_history():
    """The ceiling needs no history: three losses above ln(256) x 1.5 from the very first step."""
    d = first_divergence([9.0, 9.0, 9.0])
    assert (d.kind, d.step, d.spike_start, d.threshold) == ("loss-spike", 3, 1, pytest.approx(8.3178, 1e-4))


def test_a_real_clean_run_fires_nothing(guard_parent):
    """The 300 measured steps of andrea-tiny (warm-up included), per arm as the trainer feeds them."""
    history = read_history(RunDir(str(guard_parent)))
    d = Detector(G, VOCAB)
    assert [d.observe(e.step, e.loss, e.grad_norm, e.arm) for e in history] == [None] * len(history)


# --- item 1: continuity --------------------------------------------------------------------------


def test_replay_keeps_the_statistics():
    """Kills `Detector.replay` forgetting its statistics: replayed from 200 clean steps, the detector
    judges the next steps exactly as the live one does (a spike below the ceiling at once; the
    oscillation's rise at the same step)."""
    history = as_history(flat())
    for tail in ([7.0, 7.0, 7.0], [9.0 if i % 3 != 2 else 3.0 for i in range(100)]):
        live = first_divergence([v for _, v, _, _ in history] + tail)
        replayed = first_divergence(tail, history=history)
        assert replayed is not None and live is not None
        assert (replayed.kind, replayed.step, replayed.spike_start) == (
            live.kind,
            live.step,
            live.spike_start,
        )


def test_replay_mid_rise_is_the_live_state():
    """The sustained-rise rule's state is a function of the replayed tail: a restart in the middle of a
    drift fires at the same step as the run that never stopped."""
    losses = flat() + [3.0 + 5.0 * i / 1000 for i in range(1000)]
    live = first_divergence(losses)
    for cut in (230, 300, live.step - 5):
        replayed = first_divergence(losses[cut:], history=as_history(losses[:cut]))
        assert (replayed.step, replayed.spike_start, replayed.value) == (
            live.step,
            live.spike_start,
            live.value,
        )


def test_after_a_fork_a_blow_up_is_judged_against_the_parent(guard_parent):
    """The issue's case 1, measured losses: the parent's history (andrea-tiny to 300) and then losses
    like those its train.lr=1.0 branch logged (6-12, then about 4: below the ceiling after the first).
    With the parent's history the detector flags them at the third step; started empty (today's
    Guard.restart of a branch), only steps above the ceiling can count and it never fires."""
    parent = [(e.step, e.loss, e.grad_norm, e.arm) for e in read_history(RunDir(str(guard_parent)))]
    arm = parent[-1][3]
    branch = [9.1, 7.9, 6.4, 6.1, 5.2, 4.8, 4.6, 4.4] + [4.2] * 40
    d = Detector(G, VOCAB)
    d.replay(parent)
    found = [d.observe(301 + i, v, None, arm) for i, v in enumerate(branch)]
    first = next(x for x in found if x is not None)
    assert (first.kind, first.step, first.spike_start) == ("loss-spike", 303, 301)
    empty = Detector(G, VOCAB)
    assert all(empty.observe(301 + i, v, None, arm) is None for i, v in enumerate(branch[1:], 1))


def test_a_new_arm_after_a_pivot_is_judged_against_all_arms():
    """A pivot's new arm has no history of its own: it is judged against every arm's window (the spike
    rules), and the sustained-rise rule starts again after the boundary. A level shift passes (new data:
    measured at andrea-tiny's pivot to tiny-mix at 3,000, docs-prose at 2.47, 3.12, 2.90 against a
    median of 1.52, x2.06, then settling near 2.9); a blow-up beyond a uniform guess (6.0 > ln 256 =
    5.55) is flagged at the third step."""
    before = as_history(flat(200, 1.52))
    d = Detector(G, VOCAB)
    d.replay(before, floor=200)
    shift = [2.47, 3.12, 2.90, 2.73] + [2.9 + 0.01 * (i % 3) for i in range(600)]
    assert all(d.observe(201 + i, v, 0.5, "new-arm") is None for i, v in enumerate(shift))
    before = as_history(flat(200, 2.0))
    # The same shift on the same arm, with no boundary between: a sustained rise (by its margin, 1 nat).
    same = first_divergence([3.05 + 0.01 * (i % 3) for i in range(600)], history=before)
    assert same is not None and same.kind == "loss-rise"
    d = Detector(G, VOCAB)
    d.replay(before)
    found = [d.observe(201 + i, 6.0, None, "new-arm") for i in range(3)]
    assert found[:2] == [None, None] and (found[2].kind, found[2].spike_start) == ("loss-spike", 201)


# --- the plan: escalation, its window, the floor; the remedies' cooldown -------------------------


def rollback(number: int, step: int, to: int, level: int = 0, remedy_from: int | None = None) -> GuardEvent:
    """A rollback at `step` to `to`, its remedy from `remedy_from` (default: `to`, as format 1 had it)."""
    f = to if remedy_from is None else remedy_from
    return GuardEvent(number, "rollback", step, step, "loss-spike", 9.0, 3.0, 6.0, to, level,
                      (step - f) * 2**level, 0.3 ** (level + 1), 1000 * 2**level, 0.0, f)  # fmt: skip


def planned(
    tmp_path: Path, events: list[GuardEvent], d: Divergence, ckpts: list[int], floor: int
) -> GuardEvent:
    run = RunDir(str(tmp_path / "run"))
    run.makedirs()
    g = Guard(run, G, VOCAB, log=lambda _: None, writes=False)
    g.events = list(events)
    return g.plan(d, ckpts, floor)


def test_escalation_compounds_within_the_window_only(tmp_path):
    """Kills escalation removed and `plan` without its window: a second rollback 1,000 steps after the
    first is level 1 (lr x0.09, cooldown 2000, twice the skip); one 2,001 steps after is level 0. The
    skip is counted from remedy_from = spike_start - rollback_margin, not from the checkpoint."""
    d = Divergence("loss-spike", 1500, 1498, 9.0, 3.0, 6.0)
    second = planned(tmp_path, [rollback(1, 500, 400)], d, [1200, 1400, 1440], 0)
    assert (second.number, second.level, second.rolled_back_to) == (2, 1, 1440)  # <= 1498 - 50
    assert second.remedy_from == 1448  # 1498 - 50: steps 1441..1448 retrain on their own data
    assert (second.lr_scale, second.cooldown, second.skip) == (pytest.approx(0.09), 2000, 104)  # 52 x 2
    far = Divergence("loss-spike", 2501, 2499, 9.0, 3.0, 6.0)
    fresh = planned(tmp_path, [rollback(1, 500, 400)], far, [2400, 2440], 0)
    assert (fresh.level, fresh.lr_scale, fresh.cooldown, fresh.skip) == (0, 0.3, 1000, 52)  # 2501 - 2449
    events = [rollback(n, 1000 + n, 900, n - 1) for n in range(1, 5)]
    stop = planned(tmp_path, events, Divergence("loss-spike", 1100, 1100, 9.0, 3.0, 6.0), [900], 0)
    assert (stop.action, stop.level, stop.rolled_back_to, stop.lr_scale) == ("stop", 4, None, 1.0)


def test_the_floor_keeps_a_rollback_inside_its_own_timeline(tmp_path):
    """A branch forked at 200 never goes back past its fork point: with nothing rollback_margin back,
    to its fork point; with that checkpoint gone, it stops. A run from step 0 with no checkpoint
    rollback_margin before the spike goes back to the initial weights (step 0's checkpoint, which no
    fault leaves unwritten; retention keeps any that may become the rollback point, so only a young
    run or a fault comes here). The remedy acts after 213 - 50 = 163 wherever the rollback went at or
    before it; after the fork point where that is past 163."""
    d = Divergence("loss-spike", 215, 213, 9.0, 3.0, 6.0)
    to = [(e.rolled_back_to, e.remedy_from, e.skip) for e in (
        planned(tmp_path, [], d, [150, 200, 210], 200),
        planned(tmp_path, [], d, [], 0),
        planned(tmp_path, [], d, [170, 180, 190], 0),
        planned(tmp_path, [], d, [100, 170, 180], 0),
        planned(tmp_path, [], d, [100, 160], 0),
    )]  # fmt: skip
    assert to == [(200, 200, 15), (0, 163, 52), (0, 163, 52), (100, 163, 52), (160, 163, 52)]
    stop = planned(tmp_path, [], d, [150], 200)
    assert (stop.action, stop.rolled_back_to, stop.remedy_from) == ("stop", None, None)
    margin0 = Guard(RunDir(str(tmp_path / "run")), replace(G, rollback_margin=0), VOCAB, writes=False)
    assert margin0.plan(d, [100, 212], 0).remedy_from == 212  # never past the spike: 213 is skipped


def test_the_cooldown_ends_where_the_event_says():
    """The learning-rate factor holds for exactly steps R+1 .. R+cooldown; the skip from R+1 on."""
    r = Remedies([rollback(1, 150, 100)])
    assert [r.lr_factor(s) for s in (100, 101, 1100, 1101)] == [1.0, 0.3, 0.3, 1.0]
    assert [r.data_step(s) for s in (100, 101)] == [100, 151]
    assert lr_changes([rollback(1, 150, 100)]) == [(101, 1100, 0.3)]
    late = Remedies([rollback(1, 150, 40, remedy_from=100)])  # steps 41..100 retrain on their own data
    assert [late.lr_factor(s) for s in (41, 100, 101, 1100, 1101)] == [1.0, 1.0, 0.3, 0.3, 1.0]
    assert [late.data_step(s) for s in (41, 100, 101)] == [41, 100, 151]


def test_a_later_rollback_keeps_the_remedies_acting_before_its_own():
    """The superseding rule keyed on remedy_from: a rollback whose remedy acts after F keeps the active
    events acting from before F (they shaped the steps it retrains as they were) and drops the rest.
    Event 1 acts after 100; event 2 goes back to checkpoint 80 with its remedy after 120: steps 81..120
    retrain exactly as before, event 1's skip from 101 included (keyed on rolled_back_to, event 1 was
    dropped and 101..120 drew other data). Event 3 acts after 100 too: it replaces both."""
    one, two = rollback(1, 150, 90, remedy_from=100), rollback(2, 170, 80, remedy_from=120)
    r = Remedies([one, two])
    assert [e.number for e in r.active] == [1, 2]
    assert [r.data_step(s) for s in (100, 101, 120, 121)] == [100, 151, 170, 121 + 50 + 50]
    assert [r.lr_factor(s) for s in (100, 101, 121)] == [1.0, 0.3, 0.3]
    three = rollback(3, 180, 60, remedy_from=100)
    assert [e.number for e in Remedies([one, two, three]).active] == [3]


def test_format_1_lines_read_as_remedy_from_their_checkpoint():
    """A format 1 line (before remedy_from) acts from its rolled_back_to, as it always did, so a run or a
    fork branch written before keeps its history; format 2 names remedy_from, within [rolled_back_to,
    step); a line of either format with the other's shape is refused. A fork at F copies the rollbacks
    whose remedy acts from before F, whichever checkpoint they went back to."""
    old = {k: v for k, v in rollback(1, 150, 100).__dict__.items() if k != "remedy_from"}
    line = lambda **f: (json.dumps({"format": FORMAT, **rollback(1, 150, 100).__dict__, **f}) + "\n").encode()  # noqa: E731
    (e,) = parse_events((json.dumps({"format": 1, **old}) + "\n").encode())
    assert (e.rolled_back_to, e.remedy_from) == (100, 100) and Remedies([e]).data_step(101) == 151
    assert parse_events(line(remedy_from=120, skip=30))[0].remedy_from == 120
    for bad in (
        (json.dumps({"format": 1, **old, "remedy_from": 120}) + "\n").encode(),
        (json.dumps({"format": FORMAT, **old}) + "\n").encode(),
        line(remedy_from=None),
        line(remedy_from=99),
        line(remedy_from=150),
        line(remedy_from=120),  # skip 50 is beyond (150 - 120) x 2^0
    ):
        warnings: list[str] = []
        assert parse_events(bad, warn=warnings.append) == [] and len(warnings) == 1, bad
    late = line(rolled_back_to=40, remedy_from=120, skip=30)
    assert events_up_to(late, 120) == b"" and events_up_to(late, 121) == late


# --- item 3: a rollback point that always exists --------------------------------------------------


def test_retention_keeps_the_guards_rollback_point():
    """The issue's case 3: checkpoints every 10, the default retention (newest 5). After checkpoint 80
    retention used to keep 40..80 only, and a divergence at 85 went back to the initial weights. Now the
    newest checkpoint at least rollback_margin + 19 (detection lag) steps before step 81 stays (10), and
    every one after it, which may still become it (20, 30)."""
    steps = list(range(10, 90, 10))
    reach = rollback_reach(G)
    assert reach == 50 + 20 - 1  # the rise rule's 20 steps are the longest lag
    plan = plan_retention(steps, RetentionConfig(), {}, 80, reach)
    assert sorted(plan.keep) == steps and plan.delete == []
    assert "rollback point (at least 69" in plan.keep[10][0] and "may become" in plan.keep[20][0]
    assert plan_retention(steps, RetentionConfig(), {}, 80, None).delete == [10, 20, 30]


@pytest.mark.parametrize(
    "every, keep_last, keep_every, lost",
    [
        (10, 5, None, set()),  # the case 3, run long
        (5, 3, 50, {50}),  # the S3 soak's settings, its keep_every checkpoint 50 never written
        (5, 3, 50, {50, 75, 100, 105}),
        (10, 5, None, {10, 20}),  # a young run's first checkpoints never written
        (1, 2, None, {7, 8, 9, 60}),  # checkpoints every step, as the pivot tests take them
        (100, 5, 10_000, set()),  # the defaults: nothing kept beyond the newest 5
    ],
)
def test_retention_pass_by_pass_leaves_the_rollback_a_run_keeping_everything_would_take(
    tmp_path, every, keep_last, keep_every, lost
):
    """Retention as the trainer applies it, after each checkpoint (those in `lost` never written, as a
    full disk leaves them): before each next checkpoint, every divergence the guard may see (each step
    up to it, each spike start within the detection lag) plans the same rollback from what retention
    kept as from every checkpoint written, and the same remedy as from every checkpoint of a run without
    the faults; and what is kept beyond keep_last is bounded by the reach."""
    cfg, reach = RetentionConfig(keep_last=keep_last, keep_every=keep_every), rollback_reach(G)
    (tmp_path / "run").mkdir()
    guard = Guard(RunDir(str(tmp_path / "run")), G, VOCAB, log=lambda _: None, writes=False)
    written: list[int] = []
    kept: list[int] = []
    for newest in range(every, 700 + 1, every):
        if newest in lost:
            continue
        written.append(newest)
        unfaulted = list(range(every, newest + 1, every))
        kept = sorted(plan_retention(kept + [newest], cfg, {}, newest, reach).keep)
        assert set(kept) <= set(written) and kept[-1] == newest
        beyond = [s for s in kept if s < newest - keep_last * every and (not keep_every or s % keep_every)]
        assert len(beyond) <= reach // every + 1, (newest, kept)
        for step in range(newest + 1, newest + every + 1):
            for spike_start in range(step - G.rise_steps + 1, step + 1):
                d = Divergence("loss-rise", step, spike_start, 9.0, 3.0, 4.0)
                a, b, c = (guard.plan(d, ckpts, 0) for ckpts in (kept, written, unfaulted))
                assert (a.rolled_back_to, a.remedy_from) == (b.rolled_back_to, b.remedy_from), (newest, d)
                assert (a.remedy_from, a.skip) == (c.remedy_from, c.skip), (newest, d)


# --- item 5: guard.jsonl is input -----------------------------------------------------------------


@pytest.fixture
def reference_copy(guard_parent, tmp_path) -> RunDir:
    shutil.copytree(guard_parent, tmp_path / "run")
    return RunDir(str(tmp_path / "run"))


def event_line(**fields) -> bytes:
    """A rollback at 250 to 100 (the start checkpoint of the replay below), with `fields` changed."""
    e = {"format": FORMAT, **rollback(1, 250, 100).__dict__, **fields}
    if "rolled_back_to" in fields:
        e["remedy_from"] = fields["rolled_back_to"]
    return (json.dumps(e) + "\n").encode()


@pytest.mark.parametrize(
    "fields, why",
    [
        # The forged line: a rollback to 19 (never a checkpoint), lr x1e-300, a 2^53-step cooldown.
        ({"rolled_back_to": 19, "lr_scale": 1e-300, "cooldown": 2**53 - 1, "skip": 0}, "lr_scale outside"),
        ({"rolled_back_to": 19, "skip": 0}, "rolled_back_to 19: the run's history never restarted"),
        ({"cooldown": 2001}, "cooldown 2001 beyond the run's length (2000 steps)"),
        ({"skip": 10_000}, "skip 10000 beyond its escalated distance"),
        ({"level": 3}, "level 3 is not below the event's number 2"),
        ({"lr_scale": 1.5}, "lr_scale outside"),
    ],
)
def test_a_forged_line_is_skipped_naming_it_never_obeyed(reference_copy, fields, why):
    """Line 1 legitimate (a rollback to 100, the checkpoint the trainer starts from), line 2 forged:
    line 2 alone is skipped, with one warning naming the file, the line and what is wrong."""
    run = reference_copy
    good = (json.dumps({"format": FORMAT, **rollback(1, 120, 100).__dict__}) + "\n").encode()
    run.write_atomic(GUARD_LOG, good + event_line(number=2, **fields))
    warnings: list[str] = []
    events = replayable_events(run, 2000, 100, warnings.append)
    assert [e.number for e in events] == [1]
    (warning,) = warnings
    assert warning.startswith(f"{run.path(GUARD_LOG)}: line 2: not obeyed, skipped: ") and why in warning


def test_numbers_out_of_order_and_torn_lines(reference_copy):
    run = reference_copy
    line = (json.dumps({"format": FORMAT, **rollback(3, 120, 100).__dict__}) + "\n").encode()
    again = (json.dumps({"format": FORMAT, **rollback(2, 130, 100).__dict__}) + "\n").encode()
    run.write_atomic(GUARD_LOG, line + b'{"format": 1, "numb\n' + again)
    warnings: list[str] = []
    assert [e.number for e in replayable_events(run, 2000, 100, warnings.append)] == [3]
    assert any("malformed line(s) (torn by a crash?): lines 2" in w for w in warnings)
    assert any("line 3: not obeyed, skipped: number 2 after event 3" in w for w in warnings)


def test_the_trainer_logs_what_it_replays_and_skips_the_forged(reference_copy, tmp_path):
    """A real trainer start on a run with the issue's forged line (as it would have been appended:
    rollback to 19, lr x1e-300, cooldown 2^53 - 1): today it trains at lr 3e-303 and says nothing.
    Now the line is skipped, named, and step 301's learning rate is the schedule's own."""
    run = reference_copy
    forged = event_line(
        step=250, spike_start=250, rolled_back_to=19, skip=0, lr_scale=1e-300, cooldown=2**53 - 1
    )
    run.write_atomic(GUARD_LOG, forged)
    proc = andrea("train", "--run-dir", run.url, "--max-steps", "302", "--device", "cpu")
    out = proc.stdout + proc.stderr
    assert f"{run.path(GUARD_LOG)}: line 1: not obeyed, skipped: lr_scale outside" in out
    assert "guard: replaying" not in out
    from andrea_core.run.record import read_run
    from andrea_core.train.optim import lr_at

    cfg = read_run(run).config
    (e301,) = [e for e in read_history(run) if e.step == 301]
    assert e301.lr == lr_at(301, cfg.train)
