"""The mixers under the policy's floors and caps: projection, EXP3 draws, rewards, infeasible policies."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from conftest import REPO, andrea

from andrea_core.config import ConfigError
from andrea_core.data.mixer import Exp3Mixer, UniformMixer, project_capped_simplex
from andrea_core.data.pipeline import make_mixer, step_rng
from andrea_core.data.policy import live_caps, parse_policy

N_DRAWS = 10_000
# Each draw is a Bernoulli(p_t) with p_t inside [floor, cap]; the empirical share minus the mean of the
# p_t is a martingale with increments in an interval of length 1, so by Azuma-Hoeffding it exceeds
# 0.025 with probability at most exp(-2 * 10000 * 0.025**2) = 3.7e-6 per arm. A sampler that honours
# the bounds at every draw therefore stays within TOL of them.
TOL = 0.025


def simulate(mixer, loss_of, n: int = N_DRAWS, seed: int = 7):
    """Draw n arms as the pipeline does (one generator per step) and feed back synthetic losses.

    `loss_of(arm_index, its_pull_number, noise)` is the loss training on that arm would report.
    Returns the empirical shares and every distribution actually drawn from."""
    noise = np.random.default_rng(1)
    counts = np.zeros(len(mixer.arms))
    drawn = []
    for step in range(1, n + 1):
        drawn.append(mixer.probabilities().copy())
        arm = mixer.choose(step, step_rng(seed, step))
        i = mixer.arms.index(arm)
        counts[i] += 1
        mixer.observe(step, arm, loss_of(i, counts[i], noise))
    return counts / n, np.array(drawn)


def favourite_learns(i, pulls, noise):
    """Adversarial: arm 0's loss falls on every pull (reward > 0 every time); the others never move."""
    return 5.0 * 0.999**pulls if i == 0 else 3.0


def test_projection_is_the_nearest_point_of_the_capped_simplex():
    rng = np.random.default_rng(0)
    for _ in range(300):
        k = int(rng.integers(2, 7))
        floors = rng.dirichlet(np.ones(k)) * rng.uniform(0, 0.9)
        caps = np.minimum(1.0, floors + rng.uniform(0.05, 1.0, size=k))
        if caps.sum() < 1.0:
            caps = np.minimum(1.0, caps / caps.sum() + 1e-3)
        p = rng.normal(0.2, 0.5, size=k)  # anything, not even a distribution
        q = project_capped_simplex(p, floors, caps)
        assert abs(q.sum() - 1.0) < 1e-12
        assert np.all(q >= floors - 1e-12) and np.all(q <= caps + 1e-12)
        # Optimality (KKT): q = clip(p - tau, floors, caps) for one tau shared by all arms.
        free = (q > floors + 1e-9) & (q < caps - 1e-9)
        tau = float(np.mean((p - q)[free])) if free.any() else None
        if tau is not None:
            assert np.allclose((p - q)[free], tau, atol=1e-9)
            assert np.all(p[q <= floors + 1e-9] - tau <= floors[q <= floors + 1e-9] + 1e-9)
            assert np.all(p[q >= caps - 1e-9] - tau >= caps[q >= caps - 1e-9] - 1e-9)
    inside = np.array([0.2, 0.3, 0.5])
    assert np.array_equal(project_capped_simplex(inside, np.zeros(3), np.ones(3)), inside)


