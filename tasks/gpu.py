"""One trainer per GPU: a Prefect global concurrency limit named after the device ("gpu-0") with one
slot, held for as long as a trainer runs on it. Together with the run lock (.trainer.json), which keeps
two trainers off one run directory, it keeps a scheduled audit fork off the GPU of the main run.

The slot is a lease that this flow-run process renews; if the process dies, the lease runs out after
ANDREA_GPU_SLOT_LEASE_S (default LEASE_S, 60 s: the least the server accepts) and the slot frees itself.
With the server's lease storage on the filesystem
(PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE=prefect.server.concurrency.lease_storage.filesystem), a
server restart neither forgets a held slot nor leaks it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from prefect import get_run_logger
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

from andrea_core.ops.supervise import gpu_slot_name, gpu_slot_names

LEASE_S = 60.0
LEASE_ENV = "ANDREA_GPU_SLOT_LEASE_S"


def lease_s() -> float:
    """The slot's lease: ANDREA_GPU_SLOT_LEASE_S seconds, else LEASE_S; never under the server's 60."""
    text = os.environ.get(LEASE_ENV) or str(LEASE_S)
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 60:
        raise ValueError(f"{LEASE_ENV}={text!r}: expected seconds, at least 60 (the server's minimum)")
    return value


class GpuBusy(RuntimeError):
    """The GPU's slot stayed taken: another trainer runs on it."""


def ensure_gpu_limit(name: str) -> None:
    """Create the one-slot limit on first use, so that a GPU is never shared just because the operator's
    setup did not create its limit yet. An existing limit is left as the operator configured it."""
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            with contextlib.suppress(ObjectAlreadyExists):
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))


@contextlib.contextmanager
def holding_gpu_slot(slot: str | None, device: str, timeout_s: float | None) -> Iterator[str | None]:
    """Hold the slot of the GPU that `device` resolves to ("auto": gpu-N on CUDA, nothing on the CPU;
    an explicit name is used as given). Waits up to `timeout_s` (None: as long as it takes)."""
    name = gpu_slot_name(slot, device)
    if name is None:
        yield None
        return
    logger = get_run_logger()
    ensure_gpu_limit(name)
    logger.info(f"waiting for concurrency slot {name!r} (one trainer per GPU)")
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(
                concurrency(
                    name,
                    occupy=1,
                    timeout_seconds=timeout_s,
                    strict=True,
                    lease_duration=lease_s(),
                    raise_on_lease_renewal_failure=False,
                )
            )
        except TimeoutError:
            raise GpuBusy(
                f"concurrency slot {name!r} stayed taken for {timeout_s:.0f}s: another trainer (the main "
                "run?) runs on that GPU, and a trainer never shares one. Use another device, or wait."
            ) from None
        logger.info(f"holding concurrency slot {name!r}")
        yield name


@contextlib.contextmanager
def holding_gpu_slots(
    slot: str | None, device: str, timeout_s: float | None, nproc_per_node: int = 1
) -> Iterator[list[str]]:
    """Hold the slot of every GPU a trainer of `nproc_per_node` ranks uses (gpu-0 .. gpu-N-1 under
    "auto" on CUDA), always in the same order, so that two jobs never each hold a part and wait."""
    names = gpu_slot_names(slot, device, nproc_per_node)
    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(holding_gpu_slot(name, device, timeout_s))  # an explicit name: as given
        yield names
