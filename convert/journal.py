"""The resume journal: which output shards a pack has finished, so that an interrupted run
continues where it stopped instead of starting over.

It lives in the output folder as ``.kimi-convert-pack.json`` while a pack runs and is removed once
``manifest.json`` is in place. Each finished shard is recorded with its size, its sha256 and the
hashes and notes the manifest needs; a resumed run re-hashes every recorded shard and redoes any
that does not match. The journal is bound to the plan (a hash of the plan, which covers the input
headers, mapping and options) and to the input files' sizes and modification times.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .atomic import write_atomic
from .errors import ConvertError

NAME = ".kimi-convert-pack.json"
VERSION = 2  # 2: fingerprint renamed plan_sha256


@dataclass
class ShardRecord:
    size: int
    sha256: str
    tensors: dict[str, str]  # output tensor -> sha256
    sources: dict[str, str]  # stored input tensor -> sha256
    notes: dict[str, dict]


@dataclass
class Journal:
    plan_sha256: str  # the plan's hash (manifest.plan_hash): a resume refuses another plan's output
    command: str  # the command that resumes this pack
    inputs: dict[str, list[int]]  # file -> [size, mtime_ns]
    shards: dict[str, ShardRecord] = field(default_factory=dict)
    version: int = VERSION

    def save(self, folder: Path) -> None:
        write_atomic(folder / NAME, json.dumps(asdict(self), sort_keys=True).encode(), fault="journal")

    @staticmethod
    def load(folder: Path) -> Journal | None:
        path = folder / NAME
        if not path.exists():
            return None
        try:
            d = json.loads(path.read_text())
            shards = {k: ShardRecord(**v) for k, v in d.pop("shards").items()}
            j = Journal(**d, shards=shards)
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
            raise ConvertError(f"{path}: unreadable resume journal ({e}); start again with --overwrite") from None
        if j.version != VERSION:
            raise ConvertError(f"{path}: journal version {j.version} is not {VERSION}; start again with --overwrite")
        return j


def input_stamps(folder: Path, files: list[str]) -> dict[str, list[int]]:
    out = {}
    for f in files:
        st = (folder / f).stat()
        out[f] = [st.st_size, st.st_mtime_ns]
    return out
