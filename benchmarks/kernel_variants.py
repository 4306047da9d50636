"""Time the Triton kernel's variants on the GPU (tiles, warps, the cost of the exact division).

    python benchmarks/kernel_variants.py

Prints one table; each row is the median of triton.testing.do_bench over 8 rotated inputs.
The EXACT_DIV=False rows are for measurement only: they multiply by a reciprocal and are not bit-exact.
"""

from __future__ import annotations

from functools import partial

import torch
import triton
import triton.testing as tt

from kimi_convert.kernels import nvfp4_triton as T


def bench(fn, ws) -> float:
    state = {"i": 0}

    def step():
        state["i"] += 1
        fn(ws[state["i"] % len(ws)])
    return tt.do_bench(step, warmup=30, rep=300, return_mode="median")


def copy_bw() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (tt.do_bench(lambda: dst.copy_(src), rep=300, return_mode="median") * 1e-3)


def amax_generic(w, amax):
    T._amax_kernel[(triton.cdiv(w.numel(), T.AMAX_TILE[0]),)](w.reshape(-1), w.numel(), amax, 1, BLOCK=T.AMAX_TILE[0])


def amax_pairs(w, amax, block):
    p = w.reshape(-1).view(torch.int32)
    T._amax_bf16_kernel[(triton.cdiv(p.numel(), block),)](p, p.numel(), amax.view(torch.int32), 1, BLOCK=block)


def quant_generic(w, amax, packed, scales):
    n, k = w.shape
    grid = (triton.cdiv(n, T.BLOCK_M), triton.cdiv(k, T.BLOCK_K))
    T._quant_kernel[grid](w, amax, packed, scales, n, k, BLOCK_M=T.BLOCK_M, BLOCK_K=T.BLOCK_K)


def quant_bf16(w, amax, packed, scales, bm, bb, warps, exact):
    n, k = w.shape
    grid = (triton.cdiv(n, bm), triton.cdiv(k // 16, bb))
    T._quant_bf16_kernel[grid](w.view(torch.int32), amax, packed, scales, n, k, BLOCK_M=bm, BLOCK_B=bb,
                               EXACT_DIV=exact, ORDER=0, num_warps=warps, enable_fp_fusion=False)


TILES = ((16, 16, 4), (32, 16, 4), (32, 16, 8), (64, 8, 4), (16, 32, 4), (8, 32, 2), (64, 16, 8), (32, 32, 8))


def main() -> None:
    bw = copy_bw()
    print(f"copy {bw / 1e12:.2f} TB/s")
    rows = []
    for n, k in ((3072, 7168), (32768, 7168)):
        ws = [torch.randn(n, k, device="cuda").to(torch.bfloat16) for _ in range(8)]
        amax = torch.zeros(1, device="cuda")
        T.amax_into(ws[0], amax)
        packed = torch.empty(n, k // 2, dtype=torch.uint8, device="cuda")
        scales = torch.empty(n, k // 16, dtype=torch.uint8, device="cuda")
        read_floor = n * k * 2 / bw * 1e3  # one read of the input, at half the copy's read+write rate
        quant_floor = (n * k * 2 + n * k // 2 + n * k // 16) / bw * 1e3
        shape = f"{n}x{k}"
        rows.append((shape, "amax generic", bench(partial(amax_generic, amax=amax), ws), read_floor))
        for block in (4096, 8192, 16384):
            rows.append((shape, f"amax bf16 pairs BLOCK={block}",
                         bench(partial(amax_pairs, amax=amax, block=block), ws), read_floor))
        rows.append((shape, "quant generic 32x256 w4",
                     bench(partial(quant_generic, amax=amax, packed=packed, scales=scales), ws), quant_floor))
        for bm, bb, warps in TILES:
            for exact in (True, False) if (bm, bb, warps) == TILES[0] else (True,):
                fn = partial(quant_bf16, amax=amax, packed=packed, scales=scales, bm=bm, bb=bb, warps=warps,
                             exact=exact)
                name = f"quant bf16 {bm}x{bb * 16} w{warps}" + ("" if exact else " NOT EXACT (multiply)")
                rows.append((shape, name, bench(fn, ws), quant_floor))
    print("| shape | variant | ms | floor of this pass ms | ratio |")
    print("|---|---|---|---|---|")
    for shape, name, ms, floor in rows:
        print(f"| {shape} | {name} | {ms:.4f} | {floor:.4f} | {ms / floor:.2f}x |")


if __name__ == "__main__":
    main()
