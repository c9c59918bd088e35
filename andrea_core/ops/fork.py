"""Audit forks: copy one checkpoint of a run into branch run directories with their own configs.

A fork never writes into the parent except one line appended to its forks.jsonl: the parent's
checkpoints and sidecars stay byte-identical.

Order, so that a fork killed at any point can neither lose its fork point nor leave a branch that
trains from scratch:
  1. validate everything (branch names, configs, destinations, the checkpoint) before any write;
  2. append the fork's line to the parent's forks.jsonl: from then on retention keeps the fork point
     (retention.protected_steps), even while the branches are still being copied;
  3. build each branch with its run.yaml last: a folder without run.yaml is an unfinished branch, never
     a run. A rerun of the same fork (same step, same branch names) finds its line and completes
     whatever is missing instead of refusing or appending a second line;
  4. confirm the parent keeps the fork point: a retention pass under way when the line was added read
     the protections before it and may still delete it (confirm_fork_point waits that pass out);
  5. a trainer started on a branch whose lineage names a fork point it does not hold refuses to start
     (require_fork_point) instead of training from step 1.

Replicates: with `replicates` K > 1 each branch is K runs, identical but for train.seed (replicate 0
keeps the branch's seed and URL; replicate r trains with replicate_seed(seed, r) at "<url>.r<r>").
Branches that share a seed share the data order of each replicate, so their replicate-r difference
cancels the order's part; the spread over replicates is the training noise the verdict weighs
(ops/compare.py).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from andrea_core import faults
from andrea_core.checkpoint import Checkpoint, CheckpointError, checkpoint_name, encode_parts, size_problem
from andrea_core.config import ConfigError, RetentionConfig, RunConfig, load_yaml
from andrea_core.data.policy import load_policy, parse_policy
from andrea_core.poll import poll_until
from andrea_core.run.guard_events import events_up_to
from andrea_core.run.lineage import BRANCH_NAME_RE, check_branch_name, fork_records  # noqa: F401 (re-exported)
from andrea_core.run.lock import read_lock, still_holds
from andrea_core.run.record import config_differences, read_run, run_n_params
from andrea_core.run.rundir import (
    FORKS,
    GUARD_LOG,
    LOSS_LOG,
    POLICY_YAML,
    RUN_YAML,
    STATE,
    TOKENIZER_JSON,
    RunDir,
)
from andrea_core.train.setup import create_run

# run/lineage.BRANCH_NAME_RE for a JSON schema (the Prefect parameter form): `pattern` is searched.
BRANCH_NAME_SCHEMA = f"^{BRANCH_NAME_RE.pattern}$"


@dataclass
class BranchSpec:
    name: str
    overrides: dict[str, Any] = field(default_factory=dict)  # dotted run-config keys: {"train.lr": 1e-3}
    url: str | None = None  # default: beside the parent, "<parent>-<name>"


DEFAULT_REPLICATES = 3  # runs a branch on the operator's paths (`andrea fork`, the audit-fork flow)
MAX_REPLICATES = 64
REPLICATE_SEED_STRIDE = 1_000_003


def check_replicates(value: Any, where: str = "replicates") -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_REPLICATES:
        raise ConfigError(f"{where}: expected a whole number 1..{MAX_REPLICATES}, got {value!r}")
    return value


def replicate_seed(seed: int, replicate: int) -> int:
    """train.seed of replicate `replicate` of a branch whose seed is `seed` (replicate 0: its own)."""
    return (seed + replicate * REPLICATE_SEED_STRIDE) % 2**31 if replicate else seed


def replicate_url(url: str, replicate: int) -> str:
    """Replicate 0 is the branch's URL; replicate r, "<url>.r<r>" beside it."""
    return url if replicate == 0 else f"{url.rstrip('/')}.r{replicate}"


def replicate_label(name: str, replicate: int) -> str:
    return name if replicate == 0 else f"{name}.r{replicate}"


def check_destination(url: str, where: str) -> str:
    """An explicit destination (a branch URL, a report folder): no '..' component may climb out of
    where it names."""
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(f"{where}: expected a path or URL, got {url!r}")
    parts = re.split(r"[/\\]", url)
    if ".." in parts or any(ord(c) < 32 for c in url):
        raise ConfigError(f"{where}: {url!r} may not contain '..' components or control characters")
    return url


