"""The output folder of one ``pack``, claimed for the run: its lock, its resume journal, its space checks, and
the finish (configs, side files, index, then the manifest, then the journal goes).

Crash safety: each shard is written under a ``.partial`` name, flushed, renamed, hashed and recorded in the
journal; configs, index and manifest come last, the manifest very last, and the journal is removed after it.
A resume re-checks the recorded shards against their hashes and writes only the rest, so the result is
byte-identical to an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from . import configs, filenames, journal, write
from . import manifest as manifest_mod
from .atomic import write_atomic, write_atomic_chunks, write_json_atomic
from .checkpoint import INDEX_NAME, Checkpoint
from .errors import ConvertError
from .hashing import HUB_DIGEST, bytes_digest, file_digest, labelled, unlabel
from .journal import Journal, ShardRecord
from .plan import Plan, ShardSize
from .plan.serialize import plan_sha256
from .progress import human_bytes
from .sources import Source

if TYPE_CHECKING:
    from .upload.live import LiveUpload


class OutputFolder:
    """``pack``'s output folder, locked for the run (``claim``, a context manager); ``journal``: the shards
    finished (by this run or an earlier one), recorded under ``lock`` (the pipeline's threads and the
    uploader's both record)."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd
        self.journal: Journal | None = None
        self.lock = threading.Lock()

    @classmethod
    @contextlib.contextmanager
    def claim(cls, path: Path):
        """The folder made and locked (before the journal is read: a concurrent pack is told so, not --resume)."""
        path.mkdir(parents=True, exist_ok=True)
        fd = lock_output(path)
        try:
            yield cls(path, fd)
        finally:
            unlock_output(path, fd)

    def open(self, source: Source, plan: Plan, overwrite: bool, resume: bool, command: str,
             uploading: bool = False) -> bool:
        """The journal to continue, or a fresh one; False when a resumed output is already complete."""
        plan_sha = plan_sha256(plan)
        stamps = journal.input_stamps(source, [f for f, _ in plan.inputs])
        try:
            existing = Journal.load(self.path)
        except ConvertError:
            if resume or not overwrite:
                raise
            existing = None  # unreadable, or another version's (its message says --overwrite): replaced
        if resume and existing is not None:
            if existing.plan_sha256 != plan_sha or existing.inputs != stamps:
                what = ("input files changed" if existing.inputs != stamps
                        else "the plan (input headers, mapping or options) differs")
                raise ConvertError(f"{self.path}: cannot resume: {what} since the interrupted run; "
                                   "rerun it with the same options, or start again with --overwrite")
            self.journal = existing
            return True
        if resume and (self.path / filenames.MANIFEST).exists():
            _check_same_run(source, self.path, plan, plan_sha)
            _check_complete(self.path, shards_may_be_gone=uploading)
            return False
        self._start_afresh(plan, existing, overwrite, resume)
        self.journal = Journal(plan_sha, command, stamps)
        self.journal.save(self.path)
        return True

    def _start_afresh(self, plan: Plan, existing: Journal | None, overwrite: bool, resume: bool) -> None:
        """Refuse what is not ours to replace, then clear a previous output."""
        out = self.path
        if existing is not None and not overwrite:
            raise ConvertError(f"{out}: holds an unfinished pack ({len(existing.shards)} shards done); "
                               f"resume it with: {existing.command}")
        if not (resume or overwrite) and any(p.name != journal.LOCK for p in out.iterdir()):
            raise ConvertError(f"{out}: not empty; pass --overwrite to replace a previous output")
        if resume and not write.own_files_only(out, plan.side_files):
            raise ConvertError(f"{out}: nothing to resume (no journal) and the folder holds other files; "
                               "pass --overwrite to start again")
        write.clear_previous(out, plan.side_files)
        for p in out.rglob("*" + write.PARTIAL):  # side files' are in sub-folders
            p.unlink()

    def keep_finished(self, plan: Plan, hub: LiveUpload | None = None) -> int:
        """Keep the journaled shards whose file and records file still hash to the recorded values, or (with
        --upload) whose records file does and whose upload the Hub's LFS confirms by sha256; forget the rest."""
        j, out = self.journal, self.path
        planned = {s.file for s in plan.shard_sizes()}
        claimed = {f: (j.shards[f].size, sha) for f, sha in j.uploaded.items() if f in planned and f in j.shards}
        on_hub = hub.present(claimed) if hub is not None else set()
        j.uploaded = {f: sha for f, sha in j.uploaded.items() if f in on_hub}
        kept = 0
        for name, rec in list(j.shards.items()):
            if name in planned and ((name in on_hub and journal.records_intact(out, name, rec))
                                    or journal.intact(out, name, rec)):
                kept += 1
                if name in on_hub and hub is not None and not hub.target.keep_output:
                    (out / name).unlink(missing_ok=True)  # killed between the upload and the delete
            else:
                del j.shards[name]
                j.uploaded.pop(name, None)
        j.save(out)
        return kept

    def todo(self, plan: Plan) -> list[ShardSize]:
        """The shards still to write, as the outline counts them (their parts of the plan are made when run)."""
        return [s for s in plan.shard_sizes() if s.file not in self.journal.shards]

    def done_bytes(self, plan: Plan) -> int:
        loads = plan.shard_loads
        return sum(loads[f].bytes_in for f in self.journal.shards if f in loads)

    def check_space(self, todo: list[ShardSize], in_flight: int | None = None, queue: int = 0) -> None:
        check_space(self.path, todo, in_flight, queue)

    def record(self, file: str, rec: ShardRecord, uploaded: str | None = None) -> None:
        """A finished shard journaled (``uploaded``: its sha256, uploaded by a Ray task, this run's upload as well)."""
        with self.lock:
            self.journal.shards[file] = rec
            if uploaded:
                self.journal.uploaded[file] = uploaded
            self.journal.save(self.path)

    def record_inputs(self, hashes: dict[str, str]) -> None:
        """Input files' digests, journaled once a wave has hashed them whole (a resume does not hash them again)."""
        if hashes:
            with self.lock:
                self.journal.input_digests.update(hashes)
                self.journal.save(self.path)

    def record_upload(self, file: str, sha: str) -> None:
        with self.lock:
            self.journal.uploaded[file] = sha
            self.journal.save(self.path)

    def place_records(self, shard: str, rec: ShardRecord, data: bytes) -> None:
        """A Ray task's records file, written where the manifest and the commit read it, once checked against
        the record (it crossed the network)."""
        if len(data) != rec.records_size or bytes_digest(data, unlabel(rec.records_digest)[0]) != rec.records_digest:
            raise ConvertError(f"{shard}: the records file a Ray task sent does not match its record (a bug)")
        path = self.path / filenames.records_name(shard)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, data, fault="records")

    def drop_partials(self) -> None:
        """Remove the ``.partial`` files of shards and records a failed run left (their space reserved, their
        data unfinished): the shards it finished stay, journaled, and nothing else in the folder looks written."""
        for p in self.path.rglob("*" + write.PARTIAL):
            with contextlib.suppress(OSError):
                p.unlink()

    def finish(self, ckpt: Checkpoint, plan: Plan, input_hashes: dict[str, str], keep_journal: bool = False,
               origin: dict | None = None, uploaded: dict[str, str] | None = None) -> None:
        """Configs, side files and index, then the manifest, then the journal goes (``keep_journal``: --upload,
        kept until the commit is in: a resume then commits). Side files are copied again by a resumed run
        (they are cheap), so its manifest is an uninterrupted run's. The module records are already on disk,
        one file per shard (written as each shard finished): manifest.json lists them with their digests.
        ``uploaded`` (``pack --upload``: shard -> the sha256 its upload computed): every output file's sha256 goes
        beside its BLAKE3, as ``upload`` writes it (``manifest.with_hub_digests``)."""
        out, j = self.path, self.journal
        cfgs = configs.config_files(ckpt.config, plan)
        for name, content in cfgs.items():
            write_json_atomic(out / name, content)
        side = write.copy_side_files(ckpt.source, out, plan.side_files, plan.side_folders)
        write_atomic_chunks(out / INDEX_NAME, configs.index_chunks(plan, spill=out), fault="json")
        own = [write.record(out, f) for f in (*cfgs, INDEX_NAME)]
        recs = {s.file: j.shards[s.file] for s in plan.shard_sizes()}
        man = manifest_mod.build(
            plan,
            j.plan_sha256,  # the hash of plan_dict(plan): a journal is only continued for the same plan
            input_hashes,
            {f: (r.size, r.digest) for f, r in recs.items()},
            {f: manifest_mod.RecordsFile(manifest_mod.records_name(f), r.records_size, r.records_digest, r.modules)
             for f, r in recs.items()},
            [r.to_dict() for r in [*own, *side]],
            [r.to_dict() for r in side],
            origin,
        )
        if uploaded is not None:
            man = manifest_mod.with_hub_digests(man, manifest_mod.hub_sha256(out, man, uploaded))
        manifest_mod.write_manifest(out, man)
        if not keep_journal:
            self.remove_journal()

    def remove_journal(self) -> None:
        (self.path / journal.NAME).unlink()


