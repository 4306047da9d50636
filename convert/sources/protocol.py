"""The ``Source`` protocol and its small types (``sources/__init__`` is the package's face); a leaf module:
an implementation imports it, it imports no implementation.

Where the input's bytes come from: the ``Source`` protocol, under ``checkpoint``, ``readers``, ``hashing``,
``sidefiles`` and ``journal``.

Everything that reads the INPUT checkpoint (its config, index and shard headers for the plan; its tensor bytes
for the pipeline and verify; its side files for the copy; its files' identities for the resume journal) goes
through a ``Source``, never through a path, so that a second kind of input (a Hub repository read by range
requests and downloaded just in time, issue 25) is one new module here and nothing above changes. The output
folder is always a local folder and is not a source.

A source names its files by relative POSIX paths (``model-00001-of-00096.safetensors``, ``1_Pooling/config.json``).
It offers:

- ``list_files()``: the tree as ``FileEntry`` rows (files and folders, with whatever identity the source knows:
  size; mtime for a local folder; the LFS sha256 and the revision for the Hub), in a fixed order;
- ``entry(rel)``: one name's entry (None: nothing by that name), ``check_named(rel, what)``: a file that the index
  names, which must be a regular file of the source (its refusals are the source's own words);
- ``open(rel)``: a ``SourceFile``, whose ``read_range``/``readinto`` read byte ranges (the pipeline reads into its
  pooled buffers with ``readinto``) and ``will_need`` hints what comes next;
- ``read_json(rel)``: a JSON file through ``jsonfile``'s one reader (regular file, bounded size, depth-safe);
- ``local_path(rel)``: where the file lies on this machine, or None. Two uses only: the memory-mapped reader of
  verify and the numeric check (``MappedReader``: zero-copy views need a file to map; without one it reads
  through the source), and pack's check that the output folder is neither the input nor inside it
  (``write.check_output_dir``, with ``local_path()``, the root). Nothing else may use it.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from collections.abc import Callable


class EntryKind(Enum):
    """What a name of the source is. Only a ``FILE`` is ever read."""

    FILE = "file"  # a regular file (for a local folder: or a symlink to one)
    FOLDER = "folder"
    OTHER = "other"  # there, but not a regular file (a FIFO, a device, a socket): ``why`` says what
    BROKEN = "broken"  # a name whose target cannot be reached (a dangling symlink, a symlink loop): ``why``


@dataclass(frozen=True)
class FileEntry:
    """One name of a source and the identity the source knows of it.

    ``refusal``: set when the source lists the entry but will not serve it (for a local folder: a symlink that
    leaves the folder, dangles, or names a folder); the message is raised by whoever would read or copy it, so
    that an entry skipped for another reason (``.git/``, an unconverted weight file) is skipped, not refused."""

    rel: str  # relative path, forward slashes
    kind: EntryKind
    size: int = 0
    mtime_ns: int | None = None  # a local file's modification time
    sha256: str | None = None  # the Hub's LFS sha256 (a local folder does not know it before hashing)
    revision: str | None = None  # the commit the Hub resolved the revision to
    oid: str | None = None  # the Hub's git blob id (a file not stored through LFS: no sha256 without reading it)
    why: str | None = None  # for OTHER and BROKEN: what it is, in ``jsonfile.regular_file_error``'s words
    refusal: str | None = None

    @property
    def stamp(self) -> list[int | str]:
        """What the resume journal binds a run to, so that a changed input file is noticed: size and mtime for
        a local file; size, sha256 and revision where the source knows those instead."""
        if self.mtime_ns is not None:
            return [self.size, self.mtime_ns]
        return [self.size, self.sha256 or "", self.revision or ""]


@runtime_checkable
class SourceFile(Protocol):
    """An open file of a source: byte ranges read at any offset, from any thread (no shared position)."""

    size: int

    def read_range(self, offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length); fewer only where the file ends."""
        ...

    def readinto(self, offset: int, buf: memoryview) -> int:
        """Read up to ``len(buf)`` bytes at ``offset`` into ``buf``; the count read (0: the file ends)."""
        ...

    def readinto_direct(self, offset: int, buf: memoryview) -> int:
        """``readinto``, past the page cache where the file allows (a local file: ``O_DIRECT``); the same bytes."""
        ...

    def will_need(self, offset: int, length: int) -> None:
        """A hint: this range is read soon (a local file: readahead into the page cache)."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> SourceFile: ...

    def __exit__(self, *exc: object) -> None: ...


class ResourceFreeFile:
    """The ``SourceFile`` methods of a file that holds no descriptor of its own and takes no readahead hint
    (a Hub file read by range requests, a download the fetcher owns, bytes in memory): nothing to close or
    advise. Subclasses give ``size`` and ``readinto``; ``read_range`` is ``readinto`` into a new buffer."""

    size: int

    def readinto(self, offset: int, buf: memoryview) -> int:
        raise NotImplementedError

    def readinto_direct(self, offset: int, buf: memoryview) -> int:
        return self.readinto(offset, buf)  # no page cache of this process's to go past

    def read_range(self, offset: int, length: int) -> bytes:
        buf = bytearray(max(0, min(length, self.size - offset)))
        n = self.readinto(offset, memoryview(buf)) if buf else 0
        return bytes(buf[:n])

    def will_need(self, offset: int, length: int) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        pass


@runtime_checkable
class Source(Protocol):
    """The input checkpoint's files, wherever they are (module docstring)."""

    #: How messages name the source: the folder as the user gave it, or ``hf://owner/repo@commit``.
    name: str

    def describe(self) -> str:
        """One line for people: what the source is."""
        ...

    def shown(self, rel: str) -> str:
        """How messages name one of its files (a local folder: ``folder/rel``)."""
        ...

    def list_files(self, prune: Callable[[str], bool] | None = None) -> list[FileEntry]:
        """Every file and folder, top-down (in each folder: its sub-folders, then its files, each sorted by
        name; then each sub-folder's contents). ``prune(rel)``: a folder not to list the contents of (its
        own entry is listed): ``.git/`` and caches, which can hold millions of files."""
        ...

    def entry(self, rel: str) -> FileEntry | None:
        """``rel``'s entry, None when there is nothing by that name (a dangling symlink is an entry)."""
        ...

    def check_named(self, rel: str, what: str) -> FileEntry:
        """A weight file that ``what`` (the index, or the listing) names: it must be a regular file inside the
        source; anything else is refused with one line naming ``what`` and ``rel``."""
        ...

    def canonical_names(self, files: list[str], what: str) -> dict[str, str]:
        """The source's own name for each file ``what`` (the index) names otherwise (a local folder: an absolute
        path that resolves inside it); others are refused as ``check_named`` refuses them; {} when all are its
        own."""
        ...

    def open(self, rel: str, shown: str | None = None) -> SourceFile:
        """A regular file, opened for reading (never blocks on a FIFO); ``shown``: how errors name it
        (default ``shown(rel)``)."""
        ...

    def read_json(self, rel: str, shown: str | None = None, *, limit: int | None = None,
                  want: type | None = dict) -> Any:
        """A JSON file, through ``jsonfile``'s rules (regular, at most ``limit`` bytes, depth-safe)."""
        ...

    def local_path(self, rel: str = "") -> Path | None:
        """Where ``rel`` (``""``: the source's root) lies on this machine, None if nowhere. For memory maps and
        for telling an output folder from the input's only (module docstring)."""
        ...

    def for_worker(self) -> Source:
        """This source as a process elsewhere opens it (a Ray task, whose working folder differs)."""
        ...


def normal_name(rel: str) -> str:
    """An index's file name in the one form the plan, the output's index, the manifest and verify use: ``./a``,
    ``a//b`` and ``a/./b`` are ``a`` and ``a/b`` (``..`` is left for ``check_named`` to refuse)."""
    return posixpath.normpath(rel) if rel else rel
