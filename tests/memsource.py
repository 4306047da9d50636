"""An input ``Source`` that is a dict of file name -> bytes, for tests: no disk behind it, so a plan or a pack
that runs from it proves that nothing above the ``Source`` protocol reads the input through a path. It is
also the smallest example of a second source (a Hub repository is another: issue 25)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

from kimi_convert.errors import ConvertError
from kimi_convert.jsonfile import MAX_JSON_BYTES, parse
from kimi_convert.sources import EntryKind, FileEntry, ResourceFreeFile


class MemoryFile(ResourceFreeFile):  # nothing to close or advise
    def __init__(self, data: bytes):
        self.data, self.size = data, len(data)
        self.reads = 0  # byte ranges read, for tests that count them

    def read_range(self, offset: int, length: int) -> bytes:
        self.reads += 1
        return self.data[offset : offset + length]

    def readinto(self, offset: int, buf: memoryview) -> int:
        self.reads += 1
        n = max(0, min(len(buf), self.size - offset))
        buf[:n] = self.data[offset : offset + n]
        return n



class MemorySource:
    """Files as bytes; folders are implied by the names. ``revision`` stands for the Hub's commit."""

    def __init__(self, files: dict[str, bytes], name: str = "mem://ckpt", revision: str = "0" * 40):
        self.files, self.name, self.revision = dict(files), name, revision
        self.opened: list[str] = []  # every file opened, in order

    @classmethod
    def from_folder(cls, folder: Path, **kw) -> MemorySource:
        return cls({p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
                    if p.is_file()}, **kw)

    def describe(self) -> str:
        return f"in-memory source {self.name} ({len(self.files)} files)"

    def shown(self, rel: str) -> str:
        return f"{self.name}/{rel}"

    def _folders(self) -> set[str]:
        return {p.as_posix() for f in self.files for p in PurePosixPath(f).parents if p.as_posix() != "."}

    def list_files(self, prune: Callable[[str], bool] | None = None) -> list[FileEntry]:
        folders = self._folders()
        out: list[FileEntry] = []

        def walk(base: str) -> None:
            def inside(names):
                return sorted(n for n in names if str(PurePosixPath(n).parent) == (base or "."))
            subs = inside(folders)
            out.extend(FileEntry(d, EntryKind.FOLDER) for d in subs)
            out.extend(self.entry(f) for f in inside(self.files))
            for d in subs:
                if prune is None or not prune(d):
                    walk(d)

        walk("")
        return out

    def entry(self, rel: str) -> FileEntry | None:
        if rel in self.files:
            data = self.files[rel]
            return FileEntry(rel, EntryKind.FILE, len(data), sha256=hashlib.sha256(data).hexdigest(),
                             revision=self.revision)
        return FileEntry(rel, EntryKind.FOLDER) if rel in self._folders() else None

    def check_named(self, rel: str, what: str) -> FileEntry:
        e = self.entry(rel)
        if e is None or e.kind is not EntryKind.FILE:
            raise ConvertError(f"{what}: names missing file {rel!r}")
        return e

    def canonical_names(self, files: list[str], what: str) -> dict[str, str]:
        return {}

    def open(self, rel: str, shown: str | None = None) -> MemoryFile:
        if rel not in self.files:
            raise ConvertError(f"{shown or self.shown(rel)}: missing")
        self.opened.append(rel)
        return MemoryFile(self.files[rel])

    def read_json(self, rel: str, shown: str | None = None, *, limit: int | None = None,
                  want: type | None = dict) -> Any:
        with self.open(rel, shown) as f:
            return parse(f.data, shown or self.shown(rel), limit=limit or MAX_JSON_BYTES, want=want)

    def local_path(self, rel: str = "") -> Path | None:
        return None

    def for_worker(self) -> MemorySource:
        return self
