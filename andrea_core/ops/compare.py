"""Audit-fork comparison: which branch converges, judged on the same held-out data for every branch.

Each branch's newest checkpoint is scored on one fixed validation batch per arm (the union of the
branches' arms, each split as the parent's sources split it, drawn from the parent's data config), so that
the branches differ only in what they learned. That held-out data is outside every branch's training
split only while every branch splits its arms as the parent does: a branch that changes the split
(data.val_fraction, data.max_source_bytes), or whose policy reads the held-out documents' files under
other identities (a wider folder: trained_on_held_out), is refused naming the branch and the arm, not
scored on data it trained on.

The leader has the lowest mean held-out loss; the margin is its lead over the runner-up, and the noise is
the standard error of the paired per-sequence difference (same sequences, so the sequence-to-sequence
spread cancels). The leader is named the winner only when the margin exceeds SIGNIFICANCE x the noise;
otherwise there is no winner ("no winner: within noise"). Training-loss figures (final, EMA, spread) are
reported beside it.

Every string that comes from an input (run URLs, branch, arm and policy names, overrides, error texts)
reaches the markdown report escaped (markdown_text, markdown_code): it is shown, never interpreted as a
link, an image or HTML.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from andrea_core.checkpoint import restore
from andrea_core.config import ConfigError, RunConfig
from andrea_core.data.pipeline import DataPipeline
from andrea_core.data.policy import CORPUS_KINDS, ArmSpec, Policy, SourceUnavailable, load_policy, read_policy
from andrea_core.data.tokens import run_tokenizer
from andrea_core.model.gpt import GPT
from andrea_core.ops.fork import BranchSpec, check_destination
from andrea_core.run.guard_events import GuardEvent, read_events
from andrea_core.run.lineage import phases
from andrea_core.run.loss_log import LossEntry, ema, ema_curve, read_history
from andrea_core.run.record import read_run
from andrea_core.run.rundir import RunDir
from andrea_core.train.optim import build_optimizer

SIGNIFICANCE = 2.0  # a margin above this many standard errors is called a winner, not noise
# The data settings that decide which tokens of an arm are held out: a branch must share the parent's.
SPLIT_FIELDS = ("val_fraction", "max_source_bytes")
UNTRAINED = "untrained: no checkpoint past the fork point"


@dataclass
class BranchResult:
    name: str
    url: str
    overrides: dict
    trained_to: int | None = None  # step of the newest valid checkpoint
    final_loss: float | None = None  # training loss of the last logged step
    ema_loss: float | None = None  # EMA (alpha 0.05) of the training loss since the fork
    train_noise: float | None = None  # std of the training loss over the last `window` steps
    val_loss: dict[str, float] = field(default_factory=dict)  # held-out loss per arm
    val_mean: float | None = None  # mean over arms
    val_stderr: dict[str, float] = field(default_factory=dict)  # standard error of each arm's mean
    problem: str | None = None  # why the branch is out of the running
    # The divergence guard's events of the branch itself (guard.jsonl, after the fork point): a branch
    # that rolled back trained a remedied timeline (batches skipped, a cooled learning rate).
    guard_events: list[dict] = field(default_factory=list)
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
    winner: str | None = None  # the leader, only when its margin is beyond the noise
    leader: str | None = None  # the lowest held-out loss, winner or not
    runner_up: str | None = None
    margin: float | None = None
    noise: float | None = None
    significant: bool = False
    verdict: str = ""
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
        return out


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
    logits, _ = model(x)
    per_token = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none")
    return per_token.view(y.shape).mean(dim=1).double().numpy()


def compare_branches(
    parent_url: str,
    branch_urls: list[str],
    fork_step: int,
    *,
    val_sequences: int = 32,
    window: int = 50,
    failed: dict[str, str] | None = None,
    warn: Callable[[str], None] = print,
) -> Comparison:
    """Score every branch on the same held-out batches and name the one that converges.

    `failed` maps branch names to why their trainer did not finish (they are reported, not ranked)."""
    parent = RunDir(parent_url)
    parent_cfg = read_run(parent).config
    branches = [RunDir(u) for u in branch_urls]
    records = [read_run(b) for b in branches]
    names = [r.lineage.get("branch") or b.url for b, r in zip(branches, records, strict=True)]
    policies = {name: read_policy(b) for name, b in zip(names, branches, strict=True)}
    parent_policy = read_policy(parent)
    check_held_out(
        parent_cfg, {n: r.config for n, r in zip(names, records, strict=True)}, policies, parent_policy
    )
    policy = evaluation_policy(list(policies.values()), parent_policy)
    data = DataPipeline(parent_cfg, policy, warn, run_tokenizer(parent, parent_cfg))
    arms = list(data.arms)
    batches = {arm: data.val_batch(arm, val_sequences) for arm in arms}

    torch.manual_seed(0)
    model = GPT(parent_cfg.model)
    optimizer = build_optimizer(model, parent_cfg.train, "cpu")  # restore() fills m and v too
    model.eval()

    results = []
    for run, record in zip(branches, records, strict=True):
        name = record.lineage.get("branch") or run.url.rsplit("/", 1)[-1]
        result = BranchResult(name, run.url, dict(record.lineage.get("overrides") or {}))
        result.history = [e for e in read_history(run) if e.step > fork_step]
        losses = [e.loss for e in result.history]
        if losses:
            result.final_loss = losses[-1]
            result.ema_loss = ema(losses)
            result.train_noise = float(np.std(losses[-window:], ddof=1)) if len(losses) > 1 else None
        result.guard_events = [asdict(e) for e in read_events(run, warn=warn) if is_own_event(e, fork_step)]
        ckpt = run.newest_valid_checkpoint(model.n_params, warn=warn)
        if failed and name in failed:
            result.problem = failed[name]
        if ckpt is None or ckpt.step <= fork_step:
            result.problem = result.problem or UNTRAINED
        if ckpt is not None:
            result.trained_to = ckpt.step
            restore(ckpt, model, optimizer)
            per_arm = {arm: sequence_losses(model, *batches[arm]) for arm in arms}
            result.val_loss = {arm: float(v.mean()) for arm, v in per_arm.items()}
            result.val_stderr = {
                arm: float(v.std(ddof=1) / math.sqrt(v.size)) if v.size > 1 else 0.0
                for arm, v in per_arm.items()
            }
            result.val_mean = float(np.mean(list(result.val_loss.values())))
            result.per_sequence = np.concatenate([per_arm[arm] for arm in arms])
        results.append(result)

    comparison = Comparison(parent.url, fork_step, arms, val_sequences, parent_cfg.model.block_size, results)
    comparison.parent_history = [e for e in read_history(parent) if e.step <= fork_step]
    comparison.pivots = phases(parent)
    _name_winner(comparison)
    return comparison


def _name_winner(c: Comparison) -> None:
    ranked = sorted((b for b in c.branches if b.problem is None), key=lambda b: b.val_mean)
    if not ranked:
        c.verdict = "no branch could be evaluated: " + "; ".join(f"{b.name}: {b.problem}" for b in c.branches)
        return
    best = ranked[0]
    c.leader = best.name
    if len(ranked) == 1:
        c.verdict = (
            f"no winner: {best.name} is the only branch that trained (held-out loss {best.val_mean:.4f}), "
            "nothing to compare it with"
        )
        return
    second = ranked[1]
    diff = second.per_sequence - best.per_sequence  # paired: the same held-out sequences
    c.runner_up = second.name
    c.margin = float(diff.mean())
    c.noise = float(diff.std(ddof=1) / math.sqrt(diff.size))
    c.significant = c.margin > SIGNIFICANCE * c.noise
    figures = (
        f"held-out loss {best.val_mean:.4f} vs {second.val_mean:.4f} for {second.name}; "
        f"margin {c.margin:.4f}, noise ±{c.noise:.4f}"
    )
    if c.significant:
        c.winner = best.name
        ratio = c.margin / c.noise if c.noise > 0 else math.inf
        c.verdict = f"{best.name} converges best: {figures} ({ratio:.1f} standard errors)"
    else:
        c.verdict = (
            f"no winner: within noise ({best.name} leads: {figures}, under {SIGNIFICANCE:g} standard "
            "errors); run the branches longer"
        )


# --- the report ------------------------------------------------------------------------------------


def legend_label(c: Comparison, b: BranchResult) -> str:
    """A branch's name in the plot: "(winner)" only for a winner beyond the noise. Shown as text: a
    leading "_" would hide it from the legend and "$" start matplotlib's mathtext."""
    name = b.name.replace("$", r"\$")
    name = " " + name if name.startswith("_") else name
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
            label=b.name,
            color=f"C{c.branches.index(b)}",
        )
    bx.set_xticks(x + width * (len(scored) - 1) / 2, c.arms, fontsize=8)
    title = "held-out loss per arm (same batches; bars: ±1 standard error)"
    if c.margin is not None and c.noise is not None:
        title += f"\npaired margin {c.margin:.4f} vs noise ±{c.noise:.4f} (winner needs > {SIGNIFICANCE:g}x)"
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


