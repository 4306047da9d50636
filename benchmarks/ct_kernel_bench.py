"""compressed-tensors' NVFP4 of one expert-sized BF16 weight: the C kernel (``nvfp4_cpu.c: kc_ct_quant_mt``)
against the torch steps (``kernels/src/ct_nvfp4.py``, the peer's own operations); checks they give the same bytes.

    python benchmarks/ct_kernel_bench.py [--rows 3072] [--cols 7168] [--repeat 3]
"""

from __future__ import annotations

import argparse
import time

import torch

from kimi_convert.devices import get_backend
from kimi_convert.kernels import ct_nvfp4


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=3072)
    ap.add_argument("--cols", type=int, default=7168)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    w = (torch.randn(a.rows, a.cols, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    g = ct_nvfp4.global_scale(w.abs().amax().float(), w.dtype)
    backend = get_backend("cpu")
    p1, s1 = ct_nvfp4.quantize(w, g)
    p2, s2 = backend.quantize_ct(w, g)
    same = torch.equal(p1, p2) and torch.equal(s1.view(torch.uint8), s2.view(torch.uint8))
    tc = best(lambda: backend.quantize_ct(w, g), a.repeat)
    tt = best(lambda: ct_nvfp4.quantize(w, g), a.repeat)
    gb = w.numel() * 2 / 1e9
    print(f"{a.rows}x{a.cols} bf16, {backend.threads} threads: C {tc:.3f} s ({gb / tc:.2f} GB/s), torch steps "
          f"{tt:.3f} s ({gb / tt:.3f} GB/s): {tt / tc:.0f}x; same bytes: {same}")


if __name__ == "__main__":
    main()
