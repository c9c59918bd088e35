"""A run's weights outside the trainer: the checkpoint a command names, validated, as named tensors or as
a model ready to run (`andrea sample`, `andrea export`).

Only the weights region of `step_NNNNNN.bin` is used (Adam's m and v stay behind), and the names come
from the model's own parameter iterator, which is the checkpoint's order (contract). Nothing here
unpickles: a checkpoint is raw little-endian floats.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from andrea_core.checkpoint import Checkpoint, CheckpointError
from andrea_core.fork import run_n_params
from andrea_core.model import GPT, ModelConfig
from andrea_core.rundir import RunDir
from andrea_core.runs import RunRecord, open_run


@dataclass
class RunWeights:
    run: RunDir
    record: RunRecord
    checkpoint: Checkpoint

    @property
    def model_config(self) -> ModelConfig:
        return self.record.config.model


def read_weights(url: str, step: int | None = None, warn: Callable[[str], None] | None = None) -> RunWeights:
    """The checkpoint of `step` (default: the newest valid one) of the run at `url`, validated against
    the run's model; CheckpointError naming the file and the problem when it cannot be used."""
    run, record = open_run(url)
    n_params = run_n_params(record)
    if step is not None:
        return RunWeights(run, record, run.read_checkpoint(step, n_params))
    ckpt = run.newest_valid_checkpoint(n_params, warn=warn)
    if ckpt is None:
        found = len(run.checkpoint_steps())
        why = f"all {found} checkpoint(s) fail validation" if found else "no checkpoint yet"
        raise CheckpointError(run.url, f"no valid checkpoint ({why})")
    return RunWeights(run, record, ckpt)


def meta_model(cfg: ModelConfig) -> GPT:
    """The model's structure without its storage: names, shapes and modules, nothing allocated."""
    with torch.device("meta"):
        return GPT(cfg)


def named_weights(cfg: ModelConfig, ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """The checkpoint's weights as `GPT.named_parameters()` names and shapes, in checkpoint order."""
    flat = torch.from_numpy(ckpt.weights.copy())  # the checkpoint's buffer is read-only
    out, offset = {}, 0
    for name, p in meta_model(cfg).named_parameters():
        out[name] = flat[offset : offset + p.numel()].view(p.shape)
        offset += p.numel()
    if offset != ckpt.n_params:
        raise CheckpointError(f"step {ckpt.step}", f"n_params {ckpt.n_params} != the model's {offset}")
    return out


def load_model(weights: RunWeights, device: str = "cpu") -> GPT:
    """The run's model with the checkpoint's weights, in eval mode on `device`."""
    model = meta_model(weights.model_config)
    # assign=True adopts the tensors instead of copying into the meta model's (absent) storage.
    model.load_state_dict(named_weights(weights.model_config, weights.checkpoint), strict=True, assign=True)
    return model.to(device).eval()
