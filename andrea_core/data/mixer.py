"""Data mixers: choose the arm that feeds each batch, under the policy's floors and caps.

A mixer's draw must be a pure function of (seed, step, mixer state): it is handed the step's own
generator and keeps everything else it needs in `state_dict()`, which is saved with every checkpoint.
Every distribution a mixer draws from has been projected onto {floor <= p <= cap, sum p = 1}, so the
policy's bounds hold at every single draw, not only on average.

The trainer reports a step's loss one step late (trainer.py): observe(s) comes after choose(s+1) and
before choose(s+2), and after observe(s-1). A mixer that weighs an observation by the probability its
arm was drawn with must therefore remember that probability from choose(s); it is part of the state
saved with checkpoint s, whose observation a resumed run delivers after the restart.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np

GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


def project_capped_simplex(p: np.ndarray, floors: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """Euclidean projection of `p` onto {floor <= q <= cap, sum q = 1}.

    q_i = clip(p_i - tau, floor_i, cap_i) for the one tau where the sum is 1. The sum is monotone and
    piecewise linear in tau, with breakpoints at p_i - cap_i and p_i - floor_i: bisect the sorted
    breakpoints for the piece that crosses 1 (np.searchsorted), then solve that linear piece exactly.
    The caller guarantees feasibility (sum floors <= 1 <= sum caps, within check_feasible's slack).

    Total over every such input: floors that sum to 1 in decimal (0.2 + 0.4 + 0.3 + 0.1, which is
    1.0000000000000002 in floating point) leave a set of one point, the floors themselves, and no
    breakpoint whose sum is <= 1; likewise caps that sum to 1. Those are answered directly, scaled.
    """
    if not np.all(np.isfinite(p)):
        raise ValueError(f"distribution {p.tolist()} is not finite: refusing to draw from it")
    floor_sum, cap_sum = float(floors.sum()), float(caps.sum())
    if floor_sum >= 1.0 - 1e-12:
        return floors / floor_sum  # the set is (up to rounding) the floors alone
    if cap_sum <= 1.0 + 1e-12:
        return caps / cap_sum
    if np.all(p >= floors) and np.all(p <= caps) and abs(p.sum() - 1.0) < 1e-12:
        return p / p.sum()  # already inside: the projection of a point of the set is itself
    taus = np.sort(np.concatenate([p - caps, p - floors]))
    sums = np.clip(p[None, :] - taus[:, None], floors, caps).sum(axis=1)  # non-increasing in tau
    j = int(np.searchsorted(-sums, -1.0))  # the first breakpoint whose sum is <= 1
    # In exact arithmetic sums[0] is the caps' sum (> 1) and sums[-1] the floors' (< 1). Rounding in
    # p - tau (p far from the simplex, floors within 1e-9 of summing to 1) can push either end across
    # 1: the crossing is then at that end, the caps or the floors.
    if j == len(sums):
        q = floors.copy()
    elif j == 0:
        q = caps.copy()
    else:
        if sums[j] == 1.0:
            tau = taus[j]
        else:
            tau = taus[j - 1] + (sums[j - 1] - 1.0) * (taus[j] - taus[j - 1]) / (sums[j - 1] - sums[j])
        q = np.clip(p - tau, floors, caps)
    return q / q.sum()


def draw(p: np.ndarray, u: float) -> int:
    """Inverse-CDF draw of an index from `p` with the uniform number `u` in [0, 1)."""
    return min(int(np.searchsorted(np.cumsum(p), u, side="right")), len(p) - 1)


class Mixer(Protocol):
    kind: str
    arms: list[str]

    def probabilities(self) -> np.ndarray: ...

    def choose(self, step: int, rng: np.random.Generator) -> str: ...

    def observe(self, step: int, arm: str, loss: float) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class UniformMixer:
    """The baseline: uniform over arms, projected onto the policy's bounds; learns nothing.

    Stratified rather than drawn independently: step t takes the arm at u_t = frac(offset + t * golden
    ratio) of the cumulative distribution, a low-discrepancy sequence, so every window of steps carries
    each arm's share up to a few draws instead of up to sqrt(n) noise. Still a pure function of
    (seed, step).
    """

    kind = "uniform"

    def __init__(self, arms: list[str], floors: list[float], caps: list[float], seed: int = 0):
        self.arms = list(arms)
        self._p = project_capped_simplex(
            np.full(len(arms), 1.0 / len(arms)), np.asarray(floors, float), np.asarray(caps, float)
        )
        self._offset = float(np.random.default_rng([seed, 0x5EED]).random())
        self.pulls = dict.fromkeys(self.arms, 0)

    def probabilities(self) -> np.ndarray:
        return self._p

    def choose(self, step: int, rng: np.random.Generator) -> str:
        return self.arms[draw(self._p, (self._offset + step * GOLDEN) % 1.0)]

    def observe(self, step: int, arm: str, loss: float) -> None:
        if arm in self.pulls:  # not a zombie drawn before a restart (state.py)
            self.pulls[arm] += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "arms": {
                a: {"pulls": self.pulls[a], "p": float(p)} for a, p in zip(self.arms, self._p, strict=True)
            }
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for a, s in state["arms"].items():
            if a in self.pulls:
                self.pulls[a] = int(s["pulls"])


class Exp3Mixer:
    """EXP3 over arms with the Online Data Mixing changes (Albalak et al. 2023) and a normalised reward.

    Each round t (one training step):
      eps_t = min(1/K, sqrt(ln K / (K t)))                  decaying exploration, t = live pulls so far
      p     = project((1 - K eps_t) softmax(eta * R) + eps_t)  onto the policy's floors and caps
      draw an arm i from p, train on it, observe its loss L
      r     = (b_i - L) / b_i                               relative progress against the arm's baseline
      R_j  <- (1 - reward_ema) R_j  for every arm,  R_i += reward_ema * clip(r / s, -1, 1) / p_i

    The reward. ODM rewards the raw loss, which favours a high-entropy arm (prose, say) for being hard
    to predict at all rather than for how much the model is still learning from it, and an arm of pure
    noise would win for ever. Here the reward is the arm's relative loss improvement over its own slow
    baseline b_i (an EMA of its past losses): dimensionless, zero for an arm whose loss no longer falls
    whatever its level, positive while the model is learning it. It is divided by s, a running mean of
    |r| over all arms, so that eta means the same whatever the run's noise level.

    Importance weighting. R is a per-round EMA: every arm decays each round and only the pulled arm
    receives r / p_i, with p_i the probability it was actually drawn with (after exploration and
    projection), so E[R_i] tracks the arm's reward per round however often it is pulled.

    The state (pulls, R, b, s) lives in `state_dict()`; weights (K softmax(eta R), 1 = an average arm)
    and the next distribution are derived from it and recorded for operators.
    """

    kind = "exp3"

    def __init__(
        self,
        arms: list[str],
        floors: list[float],
        caps: list[float],
        reward_ema: float = 0.1,
        baseline_ema: float = 0.05,
        eta: float = 4.0,
    ):
        self.arms = list(arms)
        self.floors = np.asarray(floors, float)
        self.caps = np.asarray(caps, float)
        self.reward_ema, self.baseline_ema, self.eta = reward_ema, baseline_ema, eta
        k = len(arms)
        self.pulls = np.zeros(k, dtype=np.int64)
        self.reward = np.zeros(k)  # R: importance-weighted EMA of normalised rewards
        self.baseline = np.full(k, np.nan)  # b: each arm's slow loss EMA; nan until first pulled
        self.reward_scale = math.nan  # s: running mean |r|; nan until the first non-trivial reward
        self._p: np.ndarray | None = None  # the next distribution, cached until the state changes
        self.drawn: dict[int, tuple[str, float]] = {}  # step -> (arm, p) of draws not yet observed

    def exploration(self) -> float:
        k, t = len(self.arms), max(1, int(self.pulls.sum()))
        return 0.0 if k == 1 else min(1.0 / k, math.sqrt(math.log(k) / (k * t)))

    def weights(self) -> np.ndarray:
        z = self.eta * self.reward
        e = np.exp(z - z.max())
        return len(self.arms) * e / e.sum()

    def probabilities(self) -> np.ndarray:
        if self._p is None:
            k, eps = len(self.arms), self.exploration()
            mixed = (1.0 - k * eps) * self.weights() / k + eps
            self._p = project_capped_simplex(mixed, self.floors, self.caps)
        return self._p

    def choose(self, step: int, rng: np.random.Generator) -> str:
        p = self.probabilities()
        i = draw(p, rng.random())
        self.drawn[step] = (self.arms[i], float(p[i]))  # observe(step) comes after the next draw
        return self.arms[i]

    def observe(self, step: int, arm: str, loss: float) -> None:
        drawn = self.drawn.pop(step, None)
        if arm not in self.arms:
            return  # drawn before a restart that dropped the arm as a zombie (state.py): never learnt from
        i = self.arms.index(arm)
        # The probability the arm was actually drawn with; the current one only for a step this bandit
        # did not draw (a caller that observes without choosing, a fresh bandit after a pivot).
        p_i = drawn[1] if drawn is not None and drawn[0] == arm else float(self.probabilities()[i])
        if math.isnan(self.baseline[i]):
            r = 0.0  # the first pull only sets the arm's baseline
            self.baseline[i] = loss
        else:
            r = (self.baseline[i] - loss) / self.baseline[i]
            self.baseline[i] += self.baseline_ema * (loss - self.baseline[i])
        if r != 0.0:
            s = abs(r) if math.isnan(self.reward_scale) else self.reward_scale
            self.reward_scale = s + self.baseline_ema * (abs(r) - s)
        r_norm = 0.0 if math.isnan(self.reward_scale) else max(-1.0, min(1.0, r / self.reward_scale))
        self.reward *= 1.0 - self.reward_ema
        self.reward[i] += self.reward_ema * r_norm / p_i
        self.pulls[i] += 1
        self._p = None

    def state_dict(self) -> dict[str, Any]:
        p, w = self.probabilities(), self.weights()
        return {
            "exploration": self.exploration(),
            "reward_scale": None if math.isnan(self.reward_scale) else float(self.reward_scale),
            "arms": {
                a: {
                    "pulls": int(self.pulls[i]),
                    "reward": float(self.reward[i]),
                    "loss_baseline": None if math.isnan(self.baseline[i]) else float(self.baseline[i]),
                    "weight": float(w[i]),
                    "p": float(p[i]),
                }
                for i, a in enumerate(self.arms)
            },
            "drawn": [{"step": s, "arm": a, "p": p_i} for s, (a, p_i) in sorted(self.drawn.items())],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the arms the state and this mixer share; arms new to the state keep the prior.

        `exploration`, `weight` and `p` are derived and ignored here; arms of the state this mixer does
        not have are the caller's business (state.py reports them as zombies before calling this).
        """
        scale = state.get("reward_scale")
        self.reward_scale = math.nan if scale is None else float(scale)
        for a, s in state["arms"].items():
            if a not in self.arms:
                continue
            i = self.arms.index(a)
            self.pulls[i] = int(s["pulls"])
            self.reward[i] = float(s["reward"])
            b = s.get("loss_baseline")
            self.baseline[i] = math.nan if b is None else float(b)
        self.drawn = {int(d["step"]): (d["arm"], float(d["p"])) for d in state.get("drawn", [])}
        self._p = None
