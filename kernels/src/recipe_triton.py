"""NVIDIA's K3 recipe in Triton: the closed-form MXFP4 -> NVFP4 cast and the 128x128 block FP8 quantizer.

Bit-identical to :mod:`.mxfp4_cast` and :mod:`.fp8_block` (torch 2.13's rounding) on the GPU and in the
interpreter (``TRITON_INTERPRET=1``, the tests): no conversion instruction by default (the interpreter rounds
those differently), divisions only between normal numbers (``div_rn``), every other rounding done on the bits or
by exact fp32 splits (the kernels are launched with ``enable_fp_fusion=False`` where a split needs it).

The cast (two launches, no host sync between them): a block whose E8M0 exponent lies in e4m3's window keeps its
codes (only -0 -> 0, done on 32-bit words of 8 codes) and its scale is a power of two. K3's data is almost only
such blocks, so the first kernel is a flat stream over blocks (E8M0 bytes and code words are in the same block
order) that writes every block that way, counts lossless blocks per program (summed by the caller: no contended
atomic) and flags a program holding any other block (out of the window, E8M0 0, overflowing); the second kernel
recomputes every block of the flagged programs the long way, value by value, as the torch code, and exits at once
elsewhere. The long path lives in its own kernel so that its registers do not cost the stream its occupancy.

Block FP8 (one pass): a program holds one 128x128 tile (bf16 pairs as int32), takes its amax, its bf16 scale
(``amax / 448`` rounded as torch rounds it) and the e4m3 codes of ``bf16(x / scale)``. The quotient is
``x * (1 / scale)``: the exact quotient of two bf16 values is never within 2^-17 (relative) of a bf16 rounding
boundary unless it lies on the bf16 grid, and the product is within 2^-23 of it, so both round to the same bf16
(and no tie occurs there); the e4m3 rounding of that bf16 (ties to even, saturating at 448, as torch 2.13) is
done by an exact fp32 split (see ``_fp8_byte``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import fp8_block, mxfp4_cast
from .nvfp4_triton import INTERPRETER, e2m1_mag, e4m3_rne

#: cast: 32-blocks a program and warps of the closed-form kernel; at most this many programs, blocks a step and
#: warps of the long-path kernel (each reads the flags of enough fast programs to stay under that many: the empty
#: programs cost K3's data time, too few cost a fully flagged tensor its parallelism). Block FP8: warps (the tile is
#: 128 x 128). Measured: docs/history/RESULTS-history.md, "Issue 14: recipe kernels, second pass".
CAST_BLOCKS = (1024, 4)
CAST_SLOW = (512, 32, 4)
FP8_WARPS = 8
#: block FP8 rounds with the GPU's conversion instructions where it has them (compiled, sm_89 and later): 1.13x its
#: memory floor on the H200 against 1.66x for the fp32 splits, same bytes (docs/history/RESULTS-history.md, issue 14)
FP8_HW = True
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _capability(t: torch.Tensor) -> tuple[int, int]:
    """The compute capability of ``t``'s GPU; (0, 0) in the interpreter (no PTX there)."""
    return (0, 0) if _INTERPRETED or t.device.type != "cuda" else torch.cuda.get_device_capability(t.device)


