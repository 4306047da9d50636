"""A Hub input's weight files downloaded just in time, for ``pack hf://OWNER/REPO[@REV] OUTPUT`` (issue 25).

``plan`` and ``inspect`` read a Hub repository by range requests (``hub.HubRepo``). ``pack`` reads every byte of
every weight file, so here those files are downloaded whole, each one a single sequential stream (what a Hub
link does fastest), into a scratch folder on this machine, and the pipeline reads them from there as it reads
a local folder. What this module adds to ``HubRepo`` is the disk bound and the order:

- the files are downloaded in the order the plan first reads them (``ScratchPlan``), ahead of the pipeline,
  within ``--max-scratch``: a download writes its next bytes only while the files before it in that order
  (each counted at its full size, downloaded or not) plus its own bytes so far fit in the bound, so the disk
  never holds more than the bound and a later file never takes the room an earlier one needs; a download
  stops mid-file when the bound is reached and goes on as room frees (the link stays busy: counting each
  download at its full size from its first byte left it idle while a file's worth of room was not yet
  free, benchmarks/hub_to_hub.py). The pipeline reads a file's bytes as they arrive (``Downloads.readinto``
  waits for the range it asks for). A file is deleted once the pipeline has read every byte it reads of it and
  it is verified (the reads are counted, which no other reader of the file shares: a Hub input's file hashes
  are the downloads' own, see below). Because downloads follow the order of first use and the
  pipeline's one stream reads in that order, the bound cannot stall the pack as long as it holds the largest
  set of files that some unit reads together or in between (``ScratchPlan.required``); a smaller bound is a
  one-line error before anything is downloaded, as is one file larger than the bound (it could never be
  held);
- each file is hashed as its bytes arrive and compared with the sha256 the Hub recorded for its LFS object;
  an output shard is finished (renamed into place, journaled, uploaded) only once every input file it read
  is verified (``settle``, which the pipeline calls before the rename): no finished output holds a byte the
  Hub did not record, and a corrupted transfer fails the pack naming the file, its unfinished shards dropped.
  Reading before the verification is what lets the first output shard start while its inputs arrive
  (waiting for whole verified files cost the Hub-to-Hub run the download of the first shard's input files
  before any work, benchmarks/hub_to_hub.py). That digest is the manifest's input hash (the pipeline does not
  hash a Hub input's files a second time);
- the transfer is huggingface_hub's ``http_get`` on the file's ``resolve`` URL at the resolved commit: the
  library's auth headers, its retries and resumption of a dropped stream, its typed errors, which
  ``transport.with_retries`` turns into one line;
- a verified file stays in the scratch folder until it is consumed, so a killed pack resumed later finds it
  (checked again against the Hub's sha256) instead of downloading it again; a partial download
  (``.incomplete``) is continued from where it stopped.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from .. import faults
from ..errors import ConvertError
from .local import LocalFile
from .protocol import FileEntry, ResourceFreeFile

if TYPE_CHECKING:
    from .hub import HubRepo

INCOMPLETE = ".incomplete"
#: --max-scratch's default: this many of the largest weight files (and at least ``ScratchPlan.required``).
DEFAULT_FILES = 3
#: Bytes a download writes at a time, each step within the bound.
WRITE_STEP = 1 << 20


@dataclass(frozen=True)
class Need:
    """One weight file the pack reads: its size, the sha256 the Hub recorded, the bytes the pipeline reads."""

    rel: str
    size: int
    sha256: str
    reads: int


@dataclass(frozen=True)
class ScratchPlan:
    """What the pack downloads, in the order it first reads each file; ``required``: the least bound under
    which it cannot stall (the largest set of files that are read together or between two reads of one of
    them: ``together``)."""

    needs: tuple[Need, ...]
    required: int
    together: tuple[str, ...]

    @property
    def largest(self) -> int:
        return max((n.size for n in self.needs), default=0)

    def default_bound(self) -> int:
        sizes = sorted((n.size for n in self.needs), reverse=True)
        return max(sum(sizes[:DEFAULT_FILES]), self.required)

    def check(self, bound: int, source_name: str, human: Callable[[int], str]) -> None:
        """One line when ``bound`` cannot hold what the pack must hold at once."""
        big = max(self.needs, key=lambda n: n.size, default=None)
        if big is not None and big.size > bound:
            raise ConvertError(f"--max-scratch {human(bound)}: {source_name}/{big.rel} alone is {human(big.size)}; "
                               f"raise it to at least {human(self.required)}")
        if self.required > bound:
            raise ConvertError(f"--max-scratch {human(bound)}: the pack reads {len(self.together)} files together "
                               f"({', '.join(self.together[:3])}{', ...' if len(self.together) > 3 else ''}), "
                               f"{human(self.required)} in all; raise it to at least that")


class _Part(Protocol):
    file: str
    nbytes: int


class ReadingUnit(Protocol):
    """What the downloads need of a plan unit (``plan.Unit``, which this layer below the plan does not import):
    the input ranges it reads."""

    @property
    def parts(self) -> Sequence[_Part]: ...


def scratch_plan(units: Iterable[ReadingUnit], entries: dict[str, FileEntry], source_name: str) -> ScratchPlan:
    """The files ``units`` (in the order the pipeline runs them) read, in the order of their first read, and
    the largest set alive at once (a file is alive from its first unit to its last)."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    reads: dict[str, int] = {}
    for i, u in enumerate(units):
        for p in u.parts:
            if p.nbytes == 0:
                continue
            first.setdefault(p.file, i)
            last[p.file] = i
            reads[p.file] = reads.get(p.file, 0) + p.nbytes
    needs = []
    for rel in sorted(first, key=lambda f: (first[f], f)):
        e = entries[rel]
        if not e.sha256:
            raise ConvertError(f"{source_name}/{rel}: not stored through LFS, so the Hub records no sha256 to "
                               "verify the download against")
        needs.append(Need(rel, e.size, e.sha256, reads[rel]))
    events = sorted([(first[f], 0, f) for f in first] + [(last[f], 1, f) for f in first])
    alive: dict[str, int] = {}
    best, together = 0, ()
    for _, kind, f in events:  # at one unit, every file starting there is counted before any ending there
        if kind == 0:
            alive[f] = entries[f].size
            if (now := sum(alive.values())) > best:
                best, together = now, tuple(alive)
        else:
            alive.pop(f, None)
    return ScratchPlan(tuple(needs), best, together)