def _check_same_run(source: Source, output_dir: Path, plan: Plan, plan_sha: str) -> None:
    """A finished output is "already complete" only for the run this command asks: the same plan (recipe,
    options, mapping, input headers: the manifest's ``plan_sha256``) from the same input files (each one's size
    and digest as the manifest records them; the Hub's LFS sha256 where the source knows it and the manifest
    records sha256, else the file re-hashed). Anything else is another output, refused in one line rather than
    passed off as this one."""
    man = manifest_mod.load_manifest(output_dir)
    if man.get("plan_sha256") != plan_sha:
        was, now = man.get("recipe") or {}, plan.recipe.name
        what = (f"recipe {was.get('name')!r}, not {now!r}" if isinstance(was, dict) and was.get("name") not in
                (None, now) else "another plan (options, mapping or input headers)")
        raise ConvertError(f"{output_dir}: already finished, but by {what} (manifest.json plan_sha256 differs): "
                           "this is not the output this command makes; start again with --overwrite")
    recorded = {e.get("file"): e for e in man.get("inputs", []) if isinstance(e, dict)}
    for f, size in plan.inputs:
        rec = recorded.get(f)
        want = None if rec is None else manifest_mod.entry_digest(rec)
        if want is None or rec.get("size") != size or _input_digest(source, f, unlabel(want)[0]) != want:
            raise ConvertError(f"{output_dir}: already finished, but from another {source.shown(f)} (its size or "
                               "digest differs from manifest.json's inputs); start again with --overwrite")