def png_data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def _fmt(v: float | None, digits: int = 4) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


# Markdown's inline syntax (links, images, emphasis, code, table cells, strikethrough); what matters only
# at the start of a line (lists, headings) cannot occur: these strings are always placed mid-line.
_MD_SPECIAL = re.compile(r"([\\`*_{}\[\]()#|~])")


def markdown_text(text: object) -> str:
    """An input-derived string as plain markdown text: HTML and markdown syntax shown, never interpreted
    (no link, image, raw HTML, emphasis or table cell break); one line."""
    text = " ".join(str(text).split())
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _MD_SPECIAL.sub(r"\\\1", text)


def markdown_code(text: object, in_table: bool = False) -> str:
    """An input-derived string as a markdown code span: shown verbatim, whatever backticks, brackets or
    HTML it holds (the fence is longer than any run of backticks inside). In a table cell "|" is
    escaped, which GitHub-flavoured markdown requires even inside code spans."""
    text = " ".join(str(text).split())
    fence = "`" * (max((len(r) for r in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") or not text else ""
    if in_table:
        text = text.replace("|", "\\|")
    return f"{fence}{pad}{text}{pad}{fence}"


def headline(c: Comparison) -> str:
    if c.winner:
        return f"**Winner: {markdown_code(c.winner)}**."
    if c.margin is not None:
        return "**No winner: within noise.**"
    return "**No winner.**"


def report_markdown(c: Comparison, plot_src: str | None = None) -> str:
    """The audit report: verdict first, then the figures behind it. `plot_src` is an image URL or a
    data URI (the Prefect UI shows data URIs inside markdown artifacts). Every input-derived string is
    escaped (markdown_text, markdown_code)."""
    lines = [
        f"# Audit fork of {markdown_code(c.parent)} at step {c.fork_step}",
        "",
        f"{headline(c)} {markdown_text(c.verdict)}",
        "",
        "| branch | overrides | trained to | final loss | EMA loss | train noise | held-out loss | "
        + " | ".join(f"held-out {markdown_code(a, in_table=True)}" for a in c.arms)
        + " |",
        "|---" * (7 + len(c.arms)) + "|",
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
        cells = [
            name,
            overrides,
            str(b.trained_to) if b.trained_to is not None else "n/a",
            _fmt(b.final_loss),
            _fmt(b.ema_loss),
            _fmt(b.train_noise),
            _fmt(b.val_mean),
            *(_fmt(b.val_loss.get(a)) for a in c.arms),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Held-out data: {c.val_sequences} sequences of {c.block_size} tokens from the validation split of "
        f"each arm under the parent's data settings, the same for every branch. No branch trained on it: "
        f"every branch splits its arms as the parent does (a branch that changes "
        f"{' or '.join('data.' + f for f in SPLIT_FIELDS)}, or whose arms read the held-out documents' "
        f"files under other paths, is refused). Margin: the runner-up's mean "
        f"held-out loss minus the leader's ({_fmt(c.margin)}); noise: standard error of the paired "
        f"per-sequence difference ({_fmt(c.noise)}). A margin above {SIGNIFICANCE:g}x the noise names a "
        f"winner; below, there is no winner (within noise).",
        "",
    ]
    rolled = [b for b in c.branches if b.guard_events]
    for b in rolled:
        events = "; ".join(
            f"{e['kind']} at step {e['step']}, "
            + (f"rolled back to {e['rolled_back_to']}" if e["action"] == "rollback" else "stopped")
            for e in b.guard_events
        )
        lines += [f"Branch {markdown_code(b.name)} rolled back (divergence guard): {events}.", ""]
    if not rolled:
        lines += ["No branch rolled back (divergence guard).", ""]
    if plot_src:
        lines += [f"![training and held-out loss of the branches]({plot_src})", ""]
    lines += ["Branch run directories (lineage in each `run.yaml`):", ""]
    lines += [f"- {markdown_code(b.name)}: {markdown_code(b.url)}" for b in c.branches]
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
    past its fork point, and the copied ones rolled back before it (run/guard_events.events_up_to)."""
    if e.action == "rollback":
        return e.rolled_back_to >= fork_step
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
