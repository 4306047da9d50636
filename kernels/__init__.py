"""Compute kernels: NVFP4 quantization (reference, fast CPU, Triton), MXFP4 transcoding, decoding.

The pipeline only calls :func:`get_backend` and the :class:`Backend` methods, so every quantizer
plugs into the same code path and is held to the same bytes as ``reference``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kimi_convert.devices import Device, cpus, resolve_device

from . import fp8_block, mxfp4_cast, reference
from .formats import DecodeError, decode_fp8_block, decode_mxfp4

__all__ = ["Backend", "DecodeError", "decode_fp8_block", "decode_mxfp4", "fp8_block", "get_backend", "mxfp4_cast",
           "reference"]

#: Elements a chunk of the torch reference path holds: bounds its fp32 temporaries.
CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class Backend:
    """Where and how tensors are quantized: ``reference`` (torch), ``cpu`` (C) or ``triton``."""

    name: str
    device: torch.device
    threads: int = 1  # the C kernel's threads (cpu)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device)

    def amax(self, w: torch.Tensor) -> torch.Tensor:
        """fp32 amax of |w| on the device; NaN or inf when w holds a NaN or an Inf (callers reject it)."""
        if w.numel() == 0:
            return torch.zeros((), dtype=torch.float32, device=self.device)
        if self.name == "cpu":
            from . import nvfp4_cpu

            return nvfp4_cpu.amax(nvfp4_cpu.load(), w, self.threads)
        if self.name == "triton":
            from . import nvfp4_triton

            return nvfp4_triton.amax(self.to_device(w))
        return self.to_device(w).abs().amax().float()

    def quantize(self, w: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed uint8 [..., K/2] and e4m3 scales [..., K/16] of ``w`` [..., K] under the global scale
        of ``amax`` (the joint amax of a fused module or scale group: ``reference.global_scale``)."""
        if self.name == "triton":
            from . import nvfp4_triton

            return nvfp4_triton.quantize(self.to_device(w), amax.to(self.device))
        s2 = reference.global_scale(amax.cpu())
        if self.name == "cpu":
            from . import nvfp4_cpu

            return nvfp4_cpu.quantize(nvfp4_cpu.load(), w, s2, self.threads)
        return self._reference_chunked(w, s2)

    def _reference_chunked(self, w: torch.Tensor, s2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w2 = w.reshape(-1, w.shape[-1])
        rows = max(1, CHUNK_ELEMENTS // max(1, w2.shape[1]))
        s2 = s2.to(self.device)
        parts = [reference.quantize(self.to_device(w2[i : i + rows]), s2) for i in range(0, w2.shape[0], rows)]
        k = w.shape[-1]
        p = torch.cat([x[0] for x in parts]) if parts else torch.empty((0, k // 2), dtype=torch.uint8)
        s = torch.cat([x[1] for x in parts]) if parts else torch.empty((0, k // 16), dtype=torch.float8_e4m3fn)
        return p.reshape(*w.shape[:-1], -1), s.reshape(*w.shape[:-1], -1)


def get_backend(device: Device | str = "auto", threads: int | None = None) -> Backend:
    """The backend of a resolved device (a string is resolved by ``resolve_device``: ``auto``, ``cpu``,
    ``cuda[:N]``, ``reference``, ``triton``). ``threads``: the C kernel's threads (default: ``cpus()``).

    ``triton`` runs the Triton kernel on the CPU under ``TRITON_INTERPRET=1`` (tests) or on the GPU.
    """
    device = resolve_device(device)
    threads = threads or cpus()
    if device.kind == "reference":
        return Backend("reference", torch.device("cpu"), threads)
    if device.kind == "cpu":
        from . import nvfp4_cpu

        return Backend("cpu" if nvfp4_cpu.load() is not None else "reference", torch.device("cpu"), threads)
    if device.kind == "triton":
        interpret = os.environ.get("TRITON_INTERPRET") == "1"
        return Backend("triton", torch.device("cpu" if interpret or not torch.cuda.is_available() else "cuda"),
                       threads)
    if not torch.cuda.is_available():  # cuda: resolve_device saw the GPU; torch must be able to start it
        raise ValueError(f"--device {device}: torch sees no CUDA device")
    return Backend("triton", torch.device("cuda", device.index), threads)
