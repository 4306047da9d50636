"""Where the C recipe kernels' time goes on many cores (issue 14): dispatch, thread scaling, fresh outputs, stores.

    python benchmarks/cpu_pool_probe.py            # threads up to every core (KIMI_CONVERT_THREADS overrides)

1. Dispatch alone: an empty C task run on every thread, the way the kernels were split before (a Python
   ThreadPoolExecutor mapping one ctypes call a thread) and now (one ctypes call; the library's pthread pool).
2. Each kernel (preallocated outputs, touched once before: no page faults in the timing; inputs rotated past the
   last-level cache) at 1, 2, 4, ... threads: wall ms, GB/s of its floor bytes, CPU seconds a call (user + sys).
3. At every thread: the whole call (fresh outputs, as the pipeline allocates them: glibc maps blocks above 32 MB
   afresh each time, so every page of such an output faults) against preallocated ones, and the codes stored
   plainly against non-temporally (``recipe_cpu.STREAM_MIN_BYTES``).
Medians of repeated calls; the copy bandwidth that defines the floor is measured first, as recipe_kernels.py does.
"""

from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from recipe_kernels import (  # benchmarks/ is sys.path[0] when run as a script
    bf16_input,
    cast_bytes,
    copy_bandwidth_cpu,
    fp8_bytes,
    mx_inputs,
    nvfp4_bytes,
    rotation,
)

from kimi_convert.devices import cpus
from kimi_convert.kernels import fp8_block, mxfp4_cast, nvfp4_cpu, recipe_cpu, reference

THREADS = cpus()


def timed(fn, reps: int) -> tuple[float, float]:
    """(median wall s, median CPU s of the process) a call."""
    fn()
    walls, cpus_ = [], []
    for _ in range(reps):
        c, t = time.process_time(), time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t)
        cpus_.append(time.process_time() - c)
    return statistics.median(walls), statistics.median(cpus_)


def dispatch(lib) -> None:
    print("1. dispatch of an empty task on every thread (us a call)")
    for threads in sorted({1, 2, 4, 8, THREADS}):
        if threads > THREADS:
            continue
        pool = ThreadPoolExecutor(max_workers=threads)
        old, _ = timed(lambda p=pool, n=threads: list(p.map(lambda _: lib.kc_pool_nop(1, 1), range(n))), 2000)
        new, _ = timed(lambda n=threads: lib.kc_pool_nop(4 * n, n), 2000)
        pool.shutdown()
        print(f"   threads {threads:3d}: Python pool of ctypes calls {old * 1e6:8.1f} us | one call, C pool "
              f"{new * 1e6:8.1f} us", flush=True)


def kernels(lib, nlib) -> list[tuple[str, int, list, callable, callable]]:
    """(label, floor bytes, inputs, into(a, threads), whole(a, threads))."""
    def mx(i):
        p, sc = mx_inputs(3072, 3584, i)
        own = mxfp4_cast.k_max(sc)
        return p, sc, own, torch.zeros_like(p), torch.zeros((3072, 448), dtype=torch.uint8)

    def f8(i):
        return bf16_input(7168, 7168, i), torch.zeros((7168, 7168), dtype=torch.uint8), torch.zeros(
            fp8_block.scale_shape(7168, 7168))

    def nv_into(x, threads, out):
        s2 = reference.global_scale(nvfp4_cpu.amax(nlib, x, threads))
        nlib.kc_quant_bf16_mt(x.data_ptr(), x.shape[0], x.shape[1], float(s2), out[0].data_ptr(), out[1].data_ptr(),
                              threads)

    nv_out = (torch.zeros((3072, 3584), dtype=torch.uint8), torch.zeros((3072, 448), dtype=torch.uint8))
    return [
        ("cast expert 3072x7168", cast_bytes(3072, 3584), rotation(mx, cast_bytes(3072, 3584)),
         lambda a, t: recipe_cpu.cast_into(lib, a[0], a[1], a[2], a[2], a[3], a[4], t),
         lambda a, t: recipe_cpu.cast(lib, a[0], a[1], a[2], a[2], t)),
        ("fp8-block 7168x7168", fp8_bytes(7168, 7168), rotation(f8, fp8_bytes(7168, 7168)),
         lambda a, t: recipe_cpu.fp8_into(lib, *a, threads=t), lambda a, t: recipe_cpu.fp8_quantize(lib, a[0], t)),
        ("nvfp4 3072x7168", nvfp4_bytes(3072, 7168),
         rotation(lambda i: bf16_input(3072, 7168, i), nvfp4_bytes(3072, 7168)),
         lambda x, t: nv_into(x, t, nv_out),
         lambda x, t: nvfp4_cpu.quantize(nlib, x, reference.global_scale(nvfp4_cpu.amax(nlib, x, t)), t)),
    ]


def main() -> None:
    lib, nlib = recipe_cpu.load(), nvfp4_cpu.load()
    torch.set_num_threads(THREADS)
    bw = copy_bandwidth_cpu()
    print(f"CPU copy {bw / 1e9:.2f} GB/s (read + write), {THREADS} threads, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    dispatch(lib)
    ks = kernels(lib, nlib)
    print("2. threads: wall ms, GB/s of the floor bytes, CPU s a call (preallocated outputs)")
    counts = [t for t in (1, 2, 4, 8, 16, 32, 64) if t < THREADS] + [THREADS]
    for label, nbytes, ins, into, _ in ks:
        state = {"i": 0}
        for t in counts:
            def step(into=into, ins=ins, t=t, state=state):
                state["i"] += 1
                into(ins[state["i"] % len(ins)], t)
            wall, cpu = timed(step, 7)
            print(f"   {label:24s} threads {t:3d}: {wall * 1e3:8.2f} ms {nbytes / wall / 1e9:7.2f} GB/s "
                  f"= {wall / (nbytes / bw):5.2f}x floor | CPU {cpu * 1e3:8.2f} ms", flush=True)
    print(f"3. at {THREADS} threads: whole call (fresh outputs) and plain stores against preallocated, streamed")
    for label, nbytes, ins, into, whole in ks:
        state = {"i": 0}

        def run(fn, ins=ins, state=state):
            state["i"] += 1
            fn(ins[state["i"] % len(ins)], THREADS)
        rows = [("preallocated", lambda into=into: run(into)), ("whole call", lambda whole=whole: run(whole))]
        if not label.startswith("nvfp4"):
            def plain(into=into):
                recipe_cpu.STREAM_MIN_BYTES = 1 << 62
                try:
                    run(into)
                finally:
                    recipe_cpu.STREAM_MIN_BYTES = 8 << 20
            rows.append(("preallocated, plain stores", plain))
        for name, fn in rows:
            wall, cpu = timed(fn, 9)
            print(f"   {label:24s} {name:28s} {wall * 1e3:8.2f} ms = {wall / (nbytes / bw):5.2f}x floor | "
                  f"CPU {cpu * 1e3:8.2f} ms", flush=True)


if __name__ == "__main__":
    main()
