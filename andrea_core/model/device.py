"""Which device a run trains on, and which attention kernels it may use there.

Takes a device name (`auto`, `cpu`, `cuda`, `cuda:N`); imports torch."""

from __future__ import annotations

import contextlib

import torch

from andrea_core.config import ConfigError


def pick_device(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {requested}: CUDA is not available on this machine")
    if requested != "cpu" and not requested.startswith("cuda"):
        raise ConfigError(f"--device {requested}: expected auto, cpu or cuda[:N]")
    return requested


def attention_kernels(device: str) -> contextlib.AbstractContextManager:
    """SDPA backends in order of preference on CUDA: flash attention first, then cuDNN and
    memory-efficient attention, with the math kernel as the last resort."""
    if not device.startswith("cuda"):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    return sdpa_kernel([*order, SDPBackend.MATH], set_priority=True)
