"""A Hub input's staging for ``pack`` (``staging``'s protocol): its weight files downloaded just in time within
``--max-scratch`` (``hubfetch``), by this process (``HubStaging``) or, with ``--ray``, by each task on its node
(``TaskStaging``: no shared filesystem for the input, issue 25, item 5).

Why each Ray task fetches its own bytes: the point of a cluster is many links and many disks; routing the
checkpoint through the driver (or through Ray's object store) would make the driver's link the bound again.
So a task is given its job and the Hub's coordinates (the repository at its resolved commit, pickled without
the token; the endpoint and the token travel in the task's environment, ``HF_ENDPOINT`` and ``HF_TOKEN``, where
huggingface_hub reads them), and on its node downloads just the weight files its job reads into a task-local
scratch folder (``--scratch`` as a path on every node, default the node's temporary folder), within
``--max-scratch`` (per task: each task holds its own bound, checked by the driver against its job before any
task starts), verifying each against the Hub's LFS sha256. Where the task's shards go to OUTPUT (no
``--upload --no-keep-output``), every node must see OUTPUT at the same path: a task checks that it does (the
driver's probe file, with a nonce) and otherwise fails at once with one line saying what to add. A re-run task
finds the downloads it had verified on the same node (its folder is named by its first shard and the run's
nonce). How the task converts and uploads is ``raycluster``'s.
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .. import filenames
from ..errors import ConvertError
from .hubfetch import Downloads, FetchedHub, ScratchPlan, remove_empty, scratch_plan

if TYPE_CHECKING:
    from .hub import HubRepo

#: The default root of the Ray tasks' folders, under the node's temporary folder (``TMPDIR``).
SCRATCH = "kimi-convert-hub-scratch"
#: Environment settings of the driver's huggingface_hub that its tasks take (with HF_ENDPOINT, HF_TOKEN).
HUB_SETTINGS = "HF_HUB_"


def _human(n: int) -> str:
    from ..progress import human_bytes

    return human_bytes(n)


def checked_plan(hub: HubRepo, units: list, max_scratch: int | None) -> tuple[ScratchPlan, int]:
    """What the downloads fetch and the bound they keep (``--max-scratch``, default a few files), checked."""
    sp = scratch_plan(units, hub.files, hub.name)
    bound = max_scratch or sp.default_bound()
    sp.check(bound, hub.name, _human)
    return sp, bound


def scratch_folder(output_dir: Path, scratch: str | os.PathLike | None) -> Path:
    """The scratch folder (default: beside the output, ``.OUTPUT.hub-scratch``; with --ray, on each node): not
    inside the output, which is uploaded and checked as a whole."""
    out = output_dir.absolute()
    where = Path(scratch).absolute() if scratch is not None else out.parent / f".{out.name}.hub-scratch"
    if where == out or where.is_relative_to(out) or out.is_relative_to(where):
        raise ConvertError(f"--scratch {where}: must be outside the output folder {out} (and not contain it)")
    if where.exists() and not where.is_dir():
        raise ConvertError(f"--scratch {where}: is a file, expected a folder")
    return where


def check_scratch_space(scratch: Path, output_dir: Path, shard_sizes: list[int], sp: ScratchPlan,
                        bound: int) -> None:
    """The scratch folder's disk holds the bound (or everything still to download, if less); on the output's
    disk, with the shards still to write."""
    need = min(bound, sum(n.size for n in sp.needs))
    probe = scratch if scratch.exists() else scratch.parent
    if not probe.exists():
        raise ConvertError(f"--scratch {scratch}: its parent folder does not exist")
    if os.stat(probe).st_dev == os.stat(output_dir).st_dev:
        need += sum(shard_sizes)
    free = shutil.disk_usage(probe).free
    if need > free:
        raise ConvertError(f"{scratch}: the downloads need up to {_human(need)} at once (with the output "
                           f"where it shares the disk), {_human(free)} free; lower --max-scratch or free space")


@dataclass
class HubStaging:
    """The driver's side: one stream's downloads in this process, or (``ray``) the tasks' coordinates."""

    hub: HubRepo
    output_dir: Path
    scratch: str | os.PathLike | None
    max_scratch: int | None
    ray: bool
    say: Callable[[str], None]
    download_threads: int  # Tuning.download_threads
    hashes_inputs: bool = False  # the downloads verify and hash each file as it arrives
    reads_ahead: bool = False  # nothing local to read ahead: the downloads are the readahead
    per_task: bool = True  # with --ray, each task downloads its own inputs (``TaskStaging``)
    downloads: Downloads | None = None
    early: tuple[ScratchPlan, int] | None = None
    folder: Path | None = None  # the scratch folder, checked by ``limits``

    def limits(self, workers: int | None, streams: int | None) -> tuple[int | None, int | None]:
        """One worker and one stream (its reads then follow the download order, which is what keeps the scratch
        bound from stalling: ``hubfetch``), in this process or in each Ray task; the scratch folder checked."""
        for flag, n in (("--workers", workers), ("--streams", streams)):
            if n is not None and n > 1:
                raise ConvertError(f"{flag} {n}: a Hub input packs with one worker and one stream (the network, "
                                   "not the conversion, is its bound)")
        self.folder = scratch_folder(self.output_dir, self.scratch)
        return (workers, streams) if self.ray else (1, 1)

    def command(self, command: str | None, spec: object, output_dir: Path) -> str | None:
        """The resume command names the resolved commit, so a resume reads the same bytes."""
        if command is None or isinstance(spec, str):
            return (command or f"kimi-convert pack {spec} {output_dir} --resume").replace(str(spec), self.hub.name, 1)
        return command

    def check_plan(self, units: list, resume: bool, task_units: Callable[[], Iterator[list]] | None) -> None:
        """The bound checked before the output exists (a resume: at ``start``, against what is left); with
        --ray, each task's bound against its job (``task_units``: each job's units, a wave's part of the plan made
        at a time, never the whole plan's units at once)."""
        if resume:
            return
        if not self.ray:
            self.early = checked_plan(self.hub, units, self.max_scratch)
        elif task_units is not None:
            for us in task_units():
                checked_plan(self.hub, us, self.max_scratch)

    def start(self, units: list, todo: list, output_dir: Path, stop: threading.Event, started: bool):
        """The source the jobs read: with --ray the repository (pickled to the tasks without the token: it travels
        as HF_TOKEN, ``task_env``), else the downloads, started (``stop``: the pipeline's; they stop with it)."""
        if self.ray:
            return dataclasses.replace(self.hub, token=None)
        sp, bound = self.early if self.early is not None and not started else checked_plan(
            self.hub, units, self.max_scratch)
        folder = self.folder or scratch_folder(output_dir, self.scratch)
        check_scratch_space(folder, output_dir, [s.size for s in todo], sp, bound)
        self.downloads = Downloads(self.hub, folder, bound, sp, stop, self.say, self.download_threads)
        self.downloads.start()
        return FetchedHub(self.hub, self.downloads)

    @contextlib.contextmanager
    def tasks(self, jobs: list, output_dir: Path, upload: object, token: str | None,
              local_output: bool) -> Iterator[tuple[list | None, dict[str, str] | None]]:
        """Each Ray task's ``HubTask`` and environment; where its shards go to OUTPUT, the probe file that lets
        each task check it sees this OUTPUT (removed at the end)."""
        probe = "" if local_output else write_probe(output_dir)
        root = str(Path(self.scratch).absolute()) if self.scratch is not None else None
        target = dataclasses.replace(upload, token=None) if upload is not None else None
        run = secrets.token_hex(4)  # a task's re-run shares its folder, a resumed pack's tasks never an orphan's
        tasks = [HubTask(checked_plan(self.hub, job.units, self.max_scratch)[1], root,
                         f"{job.shards[0].file.removesuffix('.safetensors') if job.shards else 'none'}.{run}",
                         target, local_output, probe) for job in jobs]
        try:
            yield tasks, task_env(token if upload is not None else self.hub.token)
        finally:
            remove_probe(output_dir)

    def close(self, ok: bool) -> None:
        if self.downloads is not None:
            self.downloads.close(ok=ok)

    def failed(self, e: BaseException) -> BaseException:
        """The run failed: the transfers end (verified downloads stay in the scratch folder for a resume), and a
        download's error is the one to report (the pipeline then saw only its stop)."""
        if self.downloads is None:
            return e
        with contextlib.suppress(BaseException):
            self.downloads.close(ok=False)
        return self.downloads.first_error(e)

    def input_hashes(self, inputs: list[tuple[str, int]], read: dict[str, str]) -> dict[str, str]:
        """Verified against the Hub's LFS sha256 by the downloads (those of done shards: the Hub's), labelled."""
        from ..hashing import HUB_DIGEST, labelled  # (hashing imports the sources)

        return {f: labelled(HUB_DIGEST, self.hub.files[f].sha256) for f, _ in inputs} | (
            self.downloads.hashes() if self.downloads is not None else read)

    def stats(self, results: list) -> dict | None:
        """``PackStats.downloads``: this process's downloads, or the Ray tasks' (the sums; the peak and the bound:
        the largest task's; each task's figures with its node and folders)."""
        if self.downloads is not None:
            return dataclasses.asdict(self.downloads.stats)
        if not self.ray:
            return None
        tasks = [r.downloads for r in results if r.downloads]
        total = {k: sum(t[k] for t in tasks) for k in ("downloaded", "reused", "bytes", "resumed_bytes", "waited_s")}
        return {**total, "peak_scratch": max((t["peak_scratch"] for t in tasks), default=0),
                "bound": max((t["bound"] for t in tasks), default=0),
                "files": [f for t in tasks for f in t["files"]], "tasks": tasks}


