"""torch's AdamW, the same kernels and bits, without the import of torch._dynamo (1.5 s and more of a
CPU's time) that its step, zero_grad, add_param_group and state-dict methods make on their first call.

Each of those methods is wrapped in torch.optim (`_use_grad_for_differentiable`, `torch._disable_dynamo`)
only to tell a compiler tracing the optimizer where to break its graph or to skip the frame. Nothing here
traces the optimizer: `train.compile` compiles the model's forward, and the step runs eagerly after it. So
this subclass calls each method's undecorated body (`inspect.unwrap`), under `torch.no_grad()` for the
step as the wrapper would with differentiable=False. A CPU trainer start of andrea-tiny to its first
step's exit, measured: 5.6 s -> 2.9 s, median of 5 (bench/train_start.py), at every restart and pivot."""

from __future__ import annotations

import inspect
from typing import Any

import torch

_STEP = inspect.unwrap(torch.optim.AdamW.step)
_ZERO_GRAD = inspect.unwrap(torch.optim.Optimizer.zero_grad)
_ADD_PARAM_GROUP = inspect.unwrap(torch.optim.Optimizer.add_param_group)
_STATE_DICT = inspect.unwrap(torch.optim.Optimizer.state_dict)
_LOAD_STATE_DICT = inspect.unwrap(torch.optim.Optimizer.load_state_dict)


class AdamW(torch.optim.AdamW):
    def step(self, closure: Any = None) -> Any:
        if self.defaults["differentiable"]:
            raise ValueError("andrea's AdamW is not differentiable (torch.optim.AdamW is)")
        with torch.no_grad():
            return _STEP(self, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        _ZERO_GRAD(self, set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        _ADD_PARAM_GROUP(self, param_group)

    def state_dict(self) -> dict[str, Any]:
        return _STATE_DICT(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        _LOAD_STATE_DICT(self, state_dict)
