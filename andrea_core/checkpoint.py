"""The step_NNNNNN.bin checkpoint (contract): one line to describe, `struct` to check.

    little-endian [int32 step][int32 n_params][n x f32 weights][n x f32 Adam m][n x f32 Adam v]

Size is exactly 8 + 12 * n_params. The three regions are the model's parameters and AdamW's
exp_avg / exp_avg_sq, flattened in `model.parameters()` order. No pickle anywhere on this path:
a checkpoint is raw floats, so reading one can never execute code.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is imported by the functions that use it: reading a checkpoint needs none
    import torch

HEADER = struct.Struct("<ii")
# Anything shaped like a checkpoint name; only the canonical spelling of a step (checkpoint_name) counts.
NAME_RE = re.compile(r"step_(\d+)\.bin")  # fullmatch: `$` would let "step_000100.bin\n" through
INT32_MAX = 2**31 - 1


class CheckpointError(ValueError):
    """A checkpoint that must not be used; names the file and the problem."""

    def __init__(self, name: str, problem: str):
        super().__init__(f"{name}: {problem}")
        self.name = name
        self.problem = problem


def checkpoint_name(step: int) -> str:
    """The one name of a step's checkpoint: six digits, more only from step 1,000,000 on."""
    return f"step_{step:06d}.bin"


def step_from_name(name: str) -> int | None:
    """The step of a canonically named checkpoint; None for any other name. A stray spelling of a
    step (`step_0000350.bin`) is not that step's checkpoint: reading or moving "step 350" would
    address step_000350.bin, another file."""
    base = name.rsplit("/", 1)[-1]
    m = NAME_RE.fullmatch(base)
    if m is None:
        return None
    step = int(m.group(1))
    return step if checkpoint_name(step) == base else None


def is_stray_checkpoint_name(name: str) -> bool:
    """Shaped like a checkpoint name but not a canonical one (ignored, with a warning, never touched)."""
    base = name.rsplit("/", 1)[-1]
    return NAME_RE.fullmatch(base) is not None and step_from_name(base) is None


def expected_size(n_params: int) -> int:
    return HEADER.size + 12 * n_params


@dataclass
class Checkpoint:
    step: int
    n_params: int
    flat: np.ndarray  # float32 [3 * n_params]: weights | m | v, a view of the file's bytes

    @property
    def weights(self) -> np.ndarray:
        return self.flat[: self.n_params]

    @property
    def m(self) -> np.ndarray:
        return self.flat[self.n_params : 2 * self.n_params]

    @property
    def v(self) -> np.ndarray:
        return self.flat[2 * self.n_params :]

    def regions(self) -> dict[str, np.ndarray]:
        return {"weights": self.weights, "m": self.m, "v": self.v}


def encode_header(step: int, n_params: int) -> bytes:
    if not 0 <= step <= INT32_MAX or not 0 < n_params <= INT32_MAX:
        raise ValueError(f"step {step} / n_params {n_params} do not fit the int32 header")
    return HEADER.pack(step, n_params)


