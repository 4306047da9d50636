"""A large JSON object read one entry at a time: the index of the released K3 maps ~1 M tensor names
to their files (~100 MB of JSON); ``json.loads`` would hold all of it, as Python objects several
times its size, where ``verify-manifest`` needs each entry only once.

The file is read in 1 MiB pieces; each string and value is parsed by the ``json`` module's own
scanner (``scanstring``, ``raw_decode``), so what is accepted is exactly JSON. A parse that reaches
the end of the buffer before the end of the file is retried with more of the file (a number cut in
two by a piece boundary would otherwise parse as a shorter one).

Why not a streaming JSON library (ijson): this is the one place the tool streams JSON, for one shape
(an object of string -> string), and a hundred lines over the standard scanner keep the dependencies
at the design card's and accept exactly what ``json.loads`` accepts (tests/test_jsonstream.py).
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable, Iterator
from json.decoder import scanstring
from pathlib import Path
from typing import Any, BinaryIO

from . import jsonfile
from .errors import ConvertError

#: Bytes read at a time (more where a value is longer): the parser's memory, whatever the file's size.
PIECE = 1 << 20
_WS = re.compile(r"[ \t\n\r]*")
_decoder = json.JSONDecoder()


def iter_object(path: Path, streamed: str, piece: int = PIECE) -> Iterator[tuple[str, Any]]:
    """The top-level entries of the JSON object in ``path``, in file order, as (key, value); the
    entries of the object under key ``streamed`` come one at a time, as (streamed, (key, value)).
    Raises ValueError on anything that is not one JSON object or nests values deeper than
    ``jsonfile.MAX_DEPTH``, or that is not a regular file (a FIFO is refused, never waited on); OSError if
    the file cannot be read. ``piece``: the bytes read at a time (the tests cut values at every boundary)."""
    try:
        fd = jsonfile.open_regular(path, path.name)
    except ConvertError as e:
        raise ValueError(str(e).removeprefix(f"{path.name}: ")) from None
    with open(fd, "rb") as f:
        b = _Buffer(f, piece)
        b.expect("{")
        for key in b.entries():
            if key != streamed:
                yield key, b.parse(_value)
                continue
            b.expect("{")
            for k in b.entries():
                yield streamed, (k, b.parse(_value))
        b.skip_ws()
        if b.i < len(b.s):
            raise ValueError(f"extra data after the object at character {b.offset + b.i}")


def _string(s: str, i: int) -> tuple[str, int]:
    if s[i] != '"':
        raise ValueError(f"expected a string at {i}")
    return scanstring(s, i + 1)


def _value(s: str, i: int) -> tuple[Any, int]:
    if s[i] == '"':  # the index's values: the common case, without raw_decode's detour
        return scanstring(s, i + 1)
    value, end = _decoder.raw_decode(s, i)  # RecursionError past Python's limit: _Buffer.parse says so
    if isinstance(value, dict | list):  # parsed: now bounded like every JSON file (jsonfile.loads)
        try:
            jsonfile.loads(s[i:end], "value")
        except ConvertError as e:
            raise _TooDeep(str(e).removeprefix("value: ")) from None
    return value, end


class _TooDeep(Exception):
    """A value nested deeper than any JSON file the tool reads: not retried with more of the file."""


class _Buffer:
    def __init__(self, f: BinaryIO, piece: int):
        self.f, self.s, self.i, self.offset, self.eof = f, "", 0, 0, False
        self.piece = piece
        self.text = codecs.getincrementaldecoder("utf-8")()

    def more(self, n: int) -> None:
        """At least ``n`` characters from the read position, or the rest of the file."""
        while len(self.s) - self.i < n and not self.eof:
            piece = self.f.read(max(self.piece, n))
            self.eof = not piece
            self.offset += self.i
            self.s = self.s[self.i:] + self.text.decode(piece, final=self.eof)
            self.i = 0

    def skip_ws(self) -> None:
        while True:
            if len(self.s) - self.i < 1:
                self.more(1)
            self.i = _WS.match(self.s, self.i).end()
            if self.i < len(self.s) or self.eof:
                return

    def next_char(self) -> str:
        self.skip_ws()
        if self.i >= len(self.s):
            raise ValueError("unexpected end of the file")
        self.i += 1
        return self.s[self.i - 1]

    def expect(self, ch: str) -> None:
        got = self.next_char()
        if got != ch:
            raise ValueError(f"expected {ch!r} at character {self.offset + self.i - 1}, found {got!r}")

    def entries(self) -> Iterator[str]:
        """The keys of the object whose '{' was just read; the caller parses each value."""
        self.skip_ws()
        if self.s[self.i:self.i + 1] == "}":
            self.i += 1
            return
        while True:
            key = self.parse(_string)
            self.expect(":")
            yield key
            c = self.next_char()
            if c == "}":
                return
            if c != ",":
                raise ValueError(f"expected ',' or '}}' at character {self.offset + self.i - 1}, found {c!r}")

    def parse(self, fn: Callable[[str, int], tuple[Any, int]]) -> Any:
        self.skip_ws()
        want = self.piece
        while True:
            try:
                value, end = fn(self.s, self.i)
            except (_TooDeep, RecursionError) as e:
                raise ValueError(f"a value at character {self.offset + self.i}: "
                                 f"{e if isinstance(e, _TooDeep) else 'JSON nested too deeply'}") from None
            except (ValueError, IndexError):
                if self.eof:
                    raise ValueError(f"not valid JSON at character {self.offset + self.i}") from None
                end = None
            if end is not None and (end < len(self.s) or self.eof):
                self.i = end
                return value
            want *= 2
            self.more(len(self.s) - self.i + want)
