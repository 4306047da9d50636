"""Write stage: shard files streamed from the plan's headers, the index, configs, side files.

The safetensors library cannot write a file incrementally (``save_file`` needs every tensor in
memory to build the header), so shards are written here: the header computed by the plan first,
then each tensor's bytes at the offset the plan gave it. Every file is written under a temporary
name and renamed into place once complete and flushed, and the manifest is written last, so a
folder without its manifest is never mistaken for a finished checkpoint.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

import numpy as np

from . import faults, filenames, formats, journal, paths
from .atomic import PARTIAL
from .errors import ConvertError
from .hashing import FILE_DIGEST, file_digest, labelled, new_digest
from .manifest import RECORDS_DIR, digest_entry, load_manifest
from .plan import Placed, Shard

if TYPE_CHECKING:
    from .compute import Chunk
    from .sources import Source

CHUNK = 16 << 20

#: Files a previous run of pack may have left, removed by --overwrite (nothing else is touched).
OWN_FILES = (filenames.MANIFEST, filenames.INDEX, filenames.CONFIG, *formats.config_files(), filenames.JOURNAL,
             filenames.LOCK, filenames.RAY_PROBE)


def check_output_dir(input_dir: Path | None, output_dir: Path) -> None:
    """Where the output may go (whether it may be non-empty is the journal's business). ``input_dir``: where
    the input lies on this machine (``Source.local_path()``), None for an input that is not a folder here."""
    src, dst = (input_dir.resolve() if input_dir is not None else None), output_dir.resolve()
    if src is not None and (dst == src or dst.is_relative_to(src)):
        raise ConvertError(f"{output_dir}: the output folder must not be the input folder or inside it")
    if src is not None and src.is_relative_to(dst):
        raise ConvertError(f"{output_dir}: the output folder must not contain the input folder")
    paths.output_folder(output_dir)


def own_files_only(output_dir: Path, side_files: tuple[str, ...]) -> bool:
    """Whether every file in the folder is one pack writes (so starting afresh loses nothing)."""
    side = set(side_files)
    for p in output_dir.rglob("*"):
        if p.is_dir() and not p.is_symlink():
            continue
        top = p.parent == output_dir and (p.name.endswith(".safetensors") or p.name in OWN_FILES)
        if not (top or p.name.endswith(PARTIAL) or _is_records(output_dir, p)
                or p.relative_to(output_dir).as_posix() in side):
            return False
    return True


def clear_previous(output_dir: Path, side_files: tuple[str, ...]) -> None:
    """Remove what an earlier pack wrote (shards, index, configs, manifest, its records files, side
    files: this plan's and those the previous manifest lists, which another input may have had),
    nothing else."""
    previous = previous_side_files(output_dir)
    for p in output_dir.iterdir():
        if p.is_file() and (p.name.endswith((".safetensors", PARTIAL)) or p.name in OWN_FILES) \
                and p.name != journal.LOCK:  # held by this pack
            p.unlink()
    for rel in dict.fromkeys([*side_files, *previous]):
        p = output_dir / rel
        if p.is_file() or p.is_symlink():
            p.unlink()
    records = output_dir / RECORDS_DIR
    if records.is_dir() and not records.is_symlink():
        for p in records.rglob("*"):
            if _is_records(output_dir, p) or (p.is_file() and p.name.endswith(PARTIAL)):
                p.unlink()
        for d in sorted((d for d in records.rglob("*") if d.is_dir()), reverse=True):
            with contextlib.suppress(OSError):
                d.rmdir()
        with contextlib.suppress(OSError):
            records.rmdir()


def _is_records(output_dir: Path, p: Path) -> bool:
    """A manifest records file (``manifest-records/...jsonl``), which pack writes."""
    rel = p.relative_to(output_dir).as_posix()
    return rel.startswith(RECORDS_DIR + "/") and rel.endswith(".jsonl") and p.is_file() and not p.is_symlink()


def previous_side_files(output_dir: Path) -> list[str]:
    """The side files an earlier manifest in ``output_dir`` lists (relative paths inside it only:
    the manifest is not trusted to name a file elsewhere); [] without a readable one."""
    try:
        man = load_manifest(output_dir)
    except ConvertError:
        return []
    entries = man.get("side_files")
    names = [e.get("file") if isinstance(e, dict) else e for e in entries] if isinstance(entries, list) else []
    return [n for n in names if isinstance(n, str) and is_inside(n)]


def is_inside(rel: str) -> bool:
    """A relative path that stays inside the folder it is joined to (no absolute path, no ``..``)."""
    return bool(rel) and not PurePosixPath(rel).is_absolute() and ".." not in PurePosixPath(rel).parts


class ShardWriter:
    """Writes one shard: header first, then each tensor's chunks at its planned offset.

    The file's space is reserved up front (posix_fallocate), so a full disk fails at the start of a
    shard rather than in the middle of one; every OS error names the file. ``direct_bytes`` (``Tuning.direct_write``):
    where the file system allows it, the bytes go to the disk past the page cache (``DirectStage``) while they come in
    file order, the usual order; else, and from the first write out of that order on, through the page cache, asking
    the kernel to start writing back every ``writeback_every`` bytes (``Tuning.writeback_every``).
    """

    def __init__(self, output_dir: Path, shard: Shard, writeback_every: int, direct_bytes: int = 0):
        self.shard, self.writeback_every = shard, writeback_every
        self.final = output_dir / shard.file
        self.tmp = output_dir / (shard.file + PARTIAL)
        self.fd = -1
        self._direct: DirectStage | None = None
        try:
            # 0o666 less the umask, as open(..., "w") gives every other file of the output
            self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
            if hasattr(os, "posix_fallocate") and shard.size:
                os.posix_fallocate(self.fd, 0, shard.size)
            else:
                os.ftruncate(self.fd, shard.size)
            if direct_bytes:
                self._direct = DirectStage.open(self.tmp, self.fd, direct_bytes)
        except OSError as e:
            self.abort()
            raise self._error(e) from None
        self.header = shard.header  # encoded here once (the file hash takes these bytes: pipeline/stream.py)
        half = len(self.header) // 2
        self._pwrite(self.header[:half], 0)
        faults.point("header")
        self._pwrite(self.header[half:], half)
        self.placed = {p.tensor.name: p for p in shard.placed}
        self.written: dict[str, int] = {}
        self._unflushed = 0

    def _error(self, e: OSError) -> ConvertError:
        return ConvertError(f"{self.tmp}: cannot write: {e.strerror or e}; the finished shards are kept, "
                            "rerun with --resume once it is fixed")

    def _pwrite(self, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        try:
            if self._direct is not None:
                if self._direct.take(view, offset):
                    if self._direct.refused:
                        self._leave_direct()
                    return
                self._leave_direct()  # out of file order: what is staged goes out, the rest through the page cache
            _pwrite_all(self.fd, view, offset)
        except OSError as e:
            raise self._error(e) from None

    def write(self, name: str, chunks: list[Chunk], offset: int = 0) -> None:
        """Write ``chunks`` back to back into tensor ``name``, from ``offset`` bytes into it."""
        p: Placed = self.placed[name]
        pos = p.start + offset
        for c in chunks:
            view = memoryview(c).cast("B")
            n = view.nbytes
            if pos + n > p.end:
                raise ConvertError(f"{self.shard.file}: tensor {name}: {pos + n - p.start} bytes, "
                                   f"planned {p.end - p.start}")
            self._pwrite(view[: n // 2], pos)
            faults.point("tensor")
            self._pwrite(view[n // 2 :], pos + n // 2)
            pos += n
            self._unflushed += n
        self.written[name] = self.written.get(name, 0) + pos - p.start - offset
        if self._direct is None and self._unflushed >= self.writeback_every:
            self._unflushed = 0
            start_writeback(self.fd)

    def finish(self) -> None:
        """Check every planned byte was written, flush, and move the file to its final name."""
        for name, p in self.placed.items():
            if self.written.get(name, 0) != p.end - p.start:
                self.abort()
                raise ConvertError(f"{self.shard.file}: tensor {name}: wrote {self.written.get(name, 0)} bytes, "
                                   f"planned {p.end - p.start}")
        try:
            self._leave_direct()
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1
            os.replace(self.tmp, self.final)
        except OSError as e:
            raise self._error(e) from None

    @property
    def direct(self) -> bool:
        """Whether the bytes still go past the page cache (``DirectStage``)."""
        return self._direct is not None

    def _leave_direct(self) -> None:
        """What is staged written out (its last partial block through the page cache); later writes go there too."""
        if self._direct is not None:
            stage, self._direct = self._direct, None
            stage.close()

    def abort(self) -> None:
        if self._direct is not None:
            self._direct.discard()
            self._direct = None
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


class DirectStage:
    """A shard's bytes written past the page cache (``O_DIRECT``) while they come in file order: appended to an
    aligned staging buffer, each full buffer written by a thread of its own while the next one fills (a direct write
    returns only once the disk has the bytes: written in the writer's thread, it would wait for the disk instead of
    hashing and copying meanwhile). Through the page cache, every output byte is copied into a newly allocated cache
    page and written back later, CPU time that on two cores is the pack's bound (benchmarks/RESULTS.md, "Shards
    written past the page cache"); past it, the disk takes the buffer as it is.

    O_DIRECT asks for aligned buffers, offsets and lengths (``BLOCK``): the buffers are page-aligned (anonymous maps),
    writes are whole buffers at multiples of their size, and the last partial block goes through the page cache
    (``close``). A file system that refuses O_DIRECT (tmpfs, some network file systems) refuses it when the file is
    opened (``open`` returns None) or at a write (EINVAL: those bytes go through the page cache, and ``refused``
    tells the writer to send the rest there too)."""

    BLOCK = 4096  # a multiple of every logical block size O_DIRECT asks for
    DEPTH = 2  # staging buffers: one being written while the other fills

    def __init__(self, fd: int, cached_fd: int, size: int):
        self.fd, self.cached_fd = fd, cached_fd
        self.size = max(self.BLOCK, size // self.BLOCK * self.BLOCK)
        self._maps = [mmap.mmap(-1, self.size) for _ in range(self.DEPTH)]
        self._pending: list[Future | None] = [None] * self.DEPTH
        self._i = 0  # the buffer filling
        self.buf = np.frombuffer(self._maps[0], np.uint8)
        self._disk = ThreadPoolExecutor(1, thread_name_prefix="kimi-convert-direct-write")
        self.base = 0  # the file offset of buf[0]
        self.fill = 0  # bytes staged
        self.refused = False  # the file system refused a direct write

    @classmethod
    def open(cls, path: Path, cached_fd: int, size: int) -> DirectStage | None:
        """A second descriptor of ``path`` that bypasses the page cache (``cached_fd``: the writer's own, for what
        cannot go past it), or None where the file system refuses."""
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            return None
        try:
            fd = os.open(path, os.O_WRONLY | flag)
        except OSError:
            return None
        return cls(fd, cached_fd, size)

    def take(self, view: memoryview, offset: int) -> bool:
        """Stage ``view`` if it continues the file where the staged bytes end; False otherwise (nothing taken)."""
        if offset != self.base + self.fill:
            return False
        src = np.frombuffer(view, np.uint8)
        i, n = 0, src.size
        while i < n:
            k = min(n - i, self.size - self.fill)
            np.copyto(self.buf[self.fill : self.fill + k], src[i : i + k])  # (numpy copies without the GIL)
            self.fill += k
            i += k
            if self.fill == self.size:
                self._send()
        return True

    def _send(self) -> None:
        """The full buffer to the disk on the stage's thread; the next buffer (its earlier write done) fills."""
        self._pending[self._i] = self._disk.submit(self._write, memoryview(self._maps[self._i]), self.base)
        self.base += self.size
        self.fill = 0
        self._i = (self._i + 1) % self.DEPTH
        self._wait(self._i)
        self.buf = np.frombuffer(self._maps[self._i], np.uint8)

    def _wait(self, i: int) -> None:
        """Buffer ``i``'s write finished (its error, if any, raised here)."""
        fut, self._pending[i] = self._pending[i], None
        if fut is not None:
            fut.result()

    def _write(self, view: memoryview, offset: int, cached: bool = False) -> None:
        """``view`` (of a staging buffer; released here) at ``offset``: past the page cache (whole blocks), unless
        ``cached`` or the file system refused a direct write."""
        try:
            if not (cached or self.refused):
                try:
                    _pwrite_all(self.fd, view, offset)
                    return
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    self.refused = True
            _pwrite_all(self.cached_fd, view, offset)
        finally:
            view.release()

    def close(self) -> None:
        """Write what is staged (whole blocks past the page cache, the last partial one through it), let go."""
        try:
            for i in range(self.DEPTH):
                self._wait(i)
            whole = self.fill // self.BLOCK * self.BLOCK
            with memoryview(self._maps[self._i]) as buf:
                if whole:
                    self._write(buf[:whole], self.base)
                if self.fill > whole:
                    self._write(buf[whole : self.fill], self.base + whole, cached=True)
            self.base, self.fill = self.base + self.fill, 0
        finally:
            self.discard()

    def discard(self) -> None:
        """The thread, the descriptor and the buffers let go (what is staged is dropped: a failed or stopped shard);
        a write in flight is waited for first, so that it never reaches a descriptor closed under it."""
        self._disk.shutdown(wait=True)
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1
        self.buf = None
        for m in self._maps:
            with contextlib.suppress(BufferError):
                m.close()


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """All of ``view`` at ``offset`` (``pwrite`` may write less than asked)."""
    done = 0
    while done < view.nbytes:
        done += os.pwrite(fd, view[done:], offset + done)


@functools.cache
def _sync_file_range():
    """libc's ``sync_file_range`` (Linux), or None: Python's ``os`` has no binding for it."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def start_writeback(fd: int) -> None:
    """Ask the kernel to start writing the file's dirty pages to disk now (``SYNC_FILE_RANGE_WRITE``: it does
    not wait for them), so that a shard's closing fsync finds little left to write: otherwise a large shard's
    fsync takes seconds at the end of the stream, after the last byte (benchmarks/RESULTS.md, "The figures behind
    the pipeline's constants"). A no-op where the call does not exist; a failure is left to the fsync, which
    reports it."""
    fn = _sync_file_range()
    if fn is not None:
        fn(fd, 0, 0, 2)  # SYNC_FILE_RANGE_WRITE: the whole file, no waiting


@dataclass(frozen=True)
class FileRecord:
    """A file of the output other than a shard, as the manifest lists it."""

    file: str  # relative path, forward slashes
    size: int
    digest: str  # ``hashing.labelled``

    def to_dict(self) -> dict:
        return {"file": self.file, "size": self.size, **digest_entry(self.digest)}


def record(output_dir: Path, rel: str) -> FileRecord:
    path = output_dir / rel
    return FileRecord(rel, path.stat().st_size, file_digest(path))


def copy_side_files(source: Source, output_dir: Path, side_files: tuple[str, ...],
                    folders: tuple[str, ...] = ()) -> list[FileRecord]:
    """Copy each side file of the input ``source`` byte for byte (a symlink as its target's content) and
    recreate the empty folders; the records hash the bytes written, in the same pass."""
    for rel in folders:
        _mkdir(output_dir / _inside(rel))
    return [copy_file(source, _inside(rel), output_dir / rel) for rel in side_files]


def _inside(rel: str) -> str:
    """Side-file paths come from walking the input, so they are relative; a guard, not a check."""
    if not is_inside(rel):
        raise ConvertError(f"side file {rel!r}: not a relative path inside the folder")
    return rel


def _mkdir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConvertError(f"{path}: cannot create: {e.strerror or e}") from None


def copy_file(source: Source, rel: str, dst: Path) -> FileRecord:
    """``rel`` of ``source`` to ``dst``. Atomic like the shards: written under a temporary name, hashed as
    written, flushed, renamed."""
    tmp = dst.with_name(dst.name + PARTIAL)
    _mkdir(dst.parent)
    h, size = new_digest(FILE_DIGEST), 0
    try:
        with source.open(rel) as fi, open(tmp, "wb") as fo:
            while block := fi.read_range(size, CHUNK):
                h.update(block)
                fo.write(block[: len(block) // 2])
                faults.point("side")
                fo.write(block[len(block) // 2 :])
                size += len(block)
            fo.flush()
            os.fsync(fo.fileno())
        os.replace(tmp, dst)
    except OSError as e:
        raise ConvertError(f"{e.filename or dst}: cannot copy {rel}: {e.strerror or e}") from None
    return FileRecord(rel, size, labelled(FILE_DIGEST, h.hexdigest()))


def default_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file: 0o666 less the umask. (For files a library
    writes with another mode: safetensors' ``save_file`` makes them 0o600.) The umask is read from
    /proc where it can be, so that no other thread ever creates a file under a borrowed one."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask
