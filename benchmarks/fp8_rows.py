"""A block FP8 weight quantized to NVFP4 on the CPU's C kernels, two ways, in one process and in turn (issue 38,
DeepSeek V3.2's experts): decoded whole to fp32 by numpy and quantized (the steps ``compute_early`` ran up to session
24: an e4m3 table lookup, a multiply a 128-row band, ``kc_amax_f32_mt`` and ``kc_quant_f32_mt``, the latter now with
session 25's AVX-512 row), and quantized from its codes a row at a time (``kc_fp8_amax_mt`` / ``kc_fp8_quant_mt``,
session 25). Checks that both give the same bytes.

    python benchmarks/fp8_rows.py [--rows 2048] [--cols 7168] [--weights 4] [--reps 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from kimi_convert.kernels import clib, scales


def e4m3_table() -> np.ndarray:
    b = np.arange(256, dtype=np.uint32)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, (b & 7).astype(np.float64)
    mag = np.where(exp == 0, man / 8 * 2.0 ** -6, (1 + man / 8) * 2.0 ** (exp.astype(np.float64) - 7))
    out = (sign * mag).astype(np.float32)
    out[(b & 0x7F) == 0x7F] = np.nan
    return out


def whole(lib, codes, sc, block, threads, table):
    m, k = codes.shape
    v = table[codes]
    for i in range(sc.shape[0]):
        v[i * block[0]:(i + 1) * block[0]] *= np.repeat(sc[i], block[1])[:k]
    amax = float(np.array(clib.amax_bits(lib, v.ctypes.data, v.size, True, threads), dtype=np.uint32).view(np.float32))
    p, s = np.empty(m * k // 2, np.uint8), np.empty(m * k // 16, np.uint8)
    clib.quant(lib, v.ctypes.data, m, k, True, scales.modelopt(amax), p.ctypes.data, s.ctypes.data, threads)
    return p, s


def rows(lib, codes, sc, block, threads, _table):
    m, k = codes.shape
    bits = clib.fp8_amax_bits(lib, codes.ctypes.data, sc.ctypes.data, m, k, block, threads)
    amax = float(np.array(bits, dtype=np.uint32).view(np.float32))
    p, s = np.empty(m * k // 2, np.uint8), np.empty(m * k // 16, np.uint8)
    clib.fp8_quant(lib, codes.ctypes.data, sc.ctypes.data, m, k, block, False, scales.modelopt(amax), p.ctypes.data,
                   s.ctypes.data, threads)
    return p, s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=7168)
    ap.add_argument("--weights", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    block = (128, 128)
    ws = []
    for _ in range(a.weights):
        codes = rng.integers(0, 256, (a.rows, a.cols), dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x40
        sc = (rng.random((-(-a.rows // 128), -(-a.cols // 128)), dtype=np.float32) * 1e-3 + 1e-4)
        ws.append((codes, np.ascontiguousarray(sc)))
    lib, table = clib.load(), e4m3_table()
    for c, s in ws[:1]:
        (p0, s0), (p1, s1) = whole(lib, c, s, block, a.threads, table), rows(lib, c, s, block, a.threads, table)
        assert p0.tobytes() == p1.tobytes() and s0.tobytes() == s1.tobytes(), "the two ways differ"
    gb = sum(c.nbytes for c, _ in ws) / 1e9
    times: dict[str, list[float]] = {"whole": [], "rows": []}
    for _ in range(a.reps):
        for name, fn in (("whole", whole), ("rows", rows)):
            t = time.perf_counter()
            for c, s in ws:
                fn(lib, c, s, block, a.threads, table)
            times[name].append(time.perf_counter() - t)
    print(f"{a.weights} weights of {a.rows} x {a.cols} FP8 codes ({gb:.2f} GB), {a.threads} threads, load "
          f"{os.getloadavg()[0]:.1f}; the same bytes both ways")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name}: median {med:.3f} s ({gb / med:.2f} GB/s of codes), all {', '.join(f'{t:.3f}' for t in ts)}")
    print(f"rows / whole: {statistics.median(times['rows']) / statistics.median(times['whole']):.3f}")


if __name__ == "__main__":
    main()