@triton.jit
def _pow2(k):
    """2^k as fp32 for int32 k in [-126, 127]."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_value(mag):
    """fp32 value of an E2M1 magnitude code 0..7 (0, 0.5, 1, 1.5, 2, 3, 4, 6)."""
    bits = tl.where(mag >= 2, (((mag >> 1) + 126) << 23) | ((mag & 1) << 22), tl.where(mag == 1, 126 << 23, 0))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _cast_scale(e, k, kmm, in_range, mx):
    """(e4m3 value, e4m3 byte, exact) of 32-blocks: ``e4m3(clamp(amax / (6 s2), 2^-9, 448))`` with the block's
    amax ``6 * 2^k`` in the window (``in_range``), else ``E2M1[mx] * 2^k`` (mx: its largest magnitude code);
    kmm = k - m where s2 = 2^m. ``exact``: the scale times s2 is 2^k (the codes are kept)."""
    # amax / (6 s2) = (amax / 6) * 2^-m: a power of two in the window, else fl(E2M1[mx] / 6) 2^(k-m), both scaled
    # within the normal range (any clamped exponent gives the same clamp); 6 * 2^k overflows for k >= 126
    r6 = tl.where(in_range, 1.0, tl.math.div_rn(_e2m1_value(mx), 6.0))
    q = r6 * _pow2(tl.minimum(tl.maximum(kmm, -40), 40))
    q = tl.where(in_range & (k >= 126), float("inf"), q)
    sb = tl.minimum(tl.maximum(q, 0.001953125), 448.0)
    v, byte = e4m3_rne(sb)
    exact = (e > 0) & (kmm >= -9) & (kmm <= 8) & (v == _pow2(tl.minimum(tl.maximum(kmm, -9), 8)))
    return v, byte, exact


@triton.jit
def _cast_codes(c, k, kmm, sbv, m):
    """E2M1 codes (sign in bit 3) of ``bf16(E2M1[c] * 2^k) / (sbv * 2^m)`` for codes c of one block, kmm = k - m:
    the quotient is fl(E2M1 / sbv) 2^(k-m) where that is normal, else its code is 0 and only its sign is decided
    (negative iff |quotient| > 2^-150); the value overflows to inf where E2M1 2^k >= 2^128 (0 * inf is NaN), the
    divisor where sbv 2^m >= 2^128 (m <= 120: m = 120 and sbv >= 256), giving 0 (finite / inf) or NaN."""
    mag = c & 7
    neg = (c >> 3) & 1
    v = _e2m1_value(mag)
    y = tl.math.div_rn(v, sbv)  # normal / normal; 0 for the zero code
    z = y * _pow2(tl.minimum(tl.maximum(kmm, -14), 14))
    out = tl.where(kmm > 14, tl.where(mag > 0, 7, 0), tl.where(kmm < -14, 0, e2m1_mag(z)))
    t = -150 - kmm  # |quotient| > 2^-150  <=>  v > sbv 2^t
    far = tl.where(t > 13, 0, 1)
    near = (v > sbv * _pow2(tl.minimum(tl.maximum(t, -13), 13))).to(tl.int32)
    sign = neg & (mag > 0).to(tl.int32) & tl.where(kmm >= -14, 1, tl.where(t < -13, 1, far & near))
    code = out | (sign << 3)
    ev = tl.where(mag >= 6, 2, tl.where(mag >= 4, 1, tl.where(mag >= 2, 0, -1)))
    overflow = (mag > 0) & ((ev + k >= 128) | (k >= 128))  # the value is +-inf (2^128 is inf): code 7, its sign
    code = tl.where(overflow, 7 | (neg << 3), code)
    nan = (mag == 0) & (k >= 128)  # 0 * inf
    code = tl.where(nan, 7, code)
    return tl.where((m >= 120) & (sbv >= 256.0), tl.where(overflow | nan, 7, 0), code)


@triton.jit
def _cast_fast_kernel(p_ptr, e_ptr, out_ptr, sb_ptr, count_ptr, flag_ptr, NB, own, shared, BLOCKS: tl.constexpr):
    """The closed form over BLOCKS consecutive 32-blocks (flat: E8M0 bytes [NB], codes int32 words [NB, 4] and e4m3
    byte pairs int16 [NB] are in the same block order): the scale and code loads issued together, every block's
    codes written with -0 -> 0 and its power-of-two scale. A program with a block off the closed form raises its
    flag for ``_cast_slow_kernel``, which rewrites the program's blocks; count_ptr gets the program's lossless
    count (no atomic: the caller sums the partial counts)."""
    pid = tl.program_id(0)
    blk = pid.to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    bmask = blk < NB
    widx = blk[:, None] * 4 + tl.arange(0, 4)[None, :]
    e = tl.load(e_ptr + blk, mask=bmask, other=0).to(tl.int32)
    w = tl.load(p_ptr + widx, mask=bmask[:, None], other=0)
    k = e - 127
    kmm = k - (shared - 8)
    fast = (k >= own - 17) & (k <= own) & (e > 0) & (kmm >= -9) & (kmm <= 8) & (k < 126)
    byte = tl.where(kmm >= -6, (kmm + 7) << 3, tl.where(kmm == -7, 4, tl.where(kmm == -8, 2, 1)))
    z = ((w & 0x77777777) + 0x77777777) & -0x77777778  # bit 3 of each nibble: its magnitude is not 0
    tl.store(out_ptr + widx, w & (z | 0x77777777), mask=bmask[:, None])
    tl.store(sb_ptr + blk, (byte | (byte << 8)).to(tl.int16), mask=bmask)
    tl.store(flag_ptr + pid, tl.sum(((~fast) & bmask).to(tl.int32), axis=0))
    tl.store(count_ptr + pid, tl.sum((((k >= shared - 17) | (e == 0)) & bmask).to(tl.int32), axis=0))


@triton.jit
def _cast_slow_kernel(p_ptr, e_ptr, out_ptr, sb_ptr, flag_ptr, NB, NP, own, shared, BLOCKS: tl.constexpr,
                      FLAGS: tl.constexpr, CHUNK: tl.constexpr):
    """The long way, value by value (as the torch code), for every block of the fast kernel's programs whose flag
    is raised, FLAGS programs' worth a program: a program of unflagged ones reads its flags and exits (no host
    sync decides the launch). CHUNK blocks at a time (compiled: few registers; the interpreter: all at once)."""
    pid = tl.program_id(0)
    fidx = pid * FLAGS + tl.arange(0, FLAGS)
    flags = tl.load(flag_ptr + fidx, mask=fidx < NP, other=0)
    if tl.max(flags, axis=0) > 0:
        m = shared - 8
        shifts = (tl.arange(0, 8) * 4)[None, None, :]
        for f in range(FLAGS):
            prog = pid * FLAGS + f
            if tl.load(flag_ptr + prog, mask=prog < NP, other=0) > 0:
                for j in range(BLOCKS // CHUNK):
                    blk = prog.to(tl.int64) * BLOCKS + j * CHUNK + tl.arange(0, CHUNK)
                    bmask = blk < NB
                    widx = blk[:, None] * 4 + tl.arange(0, 4)[None, :]
                    e = tl.load(e_ptr + blk, mask=bmask, other=0).to(tl.int32)
                    w = tl.load(p_ptr + widx, mask=bmask[:, None], other=0)
                    k = e - 127
                    kmm = k - m
                    c = (w[:, :, None] >> shifts) & 15  # [CHUNK, 4, 8]: the 32 codes of each block
                    mx = tl.max(tl.max(c & 7, axis=2), axis=1)
                    sbv, byte, exact = _cast_scale(e, k, kmm, (k >= own - 17) & (k <= own), mx)
                    codes = _cast_codes(c, k[:, None, None], kmm[:, None, None], sbv[:, None, None], m)
                    z = ((w & 0x77777777) + 0x77777777) & -0x77777778
                    out = tl.where(exact[:, None], w & (z | 0x77777777), tl.sum(codes << shifts, axis=2))
                    tl.store(out_ptr + widx, out, mask=bmask[:, None])
                    tl.store(sb_ptr + blk, (byte | (byte << 8)).to(tl.int16), mask=bmask)


@triton.jit
def _fp8_byte(xf, r, SATURATE: tl.constexpr):
    """e4m3 byte of torch's e4m3(bf16(x / s)) from fp32 x and r = 2^8 RN(1 / s), in fp32 operations (the
    integer pipe is the kernel's bottleneck): the quotient scaled by 2^8 (exact), its magnitude rounded to bf16 by
    Veltkamp's split to 8 significant bits (no tie can occur there: see the module docstring), saturated at 448
    where a subnormal scale lets it pass 464 (``SATURATE``), rounded to e4m3 by the split to 4 significant bits
    (ties to even: checked on every bf16 value); e4m3's byte is then the exponent field + mantissa (bits 20-26 of
    the fp32: the 2^8 scaling adds 128 + e4m3's bias to the exponent); below 2^-6 (4 scaled) e4m3's grid is 2^-9
    (1/2 scaled), reached by adding 2^22; the sign is the quotient's."""
    q = xf * r
    aq = tl.abs(q)
    g8 = aq * 65537.0
    y = g8 + (aq - g8)
    if SATURATE:
        y = tl.minimum(y, 114688.0)
    g4 = y * 1048577.0
    hi = g4 + (y - g4)
    normal = hi.to(tl.int32, bitcast=True) >> 20
    sub = (y + 4194304.0).to(tl.int32, bitcast=True) - 0x4A800000
    mag = tl.where(y < 4.0, sub, normal)
    sign = (q.to(tl.uint32, bitcast=True) >> 24).to(tl.int32, bitcast=True)  # bit 7; bits 8-31 are 0
    return mag ^ ((mag ^ sign) & -128)  # bits 0-6 of mag, 7-31 of sign: one bit select