@pytest.mark.parametrize(
    "floors,caps",
    [
        ([0.1, 0.1, 0.1], [0.7, 0.6, 0.6]),  # configs/policies/default.yaml
        ([0.05, 0.3, 0.2], [0.3, 0.7, 0.6]),  # configs/policies/polish.yaml
        ([0.0, 0.2, 0.15, 0.1], [0.4, 1.0, 1.0, 1.0]),
    ],
)
def test_adversarial_exp3_stays_within_floors_and_caps_over_10000_draws(floors, caps):
    unconstrained, _ = simulate(
        Exp3Mixer([f"a{i}" for i in range(len(floors))], [0.0] * len(floors), [1.0] * len(floors)),
        favourite_learns,
    )
    assert unconstrained[0] > 0.9, f"not adversarial: unconstrained EXP3 gave arm 0 only {unconstrained[0]}"

    mixer = Exp3Mixer([f"a{i}" for i in range(len(floors))], floors, caps)
    shares, drawn = simulate(mixer, favourite_learns)
    # The bounds hold exactly at every single draw...
    assert np.all(drawn >= np.array(floors) - 1e-12) and np.all(drawn <= np.array(caps) + 1e-12)
    assert np.allclose(drawn.sum(axis=1), 1.0, atol=1e-12)
    # ...and so, up to sampling noise, over the 10,000 draws.
    for i, (f, c) in enumerate(zip(floors, caps, strict=True)):
        assert f - TOL <= shares[i] <= c + TOL, f"arm {i}: share {shares[i]} outside [{f}, {c}] +- {TOL}"
    assert shares[0] >= caps[0] - TOL, "the favourite should sit at its cap, the cap is what binds"
    assert sum(mixer.state_dict()["arms"][a]["pulls"] for a in mixer.arms) == N_DRAWS


def test_uniform_mixer_is_stratified_within_the_bounds():
    floors, caps = [0.0, 0.3, 0.0], [0.25, 1.0, 1.0]
    mixer = UniformMixer(["a", "b", "c"], floors, caps, seed=1337)
    assert np.allclose(mixer.probabilities(), [0.25, 0.375, 0.375])
    shares, _ = simulate(mixer, lambda i, n, noise: 1.0)
    # Low-discrepancy draws: off by a few draws in 10,000, not by sqrt(n) noise.
    assert np.max(np.abs(shares - mixer.probabilities())) < 0.002
    assert mixer.pulls == {
        "a": round(shares[0] * N_DRAWS),
        "b": round(shares[1] * N_DRAWS),
        "c": round(shares[2] * N_DRAWS),
    }


def test_reward_is_normalised_per_arm_so_a_high_entropy_arm_does_not_win_by_its_loss():
    levels = [6.0, 2.0]  # same learning curve, one arm 3x harder to predict (higher entropy)

    def same_progress(i, pulls, noise):
        return levels[i] * (0.5 + 0.5 * math.exp(-pulls / 1500)) * (1 + 0.02 * noise.standard_normal())

    shares, _ = simulate(Exp3Mixer(["prose", "code"], [0.0, 0.0], [1.0, 1.0]), same_progress)
    assert 0.4 < shares[0] < 0.6, f"the higher-loss arm took {shares[0]:.3f} of the draws"

    def noise_arm_vs_learners(i, pulls, noise):
        if i == 0:  # pure noise: the highest loss of all and nothing to learn
            return 5.5 * (1 + 0.05 * noise.standard_normal())
        return 3.0 * (0.5 + 0.5 * math.exp(-pulls / 1500)) * (1 + 0.02 * noise.standard_normal())

    shares, _ = simulate(Exp3Mixer(["noise", "code", "docs"], [0.0] * 3, [1.0] * 3), noise_arm_vs_learners)
    assert shares[0] < min(shares[1], shares[2]), f"the unlearnable arm won draws: {shares}"


def test_reward_is_importance_weighted_by_the_probability_actually_drawn():
    mixer = Exp3Mixer(["a", "b", "c"], [0.5, 0.0, 0.0], [1.0, 1.0, 1.0])  # the floor reshapes p
    for step, arm in enumerate(["a", "b", "c", "b", "c"], start=1):
        mixer.observe(step, arm, 3.0 - 0.1 * step)  # baselines and the reward scale are set now
    k, eps = 3, mixer.exploration()
    mixed = (1 - k * eps) * mixer.weights() / k + eps
    p = mixer.probabilities()
    assert p[1] < mixed[1] - 0.05, "the test needs a projection that moves b's probability"
    before = mixer.reward.copy()
    mixer.observe(6, "b", 0.01)  # a huge improvement: the normalised reward clips to exactly 1
    expected = (1 - mixer.reward_ema) * before
    expected[1] += mixer.reward_ema * 1.0 / p[1]
    assert np.array_equal(mixer.reward, expected)


