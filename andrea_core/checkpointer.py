"""Writing checkpoints of the live model and optimizer into a run directory."""

from __future__ import annotations

import time

import torch

from andrea_core.checkpoint import checkpoint_name, encode_header, snapshot
from andrea_core.rundir import RunDir


class Checkpointer:
    """Snapshot weights, Adam m and v into a reusable CPU buffer and publish step_NNNNNN.bin."""

    def __init__(self, run: RunDir, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.run = run
        self.model = model
        self.optimizer = optimizer
        self._buffer: torch.Tensor | None = None
        self.last_write_s = 0.0

    def save(self, step: int) -> str:
        t0 = time.perf_counter()
        self._buffer = snapshot(self.model, self.optimizer, out=self._buffer)
        flat = self._buffer.numpy()
        name = checkpoint_name(step)
        header = encode_header(step, flat.size // 3)
        self.run.write_atomic(name, [header, memoryview(flat.astype("<f4", copy=False))])
        self.last_write_s = time.perf_counter() - t0
        return name

    def wait(self) -> None:
        """Block until every save has been published (saves are synchronous here)."""
