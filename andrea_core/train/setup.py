"""Create a run directory and prepare one for training: run.yaml frozen, policy and tokenizer installed.

Takes a RunConfig and a RunDir; the trainer and `andrea fork` call it."""

from __future__ import annotations

import time

from andrea_core.config import ConfigError, RunConfig, load_yaml
from andrea_core.data.policy import load_policy, parse_policy
from andrea_core.data.tokens import BPETokenizer, ByteTokenizer, new_run_tokenizer
from andrea_core.run.record import RunRecord, config_differences, environment, read_run
from andrea_core.run.rundir import POLICY_YAML, RUN_YAML, TOKENIZER_JSON, RunDir


def create_run(
    run: RunDir,
    cfg: RunConfig,
    policy_text: str | None = None,
    lineage: dict | None = None,
    tokenizer: bytes | None = None,
    check_data: bool = False,
) -> RunRecord:
    """Freeze `cfg` into a new run directory and install its data policy and, for a BPE run, its
    tokenizer: `tokenizer` (a fork keeps its parent's) or one trained now on the policy's sources.
    With `check_data` (a new run from the trainer) every arm must have data here, checked as the
    trainer will check it (and its caches built), before anything is written."""
    if run.exists(RUN_YAML):
        raise ConfigError(f"{run.url} already holds a run ({RUN_YAML} exists)")
    if policy_text is None:
        policy, policy_text = load_policy(cfg.data.policy)
    else:
        policy = parse_policy(load_yaml(policy_text, "policy"), "policy")
    if cfg.data.tokenizer != "bytes":
        if tokenizer is None:
            tokenizer = new_run_tokenizer(policy, cfg)  # before any write: a failure leaves no half-made run
        vocab = BPETokenizer(tokenizer).vocab_size
        if vocab > cfg.model.vocab_size:
            raise ConfigError(f"{run.url}: a tokenizer of {vocab} tokens exceeds model.vocab_size")
    if check_data:
        from andrea_core.data.pipeline import prepare_data, require_available  # torch: only here

        kind = "bpe" if cfg.data.tokenizer == "bpe" else "hf"
        tok = ByteTokenizer() if tokenizer is None else BPETokenizer(tokenizer, kind)
        _, unavailable, _ = prepare_data(policy, cfg, tok, print)
        require_available(policy, unavailable, "a new run")
    record = RunRecord(
        cfg,
        {"parent": None, "parent_step": None, "created_at": time.time(), **(lineage or {})},
        environment(),
    )
    run.makedirs()
    if cfg.data.tokenizer != "bytes":
        run.write_atomic(TOKENIZER_JSON, tokenizer)
    run.write_text(POLICY_YAML, policy_text)
    run.write_text(RUN_YAML, record.to_yaml())
    return record


def prepare_run(run: RunDir, cfg: RunConfig | None) -> RunConfig:
    """The run's frozen config: created from `cfg` for a new run, checked against it for an old one."""
    if not run.exists(RUN_YAML):
        if cfg is None:
            raise ConfigError(f"{run.url}: no run here yet; pass --config to create one")
        return create_run(run, cfg, check_data=True).config
    frozen = read_run(run).config
    if cfg is not None and cfg != frozen:
        diffs = ", ".join(config_differences(cfg, frozen))
        raise ConfigError(
            f"{run.url}: --config differs from the frozen {RUN_YAML} in {diffs}; "
            "resume without --config, or fork the run to change its config"
        )
    return frozen
