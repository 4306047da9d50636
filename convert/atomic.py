"""The one way a small file (a config, the index, the manifest, the resume journal) is written: whole
or not at all. The bytes go to ``NAME.partial``, are flushed to disk, and the temporary is renamed over
``NAME``, so a crash leaves the previous file or the new one, never a torn one (shards and side files,
written in pieces, follow the same discipline in ``write``)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from . import faults
from .errors import ConvertError

PARTIAL = ".partial"


def write_atomic(path: Path, data: bytes, fault: str | None = None) -> None:
    """``fault``: the fault-injection point hit half-way (``convert/faults.py``), for the kill tests."""
    write_atomic_chunks(path, (data[: len(data) // 2], data[len(data) // 2 :]), fault)


def write_atomic_chunks(path: Path, chunks: Iterable[bytes], fault: str | None = None) -> None:
    """``write_atomic`` of bytes made piece by piece (the index of a million tensors: never held whole);
    ``fault`` is hit after the first piece."""
    tmp = path.with_name(path.name + PARTIAL)
    try:
        with open(tmp, "wb") as f:
            for i, chunk in enumerate(chunks):
                f.write(chunk)
                if fault and i == 0:
                    faults.point(fault)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise ConvertError(f"{tmp}: cannot write: {e.strerror or e}") from None


def dumps(obj: dict, compact_lists: tuple[str, ...] = ()) -> str:
    """Indented JSON, except that the lists named in ``compact_lists`` hold one compact entry a line
    (a real K3 manifest has ~250k modules: indenting each would make it several hundred MB)."""
    return "".join(dump_chunks(obj, compact_lists))


def dump_chunks(obj: dict, compact_lists: tuple[str, ...] = (), block: int = 4096) -> Iterator[str]:
    """``dumps``'s text in pieces: a compact list ``block`` entries a piece (the whole release's manifest, 30 MB,
    is never held whole as text; issue 43)."""
    if not compact_lists:
        yield json.dumps(obj, indent=2) + "\n"
        return
    sep = "{\n"
    for k, v in obj.items():
        if k in compact_lists and isinstance(v, list):
            yield f"{sep}  {json.dumps(k)}: [\n"
            for i in range(0, len(v), block):
                yield ("" if i == 0 else ",\n") + ",\n".join(
                    "    " + json.dumps(x, separators=(",", ":")) for x in v[i : i + block])
            yield "\n  ]"
        else:
            yield f"{sep}  {json.dumps(k)}: " + json.dumps(v, indent=2).replace("\n", "\n  ")
        sep = ",\n"
    yield ("{\n" if sep == "{\n" else "") + "\n}\n"  # {} as dumps always wrote it


def write_json_atomic(path: Path, obj: dict, compact_lists: tuple[str, ...] = ()) -> None:
    write_atomic_chunks(path, (c.encode() for c in dump_chunks(obj, compact_lists)), fault="json")
