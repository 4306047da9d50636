"""Time the Triton kernel's variants on the GPU (tiles, warps, the cost of the exact division).

    python benchmarks/kernel_variants.py

Prints one table; each row is the median of triton.testing.do_bench over 8 rotated inputs.
The EXACT_DIV=False rows are for measurement only: they multiply by a reciprocal and are not bit-exact.
"""

from __future__ import annotations

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


def main() -> None:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    bw = 2 * src.numel() / (tt.do_bench(lambda: dst.copy_(src), rep=300, return_mode="median") * 1e-3)
    del src, dst
    print(f"copy {bw / 1e12:.2f} TB/s")
    rows = []
    for n, k in ((3072, 7168), (32768, 7168)):
        ws = [torch.randn(n, k, device="cuda").to(torch.bfloat16) for _ in range(8)]
        amax = torch.zeros(1, device="cuda")
        T.amax_into(ws[0], amax)
        read_ms = n * k * 2 / bw * 2 * 1e3  # one read of the input at copy speed (read-only ~ half a copy)
        packed = torch.empty(n, k // 2, dtype=torch.uint8, device="cuda")
        scales = torch.empty(n, k // 16, dtype=torch.uint8, device="cuda")

        def amax_generic(w):
            T._amax_kernel[(triton.cdiv(w.numel(), T.BLOCK_AMAX),)](w.reshape(-1),
                                                                   w.numel(), amax, BLOCK=T.BLOCK_AMAX)
        rows.append((f"{n}x{k}", "amax generic (fp32 compare)", bench(amax_generic, ws), read_ms / 2))
        for block in (4096, 8192, 16384):
            def amax_pairs(w, block=block):
                p = w.reshape(-1).view(torch.int32)
                T._amax_bf16_kernel[(triton.cdiv(p.numel(), block),)](p, p.numel(), amax.view(torch.int32), BLOCK=block)
            rows.append((f"{n}x{k}", f"amax bf16 pairs BLOCK={block}", bench(amax_pairs, ws), read_ms / 2))

        def quant_generic(w):
            grid = (triton.cdiv(n, T.BLOCK_M), triton.cdiv(k, T.BLOCK_K))
            T._quant_kernel[grid](w, amax, packed, scales, n, k, BLOCK_M=T.BLOCK_M, BLOCK_K=T.BLOCK_K)
        floor_q = (n * k * 2 + n * k // 2 + n * k // 16) / bw * 1e3
        rows.append((f"{n}x{k}", "quant generic 32x256 w4", bench(quant_generic, ws), floor_q))
        for bm, bb, warps in ((16, 16, 4), (32, 16, 4), (32, 16, 8), (64, 8, 4), (16, 32, 4), (8, 32, 2),
                              (64, 16, 8), (32, 32, 8)):
            for exact in (True, False):
                def quant(w, bm=bm, bb=bb, warps=warps, exact=exact):
                    grid = (triton.cdiv(n, bm), triton.cdiv(k // 16, bb))
                    T._quant_bf16_kernel[grid](w.view(torch.int32), amax, packed, scales, n, k, BLOCK_M=bm,
                                               BLOCK_B=bb, EXACT_DIV=exact, num_warps=warps)
                if not exact and (bm, bb, warps) != (16, 16, 4):
                    continue
                name = f"quant bf16 {bm}x{bb * 16} w{warps}" + ("" if exact else " NOT EXACT (multiply)")
                rows.append((f"{n}x{k}", name, bench(quant, ws), floor_q))
        del ws
    print("| shape | variant | ms | floor of this pass ms | ratio |")
    print("|---|---|---|---|---|")
    for shape, name, ms, floor in rows:
        print(f"| {shape} | {name} | {ms:.4f} | {floor:.4f} | {ms / floor:.2f}x |")


if __name__ == "__main__":
    main()
