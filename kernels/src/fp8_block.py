"""128x128 block FP8 (ModelOpt's ``FP8_PB_WO``): e4m3 weight with one fp32 scale per tile, weight only.

ModelOpt's ``FP8QTensor.quantize(W, block_sizes={-2: 128, -1: 128})``, step by step, as NVIDIA's
Kimi K3 converter calls it on the BF16 attention weights:

1. pad ``W`` [N, K] with zeros to multiples of 128 in both dimensions;
2. ``amax`` of each 128x128 tile, in ``W``'s dtype (exact);
3. ``scale = amax / 448`` in ``W``'s dtype: for a BF16 weight the scale is **rounded to BF16**;
4. ``q = e4m3(W / scale)``, the division done in ``W``'s dtype (for BF16: the fp32 quotient
   rounded to BF16, then rounded again to e4m3, saturating at 448);
5. the weight is cropped back to [N, K]; the scales are stored as fp32 ``[N/128, 1, K/128, 1]``.

One defined deviation: an all-zero tile (scale 0, where ModelOpt divides 0 by 0 and stores NaN
codes) gets codes 0, so it dequantizes to 0 as the source does; the scale stays 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .scales import FP8_TILE as BLOCK
from .scales import fp8_scale_shape as scale_shape

__all__ = ["BLOCK", "E4M3_MAX", "quantize", "scale_shape"]
E4M3_MAX = 448.0


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [N, K], fp32 scales [N/128, 1, K/128, 1]) of a 2-D weight, on ``w``'s device."""
    if w.dim() != 2:
        raise ValueError(f"block FP8 needs a 2-D weight, got {list(w.shape)}")
    n, k = w.shape
    pn, pk = -n % BLOCK, -k % BLOCK
    padded = F.pad(w, (0, pk, 0, pn)) if pn or pk else w
    tiles = padded.reshape(padded.shape[0] // BLOCK, BLOCK, padded.shape[1] // BLOCK, BLOCK)
    amax = tiles.abs().amax(dim=(1, 3))  # in w's dtype: exact
    scale = amax / E4M3_MAX  # in w's dtype, as ModelOpt
    q = tiles / scale[:, None, :, None]
    q = torch.where(scale[:, None, :, None] == 0, torch.zeros((), dtype=q.dtype, device=q.device), q)
    q = q.to(torch.float8_e4m3fn).reshape(padded.shape)[:n, :k].contiguous()
    return q, scale.float()[:, None, :, None].contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``q[i, j] * scale[i // 128, j // 128]``."""
    n, k = q.shape
    s = scale.reshape(scale.shape[0], scale.shape[2]).float()
    return q.float() * s.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