def default_branch_url(parent: RunDir, step: int, name: str) -> str:
    return f"{parent.url.rstrip('/')}-fork{step}-{check_branch_name(name)}"


@dataclass
class _Plan:
    spec: BranchSpec
    cfg: RunConfig
    branch: RunDir
    policy_text: str
    complete: bool  # a finished branch of this very fork: left as it is
    replicate: int = 0
    replicates: int = 1


def fork(
    parent_url: str,
    branches: list[BranchSpec],
    step: int | None = None,
    log: Callable[[str], None] = print,
    replicates: int = 1,
) -> list[str]:
    """Create `replicates` run directories per spec from the parent's checkpoint at `step` (default:
    newest valid). Returns the run URLs, branch by branch, replicate 0 first. Everything is validated
    before the first write; a rerun of a fork that did not finish completes it. `log` gets what the
    fork waits for and a fork point the parent could not be shown to keep (confirm_fork_point)."""
    check_replicates(replicates)
    parent = RunDir(parent_url)
    record = read_run(parent)
    n_params = run_n_params(record)
    for i, b in enumerate(branches):
        check_branch_name(b.name, f"branches[{i}]")
        if b.url is not None:
            check_destination(b.url, f"branches[{i}] ({b.name}).url")
    if len({b.name for b in branches}) != len(branches) or len(branches) < 1:
        raise ConfigError(
            f"fork of {parent.url}: branch names must be unique, got {[b.name for b in branches]}"
        )
    if step is None:  # the newest is a moving target while a trainer that cannot be checked runs
        from andrea_core.run.lock import require_not_elsewhere

        require_not_elsewhere(parent, "forking its newest checkpoint (name one with --step)")
    # Read once (a 1.44 GB download on an object store) and validated (raises naming the file).
    ckpt = (
        parent.newest_valid_checkpoint(n_params) if step is None else parent.read_checkpoint(step, n_params)
    )
    if ckpt is None:
        raise CheckpointError(parent.url, "no valid checkpoint to fork from")
    step = ckpt.step
    bases = [RunDir(b.url or default_branch_url(parent, step, b.name)).url for b in branches]
    runs = [(b, r, RunDir(replicate_url(u, r)).url) for b, u in zip(branches, bases, strict=True)
            for r in range(replicates)]  # fmt: skip
    names = [replicate_label(b.name, r) for b, r, _ in runs]
    urls = [u for _, _, u in runs]
    if len(set(urls)) != len(urls):
        raise ConfigError(f"fork of {parent.url}: two runs of this fork would share a folder: {urls}")
    earlier = next(
        (r for r in fork_records(parent) if r.get("step") == step and r.get("names") == names), None
    )
    if earlier is not None and list(earlier.get("branches", [])) != urls:
        raise ConfigError(
            f"fork of {parent.url} at step {step} into {names} was made before into {earlier['branches']}, "
            f"not {urls}"
        )

    plans = []
    for spec, replicate, url in runs:
        cfg = record.config.with_overrides(spec.overrides, f"branch {spec.name!r}")
        if replicate:
            seed = replicate_seed(cfg.train.seed, replicate)
            cfg = cfg.with_overrides({"train.seed": seed}, f"branch {spec.name!r} replicate {replicate}")
        if cfg.model != record.config.model or cfg.data.tokenizer != record.config.data.tokenizer:
            raise ConfigError(
                f"branch {spec.name!r}: a fork cannot change the model architecture or tokenizer"
            )
        branch = RunDir(url)
        # A branch trains on the policy its config names whenever the override names one (even the
        # parent's original one after a pivot); without it, on the parent's policy in force.
        if "data.policy" in spec.overrides:
            _, policy_text = load_policy(cfg.data.policy)
        else:
            policy_text = parent.read_text(POLICY_YAML)
        complete = _branch_state(branch, spec, parent, step, n_params, cfg, earlier is not None)
        plans.append(_Plan(spec, cfg, branch, policy_text, complete, replicate, replicates))

    firsts = [p for p in plans if p.replicate == 0]  # the operator's branches, as they were named
    check_branches_change_training(record.config, parent.read_text(POLICY_YAML), firsts, step)
    _check_branch_data(parent, record.config, firsts)
    if earlier is None:
        # The fork point is protected from here on, before anything is copied (retention reads this).
        line = {"step": step, "branches": urls, "names": names, "time": time.time()}
        if replicates > 1:
            line["replicates"] = replicates
        parent.append(FORKS, (json.dumps(line) + "\n").encode(), durable=True)
    for plan in plans:
        if not plan.complete:
            _build_branch(parent, plan, ckpt)
    confirm_fork_point(parent, step, record.config.retention, log)
    return urls


