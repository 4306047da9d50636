"""``pack hf://OWNER/REPO OUTPUT --ray``: Ray tasks that need no shared filesystem for the input, nor
(with ``--upload REPO_ID --no-keep-output``) for the output (issue 25, item 5).

Why each task fetches and sends its own bytes: the point of a cluster is many links and many disks; routing
the checkpoint through the driver (or through Ray's object store) would make the driver's link the bound
again. So a task is given its job (consecutive output shards and their units, as ``raycluster`` cuts them)
and the Hub's coordinates (the repository at its resolved commit, pickled without the token; the endpoint
and the token travel in the task's environment, ``HF_ENDPOINT`` and ``HF_TOKEN``, where huggingface_hub reads
them), and on its node:

- downloads just the weight files its job reads into a task-local scratch folder (``--scratch`` as a path
  on every node, default the node's temporary folder), within ``--max-scratch`` (per task: each task holds
  its own bound), verifying each against the Hub's LFS sha256 (``sources.hubfetch``, one stream: the reads
  follow the download order);
- converts (``pipeline.run_jobs``);
- with ``--upload``: preuploads each shard's LFS object to the destination itself (``hub.live.LiveUpload``,
  without its connect: the driver checked the token and created the repository) and deletes it;
- yields to the driver, per shard, its record (sizes and sha256s: what the journal, the manifest and the
  commit need) and its records file's bytes (a few kB of JSON: the driver writes it into OUTPUT, where the
  manifest and the commit read it), never the shard's bytes.

The driver keeps the journal, writes configs, index and manifest, and makes the one commit (the manifest
last), as a local ``pack --upload`` does: the repository is the same bytes.

Where a task writes its shards: with ``--upload --no-keep-output``, in its task folder (nothing of the
driver's filesystem is used on the nodes). Otherwise the shards must end in OUTPUT, so, as for any
``--ray`` pack, every node must see OUTPUT at the same path; a task checks that it does (the driver's
probe file, with a nonce) and otherwise fails at once with one line saying what to add.

Retries: a re-run task (its worker or node died) converts its job again (its shards' records are the same
bytes: Ray's replay of the generator hands the driver each exactly once); its uploads are not sent twice, the
LFS batch answers that the Hub has them. Downloads it had verified on the same node are reused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from . import filenames
from .errors import ConvertError
from .journal import ShardRecord

if TYPE_CHECKING:
    from .hub.live import UploadTarget
    from .pipeline import Job, JobResult
    from .sources.hub import HubRepo

#: The default root of the tasks' folders, under the node's temporary folder (``TMPDIR``).
SCRATCH = "kimi-convert-hub-scratch"
#: Environment settings of the driver's huggingface_hub that its tasks take (with HF_ENDPOINT, HF_TOKEN).
HUB_SETTINGS = "HF_HUB_"


@dataclass(frozen=True)
class HubTask:
    """What a Hub-input task gets besides its job: its scratch bound, where its folder goes, where its
    shards go and whether it uploads them (``upload``: the target, token left out)."""

    bound: int  # --max-scratch for this task (checked by the driver against its job)
    root: str | None  # --scratch (the same node-local path on every node), None: the node's temporary folder
    tag: str  # the task folder's name (its first shard, the run's nonce): a re-run on the node finds its downloads
    upload: UploadTarget | None
    local_output: bool  # the shards in the task folder (--upload --no-keep-output), else in OUTPUT
    probe: str  # the nonce the driver wrote into OUTPUT/RAY_PROBE (checked where the shards go to OUTPUT)


@dataclass(frozen=True)
class Arrived:
    """What a task sends with a shard's record: its records file (None: written in OUTPUT by the task) and
    whether the task uploaded the shard (the driver journals it as on the Hub)."""

    records: bytes | None
    uploaded: bool


def task_env(token: str | None) -> dict[str, str]:
    """The tasks' huggingface_hub settings: the driver's endpoint and token (as the library reads them) and
    its ``HF_HUB_*`` options (Xet off, timeouts). Not HF_HOME: a path of the driver's machine."""
    from huggingface_hub import constants

    env = {k: v for k, v in os.environ.items() if k.startswith(HUB_SETTINGS)}
    env["HF_ENDPOINT"] = constants.ENDPOINT
    if token:
        env["HF_TOKEN"] = token
    return env


def write_probe(output_dir: Path) -> str:
    """The nonce a task checks to know it sees the driver's OUTPUT (not a folder of the same name on its node)."""
    nonce = secrets.token_hex(16)
    (output_dir / filenames.RAY_PROBE).write_text(nonce, encoding="ascii")
    return nonce


def remove_probe(output_dir: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        (output_dir / filenames.RAY_PROBE).unlink()


def check_probe(output_dir: Path, nonce: str) -> None:
    """One line when this node does not see the driver's OUTPUT (no shared filesystem)."""
    try:
        seen = (output_dir / filenames.RAY_PROBE).read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError):
        seen = ""
    if seen != nonce:
        raise ConvertError(f"{output_dir}: not the pack's output folder on Ray node {socket.gethostname()} (no "
                           "shared filesystem): with a Hub input, add --upload REPO_ID --no-keep-output (each task "
                           "uploads its own shards), or put OUTPUT on a filesystem every node mounts at the same path")


