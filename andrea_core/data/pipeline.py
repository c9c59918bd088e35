"""The trainer's one view of data: `batch(step)` is a pure function of (seed, step, mixer state).

The step's generator is seeded with (seed, step) alone, so a resumed run draws exactly the batches
the uninterrupted run would, whatever happened to the process in between; the mixer state is the one
saved with the checkpoint resumed from (.state.json, see state.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from andrea_core.config import ConfigError, RunConfig
from andrea_core.data.changes import record_data_changes
from andrea_core.data.mixer import Exp3Mixer, Mixer, UniformMixer
from andrea_core.data.policy import (
    CORPUS_KINDS,
    Policy,
    SourceUnavailable,
    check_feasible,
    live_caps,
    read_policy,
)
from andrea_core.data.shards import ShardedTokens, check_corpus_split, corpus_arm
from andrea_core.data.sources import open_source
from andrea_core.data.state import BanditStore
from andrea_core.data.tokens import ByteTokenizer, Tokenizer, run_tokenizer, token_cache
from andrea_core.run.rundir import RunDir


@dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor
    arm: str


@dataclass
class TokenArm:
    name: str
    train: np.ndarray | ShardedTokens
    val: np.ndarray | ShardedTokens
    fingerprint: str = ""  # the source's, as this start loaded it (recorded in data.jsonl)
    info: dict = field(default_factory=dict)  # a corpus arm's counts (documents, bad records, cache size)


def step_rng(seed: int, step: int, stream: int = 0) -> np.random.Generator:
    """The generator of one step; `stream` separates uses (batches 0, audit 1) that must not interact."""
    return np.random.default_rng([seed, step, stream])


def load_arms(
    policy: Policy, cfg: RunConfig, tokenizer: Tokenizer, warn: Callable[[str], None] = print
) -> tuple[dict[str, TokenArm], dict[str, str]]:
    """Token arrays for every arm whose source is available here, and why each other arm is not."""
    arms, unavailable = {}, {}
    T = cfg.model.block_size
    for spec in policy.arms:
        try:
            source = open_source(spec, cfg.data.max_source_bytes)
            if spec.kind in CORPUS_KINDS:  # sharded caches, split by document (data/shards.py)
                data = corpus_arm(source, tokenizer, cfg, warn)
                arm = TokenArm(spec.name, data.train, data.val, source.fingerprint, data.info)
                check_corpus_split(data, T)
            else:
                tokens = token_cache(source, tokenizer)
                n_val = max(T + 2, int(len(tokens) * cfg.data.val_fraction))
                if len(tokens) - n_val < T + 2:
                    raise ValueError(f"{len(tokens)} tokens leave no training split of block_size {T}")
                arm = TokenArm(spec.name, tokens[:-n_val], tokens[-n_val:], source.fingerprint)
        except (SourceUnavailable, ValueError) as e:
            warn(f"arm {spec.name!r} is unavailable and will not be drawn: {e}")
            unavailable[spec.name] = str(e)
            continue
        arms[spec.name] = arm
    if not arms:
        reasons = "; ".join(f"{a}: {why}" for a, why in unavailable.items())
        raise SourceUnavailable(
            f"policy {policy.name!r}: none of its arms has data on this machine, nothing to train on "
            f"({reasons})"
        )
    return arms, unavailable


def make_mixer(policy: Policy, available: list[str], seed: int = 0) -> Mixer:
    """The policy's mixer over the available arms: an unavailable arm's floor is released, and the
    caps of the arms left, where they sum below 1, scaled up to reach it (policy.live_caps)."""
    floors = [policy.arm(a).floor for a in available]
    caps, _ = live_caps(policy, available)
    missing = [a.name for a in policy.arms if a.name not in available]
    if missing:
        where = f"policy {policy.name!r} without its unavailable arm(s) {', '.join(missing)}"
        check_feasible(floors, caps, where, available)
    if policy.mixer == "exp3":
        return Exp3Mixer(available, floors, caps, policy.reward_ema, policy.baseline_ema, policy.eta)
    return UniformMixer(available, floors, caps, seed)


def prepare_data(
    policy: Policy, cfg: RunConfig, tokenizer: Tokenizer, warn: Callable[[str], None] = print
) -> tuple[dict[str, TokenArm], dict[str, str], Mixer]:
    """The trainer's whole check of a policy against this machine's data, and what it yields: the
    token arms that are available, why the others are not, and the mixer over the available ones.
    Raises (naming the policy and what is wrong) when no arm has data, when an arm has too few tokens,
    or when the arms left cannot satisfy the floors and caps. The trainer builds its data with this, and
    a pivot runs it on the new policy before it touches anything, so both refuse the same policies."""
    arms, unavailable = load_arms(policy, cfg, tokenizer, warn)
    return arms, unavailable, make_mixer(policy, list(arms), cfg.train.seed)


def require_available(policy: Policy, unavailable: dict[str, str], what: str) -> None:
    """A pivot or a new run starts with every arm of its policy: an arm without data at its first load
    is refused here, before anything is touched, rather than trained without (and recorded, by a
    trainer, in data.jsonl)."""
    if unavailable:
        arms = "; ".join(f"arm {a!r} is unavailable ({why})" for a, why in unavailable.items())
        raise ConfigError(
            f"policy {policy.name!r}: {arms}: {what} is refused before anything is touched (a relative "
            "path is the policy file's folder's); fix the paths or remove the arm"
        )


def windows(
    tokens: np.ndarray | ShardedTokens, offsets: np.ndarray, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(tokens, ShardedTokens):
        chunk = torch.from_numpy(tokens.rows(offsets, block_size + 1))
    else:
        idx = offsets[:, None] + np.arange(block_size + 1)[None, :]
        chunk = torch.from_numpy(tokens[idx].astype(np.int64))
    return chunk[:, :-1], chunk[:, 1:]


class DataPipeline:
    def __init__(
        self,
        cfg: RunConfig,
        policy: Policy,
        warn: Callable[[str], None] = print,
        tokenizer: Tokenizer | None = None,
    ):
        self.cfg = cfg
        self.policy = policy
        self.tokenizer: Tokenizer = tokenizer or ByteTokenizer()
        self.arms, self.unavailable, self.mixer = prepare_data(policy, cfg, self.tokenizer, warn)
        self.store: BanditStore | None = None

    @classmethod
    def for_run(cls, run: RunDir, cfg: RunConfig, warn: Callable[[str], None] = print) -> DataPipeline:
        """The pipeline of a run directory: its policy in force, its frozen tokenizer, its bandit store."""
        pipeline = cls(cfg, read_policy(run), warn, run_tokenizer(run, cfg))
        pipeline.store = BanditStore(
            run,
            pipeline.policy,
            cfg.train.checkpoint_every,
            pipeline.unavailable,
            warn,
            cfg.retention,
            cfg.train.guard,
        )
        return pipeline

    def resume(self, step: int) -> None:
        """Restore the bandit of checkpoint `step` (0: a new run) before the first batch is drawn, and
        record in the run what changed in its data since the last start (data/changes.py)."""
        self.store.restore(self.mixer, step)
        record_data_changes(self.store.run, self.arms, self.unavailable, step, self.store.warn, self.policy)

    def rewind(self, step: int) -> None:
        """The mixer as checkpoint `step` left it (0: a fresh one), for a rollback in the same process:
        built anew and restored, as a trainer starting from that checkpoint would build it."""
        self.mixer = make_mixer(self.policy, list(self.arms), self.cfg.train.seed)
        self.store.restore(self.mixer, step)

    def save_state(self, step: int) -> None:
        """Write .state.json for `step`; the trainer calls it just before writing checkpoint `step`."""
        self.store.save(self.mixer, step)

    def batch(self, step: int, position: int | None = None) -> Batch:
        """The batch of `step`, drawn at data position `position` (default: the step itself). The
        divergence guard moves the position past batches it skips (guard_events.Remedies); the mixer
        is still asked and told by step, so its bookkeeping is the same either way."""
        rng = step_rng(self.cfg.train.seed, step if position is None else position)
        arm = self.arms[self.mixer.choose(step, rng)]
        T = self.cfg.model.block_size
        offsets = rng.integers(0, len(arm.train) - T - 1, size=self.cfg.train.batch_size)
        x, y = windows(arm.train, offsets, T)
        return Batch(x, y, arm.name)

    def observe(self, step: int, arm: str, loss: float) -> None:
        self.mixer.observe(step, arm, loss)

    def val_batch(self, arm: str, n_seqs: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """A fixed held-out batch of an arm: the same for every run and step that asks."""
        val = self.arms[arm].val
        T = self.cfg.model.block_size
        rng = np.random.default_rng([seed, len(val)])
        return windows(val, rng.integers(0, len(val) - T - 1, size=n_seqs), T)