CONFIRM_TIMEOUT_S = 600.0  # a trainer stopped (SIGSTOP, a paused VM) publishes nothing: how long to wait


def confirm_fork_point(
    parent: RunDir,
    step: int,
    retention: RetentionConfig,
    log: Callable[[str], None] = print,
    timeout_s: float = CONFIRM_TIMEOUT_S,
    poll: float = 0.25,  # a listing each: on an object store, a LIST request
) -> bool:
    """Whether the parent keeps checkpoint `step` for good, once the fork's line is in forks.jsonl.

    Every retention pass that reads the protections after the line keeps the step; one under way when
    the line was added read them before and may still delete it. Retention runs only under the run's
    lease (the trainer's pass after each checkpoint, `andrea gc`), one pass at a time, and a trainer
    publishes its next checkpoint only once the previous one's pass is over: so the pass that can
    delete the fork point is over when the lease holder of now publishes a checkpoint that is not on
    disk now, or holds the run no more. Until one of those, this waits (at most `timeout_s`); it need
    not where no pass can release the step: retention.keep_last null, a keep_every multiple, or one of
    the keep_last newest on disk now (a pass's newest is on disk already, and it deletes oldest first).
    A False is logged, naming what happened; the branches hold the checkpoint either way."""
    name = checkpoint_name(step)
    # Kept by a rule no pass can change: asked first, with no listing and no lock read.
    fixed = retention.keep_last is None or bool(retention.keep_every and step % retention.keep_every == 0)
    listed = [] if fixed else parent.checkpoint_steps()
    holder = None if fixed else read_lock(parent)
    newer = sum(1 for s in listed if s > step)
    if step in listed and newer >= retention.keep_last and holder is not None:
        log(
            f"{parent.url}: waiting for trainer pid {holder.pid}'s next checkpoint: a retention pass "
            f"under way when the fork was recorded may still delete {name} (at most {timeout_s:g}s)"
        )

        def moved_on() -> bool:
            return not still_holds(parent, holder) or not set(parent.checkpoint_steps()) <= set(listed)

        if not poll_until(moved_on, timeout_s, poll):
            log(
                f"warning: {parent.url}: could not confirm the parent keeps the fork point {name}: "
                f"trainer pid {holder.pid} published no checkpoint in {timeout_s:g}s (stopped?); "
                "a retention pass it had under way may still delete it. The branches hold it"
            )
            return False
    if parent.exists(name):
        return True
    log(
        f"warning: {parent.url}: the parent no longer holds the fork point {name}: a retention pass "
        "under way when the fork was recorded deleted it. The branches hold it; a rerun of this fork "
        "cannot rebuild a branch from the parent"
    )
    return False


# Settings that change how a run is run, never what it learns (the same steps, the same weights).
NOT_TRAINING = {
    "train.checkpoint_every": "when checkpoints are written",
    "train.sample_every": "when audits are made",
    "train.log_every": "how often progress is printed",
    "train.num_threads": "how many threads compute the same steps",
    "train.compile": "how the same model is compiled",
    "train.compile_mode": "how the same model is compiled",
    "train.loss_chunk_tokens": "how the same loss is computed",
    "train.async_checkpoint": "how checkpoints are written",
    "train.audit_async": "where audits run",
    "retention.keep_last": "which checkpoints are kept",
    "retention.keep_every": "which checkpoints are kept",
}
SCHEDULE = ("train.lr", "train.min_lr", "train.warmup_steps", "train.lr_decay_steps")


