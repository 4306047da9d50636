"""``pack --upload``: each output shard sent to the Hub as soon as it is final, while the next ones convert.

The transfer is huggingface_hub's: ``preupload_lfs_files`` with a ``CommitOperationAdd`` per shard (LFS:
the preupload call, the LFS batch, the object PUT), on a thread of its own, then ``create_commit`` of
every file at the end, the manifest last. What ``upload`` checks before its transfer (the repo id's
form, the token, one cheap request: ``connect``) runs before the plan, so a Hub that cannot be reached
costs no packing; retries and one-line errors are ``upload``'s (``with_retries``).

Why ``admit``: with ``--no-keep-output`` a shard is deleted once the Hub has it, so the local disk holds
only the shards in flight; a slow uplink must then slow the conversion down instead of filling the disk,
so a stream waits before opening a shard while ``Tuning.upload_queue + 1`` are on the disk and not yet on the Hub
(in-process workers and a Hub input's Ray tasks, each with its own uploader: ``run_hub_task``; with --workers N
or --ray of a local input the shards are still uploaded as they finish, but not waited for).

Resume: the journal records each upload with the shard's sha256 (``Journal.uploaded``); a resumed pack
asks the Hub's LFS batch endpoint which of those objects it holds (an object is named by its sha256, so
presence is the bytes' proof) and redoes only the rest.

The shard's sha256 (its LFS object id) is computed here, on the uploader's thread, from one read of the shard
that also checks its BLAKE3 against the journal's (what the pipeline computed while writing it): the bytes sent
are the manifest's. The pipeline itself hashes its outputs by BLAKE3 only, so a pack that does not upload never
pays for a sha256; one that does pays for it beside the transfer, which bounds it. The manifest then records
each output file's sha256 beside its BLAKE3 (``manifest.with_hub_digests``), as ``upload`` does.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import CommitOperationAdd, HfApi
from huggingface_hub.lfs import UploadInfo, post_lfs_batch_info
from huggingface_hub.utils import filter_repo_objects
from huggingface_hub.utils._paths import DEFAULT_IGNORE_PATTERNS

from .. import faults, filenames
from ..errors import ConvertError
from ..hashing import sha256_checked
from ..transport import IGNORE, RESUME, connect, with_retries
from ..tuning import Tuning

#: Objects per LFS batch request (huggingface_hub's UPLOAD_BATCH_MAX_NUM_FILES for the same endpoint).
BATCH = 256


@dataclass(frozen=True)
class UploadTarget:
    """Where ``pack --upload`` sends the output, and whether the local shards stay."""

    repo_id: str
    revision: str | None = None
    private: bool = False
    token: str | None = None
    keep_output: bool = True
    base_model: str | None = None


def _addition(path_in_repo: str, size: int, sha256: str, local: Path | None) -> CommitOperationAdd:
    """An LFS addition whose sha256 is known (``_hub_sha256``, or the journal's): the library then reads the file
    only to send it. ``local`` None: already on the Hub (a resumed run), nothing to read."""
    op = CommitOperationAdd(path_in_repo=path_in_repo, path_or_fileobj=b"")
    op.path_or_fileobj = str(local) if local is not None else b""
    sample = b""
    if local is not None:
        with open(local, "rb") as f:
            sample = f.read(512)
    op.upload_info = UploadInfo(size=size, sample=sample, sha256=bytes.fromhex(sha256))
    if local is None:
        op._upload_mode, op._is_uploaded = "lfs", True
    return op


def _hub_sha256(path: Path, size: int, digest: str) -> str:
    """The shard's sha256 (hex), from one read that also checks its size and its digest (``hashing.labelled``, the
    journal's): a shard changed on the disk since it was written is not sent."""
    sha = sha256_checked(path, size, digest)
    if sha is None:
        raise ConvertError(f"{path}: changed since it was written (not the size or digest the pack recorded); "
                           "start again with --overwrite")
    return sha


class LiveUpload:
    """The Hub side of one ``pack --upload``: connected and the repo created before the plan; a thread
    that preuploads each finished shard (``Tuning.upload_threads`` of them); the commit and the remote check at the
    end."""

    def __init__(self, target: UploadTarget, say: Callable[[str], None] = print, api: HfApi | None = None,
                 tuning: Tuning | None = None):
        """``api``: a Ray task's (``run_hub_task``), whose driver has already checked the token and created the repo:
        nothing is asked of the Hub here then. ``tuning``: pack's (its queue, threads and files per commit)."""
        self.target, self.say, self.tuning = target, say, tuning or Tuning()
        if api is None:
            api = connect(target.repo_id, target.token, write=True, say=say)
            with_retries(lambda: api.create_repo(target.repo_id, private=target.private, exist_ok=True,
                                                 repo_type="model"),
                         "creating the repository", target.repo_id, say)
        self.api: HfApi = api
        self._queue: queue.Queue = queue.Queue()
        self._room = threading.Condition()
        self._local = 0  # shards admitted (or resumed) and not yet on the Hub
        self._threads: list[threading.Thread] = []
        self._error: BaseException | None = None
        self.sent: list[str] = []  # shards this run preuploaded, in order (for tests and the summary)

    # ------------------------------------------------------------------------------------------
    # While packing: ``Tuning.upload_threads`` threads, each sending one shard at a time.

    def start(self, output_dir: Path, on_uploaded: Callable[[str, str], None]) -> None:
        """``on_uploaded(file, sha256)``: the Hub has the shard (the journal records it)."""
        self.output_dir, self._on_uploaded = output_dir, on_uploaded
        self._threads = [threading.Thread(target=self._run, daemon=True, name=f"kimi-convert-upload-{k}")
                         for k in range(self.tuning.upload_threads)]
        for t in self._threads:
            t.start()

    def admit(self, wait: bool, stop: threading.Event) -> None:
        """A stream is about to open a shard: with --no-keep-output and ``wait``, wait until fewer than
        ``Tuning.upload_queue + 1`` shards are local and not on the Hub (the disk bound). Raises the uploader's error,
        so that a failed upload stops the pack instead of letting shards pile up."""
        with self._room:
            while (wait and not self.target.keep_output and self._local > self.tuning.upload_queue
                   and self._error is None and not stop.is_set()):
                self._room.wait(0.2)
            self._raise()
            self._local += 1

    def submit(self, file: str, size: int, digest: str, admitted: bool = True) -> None:
        """Queue a finished shard (``digest``: its journaled BLAKE3, ``hashing.labelled``; ``admitted``: counted by
        ``admit`` when it was opened; a resumed run's shards are not)."""
        self._raise()
        if not admitted:
            with self._room:
                self._local += 1
        self._queue.put((file, size, digest))

    def close(self) -> None:
        """Wait for every queued shard to be on the Hub; the uploader's error, if any, as one line."""
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join()
        self._threads = []
        self._raise()

    def abandon(self) -> None:
        """The pack failed: stop after the shard in flight (what was sent is journaled, a resume skips it)."""
        self._error = self._error or ConvertError("stopped")
        self._drain()
        for _ in self._threads:
            self._queue.put(None)

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _drain(self) -> None:
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._error is not None:
                continue
            try:
                self._send(*item)
            except BaseException as e:  # raised in the pack's thread (admit, submit, close)
                self._error = e
                self._drain()
            with self._room:
                self._local = max(0, self._local - 1)
                self._room.notify_all()

    def _send(self, file: str, size: int, digest: str) -> None:
        path, records = self.output_dir / file, filenames.records_name(file)
        t = self.target
        sha256 = _hub_sha256(path, size, digest)

        def ops() -> list[CommitOperationAdd]:  # fresh each attempt: the library mutates them
            # the shard's records file with it (kept here, committed at the end: if the Hub takes it through
            # LFS, the commit then finds it sent and does not hold the end for it)
            extra = self.output_dir / records
            more = [CommitOperationAdd(path_in_repo=records, path_or_fileobj=str(extra))] if extra.is_file() else []
            return [_addition(file, size, sha256, path), *more]
        with_retries(lambda: self.api.preupload_lfs_files(t.repo_id, ops(), revision=t.revision, num_threads=1),
                     "uploading", t.repo_id, self.say, hint=RESUME)
        faults.point("upload")
        self.sent.append(file)
        self._on_uploaded(file, sha256)
        if not t.keep_output:
            path.unlink(missing_ok=True)

    # ------------------------------------------------------------------------------------------
    # Resume: which journaled uploads the Hub still has.

    def present(self, shards: dict[str, tuple[int, str]]) -> set[str]:
        """Of ``shards`` (file -> size, sha256), those whose LFS object the repo holds: the LFS batch
        endpoint answers without upload actions for an object it has. Nothing is sent."""
        if not shards:
            return set()
        t = self.target
        infos = [UploadInfo(size=size, sample=b"", sha256=bytes.fromhex(sha)) for size, sha in shards.values()]
        have: set[str] = set()
        for k in range(0, len(infos), BATCH):  # the library's own chunk for the batch endpoint
            batch, _, _ = with_retries(
                lambda part=infos[k:k + BATCH]: post_lfs_batch_info(part, self.api.token, "model", t.repo_id,
                                                                    revision=t.revision, endpoint=self.api.endpoint),
                "checking the uploaded shards", t.repo_id, self.say, hint=RESUME)
            have |= {o["oid"] for o in batch if not o.get("actions")}
        return {f for f, (_, sha) in shards.items() if sha in have}

    # ------------------------------------------------------------------------------------------
    # At the end: every file in one commit (or several, the manifest's last).

    def commit(self, output_dir: Path, shards: dict[str, tuple[int, str]], on_hub: set[str], message: str) -> object:
        """Commit the shards (``shards``: file -> size, sha256; ``on_hub``: those preuploaded, the others
        sent by the commit's own preupload from the local file) and every other file of the
        output (what ``upload_folder`` would take: ``IGNORE`` and the library's own patterns left out),
        manifest.json last. Returns the last commit's info."""
        local = sorted(p.relative_to(output_dir).as_posix() for p in output_dir.rglob("*") if p.is_file())
        names = [n for n in filter_repo_objects(local, ignore_patterns=[*IGNORE, *DEFAULT_IGNORE_PATTERNS])
                 if n not in shards]
        ops = [_addition(f, size, sha, None if f in on_hub else output_dir / f)
               for f, (size, sha) in sorted(shards.items())]
        records = [n for n in names if n.startswith(filenames.RECORDS_DIR + "/")]
        rest = [n for n in names if n not in records and n != filenames.MANIFEST]
        tail = [*rest, *([filenames.MANIFEST] if filenames.MANIFEST in names else [])]
        ops += [CommitOperationAdd(path_in_repo=n, path_or_fileobj=str(output_dir / n)) for n in records]
        last = [CommitOperationAdd(path_in_repo=n, path_or_fileobj=str(output_dir / n)) for n in tail]
        most = self.tuning.max_commit_files
        batches = [ops[i:i + most] for i in range(0, len(ops), most)]
        if batches and len(batches[-1]) + len(last) <= most:
            batches[-1] += last
        else:
            batches.append(last)
        t, info = self.target, None
        for k, batch in enumerate(batches, 1):
            msg = message if len(batches) == 1 else f"{message} ({k}/{len(batches)})"
            info = with_retries(lambda b=batch, m=msg: self.api.create_commit(t.repo_id, b, commit_message=m,
                                                                              revision=t.revision),
                                "committing", t.repo_id, self.say, hint=RESUME)
        return info