# -- a Ray task's side --------------------------------------------------------------------------------


@dataclass(frozen=True)
class HubTask:
    """What a Hub-input task gets besides its job: its scratch bound, where its folder goes, where its
    shards go and whether it uploads them (``upload``: the target, token left out)."""

    bound: int  # --max-scratch for this task (checked by the driver against its job)
    root: str | None  # --scratch (the same node-local path on every node), None: the node's temporary folder
    tag: str  # the task folder's name (its first shard, the run's nonce): a re-run on the node finds its downloads
    upload: object  # upload.live.UploadTarget | None
    local_output: bool  # the shards in the task folder (--upload --no-keep-output), else in OUTPUT
    probe: str  # the nonce the driver wrote into OUTPUT/RAY_PROBE (checked where the shards go to OUTPUT)


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


def say_on_node(line: str) -> None:
    import sys

    print(line, file=sys.stderr)


class TaskStaging:
    """One attempt's downloads on a Ray node: its task folder (``in``: the downloads; ``out``: its shards with
    --upload --no-keep-output, else OUTPUT, whose probe it checks). ``threads``: its downloads at once
    (``Tuning.download_threads``)."""

    def __init__(self, hub: HubRepo, t: HubTask, units: list, output_dir: Path, threads: int):
        self.hub, self.t = hub, t
        self.folder = task_folder(hub, t)
        self.out = self.folder / "out" if t.local_output else output_dir
        if not t.local_output:
            check_probe(output_dir, t.probe)
        self.out.mkdir(parents=True, exist_ok=True)
        self.plan = scratch_plan(units, hub.files, hub.name)
        self.stop = threading.Event()
        self.downloads = Downloads(hub, self.folder / "in", t.bound, self.plan, self.stop, say_on_node, threads)

    def check_space(self, shard_sizes: list[int], queue: int) -> None:
        """The task folder's disk holds the scratch bound (or all the job downloads, if less) and, with the
        shards written there, the ones that may be there at once (``--no-keep-output``'s bound: the uploader's
        ``queue``, the one being sent and the one being written)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        need = min(self.t.bound, sum(n.size for n in self.plan.needs))
        if self.t.local_output:
            need += sum(sorted(shard_sizes, reverse=True)[: queue + 2])
        free = shutil.disk_usage(self.folder).free
        if need > free:
            raise ConvertError(f"{self.folder} (Ray node {socket.gethostname()}): the task needs up to "
                               f"{_human(need)} at once, {_human(free)} free; lower --max-scratch or free space")

    def start(self) -> FetchedHub:
        self.downloads.start()
        return FetchedHub(self.hub, self.downloads)

    def close(self, ok: bool) -> None:
        self.downloads.close(ok=ok)

    def failed(self, e: BaseException) -> BaseException:
        """No later run reads this run's task folder (but an interrupted one: kept); a download's error first."""
        if not isinstance(e, KeyboardInterrupt):
            shutil.rmtree(self.folder, ignore_errors=True)
        return self.downloads.first_error(e)

    def finish(self, shards: list[str]) -> tuple[dict[str, str], dict]:
        """A finished task leaves nothing (its records files were sent, its shards uploaded and deleted); returns
        the verified downloads' hashes and the scratch folder's figures."""
        if self.t.local_output:
            for f in shards:
                for p in (self.out / f, self.out / filenames.records_name(f)):
                    with contextlib.suppress(FileNotFoundError):
                        p.unlink()
            remove_empty(self.folder)
            with contextlib.suppress(OSError):
                self.folder.parent.rmdir()
        return self.downloads.hashes(), {**dataclasses.asdict(self.downloads.stats),
                                         "scratch": str(self.folder / "in"), "node": socket.gethostname(),
                                         "output": str(self.out)}
