"""The bounded reader: bytes from someone else (a run file, a tokenizer, a corpus stream after
decompression) read with a bound on how many come out and on the length of each line, both checked as
the bytes arrive, so that a small input can never make this process hold more than the bound.

Every reader of a file from outside goes through `read_bounded` or `bounded_lines`; the errors are
ConfigErrors naming the file and the bound (one `andrea: error:` line).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

from andrea_core.config import ConfigError

CHUNK = 1 << 20


class TooLarge(ConfigError):
    """An input over its bound; raised before more than bound + one chunk has been held."""


def read_bounded(f: BinaryIO, most: int, what: str, chunk: int = CHUNK) -> bytes:
    """All of `f`'s bytes, or TooLarge (naming `what` and `most`) as soon as more than `most` arrive.
    Read a chunk at a time, so a stream that never ends (/dev/zero, a zip bomb) costs at most
    `most` + `chunk` bytes before it is refused."""
    parts: list[bytes] = []
    size = 0
    while True:
        piece = f.read(min(chunk, most + 1 - size))
        if not piece:
            return b"".join(parts)
        size += len(piece)
        if size > most:
            raise TooLarge(f"{what}: more than {most} bytes")
        parts.append(piece)


def bounded_lines(
    f: BinaryIO, max_line: int, what: str, chunk: int = CHUNK, skip_long: bool = False
) -> Iterator[bytes | LongLine]:
    """The lines of binary stream `f` (without their b"\\n"), each at most `max_line` bytes: a longer
    one raises TooLarge naming `what` and its line number as soon as its bytes pass the bound, or, with
    `skip_long` (a corpus, where one bad line is one bad record), is read through without being kept
    and yielded as a LongLine in its place. Linear in the input: a line's pieces are kept in a list and
    joined once, never re-concatenated."""
    pending: list[bytes] = []  # the current line's pieces so far (no newline among them)
    pending_size = 0
    number = 0
    while True:
        block = f.read(chunk)
        if not block:
            break
        start = 0
        while True:
            end = block.find(b"\n", start)
            if end < 0:
                piece = block[start:]
                pending_size += len(piece)
                if pending_size > max_line:
                    if not skip_long:
                        raise TooLarge(f"{what}: line {number + 1} is longer than {max_line} bytes")
                    pending = []  # skipping: only its length is kept
                elif piece:
                    pending.append(piece)
                break
            pending_size += end - start
            if pending_size > max_line and not skip_long:
                raise TooLarge(f"{what}: line {number + 1} is longer than {max_line} bytes")
            number += 1
            if pending_size > max_line:
                yield LongLine(number, pending_size, max_line)
            else:
                pending.append(block[start:end])
                yield b"".join(pending)
            pending, pending_size = [], 0
            start = end + 1
    if pending_size > max_line:
        yield LongLine(number + 1, pending_size, max_line)
    elif pending:
        yield b"".join(pending)


@dataclass(frozen=True)
class LongLine:
    """Where bounded_lines(skip_long=True) passed over a line longer than its bound."""

    number: int  # from 1
    size: int  # its length in bytes, read through to its end
    bound: int


def read_at_most(f: BinaryIO, most: int, chunk: int = CHUNK) -> tuple[bytes, bool]:
    """Up to `most` bytes of `f`, and whether more followed (one byte past `most` is read to tell)."""
    parts: list[bytes] = []
    size = 0
    while size <= most:
        piece = f.read(min(chunk, most + 1 - size))
        if not piece:
            break
        parts.append(piece)
        size += len(piece)
    data = b"".join(parts)
    return data[:most], size > most


class BoundedReader:
    """A read-only view of stream `f` that raises TooLarge (worded by `message(seen)`, or naming `what`
    and `most`) as soon as more than `most` bytes in all were read through it: a decompressor's output,
    whose stored size says nothing about what it expands to."""

    def __init__(self, f: BinaryIO, most: int, what: str, message: Callable[[int], str] | None = None):
        self.f, self.most, self.what, self.message = f, most, what, message
        self.seen = 0

    def read(self, size: int = -1) -> bytes:
        room = self.most + 1 - self.seen
        data = self.f.read(room if size is None or size < 0 else min(size, room))
        self.seen += len(data)
        if self.seen > self.most:
            raise TooLarge(
                self.message(self.seen) if self.message else f"{self.what}: more than {self.most} bytes"
            )
        return data

    def close(self) -> None:
        self.f.close()

    def __enter__(self) -> BoundedReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
