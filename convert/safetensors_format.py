"""The safetensors file format: its header, parsed (reading a checkpoint) and encoded (writing a shard).

A file is an 8-byte little-endian header length, the header (JSON: for each tensor its dtype, shape and
byte range in the data section; an optional ``__metadata__`` map of strings), then the data.

The safetensors library's ``safe_open`` is not used for reading: it exposes neither the raw byte
range of a tensor (needed for byte-identical pass-through and for hashing) nor a way to drop pages
after use, and its errors do not name the shard. Parsing a header is ~40 lines of validation, so
the tool does it itself and answers bad input with one line that names the file and tensor.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii as _json_str
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from . import jsonfile
from .errors import ConvertError
from .sources.local import LocalFile

if TYPE_CHECKING:
    import torch

    from .sources import Source, SourceFile

#: The safetensors library refuses headers above 100 MB; so do we.
MAX_HEADER_BYTES = 100 * 1024 * 1024


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
        DType("F8_E8M0", 1, "float8_e8m0fnu"),  # MX scales (DeepSeek V4's `.scale` tensors)
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
    """Validate and parse the header of the safetensors file at ``path`` (verify reads the output's shards so);
    return its tensors and its metadata."""
    return _read_header(LocalFile.open(path, rel), rel)  # a FIFO or a loop is refused, never waited on


def read_header(source: Source, rel: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Validate and parse the header of ``rel`` of an input ``source``: the 8-byte length and the JSON header,
    two byte ranges (for the Hub, two range requests: the plan needs no tensor data)."""
    return _read_header(source.open(rel, rel), rel)


def _read_header(f: SourceFile, rel: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    try:
        with f:
            size = f.size
            head = f.read_range(0, 8)
            if len(head) < 8:
                raise ConvertError(f"{rel}: truncated safetensors file ({size} bytes, no header length)")
            n = int.from_bytes(head, "little")
            if n > MAX_HEADER_BYTES:
                raise ConvertError(f"{rel}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
            if 8 + n > size:
                raise ConvertError(f"{rel}: header length {n} is larger than the file ({size} bytes)")
            raw = f.read_range(8, n)
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
        obj = jsonfile.loads(text, f"{rel}: header")
    except UnicodeDecodeError as e:
        raise ConvertError(f"{rel}: header is not valid JSON ({e.__class__.__name__})") from None
    if not isinstance(obj, dict):
        raise ConvertError(f"{rel}: header is not a JSON object")
    # absent or null: no metadata (as the safetensors library reads it); anything else but a map of strings
    # (a list, "", 0, false) the library refuses to load, so it is refused here too, whatever its truth value
    meta = obj.pop("__metadata__", None)
    meta = {} if meta is None else meta
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ConvertError(f"{rel}: __metadata__ must be a map of strings (found {type(meta).__name__} "
                           f"{json.dumps(meta)[:40]}); the safetensors library refuses such a file")
    for text in (*meta, *meta.values()):  # (a string the fast path takes has no escape: it is text)
        _check_text(text, rel, "__metadata__ string")
    tensors: dict[str, TensorInfo] = {}
    for name, entry in obj.items():
        _check_text(name, rel, "tensor name")
        tensors[name] = _parse_entry(name, entry, rel, data_start)
    _check_layout(tensors, rel, data_start, data_len)
    return tensors, meta


def _check_text(text: str, rel: str, what: str) -> None:
    """A JSON string escaping half of a surrogate pair (``"\\ud800"``) decodes to no Unicode text: no header can hold
    it in UTF-8, and the safetensors library refuses such a header; refused here, naming it, before anything
    tries to write it."""
    if not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError:
            raise ConvertError(f"{rel}: {what} {text!r} holds a lone surrogate escape (\\ud800-\\udfff): not "
                               "Unicode text; the safetensors library refuses such a header") from None


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
    shapes: dict[str, tuple[str, tuple[int, ...], int]] = {}
    tensors: dict[str, TensorInfo] = {}
    pos, in_order = data_start, True
    new = tuple.__new__  # TensorInfo(...) without its __new__'s Python frame: 500,000 of them
    for name, dtype, shape_text, a, b, _ in rows:
        got = shapes.get(dtype + ":" + shape_text)  # one key string, not a tuple (neither holds a ':')
        if got is None:
            if dtype not in DTYPES:
                return None
            shape = tuple(map(int, shape_text.split(","))) if shape_text else ()
            got = shapes[dtype + ":" + shape_text] = (dtype, shape, math.prod(shape) * DTYPES[dtype].itemsize)
        start = data_start + int(a)
        end = start + got[2]
        if data_start + int(b) != end:
            return None
        tensors[name] = new(TensorInfo, (name, rel, got[0], got[1], start, end))
        if start != pos:
            in_order = False
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



# ---------------------------------------------------------------------------------------------
# Encoding: the header of a shard written


class HeaderTensor(NamedTuple):
    """What a header says of one tensor besides its byte range (``plan.OutTensor`` is one)."""

    name: str
    dtype: str
    shape: tuple[int, ...]


@functools.lru_cache(maxsize=4096)
def size_of(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * DTYPES[dtype].itemsize


HEADER_HEAD = '{"__metadata__":{"format":"pt"}'  # what encode_header writes before the tensors, "}" after them


def entry_text_len(name: str, dtype: str, shape: tuple[int, ...]) -> int:
    """Characters of one tensor's entry in the header ``encode_header`` writes, but for its two offsets' digits:
    ``,"name":{"dtype":"D","shape":[S],"data_offsets":[a,b]}`` (the plan sizes a million entries by it)."""
    return (len(_json_str(name)) + len(_json_str(dtype)) + len(",".join(map(str, shape)))
            + len(',:{"dtype":,"shape":[],"data_offsets":[,]}'))


def padded_len(text_len: int, align: int = 16) -> int:
    """The header's length in bytes once padded with spaces so that the data (after the 8-byte length) starts
    ``align``-byte aligned."""
    return text_len + (-(8 + text_len) % align)


def _header_text(ordered: Sequence[HeaderTensor], starts: list[int], ends: list[int]) -> str | None:
    """``json.dumps(header, separators=(",", ":"))`` of a shard header, written directly (a million
    tensors for the released K3); None when a name repeats (the dict would keep one)."""
    names = [t.name for t in ordered]
    if len(set(names)) != len(names):
        return None
    joined = "".join(names)  # names json.dumps writes as they are (in ASCII it escapes '"', '\\', controls)
    if joined.isascii() and joined.isprintable() and '"' not in joined and "\\" not in joined:
        names = [f'"{n}"' for n in names]
    else:
        names = [_json_str(n) for n in names]
    frags: dict[tuple[str, tuple[int, ...]], str] = {}
    parts = [HEADER_HEAD]
    for t, name, a, b in zip(ordered, names, starts, ends, strict=True):
        frag = frags.get((t.dtype, t.shape))
        if frag is None:
            shape = ",".join(map(str, t.shape))
            frag = frags[t.dtype, t.shape] = f'{{"dtype":{_json_str(t.dtype)},"shape":[{shape}],"data_offsets":['
        parts.append(f",{name}:{frag}{a},{b}]}}")
    parts.append("}")
    return "".join(parts)


def encode_header(ordered: Sequence[HeaderTensor], starts: list[int], ends: list[int], align: int = 16) -> bytes:
    """The 8-byte length and the JSON header of ``ordered`` at data offsets ``starts``/``ends``, padded
    with spaces so that the data starts ``align``-byte aligned (16 for pack's outputs)."""
    text = _header_text(ordered, starts, ends)
    if text is None:
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        for t, a, b in zip(ordered, starts, ends, strict=True):
            header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [a, b]}
        text = json.dumps(header, separators=(",", ":"))
    raw = text.encode()
    raw += b" " * (padded_len(len(raw), align) - len(raw))
    return len(raw).to_bytes(8, "little") + raw
