"""Audit-fork comparison: which branch converges, judged on the same held-out data for every branch.

Each branch's newest checkpoint is scored on one fixed validation batch per arm (the union of the
branches' arms, each split as the parent's sources split it, drawn from the parent's data config), so that
the branches differ only in what they learned. That held-out data is outside every branch's training
split only while every branch splits its arms as the parent does: a branch that changes the split
(data.val_fraction, data.max_source_bytes), or whose policy reads the held-out documents' files under
other identities (a wider folder: trained_on_held_out), is refused naming the branch and the arm, not
scored on data it trained on.

Every branch is scored at one step: the newest past the fork for which each of its runs has a valid
checkpoint (ConfigError names the run that falls short, and what to run, when there is none); every
column of the report is of that step.

A branch is one run, or `replicates` runs identical but for their data order (fork --replicates). The
leader has the lowest held-out loss (mean over its runs); the margin is its lead over the runner-up.
The noise of the margin has two parts: training (how much a run's held-out loss moves with its data
order: the spread of the replicates, pooled over the ranked branches) and held-out sampling (the
standard error of the paired per-sequence difference). The leader is the winner only when the margin
exceeds Student's t critical value (two-sided, LEVEL) times the noise; one run a branch measures no
training noise, so it names no winner; nor does a noise below NOISE_RESOLUTION (replicates that
scored the same: the verdict says so). The held-out batch is DEFAULT_VAL_SEQUENCES an arm unless
asked otherwise. Without a winner the verdict says what would decide it. A
branch in which the divergence guard acted after the fork did not train under its overrides alone:
it is shown with its events and ranked apart, never the winner. Training-loss figures (final, EMA,
spread) are reported beside it.

Every string that comes from an input (run URLs, branch, arm and policy names, overrides, error texts)
reaches the markdown report escaped (markdown_text, markdown_code): it is shown, never interpreted as a
link, an image or HTML.
"""

from __future__ import annotations

import dataclasses
import io
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from andrea_core.checkpoint import CheckpointError, restore
from andrea_core.config import ConfigError, RunConfig
from andrea_core.data.pipeline import DataPipeline
from andrea_core.data.policy import CORPUS_KINDS, ArmSpec, Policy, SourceUnavailable, load_policy, read_policy
from andrea_core.data.tokens import run_tokenizer
from andrea_core.model.gpt import GPT
from andrea_core.ops.fork import (
    DEFAULT_REPLICATES,
    MAX_REPLICATES,
    BranchSpec,
    check_destination,
    replicate_url,
)
from andrea_core.run.guard_events import GuardEvent, Remedies, event_of, read_events, remedy_text
from andrea_core.run.lineage import branch_of, phases
from andrea_core.run.loss_log import LossEntry, ema, ema_curve, read_history
from andrea_core.run.record import read_run
from andrea_core.run.rundir import RUN_YAML, RunDir
from andrea_core.train.optim import build_optimizer
from andrea_core.untrusted import markdown_code, markdown_text  # the one sanitizer; re-exported

LEVEL = 0.05  # the false-winner rate the verdict is calibrated to (two-sided: either branch may lead)
# A noise (or lead) at or below this is none: float32 losses near 2-8 nats are spaced 2.4e-7 to 9.5e-7,
# so a spread below a millionth of a nat is not a measurement (the verdict then names no winner).
NOISE_RESOLUTION = 1e-6
# The data settings that decide which tokens of an arm are held out: a branch must share the parent's.
SPLIT_FIELDS = ("val_fraction", "max_source_bytes")
UNTRAINED = "untrained: no checkpoint past the fork point"
TEST = (
    "two-sample t-test on the replicates' held-out means (training noise: their spread, pooled over "
    "the ranked branches) plus the held-out sampling noise of the paired per-sequence difference, "
    f"Student's t with the training part's degrees of freedom; two-sided, level {LEVEL:g}"
)


@dataclass
class RunScore:
    """One replicate run of a branch, scored at the comparison's step."""

    url: str
    replicate: int
    seed: int
    trained_to: int | None  # its newest checkpoint (valid or not)
    val_mean: float | None = None  # its held-out loss at the scored step (mean over arms)
    final_loss: float | None = None  # its training loss logged at the scored step
    per_sequence: np.ndarray | None = field(default=None, repr=False)  # its held-out loss per sequence


@dataclass
class BranchResult:
    name: str
    url: str  # replicate 0's run
    overrides: dict
    trained_to: int | None = None  # the step it is scored at (the comparison's common step)
    final_loss: float | None = None  # training loss logged at that step (mean over replicates)
    ema_loss: float | None = None  # EMA (alpha 0.05) of the training loss from the fork to that step
    train_noise: float | None = None  # std of the training loss over the last `window` steps to it
    val_loss: dict[str, float] = field(default_factory=dict)  # held-out loss per arm (replicate mean)
    val_mean: float | None = None  # mean over arms
    val_stderr: dict[str, float] = field(default_factory=dict)  # held-out sampling error of each arm's
    problem: str | None = None  # why the branch is out of the running
    # The divergence guard's events of the branch itself (guard.jsonl, after the fork point): a branch
    # that rolled back trained a remedied timeline (batches skipped, a cooled learning rate).
    guard_events: list[dict] = field(default_factory=list)
    # Not None: the guard acted in this branch after the fork, so it did not train under its overrides
    # alone; what it trained under instead (ranked apart from the others, never the winner).
    diverged: str | None = None
    # The remedies in force on the scored timeline (guard_events.Remedies: a later rollback to an
    # earlier step abandons an earlier one's): the settings the branch trained under after its events.
    trained_under: list[str] = field(default_factory=list)
    replicates: int = 1
    replicate_val: list[float] = field(default_factory=list)  # held-out mean of each replicate
    runs: list[RunScore] = field(default_factory=list)
    history: list[LossEntry] = field(default_factory=list, repr=False)
    per_sequence: np.ndarray | None = field(default=None, repr=False)  # held-out loss per sequence


