"""The step_NNNNNN.bin checkpoint (contract): one line to describe, `struct` to check.

    little-endian [int32 step][int32 n_params][n x f32 weights][n x f32 Adam m][n x f32 Adam v]
                  [char[3] "ANC"][uint8 version 1][uint32 CRC-32 of every byte before the trailer]

Size is exactly 8 + 12 * n_params + 8. The three regions are the model's parameters and AdamW's
exp_avg / exp_avg_sq, flattened in `model.parameters()` order; the 8-byte trailer's CRC-32
(zlib.crc32) covers the header and the floats, so a flipped bit or a torn write is refused as a
torn file is. The legacy form, without the trailer (exactly 8 + 12 * n_params bytes, written before
the trailer existed), is still read: it has no checksum, and says so (`Checkpoint.checksum` is None).
Any other size is refused before the body is read. No pickle anywhere on this path: a checkpoint is
raw floats, so reading one can never execute code. Why a trailer: docs/design.md.
"""

from __future__ import annotations

import re
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is imported by the functions that use it: reading a checkpoint needs none
    import torch

HEADER = struct.Struct("<ii")
TRAILER = struct.Struct("<3sBI")  # magic, format version, CRC-32 of the header and the floats
MAGIC, VERSION = b"ANC", 1
# The floats are checksummed in pieces of this size just before each is written, while in cache:
# the writer reads its buffer once (encode_parts).
CHUNK = 4 * 2**20
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


def expected_size(n_params: int, checksum: bool = True) -> int:
    """The size of a checkpoint of `n_params` written now (with its trailer), or of the legacy form."""
    return HEADER.size + 12 * n_params + (TRAILER.size if checksum else 0)


def size_problem(size: int, n_params: int) -> str | None:
    """Why a file of `size` bytes whose header says `n_params` cannot be a checkpoint; None if it can
    (either form). Known from the header alone: a 3 GB file claiming n = 1 is refused unread."""
    legacy = expected_size(n_params, checksum=False)
    if size in (legacy, legacy + TRAILER.size):
        return None
    return (
        f"{size} bytes where 8 + 12*{n_params} = {legacy} are required "
        f"({legacy + TRAILER.size} with its checksum trailer)"
    )


@dataclass
class Checkpoint:
    step: int
    n_params: int
    flat: np.ndarray  # float32 [3 * n_params]: weights | m | v, a view of the file's bytes
    checksum: int | None = None  # the CRC-32 the file carries and matches; None: the legacy form

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


def encode_parts(step: int, flat: np.ndarray) -> Iterator[memoryview]:
    """The file's bytes for a float32 [weights | m | v] vector, in pieces to be written in order: the
    header, the floats (views of `flat`, no copy), the trailer. The CRC-32 is taken of each piece as it
    is handed out, so a streaming writer (a file, a multipart upload) reads the buffer once; the
    trailer is made when the pieces before it have all been taken."""
    flat = np.ascontiguousarray(flat, dtype="<f4")
    if flat.size % 3:
        raise ValueError(f"flat state of {flat.size} floats is not three equal regions")
    header = encode_header(step, flat.size // 3)
    crc = zlib.crc32(header)
    yield memoryview(header)
    body = memoryview(flat).cast("B")
    for at in range(0, body.nbytes, CHUNK):
        piece = body[at : at + CHUNK]
        crc = zlib.crc32(piece, crc)
        yield piece
    yield memoryview(TRAILER.pack(MAGIC, VERSION, crc))


def encode(step: int, flat: np.ndarray) -> bytes:
    """The file's bytes for a float32 [weights | m | v] vector (encode_parts, joined)."""
    return b"".join(encode_parts(step, flat))


def trailer_problem(data: bytes | memoryview, n_params: int) -> tuple[int | None, str | None]:
    """(CRC-32, None) for a file of the checksummed form whose checksum matches; (None, None) for the
    legacy form (no trailer: nothing to check); (None, problem) otherwise. The size is size_problem's."""
    body = HEADER.size + 12 * n_params
    if len(data) == body:
        return None, None
    magic, version, want = TRAILER.unpack_from(data, body)
    if magic != MAGIC:
        return None, f"its last 8 bytes are not a checksum trailer (magic {magic!r}, not {MAGIC!r})"
    if version != VERSION:
        return None, f"checksum trailer version {version} is not one this reader knows ({VERSION})"
    got = zlib.crc32(memoryview(data)[:body])
    if got != want:
        return None, (
            f"checksum does not match: the trailer says CRC-32 {want:08x}, its {body:,} bytes have "
            f"{got:08x} (a flipped bit or a torn write: the file is damaged)"
        )
    return got, None


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
    problem = size_problem(size, n)
    if problem:
        raise CheckpointError(name, problem)
    name_step = step_from_name(name)
    if name_step is None:
        raise CheckpointError(name, "file name is not step_NNNNNN.bin")
    if name_step != step:
        raise CheckpointError(name, f"header step {step} disagrees with the name's {name_step}")
    if expected_n_params is not None and n != expected_n_params:
        raise CheckpointError(name, f"n_params {n} does not match the model's {expected_n_params}")
    crc, problem = trailer_problem(data, n)
    if problem:
        raise CheckpointError(name, problem)
    flat = np.frombuffer(data, dtype="<f4", offset=HEADER.size, count=3 * n)
    ckpt = Checkpoint(step, n, flat, crc)
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
    """What `andrea inspect` shows: header, size, verdict, checksum status and per-region statistics
    (even when invalid). `checksum`: "CRC-32 XXXXXXXX, matches", "none (the legacy form ...)", the
    trailer's problem, or None when the size fits neither form."""
    report: dict = {"file": name, "bytes": len(data), "step": None, "n_params": None, "checksum": None}
    if len(data) >= HEADER.size:
        report["step"], report["n_params"] = HEADER.unpack_from(data, 0)
    try:
        decode(data, name)
        report["valid"], report["problem"] = True, None
    except CheckpointError as e:
        report["valid"], report["problem"] = False, e.problem
    n = report["n_params"]
    if n and n > 0 and size_problem(len(data), n) is None:
        crc, problem = trailer_problem(data, n)
        if problem:
            report["checksum"] = problem.removeprefix("checksum ")
        elif crc is None:
            report["checksum"] = "none (the legacy form, 8 + 12n bytes: written before checksums)"
        else:
            report["checksum"] = f"CRC-32 {crc:08x}, matches"
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
