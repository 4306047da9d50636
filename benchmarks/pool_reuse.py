"""How many of a pack's buffers are fresh memory and how many the buffer pool reuses (issue 38, session 37).

    python benchmarks/pool_reuse.py INPUT OUTPUT [pack options...]

Runs ``kimi-convert pack INPUT OUTPUT`` in this process with ``readers.BufferPool`` counted: each ``get`` that made
a new buffer, by the function that asked (fresh pages: on this VM a first-touched page costs ~0.55 s of system CPU a
GB, benchmarks/fresh_pages.py) or took a free one, each ``put`` given back for reuse or not (a file hash keeps a view
of it), and the free bytes the end of the wave lets go; prints them as JSON on stderr, with the process's user and
system CPU seconds and peak RSS.
"""

from __future__ import annotations

import collections
import json
import resource
import sys

from kimi_convert import readers
from kimi_convert.cli import cli

COUNTS: collections.Counter = collections.Counter()


def _counted() -> None:
    get, put, clear = readers.BufferPool.get, readers.BufferPool.put, readers.BufferPool.clear

    def counted_get(self, n):
        free = {id(b) for b in self._free}
        buf = get(self, n)
        kind = ("reused" if id(buf) in free else "fresh") + f"_by_{sys._getframe(1).f_code.co_name}"
        COUNTS[kind] += 1
        COUNTS[f"{kind}_bytes"] += buf.nbytes
        return buf

    def counted_put(self, buf, reuse=True):
        COUNTS["put_for_reuse" if reuse else "put_not_reused"] += 1
        COUNTS["put_not_reused_bytes"] += 0 if reuse else buf.nbytes
        return put(self, buf, reuse)

    def counted_clear(self):
        COUNTS["let_go_at_wave_end_bytes"] += sum(b.nbytes for b in self._free)
        return clear(self)

    readers.BufferPool.get, readers.BufferPool.put, readers.BufferPool.clear = counted_get, counted_put, counted_clear


def main() -> int:
    _counted()
    try:
        cli(["pack", *sys.argv[1:], "-q"], standalone_mode=False)
    finally:
        use = resource.getrusage(resource.RUSAGE_SELF)
        out = {k: round(v / 1e9, 2) if k.endswith("_bytes") else v for k, v in sorted(COUNTS.items())}
        out |= {"user_s": round(use.ru_utime, 2), "sys_s": round(use.ru_stime, 2),
                "peak_rss_gb": round(use.ru_maxrss / 1e6, 2)}
        print(json.dumps(out), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
