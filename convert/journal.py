"""The resume journal: which output shards a pack has finished, so that an interrupted run
continues where it stopped instead of starting over.

It lives in the output folder as ``.kimi-convert-pack.json`` while a pack runs and is removed once
``manifest.json`` is in place. Each finished shard is recorded with its size and digest and those of
its records file (``manifest-records/``: the manifest's per-module records, written with the shard);
a resumed run re-hashes every recorded shard and its records file and redoes any that does not
match. The journal stays small (a few numbers a shard), as it is rewritten each time a shard
finishes. It is bound to the plan (a hash of the plan, which covers the input headers, mapping and
options) and to the input files' identities as their source knows them (a local folder: sizes and
modification times; ``sources.FileEntry.stamp``).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import filenames
from .atomic import write_atomic
from .errors import ConvertError
from .jsonfile import read_json
from .sources import EntryKind, Source

NAME = filenames.JOURNAL
#: The lock a running pack holds on its output (outfolder.lock_output): its pid; removed when the output is finished.
LOCK = filenames.LOCK
VERSION = 5  # 2: fingerprint renamed plan_sha256; 3: hashes and notes moved to the records files;
#: 4: the records files' tensor digests are BLAKE3 (a version 3 journal's shards have sha256 records: not continued,
#: so that one manifest holds one digest); 5: files' digests are BLAKE3, labelled (``hashing.labelled``)


@dataclass
class ShardRecord:
    size: int
    digest: str  # ``hashing.labelled`` (``FILE_DIGEST``)
    records_size: int  # the shard's records file (manifest.records_name)
    records_digest: str
    modules: int  # records in it
    cast_blocks: int = 0  # MXFP4 blocks cast to NVFP4 (pack's summary line)
    cast_lossless: int = 0  # of which exact


@dataclass
class Journal:
    plan_sha256: str  # the plan's hash (plan.serialize.plan_hash): a resume refuses another plan's output
    command: str  # the command that resumes this pack
    inputs: dict[str, list[int | str]]  # input file -> its identity (sources.FileEntry.stamp: [size, mtime_ns])
    shards: dict[str, ShardRecord] = field(default_factory=dict)
    version: int = VERSION
    #: ``pack --upload``: shard -> the sha256 the upload computed as it sent it (its LFS object id, which a resume
    #: asks the Hub's LFS for)
    uploaded: dict[str, str] = field(default_factory=dict)
    #: input file -> its digest (labelled), once a wave has hashed it whole (bound to ``inputs``' stamp, which a
    #: resume checks): a resume does not read 1.4 TB of the released K3 again for the manifest's hashes of the files
    #: its killed run had finished (issue 43's kill leg)
    input_digests: dict[str, str] = field(default_factory=dict)

    def save(self, folder: Path) -> None:
        write_atomic(folder / NAME, json.dumps(asdict(self), sort_keys=True).encode(), fault="journal")

    @staticmethod
    def load(folder: Path) -> Journal | None:
        path = folder / NAME
        if not os.path.lexists(path):
            return None
        try:
            d = read_json(path, str(path))
            version = d.get("version")  # first: another version's records have other fields
            if version == VERSION:
                shards = {k: ShardRecord(**v) for k, v in d.pop("shards").items()}
                j = Journal(**d, shards=shards)
        except (ConvertError, OSError, ValueError, TypeError, KeyError, AttributeError) as e:
            raise ConvertError(f"{path}: unreadable resume journal ({e}); start again with --overwrite") from None
        if version != VERSION:
            raise ConvertError(f"{path}: journal version {version} is not {VERSION}; start again with --overwrite")
        return j


def intact(folder: Path, shard: str, rec: ShardRecord) -> bool:
    """Whether a journaled shard and its records file are still the bytes recorded (a resume keeps
    it then; otherwise both are written again)."""
    return records_intact(folder, shard, rec) and _same(folder / shard, rec.size, rec.digest)


def records_intact(folder: Path, shard: str, rec: ShardRecord) -> bool:
    """The shard's records file alone (``pack --upload --no-keep-output``: the shard itself is on the Hub)."""
    return _same(folder / filenames.records_name(shard), rec.records_size, rec.records_digest)


def _same(path: Path, size: int, digest: str) -> bool:
    from .hashing import file_digest, unlabel

    return path.is_file() and path.stat().st_size == size and file_digest(path, unlabel(digest)[0]) == digest


def input_stamps(source: Source, files: list[str]) -> dict[str, list[int | str]]:
    """Each input file's identity as its source knows it (``FileEntry.stamp``: size and mtime for a local
    folder), so that a resume notices a changed input."""
    out = {}
    for f in files:
        e = source.entry(f)
        if e is None or e.kind is not EntryKind.FILE:
            raise ConvertError(f"{source.shown(f)}: {'missing' if e is None else e.why}")
        out[f] = e.stamp
    return out
