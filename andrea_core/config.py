"""Run configuration: typed dataclasses loaded from YAML with strict validation.

A bad config is rejected before any work starts, with an error that names the field (`train.lr`),
what is wrong with it and the file it came from. Each document (run.yaml, a policy, overrides) is
checked by the one checker of documents (document.py) against a table derived from its dataclasses
(`schema_of`): types, nulls, finite numbers, nested sections; unknown keys are errors, not silently
ignored (a typo such as `lerning_rate` would otherwise train a week with the default). What relates
fields to each other (n_head divides n_embd, the guard's remedies) is `_check_ranges`.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import hashlib
import json
import os
import re
import threading
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from andrea_core.document import DocumentError, Field, check
from andrea_core.model_config import ModelConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO_ROOT / "configs"


class ConfigError(ValueError):
    """A config that cannot be used; the message names the field and the source."""


# Upper bounds on what an input may ask for, each overridable by its environment variable: a policy, a
# run.yaml or a run directory may come from someone else, and must not take a machine's memory, disk
# or hours before anything checks it. Generous for the shipped configs (andrea-120m is 0.12 billion).
LIMITS = {
    "ANDREA_MAX_PARAMS": 1_000_000_000,  # 16 GB of weights, gradients and Adam state in float32
    "ANDREA_MAX_ARMS": 64,  # each arm is tokenized into its own cache (up to data.max_source_bytes)
    "ANDREA_MAX_POLICY_BYTES": 1 << 20,
    "ANDREA_MAX_SIDECAR_BYTES": 64 << 20,  # run.yaml, policy.yaml, forks.jsonl, .samples.json ...
    "ANDREA_MAX_LOSS_LOG_BYTES": 512 << 20,  # about 4.5 million steps of .loss.json
    # A user's corpus: one JSON line at most this long (longer: a bad record, skipped as it streams), and
    # a compressed file expanding to at most this many times its stored size (more: refused by name).
    "ANDREA_MAX_LINE_BYTES": 64 << 20,
    "ANDREA_MAX_EXPANSION": 100,
    # The newest versions of a run's dashboard artifact that Prefect's database keeps (about 95 KB each;
    # one is published at every checkpoint of a run that may last weeks).
    "ANDREA_DASHBOARD_VERSIONS": 48,
}


def limit(name: str) -> int:
    """The bound `name` (one of LIMITS), from its environment variable when set."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return LIMITS[name]
    try:
        value = int(raw.replace("_", ""))
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: expected a whole number") from None
    if value <= 0:
        raise ConfigError(f"{name}={raw!r}: must be positive")
    return value


def check_limit(value: int, name: str, what: str) -> None:
    """Raise naming `what`, the bound and how to raise it, if `value` is above limit `name`."""
    bound = limit(name)
    if value > bound:
        raise ConfigError(f"{what}, more than the limit of {bound} (set {name} to allow more)")


