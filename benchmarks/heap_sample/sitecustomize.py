"""What a pack's resident memory is made of, sampled every half second (issue 43: the released K3's peak against
its 2-shard base). Put this folder first on PYTHONPATH and set ``KC_HEAP_SAMPLE=PREFIX``: each ``kimi-convert pack``
process then writes ``PREFIX.PID`` (CSV) with its RssAnon and RssFile, glibc's heaps (``mallinfo2``: ``arena``, the
bytes its heaps span; ``hblkhd``, its blocks mapped on their own; ``fordblks``, the free bytes its heaps keep) and
the pipeline's own counters (bytes in flight, in the buffer pools, held by the file hashes), all in MiB:

    KC_HEAP_SAMPLE=/tmp/heap PYTHONPATH=benchmarks/heap_sample python benchmarks/whole_release.py --stop-after 900 ...

(``whole_release.py`` passes PYTHONPATH and the variable on to the pack it runs.) Not part of the tool."""

import os
import sys

if os.environ.get("KC_HEAP_SAMPLE") and "pack" in sys.argv:
    import ctypes
    import threading
    import time
    import weakref

    class _Mallinfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]

    _libc = ctypes.CDLL(None)
    _libc.mallinfo2.restype = _Mallinfo2
    _memories: weakref.WeakSet = weakref.WeakSet()

    from kimi_convert.pipeline import budgets

    _init = budgets.Memory.__init__

    def _registered(self, *args, **kwargs):
        _init(self, *args, **kwargs)
        _memories.add(self)

    budgets.Memory.__init__ = _registered

    def _rss() -> tuple[int, int]:
        got = {}
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("RssAnon", "RssFile")):
                    got[line.split(":")[0]] = int(line.split()[1]) >> 10
        return got.get("RssAnon", 0), got.get("RssFile", 0)

    def _sample(path: str) -> None:
        t0 = time.time()
        with open(path, "w") as f:
            f.write("t,rss_anon,rss_file,arena,hblkhd,fordblks,in_flight,pooled,held,threads\n")
            while True:
                time.sleep(0.5)
                m = _libc.mallinfo2()
                anon, file = _rss()
                mems = list(_memories)
                in_flight = sum(x.in_flight.held for x in mems) >> 20
                pooled = sum(x.buffers.pooled for x in mems) >> 20
                held = sum(x.hold.held for x in mems) >> 20
                f.write(f"{time.time() - t0:.1f},{anon},{file},{m.arena >> 20},{m.hblkhd >> 20},{m.fordblks >> 20},"
                        f"{in_flight},{pooled},{held},{threading.active_count()}\n")
                f.flush()

    threading.Thread(target=_sample, args=(f"{os.environ['KC_HEAP_SAMPLE']}.{os.getpid()}",), daemon=True).start()
