"""Named fault points for the kill-and-resume tests (tests/test_resume.py, scripts/fault_inject.py).

``KIMI_CONVERT_FAULT=NAME:N`` makes the process SIGKILL itself the N-th time it reaches point NAME
(``header``: mid-header; ``tensor``: mid-tensor; ``shard``: a shard renamed, not yet journaled;
``records``: mid-write of a shard's manifest records file (after ``shard``);
``journal``: mid-journal write; ``json``: mid-write of config, index or manifest; ``side``: mid-copy
of a side file; ``upload``: a shard on the Hub, not yet journaled; ``commit``: pack --upload's commit
made, before its remote check and the journal's removal; ``download``: a Hub input's file downloaded and
verified in the scratch folder, before the pipeline is told);
``NAME:N:pause`` makes it sleep there instead, for a test to deliver Ctrl-C at that exact point.
With ``KIMI_CONVERT_FAULT_ONCE=FILE`` too, only the first process to get there stops (it creates
FILE, holding its pid); the others go on: one Ray task killed, its retry let through (tests/test_ray.py).
Unset, a point costs one string comparison.
"""

from __future__ import annotations

import os
import signal
import threading

_NAME, _AT, _MODE = ([*os.environ.get("KIMI_CONVERT_FAULT", "").split(":"), "", ""])[:3]
_ONCE = os.environ.get("KIMI_CONVERT_FAULT_ONCE", "")
_hits: dict[str, int] = {}
_released = threading.Event()


def release() -> None:
    """End a pause (the pipeline is stopping: a paused background thread must not hold it up)."""
    _released.set()


def point(name: str) -> None:
    if name != _NAME:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] != int(_AT or 1):
        return
    if _ONCE:
        try:
            fd = os.open(_ONCE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
    if _MODE == "pause":
        _released.wait(3600)
    else:
        os.kill(os.getpid(), signal.SIGKILL)