@dataclass
class Comparison:
    parent: str
    fork_step: int
    arms: list[str]
    val_sequences: int  # per arm
    block_size: int
    branches: list[BranchResult]
    step: int | None = None  # the one step every branch is scored at (every column is of it)
    winner: str | None = None  # the leader, only when its margin is beyond the noise
    leader: str | None = None  # the lowest held-out loss, winner or not
    runner_up: str | None = None
    margin: float | None = None
    noise: float | None = None  # the standard error of the margin: both parts below together
    noise_held_out: float | None = None  # held-out sampling: the paired per-sequence difference's
    noise_training: float | None = None  # training (data order): from the replicates' spread
    df: int | None = None  # degrees of freedom of the training noise's estimate
    df_held_out: int | None = None  # of the held-out part's (held-out sequences - 1)
    df_effective: float | None = None  # the t test's: the training part's (conservative)
    critical: float | None = None  # the margin must exceed critical x noise to name a winner
    test: str = TEST
    level: float = LEVEL
    significant: bool = False
    verdict: str = ""
    to_decide: str | None = None  # when there is no winner: what would decide it, with numbers
    parent_history: list[LossEntry] = field(default_factory=list, repr=False)
    pivots: list[tuple[int, int]] = field(default_factory=list)  # the parent's (phase, boundary step)

    def branch(self, name: str) -> BranchResult:
        return next(b for b in self.branches if b.name == name)

    def to_dict(self) -> dict:
        """Plain JSON-able summary (no histories or per-sequence arrays)."""
        skip = {"history", "per_sequence", "parent_history", "pivots"}
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in skip}
        out["branches"] = [
            {k: v for k, v in dataclasses.asdict(b).items() if k not in skip} for b in self.branches
        ]
        for b in out["branches"]:
            b["runs"] = [{k: v for k, v in r.items() if k != "per_sequence"} for r in b["runs"]]
        return out


# --- the test's arithmetic ------------------------------------------------------------------------


def t_sf(t: float, df: float) -> float:
    """P(T > t) for Student's t with `df` degrees of freedom (Simpson's rule over its density)."""
    if t < 0:
        return 1.0 - t_sf(-t, df)
    if math.isinf(t):
        return 0.0
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    # Integrate the density over [0, t] in the variable u = atan(x): smooth and bounded for any t.
    top, n = math.atan(t), 400
    h = top / n

    def f(u: float) -> float:
        x = math.tan(u)
        return math.exp(log_c - (df + 1) / 2 * math.log1p(x * x / df)) * (1 + x * x)

    total = f(0) + f(top) + sum((4 if i % 2 else 2) * f(i * h) for i in range(1, n))
    return max(0.0, 0.5 - total * h / 3)


def t_critical(df: float, level: float = LEVEL) -> float:
    """The two-sided critical value: P(|T| > c) = level for Student's t with `df` degrees of freedom."""
    lo, hi = 0.0, 1.0
    while t_sf(hi, df) > level / 2:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_sf(mid, df) > level / 2 else (lo, mid)
    return (lo + hi) / 2


def verdict_test(
    margin: float, noise_training: float, df: int, noise_held_out: float, df_held_out: int
) -> tuple[float, float, float, bool]:
    """(noise, degrees of freedom, critical value, significant) of a margin whose noise is training
    (`df` degrees of freedom) and held-out sampling (`df_held_out`): a winner when the margin exceeds
    Student's t two-sided LEVEL critical value times the noise. The t is the training part's df, not
    the Welch-Satterthwaite combination of both (between df and df + df_held_out): measured on 40 A/A
    forks (bench/README.md) that named 3 false winners at 256 held-out sequences, this 1."""
    noise = math.hypot(noise_training, noise_held_out)
    df_effective = float(df)
    critical = t_critical(df_effective)
    return noise, df_effective, critical, margin > critical * noise


def pooled_training_variance(branches: list[BranchResult]) -> tuple[float | None, int]:
    """The variance of one run's held-out loss over data orders, pooled over `branches`' replicates,
    and its degrees of freedom (sum of replicates - 1); (None, 0) when no branch has two."""
    ss = sum(float(np.sum((np.array(b.replicate_val) - np.mean(b.replicate_val)) ** 2)) for b in branches)
    df = sum(len(b.replicate_val) - 1 for b in branches)
    return (ss / df if df else None), df


def evaluation_policy(policies: list[Policy], parent: Policy | None = None) -> Policy:
    """Every arm any branch draws from, without floors or caps: the held-out data is per arm, and the
    bounds only matter for sampling training batches. An arm the parent has is held out as the
    parent's sources split it (its spec, whatever a branch's says); an arm new in the branches, as the
    first branch that has it (check_held_out refuses any other branch that splits it differently)."""
    parents = {a.name: a for a in parent.arms} if parent is not None else {}
    arms: dict[str, ArmSpec] = {}
    for policy in policies:
        for arm in policy.arms:
            spec = parents.get(arm.name, arm)
            arms.setdefault(arm.name, dataclasses.replace(spec, floor=0.0, cap=1.0))
    return Policy(name="audit-evaluation", arms=list(arms.values()), mixer="uniform")


def held_out_differences(parent: RunConfig, branch: RunConfig) -> list[str]:
    """The data settings in which `branch` splits its arms differently from `parent`: each one moves the
    held-out tail of an arm, so that part of the parent's held-out data is in the branch's training set."""
    return [
        f"data.{name} {getattr(branch.data, name)!r} (the parent's is {getattr(parent.data, name)!r})"
        for name in SPLIT_FIELDS
        if getattr(branch.data, name) != getattr(parent.data, name)
    ]


def _listed(arm: ArmSpec) -> list | None:
    from andrea_core.data.corpora import list_files

    try:
        return list_files(arm)
    except SourceUnavailable:
        return None


def _source_files(arm: ArmSpec) -> list:
    from andrea_core.data.sources import open_source

    try:
        return open_source(arm, 1).files
    except SourceUnavailable:
        return []


