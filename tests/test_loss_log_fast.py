"""The loss log's fast writer and reader say exactly what json.dumps and json.loads say.

The writer formats lines itself and the reader parses with orjson, falling back to json.loads for the
lines orjson refuses (bench/loss_log.py measures why); both must agree with the plain JSON path on
every kind of line.
"""

from __future__ import annotations

import json
import math

from andrea_core.run.loss_log import LossWriter, _entry, canonical, parse_entries, parse_lines, read_history
from andrea_core.run.rundir import LOSS_LOG, RunDir


def same(a, b) -> bool:
    """Entry lists equal field by field, NaN equal to NaN."""
    return len(a) == len(b) and all(
        all(
            x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y))
            for x, y in zip(p, q, strict=True)
        )
        for p, q in zip(a, b, strict=True)
    )


def json_reader(data: bytes) -> tuple[list, int]:
    """The reader as it was before orjson: json.loads on every line, a bad line skipped and counted."""
    entries, skipped = [], 0
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            entries.append(_entry(json.loads(line)))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            skipped += 1
    return entries, skipped


def test_writer_lines_are_json_dumps_text(tmp_path):
    cases = [
        (1, 2.5, 0.001, "stdlib-code", 512, 1700000000.1234),
        (2, 1e-20, 3.0000000000000004e-4, None, 1, 0.0),
        (3, float("nan"), 1.0, 'qu"ote \u00e9 \\ back', 7, 5.5),
        (4, float("inf"), -0.0, "a,b:{c}\n", 3, 1e10),
        (5, 0.1 + 0.2, float("-inf"), "", 0, 12.0005),
    ]
    writer = LossWriter(RunDir(str(tmp_path)))
    for case in cases:
        writer.log(*case)
    writer.close()
    lines = (tmp_path / LOSS_LOG).read_bytes().split(b"\n")
    assert lines[-1] == b""
    for line, (step, loss, lr, arm, tokens, t) in zip(lines, cases, strict=False):
        entry = {"step": step, "loss": loss, "lr": lr, "arm": arm, "tokens": tokens, "segment": 1}
        elapsed = json.loads(line)["elapsed"]  # the segment's age on the writer's clock, to the ms
        assert elapsed == round(elapsed, 3) and 0.0 <= elapsed < 60.0
        entry = {**entry, "time": round(t, 3), "elapsed": elapsed}
        assert line == json.dumps(entry, separators=(",", ":")).encode()


