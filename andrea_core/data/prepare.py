"""`andrea data prepare` and `andrea data stats`: build the token caches ahead of a run, and say what a
run of the config's length will make of each arm.

A long tokenization should not happen inside a flow run that holds a GPU slot: `prepare` builds every
arm's cache now, on this machine, keyed exactly as the trainer keys it (source fingerprint, tokenizer
id, validation fraction), so the trainer finds it built. The target is a run directory (its frozen
config, policy and tokenizer) or a policy with `--config` (a per-run BPE is trained the way run
creation trains it: the same sources give the same tokenizer, hence the same caches).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from andrea_core.config import ConfigError, RunConfig, load_run_config
from andrea_core.data.pipeline import DataPipeline
from andrea_core.data.policy import Policy, load_policy, read_policy
from andrea_core.data.tokens import BPETokenizer, ByteTokenizer, Tokenizer, new_run_tokenizer, run_tokenizer
from andrea_core.run.record import read_run
from andrea_core.run.rundir import RUN_YAML, RunDir


@dataclass
class Target:
    what: str  # "run <url>" or "policy <name>"
    policy: Policy
    cfg: RunConfig
    tokenizer: Tokenizer


def resolve_target(target: str, config: str | None = None) -> Target:
    """A run directory (with its run.yaml), or a policy (a name under configs/policies or a path)."""
    run = RunDir(target)
    if run.exists(RUN_YAML):
        if config:
            raise ConfigError(f"{run.url} is a run: it has its frozen config; drop --config")
        cfg = read_run(run).config
        return Target(f"run {run.url}", read_policy(run), cfg, run_tokenizer(run, cfg))
    try:
        policy, _ = load_policy(target)
    except ConfigError as e:
        raise ConfigError(f"{target}: neither a run directory (no {RUN_YAML}) nor a policy: {e}") from None
    if not config:
        raise ConfigError(f"policy {policy.name!r}: give --config (the run config: tokenizer, model, length)")
    cfg = load_run_config(config)
    frozen = new_run_tokenizer(policy, cfg)
    tok: Tokenizer = (
        ByteTokenizer()
        if frozen is None
        else BPETokenizer(frozen, "bpe" if cfg.data.tokenizer == "bpe" else "hf")
    )
    if tok.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"a tokenizer of {tok.vocab_size} tokens exceeds model.vocab_size {cfg.model.vocab_size}"
        )
    return Target(f"policy {policy.name!r} under config {cfg.name!r}", policy, cfg, tok)


def arm_stats(target: Target, pipeline: DataPipeline) -> list[dict[str, Any]]:
    """Per arm: documents, tokens, cache size, and the passes over its training tokens that a run of
    the config's length makes at the arm's floor and cap (and at the mixer's starting share)."""
    cfg = target.cfg
    run_tokens = cfg.train.max_steps * cfg.train.batch_size * cfg.model.block_size
    p = dict(zip(pipeline.mixer.arms, pipeline.mixer.probabilities(), strict=True))
    rows = []
    for spec in target.policy.arms:
        arm = pipeline.arms.get(spec.name)
        if arm is None:
            rows.append({"arm": spec.name, "kind": spec.kind, "unavailable": pipeline.unavailable[spec.name]})
            continue
        train, val = len(arm.train), len(arm.val)
        cache_bytes = arm.info.get("cache_bytes", arm.train.nbytes + arm.val.nbytes)
        rows.append(
            {
                "arm": spec.name,
                "kind": spec.kind,
                "documents": arm.info.get("documents"),
                "bad_records": arm.info.get("bad", 0),
                "split_documents": arm.info.get("split_documents", 0),
                "train_tokens": train,
                "val_tokens": val,
                "cache_bytes": int(cache_bytes),
                "share_floor": spec.floor,
                "share_cap": spec.cap,
                "share_start": float(p[spec.name]),
                "passes_at_floor": spec.floor * run_tokens / train,
                "passes_at_cap": spec.cap * run_tokens / train,
                "passes_at_start": float(p[spec.name]) * run_tokens / train,
            }
        )
    return rows


def format_stats(target: Target, rows: list[dict[str, Any]]) -> str:
    cfg = target.cfg
    run_tokens = cfg.train.max_steps * cfg.train.batch_size * cfg.model.block_size
    lines = [
        f"{target.what}: tokenizer {target.tokenizer.id}; a run of {cfg.train.max_steps:,} steps x "
        f"{cfg.train.batch_size} x {cfg.model.block_size} tokens = {run_tokens:,} tokens",
        f"{'arm':<20} {'kind':<13} {'documents':>11} {'train tokens':>14} {'val tokens':>12} {'cache MB':>10}"
        f"  passes at floor / start / cap",
    ]
    for r in rows:
        if "unavailable" in r:
            lines.append(f"{r['arm']:<20} {r['kind']:<13} unavailable: {r['unavailable']}")
            continue
        docs = "-" if r["documents"] is None else f"{r['documents']:,}"
        lines.append(
            f"{r['arm']:<20} {r['kind']:<13} {docs:>11} {r['train_tokens']:>14,} {r['val_tokens']:>12,} "
            f"{r['cache_bytes'] / 1e6:>10,.1f}  {r['passes_at_floor']:.3g} / {r['passes_at_start']:.3g} / "
            f"{r['passes_at_cap']:.3g}  (share {r['share_floor']:g} / {r['share_start']:.3g} / "
            f"{r['share_cap']:g})"
        )
        if r["bad_records"]:
            lines[-1] += f"  [{r['bad_records']:,} bad records skipped]"
        if r["split_documents"]:
            lines[-1] += f"  [{r['split_documents']:,} documents cut without an exact cut]"
    return "\n".join(lines)


def prepare(target: Target, warn: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Build (or find) every arm's cache; the per-arm stats of what was built."""
    pipeline = DataPipeline(target.cfg, target.policy, warn, target.tokenizer)
    return arm_stats(target, pipeline)
