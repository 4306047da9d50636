"""Where the CPU kernels put their results: fresh tensors, or slices of a buffer the caller lends (an ``Arena``).

Why: a fresh output of a few MB is a fresh mapping (pack fixes glibc's mmap threshold at 1 MB so that freed memory
goes back to the system: ``pipeline.budgets.return_freed_memory``), and every 4 KB page of it faults on first
touch; 4.8 GB of output cost 2 M page faults and 4-6 s of system CPU (docs/history/RESULTS-history.md, session 6). The
pipeline lends each unit a buffer of its pool instead (reused, already touched), as it does for a GPU unit's
read-back (``compute.HostSink``), and takes it back once the writer has written and hashed the bytes.
"""

from __future__ import annotations

import math
from contextvars import ContextVar
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only where a tensor is made: the arena is carved before torch loads (compute_early)
    import numpy as np
    import torch

#: Each slice starts on a cache line (and so suits any dtype's alignment).
ALIGN = 64


class Arena:
    """``buf`` carved front to back into tensors; ``used``: bytes handed out, alignment included."""

    def __init__(self, buf: np.ndarray):
        self.buf, self.used = buf, 0

    def carve(self, nbytes: int) -> np.ndarray | None:
        """The next ``nbytes`` of the buffer (uint8), or None where they do not fit."""
        start = -(-self.used // ALIGN) * ALIGN
        if start + nbytes > self.buf.nbytes:
            return None
        self.used = start + nbytes
        return self.buf[start : start + nbytes]

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        import torch

        raw = self.carve(math.prod(shape) * dtype.itemsize)
        return None if raw is None else torch.from_numpy(raw).view(dtype).reshape(shape)


_ARENA: ContextVar[Arena | None] = ContextVar("kimi_convert_arena", default=None)


def use_arena(arena: Arena | None):
    """Make ``arena`` the buffer lent for this thread's unit: its CPU kernels' outputs are carved from it (and a
    GPU unit's read-backs, when it is a ``compute.HostSink``). A token for ``reset_arena``."""
    return _ARENA.set(arena)


def current() -> Arena | None:
    return _ARENA.get()


def reset_arena(token) -> None:
    _ARENA.reset(token)


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor: from this thread's arena while it has room, else a fresh one."""
    import torch

    arena = _ARENA.get()
    if arena is not None and (t := arena.empty(tuple(shape), dtype)) is not None:
        return t
    return torch.empty(shape, dtype=dtype)
