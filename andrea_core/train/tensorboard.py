"""TensorBoard event files of a run, the view Lightning and torchtitan users already watch: the
training loss, learning rate and tokens/s, each audit's held-out loss per arm, text metrics and
samples, and the bandit's probability per arm, in RUN/tensorboard/ (`tensorboard --logdir RUN/tensorboard`).

One event file per trainer start (a segment of .loss.json), written through RunDir.append like every
append-only run file (on an object store, the run cache's mirror is published at each checkpoint), so
the files live in the run directory wherever it is. The loop only appends tuples to a list; the events
are encoded and appended at each checkpoint (and exit), off the step's hot path. A segment's file
opens with a SessionLog START at its first step, written when the segment opens: TensorBoard then
drops what older files logged from that step on (a resume, a pivot's archived tail), exactly as
.loss.json's canonical history does, even when the trainer dies before its first checkpoint's flush.
.loss.json stays the source of truth; these files are a view, made durable at each flush (a power cut
loses at most the events since the last checkpoint, as it loses the steps).
A run's first event file (none in RUN/tensorboard/ yet: a fork's branch, whose .loss.json holds its
parent's history up to the fork, or a run whose folder was removed) opens with train/loss and train/lr
of the canonical history before its first step, from .loss.json: TensorBoard shows the whole history.
A view never stops training: whatever fails writing it (a full disk, EIO, a symlink or a file at
RUN/tensorboard) is one warning, and training goes on. The events a failed flush did not land are kept
(up to UNWRITTEN_MAX bytes) and written first at the next flush, from the byte where the file ends: a
record torn by a short write is finished, never followed by a new one (TensorBoard's reader stops at a
torn record, losing every later event of the file).
Text from the audits (prompts are held-out documents: anyone's text) goes through untrusted.markdown_code
and markdown_text: TensorBoard's text plugin renders markdown, links and images included.
ANDREA_TENSORBOARD=0 turns them off.
"""

from __future__ import annotations

import os
import re
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from andrea_core.run.loss_log import read_history
from andrea_core.run.rundir import RunDir
from andrea_core.untrusted import markdown_code, markdown_text

TENSORBOARD_DIR = "tensorboard"
EVENT_FILE_RE = re.compile(r"events\.out\.tfevents\.(\d{1,12})\..*")
ENV = "ANDREA_TENSORBOARD"
UNWRITTEN_MAX = 64 << 20  # events kept through a long outage (~600,000 steps of train/loss and lr)


