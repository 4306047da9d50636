"""Read stage: safetensors headers, the shard index, config.json, tensor data (read or memory-mapped).

The safetensors library's ``safe_open`` is not used for reading: it exposes neither the raw byte
range of a tensor (needed for byte-identical pass-through and for hashing) nor a way to drop pages
after use, and its errors do not name the shard. Parsing a header is ~40 lines of validation, so
the tool does it itself and answers bad input with one line that names the file and tensor.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import mmap
import os
import re
import threading
import warnings
from dataclasses import dataclass, field
from itertools import repeat
from operator import attrgetter, eq
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Protocol

from . import paths
from .errors import ConvertError
from .sidefiles import Skipped, scan

if TYPE_CHECKING:  # torch is imported where tensors are made: planning needs only the headers, and
    import numpy as np  # pack starts reading the input while torch loads (about a second)
    import torch

#: The safetensors library refuses headers above 100 MB; so do we.
MAX_HEADER_BYTES = 100 * 1024 * 1024

INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class DType:
    name: str
    itemsize: int
    torch_name: str  # the torch dtype's attribute name

    @property
    def torch(self) -> torch.dtype:
        import torch

        return getattr(torch, self.torch_name)


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("F64", 8, "float64"),
        DType("F32", 4, "float32"),
        DType("F16", 2, "float16"),
        DType("BF16", 2, "bfloat16"),
        DType("F8_E4M3", 1, "float8_e4m3fn"),
        DType("F8_E5M2", 1, "float8_e5m2"),
        DType("I64", 8, "int64"),
        DType("I32", 4, "int32"),
        DType("I16", 2, "int16"),
        DType("I8", 1, "int8"),
        DType("U8", 1, "uint8"),
        DType("BOOL", 1, "bool"),
    )
}


class TensorInfo(NamedTuple):  # a tuple: made 4x faster than a frozen dataclass (the released K3 has 500,000)
    """Where one stored tensor lives: file (relative to the checkpoint), dtype, shape, byte range."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def parse_header(path: Path, rel: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Validate and parse one safetensors header; return its tensors and its metadata."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ConvertError(f"{rel}: truncated safetensors file ({size} bytes, no header length)")
            n = int.from_bytes(head, "little")
            if n > MAX_HEADER_BYTES:
                raise ConvertError(f"{rel}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
            if 8 + n > size:
                raise ConvertError(f"{rel}: header length {n} is larger than the file ({size} bytes)")
            raw = f.read(n)
    except OSError as e:
        raise ConvertError(f"{rel}: cannot read: {e.strerror or e}") from None
    return _parse_header_bytes(raw, rel, size)


def _parse_header_bytes(raw: bytes, rel: str, size: int) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    data_start = 8 + len(raw)
    data_len = size - data_start
    try:
        text = raw.decode("utf-8")
        fast = _parse_fast(text, rel, data_start, data_len)
        if fast is not None:
            return fast
        obj = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ConvertError(f"{rel}: header is not valid JSON ({e.__class__.__name__})") from None
    if not isinstance(obj, dict):
        raise ConvertError(f"{rel}: header is not a JSON object")
    meta = obj.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ConvertError(f"{rel}: __metadata__ must be a map of strings")
    tensors: dict[str, TensorInfo] = {}
    for name, entry in obj.items():
        tensors[name] = _parse_entry(name, entry, rel, data_start)
    _check_layout(tensors, rel, data_start, data_len)
    return tensors, meta


# A header as safetensors writes it (compact JSON, each entry's keys dtype, shape, data_offsets in that
# order) is read with one regex instead of json.loads and a dict per tensor: 3x faster on the released K3's
# 96 headers (500,000 tensors). Anything else (another key order, white space, escapes, a repeated name, any
# fault) returns None and takes the json path, so what is accepted and every error stay the same.
_STR = r'[^"\\\x00-\x1f]*'
_NUM = r"(?:0|[1-9][0-9]*)"
_FAST_HEAD = re.compile(rf'\{{(?:"__metadata__":(\{{(?:"{_STR}":"{_STR}"(?:,"{_STR}":"{_STR}")*)?\}}),)?')
_FAST_ENTRY = re.compile(rf'"({_STR})":\{{"dtype":"([A-Z0-9_]+)","shape":\[((?:{_NUM}(?:,{_NUM})*)?)\],'
                         rf'"data_offsets":\[({_NUM}),({_NUM})\]\}}(,|\}}[ \t\n\r]*\Z)')
_FAST_ENTRY_CHARS = len('"":{"dtype":"","shape":[],"data_offsets":[,]}')


def _parse_fast(text: str, rel: str, data_start: int, data_len: int
                ) -> tuple[dict[str, TensorInfo], dict[str, str]] | None:
    head = _FAST_HEAD.match(text)
    if head is None:
        return None
    rows = _FAST_ENTRY.findall(text, head.end())
    if not rows or rows[-1][5] == ",":
        return None
    # the matches do not overlap, so they cover the text exactly when their lengths add up to it
    covered = _FAST_ENTRY_CHARS * len(rows) + sum(sum(map(len, col)) for col in zip(*rows, strict=True))
    if head.end() + covered != len(text):
        return None
    shapes: dict[tuple[str, str], tuple[tuple[int, ...], int]] = {}
    tensors: dict[str, TensorInfo] = {}
    pos, in_order = data_start, True
    for name, dtype, shape_text, a, b, _ in rows:
        got = shapes.get((dtype, shape_text))
        if got is None:
            if dtype not in DTYPES:
                return None
            shape = tuple(map(int, shape_text.split(","))) if shape_text else ()
            got = shapes[dtype, shape_text] = (shape, math.prod(shape) * DTYPES[dtype].itemsize)
        start, end = data_start + int(a), data_start + int(b)
        if end - start != got[1]:
            return None
        tensors[name] = TensorInfo(name, rel, dtype, got[0], start, end)
        in_order = in_order and start == pos
        pos = end
    if len(tensors) != len(rows) or "__metadata__" in tensors:
        return None
    meta = json.loads(head.group(1)) if head.group(1) else {}
    if not (in_order and pos - data_start == data_len):
        _check_layout(tensors, rel, data_start, data_len)  # the json path would fail (or pass) the same way
    return tensors, meta


def _parse_entry(name: str, entry: object, rel: str, data_start: int) -> TensorInfo:
    """One header entry; a well-formed one takes the fast path, anything else the checks that name the fault."""
    if type(entry) is dict:
        dtype, shape, offs = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        dt = DTYPES.get(dtype) if type(dtype) is str else None
        if dt is not None and type(shape) is list and type(offs) is list and len(offs) == 2:
            a, b = offs
            n = dt.itemsize
            for d in shape:
                if type(d) is not int or d < 0:
                    break
                n *= d
            else:
                if type(a) is int and type(b) is int and 0 <= a <= b and b - a == n:
                    return TensorInfo(name, rel, dtype, tuple(shape), data_start + a, data_start + b)
    return _parse_entry_checked(name, entry, rel, data_start)


def _parse_entry_checked(name: str, entry: object, rel: str, data_start: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise ConvertError(f"{rel}: tensor {name}: entry is not an object")
    dtype, shape, offs = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPES:
        raise ConvertError(f"{rel}: tensor {name}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise ConvertError(f"{rel}: tensor {name}: shape {shape!r} is not a list of non-negative integers")
    if (
        not isinstance(offs, list)
        or len(offs) != 2
        or not all(type(o) is int and o >= 0 for o in offs)
        or offs[1] < offs[0]
    ):
        raise ConvertError(f"{rel}: tensor {name}: data_offsets {offs!r} are not [begin, end]")
    want = math.prod(shape) * DTYPES[dtype].itemsize
    if offs[1] - offs[0] != want:
        raise ConvertError(
            f"{rel}: tensor {name}: {dtype}{shape} needs {want} bytes but data_offsets span {offs[1] - offs[0]}"
        )
    return TensorInfo(name, rel, dtype, tuple(shape), data_start + offs[0], data_start + offs[1])


def _check_layout(tensors: dict[str, TensorInfo], rel: str, data_start: int, data_len: int) -> None:
    """Data must be contiguous, without overlap or holes, and end with the file (as safetensors checks)."""
    pos = data_start
    for t in sorted(tensors.values(), key=attrgetter("start", "end")):
        if t.start != pos:
            what = "overlaps the previous tensor" if t.start < pos else "leaves a hole before it"
            raise ConvertError(f"{rel}: tensor {t.name}: data at offset {t.start - data_start} {what}")
        pos = t.end
    if pos - data_start > data_len:
        raise ConvertError(
            f"{rel}: truncated: tensors need {pos - data_start} data bytes, the file holds {data_len}"
        )
    if pos - data_start < data_len:
        raise ConvertError(f"{rel}: {data_len - (pos - data_start)} trailing bytes after the last tensor")


def load_json(path: Path, rel: str) -> dict:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConvertError(f"{rel}: missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConvertError(f"{rel}: not valid JSON ({e.__class__.__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise ConvertError(f"{rel}: not a JSON object")
    return obj


def _inside(folder: Path, rel: str, what: str) -> Path:
    """Resolve ``rel`` under ``folder``; refuse absolute paths, ``..`` and symlinks escaping it."""
    if os.path.isabs(rel) or any(p == ".." for p in Path(rel).parts):
        raise ConvertError(f"{what}: file {rel!r} is outside the input folder")
    path = folder / rel
    real = path.resolve()
    if not real.is_relative_to(folder.resolve()):
        raise ConvertError(f"{what}: file {rel!r} resolves outside the input folder")
    if not real.is_file():
        raise ConvertError(f"{what}: names missing file {rel!r}")
    return path


@dataclass
class Checkpoint:
    """A checkpoint folder's headers and config: everything the plan needs, no tensor data."""

    folder: Path
    config: dict
    files: list[str]  # shard files in index order
    tensors: dict[str, TensorInfo]  # every stored tensor by name
    file_sizes: dict[str, int] = field(default_factory=dict)
    side_files: list[str] = field(default_factory=list)  # non-weight files to copy (sidefiles.scan)
    has_index: bool = False
    side_folders: list[str] = field(default_factory=list)  # empty folders to recreate
    skipped_files: list[Skipped] = field(default_factory=list)  # input files not copied, with the reason

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


@contextlib.contextmanager
def gc_paused():
    """Pause the cyclic garbage collector while many small objects are made (headers, the plan): its
    collections, triggered by allocation counts, walk every live object again and again (measured on the
    released K3's 500,000 tensors: half the time of reading the headers). The objects made hold no cycles."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@gc_paused()
def open_checkpoint(folder: str | os.PathLike, need_weights: bool = True) -> Checkpoint:
    """Read config.json, the index and every shard header of ``folder`` (no tensor data)."""
    folder = paths.folder(folder)
    config = load_json(folder / "config.json", f"{folder}/config.json")
    index_path = folder / INDEX_NAME
    tensors: dict[str, TensorInfo] = {}
    files: list[str]
    weight_map: dict[str, str] | None = None
    if index_path.exists():
        index = load_json(index_path, INDEX_NAME)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not (
            all(map(isinstance, weight_map, repeat(str))) and all(map(isinstance, weight_map.values(), repeat(str)))
        ):
            raise ConvertError(f"{INDEX_NAME}: weight_map is not a map of tensor name to file")
        files = list(dict.fromkeys(weight_map.values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files and need_weights:
            raise ConvertError(f"{folder}: no *.safetensors files and no {INDEX_NAME}")
    # Every named file must exist inside the folder before any header is read: a missing or
    # escaping file is the more useful error than the tensors it leaves unaccounted for.
    shard_paths = {rel: _inside(folder, rel, INDEX_NAME if weight_map is not None else str(folder)) for rel in files}
    sizes: dict[str, int] = {}
    for rel, path in shard_paths.items():
        sizes[rel] = path.stat().st_size
        found, _meta = parse_header(path, rel)
        # checked in bulk (the released K3 has 500,000 names); a fault is found and named by the loop below
        if found.keys().isdisjoint(tensors.keys()) and (
            weight_map is None or all(map(eq, map(weight_map.get, found), repeat(rel)))
        ):
            tensors.update(found)
            continue
        for name, info in found.items():
            if name in tensors:
                raise ConvertError(f"{rel}: tensor {name} is also stored in {tensors[name].file}")
            if weight_map is not None and weight_map.get(name) != rel:
                where = weight_map.get(name)
                raise ConvertError(
                    f"{rel}: tensor {name} is not listed in {INDEX_NAME}"
                    if where is None
                    else f"{rel}: tensor {name} is stored here but {INDEX_NAME} says {where}"
                )
            tensors[name] = info
    if weight_map is not None and len(tensors) != len(weight_map):  # every stored tensor is listed: equal sets
        for name, rel in weight_map.items():
            if name not in tensors:
                raise ConvertError(f"{INDEX_NAME}: tensor {name} is not in {rel}")
    side = scan(folder, consumed(files))
    return Checkpoint(folder, config, files, tensors, sizes, list(side.copied), weight_map is not None,
                      list(side.folders), list(side.skipped))


def consumed(files: list[str]) -> list[str]:
    """The input files pack reads and writes anew: the shards, ``config.json`` and the index."""
    return [*files, "config.json", INDEX_NAME]


class TensorReader:
    """Zero-copy, read-only views of stored tensors over one memory map per shard.

    Pages a finished group touched are dropped from the process (``release``), so resident memory
    follows the group being converted, not the part of the checkpoint read so far.
    """

    def __init__(self, folder: Path):
        self.folder = folder
        self._maps: dict[str, mmap.mmap] = {}
        self._lock = threading.Lock()  # the compute thread and the writer thread both map files

    def _map(self, rel: str) -> mmap.mmap:
        with self._lock:
            m = self._maps.get(rel)
            if m is None:
                with open(self.folder / rel, "rb") as f:
                    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                self._maps[rel] = m
            return m

    def raw(self, t: TensorInfo) -> memoryview:
        return memoryview(self._map(t.file))[t.start : t.end]

    def tensor(self, t: TensorInfo) -> torch.Tensor:
        import torch

        dt = DTYPES[t.dtype].torch
        if t.nbytes == 0:
            return torch.empty(t.shape, dtype=dt)
        with warnings.catch_warnings():
            # The map is read-only on purpose; torch warns that it cannot write through it.
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(self._map(t.file), dtype=dt, count=t.nbytes // DTYPES[t.dtype].itemsize,
                                    offset=t.start)
        return flat.view(t.shape)

    def _advise(self, t: TensorInfo, advice: int | None) -> None:
        m = self._map(t.file) if advice is not None else None
        if m is None:
            return
        page = mmap.PAGESIZE
        lo = t.start - t.start % page
        hi = min(len(m), -(-t.end // page) * page)
        if hi > lo:
            m.madvise(advice, lo, hi - lo)

    def release(self, t: TensorInfo) -> None:
        """Drop ``t``'s pages from this process (they stay in the page cache)."""
        if t.file in self._maps:
            self._advise(t, getattr(mmap, "MADV_DONTNEED", None))

    def close(self) -> None:
        for m in self._maps.values():
            with contextlib.suppress(BufferError):  # a view is still alive: it closes when collected
                m.close()
        self._maps.clear()


def readahead(folder: Path, parts: list[TensorInfo], budget: int) -> None:
    """Ask the kernel to start reading the first ``budget`` bytes of ``parts`` into the page cache
    (a hint the kernel may drop under memory pressure; queueing it can block, so callers run it on
    a thread)."""
    reader = RangeReader(folder)
    try:
        for t in parts:
            if budget <= 0:
                break
            n = min(t.nbytes, budget)
            reader.will_need(t, 0, n)
            budget -= n
    except OSError:
        pass  # only a hint
    finally:
        reader.close()


class TensorSource(Protocol):
    """What the compute stage reads stored tensors from: a memory map, or buffers read for it."""

    def tensor(self, t: TensorInfo) -> torch.Tensor: ...

    def raw(self, t: TensorInfo) -> memoryview | np.ndarray: ...


def _typed(buf: np.ndarray, t: TensorInfo) -> torch.Tensor:
    import torch

    dt = DTYPES[t.dtype].torch
    if t.nbytes == 0:
        return torch.empty(t.shape, dtype=dt)
    return torch.from_numpy(buf).view(dt).view(t.shape)


class RangeReader:
    """Reads byte ranges of stored tensors into buffers with ``pread``: the pipeline's reader.

    Explicit reads rather than memory-map faults: one large read on a reader thread overlaps the
    compute of the previous group and yields the very buffers the hashers need. The buffers are
    numpy arrays, so reading and hashing start before torch has loaded."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def _fd(self, rel: str) -> int:
        with self._lock:
            fd = self._fds.get(rel)
            if fd is None:
                fd = self._fds[rel] = os.open(self.folder / rel, os.O_RDONLY)
            return fd

    def read(self, t: TensorInfo, lo: int = 0, hi: int | None = None, into: np.ndarray | None = None) -> np.ndarray:
        """Bytes [lo, hi) of ``t`` (relative to its start), into ``into`` or a new uint8 array."""
        import numpy as np

        hi = t.nbytes if hi is None else hi
        buf = np.empty(hi - lo, dtype=np.uint8) if into is None else into
        view = memoryview(buf)
        fd, pos = self._fd(t.file), t.start + lo
        while view:
            n = os.preadv(fd, [view], pos)
            if n == 0:
                raise ConvertError(f"{t.file}: tensor {t.name}: file ends before the tensor's data (truncated?)")
            view, pos = view[n:], pos + n
        return buf

    def will_need(self, t: TensorInfo, lo: int = 0, hi: int | None = None) -> None:
        """Start reading a later range into the page cache now (asynchronous readahead)."""
        hi = t.nbytes if hi is None else hi
        if hi > lo and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd(t.file), t.start + lo, hi - lo, os.POSIX_FADV_WILLNEED)

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


class BufferPool:
    """Read buffers, reused: a new buffer costs a page fault and a zeroed page per 4 KB on first
    touch (measured: more system time than the read itself).

    ``get`` returns the smallest free buffer that fits (if at most about twice the size asked for);
    ``put`` takes it back, and free buffers are dropped (the largest first) while free and in-use
    buffers together exceed ``limit`` bytes.

    Buffers are pageable, also for a GPU: page-locked ones copy to the GPU 7x faster, but over a
    whole pack that is well under the disk's time (measured, benchmarks/RESULTS.md), and torch's
    page-locked allocator keeps every block it ever made (peak memory grew with the checkpoint)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._free: list[np.ndarray] = []
        self._in_use = 0
        self._lock = threading.Lock()

    def get(self, n: int) -> np.ndarray:
        import numpy as np

        with self._lock:
            for i, b in enumerate(self._free):  # sorted by size: the first that fits is the smallest
                if n <= b.nbytes <= 2 * n + (1 << 20):  # not a large buffer for a small read
                    self._in_use += b.nbytes
                    return self._free.pop(i)
            buf = np.empty(max(n, 1), dtype=np.uint8)
            self._in_use += buf.nbytes
            self._trim()
            return buf

    def put(self, buf: np.ndarray, reuse: bool = True) -> None:
        """Give ``buf`` back (``reuse=False``: it stays referenced elsewhere, only count it out)."""
        with self._lock:
            self._in_use -= buf.nbytes
            if reuse:
                self._free.append(buf)
                self._free.sort(key=lambda b: b.nbytes)
            self._trim()

    def _trim(self) -> None:
        while self._free and self._in_use + sum(b.nbytes for b in self._free) > self.limit:
            self._free.pop()


class Loaded:
    """A group's stored tensors, read into buffers (the compute stage's view of a ``RangeReader``)."""

    def __init__(self, buffers: dict[str, np.ndarray]):
        self.buffers = buffers

    def tensor(self, t: TensorInfo) -> torch.Tensor:
        return _typed(self.buffers[t.name], t)

    def raw(self, t: TensorInfo) -> np.ndarray:
        return self.buffers[t.name]