def _same_schedule(a: RunConfig, b: RunConfig, step: int) -> bool:
    """Whether the two learning-rate schedules agree at every step a branch of `step` can train: from
    step + 1 to past both decays' ends (both are constant at min_lr from there on)."""
    from andrea_core.train.optim import lr_at  # no torch

    end = max(a.train.max_steps, b.train.max_steps, a.train.lr_decay_steps, b.train.lr_decay_steps,
              a.train.warmup_steps, b.train.warmup_steps, step + 1) + 1  # fmt: skip
    return all(lr_at(s, a.train) == lr_at(s, b.train) for s in range(step + 1, end + 1))


def _same_training(a: RunConfig, policy_a: str, b: RunConfig, policy_b: str, step: int) -> bool:
    learns = [d for d in config_differences(a, b) if d not in NOT_TRAINING and d not in SCHEDULE]
    return not learns and policy_a == policy_b and _same_schedule(a, b, step)


def _why_nothing(key: str, parent: RunConfig, cfg: RunConfig, step: int) -> str:
    if key in NOT_TRAINING:
        return f"{key} only changes {NOT_TRAINING[key]}"
    if key in SCHEDULE:
        t = cfg.train
        if step >= t.lr_decay_steps and step >= parent.train.lr_decay_steps:
            return (
                f"the learning rate is train.min_lr from train.lr_decay_steps={t.lr_decay_steps} on; set "
                "train.min_lr or train.lr_decay_steps"
            )
        return "the learning rate is the same at every one of those steps"
    if key == "data.policy":
        return "it names the policy the parent trains on already"
    return f"{key} is the parent's value already"


def check_branches_change_training(
    parent: RunConfig, parent_policy_text: str, plans: list[_Plan], step: int
) -> None:
    """Refuse a branch whose overrides change nothing it will learn (over the steps from the fork point
    on, it would train exactly as the parent, or as another branch, would): comparing it would only
    measure noise. Named with the setting and why. A branch without overrides is the control."""

    def policy_hash(text: str) -> str:
        return parse_policy(load_yaml(text, "policy"), "policy").hash

    parent_hash = policy_hash(parent_policy_text)
    hashes = [policy_hash(p.policy_text) for p in plans]
    for i, plan in enumerate(plans):
        if not plan.spec.overrides:
            continue
        last = plan.cfg.train.max_steps
        steps = f"{step + 1} to {last}" if last > step else f"from {step + 1} on"
        what = ", ".join(f"{k}={v}" for k, v in plan.spec.overrides.items())
        if _same_training(parent, parent_hash, plan.cfg, hashes[i], step):
            whys = dict.fromkeys(_why_nothing(k, parent, plan.cfg, step) for k in plan.spec.overrides)
            raise ConfigError(
                f"branch {plan.spec.name!r}: {what} changes nothing over the steps it trains ({steps}): "
                + "; ".join(whys)
            )
        for other, other_hash in zip(plans[:i], hashes[:i], strict=True):
            if _same_training(other.cfg, other_hash, plan.cfg, hashes[i], step):
                raise ConfigError(
                    f"branch {plan.spec.name!r}: {what} trains exactly as branch {other.spec.name!r} over "
                    f"the steps it trains ({steps}): their settings differ only where nothing is learned"
                )


def _branch_state(
    branch: RunDir, spec: BranchSpec, parent: RunDir, step: int, n_params: int, cfg: RunConfig, rerun: bool
) -> bool:
    """True: a finished branch of this fork; False: to be built (absent, or left unfinished by an
    earlier attempt of this same fork). Anything else at the destination is refused."""
    if not branch.exists(RUN_YAML):
        if rerun or not branch.listdir():
            return False
        raise ConfigError(f"branch {spec.name!r}: {branch.url} exists and is not a branch of this fork")
    lineage = read_run(branch).lineage
    ours = lineage.get("parent") == parent.url and lineage.get("parent_step") == step
    if not (rerun and ours):
        raise ConfigError(f"branch {spec.name!r}: {branch.url} already holds a run")
    if read_run(branch).config != cfg:
        raise ConfigError(
            f"branch {spec.name!r}: {branch.url} was forked with other overrides "
            f"({lineage.get('overrides')}), not {spec.overrides}"
        )
    return _holds_fork_point(branch, step, n_params)


