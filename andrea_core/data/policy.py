"""Data policies: the arms a run draws from, with their floors and caps, loaded from YAML.

A policy is rejected before any work starts if it cannot be satisfied: floors summing above 1 or caps
below 1 leave no distribution that meets them all.

An arm's relative paths (and a tokens arm's relative tokenizer path) are the policy file's: load_policy
resolves them once, against the folder the file is in, and the text it returns (what a run installs as
its policy.yaml) holds them as absolute paths. A trainer started anywhere (a detached one starts in the
repository root) then reads the files that were checked, not whatever its working folder holds.
"""

from __future__ import annotations

import hashlib
import json
import keyword
import math
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import yaml

from andrea_core.config import (
    ConfigError,
    build_dataclass,
    check_limit,
    load_yaml,
    resolve_config_path,
)
from andrea_core.run.rundir import POLICY_YAML, RunDir

# The user's own data, over fsspec URLs (andrea_core/data/corpora.py), beside the embedded defaults.
CORPUS_KINDS = ("text", "jsonl", "parquet", "tokens")
ARM_KINDS = ("python-stdlib", "docstrings", "prose", *CORPUS_KINDS)
MIXERS = ("uniform", "exp3")
# An arm's name (and a policy's) becomes part of file names (its token cache) and of artifacts: no path
# separators, no hidden or relative names, nothing a shell or a markdown renderer reads specially.
ARM_NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}")
ARM_NAME_RULE = "1 to 64 letters, digits, '-', '_' or '.', not starting with '.'"


def is_plain_package_name(name: str) -> bool:
    """A top-level package name as `import NAME` takes it: dotted names would need their parents
    imported to be found, which runs their code."""
    return name.isascii() and name.isidentifier() and not keyword.iskeyword(name)


@dataclass(frozen=True)
class ArmSpec:
    name: str
    kind: str
    floor: float = 0.0
    cap: float = 1.0
    paths: list[str] = field(default_factory=list)  # prose: folders or files; empty: the kind's default
    packages: list[str] = field(default_factory=list)  # docstrings: installed packages to read
    field: str = "text"  # jsonl: the field holding each document
    column: str = "text"  # parquet: the column holding each document
    tokenizer: str = ""  # tokens: the tokenizer its shards were made with (bytes, or a tokenizer.json)


# Arm fields added after policies were first hashed: left out of the hash at their defaults, so that a
# policy written before them keeps its hash (and a running run its bandit state).
_LATER_ARM_DEFAULTS = {"field": "text", "column": "text", "tokenizer": ""}


@dataclass(frozen=True)
class Policy:
    name: str
    arms: list[ArmSpec]
    mixer: str = "uniform"
    # EXP3 knobs (see mixer.Exp3Mixer). Exploration decays as min(1/K, sqrt(ln K / (K t))) (Online Data
    # Mixing); reward_ema is the per-round decay of the importance-weighted reward estimate, baseline_ema
    # the per-pull rate of each arm's loss baseline, eta the inverse temperature on normalised rewards.
    reward_ema: float = 0.1
    baseline_ema: float = 0.05
    eta: float = 4.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def hash(self) -> str:
        """Identifies the policy a bandit state belongs to: a state from another policy is not loaded."""
        doc = self.to_dict()
        for arm in doc["arms"]:
            for k, default in _LATER_ARM_DEFAULTS.items():
                if arm.get(k) == default:
                    del arm[k]
        canon = json.dumps(doc, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:16]

    def arm(self, name: str) -> ArmSpec:
        return next(a for a in self.arms if a.name == name)


def parse_policy(raw: Any, source: str) -> Policy:
    policy = build_dataclass(Policy, raw, source)
    if not ARM_NAME_RE.fullmatch(policy.name):  # shown by status, the dashboard, pivots and artifacts
        raise ConfigError(f"{source}: name: {policy.name!r} must be {ARM_NAME_RULE}")
    arms = policy.arms
    if not arms:
        raise ConfigError(f"{source}: arms: must list at least one arm")
    check_limit(len(arms), "ANDREA_MAX_ARMS", f"{source}: arms: {len(arms)} arms")
    for i, a in enumerate(arms):
        if not ARM_NAME_RE.fullmatch(a.name):
            raise ConfigError(f"{source}: arms[{i}].name: {a.name!r} must be {ARM_NAME_RULE}")
        for j, pkg in enumerate(a.packages):
            if not is_plain_package_name(pkg):
                raise ConfigError(
                    f"{source}: arms[{i}].packages[{j}]: {pkg!r} is not a plain package name "
                    "(a top-level import name such as numpy; dotted names and paths are refused)"
                )
    names = [a.name for a in arms]
    if len(set(names)) != len(names):
        raise ConfigError(f"{source}: arms: duplicate arm names in {names}")
    for i, a in enumerate(arms):
        if a.kind not in ARM_KINDS:
            raise ConfigError(f"{source}: arms[{i}].kind: {a.kind!r} is not one of {ARM_KINDS}")
        if not 0.0 <= a.floor <= a.cap <= 1.0:
            raise ConfigError(
                f"{source}: arms[{i}] ({a.name}): need 0 <= floor <= cap <= 1, "
                f"got floor {a.floor} cap {a.cap}"
            )
        if a.kind in CORPUS_KINDS and not a.paths:
            raise ConfigError(
                f"{source}: arms[{i}].paths: a {a.kind} arm needs paths (files, folders, globs, URLs)"
            )
        if a.kind == "tokens" and not a.tokenizer:
            raise ConfigError(
                f"{source}: arms[{i}].tokenizer: a tokens arm declares the tokenizer its shards were made "
                "with (bytes, or the path or URL of that tokenizer.json)"
            )
    if policy.mixer not in MIXERS:
        raise ConfigError(f"{source}: mixer: {policy.mixer!r} is not one of {MIXERS}")
    for knob in ("reward_ema", "baseline_ema"):
        if not 0.0 < getattr(policy, knob) <= 1.0:  # NaN fails every comparison: refused here too
            raise ConfigError(f"{source}: {knob}: must be in (0, 1], got {getattr(policy, knob)}")
    # An infinite eta makes every softmax weight NaN: every draw would pick arm 0, bounds ignored.
    if not (math.isfinite(policy.eta) and policy.eta > 0.0):
        raise ConfigError(f"{source}: eta: must be a finite positive number, got {policy.eta}")
    check_feasible([a.floor for a in arms], [a.cap for a in arms], source, names)
    return policy