def _input_digest(source: Source, f: str, digest: str) -> str:
    """An input file's ``digest`` (labelled): the Hub's LFS sha256 where the source knows it, else the file's bytes
    hashed."""
    entry = source.entry(f)
    if digest == HUB_DIGEST and entry is not None and entry.sha256:
        return labelled(HUB_DIGEST, entry.sha256)
    return file_digest(f, digest, source=source)


def _check_complete(output_dir: Path, shards_may_be_gone: bool = False) -> None:
    """A resumed run that finds a finished output checks its files against the manifest (with --upload,
    the shards --no-keep-output removed are checked on the Hub instead, by the remote check)."""
    man = manifest_mod.load_manifest(output_dir)
    for f in [*man.get("outputs", []), *man.get("records", []), *man.get("files", [])]:
        path = output_dir / f["file"]
        if shards_may_be_gone and f in man.get("outputs", []) and not path.exists():
            continue
        want = manifest_mod.entry_digest(f)
        if (want is None or not path.is_file() or path.stat().st_size != f["size"]
                or file_digest(path, unlabel(want)[0]) != want):
            raise ConvertError(f"{path}: does not match manifest.json; start again with --overwrite")


def check_space(output_dir: Path, todo: list[ShardSize], in_flight: int | None = None, queue: int = 0) -> None:
    """``in_flight``: with --no-keep-output, the shards being written at once (each stream's), to which the
    uploader's ``queue`` (``Tuning.upload_queue``) adds its own: the disk needs the largest of those only."""
    sizes = sorted((s.size for s in todo), reverse=True)
    if in_flight is not None:
        sizes = sizes[: in_flight + queue + 1]
    need = sum(sizes)
    free = shutil.disk_usage(output_dir).free
    if need > free:
        raise ConvertError(f"{output_dir}: needs {human_bytes(need)} for {len(todo)} shard(s), "
                           f"{human_bytes(free)} free")


def lock_output(output_dir: Path) -> int:
    """An exclusive ``flock`` on ``OUTPUT/.kimi-convert-pack.lock`` (holding this process's pid), held until the
    descriptor closes: at the end of pack (which removes the file), or by the kernel when the process dies, so
    a killed pack leaves no stale lock (its file is taken over by the next pack). A second pack into the same
    folder is refused at once, naming the holder's pid, instead of being told to --resume what is still being
    written. Returns the descriptor; a filesystem without flock (some network mounts) gets no lock, as before."""
    import fcntl

    path = output_dir / journal.LOCK
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            os.close(fd)
            who = f"another pack (pid {holder})" if holder.isdigit() else "another pack"
            raise ConvertError(f"{output_dir}: {who} is writing this output now; wait for it to end (or stop it), "
                               "then run pack again") from None
        except OSError:
            return fd
        try:  # the file locked must still be the one at the path (a finishing pack removes it, then unlocks)
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def unlock_output(output_dir: Path, fd: int) -> None:
    """Release :func:`lock_output`'s lock and remove its file (still held, so no other pack has it): a finished
    output keeps only what its manifest lists. Only a killed pack leaves the file, for the next to take over."""
    with contextlib.suppress(FileNotFoundError):
        (output_dir / journal.LOCK).unlink()
    os.close(fd)