@dataclass(frozen=True)
class GuardConfig:
    """The divergence guard (train/guard.py): what counts as a diverging step, and what is done.

    A step's loss is a spike when it is above the median of the last `window` steps by more than
    `loss_mads` median absolute deviations, AND more than `loss_ratio` times that median, AND more than
    `loss_floor` above it (the ratio and the floor keep a tiny run's noise from ever firing); likewise
    the gradient norm (before clipping). `consecutive` such steps in a row, or one non-finite loss or
    gradient norm, is a divergence. The loss is judged against the steps of its own arm (arms differ in
    difficulty; an arm with fewer than `min_history` steps of its own, a new arm after a pivot, against
    all arms' last `window`), and a loss above `loss_ceiling` times ln(model.vocab_size), far worse than
    predicting every token as equally likely, is a spike whatever came before (no history needed).
    Spikes that come and go (oscillation) and a slow drift are the sustained-rise rule's: the loss's
    level, the mean of its arm's last `rise_span` steps, above the lowest level of its last
    `rise_horizon` steps by more than `rise_margin` nats for `rise_steps` steps in a row. Defaults from
    measured clean runs (README "When a run diverges")."""

    enabled: bool = True
    window: int = 100  # steps in the running median and MAD
    min_history: int = 4  # observations before a spike can be judged at all
    consecutive: int = 3  # spiking steps in a row that make a divergence
    loss_mads: float = 12.0
    loss_ratio: float = 2.0
    loss_floor: float = 1.25  # nats above the median
    loss_ceiling: float = 1.5  # times ln(vocab_size), the loss of a uniform guess
    grad_mads: float = 30.0
    grad_ratio: float = 5.0
    grad_floor: float = 1.0
    rise_span: int = 50  # steps in the loss's level (a mean, per arm)
    rise_horizon: int = 500  # the level's best is the lowest of its last this many steps
    rise_margin: float = 1.0  # nats above that best
    rise_steps: int = 20  # steps in a row above it that make a divergence (0: the rule is off)
    # A fork branch that diverges: "stop" (exit 3: its divergence is the experiment's result, said as
    # "diverged at step N under train.lr=..."), or "remedy" (rolls back and remedies like a main run;
    # guard.jsonl records the learning rate it went on at, and from which step).
    in_branch: str = "stop"
    # The rollback: the newest valid checkpoint at least this many steps before the spike began.
    rollback_margin: int = 50
    skip_batches: bool = True  # skip the batches from the checkpoint to the divergence (data continues)
    lr_scale: float = 0.3  # the learning rate times this for `cooldown_steps` after the rollback (1: off)
    cooldown_steps: int = 1000
    # Each further rollback within `rollback_window` steps escalates: twice the batches skipped, the
    # scale applied once more, twice the cooldown. The (max_rollbacks + 1)-th stops the run (exit 3).
    max_rollbacks: int = 4
    rollback_window: int = 2000


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 1337
    batch_size: int = 8  # the global batch of one optimizer step, whatever grad_accum_steps is
    # Micro-batches per optimizer step (batch_size / grad_accum_steps sequences each): a batch too big
    # for the device's memory in one pass. A step is still one optimizer step, with the same data.
    grad_accum_steps: int = 1
    max_steps: int = 1000
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 100
    # The cosine decay length is frozen separately from max_steps so that the learning rate stays a
    # pure function of the step: extending a run with --max-steps must not rewrite its past schedule.
    lr_decay_steps: int = 10_000
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.999
    grad_clip: float = 1.0
    checkpoint_every: int = 100
    sample_every: int | None = None  # None: same as checkpoint_every, so every checkpoint has an audit
    log_every: int = 10
    # Part of the frozen run: CPU results are bit-reproducible only at a fixed intra-op thread count.
    num_threads: int = 2
    compile: bool = False
    compile_mode: str = "default"  # torch.compile's mode, when train.compile is true (COMPILE_MODES)
    # 0: the output head's logits of a whole micro-batch, then one cross-entropy. N > 0: head and loss
    # fused, N tokens at a time (model.LinearCrossEntropy): the logits never exist whole. Same loss and
    # gradients up to float rounding, so a run keeps the value it was created with.
    loss_chunk_tokens: int = 0
    # Write checkpoints on a background thread while training goes on (same bytes); false keeps the
    # synchronous writer, for comparison.
    async_checkpoint: bool = True
    # Run each sample audit on a thread (on CUDA, its own stream) from a copy of the weights, while
    # training goes on; the audit is the same, written a little later (audit.py).
    audit_async: bool = False
    # The sample audit's prompts; None: the first tokens of a few held-out documents of each arm (audit.py).
    audit_prompts: list[str] | None = None
    guard: GuardConfig = field(default_factory=GuardConfig)

    @property
    def audit_every(self) -> int:
        return self.sample_every or self.checkpoint_every


@dataclass(frozen=True)
class DataConfig:
    policy: str = "stdlib-only"  # a name under configs/policies/ or a path
    # "bytes" (vocab 256), "bpe" (trained per run) or a tokenizer.json path or URL; frozen in the run dir
    tokenizer: str = "bytes"
    val_fraction: float = 0.05
    max_source_bytes: int = 8_000_000  # per arm: bounds the token cache on small machines


@dataclass(frozen=True)
class RetentionConfig:
    """Which checkpoints stay once newer ones exist (see run/retention.py). Pivot boundaries
    and fork points are kept whatever these say."""

    keep_last: int | None = 5  # the newest N; None keeps every checkpoint
    keep_every: int | None = 10_000  # and every checkpoint whose step is a multiple of this


