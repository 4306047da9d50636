"""A stream's progress sampled in time, for ``pack --stats`` (``stream_timelines``).

The stages' summed seconds (``stages_s``) say how long each stage worked or waited, not when: a chain that idles
two seconds at the start and one that idles in short spells all through sum alike, and call for different fixes.
A timeline samples the stream's counters (bytes read, bytes its input files' digest chains have hashed, bytes
stored by the writer, the worker's bytes in flight, in its buffer pool and held by its file hashes) every ``every_s``
on a thread of its own, and halves its rows (doubling the interval) whenever it holds more than ``limit``: a long pack
keeps a bounded, evenly spaced record.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

COLUMNS = ("s", "read", "hashed", "stored", "in_flight", "pooled", "held")


@dataclass
class Timeline:
    """Rows of (seconds since the start, then ``probe()``'s counters), every ``every_s`` at first."""

    probe: Callable[[], tuple[int, ...]]
    every_s: float = 0.1
    limit: int = 512
    rows: list[list[float]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kimi-convert-timeline")
        self._thread.start()

    def stop(self) -> dict:
        """Ends the sampling (with a last row) and gives ``{"columns": [...], "rows": [...]}``."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._sample()
        return {"columns": list(COLUMNS), "every_s": self.every_s, "rows": self.rows}

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()
            if len(self.rows) > self.limit:
                self.rows = self.rows[::2]
                self.every_s *= 2

    def _sample(self) -> None:
        self.rows.append([round(time.perf_counter() - self._t0, 3), *self.probe()])