def trained_on_held_out(held: ArmSpec, arm: ArmSpec, val_fraction: float) -> str | None:
    """How a branch's arm `arm` trains on documents that the evaluation holds out of arm `held`, or
    None if it trains on none of them. A document is held out by the hash of its identity (its file's
    path relative to the arm's path, and its index), so an arm that reads the same file under another
    path (a wider folder, say) splits that file's documents differently; a built-in arm is held out
    as the tail of its token stream, which another list of files moves."""
    from andrea_core.data.corpora import READERS, is_validation

    if arm.kind != held.kind:
        return None
    if held.kind not in CORPUS_KINDS:
        if (arm.paths, arm.packages) == (held.paths, held.packages):
            return None  # the same list of files: the same tail held out
        shared = set(_source_files(held)) & set(_source_files(arm))
        if not shared:
            return None
        return (
            f"reads {len(shared)} of the files of held-out arm {held.name!r} ({held.kind}) in another list "
            "of files, which moves the held-out tail of its token stream"
        )
    if held.kind == "tokens" or (arm.field, arm.column) != (held.field, held.column):
        return None  # shards split by their names; another field or column is another text
    held_files, arm_files = _listed(held), _listed(arm)
    if not held_files or not arm_files:
        return None  # no documents: nothing held out, or nothing trained on
    rel = {f.url: f.rel for f in held_files}
    moved = [f for f in arm_files if f.url in rel and rel[f.url] != f.rel]
    if held.kind == "text":  # one document per file: counted exactly, cheaply
        held_out = [f for f in held_files if is_validation(f"{f.rel}:0", val_fraction)]
        trained = [f for f in moved if is_validation(f"{rel[f.url]}:0", val_fraction)
                   and not is_validation(f"{f.rel}:0", val_fraction)]  # fmt: skip
        if not trained:
            return None
        return (
            f"trains on {len(trained)} of the {len(held_out)} held-out documents of arm {held.name!r} "
            f"(it reads {trained[0].url} as {trained[0].rel}, held out as {rel[trained[0].url]})"
        )
    for f in moved:  # many documents per file: the first one trained on is proof enough
        for rec in READERS[held.kind](held, 0, f, 0):
            if rec.bad:
                continue
            if is_validation(f"{rel[f.url]}:{rec.index}", val_fraction) and not is_validation(
                f"{f.rel}:{rec.index}", val_fraction
            ):
                return (
                    f"trains on held-out documents of arm {held.name!r} (first: record {rec.index} of "
                    f"{f.url}, held out as {rel[f.url]}:{rec.index}, trained on as {f.rel}:{rec.index})"
                )
    return None


def check_held_out(
    parent: RunConfig,
    branches: dict[str, RunConfig],
    policies: dict[str, Policy] | None = None,
    parent_policy: Policy | None = None,
) -> None:
    """Refuse branches that would be scored on data they trained on: a branch that splits the data
    differently (held_out_differences), or whose arms (`policies`) train on documents the evaluation
    holds out (trained_on_held_out), named with the arm."""
    problems = [f"branch {name!r}: {', '.join(d)}" for name, cfg in branches.items()
                if (d := held_out_differences(parent, cfg))]  # fmt: skip
    if problems:
        raise ConfigError(
            "an audit fork scores every branch on the parent's held-out split, and these branches split "
            f"the data differently (they would be scored on data they trained on): {'; '.join(problems)}"
        )
    if not policies:
        return
    evaluated = evaluation_policy(list(policies.values()), parent_policy)
    for name, policy in policies.items():
        for arm in policy.arms:
            for held in evaluated.arms:
                why = trained_on_held_out(held, arm, parent.data.val_fraction)
                if why is not None:
                    problems.append(f"branch {name!r}: its arm {arm.name!r} {why}")
    if problems:
        raise ConfigError(
            "an audit fork scores every branch on held-out documents no branch trained on, and these "
            f"branches train on some of them: {'; '.join(problems)}; give the branch a policy whose "
            "arms read those files under the parent's paths"
        )


MAX_VAL_SEQUENCES = 4096  # per arm: held-out scoring runs every branch's model over all of them
# Per arm, on the default path (`andrea compare`, the audit-fork flow): at 3 replicates a branch, 32
# left the held-out part of the noise (±0.012) near the training part (±0.015) and told the lr-1e-4
# fork apart in 17 of 20; 256 (±0.004) in 20 of 20, A/A false winners 1 of 40 at both (bench/README.md,
# verdict_calibration.py). It costs scoring only: forward passes, no training.
DEFAULT_VAL_SEQUENCES = 256
# Logits held at once while scoring (sequences x block x vocab, float32: 1 GiB): the held-out batch is
# scored in chunks of sequences, whatever its size (256 x 1024 x 22,528 at 120M would be 24 GiB at once).
LOGITS_AT_ONCE = 1 << 28


