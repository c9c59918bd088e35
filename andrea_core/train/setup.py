"""Create a run directory and prepare one for training: run.yaml frozen, policy and tokenizer installed.

Takes a RunConfig and a RunDir; the trainer and `andrea fork` call it."""

from __future__ import annotations

import time

from andrea_core.config import ConfigError, RunConfig, load_run_config, load_yaml, setting_arg
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


def train_config(
    run: RunDir, config: str | None, settings: dict | None = None, policy: str | None = None
) -> RunConfig | None:
    """The config `andrea train` (and the train flow) gives the trainer: `config` (a name or path) with
    `settings` (dotted keys, as `andrea fork --set`) and `policy` (`data.policy`) applied, each checked
    as the same value in a config file, a policy loaded as a pivot loads one. A setting on a run that
    exists is refused where it would change the frozen run.yaml, naming it and the command that would:
    `andrea fork` (`andrea pivot` for the policy). ConfigError before anything is written; None: no
    --config and nothing to apply (a resume)."""
    settings = dict(settings or {})
    if policy is not None:
        if "data.policy" in settings:
            raise ConfigError("--policy and --set data.policy: give the policy once")
        settings["data.policy"] = policy
    exists = run.exists(RUN_YAML)
    if not exists and config is None:
        if settings:
            raise ConfigError(
                f"{run.url}: no run here yet; pass --config to create one (settings apply to it)"
            )
        return None
    base = read_run(run).config if exists and config is None else load_run_config(config)
    cfg = base.with_overrides(settings, "andrea train --set") if settings else base
    if exists and settings:
        frozen = read_run(run).config
        changed = [key for key in settings if key in config_differences(cfg, frozen)]
        if changed:
            given = " ".join(
                f"--policy {settings[k]}"
                if k == "data.policy" and policy is not None
                else f"--set {setting_arg(k, settings[k])}"
                for k in changed
            )
            if changed == ["train.max_steps"]:
                target = settings["train.max_steps"]
                how = f"give it a new target: andrea train --run-dir {run.url} --max-steps {target}"
            elif changed == ["data.policy"]:
                how = f"pivot it: andrea pivot {run.url} --policy {settings['data.policy']}"
            else:
                how = f"fork it: andrea fork {run.url} --branch NAME {given}"
            raise ConfigError(
                f"{run.url}: {given} would change a run that exists ({RUN_YAML} is frozen); to train "
                f"with {'another policy' if changed == ['data.policy'] else 'that'}, {how}"
            )
        return cfg if config is not None else None
    if not exists and "data.policy" in settings:
        load_policy(cfg.data.policy)  # a bad policy name, path or file: refused now, as a pivot's is
    return cfg