def test_fast_reader_agrees_with_json_on_every_kind_of_line(tmp_path):
    writer = LossWriter(RunDir(str(tmp_path)))
    for step in range(1, 9001):  # three blocks of the fast path, and then some
        writer.log(step, 10.0 / step, 6e-4 * (1 - step / 9001), ["x", "y", None][step % 3], 4096, 1e9 + step)
    writer.log(9000, 1.0, 0.1, "a,b:{c}", 1, 1.0)  # the writer's own line, with delimiters in its arm
    writer.close()
    good = (tmp_path / LOSS_LOG).read_bytes().split(b"\n")
    block = b"\n".join(good[:4096])
    assert same(parse_entries(block)[0], json_reader(block)[0])  # the writer's own lines
    odd = [
        good[9000],
        b'{"step": 9001, "loss": 1.5, "segment": 2}',  # another writer's spacing, fields missing
        b'{"segment":2,"time":1.0,"step":9002,"loss":2.5,"lr":0.1,"arm":"x","tokens":1}',  # key order
        b'{"step":9003,"loss":NaN,"lr":0.1,"arm":"x","tokens":1,"segment":2,"time":1.0}',
        b'{"step":9004,"loss":inf,"lr":0.1,"arm":"x","tokens":1,"segment":2,"time":1.0}',  # not JSON
        b'{"step":9005,"loss":1_0,"lr":0.1,"arm":"x","tokens":1,"segment":2,"time":1.0}',  # not JSON
        b'{"step":"9006","loss":1.0,"lr":0.1,"arm":"x","tokens":1,"segment":2,"time":1.0}',  # a string
        b'{"step":9007,"loss":1.0,"lr":0.1,"arm":7,"tokens":1,"segment":2,"time":1.0}',  # a number as arm
        b'{"step":9008,"loss":[1],"lr":0.1,"arm":"x","tokens":1,"segment":2,"time":1.0}',
        b"[1, 2, 3]",
        b"   ",
        b"",
        b'{"step":9009,"loss":1.0,"lr":0.1,"arm":"x","tok',  # torn, then terminated by a later start
        b'{"step":9011,"loss":Infinity,"lr":-Infinity,"arm":"x","tokens":1,"segment":2,"time":1.0}',
        b'{"step":123456789012345678901234567890,"loss":1.0,"segment":2,"tokens":18446744073709551617}',
        b'{"step":9012,"loss":1e400,"lr":0.1,"arm":"\\ud800","tokens":1,"segment":2,"time":-0}',
        b'{"step":9013,"loss":1.0,"loss":2.0,"segment":2,"arm":"\xc3\xa9\\u00e9"}',  # a repeated key
        b"[" * 100_000 + b"]" * 100_000,  # nested past the recursion limit
        b'{"step":9014,"loss":{"a":' * 50_000,
        b"\x00" * 64,  # a sparse file's hole
        b"\xff\xfe{}",
        b'{"step":9015.0,"loss":"1.5","segment":2.0}',  # numbers as json.loads gives them, then int()
    ]
    # Odd lines inside the second block and at the very end (a torn last line without its newline).
    lines = (
        good[:5000] + odd + good[5000:9000] + [b'{"step":9010,"loss":3.5,"lr":0.1,"arm":"x","tokens":1,"segm']
    )
    data = b"\n".join(lines)
    expected, expected_skipped = parse_lines(data)
    entries, skipped = parse_entries(data)
    assert same(entries, [_entry(obj) for obj in expected])
    reference, reference_skipped = json_reader(data)
    assert same(entries, reference)
    (big,) = [e for e in entries if e.step > 2**64]  # orjson reads it as a float; json.loads does not
    assert big.step == 123456789012345678901234567890 and big.tokens == 2**64 + 1
    assert skipped == expected_skipped == reference_skipped == 10
    assert len(entries) == 9000 + 11  # the writer's lines, its odd one, and ten good odd ones from elsewhere

    (tmp_path / LOSS_LOG).write_bytes(data)
    history = read_history(RunDir(str(tmp_path)))
    assert same(history, canonical(expected))
    assert [e.step for e in history] == list(range(1, 9001))  # segment 1 came back after segment 2


def test_the_recent_entries_read_from_the_logs_end_are_the_canonical_historys(tmp_path):
    """read_recent (what `andrea status` reads: the newest step and the speed over the last minute)
    gives exactly the canonical history's newest-segment entries of the window, however the window, the
    segments and the first chunk fall: a segment that starts inside the chunk, one that began long before
    it, a window wider than many chunks, a resume below the older segment's steps, a torn last line."""
    import random

    from andrea_core.run.loss_log import read_recent

    rng = random.Random(7)
    for case in range(40):
        run = RunDir(str(tmp_path / f"run{case}"))
        run.makedirs()
        lines, step, t = [], 0, 1000.0
        for segment in range(1, rng.randint(1, 4) + 1):
            step = max(0, step - rng.randint(0, 30))  # a resume, at or below the newest step
            for _ in range(rng.randint(0, 300)):
                step, t = step + 1, t + rng.choice([0.05, 0.5, 2.0])
                lines.append(json.dumps({"step": step, "loss": 3.0, "segment": segment, "time": t,
                                         "tokens": 64}))  # fmt: skip
        data = "".join(line + "\n" for line in lines).encode()
        if rng.random() < 0.3:
            data += b'{"step": 99999, "lo'  # a crash mid-append
        (tmp_path / f"run{case}" / LOSS_LOG).write_bytes(data)
        window = rng.choice([1.0, 10.0, 60.0, 600.0])
        history = read_history(run)
        want = []
        if history:
            last = history[-1]
            want = [e for e in history if e.segment == last.segment and e.time >= last.time - window]
        got = read_recent(run, window, chunk=rng.choice([16, 100, 1000, 1 << 18]))
        assert same(got, want), (case, window, len(got), len(want))
