"""The ANDREA GPT: pre-norm transformer blocks, causal SDPA attention, an untied output head.

The parameter iterator order is the checkpoint order of the design (contract): token and position
embeddings, then each block's norms, attention and MLP, then the final norm and the output head.
Changing the order of the attributes below changes the checkpoint format.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from andrea_core.model_config import ModelConfig  # defined torch-free, still importable from here


class KVCache:
    """One attention layer's keys and values of the sequences being generated, preallocated to
    block_size positions: each new token then costs one query against the cached keys instead of a
    forward pass over the whole sequence."""

    def __init__(self, batch: int, n_head: int, head_dim: int, capacity: int, like: torch.Tensor):
        shape = (batch, n_head, capacity, head_dim)
        self.k = torch.empty(shape, dtype=like.dtype, device=like.device)
        self.v = torch.empty(shape, dtype=like.dtype, device=like.device)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new positions' keys and values; all of them so far."""
        end = self.length + k.shape[2]
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


class LinearCrossEntropy(torch.autograd.Function):
    """mean(cross_entropy(h @ weight.T, targets)), a chunk of tokens at a time, with its gradients
    computed on the way: the (tokens x vocabulary) logits, 6.6 GB in float32 at the 124M shape
    (32 x 1024 tokens, 50,304 ids), never exist whole, and nothing of them is kept for backward.
    The same matmuls as the plain head and loss (one forward, two backward), under the same autocast;
    equal to them up to float rounding."""

    @staticmethod
    def forward(
        ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int
    ) -> torch.Tensor:
        n = h.shape[0]
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros_like(weight, dtype=torch.float32)
        for start in range(0, n, chunk):
            hc, yc = h[start : start + chunk], targets[start : start + chunk]
            logits = (hc @ weight.t()).float()
            lse = torch.logsumexp(logits, dim=-1)
            loss += (lse - logits.gather(1, yc[:, None]).squeeze(1)).sum()
            # d(mean loss)/d(logits) = (softmax - one_hot) / n, in place of the logits.
            g = logits.sub_(lse[:, None]).exp_()
            g[torch.arange(len(yc), device=g.device), yc] -= 1.0
            g = g.div_(n)
            # Under autocast these matmuls run in its dtype, as the plain head's backward does.
            grad_h[start : start + chunk] = g @ weight
            grad_w += g.t() @ hc
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        return loss / n

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_loss, grad_w * grad_loss, None, None


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.dropout = cfg.dropout

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None, cache: KVCache | None = None
    ) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim): SDPA picks flash attention on CUDA when it can.
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            k, v = cache.append(k, v)
        if mask is None:  # training and plain inference: causal, no padding
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
            )
        else:  # generation (GPT.generate): the mask says which cached key each new query may see
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None, cache: KVCache | None = None
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask, cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        # Untied: the head gets its own matrix, so the checkpoint holds it separately.
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2's scaled init of the residual projections keeps the residual stream's variance flat.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, loss_chunk: int = 0
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Logits, and the mean cross-entropy against `targets` if given. With `loss_chunk` > 0 and
        targets, the head and the loss are computed together, `loss_chunk` tokens at a time
        (`LinearCrossEntropy`), and no logits are returned."""
        T = idx.shape[1]
        if T > self.cfg.block_size:
            raise ValueError(f"sequence of {T} tokens exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        if targets is not None and loss_chunk > 0:
            h, y = x.flatten(0, 1), targets.reshape(-1)
            return None, LinearCrossEntropy.apply(h, self.head.weight, y, loss_chunk)
        logits = self.head(x)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def _last_logits(
        self, idx: torch.Tensor, real: torch.Tensor, caches: list[KVCache] | None = None
    ) -> torch.Tensor:
        """Logits after the last column of left-padded rows. `idx` (B, T) are the columns not yet in
        `caches` (all of them without a cache); `real` (B, L) marks the real tokens among all L columns,
        cached ones included. Each row sees only its own real tokens, at positions counted from its
        first one, so a row computes what it would alone (up to float rounding)."""
        B, T = idx.shape
        L = real.shape[1]
        cols = torch.arange(L - T, L, device=idx.device)
        keys = torch.arange(L, device=idx.device)
        pos = (cols[None, :] - (~real).sum(dim=1, keepdim=True)).clamp(min=0)
        # A query sees the real keys up to itself, and itself: a padding query then has one key to
        # attend to (finite garbage no real query reads) instead of none (a NaN that would spread).
        causal = keys[None, :] <= cols[:, None]
        mask = causal[None] & (real[:, None, :] | (keys[None, :] == cols[:, None])[None])
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for i, block in enumerate(self.blocks):
            x = block(x, mask[:, None], caches[i] if caches is not None else None)
        return self.head(self.ln_f(x[:, -1]))

    @staticmethod
    def _uniforms(
        batch: int, n: int, generator: torch.Generator | Sequence[torch.Generator] | None, device
    ) -> torch.Tensor:
        if generator is None or isinstance(generator, torch.Generator):
            return torch.rand(batch, n, generator=generator, device=device)
        if len(generator) != batch:
            raise ValueError(f"{len(generator)} generators for a batch of {batch} rows")
        return torch.stack([torch.rand(n, generator=g, device=device) for g in generator])

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        generator: torch.Generator | Sequence[torch.Generator] | None = None,
        *,
        lengths: Sequence[int] | None = None,
        use_cache: bool = True,
    ) -> torch.Tensor:
        """Sample `max_new_tokens` after each row of `idx` (B, W); returns (B, W + max_new_tokens).

        Rows may be prompts of different lengths, left-padded: row i holds `lengths[i]` real tokens at
        its right end (default: all W). Each row is generated as it would be alone: padding is masked
        out of attention, positions count from the row's first real token, and a row that outgrows
        block_size keeps its newest block_size tokens (from then on the cache gives way to a forward
        pass over that window, since every position shifts).

        `generator` keeps sampling off the global RNG (and the training stream): one for the batch, or
        one per row, so that a row's tokens depend on its own generator alone and a batch gives what
        one-by-one generation gives. Sampling is by inverse CDF, with the uniform numbers of all steps
        drawn up front: row i's t-th token takes u[i, t].
        """
        B, W = idx.shape
        block = self.cfg.block_size
        device = idx.device
        n_real = torch.as_tensor(list(lengths) if lengths is not None else [W] * B, device=device)
        real = torch.arange(W, device=device)[None, :] >= (W - n_real)[:, None]
        u = self._uniforms(B, max_new_tokens, generator, device)
        caches = None
        if use_cache:
            head_dim = self.cfg.n_embd // self.cfg.n_head
            like = self.head.weight
            caches = [KVCache(B, self.cfg.n_head, head_dim, block, like) for _ in self.blocks]
        cached = 0  # columns of idx already in the caches
        for t in range(max_new_tokens):
            if caches is not None and idx.shape[1] <= block:
                logits = self._last_logits(idx[:, cached:], real, caches)
                cached = idx.shape[1]
            else:
                caches = None
                logits = self._last_logits(idx[:, -block:], real[:, -block:])
            cdf = F.softmax(logits.float() / max(temperature, 1e-5), dim=-1).cumsum(dim=-1)
            # Scaled by the total, u never lands past the last token with any probability.
            nxt = torch.searchsorted(cdf, u[:, t : t + 1] * cdf[:, -1:], right=True)
            idx = torch.cat([idx, nxt.clamp_(max=logits.shape[-1] - 1)], dim=1)
            real = torch.cat([real, torch.ones(B, 1, dtype=torch.bool, device=device)], dim=1)
        return idx
