"""Decoding the quantized encodings checkpoints arrive in: MXFP4 (Kimi K3's routed experts), INT4 (Kimi K2.5's) and
DeepSeek-style FP8 with 128x128 block scales. All decode exactly to fp32 (MXFP4 values are
E2M1 codes times powers of two; FP8 times an fp32 scale is one fp32 multiply, as the format defines; an INT4
code in [-8, 7] times a BF16 scale fits fp32's 24-bit significand).
"""

from __future__ import annotations

import torch

from .reference import code_values
from .scales import FP8_SCALE_MAX, INT4_OVERFLOW, INT4_SCALE_NOT_FINITE, fp8_scale_fault

MXFP4_GROUP = 32


class DecodeError(ValueError):
    """A quantized tensor whose scales cannot be decoded (E8M0 NaN, or values beyond fp32)."""


def decode_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values ``e2m1[code] * 2**(scale - 127)`` of an MXFP4 tensor (group 32)."""
    if bool((scale == 255).any()):
        raise DecodeError("E8M0 scale 255 (NaN)")
    vals = code_values(packed)
    k = vals.shape[-1]
    exp = scale.to(torch.int32) - 127
    blocks = vals.reshape(*vals.shape[:-1], k // MXFP4_GROUP, MXFP4_GROUP)
    out = torch.ldexp(blocks, exp.unsqueeze(-1).to(torch.float32)).reshape(vals.shape)
    if not bool(torch.isfinite(out).all()):
        raise DecodeError("E8M0 scales too large: decoded values overflow fp32")
    return out


def decode_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp32 ``weight[i, j] * scale_inv[i // bm, j // bn]``; a stacked expert bank (weight [E, M, N], scales [E, ., .])
    expert by expert, a fault named with its expert."""
    if weight.dim() == 3:
        out = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
        for e in range(weight.shape[0]):
            try:
                out[e] = decode_fp8_block(weight[e], scale_inv[e], block)
            except DecodeError as err:
                raise DecodeError(f"expert {e}: {err}") from None
        return out
    m, n = weight.shape
    bm, bn = block
    bad = ~(scale_inv.float().abs() <= FP8_SCALE_MAX)  # NaN compares false
    if bool(bad.any()):
        i, j = (int(x) for x in bad.nonzero()[0])
        raise DecodeError(fp8_scale_fault(i, j, float(scale_inv[i, j])))
    s = scale_inv.float().repeat_interleave(bm, 0)[:m].repeat_interleave(bn, 1)[:, :n]
    return weight.float() * s


def decode_int4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values ``(code - 8) * scale`` of compressed-tensors' symmetric INT4 ``pack-quantized`` weight:
    ``packed`` int32 [N, K/8] holding eight 4-bit codes a word, lowest nibble first (element ``8j + i`` in
    bits ``4i..4i+3`` of word ``j``: ``pack_to_int32``), ``scale`` [N, K/G] one per group of G along K.

    The words' little-endian bytes (safetensors' order, as torch holds them on the little-endian hosts the
    engines run on) are MXFP4's layout: byte ``b`` holds element ``2b`` in its low nibble, ``2b + 1`` in its high
    one; unpacked a byte at a time (3-4x faster than shifting each word eight times).

    Exact: a code times a BF16 scale needs at most 3 + 8 significant bits, which fp32 holds (BF16 does not:
    compressed-tensors' own ``dequantize`` in the scale's dtype rounds such products)."""
    n, words = packed.shape
    k = words * 8
    s = scale.float()
    if not bool(torch.isfinite(s).all()):
        raise DecodeError(INT4_SCALE_NOT_FINITE)
    fast = _int4_c(packed, s)
    if fast is not None:
        return fast
    b = packed.contiguous().view(torch.uint8)
    out = torch.stack([b & 0xF, b >> 4], -1).reshape(n, k).float().sub_(8)
    out = out.view(n, s.shape[1], -1).mul_(s.unsqueeze(-1)).view(n, k)
    if not bool(torch.isfinite(out).all()):
        raise DecodeError(INT4_OVERFLOW)
    return out


def _int4_c(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """The C decode (``recipe_cpu.c`` ``kc_int4_decode_mt``, the same values) on the process's torch threads, for a
    CPU tensor where the library builds; None: the torch code (another device, no compiler, an overflow to name).
    Why: the torch code's byte split, float conversion and group multiply pass over the weight five times
    (benchmarks/RESULTS.md, bench-kimi-k25)."""
    if packed.device.type != "cpu":
        return None
    from . import recipe_cpu

    lib = recipe_cpu.load()
    return None if lib is None else recipe_cpu.int4_decode(lib, packed, scale, torch.get_num_threads())