@dataclass(frozen=True)
class RunConfig:
    name: str
    model: ModelConfig
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def with_overrides(self, overrides: dict[str, Any], source: str = "overrides") -> RunConfig:
        """A copy with dotted-key overrides applied (`{"train.lr": 1e-3}`), validated like a file."""
        raw = self.to_dict()
        for dotted, value in overrides.items():
            node = raw
            *parents, leaf = dotted.split(".")
            for key in parents:
                if not isinstance(node.get(key), dict):
                    raise ConfigError(f"{source}: {dotted}: no such section {key!r}")
                node = node[key]
            if leaf not in node:
                raise ConfigError(f"{source}: {dotted}: unknown field")
            if isinstance(node[leaf], dict):
                # Replacing a whole section would reset every field of it not given to its default.
                raise ConfigError(
                    f"{source}: {dotted}: is a section, not a field; override its fields one by one "
                    f"({dotted}.FIELD=VALUE)"
                )
            node[leaf] = value
        return parse_run_config(raw, source)


_EXPONENT_RE = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")
MAX_SETTINGS, MAX_SETTING_CHARS = 256, 4096


def parse_setting(text: Any, where: str = "--set") -> tuple[str, Any]:
    """One `key=value` setting (`andrea fork --set`, `andrea train --set`, the train deployment's
    `settings`): the dotted key and the value as a YAML scalar (`1e-3` is the number an operator means,
    not YAML 1.1's string). Checked as a config file's value only when applied (RunConfig.with_overrides)."""
    if not isinstance(text, str) or len(text) > MAX_SETTING_CHARS:
        what = f"expected key=value text of at most {MAX_SETTING_CHARS} characters"
        raise ConfigError(f"{where} {str(text)[:60]!r}: {what}")
    key, eq, raw = text.partition("=")
    if not eq or not key.strip():
        raise ConfigError(f"{where} {text!r}: expected key=value, e.g. train.lr=3e-4")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ConfigError(f"{where} {text!r}: the value is not a YAML scalar ({type(e).__name__})") from None
    if isinstance(value, str) and _EXPONENT_RE.match(value):
        value = float(value)
    return key.strip(), value


def parse_settings(settings: Any, where: str = "--set") -> dict[str, Any]:
    """Settings as dotted keys and values, from `key=value` texts (parse_setting) or a mapping of keys to
    values (a deployment's JSON parameter); a key given twice is refused. None: no settings."""
    if settings is None:
        return {}
    if isinstance(settings, dict):
        items = list(settings.items())
        if not all(isinstance(k, str) and k.strip() and len(k) <= MAX_SETTING_CHARS for k, _ in items):
            raise ConfigError(f"{where}: every key must be a dotted field name, e.g. train.lr")
    elif isinstance(settings, list | tuple):
        items = [parse_setting(text, where) for text in settings]
    else:
        raise ConfigError(f"{where}: expected key=value texts or a mapping, got {type(settings).__name__}")
    if len(items) > MAX_SETTINGS:
        raise ConfigError(f"{where}: {len(items)} settings, more than {MAX_SETTINGS}")
    out: dict[str, Any] = {}
    for key, value in items:
        if key.strip() in out:
            raise ConfigError(f"{where}: {key.strip()} is given twice")
        out[key.strip()] = value
    return out


def setting_arg(key: str, value: Any) -> str:
    """The `key=value` text that parse_setting reads back as (key, value): the value as JSON, which
    YAML reads as the same scalar (a string quoted, 1e-05 the number)."""
    return f"{key}={json.dumps(value)}"


