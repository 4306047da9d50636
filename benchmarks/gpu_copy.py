"""Host <-> GPU copy bandwidth (pinned and pageable) and where one large unit's compute time goes,
as pack runs it (``compute_unit`` on buffers read from disk).

    python benchmarks/gpu_copy.py [--mb 1024] [--checkpoint DIR]
"""

from __future__ import annotations

import argparse
import time

import torch


def bandwidth(n: int) -> None:
    dev = torch.device("cuda")
    g = torch.empty(n, dtype=torch.uint8, device=dev)
    for pinned in (True, False):
        h = torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
        h.fill_(1)
        for name, fn in (("H2D", lambda h=h: g.copy_(h)), ("D2H", lambda h=h: h.copy_(g))):
            fn()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            s = (time.perf_counter() - t) / 5
            print(f"{name} {'pinned' if pinned else 'pageable'}: {n / s / 1e9:.1f} GB/s")


def unit_breakdown(src: str) -> None:
    from kimi_convert.compute import compute_unit
    from kimi_convert.kernels import get_backend
    from kimi_convert.pack import load_plan
    from kimi_convert.plan import Options, fp8_block_size
    from kimi_convert.readers import Loaded, PreadReader

    ckpt, plan = load_plan(src, Options())
    backend = get_backend("cuda")
    block = fp8_block_size(ckpt.config)
    reader = PreadReader(ckpt.source)
    units = [u for u in plan.units if any(it.kind == "nvfp4" for it in u.items)]
    for pinned in (True, False):
        total = h2d = nbytes = 0.0
        for u in units:
            bufs = {p.name: reader.read(p) for p in u.parts}
            if pinned:
                bufs = {k: torch.from_numpy(b).pin_memory().numpy() for k, b in bufs.items()}
            torch.cuda.synchronize()
            t = time.perf_counter()
            for p in u.parts:
                torch.from_numpy(bufs[p.name]).to("cuda")
            torch.cuda.synchronize()
            h2d += time.perf_counter() - t
            t = time.perf_counter()
            compute_unit(u, Loaded(bufs), backend, block)
            total += time.perf_counter() - t
            nbytes += u.nbytes_in
        print(f"{len(units)} NVFP4 units, {nbytes / 1e9:.2f} GB, {'pinned' if pinned else 'pageable'} sources: "
              f"compute_unit {total:.2f} s ({nbytes / total / 1e9:.2f} GB/s); their H2D copies alone {h2d:.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=1024)
    ap.add_argument("--checkpoint")
    a = ap.parse_args()
    bandwidth(a.mb << 20)
    if a.checkpoint:
        unit_breakdown(a.checkpoint)


if __name__ == "__main__":
    main()
