"""The one way a small file (a config, the index, the manifest, the resume journal) is written: whole
or not at all. The bytes go to ``NAME.partial``, are flushed to disk, and the temporary is renamed over
``NAME``, so a crash leaves the previous file or the new one, never a torn one (shards and side files,
written in pieces, follow the same discipline in ``write``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from . import faults
from .errors import ConvertError

PARTIAL = ".partial"


def write_atomic(path: Path, data: bytes, fault: str | None = None) -> None:
    """``fault``: the fault-injection point hit half-way (``convert/faults.py``), for the kill tests."""
    tmp = path.with_name(path.name + PARTIAL)
    try:
        with open(tmp, "wb") as f:
            f.write(data[: len(data) // 2])
            if fault:
                faults.point(fault)
            f.write(data[len(data) // 2 :])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise ConvertError(f"{tmp}: cannot write: {e.strerror or e}") from None


def dumps(obj: dict, compact_lists: tuple[str, ...] = ()) -> str:
    """Indented JSON, except that the lists named in ``compact_lists`` hold one compact entry a line
    (a real K3 manifest has ~250k modules: indenting each would make it several hundred MB)."""
    if not compact_lists:
        return json.dumps(obj, indent=2) + "\n"
    parts = []
    for k, v in obj.items():
        if k in compact_lists and isinstance(v, list):
            body = ",\n".join("    " + json.dumps(x, separators=(",", ":")) for x in v)
            parts.append(f"  {json.dumps(k)}: [\n{body}\n  ]")
        else:
            parts.append(f"  {json.dumps(k)}: " + json.dumps(v, indent=2).replace("\n", "\n  "))
    return "{\n" + ",\n".join(parts) + "\n}\n"


def write_json_atomic(path: Path, obj: dict, compact_lists: tuple[str, ...] = ()) -> None:
    write_atomic(path, dumps(obj, compact_lists).encode(), fault="json")
