"""How many read buffers one pack makes new (each a page fault and a zeroed page per 4 KB on first touch) and how
many it gives back unreusable: ``readers.BufferPool.get`` / ``put`` wrapped around one ``kimi-convert`` command.

    python benchmarks/pool_allocations.py pack DIR OUT -q --device cpu --overwrite

Run it with the ``python`` of the tree to measure (its editable install); the counts go to stderr at the end."""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field


@dataclass
class Counts:
    gets: int = 0
    new: int = 0
    new_bytes: int = 0
    unreusable: int = 0
    unreusable_bytes: int = 0
    seen: dict[int, weakref.ref] = field(default_factory=dict)  # id -> the buffer (an id may be reused once freed)

    def line(self) -> str:
        return (f"buffers handed out {self.gets}, new {self.new} ({self.new_bytes / 1e9:.2f} GB), given back "
                f"unreusable {self.unreusable} ({self.unreusable_bytes / 1e9:.2f} GB)")


def wrap(counts: Counts) -> None:
    from kimi_convert import readers

    get, put = readers.BufferPool.get, readers.BufferPool.put

    def counted_get(self, n):
        buf = get(self, n)
        counts.gets += 1
        ref = counts.seen.get(id(buf))
        if ref is None or ref() is not buf:
            counts.seen[id(buf)] = weakref.ref(buf)
            counts.new += 1
            counts.new_bytes += buf.nbytes
        return buf

    def counted_put(self, buf, reuse=True):
        if not reuse:
            counts.unreusable += 1
            counts.unreusable_bytes += buf.nbytes
        return put(self, buf, reuse)

    readers.BufferPool.get, readers.BufferPool.put = counted_get, counted_put


def main() -> None:
    from kimi_convert.cli import main as cli

    counts = Counts()
    wrap(counts)
    sys.argv = ["kimi-convert", *sys.argv[1:]]
    try:
        cli()
    finally:
        print(counts.line(), file=sys.stderr)


if __name__ == "__main__":
    main()