def _whole(value: Any) -> Any:
    """YAML reads 1e4 as a float; where a whole number is meant, a whole float is that number."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value


def _as_float(value: Any) -> Any:
    return float(value) if type(value) is int else value


def _field_of(tp: Any, required: bool) -> Field:
    """The document.py declaration of a dataclass field typed `tp` (int, float, str, bool, a nested
    dataclass, a list of one of those, any of them `| None`)."""
    null = False
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        null = type(None) in args
        tp = next(a for a in args if a is not type(None))
    if typing.get_origin(tp) is list:
        (item,) = typing.get_args(tp)
        return Field((list,), null=null, required=required, kind="a list", items=_field_of(item, True))
    if dataclasses.is_dataclass(tp):
        return Field((dict,), null=null, required=required, kind="a mapping", fields=schema_of(tp))
    if tp is float:
        return Field((float,), null=null, required=required, convert=_as_float, kind="float")
    if tp is int:
        return Field((int,), null=null, required=required, convert=_whole, kind="int")
    return Field((tp,), null=null, required=required, kind=tp.__name__)


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """typing.get_type_hints(cls), evaluated once a class (~1 ms each: every run.yaml read builds ~6)."""
    return typing.get_type_hints(cls)


@functools.cache
def schema_of(cls: type) -> dict[str, Field]:
    """The fields of a config dataclass as a document.py table: a field without a default is required."""
    hints = _type_hints(cls)
    return {
        f.name: _field_of(
            hints[f.name], f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )
        for f in dataclasses.fields(cls)
    }


def _built(cls: type, doc: dict[str, Any]) -> Any:
    """`cls` from a mapping schema_of(cls) has checked: nested documents become their dataclasses."""
    hints = _type_hints(cls)
    kwargs = {}
    for name, value in doc.items():
        tp = hints[name]
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        if value is not None and dataclasses.is_dataclass(tp):
            value = _built(tp, value)
        elif value is not None and typing.get_origin(tp) is list:
            (item,) = typing.get_args(tp)
            if dataclasses.is_dataclass(item):
                value = [_built(item, v) for v in value]
        kwargs[name] = value
    return cls(**kwargs)


def build_dataclass(cls: type, raw: Any, source: str) -> Any:
    """`cls` from a mapping read from `source` (run.yaml, a policy, overrides), checked by the one
    checker of documents (document.check, closed: unknown keys refused) against the table derived
    from the dataclass; ConfigError names the source and the dotted field."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping, got {type(raw).__name__}")
    try:
        doc = check(copy.deepcopy(raw), schema_of(cls), closed=True)
    except DocumentError as e:
        raise ConfigError(f"{source}: {e}") from None
    return _built(cls, doc)


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
MAX_VOCAB = 2**24  # beyond any real tokenizer; caches are uint16 up to 65536 ids, uint32 above


def estimated_n_params(m: ModelConfig) -> int:
    """The parameter count of GPT(m), by arithmetic: checked before torch allocates anything."""
    per_layer = 12 * m.n_embd * m.n_embd + 4 * m.n_embd  # qkv, proj, fc, proj; two LayerNorms
    return 2 * m.vocab_size * m.n_embd + m.block_size * m.n_embd + m.n_layer * per_layer + 2 * m.n_embd


