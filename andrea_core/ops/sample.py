"""`andrea sample`: text from a checkpoint, on the CPU or a GPU, through the model's own `generate`.

The prompt is encoded with the run's frozen tokenizer (raw bytes, or its tokenizer.json), and the
sampling draws only from a torch.Generator seeded with `seed`: the same checkpoint, prompt, settings
and seed give the same text on the same device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from andrea_core.config import ConfigError
from andrea_core.data.tokens import run_tokenizer
from andrea_core.model.gpt import GPT
from andrea_core.model.weights import load_model
from andrea_core.run.record import read_weights


@dataclass
class Sample:
    run: str
    step: int
    device: str
    prompt: str
    completion: str
    settings: dict

    def settings_line(self) -> str:
        """What produced the text, as the operator reads it: `RUN step N on cpu: 200 tokens, ...`."""
        s = self.settings
        how = (
            "greedy (temperature 0)"
            if s["temperature"] == 0
            else f"temperature {s['temperature']:g}, top-k {s['top_k'] or 'off'}, seed {s['seed']}"
        )
        return f"{self.run} step {self.step} on {self.device}: {s['tokens']} tokens, {how}"


@contextlib.contextmanager
def top_k_only(model: GPT, k: int | None) -> Iterator[None]:
    """While open, the head's logits outside each position's k largest are -inf, so that whatever
    `generate` samples from (all of its softmax) is restricted to the top k. A hook on the head rather
    than a second sampling loop: `generate` stays the one place tokens are drawn."""
    if k is None or k >= model.cfg.vocab_size:
        yield
        return

    def keep_top_k(module, inputs, logits: torch.Tensor) -> torch.Tensor:
        kth = torch.topk(logits, k, dim=-1).values[..., -1:]
        return logits.masked_fill(logits < kth, float("-inf"))

    handle = model.head.register_forward_hook(keep_top_k)
    try:
        yield
    finally:
        handle.remove()


def sample(
    run_url: str,
    prompt: str,
    *,
    step: int | None = None,
    tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = None,
    seed: int = 0,
    device: str = "auto",
    warn: Callable[[str], None] | None = None,
) -> Sample:
    """Continue `prompt` by `tokens` tokens from the run's checkpoint at `step` (default: newest valid)."""
    from andrea_core.model.device import pick_device

    if tokens < 1:
        raise ConfigError(f"--tokens {tokens}: must be at least 1")
    if not temperature >= 0:  # NaN too
        raise ConfigError(f"--temperature {temperature}: must be 0 (greedy) or positive")
    if top_k is not None and top_k < 1:
        raise ConfigError(f"--top-k {top_k}: must be at least 1")
    if not prompt:
        raise ConfigError("--prompt is empty: give the text to continue")
    device = pick_device(device)
    weights = read_weights(run_url, step, warn=warn)
    tokenizer = run_tokenizer(weights.run, weights.record.config)
    ids = tokenizer.encode(prompt)
    model = load_model(weights.model_config, weights.checkpoint, device)
    generator = torch.Generator(device=device).manual_seed(seed)
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    # Temperature 0 is greedy: only the likeliest token is left to draw (the seed no longer matters).
    with top_k_only(model, 1 if temperature == 0 else top_k):
        out = model.generate(idx, tokens, temperature=temperature or 1.0, generator=generator)
    settings = {"tokens": tokens, "temperature": temperature, "top_k": top_k, "seed": seed}
    completion = tokenizer.decode(out[0, len(ids) :].tolist())
    return Sample(weights.run.url, weights.checkpoint.step, device, prompt, completion, settings)
