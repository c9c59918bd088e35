"""Data policies: the arms a run draws from, with their floors and caps, loaded from YAML.

A policy is rejected before any work starts if it cannot be satisfied: floors summing above 1 or caps
below 1 leave no distribution that meets them all.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from andrea_core.config import ConfigError, build_dataclass, load_yaml, resolve_config_path

ARM_KINDS = ("python-stdlib", "docstrings", "prose")
MIXERS = ("uniform", "exp3")


@dataclass(frozen=True)
class ArmSpec:
    name: str
    kind: str
    floor: float = 0.0
    cap: float = 1.0
    paths: list[str] = field(default_factory=list)  # prose: folders or files; empty: the kind's default
    packages: list[str] = field(default_factory=list)  # docstrings: installed packages to read


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
        canon = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:16]

    def arm(self, name: str) -> ArmSpec:
        return next(a for a in self.arms if a.name == name)


def parse_policy(raw: Any, source: str) -> Policy:
    try:
        policy = build_dataclass(Policy, raw, "")
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    arms = policy.arms
    if not arms:
        raise ConfigError(f"{source}: arms: must list at least one arm")
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


def load_policy(name_or_path: str) -> tuple[Policy, str]:
    """The parsed policy and its YAML text (installed verbatim as the run's policy.yaml)."""
    path = resolve_config_path(name_or_path, "policies")
    text = path.read_text()
    return parse_policy(load_yaml(text, str(path)), str(path)), text
