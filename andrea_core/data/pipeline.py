"""The trainer's one view of data: `batch(step)` is a pure function of (seed, step, mixer state).

The step's generator is seeded with (seed, step) alone, so a resumed run draws exactly the batches
the uninterrupted run would, whatever happened to the process in between.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from andrea_core.config import RunConfig
from andrea_core.data.mixer import Mixer, UniformMixer
from andrea_core.data.policy import Policy
from andrea_core.data.sources import SourceUnavailable, open_source
from andrea_core.data.tokens import ByteTokenizer, Tokenizer, token_cache


@dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor
    arm: str


@dataclass
class TokenArm:
    name: str
    train: np.ndarray
    val: np.ndarray


def step_rng(seed: int, step: int, stream: int = 0) -> np.random.Generator:
    """The generator of one step; `stream` separates uses (batches 0, audit 1) that must not interact."""
    return np.random.default_rng([seed, step, stream])


def load_arms(
    policy: Policy, cfg: RunConfig, tokenizer: Tokenizer, warn: Callable[[str], None] = print
) -> dict[str, TokenArm]:
    """Token arrays for every arm whose source is available here; the others are reported and skipped."""
    arms = {}
    for spec in policy.arms:
        try:
            tokens = token_cache(open_source(spec, cfg.data.max_source_bytes), tokenizer)
        except (SourceUnavailable, ValueError) as e:
            warn(f"arm {spec.name!r} is unavailable and will not be drawn: {e}")
            continue
        n_val = max(cfg.model.block_size + 1, int(len(tokens) * cfg.data.val_fraction))
        arms[spec.name] = TokenArm(spec.name, tokens[:-n_val], tokens[-n_val:])
    if not arms:
        raise SourceUnavailable(f"policy {policy.name!r}: none of its arms has data on this machine")
    return arms


def make_mixer(policy: Policy, available: list[str]) -> Mixer:
    specs = [policy.arm(a) for a in available]
    return UniformMixer(available, [s.floor for s in specs], [s.cap for s in specs])


def windows(tokens: np.ndarray, offsets: np.ndarray, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = offsets[:, None] + np.arange(block_size + 1)[None, :]
    chunk = torch.from_numpy(tokens[idx].astype(np.int64))
    return chunk[:, :-1], chunk[:, 1:]


class DataPipeline:
    def __init__(self, cfg: RunConfig, policy: Policy, warn: Callable[[str], None] = print, tokenizer=None):
        self.cfg = cfg
        self.policy = policy
        self.tokenizer: Tokenizer = tokenizer or ByteTokenizer()
        self.arms = load_arms(policy, cfg, self.tokenizer, warn)
        self.mixer = make_mixer(policy, list(self.arms))

    def batch(self, step: int) -> Batch:
        rng = step_rng(self.cfg.train.seed, step)
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