def test_exploration_decays_as_in_online_data_mixing():
    mixer = Exp3Mixer(["a", "b", "c", "d"], [0.0] * 4, [1.0] * 4)
    for t in (1, 10, 100, 10_000):
        mixer.pulls[:] = [t, 0, 0, 0]
        assert mixer.exploration() == min(1 / 4, math.sqrt(math.log(4) / (4 * t)))
    assert Exp3Mixer(["only"], [0.0], [1.0]).probabilities().tolist() == [1.0]


def test_state_round_trips_through_json_bit_for_bit():
    arms, floors, caps = ["a", "b", "c"], [0.1, 0.1, 0.1], [0.7, 0.6, 0.6]
    first = Exp3Mixer(arms, floors, caps)
    simulate(first, favourite_learns, n=500)
    copy = Exp3Mixer(arms, floors, caps)
    copy.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert np.array_equal(copy.probabilities(), first.probabilities())
    a, _ = simulate(first, favourite_learns, n=300, seed=9)
    b, _ = simulate(copy, favourite_learns, n=300, seed=9)
    assert np.array_equal(a, b) and first.state_dict() == copy.state_dict()


def test_infeasible_policies_are_rejected_naming_the_sums():
    def policy(floors, caps):
        arms = [
            {"name": f"arm{i}", "kind": "prose", "floor": f, "cap": c}
            for i, (f, c) in enumerate(zip(floors, caps, strict=True))
        ]
        return parse_policy({"name": "p", "mixer": "exp3", "arms": arms}, "p.yaml")

    with pytest.raises(
        ConfigError,
        match=r"p.yaml: infeasible policy: floors sum to 1.2 > 1 \(arm0 0.5 \+ "
        r"arm1 0.4 \+ arm2 0.3\)",
    ):
        policy([0.5, 0.4, 0.3], [1.0, 1.0, 1.0])
    with pytest.raises(ConfigError, match=r"caps sum to 0.9 < 1 \(arm0 0.3 \+ arm1 0.3 \+ arm2 0.3\)"):
        policy([0.0, 0.0, 0.0], [0.3, 0.3, 0.3])
    # Feasible with all arms, not as they are once arm2's source is gone: the arms left cannot take all
    # the mass. Their caps are scaled by one factor to sum to 1 (issue 43.8: the run trains on).
    lopsided = policy([0.1, 0.1, 0.1], [0.4, 0.5, 0.6])
    caps, scale = live_caps(lopsided, ["arm0", "arm1"])
    assert caps == pytest.approx([0.4 / 0.9, 0.5 / 0.9]) and scale == pytest.approx(1 / 0.9)
    assert live_caps(lopsided, ["arm1", "arm2"]) == ([0.5, 0.6], 1.0)  # 1.1: the policy's own
    assert live_caps(lopsided, ["arm0", "arm1", "arm2"]) == ([0.4, 0.5, 0.6], 1.0)
    for kind in ("exp3", "uniform"):
        mixer = make_mixer(dataclasses.replace(lopsided, mixer=kind), ["arm0", "arm1"])
        assert mixer.probabilities() == pytest.approx([0.4 / 0.9, 0.5 / 0.9])


def test_infeasible_policy_stops_andrea_train_before_anything_is_written(tmp_path):
    policy = tmp_path / "greedy.yaml"
    policy.write_text(
        "name: greedy\nmixer: exp3\narms:\n"
        "  - {name: code, kind: python-stdlib, floor: 0.6}\n"
        "  - {name: docs, kind: prose, floor: 0.5}\n"
    )
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        (REPO / "configs" / "andrea-tiny.yaml")
        .read_text()
        .replace("policy: stdlib-only", f"policy: {policy}")
    )
    run = tmp_path / "run"
    proc = andrea("train", "--config", str(cfg), "--run-dir", str(run), check=False)
    assert proc.returncode == 2
    assert f"{policy}: infeasible policy: floors sum to 1.1 > 1 (code 0.6 + docs 0.5)" in proc.stderr
    assert not run.exists()
