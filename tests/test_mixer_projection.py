"""The capped-simplex projection is total over every feasible policy (issue 15.1), and the bandit's knobs
are finite (issue 15.13).

hypothesis is not installed here: a seeded generator draws random and adversarial cases instead, among
them floors and caps built from decimals that sum to exactly 1 on paper (0.2 + 0.4 + 0.3 + 0.1 is
1.0000000000000002 in floating point)."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from andrea_core.config import ConfigError
from andrea_core.data.mixer import Exp3Mixer, UniformMixer, project_capped_simplex
from andrea_core.data.pipeline import make_mixer
from andrea_core.data.policy import parse_policy

TOL = 1e-9  # check_feasible's slack: floors may sum to 1 + TOL, caps to 1 - TOL


def decimal_split(rng: np.random.Generator, k: int, total_hundredths: int = 100) -> np.ndarray:
    """k non-negative decimals of two digits whose exact (decimal) sum is total_hundredths / 100."""
    cuts = np.sort(rng.integers(0, total_hundredths + 1, size=k - 1))
    parts = np.diff(np.concatenate([[0], cuts, [total_hundredths]]))
    return np.array([float(f"{int(x) / 100:.2f}") for x in parts])


def random_case(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    k = int(rng.integers(1, 11))
    kind = rng.integers(0, 6)
    if kind == 0:  # floors exactly 1 by construction from decimals
        floors = decimal_split(rng, k)
        caps = np.minimum(1.0, floors + rng.uniform(0, 1, size=k) * rng.integers(0, 2, size=k))
    elif kind == 1:  # caps exactly 1 from decimals
        caps = decimal_split(rng, k)
        floors = caps * rng.uniform(0, 1, size=k) * rng.integers(0, 2, size=k)
    elif kind == 2:  # floor == cap for every arm: fixed proportions
        floors = caps = decimal_split(rng, k)
    elif kind == 3:  # floors at the edge of the tolerance, above and below
        floors = rng.dirichlet(np.ones(k)) * (1.0 + rng.choice([-1, 1]) * rng.uniform(0, TOL))
        caps = np.minimum(1.0, floors + rng.uniform(0, 0.5, size=k))
    elif kind == 4:  # caps at the edge of the tolerance
        caps = rng.dirichlet(np.ones(k)) * (1.0 + rng.choice([-1, 1]) * rng.uniform(0, TOL))
        caps = np.minimum(1.0, caps)
        floors = caps * rng.uniform(0, 1, size=k) * rng.integers(0, 2, size=k)
    else:  # anything feasible
        floors = rng.dirichlet(np.ones(k)) * rng.uniform(0, 1)
        caps = np.minimum(1.0, floors + rng.uniform(0, 1, size=k))
        if caps.sum() < 1.0:
            caps = np.minimum(1.0, caps / caps.sum() + 1e-3)
    floors = np.minimum(floors, caps)
    p_kind = rng.integers(0, 5)
    if p_kind == 0:
        p = rng.dirichlet(np.ones(k))
    elif p_kind == 1:
        p = rng.normal(0, 1e6, size=k)  # far off the simplex
    elif p_kind == 2:
        p = np.full(k, float(rng.choice([0.0, 1.0 / k, -3.0, 7.5])))  # all ties
    elif p_kind == 3:
        p = floors.copy()
    else:
        p = caps.copy()
    return p, floors, caps


def feasible(floors: np.ndarray, caps: np.ndarray) -> bool:
    return float(sum(floors)) <= 1.0 + TOL and float(sum(caps)) >= 1.0 - TOL


def test_floors_of_decimals_summing_to_one_are_returned_exactly():
    floors = np.array([0.2, 0.4, 0.3, 0.1])
    assert floors.sum() > 1.0  # 1.0000000000000002: the case of the issue
    for p in (np.full(4, 0.25), np.array([1.0, 0.0, 0.0, 0.0]), np.array([-5.0, 3.0, 2.0, 9.0])):
        q = project_capped_simplex(p, floors, np.ones(4))
        assert np.allclose(q, floors, rtol=0, atol=1e-15) and abs(q.sum() - 1.0) < 1e-15


def test_mixers_build_and_draw_under_floors_that_sum_to_one():
    """The issue's crash: the uniform mixer failed when built, EXP3 at its first probabilities()."""
    policy = parse_policy(
        {
            "name": "fixed",
            "mixer": "exp3",
            "arms": [
                {"name": f"a{i}", "kind": "prose", "floor": f} for i, f in enumerate([0.2, 0.4, 0.3, 0.1])
            ],
        },
        "fixed.yaml",
    )
    arms = [a.name for a in policy.arms]
    exp3 = make_mixer(policy, arms)
    assert np.allclose(exp3.probabilities(), [0.2, 0.4, 0.3, 0.1], atol=1e-15)
    uniform = UniformMixer(arms, [0.2, 0.4, 0.3, 0.1], [1.0] * 4)
    assert np.allclose(uniform.probabilities(), [0.2, 0.4, 0.3, 0.1], atol=1e-15)
    caps_exact = Exp3Mixer(["a", "b", "c"], [0.0] * 3, [0.1, 0.7, 0.2])  # caps sum to 1 exactly
    assert np.allclose(caps_exact.probabilities(), [0.1, 0.7, 0.2], atol=1e-15)


