"""MXFP4 -> NVFP4, NVIDIA's closed-form cast (Model Optimizer's Kimi K3 converter), bit for bit.

An MXFP4 block holds 32 E2M1 codes times ``2**k_j`` (``k_j = e8m0_j - 127``); NVFP4 holds blocks of 16
with an e4m3 scale and one fp32 global scale. NVIDIA's converter
(``examples/kimi/kimi_k3/quantize_to_nvfp4.py`` with ``modelopt.torch.quantization.utils.numeric_utils``):

1. ``k_max``: the largest ``k_j`` over blocks with ``e8m0 > 0``, taken over every tensor of one
   engine fusion group (w1 and w3 of an expert), 0 when there is none;
   ``weight_scale_2 = 2**(k_max - 8)``.
2. Per 32-block amax: ``6 * 2**k_j`` where ``k_j - (k_own_max - 8)`` lies in e4m3's power-of-two window
   [-9, 8] -- ``k_own_max`` is the tensor's **own** maximum, not the shared one -- else the data-derived
   ``max|code value| * 2**k_j``; each 32-block gives two 16-blocks.
3. ``weight_scale = e4m3(clamp(amax / (6 * weight_scale_2), 2**-9, 448))``.
4. The codes: ``E2M1(bf16(dequantized MXFP4) / (fp32(weight_scale) * weight_scale_2))`` with ModelOpt's
   rounding (``reference.e2m1_codes``), so a negative zero (code 0x8) becomes 0x0.

Where a block's scale is exactly ``2**k_j / weight_scale_2`` (step 2's closed form, inside the window)
the quotient is the source code's value and its code is kept (only 0x8 -> 0x0): such blocks are
"lossless" and need no arithmetic. The others (out of the window, or all-zero blocks whose ``e8m0``
is 0) take the division path. The lossless count is NVIDIA's: blocks with ``k_j >= k_max - 17`` or
``e8m0 == 0``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .encodings import DecodeError
from .reference import code_values, e2m1_codes, pack
from .scales import E4M3_KMAX, E8M0_BIAS, E8M0_NAN, MX_GROUP, mxfp4_nan_message

__all__ = ["E4M3_KMAX", "E8M0_BIAS", "E8M0_NAN", "MX_GROUP", "CastStats", "cast", "k_max", "nan_scale_message",
           "per_block_amax"]

E4M3_KMIN = -9
E2M1_MAX, E4M3_MAX = 6.0, 448.0


def k_max(scale: torch.Tensor) -> int:
    """Largest block exponent over blocks whose E8M0 byte is non-zero (0 when there is none): the bytes are
    unsigned, so that is the largest byte whenever it is not 0 (one reduction, no masked copy).

    Every cast takes its tensors' ``k_max`` from here (the C, Triton and torch paths alike, or their caller
    for them), so this is where a NaN scale is refused: byte 0xFF is NaN in the OCP MX spec, not exponent
    128, and read as one it would set the group's weight_scale_2 to 2^120 and turn its other blocks to
    garbage. Raises :class:`DecodeError` naming the first such block."""
    top = int(scale.max()) if scale.numel() else 0
    if top == E8M0_NAN:
        raise DecodeError(nan_scale_message(scale))
    return top - E8M0_BIAS if top else 0


def nan_scale_message(scale: torch.Tensor) -> str:
    """Where the first NaN E8M0 byte is: its row and 32-value block, and how many there are."""
    hits = (scale == E8M0_NAN).reshape(-1, scale.shape[-1] if scale.dim() else 1).nonzero()
    n = int(hits.shape[0])
    row, block = (int(v) for v in hits[0])
    return mxfp4_nan_message(row, block, n)


@dataclass(frozen=True)
class CastStats:
    blocks: int  # 32-element MXFP4 blocks
    lossless: int  # NVIDIA's count: k_j >= k_max - 17, or e8m0 == 0


def per_block_amax(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 amax per 16-block [N, K/16] (NVIDIA's ``mxfp4_to_nvfp4_per_block_amax``)."""
    k = scale.to(torch.int32) - E8M0_BIAS
    pow2 = torch.exp2(k.float())
    ideal = E2M1_MAX * pow2
    own = k_max(scale)
    delta = k - (own - E4M3_KMAX)
    in_range = (delta >= E4M3_KMIN) & (delta <= E4M3_KMAX)
    if not bool(in_range.all()):
        n = packed.shape[0]
        blocks = packed.reshape(n, -1, 16)
        idx = torch.maximum(blocks & 0x07, (blocks >> 4) & 0x07).amax(dim=-1).long()
        table = torch.tensor((0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0), device=packed.device)
        ideal = torch.where(in_range, ideal, table[idx] * pow2)
    return ideal.repeat_interleave(2, dim=-1)


def cast(packed: torch.Tensor, scale: torch.Tensor, shared_k_max: int
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, CastStats]:
    """(codes uint8 [N, K/2], e4m3 scales [N, K/16], fp32 weight_scale_2 [], stats) of one MXFP4 tensor
    (packed uint8 [N, K/2], E8M0 uint8 [N, K/32]) under the group's ``shared_k_max``."""
    m = shared_k_max - E4M3_KMAX
    s2 = torch.tensor(2.0**m, dtype=torch.float32, device=packed.device).reshape(())
    amax = per_block_amax(packed, scale)
    sb = (amax / (E2M1_MAX * s2)).clamp(min=2.0**E4M3_KMIN, max=E4M3_MAX).to(torch.float8_e4m3fn)
    n = packed.shape[0]
    # Closed-form blocks: the e4m3 scale times s2 is exactly the block's 2**k_j.
    kj = (scale.to(torch.int32) - E8M0_BIAS).repeat_interleave(2, dim=-1)
    exact = (sb.float() == torch.exp2((kj - m).float())) & (scale > 0).repeat_interleave(2, dim=-1)
    codes = packed.reshape(n, -1, 8)  # 16 codes a block, 8 bytes
    neg_zero_low, neg_zero_high = (codes & 0x0F) == 0x08, (codes & 0xF0) == 0x80
    kept = codes & ~(neg_zero_low.to(torch.uint8) * 0x08) & ~(neg_zero_high.to(torch.uint8) * 0x80)
    out = kept.clone()
    todo = ~exact
    if bool(todo.any()):
        rows, cols = todo.nonzero(as_tuple=True)
        vals = _decode_blocks(packed, scale, rows, cols)  # [B, 16] fp32 (bf16-exact values)
        denom = sb[rows, cols].float() * s2
        out[rows, cols] = pack(e2m1_codes(vals / denom.unsqueeze(-1)))
    kk = scale.to(torch.int32) - E8M0_BIAS
    lossless = int(((kk >= shared_k_max - (E4M3_KMAX - E4M3_KMIN)) | (scale == 0)).sum())
    return out.reshape(packed.shape), sb, s2, CastStats(scale.numel(), lossless)


def _decode_blocks(packed: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor
                   ) -> torch.Tensor:
    """fp32 values of the 16-blocks (rows, cols): e2m1 value times 2**k_j (exact in bf16 and fp32)."""
    n = packed.shape[0]
    vals = code_values(packed.reshape(n, -1, 8)[rows, cols])  # [B, 16]
    k = scale[rows, cols // 2].to(torch.int32) - E8M0_BIAS
    return torch.ldexp(vals, k.float().unsqueeze(-1)).to(torch.bfloat16).float()
