"""The reference NVFP4 quantizer: ModelOpt's ``NVFP4QTensor`` dynamic weight path, step by step.

Every other path (the fast CPU kernel, the Triton kernel) must produce the same bytes as this one;
the tests hold them to it. The steps and their rounding are those of docs/nvfp4.md:

1. ``s2 = fp32(amax|W|) / 2688`` (true IEEE division);
2. ``sb = block_amax / (6 * s2)``; ``sb == 0 -> 1``; clamp to [2^-9, 448]; round to e4m3 (RNE);
3. ``x = fp32(W) / (fp32(sb) * s2)`` (true division, not a multiply by a reciprocal);
4. E2M1 code: round to nearest, ties to even, saturate at 6; sign bit set when ``W < 0``;
5. pack two codes a byte, even index in the low nibble.

One defined deviation: an all-zero tensor (``s2 == 0``, where ModelOpt produces NaN scales) is
quantized with ``s2`` taken as 1 for the arithmetic and stored as 0: scales 1.0, codes 0.
All operands stay tensors on one device: CUDA divides by a CPU scalar through its reciprocal.
"""

from __future__ import annotations

import torch

GROUP = 16
E4M3_MAX = 448.0
SCALE_MIN = 2.0**-9
#: |x| thresholds between E2M1 magnitudes; at a tie, "<=" rounds down (even code), "<" rounds up.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _t(v: float, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32, device=like.device)


def global_scale(amax: torch.Tensor) -> torch.Tensor:
    """``weight_scale_2`` from the (fused) tensor's amax, fp32, 0-dim."""
    a = amax.detach().reshape(()).float()
    return a / _t(6.0 * 448.0, a)


def effective_global_scale(s2: torch.Tensor) -> torch.Tensor:
    return torch.where(s2 > 0, s2, _t(1.0, s2))


def block_scales(w: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """e4m3 block scales [..., K/16] for ``w`` [..., K] under global scale ``s2``."""
    s2 = effective_global_scale(s2)
    blocks = w.reshape(*w.shape[:-1], w.shape[-1] // GROUP, GROUP)
    bamax = blocks.abs().amax(dim=-1).float()
    sb = bamax / (_t(6.0, s2) * s2)
    sb = torch.where(sb == 0, _t(1.0, sb), sb)
    return sb.clamp(SCALE_MIN, E4M3_MAX).to(torch.float8_e4m3fn)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """4-bit codes (sign in bit 3) of fp32 ``x``: nearest E2M1 value, ties to even, saturating."""
    a = x.abs()
    mag = (
        7
        - (a <= 5.0).to(torch.uint8)
        - (a < 3.5).to(torch.uint8)
        - (a <= 2.5).to(torch.uint8)
        - (a < 1.75).to(torch.uint8)
        - (a <= 1.25).to(torch.uint8)
        - (a < 0.75).to(torch.uint8)
        - (a <= 0.25).to(torch.uint8)
    )
    return mag | ((x < 0).to(torch.uint8) << 3)


def pack(codes: torch.Tensor) -> torch.Tensor:
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def quantize(w: torch.Tensor, s2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed codes uint8 [..., K/2] and e4m3 scales [..., K/16] of ``w`` [..., K]."""
    if w.shape[-1] % GROUP:
        raise ValueError(f"K={w.shape[-1]} is not a multiple of {GROUP}")
    s2 = s2.to(w.device)
    sb = block_scales(w, s2)
    denom = sb.float() * effective_global_scale(s2)
    blocks = w.reshape(*w.shape[:-1], w.shape[-1] // GROUP, GROUP).float()
    x = (blocks / denom.unsqueeze(-1)).reshape(w.shape)
    return pack(e2m1_codes(x)), sb


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> codes [..., K], even index from the low nibble."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)


def code_values(packed: torch.Tensor) -> torch.Tensor:
    """fp32 E2M1 values (sign in bit 3 of each code) of packed codes."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=packed.device)
    return table[unpack_codes(packed).long()]


def dequantize(packed: torch.Tensor, scales: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """fp32 values ``e2m1[code] * fp32(scale) * s2`` of a packed NVFP4 tensor."""
    vals = code_values(packed)
    k = vals.shape[-1]
    blocks = vals.reshape(*vals.shape[:-1], k // GROUP, GROUP)
    out = blocks * (scales.float() * s2.float().to(packed.device)).unsqueeze(-1)
    return out.reshape(vals.shape)
