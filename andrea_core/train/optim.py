"""AdamW and the learning-rate schedule, a pure function of the step (lr_at needs no torch: a fork
checks a branch's schedule with it before anything else is loaded)."""

from __future__ import annotations

import math

from andrea_core.config import TrainConfig


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: str) -> torch.optim.AdamW:  # noqa: F821
    from andrea_core.train.adamw import AdamW  # torch's, without its import of torch._dynamo (adamw.py)

    # Decay matrices (linear and embedding weights), not norms: the usual GPT recipe.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # Fused on the CPU too (torch's fused CPU kernel, 2.4 and later): one pass per tensor instead of the
    # for-loop AdamW's dozen ops and temporaries per tensor, 1.3 ms instead of 4.7 a step at nanoGPT's
    # CPU shape (37 tensors, bench/peer_nanogpt.py). Elementwise, so its bits do not depend on the
    # thread count and a resume stays bit-exact; they differ from the for-loop's in the last place, so
    # a CPU run created before issue 31 continues to rounding, not to the bit, of its old course.
    return AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=True)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to lr, cosine decay to min_lr over lr_decay_steps, then min_lr."""
    if step <= cfg.warmup_steps:
        return cfg.lr * step / max(cfg.warmup_steps, 1)
    if step >= cfg.lr_decay_steps:
        return cfg.min_lr
    progress = (step - cfg.warmup_steps) / max(cfg.lr_decay_steps - cfg.warmup_steps, 1)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)
