"""Where a GPU unit's time goes: the same units computed on the CPUs (C kernels), on the GPU the way pack
did before issue 14 item 5 (pageable buffers, torch's default stream, a blocking read-back a tensor), and the
way it does now (``pipeline.runner``: page-locked pool buffers, asynchronous copies, one read-back a unit, a
CUDA stream of its own). One thread, sources already in memory, no hashing or writing: the compute stage
alone, per kind of work (``pipeline.choose.work_kind``).

    python benchmarks/gpu_unit_copies.py CHECKPOINT [--units 12]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path


def _timed(n: int, nbytes: int, fn) -> float:
    """Seconds per GB of ``fn(1) ... fn(n - 1)``, after ``fn(0)`` untimed (warm-up)."""
    import torch

    fn(0)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(1, n):
        fn(i)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / nbytes * 1e9


def main() -> None:

    from kimi_convert.compute import compute_unit
    from kimi_convert.kernels import get_backend
    from kimi_convert.pack import load_plan
    from kimi_convert.pipeline.choose import work_kind
    from kimi_convert.pipeline.runner import Runner
    from kimi_convert.plan import Options, fp8_block_size
    from kimi_convert.readers import BufferPool, Loaded, PreadReader

    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--units", type=int, default=12, help="units per kind of work (the first is a warm-up)")
    a = ap.parse_args()
    src = Path(a.checkpoint)
    ckpt, plan = load_plan(src, Options())
    block = fp8_block_size(ckpt.config)
    kinds: dict[str, list] = defaultdict(list)
    for u in plan.units:
        k = work_kind(u)
        if k and len(kinds[k]) < a.units:
            kinds[k].append(u)
    reader = PreadReader(src)
    cpu, cuda = get_backend("cpu"), get_backend("cuda")
    pool = BufferPool(limit=8 << 30)
    runner = Runner({"cuda": cuda}, pool, block)
    print(f"{src.name}: {len(plan.units)} units; CPU threads {cpu.threads}; seconds per GB of input, "
          "first unit of each kind untimed")
    print("\n| kind of work | units | MB | cpu (C) s/GB | cuda before s/GB | cuda now s/GB | now vs before |")
    print("|---|---|---|---|---|---|---|")
    for k, units in sorted(kinds.items()):
        if len(units) < 2:
            continue
        plain = [Loaded({p.name: reader.read(p) for p in u.parts}) for u in units]
        pinned = []
        for u in units:
            base, off, bufs = pool.get(u.nbytes_in), 0, {}
            for p in u.parts:
                bufs[p.name] = reader.read(p, into=base[off : off + p.nbytes])
                off += p.nbytes
            pinned.append(Loaded(bufs))
        nbytes = sum(u.nbytes_in for u in units[1:])
        c = _timed(len(units), nbytes, lambda i, u=units, p=plain: compute_unit(u[i], p[i], cpu, block))
        before = _timed(len(units), nbytes, lambda i, u=units, p=plain: compute_unit(u[i], p[i], cuda, block))
        now = _timed(len(units), nbytes, lambda i, u=units, p=pinned: runner.release(runner.compute(u[i], p[i])))
        print(f"| {k} | {len(units) - 1} | {nbytes / 1e6:.0f} | {c:.3f} | {before:.3f} | {now:.3f} | "
              f"{before / now:.2f}x |", flush=True)
    print(f"\npage-locking: {pool.pinned_bytes / 1e9:.2f} GB in {pool.pin_s:.2f} s")
    pool.unpin_all()


if __name__ == "__main__":
    main()
