"""Scale facts without torch, for the units pack computes while torch loads (``convert/compute_early.py``) and for
the torch modules that state them too: the NVFP4 global scales in plain fp32 / bf16 arithmetic (the values of
``reference.global_scale``, ModelOpt's ``weight_scale_2``, and ``ct_nvfp4.global_scale``, compressed-tensors'
``weight_global_scale``), MXFP4's E8M0 bytes and their NaN's refusal (``mxfp4_cast``), block FP8's scale grid
(``fp8_block``).

Each is the torch expression's IEEE steps, rounding where torch rounds (tests/test_early.py holds them to the
torch code over every positive bf16 value and random fp32 ones):

* ModelOpt: ``fp32(amax) / fp32(2688)``, one correctly rounded division.
* compressed-tensors, weights of dtype ``D``: ``a = D(amax)`` clamped to ``tiny(D)``, then ``448*6 / a``, which
  torch evaluates as ``a.reciprocal() * 2688`` (``Tensor.__rtruediv__``), each step rounded to ``D``; NaN and
  Inf become 1.0.
"""

from __future__ import annotations

import math

import numpy as np

GLOBAL = 448.0 * 6.0
TINY = float(np.finfo(np.float32).tiny)  # the smallest normal: bf16's too (the same exponent range)
E8M0_BIAS, E8M0_NAN = 127, 0xFF  # an E8M0 byte is 2**(byte - 127); 0xFF is NaN (OCP MX spec)
E4M3_KMAX = 8  # e4m3's largest power of two: NVIDIA's cast's weight_scale_2 is 2**(k_max - 8)
MX_GROUP = 32  # the values an E8M0 byte scales
FP8_TILE = 128  # block FP8's tile, both ways


def fp8_scale_shape(n: int, k: int) -> tuple[int, int, int, int]:
    """The fp32 scales of an [n, k] block-FP8 weight, as stored: [N/128, 1, K/128, 1]."""
    return (-(-n // FP8_TILE), 1, -(-k // FP8_TILE), 1)


def mxfp4_nan_message(row: int, block: int, count: int) -> str:
    """The refusal of an E8M0 NaN byte, the first of ``count`` at ``row``, 32-value ``block``."""
    more = f" (and {count - 1} more block(s))" if count > 1 else ""
    return (f"E8M0 scale byte 0xFF (NaN in the OCP MX spec) at row {row}, block {block} "
            f"(values {block * MX_GROUP}-{block * MX_GROUP + MX_GROUP - 1}){more}; refusing to cast it to NVFP4")


def bf16(x: float) -> float:
    """``x`` rounded to bfloat16 (to nearest, ties to even), as a float; NaN stays NaN."""
    if math.isnan(x):
        return x
    u = int(np.array(x, dtype=np.float32).view(np.uint32))
    u = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000) & 0xFFFFFFFF
    return float(np.array(u, dtype=np.uint32).view(np.float32))


def f32(x: float) -> float:
    """``x`` rounded to fp32."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def modelopt(amax: float) -> float:
    """``weight_scale_2`` of a tensor (or fused group) whose fp32 |max| is ``amax``."""
    return float(np.float32(amax) / np.float32(GLOBAL))


def compressed_tensors(amax: float, dtype: str) -> float:
    """``weight_global_scale`` of weights of ``dtype`` (``BF16`` or ``F32``) whose fp32 |max| is ``amax``."""
    if dtype not in ("BF16", "F32"):
        raise ValueError(f"no plain global scale for {dtype} weights")
    rnd = bf16 if dtype == "BF16" else f32
    a = max(rnd(amax), TINY)
    with np.errstate(divide="ignore", over="ignore"):
        g = rnd(rnd(float(np.float32(1.0) / np.float32(a))) * GLOBAL)
    return 1.0 if not math.isfinite(g) else f32(g)


#: The largest block scale whose tile decodes within fp32 (e4m3's largest value is 448).
FP8_SCALE_MAX = 3.4028234663852886e38 / 448


def fp8_scale_fault(i: int, j: int, value: float) -> str:
    """The words for a block scale no decode can use (NaN, Inf, or one that takes e4m3 values past fp32): the
    same in the torch and the C-kernel paths (compute_early)."""
    why = "not a number" if value != value else "past fp32 once times e4m3's 448"
    return f"block scale [{i}, {j}] is {value:g} ({why})"


#: The words for INT4 scales no decode can use: the same in the torch and the C-kernel paths (compute_early).
INT4_SCALE_NOT_FINITE = "INT4 scale is not finite (NaN or Inf)"
INT4_OVERFLOW = "INT4 scales too large: decoded values overflow fp32"
