"""Compute kernels: NVFP4 quantization (reference, fast CPU, Triton) and input-format decoding.

The pipeline only calls :func:`get_backend` and the :class:`Backend` methods, so every
quantizer plugs into the same code path and is held to the same bytes as ``reference``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import reference
from .formats import DecodeError, decode_fp8_block, decode_mxfp4

__all__ = ["Backend", "DecodeError", "decode_fp8_block", "decode_mxfp4", "get_backend", "reference"]

#: Elements a CPU chunk holds: bounds the fp32 temporaries of the torch reference path.
CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class Backend:
    """Where and how tensors are quantized."""

    name: str  # "reference"
    device: torch.device

    def amax(self, w: torch.Tensor) -> torch.Tensor:
        """fp32 amax of |w| (NaN if w holds a NaN, inf if an inf: the caller rejects both)."""
        w = w.to(self.device)
        if w.numel() == 0:
            return torch.zeros((), dtype=torch.float32, device=self.device)
        return w.abs().amax().float()

    def quantize(self, w: torch.Tensor, s2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed uint8 [..., K/2] and e4m3 scales [..., K/16] of ``w`` [..., K], on the CPU."""
        w2 = w.reshape(-1, w.shape[-1])
        rows = max(1, CHUNK_ELEMENTS // max(1, w2.shape[1]))
        s2 = s2.to(self.device)
        packed, scales = [], []
        for i in range(0, w2.shape[0], rows):
            p, s = reference.quantize(w2[i : i + rows].to(self.device), s2)
            packed.append(p.cpu())
            scales.append(s.cpu())
        p = torch.cat(packed) if packed else torch.empty((0, w.shape[-1] // 2), dtype=torch.uint8)
        s = torch.cat(scales) if scales else torch.empty((0, w.shape[-1] // 16), dtype=torch.float8_e4m3fn)
        return p.reshape(*w.shape[:-1], -1), s.reshape(*w.shape[:-1], -1)


def get_backend(device: str = "cpu") -> Backend:
    return Backend("reference", torch.device(device))
