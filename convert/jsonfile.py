"""The one way the tool opens a file it did not write itself, and the one reader of every JSON file it opens.

A user's folder can hold anything under a familiar name: ``config.json`` as a FIFO (an ``open()`` for reading
then blocks until a writer comes, forever), a device, a symlink loop, a 50 GB file, JSON nested 100,000 deep
(the ``json`` module's recursion then raises ``RecursionError``, a traceback), or a deep-but-parseable document
that the code walking it later cannot copy. So:

- :func:`open_regular` is the rule for what is a regular input file: opened without blocking (``O_NONBLOCK``:
  a FIFO opens at once), then ``fstat`` on what was opened (no race between a check and the open) must say
  a regular file; a symlink loop (``ELOOP``) or anything else is one line naming the file.
- :func:`read_json` reads such a file, at most ``limit`` bytes, and :func:`loads` parses it depth-safely:
  nesting deeper than :data:`MAX_DEPTH` (no file the tool reads nests more than ~8) is refused before the
  parser recurses, with the position, so neither the parser nor any later walk of the object can hit
  Python's recursion limit.
Every fault is a :class:`ConvertError` with one line naming the file.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from .errors import ConvertError

#: Deepest nesting of arrays and objects accepted in any JSON file the tool reads (configs nest ~4 deep,
#: manifests ~6); far below Python's recursion limit, so any recursive walk of the result is safe.
MAX_DEPTH = 64
#: Largest JSON file read whole: the released K3's index is ~100 MB, its manifest.json 30 MB.
MAX_JSON_BYTES = 1 << 30

# A JSON string (escapes included): the depth scan drops them whole, then counts brackets in what is left.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_BRACKETS = re.compile(r"[\[\]{}]")


def open_regular(path: str | os.PathLike, shown: str) -> int:
    """A read-only descriptor of ``path``, which must be (or be a symlink to) a regular file. Never blocks
    (a FIFO is refused, not waited on); ``shown``: how the file is named in the error."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ConvertError(f"{shown}: {_why(e)}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ConvertError(f"{shown}: {describe_mode(mode)}, expected a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def regular_file_error(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a regular input file (it is then skipped or refused), None when it is one. The same
    rule as :func:`open_regular`, without opening: ``stat`` follows symlinks, a loop is ``ELOOP``."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        return _why(e)
    return None if stat.S_ISREG(mode) else describe_mode(mode)


def describe_mode(mode: int) -> str:
    """What a non-regular file is, in words."""
    if stat.S_ISDIR(mode):
        return "is a folder"
    if stat.S_ISFIFO(mode):
        return "is a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "is a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "is a device"
    return "is not a regular file"


def _why(e: OSError) -> str:
    if e.errno == errno.ELOOP:
        return "is a symlink loop (or a chain of more than 40 symlinks)"
    if e.errno == errno.ENOENT:
        return "missing"
    return f"cannot read: {e.strerror or e}"


def read_bytes(path: str | os.PathLike, shown: str, limit: int = MAX_JSON_BYTES) -> bytes:
    """The whole content of a regular file of at most ``limit`` bytes."""
    fd = open_regular(path, shown)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        if size > limit:
            raise ConvertError(f"{shown}: {size} bytes, more than the {limit}-byte limit for this file")
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise ConvertError(f"{shown}: cannot read: {e.strerror or e}") from None
    if len(data) > limit:
        raise ConvertError(f"{shown}: more than the {limit}-byte limit for this file")
    return data


def loads(text: str | bytes, shown: str, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads(text)`` that cannot recurse deeper than ``max_depth``: a deeper document is refused
    before it is parsed (a RecursionError would be a traceback, or a later walk's)."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConvertError(f"{shown}: not valid JSON (not UTF-8 at byte {e.start})") from None
    _check_depth(text, shown, max_depth)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConvertError(f"{shown}: not valid JSON (line {e.lineno} column {e.colno}: {e.msg})") from None
    except RecursionError:  # unreachable after the scan; kept so that no parse can ever be a traceback
        raise ConvertError(f"{shown}: JSON nested too deeply") from None


def _check_depth(text: str, shown: str, max_depth: int) -> None:
    """Refuse nesting deeper than ``max_depth`` (strings skipped; brackets of invalid JSON counted as they come:
    the parser reports the rest)."""
    bare = _STRING.sub("", text)  # at C speed; an index of 1 M names keeps its two braces
    if bare.count("[") + bare.count("{") <= max_depth:
        return
    depth = 0
    for m in _BRACKETS.finditer(bare):
        if m.group() in "[{":
            depth += 1
            if depth > max_depth:
                raise ConvertError(f"{shown}: JSON nested deeper than {max_depth} levels; "
                                   "no file this tool reads nests so deep")
        else:
            depth -= 1


def read_json(path: str | os.PathLike, shown: str | None = None, *, limit: int = MAX_JSON_BYTES,
              want: type | None = dict) -> Any:
    """The parsed content of the JSON file ``path``: a regular file (never blocks), at most ``limit`` bytes,
    nesting at most :data:`MAX_DEPTH`; ``want``: the type the top level must have (None: any)."""
    shown = shown or str(path)
    return parse(read_bytes(path, shown, limit), shown, limit=limit, want=want)


def parse(data: bytes, shown: str, *, limit: int = MAX_JSON_BYTES, want: type | None = dict) -> Any:
    """:func:`read_json`'s checks on bytes a source already holds (``sources``: a Hub download, a test's
    in-memory source): at most ``limit`` bytes, nesting at most :data:`MAX_DEPTH`, top level ``want``."""
    if len(data) > limit:
        raise ConvertError(f"{shown}: {len(data)} bytes, more than the {limit}-byte limit for this file")
    obj = loads(data, shown)
    if want is not None and not isinstance(obj, want):
        raise ConvertError(f"{shown}: not a JSON {'object' if want is dict else want.__name__}")
    return obj


def resolve(path: Path, shown: str) -> Path:
    """``path.resolve()`` whose symlink loop is one line, not pathlib's RuntimeError (Python 3.11) or OSError."""
    try:
        return path.resolve()
    except (RuntimeError, OSError) as e:
        loop = isinstance(e, RuntimeError) or getattr(e, "errno", None) == errno.ELOOP
        raise ConvertError(f"{shown}: {'is a symlink loop' if loop else f'cannot resolve: {e}'}") from None