def check_feasible(
    floors: list[float], caps: list[float], source: str, names: list[str] | None = None
) -> None:
    """No distribution meets floors summing above 1 or caps summing below 1: say which and why."""
    names = names or [f"arm {i}" for i in range(len(floors))]
    floor_sum, cap_sum = sum(floors), sum(caps)
    if floor_sum > 1.0 + 1e-9:
        terms = " + ".join(f"{n} {f:g}" for n, f in zip(names, floors, strict=True))
        raise ConfigError(f"{source}: infeasible policy: floors sum to {floor_sum:.4g} > 1 ({terms})")
    if cap_sum < 1.0 - 1e-9:
        terms = " + ".join(f"{n} {c:g}" for n, c in zip(names, caps, strict=True))
        raise ConfigError(f"{source}: infeasible policy: caps sum to {cap_sum:.4g} < 1 ({terms})")


def live_caps(policy: Policy, available: list[str]) -> tuple[list[float], float]:
    """The caps a mixer over the `available` arms uses, and the factor they were scaled by (1.0: the
    policy's own). An unavailable arm's floor is released; if its absence leaves the others' caps
    summing below 1 (no distribution over them could meet them), each is multiplied by one factor,
    1 / their sum, so that they sum to 1: the arms left are then drawn in proportion to their caps
    until the arm returns, when the policy's caps hold again (the next start computes them anew). A
    weeks-long run trains on rather than wait for a person because a mount went away."""
    caps = [policy.arm(a).cap for a in available]
    total = sum(caps)
    if len(available) == len(policy.arms) or total >= 1.0 - 1e-9 or total <= 0.0:
        return caps, 1.0
    return [c / total for c in caps], 1.0 / total


def _is_relative_path(value: Any) -> bool:
    return isinstance(value, str) and bool(value) and "://" not in value and not os.path.isabs(value)


def freeze_relative_paths(raw: Any, folder: str) -> bool:
    """Resolve, in place, the relative paths of a policy's arms (paths, a tokens arm's tokenizer file)
    against `folder`; True if any was. Anything that is not a plain policy is left to parse_policy."""
    changed = False
    arms = raw.get("arms") if isinstance(raw, dict) else None
    for arm in arms if isinstance(arms, list) else []:
        if not isinstance(arm, dict):
            continue
        paths = arm.get("paths")
        if isinstance(paths, list) and any(_is_relative_path(p) for p in paths):
            arm["paths"] = [os.path.join(folder, p) if _is_relative_path(p) else p for p in paths]
            changed = True
        tok = arm.get("tokenizer")
        if arm.get("kind") == "tokens" and _is_relative_path(tok) and tok.endswith(".json"):
            arm["tokenizer"] = os.path.join(folder, tok)
            changed = True
    return changed


def load_policy(name_or_path: str) -> tuple[Policy, str]:
    """The parsed policy and its YAML text (installed as the run's policy.yaml): verbatim, or, where
    its arms name relative paths, the same policy with those resolved against the file's folder."""
    path = resolve_config_path(name_or_path, "policies")
    size = path.stat().st_size
    check_limit(size, "ANDREA_MAX_POLICY_BYTES", f"{path}: {size} bytes")
    try:
        text = path.read_bytes().decode()
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
    raw = load_yaml(text, str(path))
    folder = os.path.dirname(os.path.abspath(path))
    if freeze_relative_paths(raw, folder):
        text = "# relative paths resolved against the policy file's folder\n" + yaml.safe_dump(
            raw, sort_keys=False
        )
    return parse_policy(raw, str(path)), text


def read_policy(run: RunDir) -> Policy:
    source = run.path(POLICY_YAML)
    return parse_policy(load_yaml(run.read_text(POLICY_YAML), source), source)


class SourceUnavailable(RuntimeError):
    """An arm's source is gone or empty on this machine (the zombie-arm case)."""
