"""NVFP4 quantization in Triton: one pass for the amax, one pass that quantizes and packs.

Bit-identical to ``reference``: the divisions are ``div_rn`` (Triton's ``/`` on fp32 is not
correctly rounded), and the e4m3 rounding of the block scales is done in integer/exact arithmetic
rather than by a conversion instruction, so the GPU and the interpreter (``TRITON_INTERPRET=1``,
used by CI on CPU tensors) compute the same bytes.

Fused modules: the caller takes the amax of each member (``amax`` accumulates into one cell) and
quantizes each member into its rows of the output, so the concatenation is never materialised.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_AMAX = 8192
BLOCK_M = 32
BLOCK_K = 256


@triton.jit
def _amax_kernel(x_ptr, n, out_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    a = tl.abs(x)
    bad = tl.max(((x != x) | (a == float("inf"))).to(tl.int32), axis=0)
    m = tl.max(a, axis=0)
    m = tl.where(bad > 0, float("inf"), m)
    tl.atomic_max(out_ptr, m)


@triton.jit
def _e4m3_rne(sb):
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
def _quant_kernel(x_ptr, amax_ptr, q_ptr, s_ptr, M, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    s2 = tl.math.div_rn(tl.load(amax_ptr), 2688.0)  # the global scale, as reference.global_scale
    s2 = tl.where(s2 > 0, s2, 1.0)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    xb = tl.reshape(x, (BLOCK_M, BLOCK_K // 16, 16))
    bamax = tl.max(tl.abs(xb), axis=2)
    sb = tl.math.div_rn(bamax, 6.0 * s2)
    sb = tl.where(sb == 0.0, 1.0, sb)
    sb = tl.minimum(tl.maximum(sb, 0.001953125), 448.0)
    v, byte = _e4m3_rne(sb)
    denom = v * s2
    xs = tl.math.div_rn(xb, denom[:, :, None])
    a = tl.abs(xs)
    mag = (
        7
        - (a <= 5.0).to(tl.int32)
        - (a < 3.5).to(tl.int32)
        - (a <= 2.5).to(tl.int32)
        - (a < 1.75).to(tl.int32)
        - (a <= 1.25).to(tl.int32)
        - (a < 0.75).to(tl.int32)
        - (a <= 0.25).to(tl.int32)
    )
    code = mag | ((xs < 0).to(tl.int32) << 3)
    lo, hi = tl.split(tl.reshape(code, (BLOCK_M, BLOCK_K // 2, 2)))
    packed = (lo | (hi << 4)).to(tl.uint8)
    pcols = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    tl.store(q_ptr + rows[:, None] * (K // 2) + pcols[None, :], packed,
             mask=(rows[:, None] < M) & (pcols[None, :] < K // 2))
    scols = pid_k * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
    tl.store(s_ptr + rows[:, None] * (K // 16) + scols[None, :], byte.to(tl.uint8),
             mask=(rows[:, None] < M) & (scols[None, :] < K // 16))


def amax_into(x: torch.Tensor, out: torch.Tensor) -> None:
    """out (fp32 [1], start at 0) = max(out, amax|x|); +inf if x holds NaN or Inf."""
    n = x.numel()
    if n:
        _amax_kernel[(triton.cdiv(n, BLOCK_AMAX),)](x.reshape(-1), n, out, BLOCK=BLOCK_AMAX)


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
    if m:
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(k, BLOCK_K))
        _quant_kernel[grid](x2, amax, packed, scales, m, k, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K)
    lead = x.shape[:-1]
    return packed.reshape(*lead, k // 2), scales.view(torch.float8_e4m3fn).reshape(*lead, k // 16)