def task_folder(hub: HubRepo, t: HubTask) -> Path:
    """``ROOT/OWNER--REPO@COMMIT12/TAG``: one folder a task, so tasks on one node never share a download."""
    root = Path(t.root) if t.root else Path(tempfile.gettempdir()) / SCRATCH
    return root / f"{hub.repo_id.replace('/', '--')}@{hub.commit[:12]}" / t.tag


def run_task(job: Job, device: str, threads: int, t: HubTask,
             emit: Callable[[str, ShardRecord, Arrived | None], None]) -> JobResult:
    """One attempt at a Hub-input job on a Ray node (module docstring); ``emit`` each shard once it is final
    (uploaded, with --upload). Returns the job's result, its input hashes the verified downloads' and its
    ``downloads`` the scratch folder's figures."""
    from .devices import resolve_device
    from .hub.transport import bound_library
    from .pipeline import run_jobs
    from .sources.hubfetch import Downloads, FetchedHub, scratch_plan

    bound_library()  # the library's timeouts, in this process too
    hub: HubRepo = job.source  # type: ignore[assignment]
    folder = task_folder(hub, t)
    out = folder / "out" if t.local_output else job.output_dir
    if not t.local_output:
        check_probe(job.output_dir, t.probe)
    out.mkdir(parents=True, exist_ok=True)
    sp = scratch_plan(job.units, hub.files, hub.name)
    stop = threading.Event()
    downloads = Downloads(hub, folder / "in", t.bound, sp, stop, _say)
    uploader: _TaskUpload | None = None
    try:
        _check_task_space(folder, sp, t.bound, [s.size for s in job.shards], t.local_output)
        uploader = _uploader(t, out, emit)
        downloads.start()
        res = run_jobs([dataclasses.replace(job, source=FetchedHub(hub, downloads), output_dir=out)],
                       resolve_device(device), uploader.on_shard if uploader else lambda f, rec: emit(f, rec, None),
                       threads=threads, stop=stop, **({"admit": uploader.live.admit} if uploader else {}))[0]
        downloads.close(ok=True)
        if uploader is not None:
            uploader.live.close()  # every shard on the Hub, or the upload's error
    except BaseException as e:
        with contextlib.suppress(BaseException):
            downloads.close(ok=False)
        if uploader is not None:
            uploader.live.abandon()
        if not isinstance(e, KeyboardInterrupt):  # no later run reads this run's task folder
            shutil.rmtree(folder, ignore_errors=True)
        raise downloads.first_error(e) from None
    if t.local_output:
        _tidy(folder, out, [s.file for s in job.shards])
    res.input_hashes = downloads.hashes()
    res.downloads = {**dataclasses.asdict(downloads.stats), "scratch": str(folder / "in"),
                     "node": socket.gethostname(), "output": str(out)}
    return res


def _say(line: str) -> None:
    import sys

    print(line, file=sys.stderr)


def _records(out: Path, file: str) -> bytes:
    return (out / filenames.records_name(file)).read_bytes()


@dataclass
class _TaskUpload:
    """A task's uploader: each shard queued as it is final, emitted to the driver once the Hub has it."""

    live: object  # hub.live.LiveUpload
    out: Path
    local: bool
    emit: Callable[[str, ShardRecord, Arrived | None], None]
    pending: dict[str, tuple[ShardRecord, bytes | None]]

    def on_shard(self, file: str, rec: ShardRecord) -> None:
        self.pending[file] = (rec, _records(self.out, file) if self.local else None)
        self.live.submit(file, rec.size, rec.sha256)

    def on_uploaded(self, file: str, sha256: str) -> None:
        rec, records = self.pending.pop(file)
        self.emit(file, rec, Arrived(records, True))


def _uploader(t: HubTask, out: Path, emit: Callable) -> _TaskUpload | None:
    """With --upload: the task's ``LiveUpload`` on an ``HfApi`` of the task's environment (no connect)."""
    if t.upload is None:
        return None
    from huggingface_hub import HfApi

    from .hub.live import LiveUpload

    up = _TaskUpload(LiveUpload(t.upload, _say, api=HfApi()), out, t.local_output, emit, {})
    up.live.start(out, up.on_uploaded)
    return up


def _check_task_space(folder: Path, sp, bound: int, shard_sizes: list[int], local_output: bool) -> None:
    """The task folder's disk holds the scratch bound (or all the job downloads, if less) and, with the
    shards written there, the ones that may be there at once (``--no-keep-output``'s bound)."""
    from .hub.live import QUEUE
    from .progress import human_bytes

    folder.mkdir(parents=True, exist_ok=True)
    need = min(bound, sum(n.size for n in sp.needs))
    if local_output:
        need += sum(sorted(shard_sizes, reverse=True)[: QUEUE + 2])
    free = shutil.disk_usage(folder).free
    if need > free:
        raise ConvertError(f"{folder} (Ray node {socket.gethostname()}): the task needs up to {human_bytes(need)} "
                           f"at once, {human_bytes(free)} free; lower --max-scratch or free space")


def _tidy(folder: Path, out: Path, shards: list[str]) -> None:
    """A finished task leaves nothing: its records files were sent, its shards uploaded and deleted."""
    from .sources.hubfetch import _remove_empty

    for f in shards:
        for p in (out / f, out / filenames.records_name(f)):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
    _remove_empty(folder)
    with contextlib.suppress(OSError):
        folder.parent.rmdir()