class _Hashing:
    """The file object ``http_get`` writes into: each chunk hashed as it arrives, then written. A rewind to
    the start (the server ignored a resume's Range) starts the hash again; a stop request ends the transfer."""

    def __init__(self, f: Any, h: Any, stop: threading.Event, room: Callable[[int], None],
                 arrived: Callable[[int], None], restart: Callable[[], None]):
        self.f, self.h, self.stop, self.n, self.room = f, h, stop, 0, room
        self.arrived, self.restart = arrived, restart
        self.restarted = False

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        for k in range(0, len(view), WRITE_STEP):  # the bound's granularity
            part = view[k:k + WRITE_STEP]
            self.room(len(part))  # waits for room in the bound (raises _StopDownload when stopping)
            self.h.update(part)
            self.n += len(part)
            self.f.write(part)
            self.f.flush()  # readable by the pipeline from now on
            self.arrived(len(part))
        return len(view)

    def tell(self) -> int:
        return self.f.tell()

    def seek(self, pos: int, whence: int = 0) -> int:
        self.restarted = True
        self.restart()  # (raises if the pipeline has read the bytes being replaced)
        return self.f.seek(pos, whence)

    def truncate(self, size: int | None = None) -> int:
        return self.f.truncate(size)

    def flush(self) -> None:
        self.f.flush()


class _StopDownload(Exception):
    """The pack is stopping: the transfer in flight ends."""


@dataclass
class _State:
    need: Need
    index: int = 0  # its place in the download order
    written: int = 0  # bytes of it on the scratch disk
    avail: int = 0  # bytes of it the pipeline may read (written and flushed; not yet verified until ``ready``)
    path: Path | None = None  # where it is being written (``.incomplete``) or lies (verified)
    read: int = 0  # bytes the pipeline has read of it
    ready: bool = False  # whole and verified
    deleted: bool = False
    left: int = 0  # bytes the pipeline still reads
    fd: LocalFile | None = None
    sha256: str | None = None  # verified


@dataclass
class DownloadStats:
    """What the downloads did (``PackStats.downloads``)."""

    downloaded: int = 0  # files fetched by this run
    reused: int = 0  # files a killed run left verified in the scratch folder
    bytes: int = 0  # bytes received by this run
    resumed_bytes: int = 0  # bytes of partial downloads continued, not fetched again
    peak_scratch: int = 0  # the most bytes reserved on the scratch disk at once
    bound: int = 0
    waited_s: float = 0.0  # seconds the pipeline waited for a download
    files: list[str] = field(default_factory=list)  # fetched by this run, in order