class TensorBoardLog:
    def __init__(self, run: RunDir, segment: int, first_step: int, log: Callable[[str], None] = print):
        self.run, self.log = run, log
        self.name = (
            f"{TENSORBOARD_DIR}/events.out.tfevents.{self._stamp(run):010d}.andrea.segment{segment:04d}"
        )
        self._pending: list[tuple] = []
        self._mutex = threading.Lock()  # a background audit adds its events from its own thread
        # What a failed flush did not land: the rest of a record a short write tore, whole records after it.
        self._torn, self._records = b"", []
        self._size = 0  # bytes of this segment's file known to be on the store
        self._failed = False  # the last flush failed: how much of it landed is read before the next
        self._warned: set[str] = set()  # the causes of failed flushes already told
        self.enabled = os.environ.get(ENV, "1") != "0"
        if not self.enabled:
            return
        try:
            from tensorboard.compat.proto import event_pb2, summary_pb2  # noqa: F401
        except ImportError:
            self.enabled = False
            log("warning: the tensorboard package is not installed: no TensorBoard events (requirements.txt)")
            return
        self._pending.append(("start", first_step, time.time()))
        if first_step > 1:
            self._backfill(first_step)
        # The START on disk before the segment's first step: a trainer killed before its first flush
        # (right after publishing its first checkpoint, say) still drops the older files' tail from
        # first_step on, which the next segment, resuming past it, cannot (issue 48's soak: a pivot's
        # archived tail shown in place of the new phase's steps).
        self.flush()

    @staticmethod
    def _stamp(run: RunDir) -> int:
        """The new file's name's time: now, or one past the newest file's when the wall clock was
        stepped back since (TensorBoard reads a folder's files in name order, and a segment's START
        must come after the older segments' events to drop their superseded tail)."""
        now = int(time.time())
        try:
            names = run.listdir(TENSORBOARD_DIR)
        except Exception:  # noqa: BLE001 (no folder yet; or none readable, which the flush will say)
            return now
        stamps = [int(m.group(1)) for n in names if (m := EVENT_FILE_RE.fullmatch(n))]
        return max([now, *(t + 1 for t in stamps)])

    def _backfill(self, first_step: int) -> None:
        """The canonical history before `first_step` when this is the run's first event file."""
        try:
            if any(n.startswith("events.out.tfevents.") for n in self.run.listdir(TENSORBOARD_DIR)):
                return
            history = [e for e in read_history(self.run) if e.step < first_step]
        except Exception as e:  # noqa: BLE001 (a view: whatever fails is a warning, never the run's end)
            self._warn(f"the history before step {first_step} is not shown", e)
            return
        for e in history:
            self._pending.append(("scalar", e.step, e.time, "train/loss", float(e.loss)))
            self._pending.append(("scalar", e.step, e.time, "train/lr", float(e.lr)))

    # --- cheap: called from the loop, the audit and the checkpoint ------------------------------

    def scalar(self, step: int, tag: str, value: float, t: float | None = None) -> None:
        if self.enabled:
            with self._mutex:
                self._pending.append(("scalar", step, t or time.time(), tag, float(value)))

    def text(self, step: int, tag: str, text: str) -> None:
        if self.enabled:
            with self._mutex:
                self._pending.append(("text", step, time.time(), tag, text))

    def audit(self, audit: dict[str, Any]) -> None:
        """An audit's held-out loss per arm, text metrics and samples."""
        step, m = audit["step"], audit["metrics"]
        for arm, loss in m["val_loss"].items():
            self.scalar(step, f"val_loss/{arm}", loss)
        for key in ("distinct_1", "distinct_2", "repetition", "gzip_ratio"):
            if key in m:
                self.scalar(step, f"audit/{key}", m[key])
        lines = [
            f"**{markdown_text(s.get('arm', ''))}** {markdown_code(repr(s['prompt']))} → "
            f"{markdown_code(repr(s['completion']))}"
            for s in audit["samples"]
        ]
        self.text(step, "audit/samples", "\n\n".join(lines))

    # --- at checkpoints and exit ----------------------------------------------------------------

    def flush(self) -> None:
        """Encode what was added since the last flush and append it to this segment's file, after what
        an earlier failed flush left unwritten."""
        with self._mutex:
            pending, self._pending = self._pending, []
        if not self.enabled:
            return
        self._records.extend(_record(_event(p)) for p in pending)
        if not self._records and not self._torn:
            return
        try:
            if self._failed:
                self._settle()
            data = self._torn + b"".join(self._records)
            self.run.makedirs(TENSORBOARD_DIR)
            # Durable at every flush (each checkpoint, and exit): one fsync per checkpoint keeps the view
            # as far as the checkpoints on a power cut (its audits and bandit probabilities are not
            # rebuilt from .loss.json); between checkpoints the events are only in memory anyway.
            self.run.append(self.name, data, durable=True, lines=False)  # binary records
        except Exception as e:  # noqa: BLE001 (a view: a full disk or a symlink never ends the run)
            self._failed = True
            dropped = self._bound()
            self._warn("TensorBoard event(s) not written yet, kept for the next checkpoint's flush", e)
            if dropped:
                self._warn(f"{dropped} TensorBoard event(s) dropped: over {UNWRITTEN_MAX} bytes waited", e)
            return
        self._size += len(data)
        self._torn, self._records, self._failed = b"", [], False

    def _settle(self) -> None:
        """After a failed append: drop from what is kept the bytes of it that landed (a short write on a
        full disk lands a prefix), read from the file's size, so the next append goes on from there."""
        on_store = self.run.size(self.name) if self.run.exists(self.name) else 0
        landed, self._size = max(0, on_store - self._size), on_store
        if landed < len(self._torn):
            self._torn = self._torn[landed:]
            return
        landed -= len(self._torn)
        self._torn = b""
        while self._records and landed >= len(self._records[0]):
            landed -= len(self._records.pop(0))
        if landed and self._records:
            self._torn = self._records.pop(0)[landed:]

    def _bound(self) -> int:
        """Keep what waits within UNWRITTEN_MAX: the newest events go first (the oldest, the segment's
        START among them, keep their place). How many were dropped."""
        size, dropped = len(self._torn) + sum(len(r) for r in self._records), 0
        while size > UNWRITTEN_MAX and self._records:
            size -= len(self._records.pop())
            dropped += 1
        return dropped

    def _warn(self, what: str, e: Exception) -> None:
        """Once per cause: a view that fails at every checkpoint of a weeks-long run says so once."""
        cause = f"{type(e).__name__}: {e}"
        if cause not in self._warned:
            self._warned.add(cause)
            self.log(
                f"warning: {self.run.path(self.name)}: {what} ({cause}); training goes on, "
                "this warning is not repeated"
            )


def _event(p: tuple):
    from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2

    kind, step, t = p[0], p[1], p[2]
    if kind == "start":
        # file_version first (TensorBoard's reader expects it), then the segment's restart point.
        return [
            event_pb2.Event(wall_time=t, file_version="brain.Event:2"),
            event_pb2.Event(
                wall_time=t, step=step, session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)
            ),
        ]
    if kind == "scalar":
        value = summary_pb2.Summary.Value(tag=p[3], simple_value=p[4])
    else:
        tensor = tensor_pb2.TensorProto(
            dtype=types_pb2.DT_STRING,
            string_val=[p[4].encode()],
            tensor_shape=tensor_shape_pb2.TensorShapeProto(
                dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=1)]
            ),
        )
        meta = summary_pb2.SummaryMetadata(
            plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text")
        )
        value = summary_pb2.Summary.Value(tag=p[3], metadata=meta, tensor=tensor)
    return [event_pb2.Event(wall_time=t, step=step, summary=summary_pb2.Summary(value=[value]))]


def _crc32c_table() -> tuple[int, ...]:
    table = []
    for i in range(256):
        crc = i
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)  # Castagnoli's polynomial, reflected
        table.append(crc)
    return tuple(table)


_CRC32C_TABLE = _crc32c_table()


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC-32C of `data`. Ours, not tensorboard's: its one lives in its TensorFlow
    stub package, whose import (boto3, absl: 0.2-0.27 CPU-s) every trainer start paid for a checksum."""
    crc, table = 0xFFFFFFFF, _CRC32C_TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def _record(events: list) -> bytes:
    """TFRecord framing: length, its masked CRC32C, the serialized event, its masked CRC32C."""
    out = []
    for event in events:
        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        out.append(
            header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data))
        )
    return b"".join(out)
