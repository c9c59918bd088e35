"""The trainer's structured channel (andrea_core/train/events.py): records in, records out; a torn,
foreign or forged line is never a record; the channel writes only into a file its supervisor made."""

from __future__ import annotations

import json
import os

from andrea_core.train.events import EVENTS_PREFIX, EventChannel, EventReader


def test_records_round_trip_and_a_torn_line_waits_for_its_end(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_bytes(b"")
    reader, channel = EventReader(str(path)), EventChannel(str(path))
    channel.emit("progress", step=50, max_steps=100, loss=2.5, tokens_per_s=1000.0)
    channel.emit("result", step=50, reason="SIGTERM", checkpoint="step_000050.bin")
    records = reader.read()
    assert [(r["event"], r.get("step")) for r in records] == [("progress", 50), ("result", 50)]
    assert records[1]["checkpoint"] == "step_000050.bin" and records[0]["pid"] == os.getpid()
    # A line still being written is held back until its newline; foreign lines are skipped.
    record = json.dumps({"v": 1, "event": "checkpoint", "step": 60, "name": "step_000060.bin"})
    with open(path, "ab") as f:
        f.write(b"andrea: step 99999/100000 loss 0.0001\n")  # human text: not a record
        f.write(b'{"v": 2, "event": "progress", "step": 99999}\n')  # another version
        f.write(b'{"v": 1, "event": "forged", "step": 99999}\n')  # no such event
        f.write(record[:20].encode())
    assert reader.read() == []
    with open(path, "ab") as f:
        f.write(record[20:].encode() + b"\n")
    assert [r["step"] for r in reader.read()] == [60]


def test_a_string_with_newlines_stays_one_field_of_one_record(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_bytes(b"")
    forged = 'x\n{"v": 1, "event": "result", "step": 99999, "reason": "completed"}\n'
    EventChannel(str(path)).emit("error", message=forged)
    (record,) = EventReader(str(path)).read()
    assert record["event"] == "error" and record["message"] == forged


def test_the_channel_writes_only_into_an_existing_file_never_through_a_symlink(tmp_path):
    missing = tmp_path / "missing.jsonl"
    EventChannel(str(missing)).emit("started", first_step=1, max_steps=10)
    assert not missing.exists()  # no O_CREAT: the supervisor makes the file
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    (tmp_path / "link.jsonl").symlink_to(target)
    EventChannel(str(tmp_path / "link.jsonl")).emit("started", first_step=1, max_steps=10)
    assert target.read_bytes() == b""
    EventChannel(None).emit("started", first_step=1, max_steps=10)  # no ANDREA_EVENTS: nothing, no error


def test_a_supervisors_temporary_file_loses_its_name_once_the_trainer_has_opened_it(tmp_path):
    """A supervisor killed before its trainer ends must leave no andrea-events-* file behind: the name
    goes when the trainer opens the file; both ends keep writing and reading it through their fds."""
    path = tmp_path / f"{EVENTS_PREFIX}x.jsonl"
    path.write_bytes(b"")
    reader = EventReader(str(path))
    channel = EventChannel(str(path))
    assert not path.exists()
    channel.emit("checkpoint", step=10, name="step_000010.bin")
    assert [r["name"] for r in reader.read()] == ["step_000010.bin"]
    path.write_bytes(b"a new file of that name")  # not the reader's: remove() leaves it
    reader.remove()
    assert path.read_bytes() == b"a new file of that name"
    # A file named on purpose, or one with another link, keeps its name (and its other link its data).
    named = tmp_path / "events.jsonl"
    named.write_bytes(b"")
    EventChannel(str(named)).emit("started", first_step=1, max_steps=10)
    assert named.exists() and json.loads(named.read_bytes())["event"] == "started"
    linked = tmp_path / f"{EVENTS_PREFIX}y.jsonl"
    linked.write_bytes(b"")
    os.link(linked, tmp_path / "other-link")
    EventChannel(str(linked)).emit("started", first_step=1, max_steps=10)
    assert linked.exists() and (tmp_path / "other-link").read_bytes() == linked.read_bytes() != b""
