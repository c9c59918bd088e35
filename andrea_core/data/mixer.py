"""Data mixers: choose the arm that feeds each batch, under the policy's floors and caps.

A mixer's draw must be a pure function of (seed, step, mixer state): it is handed the step's own
generator and keeps everything else it needs in `state_dict()`, which is saved with every checkpoint.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np


def project_capped_simplex(
    p: np.ndarray, floors: np.ndarray, caps: np.ndarray, iters: int = 100
) -> np.ndarray:
    """Euclidean projection of `p` onto {floor <= q <= cap, sum q = 1}.

    q_i = clip(p_i - tau, floor_i, cap_i) is monotone in tau, so bisection on tau finds the sum of 1.
    The caller guarantees feasibility (sum floors <= 1 <= sum caps), checked when the policy loads.
    """
    lo, hi = float(np.min(p - caps)), float(np.max(p - floors))
    for _ in range(iters):
        tau = 0.5 * (lo + hi)
        if np.clip(p - tau, floors, caps).sum() > 1.0:
            lo = tau
        else:
            hi = tau
    q = np.clip(p - 0.5 * (lo + hi), floors, caps)
    return q / q.sum()


class Mixer(Protocol):
    arms: list[str]

    def probabilities(self) -> np.ndarray: ...

    def choose(self, step: int, rng: np.random.Generator) -> str: ...

    def observe(self, step: int, arm: str, loss: float) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class UniformMixer:
    """The baseline: uniform over arms, projected onto the policy's bounds; learns nothing."""

    kind = "uniform"

    def __init__(self, arms: list[str], floors: list[float], caps: list[float]):
        self.arms = list(arms)
        self._p = project_capped_simplex(
            np.full(len(arms), 1.0 / len(arms)), np.asarray(floors), np.asarray(caps)
        )

    def probabilities(self) -> np.ndarray:
        return self._p

    def choose(self, step: int, rng: np.random.Generator) -> str:
        return self.arms[int(rng.choice(len(self.arms), p=self._p))]

    def observe(self, step: int, arm: str, loss: float) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {
            "mixer": self.kind,
            "arms": {a: {"p": float(p)} for a, p in zip(self.arms, self._p, strict=True)},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
