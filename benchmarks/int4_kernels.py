"""Kimi K2.5's INT4 experts through the C kernels (issue 38, session 36): ``kc_int4_amax_mt`` (the amax pass) and
``kc_int4_quant_mt`` (NVFP4 from the codes), timed on random codes and scales of an expert bank's shape, with a digest
of the bytes (the same digest from two checkouts: the same output).

    python benchmarks/int4_kernels.py [--rows 4096] [--k 7168] [--group 32] [--threads 2] [--repeat 7]

Run it once per checkout (``PYTHONPATH=DIR`` whose ``kimi_convert`` links that checkout's ``convert/``): each builds
its own kernel library (``clib`` caches one per source). Prints the medians, GB/s of the BF16 weight they stand for.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time

import numpy as np

from kimi_convert.kernels import clib, scales


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--k", type=int, default=7168)
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args()
    lib, rng = clib.load(), np.random.default_rng(0)
    n, k, groups = a.rows, a.k, a.k // a.group
    codes = rng.integers(0, 256, n * k // 2, dtype=np.uint8)
    sc = (rng.standard_normal((n, groups)) * 1e-2).astype(np.float32)
    packed, block = np.zeros(n * k // 2, np.uint8), np.zeros(n * k // 16, np.uint8)
    amax_s, quant_s = [], []
    for _ in range(a.repeat):
        t = time.perf_counter()
        bits = clib.int4_amax_bits(lib, codes.ctypes.data, sc.ctypes.data, n, k, groups, a.threads)
        amax_s.append(time.perf_counter() - t)
        s2 = scales.modelopt(float(np.array(bits, dtype=np.uint32).view(np.float32)))
        t = time.perf_counter()
        clib.int4_quant(lib, codes.ctypes.data, sc.ctypes.data, n, k, groups, False, s2, packed.ctypes.data,
                        block.ctypes.data, a.threads)
        quant_s.append(time.perf_counter() - t)
    am, qm = statistics.median(amax_s), statistics.median(quant_s)
    gb = n * k * 2 / 1e9
    digest = hashlib.sha256(packed.tobytes() + block.tobytes()).hexdigest()[:16]
    print(f"{n} x {k} INT4 (group {a.group}), {a.threads} threads, median of {a.repeat}: amax {am * 1e3:.1f} ms, "
          f"quantize {qm * 1e3:.1f} ms, both {gb / (am + qm):.2f} GB/s of BF16; amax bits {bits:#x}, bytes {digest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