def test_projection_is_total_over_20000_random_and_adversarial_feasible_inputs():
    rng = np.random.default_rng(20_000)
    checked = 0
    while checked < 20_000:
        p, floors, caps = random_case(rng)
        if not feasible(floors, caps):
            continue
        q = project_capped_simplex(p, floors, caps)  # never raises
        assert np.all(np.isfinite(q)) and abs(q.sum() - 1.0) < 1e-12, (p, floors, caps, q)
        # Inside the bounds up to the tolerance the policy check allows (floors or caps scaled by it).
        assert np.all(q >= floors * (1 - 2 * TOL) - 1e-12) and np.all(q <= caps * (1 + 2 * TOL) + 1e-12)
        checked += 1


def test_a_non_finite_distribution_is_refused_not_drawn_from():
    with pytest.raises(ValueError, match="not finite"):
        project_capped_simplex(np.array([np.nan, 0.5]), np.zeros(2), np.ones(2))


@pytest.mark.parametrize(
    "knob,value",
    [
        ("eta", float("inf")),
        ("eta", float("nan")),
        ("eta", -1.0),
        ("reward_ema", float("nan")),
        ("baseline_ema", float("nan")),
        ("reward_ema", -0.1),
    ],
)
def test_non_finite_or_negative_knobs_are_refused_naming_the_field(knob, value):
    raw = {"name": "p", "mixer": "exp3", "arms": [{"name": "a", "kind": "prose"}], knob: value}
    # Non-finite: refused by the one checker of documents (document.py); negative: by the policy's bounds.
    why = f"{value!r} is not finite" if not math.isfinite(value) else ": must be"
    with pytest.raises(ConfigError, match=rf"^p\.yaml: {knob} ?{re.escape(why)}"):
        parse_policy(raw, "p.yaml")


@pytest.mark.parametrize("field", ["floor", "cap"])
def test_non_finite_floor_or_cap_is_refused_naming_the_arm(field):
    arm = {"name": "a", "kind": "prose", field: float("nan")}
    with pytest.raises(ConfigError, match=rf"^p\.yaml: arms\[0\]\.{field} nan is not finite$"):
        parse_policy({"name": "p", "arms": [arm]}, "p.yaml")


def test_eta_inf_from_yaml_is_refused():
    from andrea_core.config import load_yaml

    text = "name: p\nmixer: exp3\neta: .inf\narms:\n  - {name: a, kind: prose}\n"
    with pytest.raises(ConfigError, match=r"p\.yaml: eta inf is not finite"):
        parse_policy(load_yaml(text, "p.yaml"), "p.yaml")
