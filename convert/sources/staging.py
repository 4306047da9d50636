"""How ``pack`` gets a source's bytes to the pipeline: the one seam between "where the input is" and "the run".

A local folder is read where it lies (``LocalStaging``: nothing to stage, the pipeline hashes the input files
from its own reads). A Hub repository's weight files are downloaded just in time within ``--max-scratch``
(``hubstage.HubStaging``, driving ``hubfetch.Downloads``); with ``--ray`` each task downloads its own job's
inputs on its node (``hubstage.TaskStaging``). ``pack`` asks the staging of its source, in the order of the
data flow, and never which kind of source it holds:

1. ``limits``: the workers and streams it may use (a Hub input: one stream, whose reads follow the downloads);
2. ``check_plan``: before the output folder is touched, the bounds the plan must fit (one line, no work lost);
3. ``start``: the source the jobs read (the downloads started);
4. ``close`` / ``failed``: the run ended, well or not (a download's error is the one reported);
5. ``input_hashes`` and ``stats``: the manifest's input digests and ``PackStats.downloads``.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ..errors import ConvertError
from .hub import HubRepo

if TYPE_CHECKING:
    from .protocol import Source


class Staging(Protocol):
    """What ``pack`` asks of a source's staging (module docstring)."""

    hashes_inputs: bool  # the pipeline hashes the input files from its reads (else the staging does)
    reads_ahead: bool  # the start-up readahead may read the input (it lies on a local disk)
    per_task: bool  # with --ray, each task stages its own inputs (and may upload its own shards)

    def limits(self, workers: int | None, streams: int | None) -> tuple[int | None, int | None]: ...

    def command(self, command: str | None, spec: object, output_dir: Path) -> str | None: ...

    def check_plan(self, units: list, resume: bool, task_units: Callable[[], Iterator[list]] | None) -> None: ...

    def start(self, units: list, todo: list, output_dir: Path, stop: threading.Event, started: bool) -> Source: ...

    def tasks(self, jobs: list, output_dir: Path, upload: object, token: str | None,
              local_output: bool) -> contextlib.AbstractContextManager: ...

    def close(self, ok: bool) -> None: ...

    def failed(self, e: BaseException) -> BaseException: ...

    def input_hashes(self, inputs: list[tuple[str, int]], read: dict[str, str]) -> dict[str, str]: ...

    def stats(self, results: list) -> dict | None: ...

    def origin(self) -> dict | None: ...


@dataclass
class LocalStaging:
    """A source read where it lies: nothing staged, no bound, the pipeline's own input hashes."""

    source: Source
    hashes_inputs: bool = True
    reads_ahead: bool = True
    per_task: bool = False

    def limits(self, workers: int | None, streams: int | None) -> tuple[int | None, int | None]:
        return workers, streams

    def command(self, command: str | None, spec: object, output_dir: Path) -> str | None:
        return command

    def check_plan(self, units: list, resume: bool, task_units: Callable[[], Iterator[list]] | None) -> None:
        return None

    def start(self, units: list, todo: list, output_dir: Path, stop: threading.Event, started: bool) -> Source:
        return self.source

    @contextlib.contextmanager
    def tasks(self, jobs: list, output_dir: Path, upload: object, token: str | None,
              local_output: bool) -> Iterator[tuple[list | None, dict[str, str] | None]]:
        yield None, None

    def close(self, ok: bool) -> None:
        return None

    def failed(self, e: BaseException) -> BaseException:
        return e

    def input_hashes(self, inputs: list[tuple[str, int]], read: dict[str, str]) -> dict[str, str]:
        return read

    def stats(self, results: list) -> dict | None:
        return None

    def origin(self) -> dict | None:
        return None


def staging_for(source: Source, output_dir: Path, scratch: str | os.PathLike | None, max_scratch: int | None,
                ray: bool, say: Callable[[str], None], download_threads: int) -> Staging:
    """The staging of ``source`` for a pack into ``output_dir``: a Hub repository's downloads (``hubstage``), else
    read in place (the one place a kind of source is told from another: a new source that stages its bytes adds
    its case here). ``--scratch`` / ``--max-scratch`` belong to a source that stages; any other refuses them in
    one line. ``download_threads``: a Hub input's downloads at once (``Tuning.download_threads``)."""
    if isinstance(source, HubRepo):  # (its downloads' module loaded only for a Hub input)
        from .hubstage import HubStaging

        return HubStaging(source, output_dir, scratch, max_scratch, ray, say, download_threads)
    if scratch is not None or max_scratch is not None:
        raise ConvertError(f"--{'scratch' if scratch is not None else 'max-scratch'} applies to a Hub input "
                           "(hf://OWNER/REPO) only")
    return LocalStaging(source)