class Downloads:
    """The scratch folder of one pack: ``threads`` threads (``Tuning.download_threads``) fetching ``plan.needs`` in
    order within ``bound``
    (module docstring); ``stop``: the pack's stop event (a failing or interrupted pack ends the transfers
    and wakes the pipeline's reader out of a wait)."""

    def __init__(self, hub: HubRepo, scratch: Path, bound: int, plan: ScratchPlan, stop: threading.Event,
                 say: Callable[[str], None], threads: int):
        self.hub, self.scratch, self.bound, self.plan, self.stop, self.say = hub, scratch, bound, plan, stop, say
        self.threads = max(1, threads)  # (0 would never download)
        self.state = {n.rel: _State(n, k, left=n.reads) for k, n in enumerate(plan.needs)}
        self._order = [self.state[n.rel] for n in plan.needs]
        self._cv = threading.Condition()
        self._next = 0  # the next need to start
        self._error: BaseException | None = None
        self._threads: list[threading.Thread] = []
        self.stats = DownloadStats(bound=bound)

    # -- the downloaders -----------------------------------------------------------------------------

    def start(self) -> None:
        self.scratch.mkdir(parents=True, exist_ok=True)
        self._threads = [threading.Thread(target=self._run, daemon=True, name=f"kimi-convert-download-{k}")
                         for k in range(self.threads)]
        for t in self._threads:
            t.start()

    def _before(self, st: _State) -> int:
        """The files before ``st`` in the download order still on (or bound for) the disk, at full size."""
        return sum(o.need.size for o in self._order[: st.index] if not o.deleted)

    def _on_disk(self) -> int:
        return sum(o.need.size if o.ready else o.written for o in self._order if not o.deleted)

    def _take(self) -> _State | None:
        """The next file to fetch once the bound has room for a byte of it; None: nothing left, or stopping."""
        with self._cv:
            while True:
                if self.stop.is_set() or self._error is not None or self._next >= len(self._order):
                    return None
                st = self._order[self._next]
                if self._before(st) < self.bound:
                    self._next += 1
                    return st
                self._cv.wait(0.2)

    def _room(self, st: _State, n: int) -> None:
        """Wait until ``n`` more bytes of ``st`` fit: the files before it at full size, plus its own bytes."""
        with self._cv:
            while self._before(st) + st.written + n > self.bound:
                if self.stop.is_set() or self._error is not None:
                    raise _StopDownload
                self._cv.wait(0.2)
            if self.stop.is_set():
                raise _StopDownload
            st.written += n
            self.stats.peak_scratch = max(self.stats.peak_scratch, self._on_disk())

    def _run(self) -> None:
        while (st := self._take()) is not None:
            try:
                sha = self._fetch(st)
            except _StopDownload:
                return
            except BaseException as e:  # raised to the pipeline's reader (``path``) and by ``close``
                with self._cv:
                    self._error = self._error or e
                    self._cv.notify_all()
                return
            with self._cv:
                st.ready, st.sha256, st.avail = True, sha, st.need.size
                if st.left <= 0:  # every planned read done while it was still arriving
                    self._delete(st)
                self._cv.notify_all()

    def _fetch(self, st: _State) -> str:
        """``st``'s file in the scratch folder, verified: reused if a killed run left it there whole, else
        downloaded (a partial download continued). Returns its sha256 (the Hub's, checked)."""
        need = st.need
        final = self.scratch / need.rel
        part = final.with_name(final.name + INCOMPLETE)
        final.parent.mkdir(parents=True, exist_ok=True)
        shown = self.hub.shown(need.rel)
        if final.is_file():
            self._room(st, final.stat().st_size)
            if final.stat().st_size == need.size and _sha256(final, self.stop) == need.sha256:
                self.stats.reused += 1
                st.path = final
                return need.sha256
            final.unlink()
            st.written = 0
        h = hashlib.sha256()
        have = part.stat().st_size if part.is_file() else 0
        if have > need.size:
            part.unlink()
            have = 0
        if have:
            self._room(st, have)
            _hash_into(part, h, self.stop)
            self.stats.resumed_bytes += have
        with open(part, "ab") as f:
            with self._cv:
                st.path, st.avail = part, have
                self._cv.notify_all()
            w = _Hashing(f, h, self.stop, lambda n: self._room(st, n), lambda n: self._arrived(st, n),
                         lambda: self._restart(st))
            self._get(need, w, have)
        if w.restarted:  # the server sent the whole file again: the hash of what is on disk now
            h = hashlib.sha256()
            _hash_into(part, h, self.stop)
            with self._cv:
                st.written = part.stat().st_size
        size, sha = part.stat().st_size, h.hexdigest()
        self.stats.bytes += w.n
        if size != need.size or sha != need.sha256:
            part.unlink(missing_ok=True)
            what = (f"{size} bytes arrived, the Hub lists {need.size}" if size != need.size else
                    f"the downloaded bytes' sha256 {sha[:16]}... is not the one the Hub recorded "
                    f"({need.sha256[:16]}...)")
            raise ConvertError(f"{shown}: {what}: corrupted in transit or at the source; no output shard made "
                               "from it was finished (re-run the same command to download it again)")
        with self._cv:  # (a reader opens st.path under the lock: never the name being renamed)
            os.replace(part, final)
            st.path = final
        faults.point("download")
        self.stats.downloaded += 1
        self.stats.files.append(need.rel)
        return sha

    def _arrived(self, st: _State, n: int) -> None:
        with self._cv:
            st.avail += n
            self._cv.notify_all()

    def _restart(self, st: _State) -> None:
        """The server answered a resumed download with the whole file: the bytes on disk are replaced. Refused
        where the pipeline has read some (they would not be the bytes verified)."""
        with self._cv:
            if st.read:
                raise ConvertError(f"{self.hub.shown(st.need.rel)}: the Hub restarted a resumed download after some "
                                   "of its bytes were read; re-run the same command")
            st.avail = 0

    def _delete(self, st: _State) -> None:
        """(With the lock held.) The file is consumed and verified: it goes, its room freed."""
        st.deleted = True
        if st.fd is not None:
            st.fd.close()
        with contextlib.suppress(FileNotFoundError):
            (self.scratch / st.need.rel).unlink()

    def _get(self, need: Need, w: _Hashing, have: int) -> None:
        """The library's transfer (``http_get``: its retries, its resumption of a dropped stream), its errors
        as one line (``with_retries``)."""
        from huggingface_hub.file_download import http_get
        from huggingface_hub.utils import build_hf_headers

        from ..transport import with_retries

        def go() -> None:
            if w.n:  # an attempt after one that received bytes: continue after them
                return http_get(self.hub.url(need.rel), w, resume_size=have + w.n, expected_size=need.size,
                                headers=build_hf_headers(token=self.hub.token), displayed_filename=need.rel)
            return http_get(self.hub.url(need.rel), w, resume_size=have, expected_size=need.size,
                            headers=build_hf_headers(token=self.hub.token), displayed_filename=need.rel)

        def attempt() -> None:
            try:
                go()
            except _StopDownload:
                raise
            except OSError as e:  # http_get's "Consistency check failed": the size that arrived
                if "Consistency check" in str(e):
                    return
                raise

        import logging

        logging.getLogger("huggingface_hub").setLevel(logging.ERROR)  # its retry warnings: ours say it
        with_retries(attempt, f"downloading {need.rel}", self.hub.repo_id, self.say,
                     hint="re-run the same command to resume (verified downloads are kept)")

    # -- the pipeline's side -------------------------------------------------------------------------

    def _wait(self, st: _State, done: Callable[[], bool]) -> None:
        """(With the lock held.) Until ``done()``; a download's error, or ``Stopped`` when the pack stops."""
        import time

        from ..hashing import Stopped

        t = time.perf_counter()
        while not done():
            if self._error is not None:
                raise self._error
            if self.stop.is_set():
                raise Stopped(self.hub.shown(st.need.rel))
            self._cv.wait(0.2)
        self.stats.waited_s += time.perf_counter() - t

    def readinto(self, rel: str, offset: int, buf: memoryview) -> int:
        """Read ``rel`` at ``offset`` into ``buf`` once those bytes have arrived (the file may still be
        downloading: its bytes are verified before any output shard made from them is finished, ``settle``);
        the read is counted, and the file goes once every planned read is done and it is verified."""
        st = self.state[rel]
        end = min(offset + len(buf), st.need.size)
        with self._cv:
            self._wait(st, lambda: st.ready or (st.path is not None and st.avail >= end))
            if st.deleted:
                raise ConvertError(f"{self.hub.shown(rel)}: read after every planned read of it (a bug)")
            if st.fd is None:
                st.fd = LocalFile.open(st.path, self.hub.shown(rel))  # the same file once renamed
            fd = st.fd
        n = fd.readinto(offset, buf)
        with self._cv:
            st.read += n
            st.left -= n
            if st.left <= 0 and st.ready and not st.deleted:
                self._delete(st)
                self._cv.notify_all()
        return n

    def settle(self, files: Iterable[str]) -> None:
        """Wait until each of ``files`` (input files an output shard read) is whole and verified: the shard
        is finished (renamed, journaled, uploaded) only then. A download's error is raised instead."""
        for rel in files:
            st = self.state.get(rel)
            if st is not None:
                with self._cv:
                    self._wait(st, lambda st=st: st.ready)

    def is_ready(self, rel: str) -> bool:
        return self.state[rel].ready

    def first_error(self, e: BaseException) -> BaseException:
        """What to report of a failed pack: a download's error (the pipeline then saw only its stop)."""
        return self._error if self._error is not None else e

    def hashes(self) -> dict[str, str]:
        """The verified downloads' sha256 (``hashing.labelled``: the manifest's input digests)."""
        from ..hashing import HUB_DIGEST, labelled  # (hashing imports the sources)

        return {rel: labelled(HUB_DIGEST, st.sha256) for rel, st in self.state.items() if st.sha256}

    def close(self, ok: bool) -> None:
        """Stop the downloaders; raise a download's error (``ok``: the pack finished, so every file was
        consumed: the scratch folder is removed if nothing else is in it)."""
        if not ok:
            self.stop.set()
        with self._cv:
            self._cv.notify_all()
        for t in self._threads:  # failing: a transfer stalled on a silent socket is not waited for (daemon)
            t.join(None if ok else 5.0)
        for st in self.state.values():
            if st.fd is not None:
                st.fd.close()
        if ok:
            for st in self.state.values():  # (a file left unread: an empty read plan; removed as well)
                with contextlib.suppress(FileNotFoundError):
                    (self.scratch / st.need.rel).unlink()
            remove_empty(self.scratch)
            if self._error is not None:
                raise self._error


