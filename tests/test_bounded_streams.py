"""andrea_core/bounded.py for streams that are not run files (issue 24 4a/4b, issue 25): a decompressor's
output bounded as it arrives (BoundedReader, read_at_most), and lines over their bound passed over, not
kept, where one long line is one bad record (bounded_lines(skip_long=True))."""

from __future__ import annotations

import io

import pytest

from andrea_core.bounded import BoundedReader, LongLine, TooLarge, bounded_lines, read_at_most


class Endless(io.RawIOBase):
    """A stream that never ends (a decompression bomb, /dev/zero): counts what was read from it."""

    def __init__(self, byte: bytes = b"x"):
        self.byte, self.read_bytes = byte, 0

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        size = 1 << 16 if size is None or size < 0 else size
        self.read_bytes += size
        return self.byte * size


def test_reads_stop_one_byte_past_the_bound():
    assert read_at_most(io.BytesIO(b"abcdef"), 4) == (b"abcd", True)
    assert read_at_most(io.BytesIO(b"abcd"), 4) == (b"abcd", False)
    endless = Endless()
    assert read_at_most(endless, 1000, chunk=64) == (b"x" * 1000, True) and endless.read_bytes == 1001

    endless = Endless()
    reader = BoundedReader(endless, 5000, "bomb.zst", lambda seen: f"expands past {seen - 1}")
    assert len(reader.read(4000)) == 4000
    with pytest.raises(TooLarge, match="^expands past 5000$"):
        reader.read(4000)
    assert endless.read_bytes == 5001
    with pytest.raises(TooLarge, match="^b: more than 10 bytes$"):
        BoundedReader(io.BytesIO(b"y" * 11), 10, "b").read()


def test_a_long_line_is_passed_over_in_its_place_wherever_the_chunks_end():
    data = b"one\n\ntwo\n" + b"L" * 100 + b"\nthree\n" + b"M" * 50
    for chunk in (1, 3, 7, 1 << 20):
        lines = list(bounded_lines(io.BytesIO(data), 10, "f.jsonl", chunk, skip_long=True))
        assert lines == [b"one", b"", b"two", LongLine(4, 100, 10), b"three", LongLine(6, 50, 10)], chunk
    with pytest.raises(TooLarge, match=r"^f.jsonl: line 4 is longer than 10 bytes$"):
        list(bounded_lines(io.BytesIO(data), 10, "f.jsonl", 3))