def _holds_fork_point(branch: RunDir, step: int, n_params: int) -> bool:
    name = checkpoint_name(step)
    return branch.exists(name) and size_problem(branch.size(name), n_params) is None


def _build_branch(parent: RunDir, plan: _Plan, ckpt: Checkpoint) -> None:
    """Every file of the branch, run.yaml last (the branch exists as a run only once it is whole)."""
    branch, step = plan.branch, ckpt.step
    branch.makedirs()
    branch.write_atomic(checkpoint_name(step), encode_parts(step, ckpt.flat))
    _kill_point(f"{plan.spec.name}/{checkpoint_name(step)}")
    # Each file is published whole, so one an earlier attempt left is complete; and a branch's own
    # .loss.json is append-only: never replaced.
    # The branch's history is the parent's up to the fork point, never what the parent logged after it.
    if parent.exists(LOSS_LOG) and not branch.exists(LOSS_LOG):
        branch.write_atomic(LOSS_LOG, history_up_to(parent.read_bytes(LOSS_LOG), step))
    # Its divergence-guard events too: those that shaped the parent's timeline up to the fork point.
    if parent.exists(GUARD_LOG) and not branch.exists(GUARD_LOG):
        kept = events_up_to(parent.read_bounded(GUARD_LOG), step)
        if kept:
            branch.write_atomic(GUARD_LOG, kept)
    same_policy = plan.policy_text == parent.read_text(POLICY_YAML)
    if parent.exists(STATE) and same_policy and not branch.exists(STATE):
        branch.write_atomic(STATE, parent.read_bytes(STATE))
    if branch.exists(RUN_YAML):
        return  # an earlier attempt's run.yaml (a fork made before run.yaml came last): now whole
    lineage = {
        "parent": parent.url,
        "parent_step": step,
        "branch": plan.spec.name,
        "overrides": plan.spec.overrides,
    }
    if plan.replicates > 1:  # a fork without replicates writes the lineage it always did
        lineage.update(replicate=plan.replicate, replicates=plan.replicates, seed=plan.cfg.train.seed)
    # The weights only mean something with the parent's frozen tokenizer.
    tokenizer = parent.read_bytes(TOKENIZER_JSON) if parent.exists(TOKENIZER_JSON) else None
    create_run(branch, plan.cfg, plan.policy_text, lineage, tokenizer)


def _check_branch_data(parent: RunDir, parent_cfg: RunConfig, plans: list[_Plan]) -> None:
    """A branch under a policy of its own is a new run of that policy: every arm must have data on this
    machine, checked as a pivot checks its policy (pipeline.require_available), before anything is
    written. (A run that loses an arm later trains on, its caps scaled: data/changes.py.)"""
    own = [p for p in plans if p.policy_text != parent.read_text(POLICY_YAML)]
    if not own:
        return
    from andrea_core.data.pipeline import prepare_data, require_available  # torch: only here
    from andrea_core.data.tokens import run_tokenizer

    tokenizer = run_tokenizer(parent, parent_cfg)  # a branch keeps its parent's tokenizer
    for plan in own:
        policy = parse_policy(load_yaml(plan.policy_text, "policy"), "policy")
        _, unavailable, _ = prepare_data(policy, plan.cfg, tokenizer, lambda m: None)
        require_available(policy, unavailable, f"branch {plan.spec.name!r}")


def _kill_point(name: str) -> None:
    """ANDREA_TEST_FORK_KILL_AFTER=<branch>/<file>: the fork's process dies right after writing that
    file, as a worker killed mid-copy would (tests only). Unset: no effect."""
    faults.die_at(faults.FORK_KILL_AFTER, name)


def history_up_to(data: bytes, step: int) -> bytes:
    """The complete lines of a .loss.json with steps up to `step`, bytes as they were (every segment:
    the canonical history up to `step` is the same as the parent's)."""
    kept = []
    for line in data.split(b"\n"):
        try:
            if int(json.loads(line)["step"]) <= step:
                kept.append(line + b"\n")
        except (ValueError, KeyError, TypeError):
            continue  # a torn or foreign line
    return b"".join(kept)