def _check_ranges(cfg: RunConfig, source: str) -> None:
    m, t, d, r, g = cfg.model, cfg.train, cfg.data, cfg.retention, cfg.train.guard
    checks = [
        (m.vocab_size > 0, "model.vocab_size", "must be positive"),
        (
            m.vocab_size <= MAX_VOCAB,
            "model.vocab_size",
            f"must be at most {MAX_VOCAB} (token ids are uint32 at most)",
        ),
        (m.block_size > 0, "model.block_size", "must be positive"),
        (m.n_layer > 0, "model.n_layer", "must be positive"),
        (m.n_head > 0 and m.n_embd % m.n_head == 0, "model.n_head", "must divide model.n_embd"),
        (0.0 <= m.dropout < 1.0, "model.dropout", "must be in [0, 1)"),
        (t.batch_size > 0, "train.batch_size", "must be positive"),
        (
            t.grad_accum_steps > 0 and t.batch_size % t.grad_accum_steps == 0,
            "train.grad_accum_steps",
            f"must be a positive divisor of train.batch_size ({t.batch_size}), got {t.grad_accum_steps}",
        ),
        (t.max_steps > 0, "train.max_steps", "must be positive"),
        (t.lr > 0 and t.min_lr >= 0, "train.lr", "lr must be > 0 and min_lr >= 0"),
        (t.warmup_steps >= 0, "train.warmup_steps", "must be >= 0"),
        (t.lr_decay_steps > 0, "train.lr_decay_steps", "must be positive"),
        (0 <= t.beta1 < 1 and 0 <= t.beta2 < 1, "train.beta1/beta2", "must be in [0, 1)"),
        (t.checkpoint_every > 0, "train.checkpoint_every", "must be positive"),
        (t.sample_every is None or t.sample_every > 0, "train.sample_every", "must be positive"),
        (t.log_every > 0, "train.log_every", "must be positive"),
        (t.num_threads > 0, "train.num_threads", "must be positive"),
        (t.compile_mode in COMPILE_MODES, "train.compile_mode", f"must be one of {', '.join(COMPILE_MODES)}"),
        (t.loss_chunk_tokens >= 0, "train.loss_chunk_tokens", "must be >= 0 (0: no chunking)"),
        (g.window >= 3, "train.guard.window", "must be >= 3"),
        (1 <= g.min_history <= g.window, "train.guard.min_history", "must be in [1, train.guard.window]"),
        (g.consecutive >= 1, "train.guard.consecutive", "must be >= 1"),
        (g.loss_mads > 0 and g.grad_mads > 0, "train.guard.loss_mads/grad_mads", "must be > 0"),
        (g.loss_ratio > 1 and g.grad_ratio > 1, "train.guard.loss_ratio/grad_ratio", "must be > 1"),
        (g.loss_ceiling > 1, "train.guard.loss_ceiling", "must be > 1 (times ln(model.vocab_size))"),
        (g.loss_floor >= 0 and g.grad_floor >= 0, "train.guard.loss_floor/grad_floor", "must be >= 0"),
        (g.rollback_margin >= 0, "train.guard.rollback_margin", "must be >= 0"),
        (0 < g.lr_scale <= 1, "train.guard.lr_scale", "must be in (0, 1] (1: no learning-rate remedy)"),
        (g.cooldown_steps >= 0, "train.guard.cooldown_steps", "must be >= 0"),
        (g.max_rollbacks >= 1, "train.guard.max_rollbacks", "must be >= 1"),
        (g.rollback_window > 0, "train.guard.rollback_window", "must be positive"),
        (g.rise_span >= 2, "train.guard.rise_span", "must be >= 2"),
        (g.rise_horizon >= 1, "train.guard.rise_horizon", "must be >= 1"),
        (g.rise_margin > 0, "train.guard.rise_margin", "must be > 0 (nats)"),
        (g.rise_steps >= 0, "train.guard.rise_steps", "must be >= 0 (0: no sustained-rise rule)"),
        (g.in_branch in ("stop", "remedy"), "train.guard.in_branch", "must be 'stop' or 'remedy'"),
        (
            g.lr_scale**g.max_rollbacks >= 1e-6,
            "train.guard.lr_scale",
            f"to the power train.guard.max_rollbacks ({g.max_rollbacks}) must be at least 1e-6 (the "
            "smallest learning-rate factor guard.jsonl may carry)",
        ),
        (
            g.skip_batches or g.lr_scale < 1,
            "train.guard",
            "skip_batches false and lr_scale 1 leave a rollback no remedy: it would only diverge again "
            "(set enabled: false to turn the guard off)",
        ),
        (
            t.audit_prompts is None
            or 1 <= len(t.audit_prompts) <= 16
            and all(0 < len(p) <= 1000 for p in t.audit_prompts),
            "train.audit_prompts",
            "must be 1 to 16 non-empty prompts of at most 1000 characters (or null: held-out documents)",
        ),
        (
            d.tokenizer in ("bytes", "bpe") or d.tokenizer.endswith(".json"),
            "data.tokenizer",
            "must be 'bytes', 'bpe' or the path or URL of a Hugging Face tokenizer.json",
        ),
        (d.tokenizer != "bytes" or m.vocab_size == 256, "model.vocab_size", "must be 256 with bytes"),
        (0.0 < d.val_fraction < 0.5, "data.val_fraction", "must be in (0, 0.5)"),
        (d.max_source_bytes > 0, "data.max_source_bytes", "must be positive"),
        # Two, not one: the checkpoint a SIGTERM writes right after a pivot boundary must not push the
        # boundary out before the pivot has archived (and so protected) it.
        (r.keep_last is None or r.keep_last >= 2, "retention.keep_last", "must be >= 2 (or null: keep all)"),
        (r.keep_every is None or r.keep_every > 0, "retention.keep_every", "must be positive (or null)"),
    ]
    for ok, name, why in checks:
        if not ok:
            raise ConfigError(f"{source}: {name} {why}")
    n = estimated_n_params(m)
    check_limit(n, "ANDREA_MAX_PARAMS", f"{source}: model: about {n / 1e9:.1f} billion parameters ({n})")