def check_audit(
    parent_url: str,
    branches: list[BranchSpec],
    steps: object,
    val_sequences: object,
    report_dir: str | None,
) -> None:
    """Everything an audit fork's parameters can get wrong, checked before it writes anything: the
    step counts, the report's destination, each branch's config, and that no branch moves the held-out
    split it will be scored on."""
    for name, value, top in (("steps", steps, None), ("val_sequences", val_sequences, MAX_VAL_SEQUENCES)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1 or (top and value > top):
            bound = f"1..{top}" if top else ">= 1"
            raise ConfigError(f"{name}: expected a whole number {bound}, got {value!r}")
    if report_dir is not None:
        check_destination(report_dir, "report_dir")
    parent_run = RunDir(parent_url)
    parent = read_run(parent_run).config
    configs = {b.name: parent.with_overrides(b.overrides, f"branch {b.name!r}") for b in branches}
    in_force = read_policy(parent_run)
    policies = {
        b.name: load_policy(configs[b.name].data.policy)[0] if "data.policy" in b.overrides else in_force
        for b in branches
    }
    check_held_out(parent, configs, policies, in_force)


def default_report_dir(parent_url: str, fork_step: int) -> str:
    """Beside the parent, in the runs folder: "<run>-fork<step>-report"."""
    return f"{RunDir(parent_url).url.rstrip('/')}-fork{fork_step}-report"


@torch.no_grad()
def sequence_losses(model: GPT, x: torch.Tensor, y: torch.Tensor) -> np.ndarray:
    """Each sequence's mean token loss, scored in chunks of at most LOGITS_AT_ONCE logits."""
    chunk = max(1, LOGITS_AT_ONCE // (y.shape[1] * model.cfg.vocab_size))
    out = []
    for i in range(0, y.shape[0], chunk):
        logits, _ = model(x[i : i + chunk])
        yi = y[i : i + chunk]
        per_token = F.cross_entropy(logits.float().flatten(0, 1), yi.flatten(), reduction="none")
        out.append(per_token.view(yi.shape).mean(dim=1).double().numpy())
    return np.concatenate(out)


def compare_branches(
    parent_url: str,
    branch_urls: list[str],
    fork_step: int,
    *,
    val_sequences: int = DEFAULT_VAL_SEQUENCES,
    window: int = 50,
    failed: dict[str, str] | None = None,
    warn: Callable[[str], None] = print,
) -> Comparison:
    """Score every branch on the same held-out batches, at one step, and name the one that converges.

    `branch_urls` are runs of one fork; a branch forked with replicates is all its replicates (those
    not named are found beside replicate 0: expand_replicates). Every branch is scored at the newest
    step each of its runs has a valid checkpoint for (or ConfigError names the one that falls short
    and what to run). `failed` maps branch names to why their trainer did not finish (they are
    reported, not ranked), as does a branch in which the divergence guard acted (`diverged`)."""
    parent = RunDir(parent_url)
    parent_cfg = read_run(parent).config
    groups = expand_replicates(branch_urls)
    runs = [run for members in groups.values() for run, _ in members]
    records = {run.url: read_run(run) for run in runs}
    firsts = {name: members[0][0] for name, members in groups.items()}
    policies = {name: read_policy(run) for name, run in firsts.items()}
    parent_policy = read_policy(parent)
    check_held_out(parent_cfg, {n: records[r.url].config for n, r in firsts.items()}, policies, parent_policy)
    policy = evaluation_policy(list(policies.values()), parent_policy)
    data = DataPipeline(parent_cfg, policy, warn, run_tokenizer(parent, parent_cfg))
    arms = list(data.arms)
    batches = {arm: data.val_batch(arm, val_sequences) for arm in arms}

    torch.manual_seed(0)
    model = GPT(parent_cfg.model)
    optimizer = build_optimizer(model, parent_cfg.train, "cpu")  # restore() fills m and v too
    model.eval()

    results: list[BranchResult] = []
    for name, members in groups.items():
        first = members[0][0]
        result = BranchResult(name, first.url, dict(records[first.url].lineage.get("overrides") or {}))
        result.replicates = len(members)
        for run, replicate in members:
            steps = run.checkpoint_steps(warn=warn)
            seed = records[run.url].config.train.seed
            result.runs.append(RunScore(run.url, replicate, seed, steps[-1] if steps else None))
            events = [e for e in read_events(run, warn=warn) if is_own_event(e, fork_step)]
            result.guard_events += [{**asdict(e), "replicate": replicate} for e in events]
            who = f"replicate {replicate}: " if len(members) > 1 else ""
            result.trained_under += [who + remedy_text(e) for e in Remedies(events).active]
        stops = [e for e in result.guard_events if e["action"] == "stop"]
        if failed and name in failed:
            result.problem = failed[name]
        elif stops:  # its divergence is its result: not scored, and no limit on the others' common step
            result.problem = f"diverged at step {stops[0]['step']} ({stops[0]['kind']}): the guard stopped it"
        elif all(r.trained_to is None or r.trained_to <= fork_step for r in result.runs):
            result.problem = UNTRAINED
        result.diverged = diverged_summary(result)
        results.append(result)

    comparison = Comparison(parent.url, fork_step, arms, val_sequences, parent_cfg.model.block_size, results)
    scored = [b for b in results if b.problem is None]
    if scored:
        comparison.step = _score_at_common_step(scored, fork_step, model, optimizer, batches, arms, warn)
    for b in results:
        _training_figures(b, comparison.step, fork_step, window)
    comparison.parent_history = [e for e in read_history(parent) if e.step <= fork_step]
    comparison.pivots = phases(parent)
    _name_winner(comparison)
    return comparison


def expand_replicates(branch_urls: list[str]) -> dict[str, list[tuple[RunDir, int]]]:
    """The runs of each branch named by `branch_urls`, replicate 0 first: a run's lineage says which
    branch and replicate it is (lineage.branch_of, checked); the replicates a fork made that are not
    named are taken from beside replicate 0 (fork.replicate_url). A replicate missing, named twice,
    or of another branch is refused naming it."""
    groups: dict[str, dict[int, RunDir]] = {}
    counts: dict[str, int] = {}
    for url in branch_urls:
        run = RunDir(url)
        of = branch_of(run)
        name = of.name or run.url.rstrip("/").rsplit("/", 1)[-1]
        if counts.setdefault(name, of.replicates) != of.replicates:
            raise ConfigError(
                f"{run.url}: branch {name!r} has runs of {counts[name]} and {of.replicates} replicates"
            )
        if groups.setdefault(name, {}).get(of.replicate, run).url != run.url:
            raise ConfigError(
                f"{run.url}: replicate {of.replicate} of branch {name!r} is named twice "
                f"(also {groups[name][of.replicate].url})"
            )
        groups[name][of.replicate] = run
    out = {}
    for name, found in groups.items():
        if 0 not in found:
            raise ConfigError(f"branch {name!r}: name its replicate 0 (its own run directory) to compare it")
        for r in range(1, counts[name]):
            if r not in found:
                run = RunDir(replicate_url(found[0].url, r))
                if not run.exists(RUN_YAML):
                    raise ConfigError(
                        f"branch {name!r}: replicate {r} of {counts[name]} is missing ({run.url}): rerun the "
                        "fork (same step and branch names) to complete it"
                    )
                of = branch_of(run)
                if (of.name, of.replicate) != (name, r):
                    raise ConfigError(f"{run.path(RUN_YAML)}: not replicate {r} of branch {name!r}")
                found[r] = run
        out[name] = [(found[r], r) for r in sorted(found)]
    return out


def diverged_summary(b: BranchResult) -> str | None:
    """What a branch in which the divergence guard acted after the fork trained under instead of its
    overrides alone (run/guard_events.Remedies: the learning rate's factor and from which step), in
    words; None when the guard never acted there."""
    if not b.guard_events:
        return None
    parts = []
    for e in b.guard_events:
        who = f"replicate {e['replicate']} " if b.replicates > 1 else ""
        if e["action"] == "rollback":
            parts.append(
                f"{who}diverged at step {e['step']} ({e['kind']}), rolled back to {e['rolled_back_to']}: "
                + remedy_text(event_of(e))
            )
        else:
            parts.append(f"{who}diverged at step {e['step']} ({e['kind']}): the guard stopped it")
    return "; ".join(parts)


def _score_at_common_step(
    scored: list[BranchResult],
    fork_step: int,
    model: GPT,
    optimizer: torch.optim.Optimizer,
    batches: dict,
    arms: list[str],
    warn: Callable[[str], None],
) -> int:
    """Score every run of `scored` at the newest step past the fork for which each of them has a valid
    checkpoint; return that step. None such: ConfigError names the run that falls short and what to run."""
    runs = [(b, r) for b in scored for r in b.runs]
    listed = {r.url: {s for s in RunDir(r.url).checkpoint_steps() if s > fork_step} for _, r in runs}
    common = sorted(set.intersection(*listed.values()), reverse=True)
    for step in common:
        per_run: dict[str, dict[str, np.ndarray]] = {}
        for _, r in runs:
            try:
                ckpt = RunDir(r.url).read_checkpoint(step, model.n_params)
            except CheckpointError as e:
                warn(f"refusing checkpoint {e}; scoring every branch at an earlier common step")
                break
            restore(ckpt, model, optimizer)
            per_run[r.url] = {arm: sequence_losses(model, *batches[arm]) for arm in arms}
        else:
            for b in scored:
                scores = [per_run[r.url] for r in b.runs]
                for r, sc in zip(b.runs, scores, strict=True):
                    r.val_mean = float(np.mean([v.mean() for v in sc.values()]))
                    r.per_sequence = np.concatenate([sc[arm] for arm in arms])
                b.replicate_val = [r.val_mean for r in b.runs]
                mean = {arm: np.mean([sc[arm] for sc in scores], axis=0) for arm in arms}
                b.val_loss = {arm: float(v.mean()) for arm, v in mean.items()}
                b.val_stderr = {arm: float(v.std(ddof=1) / math.sqrt(v.size)) if v.size > 1 else 0.0
                                for arm, v in mean.items()}  # fmt: skip
                b.val_mean = float(np.mean(list(b.val_loss.values())))
                b.per_sequence = np.concatenate([mean[arm] for arm in arms])
            return step
    newest = {url: max(steps, default=None) for url, steps in listed.items()}
    target = max(s for s in newest.values() if s is not None)
    short = [(b, r) for b, r in runs if newest[r.url] != target]
    name = lambda b, r: b.name if b.replicates == 1 else f"{b.name} (replicate {r.replicate})"  # noqa: E731
    held = "; ".join(f"{name(b, r)} holds {sorted(listed[r.url]) or 'none'}" for b, r in runs)
    if not short:  # every run lists the same newest, and no step common to all reads back valid
        raise ConfigError(
            f"compare: no step past the fork point {fork_step} has a valid checkpoint in every branch "
            f"({held}; the refused ones are named above): train the branches on to a new checkpoint"
        )
    raise ConfigError(
        f"compare: no step past the fork point {fork_step} has a valid checkpoint in every branch ({held}); "
        f"{', '.join(name(b, r) for b, r in short) or 'a branch'} falls short of step {target}: run "
        + "; ".join(f"andrea train --run-dir {r.url} --max-steps {target}" for _, r in short)
    )


def _training_figures(b: BranchResult, step: int | None, fork_step: int, window: int) -> None:
    """The training-loss columns of `b`, of the scored `step` (every replicate's history up to it)."""
    histories = []
    for r in b.runs:
        history = [
            e for e in read_history(RunDir(r.url)) if e.step > fork_step and (step is None or e.step <= step)
        ]
        histories.append(history)
        r.final_loss = history[-1].loss if history and (step is None or history[-1].step == step) else None
    b.history = histories[0] if histories else []
    losses = [e.loss for e in b.history]
    finals = [r.final_loss for r in b.runs if r.final_loss is not None]
    if finals:
        b.final_loss = float(np.mean(finals))
    if losses:
        emas = [ema([e.loss for e in h]) for h in histories if h]
        b.ema_loss = float(np.mean(emas))
        b.train_noise = float(np.std(losses[-window:], ddof=1)) if len(losses) > 1 else None
    b.trained_to = step if b.val_mean is not None else None


def _name_winner(c: Comparison) -> None:
    """The verdict: the leader is the winner only when its margin over the runner-up exceeds the
    two-sided t critical value times the noise, whose parts are held-out sampling and training."""
    ranked = [b for b in c.branches if b.problem is None and b.diverged is None and b.val_mean is not None]
    ranked.sort(key=lambda b: b.val_mean)
    apart = [b for b in c.branches if b.problem is None and b.diverged is not None]
    aside = (
        " (not ranked, the divergence guard changed how they trained: "
        + "; ".join(f"{b.name}: {b.diverged}" for b in apart)
        + ")"
        if apart
        else ""
    )
    if not ranked:
        why = [f"{b.name}: {b.problem or 'diverged: ' + str(b.diverged)}" for b in c.branches]
        c.verdict = "no branch could be evaluated: " + "; ".join(why)
        return
    best = ranked[0]
    c.leader = best.name
    if len(ranked) == 1:
        c.verdict = (
            f"no winner: {best.name} is the only branch that trained (held-out loss {best.val_mean:.4f}), "
            f"nothing to compare it with{aside}"
        )
        return
    second = ranked[1]
    diff = second.per_sequence - best.per_sequence  # paired: the same held-out sequences
    c.runner_up = second.name
    c.margin = float(second.val_mean - best.val_mean)
    c.noise_held_out = float(diff.std(ddof=1) / math.sqrt(diff.size))
    c.df_held_out = diff.size - 1
    variance, c.df = pooled_training_variance(ranked)
    figures = (
        f"held-out loss {best.val_mean:.4f} vs {second.val_mean:.4f} for {second.name} at step {c.step}; "
        f"margin {c.margin:.4f}"
    )
    if variance is None:
        c.noise = c.noise_held_out
        errors = (
            f"{c.margin / c.noise:.1f} held-out standard errors"
            if c.noise > NOISE_RESOLUTION
            else f"the same lead on every one of the {diff.size} held-out sequences"
        )
        c.verdict = (
            f"no winner: training noise unmeasured ({best.name} leads: {figures}, {errors}, but one run "
            f"a branch cannot tell a better setting from a luckier data order){aside}"
        )
        c.to_decide = (
            f"fork again with --replicates {DEFAULT_REPLICATES} (each branch trained {DEFAULT_REPLICATES} "
            "times over other data orders; the verdict's test needs two or more runs a branch)"
        )
        c.verdict += "; " + c.to_decide
        return
    c.noise_training = math.sqrt(variance * (1 / len(best.replicate_val) + 1 / len(second.replicate_val)))
    c.noise, c.df_effective, c.critical, c.significant = verdict_test(
        c.margin, c.noise_training, c.df, c.noise_held_out, c.df_held_out
    )
    if c.noise <= NOISE_RESOLUTION:
        _no_noise(c, best, second, figures, aside)
        return
    ratio = c.margin / c.noise
    figures += (
        f", noise ±{c.noise:.4f} (training ±{c.noise_training:.4f} from {best.replicates}+"
        f"{second.replicates} replicates, held-out ±{c.noise_held_out:.4f}): {ratio:.1f} standard errors, "
        f"a winner needs {c.critical:.2f}"
    )
    if c.significant:
        c.winner = best.name
        c.verdict = f"{best.name} converges best: {figures}{aside}"
        return
    c.to_decide = what_would_decide(c, variance, len(ranked))
    c.verdict = f"no winner: within noise ({best.name} leads: {figures}){aside}; {c.to_decide}"


def _no_noise(c: Comparison, best: BranchResult, second: BranchResult, figures: str, aside: str) -> None:
    """No noise measured (below NOISE_RESOLUTION): every replicate of each ranked branch scored the
    same, and the lead is the same on every held-out sequence. A t-test would divide by zero (a lead of
    any size "infinitely" significant, or none at all); replicates that agree to the last bit did not
    train on different data orders, so the verdict names no winner and says so."""
    c.significant = False
    if c.margin <= NOISE_RESOLUTION:
        c.verdict = (
            f"no winner: {best.name} and {second.name} scored the same (held-out loss {best.val_mean:.4f} at "
            f"step {c.step}, on every held-out sequence and in every replicate): nothing tells them apart"
            f"{aside}"
        )
        c.to_decide = (
            "if they should differ, check the branches' overrides; replicates that score the same did not "
            "train on different data orders (check each replicate's train.seed)"
        )
    else:
        c.verdict = (
            f"no winner: no noise measured ({best.name} leads: {figures}; the replicates of each branch "
            f"scored the same, {best.replicates}+{second.replicates} of them, and the lead is the same on "
            f"every one of the {second.per_sequence.size} held-out sequences, so the test has nothing to "
            f"weigh it against){aside}"
        )
        c.to_decide = (
            "replicates that score the same did not train on different data orders: check each "
            "replicate's train.seed, and fork again with replicates whose data orders differ"
        )
    c.verdict += "; " + c.to_decide


def what_would_decide(c: Comparison, variance: float, n_ranked: int) -> str:
    """In words, with numbers: the margin this noise needs, and the replicates (same margin and
    spread) or held-out sequences that would make the present margin decisive."""
    needed = c.critical * c.noise
    out = [f"a lead of {needed:.4f} would be decisive at this noise"]
    k = c.df // n_ranked + 1  # replicates a branch now
    if c.margin > 0:
        for more in range(k + 1, MAX_REPLICATES + 1):
            training = math.sqrt(variance * 2 / more)
            if verdict_test(c.margin, training, n_ranked * (more - 1), c.noise_held_out, c.df_held_out)[3]:
                out.append(f"at this lead and spread, {more} replicates a branch would decide it")
                break
        else:
            out.append(f"not even {MAX_REPLICATES} replicates a branch would, at this lead")
    if c.noise_held_out > c.noise_training:
        out.append(
            "held-out sampling is the larger part: --val-sequences "
            f"{min(4 * c.val_sequences, MAX_VAL_SEQUENCES)} halves it"
        )
    out.append("or train longer, if the lead grows with the steps")
    return "; ".join(out)


# --- the report ------------------------------------------------------------------------------------


def plot_text(text: str) -> str:
    """An input-derived string as matplotlib shows it literally: "$" would start mathtext (a forged
    name such as "$\\undefinedcommand$" makes savefig raise) and a leading "_" hides a legend entry."""
    text = text.replace("$", r"\$")
    return " " + text if text.startswith("_") else text


def legend_label(c: Comparison, b: BranchResult) -> str:
    """A branch's name in the plot (plot_text): "(winner)" only for a winner beyond the noise,
    "(diverged)" for a branch the divergence guard acted in (ranked apart)."""
    name = plot_text(b.name)
    if b.diverged is not None:
        return f"{name} (diverged)"
    return f"{name} (winner)" if b.name == c.winner else name


def plot_comparison(c: Comparison) -> bytes:
    """PNG: training loss around the fork for the parent and every branch, and held-out loss per arm."""
    import matplotlib.pyplot as plt

    fig = comparison_figure(c)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def comparison_figure(c: Comparison):
    """The figure of `plot_comparison` (its data can be read back from its axes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.6), dpi=100, gridspec_kw={"width_ratios": [3, 2]})
    span = max((len(b.history) for b in c.branches), default=0)
    lead_in = [e.loss for e in c.parent_history]
    lead_smooth = ema_curve(lead_in)
    shown = [i for i, e in enumerate(c.parent_history) if e.step > c.fork_step - max(3 * span, 50)]
    if shown:
        steps = [c.parent_history[i].step for i in shown]
        ax.plot(steps, [lead_smooth[i] for i in shown], color="0.4", lw=1.6, label="parent")
    for i, b in enumerate(c.branches):
        if not b.history:
            continue
        color = f"C{i}"
        steps, losses = [e.step for e in b.history], [e.loss for e in b.history]
        # Continue the parent's EMA, so that every branch's curve leaves the fork point from the same value.
        smooth = ema_curve(losses, start=lead_smooth[-1]) if lead_smooth else ema_curve(losses)
        ax.plot(steps, losses, color=color, lw=0.6, alpha=0.35)
        ax.plot(steps, smooth, color=color, lw=1.8, label=legend_label(c, b))
        # The guard's events of replicate 0 (the curve drawn): a marker each, no text, so that any
        # number of them stays legible; which they were is in the report's table.
        at = {e.step: v for e, v in zip(b.history, smooth, strict=True)}
        marks = [e["step"] for e in b.guard_events if e.get("replicate", 0) == 0 and e["step"] in at]
        if marks:
            ax.plot(marks, [at[m] for m in marks], ls="none", marker="x", ms=7, mew=2, color=color)
    ax.axvline(c.fork_step, color="0.5", ls="--", lw=1)
    for _, boundary in c.pivots:
        if shown and c.parent_history[shown[0]].step <= boundary < c.fork_step:
            ax.axvline(boundary, color="0.6", ls=":", lw=1)
            ax.annotate("pivot", (boundary, 1), xycoords=("data", "axes fraction"), fontsize=8, color="0.4",
                        xytext=(2, -10), textcoords="offset points")  # fmt: skip
    ax.set(xlabel="step", ylabel="training loss (EMA 0.05; raw faint)", title=f"fork at step {c.fork_step}")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # none before any branch (or the parent's lead-in) has a step
        ax.legend(fontsize=8)

    scored = [b for b in c.branches if b.val_loss]
    width = 0.8 / max(len(scored), 1)
    x = np.arange(len(c.arms))
    for i, b in enumerate(scored):
        bx.bar(
            x + i * width,
            [b.val_loss[a] for a in c.arms],
            width,
            # The noise the verdict weighs the margin against: each bar's standard error.
            yerr=[b.val_stderr.get(a, 0.0) for a in c.arms],
            capsize=3,
            label=legend_label(c, b),
            color=f"C{c.branches.index(b)}",
        )
    bx.set_xticks(x + width * (len(scored) - 1) / 2, c.arms, fontsize=8)
    title = "held-out loss per arm (same batches; bars: ±1 held-out sampling standard error)"
    if c.margin is not None and c.noise is not None:
        needs = f"winner needs > {c.critical:.2f}x" if c.critical else "training noise unmeasured: no winner"
        title += f"\npaired margin {c.margin:.4f} vs noise ±{c.noise:.4f} at step {c.step} ({needs})"
    bx.set(ylabel="held-out loss")
    bx.set_title(title, fontsize=9)
    lows = [v - b.val_stderr.get(a, 0.0) for b in scored for a, v in b.val_loss.items()]
    highs = [v + b.val_stderr.get(a, 0.0) for b in scored for a, v in b.val_loss.items()]
    if lows:
        bx.set_ylim(min(lows) * 0.97, max(highs) * 1.02)
    bx.grid(axis="y", alpha=0.3)
    if scored:  # no bars before a branch was audited
        bx.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _fmt(v: float | None, digits: int = 4) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def headline(c: Comparison) -> str:
    if c.winner:
        return f"**Winner: {markdown_code(c.winner)}**."
    if c.margin is not None and c.critical and c.noise is not None and c.noise <= NOISE_RESOLUTION:
        return "**No winner: no noise measured.**"
    if c.margin is not None:
        return "**No winner: within noise.**" if c.critical else "**No winner: training noise unmeasured.**"
    return "**No winner.**"


def guard_lines(b: BranchResult) -> list[str]:
    """Each of a branch's own divergence-guard events, in words (the settings it trained under after)."""
    out = []
    for e in b.guard_events:
        who = f" (replicate {e['replicate']})" if b.replicates > 1 else ""
        if e["action"] == "rollback":
            what = f"rolled back to step {e['rolled_back_to']}: {remedy_text(event_of(e))}"
        else:
            what = "stopped (the guard's bound was reached)"
        out.append(f"{e['kind']} at step {e['step']}{who}: {what}")
    return out


def report_markdown(c: Comparison, plot_src: str | None = None) -> str:
    """The audit report: verdict first, then the figures behind it, the noise's parts and the test.
    `plot_src` is an image URL or a data URI (the Prefect UI shows data URIs inside markdown
    artifacts). Every input-derived string is escaped (markdown_text, markdown_code)."""
    at = f"step {c.step}" if c.step is not None else "no step"
    lines = [
        f"# Audit fork of {markdown_code(c.parent)} at step {c.fork_step}",
        "",
        f"{headline(c)} {markdown_text(c.verdict)}",
        "",
        f"Every column is of {at}: the newest step past the fork for which every run of every ranked "
        "branch has a valid checkpoint.",
        "",
        "| branch | overrides | runs (held-out each) | scored at | final loss | EMA loss | loss spread | "
        "held-out loss | " + " | ".join(f"held-out {markdown_code(a, in_table=True)}" for a in c.arms) + " |",
        "|---" * (8 + len(c.arms)) + "|",
    ]
    for b in c.branches:
        overrides = (
            ", ".join(markdown_code(f"{k}={v}", in_table=True) for k, v in b.overrides.items()) or "(none)"
        )
        name = markdown_text(b.name)
        if b.name == c.winner:
            name = f"**{name}**"
        if b.problem:
            name += f" ({markdown_text(b.problem)})"
        elif b.diverged:
            name += " (diverged: ranked apart)"
        each = ", ".join(_fmt(v) for v in b.replicate_val)
        cells = [
            name,
            overrides,
            f"{b.replicates}" + (f": {each}" if each else ""),
            str(b.trained_to) if b.trained_to is not None else "n/a",
            _fmt(b.final_loss),
            _fmt(b.ema_loss),
            _fmt(b.train_noise),
            _fmt(b.val_mean),
            *(_fmt(b.val_loss.get(a)) for a in c.arms),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    trained = ", ".join(
        f"{markdown_text(b.name)}{'' if b.replicates == 1 else f' r{r.replicate}'} {r.trained_to}"
        for b in c.branches
        for r in b.runs
    )
    lines += [
        "",
        f"Trained to (newest checkpoint of each run): {trained}. Final and EMA loss: the training loss "
        f"logged at {at} and its EMA from the fork to it (means over a branch's runs); loss spread: the "
        "standard deviation of the training loss over its last 50 steps.",
        "",
        f"Held-out data: {c.val_sequences} sequences of {c.block_size} tokens from the validation split of "
        f"each arm under the parent's data settings, the same for every branch. No branch trained on it: "
        f"every branch splits its arms as the parent does (a branch that changes "
        f"{' or '.join('data.' + f for f in SPLIT_FIELDS)}, or whose arms read the held-out documents' "
        f"files under other paths, is refused).",
        "",
        "| the verdict's noise | standard error |",
        "|---|---|",
        "| held-out sampling (paired per-sequence difference, leader vs runner-up) | "
        f"{_fmt(c.noise_held_out)} |",
        f"| training (data order: the replicates' spread, {c.df or 0} degrees of freedom) | "
        f"{_fmt(c.noise_training) if c.df else 'unmeasured (one run a branch)'} |",
        f"| both (the margin's standard error) | {_fmt(c.noise)} |",
        "",
        f"Margin: the runner-up's held-out loss minus the leader's ({_fmt(c.margin)}). Test: {c.test}: "
        + (
            f"a winner when the margin exceeds {c.critical:.2f}x the noise (Student's t, {c.df} degrees of "
            f"freedom, the training part's; the held-out part's {c.df_held_out} are not counted), so that "
            f"branches differing only in their data order name one in at most {c.level:.0%} of forks."
            if c.critical
            else "it needs two or more runs a branch (andrea fork --replicates)."
        ),
        "",
    ]
    if c.to_decide:
        lines += [f"What would decide it: {markdown_text(c.to_decide)}.", ""]
    acted = [b for b in c.branches if b.guard_events]
    for b in acted:
        under = f" It trained under: {markdown_text('; '.join(b.trained_under))}." if b.trained_under else ""
        events = markdown_text("; ".join(guard_lines(b)))
        lines += [
            f"Divergence guard in {markdown_code(b.name)} (ranked apart: it did not train under its "
            f"overrides alone): {events}.{under}",
            "",
        ]
    if not acted:
        lines += ["The divergence guard acted in no branch.", ""]
    if plot_src:
        lines += [f"![training and held-out loss of the branches]({plot_src})", ""]
    lines += ["Branch run directories (lineage in each `run.yaml`):", ""]
    lines += [
        f"- {markdown_code(b.name)}: "
        + ", ".join(markdown_code(r.url) for r in b.runs or [RunScore(b.url, 0, 0, None)])
        for b in c.branches
    ]
    return "\n".join(lines) + "\n"


def write_report(c: Comparison, report_dir: str, png: bytes | None = None) -> dict[str, str]:
    """report.md (with the plot beside it) and plot.png in `report_dir`: what `andrea compare` and the
    audit-fork flow both leave on disk. Returns their paths."""
    check_destination(report_dir, "report folder")
    out = RunDir(report_dir)
    out.makedirs()
    out.write_atomic("plot.png", png if png is not None else plot_comparison(c))
    out.write_text("report.md", report_markdown(c, "plot.png"))
    return {"report": out.path("report.md"), "plot": out.path("plot.png")}


def is_own_event(e: GuardEvent, fork_step: int) -> bool:
    """An event of the branch itself, not one of the parent's it copied: a branch never rolls back
    past its fork point, and the copied ones' remedies act from before it (run/guard_events.events_up_to)."""
    if e.action == "rollback":
        return e.remedy_from >= fork_step
    return e.step > fork_step


def forked_from(branch_urls: list[str]) -> tuple[str, int]:
    """(parent URL, fork step) shared by every branch, read from their run.yaml lineage; branches of
    different forks, or a run that is no branch, are refused naming it."""
    if len(branch_urls) < 1:
        raise ConfigError("compare: name one or more branch run directories")
    points = {}
    for url in branch_urls:
        run = RunDir(url)
        if not run.exists("run.yaml"):
            raise ConfigError(f"{run.url}: no run here (no run.yaml): not a branch to compare")
        lineage = read_run(run).lineage
        if lineage.get("parent") is None or type(lineage.get("parent_step")) is not int:
            raise ConfigError(f"{run.path('run.yaml')}: no lineage.parent/parent_step: not a fork branch")
        points[run.url] = (lineage["parent"], lineage["parent_step"])
    if len(set(points.values())) > 1:
        found = ", ".join(f"{u} (from {p} at step {s})" for u, (p, s) in points.items())
        raise ConfigError(f"compare: the branches are not of one fork: {found}")
    return next(iter(points.values()))
