"""A run's weights outside the trainer: the checkpoint a command names, validated, as named tensors or as
a model ready to run (`andrea sample`, `andrea export`).

Only the weights region of `step_NNNNNN.bin` is used (Adam's m and v stay behind), and the names come
from the model's own parameter iterator, which is the checkpoint's order (contract). Nothing here
unpickles: a checkpoint is raw little-endian floats.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from andrea_core.checkpoint import Checkpoint, CheckpointError
from andrea_core.model.gpt import GPT
from andrea_core.model_config import ModelConfig


class _NoInit(TorchFunctionMode):
    """A meta tensor has no values to initialise, yet torch runs each init on it through its Python
    reference (torch._refs), whose first call imports torch._dynamo: 1.5 s of an `andrea sample` of
    3.5 s on a CPU. The model's inits are skipped; everything else runs as called."""

    INITS = frozenset(
        {
            torch.nn.init.normal_,
            torch.nn.init.uniform_,
            torch.nn.init.kaiming_uniform_,
            torch.nn.init.trunc_normal_,
        }
    )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.INITS:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def meta_model(cfg: ModelConfig) -> GPT:
    """The model's structure without its storage: names, shapes and modules, nothing allocated."""
    with torch.device("meta"), _NoInit():
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


def load_model(cfg: ModelConfig, ckpt: Checkpoint, device: str = "cpu") -> GPT:
    """The model of `cfg` with the checkpoint's weights, in eval mode on `device`."""
    model = meta_model(cfg)
    # assign=True adopts the tensors instead of copying into the meta model's (absent) storage.
    model.load_state_dict(named_weights(cfg, ckpt), strict=True, assign=True)
    return model.to(device).eval()
