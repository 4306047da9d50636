"""NVFP4 quantization in Triton: one pass for the amax, one pass that quantizes and packs.

Bit-identical to ``reference``: the divisions are ``div_rn`` (Triton's ``/`` on fp32 is not
correctly rounded), and the e4m3 rounding of the block scales is done in integer/exact arithmetic
rather than by a conversion instruction, so the GPU and the interpreter (``TRITON_INTERPRET=1``,
used by CI on CPU tensors) compute the same bytes.

Fused modules: the caller takes the amax of each member (``amax`` accumulates into one cell) and
quantizes each member into its rows of the output, so the concatenation is never materialised.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch
import triton
import triton.language as tl

BLOCK_M = 32
BLOCK_K = 256
#: bf16 kernel tile: rows, blocks of 16 values, warps (chosen by benchmarks/recipe_kernels.py --variants on the H200)
BF16_TILE = (4, 16, 1)
#: amax: values (bf16 pairs) a step, at most this many programs (one atomic each; 0: no bound, one step a program),
#: warps. One step a program measured faster on the H200 than at most 512 programs of several steps (1.41x against
#: 1.48x of the floor at 32768x7168, zero + amax + quantize; docs/history/RESULTS-history.md, issue 14 second pass)
AMAX_TILE = (8192, 0, 4)


@triton.jit
def _amax_kernel(x_ptr, n, out_ptr, ITERS, BLOCK: tl.constexpr):
    """max(out, amax|x|) over ITERS consecutive chunks of BLOCK values a program (any float dtype; NaN / Inf give
    inf): one atomic a program, not one a chunk."""
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * ITERS * BLOCK
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        a = tl.abs(tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32))
        acc = tl.maximum(acc, tl.where(a != a, float("inf"), a))
    tl.atomic_max(out_ptr, tl.max(acc, axis=0))


@triton.jit
def e4m3_rne(sb):
    """Round fp32 sb in [2^-9, 448] to e4m3 (ties to even): (value as fp32, e4m3 byte)."""
    e = ((sb.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)
    q = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # the step of e4m3 at this exponent
    inv_q = ((127 - (e - 3)) << 23).to(tl.float32, bitcast=True)
    y = sb * inv_q  # exact: a power-of-two scaling, y in [1, 16)
    r = (y + 8388608.0) - 8388608.0  # round to integer, ties to even
    v = r * q  # exact
    byte = tl.where(v >= 0.015625, (v.to(tl.int32, bitcast=True) >> 20) - (120 << 3), r.to(tl.int32))
    return v, byte


@triton.jit
def e2m1_mag(a):
    """E2M1 magnitude code (0..7) of fp32 a = |x|: nearest value, ties to even, saturating at 6.

    Rounds to the quantum of a's range (0.5 below 2, 1 below 4, 2 above) by adding and removing
    2^22, 2^23 or 2^24 (an fp32 add rounds to nearest even), then maps the rounded value to its code.
    Exact for every fp32 input; NaN gives 7, as in the reference's comparison chain.
    """
    small = a < 2.0
    mid = a < 4.0
    c = tl.where(small, 4194304.0, tl.where(mid, 8388608.0, 16777216.0))
    r = (a + c) - c
    f = tl.where(small, r * 2.0, tl.where(mid, r + 2.0, r * 0.5 + 4.0))
    return tl.where(f < 7.0, f, 7.0).to(tl.int32)


@triton.jit
def _e2m1(xs):
    """E2M1 code, sign in bit 3 (set when xs < 0, as in the reference)."""
    return e2m1_mag(tl.abs(xs)) | ((xs < 0).to(tl.int32) << 3)


@triton.jit
def _e2m1_mag4(y):
    """E2M1 magnitude code (0..7) of a >= 0 from y = 4a, in four fp32 operations and two integer ones: y
    saturated at 24 (6 scaled), rounded to 2 significant bits by Veltkamp's split (ties to even), whose fp32 bits
    22-24 are then the code (the scaling by 4 aligns E2M1's exponent with fp32's); below 4 (1 scaled) E2M1's grid
    is 2 (1/2 scaled), reached by adding 2^24. The same code as ``e2m1_mag`` for every fp32 (checked on every
    value below 7: all above saturate); NaN gives 7. Needs ``enable_fp_fusion=False`` (the split's rounding)."""
    y = tl.minimum(y, 24.0)
    g = y * 4194305.0
    hi = g + (y - g)
    sub = (y + 16777216.0).to(tl.int32, bitcast=True)
    return tl.where(y < 4.0, sub, hi.to(tl.int32, bitcast=True) >> 22) & 7


@triton.jit
def _fast_code(x, d4, r4, d_low):
    """E2M1 code of RN(x / d) without a division per element, for d in [2^-89, 2^89]; d4 = d / 4, r4 = 4 RN(1/d).

    q0 = RN(x r) and Markstein's correction q = RN(q0 + RN(x - q0 d) r) (one fma each, the residual exact),
    computed scaled by 4 (exactly: the same residual): the same code as the correctly rounded quotient wherever a
    code boundary is near. Where the quotient is tiny its magnitude code is 0 either way and only its
    sign matters: RN(x/d) is negative iff x < 0 and |x| > 2^-150 d, tested exactly as
    x 2^120 + d 2^-30 < 0 (``d_low`` = d 2^-30; one fma, whose sign is the exact sum's).
    benchmarks/gpu_division_check.py compares these codes with div_rn's on every bf16 value.
    """
    q0 = x * r4
    q = tl.fma(tl.fma(-q0, d4, x), r4, q0)
    code = _e2m1_mag4(tl.abs(q))
    return tl.where(tl.fma(x, 1.329227995784916e36, d_low) < 0, code | 8, code)


@triton.jit
def _quant_kernel(x_ptr, amax_ptr, q_ptr, s_ptr, M, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    s2 = _global_scale(amax_ptr)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    xb = tl.reshape(x, (BLOCK_M, BLOCK_K // 16, 16))
    bamax = tl.max(tl.abs(xb), axis=2)
    sb = tl.math.div_rn(bamax, 6.0 * s2)
    sb = tl.where(sb == 0.0, 1.0, sb)
    sb = tl.minimum(tl.maximum(sb, 0.001953125), 448.0)
    v, byte = e4m3_rne(sb)
    denom = v * s2
    code = _e2m1(tl.math.div_rn(xb, denom[:, :, None]))
    lo, hi = tl.split(tl.reshape(code, (BLOCK_M, BLOCK_K // 2, 2)))
    packed = (lo | (hi << 4)).to(tl.uint8)
    pcols = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    tl.store(q_ptr + rows[:, None] * (K // 2) + pcols[None, :], packed,
             mask=(rows[:, None] < M) & (pcols[None, :] < K // 2))
    scols = pid_k * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
    tl.store(s_ptr + rows[:, None] * (K // 16) + scols[None, :], byte.to(tl.uint8),
             mask=(rows[:, None] < M) & (scols[None, :] < K // 16))


@triton.jit
def _amax_bf16_kernel(x_ptr, n_pairs, out_ptr, ITERS, BLOCK: tl.constexpr):
    """bf16 read as int32 pairs: |x| orders like its low 15 bits, so the amax is an integer max of
    bits, accumulated into ``out`` (the fp32 bits of the amax, as int32; NaN/Inf give inf's bits), over ITERS
    consecutive chunks of BLOCK pairs a program: one atomic a program (14,336 on one address were one a chunk)."""
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * ITERS * BLOCK
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        u = tl.load(x_ptr + offs, mask=offs < n_pairs, other=0)
        acc = tl.maximum(acc, tl.maximum(u & 0x7FFF, (u >> 16) & 0x7FFF))
    m = tl.max(acc, axis=0)
    tl.atomic_max(out_ptr, tl.where(m >= 0x7F80, 0x7F80, m) << 16)


@triton.jit
def _global_scale(amax_ptr):
    """s2 = amax / 2688 (reference.global_scale; 1 where the amax is 0)."""
    s2 = tl.math.div_rn(tl.load(amax_ptr), 2688.0)
    return tl.where(s2 > 0, s2, 1.0)


@triton.jit
def _quant_bf16_kernel(x_ptr, amax_ptr, q_ptr, s_ptr, M, K, BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr,
                       ORDER: tl.constexpr):
    """bf16 weights read as int32 pairs [M, K/2] (element 2i in the low half): the even/odd codes of a
    byte come from one load, with no shuffle. Tile: BLOCK_M rows x BLOCK_B blocks of 16 values.
    ORDER: how program ids walk the tiles (the bytes are the same in any order): 0 a 2-D grid, rows first; 1 one
    id a tile in memory order; 2 the reverse of memory order, so that the first tiles quantized are the last the
    amax pass read, still in L2 (50 MB on the H200; a 3072x7168 weight is 44 MB)."""
    if ORDER == 0:
        pid_m = tl.program_id(0)
        pid_b = tl.program_id(1)
    else:
        nbk = tl.cdiv(K // 16, BLOCK_B)
        lin = tl.program_id(0)
        if ORDER == 2:
            lin = tl.cdiv(M, BLOCK_M) * nbk - 1 - lin
        pid_m = lin // nbk
        pid_b = lin % nbk
    s2 = _global_scale(amax_ptr)
    rows = (pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M))[:, None, None]
    blk = (pid_b * BLOCK_B + tl.arange(0, BLOCK_B))[None, :, None]
    pair = blk * 8 + tl.arange(0, 8)[None, None, :]
    mask = (rows < M) & (blk < K // 16)
    u = tl.load(x_ptr + rows * (K // 2) + pair, mask=mask, other=0)
    lo = (u << 16).to(tl.float32, bitcast=True)
    hi = (u & -65536).to(tl.float32, bitcast=True)
    bamax = tl.max(tl.maximum(tl.abs(lo), tl.abs(hi)), axis=2)
    sb = tl.math.div_rn(bamax, 6.0 * s2)
    sb = tl.where(sb == 0.0, 1.0, sb)
    sb = tl.minimum(tl.maximum(sb, 0.001953125), 448.0)
    v, byte = e4m3_rne(sb)
    denom = (v * s2)[:, :, None]
    # One reciprocal a block when 1/d stays normal (s2 in [2^-80, 2^80]: every real checkpoint),
    # else the full IEEE division per element.
    if (s2 >= 8.271806125530277e-25) & (s2 <= 1.2089258196146292e24):
        r4 = tl.math.div_rn(1.0, denom) * 4.0
        d4 = denom * 0.25
        d_low = denom * 9.313225746154785e-10
        cl = _fast_code(lo, d4, r4, d_low)
        ch = _fast_code(hi, d4, r4, d_low)
    else:
        cl = _e2m1(tl.math.div_rn(lo, denom))
        ch = _e2m1(tl.math.div_rn(hi, denom))
    packed = (cl | (ch << 4)).to(tl.uint8)
    tl.store(q_ptr + rows * (K // 2) + pair, packed, mask=mask)
    rows2 = (pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]
    blk2 = (pid_b * BLOCK_B + tl.arange(0, BLOCK_B))[None, :]
    tl.store(s_ptr + rows2 * (K // 16) + blk2, byte.to(tl.uint8), mask=(rows2 < M) & (blk2 < K // 16))


#: Triton's interpreter (TRITON_INTERPRET=1) keeps the grid of the running launch in one global
#: builder, so two threads launching at once corrupt each other's grid ("x >= grid_dim[0]"); the
#: interpreter's launches are serialised. Compiled launches need no lock.
INTERPRETER = threading.Lock() if os.environ.get("TRITON_INTERPRET") == "1" else contextlib.nullcontext()


def amax_into(x: torch.Tensor, out: torch.Tensor, tile: tuple[int, int, int] | None = None) -> None:
    """out (fp32 [1], start at 0) = max(out, amax|x|); +inf if x holds NaN or Inf. ``tile``: (values a step, at
    most this many programs, warps), default AMAX_TILE (benchmarks time others)."""
    with INTERPRETER:
        _amax_into(x, out, tile or AMAX_TILE)


def _amax_into(x: torch.Tensor, out: torch.Tensor, tile: tuple[int, int, int]) -> None:
    n = x.numel()
    if not n:
        return
    block, most, warps = tile
    bf16 = x.dtype == torch.bfloat16 and n % 2 == 0
    items = n // 2 if bf16 else n
    chunks = -(-items // block)
    iters = -(-chunks // most) if most else 1
    grid = (-(-chunks // iters),)
    if bf16:
        _amax_bf16_kernel[grid](x.reshape(-1).view(torch.int32), items, out.view(torch.int32), iters, BLOCK=block,
                                num_warps=warps)
    else:
        _amax_kernel[grid](x.reshape(-1), items, out, iters, BLOCK=block, num_warps=warps)


def amax(x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(1, dtype=torch.float32, device=x.device)
    amax_into(x.contiguous(), out)
    return out.reshape(())


def quantize(x: torch.Tensor, amax: torch.Tensor, packed: torch.Tensor | None = None,
             scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed uint8 [..., K/2] and e4m3 scales [..., K/16] of ``x`` [..., K] under the global scale of
    ``amax`` (a fused module's joint amax; the kernel divides it by 2688 itself).

    ``packed`` / ``scales`` may be given: views of a fused module's output rows to write into.
    """
    k = x.shape[-1]
    x2 = x.contiguous().reshape(-1, k)
    m = x2.shape[0]
    if packed is None:
        packed = torch.empty((m, k // 2), dtype=torch.uint8, device=x.device)
    if scales is None:
        scales = torch.empty((m, k // 16), dtype=torch.uint8, device=x.device)
    amax = amax.reshape(1).to(device=x.device, dtype=torch.float32)
    with INTERPRETER:
        _launch_quant(x2, amax, packed, scales, m, k)
    lead = x.shape[:-1]
    return packed.reshape(*lead, k // 2), scales.view(torch.float8_e4m3fn).reshape(*lead, k // 16)


def _launch_quant(x2, amax, packed, scales, m: int, k: int, tile: tuple[int, ...] | None = None) -> None:
    """``tile``: the bf16 kernel's (rows, 16-blocks, warps[, order]), default BF16_TILE (benchmarks time others)."""
    if m and x2.dtype == torch.bfloat16:
        bm, bb, warps, *rest = tile or BF16_TILE
        order = rest[0] if rest else 0
        tiles = (triton.cdiv(m, bm), triton.cdiv(k // 16, bb))
        grid = tiles if order == 0 else (tiles[0] * tiles[1],)
        _quant_bf16_kernel[grid](x2.view(torch.int32), amax, packed, scales, m, k, BLOCK_M=bm, BLOCK_B=bb,
                                 ORDER=order, num_warps=warps, enable_fp_fusion=False)
    elif m:
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(k, BLOCK_K))
        _quant_kernel[grid](x2, amax, packed, scales, m, k, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K)