def _hash_into(path: Path, h: Any, stop: threading.Event) -> None:
    with open(path, "rb") as f:
        while block := f.read(16 << 20):
            if stop.is_set():
                raise _StopDownload
            h.update(block)


def _sha256(path: Path, stop: threading.Event) -> str:
    h = hashlib.sha256()
    _hash_into(path, h, stop)
    return h.hexdigest()


def remove_empty(folder: Path) -> None:
    """``folder`` and its sub-folders, where empty (what the downloads made)."""
    if not folder.is_dir():
        return
    for d in sorted((p for p in folder.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            d.rmdir()
    with contextlib.suppress(OSError):
        folder.rmdir()


@dataclass
class FetchedFile(ResourceFreeFile):
    """A weight file of a Hub input as the pipeline reads it: from its download (waited for at the first
    read, not at the open: the reader opens the next piece's files to hint them, and must not wait there);
    every read counted, so the file goes once the pipeline has all it reads of it."""

    downloads: Downloads
    rel: str
    size: int

    def readinto(self, offset: int, buf: memoryview) -> int:
        return self.downloads.readinto(self.rel, offset, buf)

    # no readahead hint (its bytes arrive in order; the page cache holds what was just written) and nothing
    # to close (the descriptor is the downloads', closed when the file is consumed): ResourceFreeFile's


@dataclass
class FetchedHub:
    """The ``Source`` that ``pack`` reads a Hub input through: ``HubRepo``'s listing, JSON and side files
    (range requests), its weight files from ``downloads``. In-process only (it holds threads): a Hub input
    packs with one worker and one stream, which is what keeps the reads in the download order."""

    hub: HubRepo
    downloads: Downloads

    def __getattr__(self, name: str) -> Any:  # the rest of the Source protocol: the repository's
        return getattr(self.hub, name)

    @property
    def name(self) -> str:
        return self.hub.name

    def settle(self, files: Iterable[str]) -> None:
        """The optional ``Source.settle``: the pipeline finishes an output shard once its inputs are verified."""
        self.downloads.settle(files)

    def open(self, rel: str, shown: str | None = None):
        if rel in self.downloads.state:
            e = self.hub.check_named(rel, self.hub.name)
            return FetchedFile(self.downloads, rel, e.size)
        return self.hub.open(rel, shown)

    def for_worker(self) -> FetchedHub:
        return self