@triton.jit
def _fp8_pair(lo, hi, r, SATURATE: tl.constexpr):
    return _fp8_byte(lo, r, SATURATE) | (_fp8_byte(hi, r, SATURATE) << 8)


@triton.jit
def _fp8_pair_hw(lo, hi, r):
    """GPU only: the bf16 and e4m3 roundings by the conversion instructions (round to nearest even, e4m3
    saturating), two values an instruction: int16 of two e4m3 bytes, ``lo``'s in the low byte."""
    b = tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [lo * r, hi * r], dtype=tl.int32,
                                  is_pure=True, pack=1)
    return tl.inline_asm_elementwise("cvt.rn.satfinite.e4m3x2.f32 $0, $2, $1;", "=h,r,r",
                                     [(b << 16).to(tl.float32, bitcast=True),
                                      (b & -65536).to(tl.float32, bitcast=True)], dtype=tl.int16, is_pure=True,
                                     pack=1)


@triton.jit
def _max_u16x2(a, b):
    return tl.inline_asm_elementwise("max.u16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _fp8_kernel(x_ptr, q_ptr, s_ptr, N, KW, TK, PAIRS: tl.constexpr, HW: tl.constexpr, ASM: tl.constexpr):
    """One 128x128 tile a program. PAIRS: x_ptr int32 [N, KW] of bf16 pairs and q_ptr int16 [N, KW] of e4m3
    byte pairs (KW = K/2); else x_ptr int16 [N, KW] bf16 and q_ptr uint8 (KW = K). s_ptr: fp32 [ceil(N/128), TK].
    HW: the roundings by conversion instructions (compiled only; the interpreter rounds those differently).
    ASM: PTX of the GPU where it saves integer operations (compiled only)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    W: tl.constexpr = 64 if PAIRS else 128
    rows = pid_n.to(tl.int64) * 128 + tl.arange(0, 128)
    cols = pid_k * W + tl.arange(0, W)
    mask = (rows[:, None] < N) & (cols[None, :] < KW)
    offs = rows[:, None] * KW + cols[None, :]
    if PAIRS:
        u = tl.load(x_ptr + offs, mask=mask, other=0)
        if ASM:  # |x| of both halves at once: one 16x2 integer max a pair
            m2 = tl.reduce(u & 0x7FFF7FFF, None, _max_u16x2)
            a = tl.maximum(m2 & 0x7FFF, m2 >> 16)
        else:
            a = tl.max(tl.max(tl.maximum(u & 0x7FFF, (u >> 16) & 0x7FFF), axis=1), axis=0)
    else:
        u = tl.load(x_ptr + offs, mask=mask, other=0).to(tl.int32) << 16
        a = tl.max(tl.max((u >> 16) & 0x7FFF, axis=1), axis=0)
    # the scale: bf16(amax / 448), the division scaled into the normal range (exact: a power of two)
    af = (a << 16).to(tl.float32, bitcast=True)
    tiny = a < 0x1000  # amax < 2^-95
    p = tl.where(tiny, 18446744073709551616.0, 1.0)  # 2^64
    t = tl.math.div_rn(af * p, 448.0)
    tb = t.to(tl.int32, bitcast=True)
    rounded = (tb + 0x7FFF + ((tb >> 16) & 1)) & -65536
    sub = (t + 1.4210854715202004e-14) - 1.4210854715202004e-14  # to the bf16 subnormal grid 2^-133 (scaled: 2^-69)
    ts = tl.where(tiny & (t < 2.168404344971009e-19), sub, rounded.to(tl.float32, bitcast=True))  # below 2^-62
    s = ts * tl.where(tiny, 5.421010862427522e-20, 1.0)  # 2^-64: exact, may be subnormal
    tl.store(s_ptr + pid_n * TK + pid_k, tl.where(a >= 0x7F80, af, s))  # NaN / Inf: the caller uses torch
    # x / s as (x p2) / (s p2) with 1 / (s p2) normal even times 2^8: p2 = 2^64 for a scale below 2^-100
    small = s < 7.888609052210118e-31
    p2 = tl.where(small, 18446744073709551616.0, 1.0)
    r = tl.where(s > 0, tl.math.div_rn(1.0, tl.where(s > 0, s * p2, 1.0)), 0.0)
    keep = tl.where(s > 0, -1, 0)  # an all-zero tile (scale 0) gets codes 0, as the torch code
    if PAIRS:
        lo = (u << 16).to(tl.float32, bitcast=True)
        hi = (u & -65536).to(tl.float32, bitcast=True)
        if HW:
            q = _fp8_pair_hw(lo * p2, hi * p2, r).to(tl.int32) & 0xFFFF
        elif small:  # a scale below 2^-100: x scaled too; a subnormal scale can give quotients past 448
            q = _fp8_pair(lo * 18446744073709551616.0, hi * 18446744073709551616.0, r * 256.0, True)
        else:
            q = _fp8_pair(lo, hi, r * 256.0, False)
        tl.store(q_ptr + offs, (q & keep).to(tl.int16), mask=mask)
    else:
        x = u.to(tl.float32, bitcast=True) * p2
        tl.store(q_ptr + offs, (_fp8_byte(x, r * 256.0, True) & keep).to(tl.uint8), mask=mask)


def _aligned(t: torch.Tensor, n: int) -> torch.Tensor:
    t = t.contiguous()
    return t if t.data_ptr() % n == 0 else t.clone()


def cast(packed: torch.Tensor, scale: torch.Tensor, shared_k_max: int, own_k_max: int | None = None
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, mxfp4_cast.CastStats]:
    """As :func:`.mxfp4_cast.cast`, on ``packed``'s device (``own_k_max``: the tensor's own k_max if known)."""
    if (packed.dtype != torch.uint8 or scale.dtype != torch.uint8 or packed.dim() != 2
            or packed.shape[:-1] != scale.shape[:-1] or packed.shape[-1] != 16 * scale.shape[-1]
            or not -126 <= shared_k_max <= 128):
        return mxfp4_cast.cast(packed, scale, shared_k_max)
    own = mxfp4_cast.k_max(scale) if own_k_max is None else own_k_max
    kb = scale.shape[-1]
    p2 = _aligned(packed, 16).reshape(-1, 16 * kb)
    s2d = scale.contiguous().reshape(-1, kb)
    out = torch.empty_like(p2)
    sb = torch.empty((s2d.shape[0], 2 * kb), dtype=torch.uint8, device=packed.device)
    programs = cast_programs(s2d.numel())
    stats = torch.empty(2 * programs, dtype=torch.int32, device=packed.device)  # counts, then flags
    if programs:
        with INTERPRETER:
            launch_cast(p2, s2d, out, sb, stats, own, shared_k_max)
    # made on the device (a fill), not copied there: no host-to-device copy to wait for
    s2 = torch.full((), 2.0 ** (shared_k_max - mxfp4_cast.E4M3_KMAX), dtype=torch.float32, device=packed.device)
    lead = packed.shape[:-1]
    return (out.reshape(packed.shape), sb.view(torch.float8_e4m3fn).reshape(*lead, 2 * kb), s2,
            mxfp4_cast.CastStats(scale.numel(), int(stats[:programs].sum()) if programs else 0))


def cast_programs(blocks: int, per_program: int | None = None) -> int:
    """Programs of the cast's fast kernel over ``blocks`` 32-blocks (its ``stats`` holds twice as many int32)."""
    return -(-blocks // (per_program or CAST_BLOCKS[0]))


def launch_cast(packed, scale, out, sb, stats, own: int, shared: int, tile=None, slow=None) -> None:
    """The kernels alone (benchmarks): contiguous operands on one device; ``stats`` int32 [2 P] (P =
    :func:`cast_programs`) gets each program's lossless count, then its flag. ``tile``: (blocks a program, warps)
    of the fast kernel; ``slow``: (at most this many programs, blocks a step, warps) of the long-path kernel."""
    per, warps = tile or CAST_BLOCKS
    most, chunk, swarps = slow or CAST_SLOW
    nb = scale.numel()
    programs = cast_programs(nb, per)
    flags = triton.next_power_of_2(-(-programs // most))  # the fast programs' flags a long-path program reads
    counts, flag = stats[:programs], stats[programs : 2 * programs]
    words, outw = packed.view(torch.int32), out.view(torch.int32)
    _cast_fast_kernel[(programs,)](words, scale, outw, sb.view(torch.int16), counts, flag, nb, own, shared,
                                   BLOCKS=per, num_warps=warps)
    _cast_slow_kernel[(-(-programs // flags),)](words, scale, outw, sb.view(torch.int16), flag, nb, programs, own,
                                                shared, BLOCKS=per, FLAGS=flags,
                                                CHUNK=per if _INTERPRETED else min(chunk, per), num_warps=swarps)


def fp8_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`.fp8_block.quantize`, on ``w``'s device (a weight that is not 2-D bf16, or holds NaN or Inf,
    goes to the torch code)."""
    if w.dim() != 2 or w.dtype != torch.bfloat16 or not w.numel():
        return fp8_block.quantize(w)
    x = _aligned(w, 4)
    n, k = x.shape
    q = torch.empty((n, k), dtype=torch.uint8, device=w.device)
    scales = torch.empty(fp8_block.scale_shape(n, k), dtype=torch.float32, device=w.device)
    with INTERPRETER:
        launch_fp8(x, q, scales)
    if not bool(torch.isfinite(scales).all()):
        return fp8_block.quantize(w)
    return q.view(torch.float8_e4m3fn), scales


def launch_fp8(x, q, scales, warps: int | None = None, hw: bool | None = None) -> None:
    """The kernel alone (benchmarks): bf16 x [n, k] contiguous, q uint8 [n, k], scales fp32 (tiles); ``hw``: round
    with the conversion instructions (default ``FP8_HW``; only where the GPU has them)."""
    n, k = x.shape
    tk = -(-k // 128)
    cap = _capability(x)
    hw = (FP8_HW if hw is None else hw) and cap >= (8, 9)  # cvt ... e4m3x2: sm_89
    if k % 2 == 0:
        _fp8_kernel[(-(-n // 128), tk)](x.view(torch.int32), q.view(torch.int16), scales, n, k // 2, tk, PAIRS=True,
                                         HW=hw, ASM=cap >= (9, 0), num_warps=warps or FP8_WARPS,  # max.u16x2: sm_90
                                         enable_fp_fusion=False)
    else:
        _fp8_kernel[(-(-n // 128), tk)](x.view(torch.int16), q, scales, n, k, tk, PAIRS=False, HW=False,
                                         ASM=False, num_warps=warps or FP8_WARPS, enable_fp_fusion=False)
