"""Writing checkpoints of the live model and optimizer into a run directory, off the training path.

A save has two halves. The snapshot copies weights, Adam m and v into one host buffer, allocated once
(pinned on CUDA, so that the device-to-host copies are queued on the training stream behind the step
that produced them instead of stalling it). The write (temporary name, fsync, rename: RunDir.write_atomic)
then runs on a background thread while training goes on. At most one write is in flight: the next save
waits for it, because the buffer that write reads is the buffer the next snapshot fills. The bytes are
exactly what the synchronous writer (`asynchronous=False`) produces: the same header, the same buffer,
the same checksum trailer (its CRC-32 taken of each piece as the store writes it: encode_parts).

Ordering guarantee of a save of step S (what sidecar writers can rely on):
  0. If the run is fenced (a trainer's lease, lock.Lease), the lease is renewed first, conditionally
     over its own version; a lost lease fails the save (LeaseLost) before anything is written. (The
     publish itself checks the fence again once its upload or temporary file exists, which a taker
     aborts: RunDir._fence_of.)
  1. `before_write(S)` runs before any byte of step_S.bin is written; if it raises, nothing is written.
     The trainer makes .loss.json durable here, so that every checkpoint has its history.
  2. step_S.bin appears under its final name whole: fsynced, renamed, directory entry fsynced.
  3. `after_publish(S)` runs after 2, and only if 2 succeeded: the place for a sidecar that must never
     be newer than the newest checkpoint. (A crash between 2 and 3 leaves the sidecar one save behind:
     sidecars record the step they belong to.) Its failure is logged as its own error: the checkpoint
     is written all the same.
  4. All of it is over before the next save takes its snapshot, and before `wait()` returns.
The callbacks run on the writer thread while the model trains on: they must write what the caller
captured at the boundary (a closure over a copy), never read live training state.

A failed write (disk full, I/O error) is logged loudly and recorded; the temporary file is removed by
write_atomic, earlier checkpoints are never touched, and the next save (the next boundary) tries again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from andrea_core.checkpoint import checkpoint_name, encode_parts, expected_size, n_params_of, snapshot
from andrea_core.run.rundir import RunDir

Hook = Callable[[int], None]


@dataclass
class SaveRecord:
    """One save: how long it blocked the caller, how long its write took, and how it ended."""

    step: int
    name: str
    stall_s: float = 0.0  # the caller blocked in save(): waiting for the previous write, the snapshot
    write_s: float | None = None  # the writer: before_write, write, fsync, rename, after_publish
    error: Exception | None = None

    @property
    def done(self) -> bool:
        return self.write_s is not None


class Checkpointer:
    """Snapshot weights, Adam m and v at a step boundary and publish step_NNNNNN.bin, in the background
    unless `asynchronous` is False (the synchronous path, kept for comparison)."""

    def __init__(
        self,
        run: RunDir,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        asynchronous: bool = True,
        log: Callable[[str], None] = print,
    ):
        self.run = run
        self.model = model
        self.optimizer = optimizer
        self.asynchronous = asynchronous
        self.log = log
        self.device = next(model.parameters()).device
        self._cuda = self.device.type == "cuda"
        # 12 bytes a parameter (1.5 GB at 124M), allocated once so that no save pays for it.
        self._buffer = torch.empty(3 * n_params_of(model), dtype=torch.float32, pin_memory=self._cuda)
        self._thread: threading.Thread | None = None
        self.records: list[SaveRecord] = []

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def save(self, step: int, *, before_write: Hook | None = None, after_publish: Hook | None = None) -> str:
        """Snapshot now and publish step_NNNNNN.bin (in the background); returns its name."""
        t0 = time.perf_counter()
        previous = self.wait()
        if previous is not None and previous.error is not None:
            self.log(f"retrying after the failed {previous.name}: writing {checkpoint_name(step)}")
        snapshot(self.model, self.optimizer, out=self._buffer, non_blocking=self._cuda)
        copied = None
        if self._cuda:
            # Recorded on the stream that queued the copies: the writer waits for it, the loop does not.
            copied = torch.cuda.Event(blocking=True)  # the writer sleeps on it instead of spinning
            copied.record(torch.cuda.current_stream(self.device))
        record = SaveRecord(step, checkpoint_name(step))
        self.records.append(record)
        if self.asynchronous:
            self._thread = threading.Thread(
                target=self._write,
                args=(record, copied, before_write, after_publish),
                name="andrea-checkpoint",
            )
            self._thread.start()
        else:
            self._write(record, copied, before_write, after_publish)
        record.stall_s = time.perf_counter() - t0
        return record.name

    def refuse(self, step: int, error: Exception) -> SaveRecord:
        """Record a save of `step` that was given up before its write (its sidecars could not be
        published): the caller sees it as a failed write, and the next boundary (or an exit) retries."""
        self.wait()
        record = SaveRecord(step, checkpoint_name(step), write_s=0.0, error=error)
        self.records.append(record)
        self.log(
            f"ERROR: checkpoint {record.name} was NOT written: {error}. "
            "Earlier checkpoints are untouched; the next checkpoint boundary tries again."
        )
        return record

    def wait(self) -> SaveRecord | None:
        """Block until the write in flight (if any) is over; the newest save's record (error set if it
        failed), or None before the first save."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return self.records[-1] if self.records else None

    def _write(
        self,
        record: SaveRecord,
        copied: torch.cuda.Event | None,
        before_write: Hook | None,
        after_publish: Hook | None,
    ) -> None:
        t0 = time.perf_counter()
        try:
            if copied is not None:
                copied.synchronize()
            if self.run.fence is not None:
                # Fencing: a conditional renewal of the lease right before the bytes; a trainer whose
                # lease was taken over (a paused VM) writes nothing.
                self.run.fence.confirm(record.name)
            if before_write is not None:
                before_write(record.step)
            flat = self._buffer.numpy()
            # Checksummed piece by piece as the store takes each (encode_parts): one read of the buffer.
            self.run.write_atomic(record.name, encode_parts(record.step, flat))
        except Exception as e:  # any failure of a write is reported; none may kill training
            record.write_s = time.perf_counter() - t0
            record.error = e
            self.log(
                f"ERROR: checkpoint {record.name} was NOT written: {type(e).__name__}: {e}. "
                "Earlier checkpoints are untouched; the next checkpoint boundary tries again."
            )
        else:
            mb = expected_size(flat.size // 3) / 1e6
            self.log(f"checkpoint {record.name} ({mb:,.1f} MB written in {time.perf_counter() - t0:.2f}s)")
            if after_publish is not None:
                # The checkpoint is published: what comes after cannot unwrite it, so its failure is
                # its own error, never a failed checkpoint (that would retry a good file, exit 1).
                try:
                    after_publish(record.step)
                except Exception as e:
                    self.log(f"ERROR: after publishing {record.name}: {type(e).__name__}: {e}")
            record.write_s = time.perf_counter() - t0