def encode(step: int, flat: np.ndarray) -> bytes:
    """The file's bytes for a float32 [weights | m | v] vector."""
    flat = np.ascontiguousarray(flat, dtype="<f4")
    if flat.size % 3:
        raise ValueError(f"flat state of {flat.size} floats is not three equal regions")
    return encode_header(step, flat.size // 3) + flat.tobytes()


def decode(data: bytes | memoryview, name: str, expected_n_params: int | None = None) -> Checkpoint:
    """Parse and validate a checkpoint's bytes; raises CheckpointError naming `name` and the problem."""
    size = len(data)
    if size < HEADER.size:
        raise CheckpointError(name, f"{size} bytes is too short for the 8-byte header")
    step, n = HEADER.unpack_from(data, 0)
    if n <= 0:
        raise CheckpointError(name, f"n_params is {n} (must be positive)")
    if step < 0:
        raise CheckpointError(name, f"header step is {step} (must be >= 0)")
    want = expected_size(n)
    if size != want:
        raise CheckpointError(name, f"{size} bytes where 8 + 12*{n} = {want} are required")
    name_step = step_from_name(name)
    if name_step is None:
        raise CheckpointError(name, "file name is not step_NNNNNN.bin")
    if name_step != step:
        raise CheckpointError(name, f"header step {step} disagrees with the name's {name_step}")
    if expected_n_params is not None and n != expected_n_params:
        raise CheckpointError(name, f"n_params {n} does not match the model's {expected_n_params}")
    flat = np.frombuffer(data, dtype="<f4", offset=HEADER.size, count=3 * n)
    ckpt = Checkpoint(step, n, flat)
    if np.isfinite(flat).all() and not (ckpt.v < 0).any():
        return ckpt  # one pass for the common case; the scan below names the first bad value
    for region, values in ckpt.regions().items():
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            i = int(bad[0])
            raise CheckpointError(
                name, f"non-finite value in {region} at index {i} ({values[i]}); {bad.size} in all"
            )
    if (ckpt.v < 0).any():
        i = int(np.flatnonzero(ckpt.v < 0)[0])
        raise CheckpointError(name, f"negative Adam v at index {i} ({ckpt.v[i]})")
    return ckpt


def region_stats(data: bytes, name: str) -> dict:
    """What `andrea inspect` shows: header, size, verdict and per-region statistics (even when invalid)."""
    report: dict = {"file": name, "bytes": len(data), "step": None, "n_params": None}
    if len(data) >= HEADER.size:
        report["step"], report["n_params"] = HEADER.unpack_from(data, 0)
    try:
        decode(data, name)
        report["valid"], report["problem"] = True, None
    except CheckpointError as e:
        report["valid"], report["problem"] = False, e.problem
    n = report["n_params"]
    if n and n > 0:
        floats = np.frombuffer(data, dtype="<f4", offset=HEADER.size, count=(len(data) - 8) // 4)
        regions = {}
        for i, region in enumerate(("weights", "m", "v")):
            values = floats[i * n : (i + 1) * n]
            finite = values[np.isfinite(values)]
            regions[region] = {
                "count": int(values.size),
                "min": float(finite.min()) if finite.size else None,
                "max": float(finite.max()) if finite.size else None,
                "mean": float(finite.astype(np.float64).mean()) if finite.size else None,
                "non_finite": int(values.size - finite.size),
            }
        report["regions"] = regions
    return report


# --- moving flat state to and from the live model and optimizer --------------------------------


def n_params_of(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def snapshot(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    out: torch.Tensor | None = None,
    non_blocking: bool = False,
) -> torch.Tensor:
    """Copy weights, m and v into one float32 CPU vector [weights | m | v] (reusing `out`).

    `non_blocking` with a pinned `out` only queues the device-to-host copies on the current stream:
    `out` must not be read before an event recorded after this call has completed.
    """
    import torch

    with torch.no_grad():
        return _snapshot(model, optimizer, out, non_blocking)


def _snapshot(model, optimizer, out, non_blocking: bool):
    import torch

    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    if out is None:
        out = torch.empty(3 * n, dtype=torch.float32)
    for region, key in enumerate((None, "exp_avg", "exp_avg_sq")):
        offset = region * n
        for p in params:
            k = p.numel()
            dst = out[offset : offset + k]
            src = p if key is None else optimizer.state.get(p, {}).get(key)
            if src is None:  # before the first step AdamW has no moments yet: they are zero
                dst.zero_()
            elif src.device.type == "cpu" and src.dtype == torch.float32:
                # A plain memcpy: torch's multi-threaded copy costs more than it saves on a CPU that
                # trains with every core (5-15x more, measured, on one shared with other work).
                np.copyto(dst.numpy(), src.detach().reshape(-1).numpy())
            else:
                dst.copy_(src.detach().reshape(-1), non_blocking=non_blocking)
            offset += k
    return out


def restore(ckpt: Checkpoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load weights, m and v into the model and AdamW, and set AdamW's step count from the header."""
    import torch

    with torch.no_grad():
        _restore(ckpt, model, optimizer)


def _restore(ckpt: Checkpoint, model, optimizer) -> None:
    import torch

    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    if n != ckpt.n_params:
        raise CheckpointError(f"step {ckpt.step}", f"n_params {ckpt.n_params} != model's {n}")
    flat = torch.from_numpy(ckpt.flat.copy())  # frombuffer views are read-only
    group_of = {p: g for g in optimizer.param_groups for p in g["params"]}
    offset = 0
    for p in params:
        k = p.numel()
        w, m, v = (flat[r * n + offset : r * n + offset + k].view_as(p) for r in range(3))
        p.copy_(w)
        group = group_of[p]
        on_device = group.get("fused") or group.get("capturable")
        optimizer.state[p] = {
            "step": torch.tensor(
                float(ckpt.step), dtype=torch.float32, device=p.device if on_device else "cpu"
            ),
            "exp_avg": m.to(p.device, copy=True),
            "exp_avg_sq": v.to(p.device, copy=True),
        }
        offset += k
