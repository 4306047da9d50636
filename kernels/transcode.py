"""Exact MXFP4 -> NVFP4 transcoding (Kimi K3's routed experts).

An MXFP4 block is 32 E2M1 codes times ``2**(e - 127)``. NVFP4 stores the same codes in blocks of 16
with an e4m3 scale and one fp32 global scale. When every non-zero block's exponent lies within the
18 powers of two e4m3 holds (2^-9 .. 2^8) around one global scale ``2**m``, each code is kept and each
16-block gets the scale ``2**(e - 127 - m)``: dequantized values are identical to the source's.
Where the exponents span more, the caller dequantizes and re-quantizes instead (and says so).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E4M3_POW2_MIN, E4M3_POW2_MAX = -9, 8


def e4m3_pow2_byte(j: torch.Tensor) -> torch.Tensor:
    """e4m3 byte of 2**j for integer j in [-9, 8] (2^-9..2^-7 are subnormal: bytes 1, 2, 4)."""
    normal = ((j + 7) << 3).to(torch.uint8)
    sub = torch.bitwise_left_shift(torch.ones_like(j), (j + 9).clamp(min=0)).to(torch.uint8)
    return torch.where(j >= -6, normal, sub)


@dataclass(frozen=True)
class Fit:
    exact: bool
    m: int  # global scale exponent when exact
    reason: str


def nonzero_exponents(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E8M0 exponents of the 32-blocks that hold a non-zero code."""
    n = packed.shape[0]
    nz = ((packed & 0x77) != 0).reshape(n, -1, 16).any(-1)
    return scale.reshape(n, -1)[nz].to(torch.int32)


def fit(members: list[tuple[torch.Tensor, torch.Tensor]]) -> Fit:
    """Whether these MXFP4 tensors (one fused module or scale group) transcode exactly under one 2**m."""
    exps = torch.cat([nonzero_exponents(p, s) for p, s in members])
    if exps.numel() == 0:
        return Fit(False, 0, "all blocks are zero")
    lo, hi = int(exps.min()), int(exps.max())
    if hi - lo > E4M3_POW2_MAX - E4M3_POW2_MIN:
        return Fit(False, 0, f"block exponents span 2^{lo - 127}..2^{hi - 127}, wider than e4m3's 2^-9..2^8")
    return Fit(True, hi - 127 - E4M3_POW2_MAX, f"block exponents 2^{lo - 127}..2^{hi - 127}")


def global_scale(m: int) -> torch.Tensor:
    return torch.ldexp(torch.tensor(1.0, dtype=torch.float32), torch.tensor(m, dtype=torch.float32))


def transcode(packed: torch.Tensor, scale: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, e4m3 scales [N, K/16]) of an MXFP4 tensor under global scale 2**m; codes are unchanged.

    All-zero blocks, whose exponent carries no information, get the nearest representable scale.
    """
    j = (scale.to(torch.int32) - 127 - m).clamp(E4M3_POW2_MIN, E4M3_POW2_MAX)
    nvfp4_scale = e4m3_pow2_byte(j).repeat_interleave(2, dim=-1)
    return packed.clone(), nvfp4_scale.view(torch.float8_e4m3fn)
