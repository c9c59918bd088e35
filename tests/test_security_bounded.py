"""Issue 24, the bounded reader (andrea_core.bounded): bytes from outside come out bounded, and every
line with a bound on its length, checked as the bytes arrive."""

from __future__ import annotations

import io

import pytest

from andrea_core.bounded import TooLarge, bounded_lines, read_bounded


def test_read_bounded_refuses_an_endless_stream_after_the_bound():
    with open("/dev/zero", "rb") as f, pytest.raises(TooLarge, match=r"/dev/zero: more than 1000000 bytes"):
        read_bounded(f, 1_000_000, "/dev/zero")
    assert read_bounded(io.BytesIO(b"x" * 10), 10, "ten") == b"x" * 10


@pytest.mark.parametrize("chunk", [1, 3, 7, 1 << 20])
def test_bounded_lines_are_the_lines_of_the_stream(chunk):
    data = b"a\n\nbcd\nef\n" + b"g" * 20 + b"\nlast"
    assert list(bounded_lines(io.BytesIO(data), 20, "x", chunk=chunk)) == data.split(b"\n")
    assert list(bounded_lines(io.BytesIO(b"a\n"), 5, "x", chunk=chunk)) == [b"a"]
    with pytest.raises(TooLarge, match=r"x: line 5 is longer than 19 bytes"):
        list(bounded_lines(io.BytesIO(data), 19, "x", chunk=chunk))
