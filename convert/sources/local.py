"""The first ``Source``: a checkpoint folder on this machine.

What a local folder adds to the protocol are its own hazards, refused here in one place: an index that names
``..`` or an absolute path, a symlink that leaves the folder, dangles, loops or names a folder, and files that
are not regular (a FIFO would block a reader forever): ``jsonfile.open_regular``'s rule. Every message is the
one the tool gave before the seam existed (``tests/test_source.py``, ``test_inputs.py``, ``test_hostile_files.py``,
``test_sidefiles.py`` assert them).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from .. import paths
from ..errors import ConvertError
from ..jsonfile import MAX_JSON_BYTES, describe_mode, open_regular, read_json, regular_file_error, resolve
from .protocol import EntryKind, FileEntry, normal_name

#: ``O_DIRECT``'s rule for a read past the page cache: its file offset, length and memory address whole multiples of
#: the device's logical block (4 KiB, the largest in use, holds for the smaller too)
ALIGN = 4096
#: A read's unaligned edges go through a staging buffer of this size, one per reading thread (``_staging``)
_STAGE = 8 << 20
_stages = threading.local()


class LocalFile:
    """An open regular file: ``pread`` at any offset (no shared position, so threads may share it)."""

    def __init__(self, fd: int, shown: str, path: str | os.PathLike | None = None):
        self.fd, self.shown = fd, shown
        self.size = os.fstat(fd).st_size
        self._path = path
        self._direct_fd: int | None = None  # opened at the first read past the page cache; -1: refused

    @classmethod
    def open(cls, path: str | os.PathLike, shown: str) -> LocalFile:
        """``path``, which must be (or be a symlink to) a regular file; never blocks (``open_regular``)."""
        return cls(open_regular(path, shown), shown, path)

    def read_range(self, offset: int, length: int) -> bytes:
        parts, pos, end = [], offset, offset + length
        while pos < end:
            block = os.pread(self.fd, end - pos, pos)
            if not block:
                break
            parts.append(block)
            pos += len(block)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def readinto(self, offset: int, buf: memoryview) -> int:
        return os.preadv(self.fd, [buf], offset)

    def readinto_direct(self, offset: int, buf: memoryview) -> int:
        """``readinto`` past the page cache (``O_DIRECT``): the disk's bytes land in ``buf`` itself where its address
        has the file offset's phase (the pipeline places its reads so), else through a staging buffer; the edges that
        are not whole blocks through the staging buffer too. Where the file system refuses ``O_DIRECT`` (tmpfs, some
        network and FUSE file systems), through the page cache, as ``readinto``: the same bytes either way. The kernel
        writes back any of the file's pages still dirty in the cache before such a read."""
        fd = self._direct()
        if fd < 0 or not buf:
            return self.readinto(offset, buf)
        try:
            head = -offset % ALIGN
            if head or len(buf) < ALIGN:
                return self._staged(fd, offset, buf[: min(len(buf), head or ALIGN)])
            if _address(buf) % ALIGN:
                return self._staged(fd, offset, buf[:_STAGE])
            return os.preadv(fd, [buf[: len(buf) - len(buf) % ALIGN]], offset)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self._close_direct(-1)  # refused after all (a block larger than ALIGN): the page cache from now on
            return self.readinto(offset, buf)

    def _direct(self) -> int:
        if self._direct_fd is None:
            self._direct_fd = -1
            if self._path is not None and hasattr(os, "O_DIRECT"):
                with contextlib.suppress(OSError):
                    self._direct_fd = os.open(self._path, os.O_RDONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
        return self._direct_fd

    def _staged(self, fd: int, offset: int, dest: memoryview) -> int:
        """Up to ``len(dest)`` bytes at ``offset`` read past the page cache into this thread's staging buffer (whole
        blocks around them), then copied."""
        at = offset - offset % ALIGN
        span = -(-(offset + len(dest) - at) // ALIGN) * ALIGN
        stage = _staging()
        n = os.preadv(fd, [stage[:span]], at)
        got = max(0, min(len(dest), n - (offset - at)))
        dest[:got] = stage[offset - at : offset - at + got]
        return got

    def _close_direct(self, to: int | None) -> None:
        if self._direct_fd is not None and self._direct_fd >= 0:
            os.close(self._direct_fd)
        self._direct_fd = to

    def will_need(self, offset: int, length: int) -> None:
        if length > 0 and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, offset, length, os.POSIX_FADV_WILLNEED)

    def close(self) -> None:
        self._close_direct(None)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> LocalFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _staging() -> memoryview:
    """This thread's staging buffer: whole pages of its own (an anonymous mapping: aligned, as ``O_DIRECT`` asks)."""
    stage = getattr(_stages, "buffer", None)
    if stage is None:
        stage = _stages.buffer = memoryview(mmap.mmap(-1, _STAGE + ALIGN))
    return stage


def _address(buf: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _entry(rel: str, path: Path) -> FileEntry:
    """``path``'s entry, symlinks followed (a regular file's size and mtime are its target's)."""
    try:
        st = os.stat(path)
    except OSError:
        return FileEntry(rel, EntryKind.BROKEN, why=regular_file_error(path))
    if stat.S_ISREG(st.st_mode):
        return FileEntry(rel, EntryKind.FILE, st.st_size, st.st_mtime_ns)
    kind = EntryKind.FOLDER if stat.S_ISDIR(st.st_mode) else EntryKind.OTHER
    return FileEntry(rel, kind, mtime_ns=st.st_mtime_ns, why=describe_mode(st.st_mode))


def _posix(rel: Path) -> str:
    return PurePosixPath(rel.as_posix()).as_posix()


@dataclass(frozen=True)
class LocalFolder:
    """A checkpoint folder. Holds nothing open (it is pickled to worker processes and Ray tasks)."""

    folder: Path

    @classmethod
    def at(cls, path: str | os.PathLike) -> LocalFolder:
        """An existing folder (``paths.folder``: ``PATH: does not exist``, ``PATH: is a file, ...``)."""
        return cls(paths.folder(path))

    @property
    def name(self) -> str:
        return str(self.folder)

    def describe(self) -> str:
        return f"local folder {self.folder}"

    def shown(self, rel: str) -> str:
        return str(self.folder / rel)

    def local_path(self, rel: str = "") -> Path | None:
        return self.folder / rel if rel else self.folder

    def for_worker(self) -> LocalFolder:
        return LocalFolder(self.folder.absolute())

    def entry(self, rel: str) -> FileEntry | None:
        path = self.folder / rel
        if not os.path.lexists(path):
            return None
        return _entry(rel, path)

    def open(self, rel: str, shown: str | None = None) -> LocalFile:
        return LocalFile.open(self.folder / rel, shown or self.shown(rel))

    def read_json(self, rel: str, shown: str | None = None, *, limit: int | None = None,
                  want: type | None = dict) -> Any:
        return read_json(self.folder / rel, shown or self.shown(rel), limit=limit or MAX_JSON_BYTES, want=want)

    def check_named(self, rel: str, what: str) -> FileEntry:
        """Resolve ``rel`` under the folder; refuse ``..`` and paths or symlinks that end outside it, and
        anything but a regular file. An absolute path is taken when it resolves inside the folder (an index
        written with the download's absolute paths), as is any symlink that stays inside."""
        folder = self.folder
        if any(p == ".." for p in Path(rel).parts):
            raise ConvertError(f"{what}: file {rel!r} has a '..' part: outside the input folder, "
                               "where the index must name files")
        path = Path(rel) if os.path.isabs(rel) else folder / rel
        real = resolve(path, f"{what}: file {rel!r}")
        root = resolve(folder, str(folder))
        if not real.is_relative_to(root):
            raise ConvertError(f"{what}: file {rel!r} resolves outside the input folder {root} (to {real})")
        if not os.path.lexists(path):
            raise ConvertError(f"{what}: names missing file {rel!r}")
        why = regular_file_error(path)
        if why is not None:
            raise ConvertError(f"{what}: file {rel!r} {why}, expected a safetensors file")
        return _entry(rel, path)

    def canonical_names(self, files: list[str], what: str) -> dict[str, str]:
        """An index whose files are named by absolute paths (written where the download lived): each one that
        resolves inside the folder is renamed to its path relative to it, so the plan, the output's index and
        the manifest name files as every other index does; one that does not is refused by ``check_named``."""
        if not any(os.path.isabs(f) or normal_name(f) != f for f in files):
            return {}
        folder = self.folder
        root = resolve(folder, str(folder))
        renamed = {}
        for f in files:
            if not os.path.isabs(f) and normal_name(f) != f:  # ./model-00002-of-00003.safetensors
                self.check_named(f, what)
                renamed[f] = normal_name(f)
            elif os.path.isabs(f):
                self.check_named(f, what)
                for base in (root, Path(os.path.abspath(folder))):  # the name as given, else where it resolves
                    if Path(os.path.normpath(f)).is_relative_to(base):
                        renamed[f] = Path(os.path.normpath(f)).relative_to(base).as_posix()
                        break
                else:
                    renamed[f] = resolve(Path(f), f).relative_to(root).as_posix()
        return renamed

    def list_files(self, prune: Callable[[str], bool] | None = None) -> list[FileEntry]:
        """The tree (symlinks listed, never followed into), in ``os.walk``'s top-down order with each folder's
        names sorted. A symlink the folder will not serve (to a folder; dangling, looping or leaving the
        folder) carries its refusal: raised by whoever would copy it, not by the listing."""
        folder = self.folder
        root = resolve(folder, str(folder))
        out: list[FileEntry] = []
        for dirpath, dirnames, filenames in os.walk(folder):
            here = Path(dirpath)
            rel_dir = here.relative_to(folder)
            descend = []
            for d in sorted(dirnames):
                rel = _posix(rel_dir / d)
                if (here / d).is_symlink():
                    out.append(FileEntry(rel, EntryKind.FOLDER, refusal=(
                        f"{folder}: {rel} is a symlink to a folder, which pack does not follow; "
                        "replace it with the folder itself, or remove it")))
                    continue
                out.append(FileEntry(rel, EntryKind.FOLDER))  # os.walk's dirnames: folders (stat followed)
                if prune is None or not prune(rel):
                    descend.append(d)
            dirnames[:] = descend
            for f in sorted(filenames):
                rel = _posix(rel_dir / f)
                e = _entry(rel, here / f)
                refusal = _link_refusal(folder, root, rel, here / f)
                out.append(e if refusal is None else FileEntry(e.rel, e.kind, e.size, e.mtime_ns, why=e.why,
                                                               refusal=refusal))
        return out


def _link_refusal(folder: Path, root: Path, rel: str, path: Path) -> str | None:
    """A symlink is served (copied as its target's content) only when the target is a file inside the folder."""
    if not path.is_symlink():
        return None
    try:
        target = resolve(path, f"{folder}: {rel}")  # a loop: one line, not pathlib's RuntimeError
    except ConvertError as e:
        return str(e)
    if not target.exists():
        return f"{folder}: {rel} is a dangling symlink; remove it or replace it with the file"
    if not target.is_relative_to(root):
        return (f"{folder}: {rel} is a symlink to {target}, outside the input folder; pack would "
                "copy that file into the output: copy it into the input folder instead, or remove it")
    return None