def parse_run_config(raw: Any, source: str = "<config>") -> RunConfig:
    cfg = build_dataclass(RunConfig, raw, source)
    _check_ranges(cfg, source)
    return cfg


def resolve_config_path(name_or_path: str, subdir: str = "") -> Path:
    """A path as given if it exists, else a named file under configs/ (`andrea-tiny`)."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    named = CONFIG_DIR / subdir / f"{name_or_path}.yaml"
    if named.is_file():
        return named
    available = sorted(q.stem for q in (CONFIG_DIR / subdir).glob("*.yaml"))
    raise ConfigError(f"config {name_or_path!r} not found (a path, or one of: {', '.join(available)})")


_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")


# load_yaml keeps what the last _PARSES_KEPT texts it parsed gave, keyed by each text's sha256: a command
# reads run.yaml a dozen times, and PyYAML is pure Python (~40 ms a read of run.yaml; seconds to refuse
# a run.yaml nested 100,000 deep, at every read). A document is kept only for a text of at most
# _DOCUMENT_TEXT_MAX characters (its memory grows with the text); a refusal, a sentence, for any text.
_PARSES_KEPT, _DOCUMENT_TEXT_MAX = 16, 64 << 10
_parses: collections.OrderedDict[bytes, tuple[bool, Any]] = collections.OrderedDict()
_parses_lock = threading.Lock()


def _yaml_problem(e: yaml.YAMLError) -> str:
    """Why a text is not valid YAML, in words that never quote it."""
    if isinstance(e, yaml.reader.ReaderError):  # a character YAML does not allow (a binary file)
        return f"not valid YAML at character {e.position}: {e.reason}"
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    # PyYAML quotes what it found ('<scalar>', a tag, a character): keep the sentence, not the text.
    problem = _QUOTED.sub("...", getattr(e, "problem", None) or type(e).__name__)
    return f"not valid YAML{where}: {problem}"


def _parse(text: str) -> tuple[bool, Any]:
    """(True, the document) or (False, why it is not valid YAML): what `text` gave when last parsed."""
    key = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
    with _parses_lock:
        if key in _parses:
            _parses.move_to_end(key)
            return _parses[key]
    try:
        outcome = (True, yaml.safe_load(text))
    except RecursionError:
        outcome = (False, "not valid YAML: nested deeper than the parser allows")
    except yaml.YAMLError as e:
        outcome = (False, _yaml_problem(e))
    if not outcome[0] or len(text) <= _DOCUMENT_TEXT_MAX:
        with _parses_lock:
            _parses[key] = outcome
            while len(_parses) > _PARSES_KEPT:
                _parses.popitem(last=False)
    return outcome


def load_yaml(text: str, source: str) -> Any:
    """safe_load only. A parse error names the file, the position and what kind of error it is, and
    never quotes the text: a credentials file given by mistake must not reach logs and UI messages.
    What a text gave is reused, keyed by its sha256 (a file changed by one byte is parsed anew; a text
    nested deeper than the parser allows is refused from then on, whatever the caller's stack), and
    each caller gets its own deep copy of a document."""
    ok, document = _parse(text)
    if not ok:
        raise ConfigError(f"{source}: {document}")
    try:
        return copy.deepcopy(document)
    except RecursionError:  # nested near the limit, copied from a deeper stack than it was parsed at
        pass
    try:
        return yaml.safe_load(text)
    except RecursionError:
        raise ConfigError(f"{source}: not valid YAML: nested deeper than the parser allows") from None


def load_run_config(name_or_path: str) -> RunConfig:
    path = resolve_config_path(name_or_path)
    return parse_run_config(load_yaml(path.read_text(), str(path)), str(path))
