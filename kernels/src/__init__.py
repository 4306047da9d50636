"""Compute kernels: NVFP4 quantization (reference, fast CPU, Triton), MXFP4 transcoding, decoding.

The pipeline only calls :func:`make_backend` (``kimi_convert.devices.get_backend``: the application resolves
the device) and the :class:`Backend` methods, so every quantizer plugs into the same code path and is held to
the same bytes as ``reference``. NVIDIA's K3 recipe (:meth:`Backend.cast_mxfp4`, :meth:`Backend.fp8_block`)
runs its torch code (``mxfp4_cast``, ``fp8_block``) on the ``reference`` backend or with
``KIMI_CONVERT_RECIPE_KERNELS=torch``, else this backend's kernels (``recipe_cpu``, ``recipe_triton``), which
give the same bytes.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from . import ct_nvfp4, fp8_block, mxfp4_cast, reference
    from .encodings import DecodeError, decode_fp8_block, decode_mxfp4

__all__ = ["Backend", "DecodeError", "ct_nvfp4", "decode_fp8_block", "decode_mxfp4", "fp8_block", "make_backend",
           "mxfp4_cast", "reference"]

#: What this package gives on first use rather than on import: each of them imports torch, and the pipeline
#: computes its first units with ``clib`` (no torch) while torch loads (``pipeline.early``).
_LAZY = {"ct_nvfp4": None, "fp8_block": None, "mxfp4_cast": None, "reference": None,
         "DecodeError": "encodings", "decode_fp8_block": "encodings", "decode_mxfp4": "encodings"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f".{_LAZY[name] or name}", __name__)
    return module if _LAZY[name] is None else getattr(module, name)

#: Elements a chunk of the torch reference path holds: bounds its fp32 temporaries.
CHUNK_ELEMENTS = 1 << 22
#: ``torch``: NVIDIA's recipe by its torch code on every backend (the bytes the kernels are held to).
RECIPE_KERNELS_ENV = "KIMI_CONVERT_RECIPE_KERNELS"


@dataclass(frozen=True)
class Backend:
    """Where and how tensors are quantized: ``reference`` (torch), ``cpu`` (C) or ``triton``."""

    name: str
    device: torch.device
    threads: int = 1  # the C kernel's threads (cpu)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the backend's device; to a GPU asynchronously (page-locked buffers are then copied by DMA
        while the host goes on): a caller keeps ``t``'s memory alive until the stream has synchronized, which
        every read-back of a result (``.cpu()``, ``.item()``, ``compute.HostSink.finish``) does."""
        return t.to(self.device, non_blocking=self.device.type == "cuda")

    def amax(self, w: torch.Tensor) -> torch.Tensor:
        """fp32 amax of |w| on the device; NaN or inf when w holds a NaN or an Inf (callers reject it)."""
        import torch

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
        from . import reference

        if self.name == "triton":
            from . import nvfp4_triton

            return nvfp4_triton.quantize(self.to_device(w), amax.to(self.device))
        s2 = reference.global_scale(amax.cpu())
        if self.name == "cpu":
            from . import nvfp4_cpu

            return nvfp4_cpu.quantize(nvfp4_cpu.load(), w, s2, self.threads)
        return self._reference_chunked(w, s2)

    def quantize_ct(self, w: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """compressed-tensors' NVFP4 (``ct_nvfp4``): packed codes and e4m3 scales of ``w`` under its
        ``weight_global_scale`` ``g``: the C kernel on the CPU backend (bf16 and fp32), torch elsewhere (the same
        bytes on each: tests/test_compressed_tensors.py)."""
        import torch

        from . import ct_nvfp4

        if self.name == "cpu" and w.dtype in (torch.bfloat16, torch.float32) and w.device.type == "cpu":
            from . import nvfp4_cpu

            lib = nvfp4_cpu.load()
            if lib is not None:
                return nvfp4_cpu.ct_quantize(lib, w, g, self.threads)
        return ct_nvfp4.quantize(self.to_device(w), g.to(self.device))

    def _recipe_kernels(self) -> str:
        """``triton``, ``cpu`` (the C kernels, when they build) or ``torch``."""
        if self.name == "reference" or os.environ.get(RECIPE_KERNELS_ENV, "auto") == "torch":
            return "torch"
        if self.name == "cpu":
            from . import recipe_cpu

            return "cpu" if recipe_cpu.load() is not None else "torch"
        return self.name

    def cast_mxfp4(self, packed: torch.Tensor, scale: torch.Tensor, shared_k_max: int, own_k_max: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, mxfp4_cast.CastStats]:
        """NVIDIA's MXFP4 -> NVFP4 cast (:func:`.mxfp4_cast.cast`): codes, e4m3 scales, weight_scale_2, stats.
        ``own_k_max``: the tensor's own ``mxfp4_cast.k_max`` when the caller has it."""
        kernels = self._recipe_kernels()
        if kernels == "triton":
            from . import recipe_triton

            return recipe_triton.cast(self.to_device(packed), self.to_device(scale), shared_k_max, own_k_max)
        if kernels == "cpu":
            from . import recipe_cpu

            return recipe_cpu.cast(recipe_cpu.load(), packed, scale, shared_k_max, own_k_max, self.threads)
        from . import mxfp4_cast

        return mxfp4_cast.cast(packed, scale, shared_k_max)

    def fp8_block(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """128x128 block FP8 (:func:`.fp8_block.quantize`) of a 2-D weight: e4m3 [N, K], fp32 [N/128, 1, K/128, 1]."""
        kernels = self._recipe_kernels()
        if kernels == "triton":
            from . import recipe_triton

            return recipe_triton.fp8_quantize(self.to_device(w))
        if kernels == "cpu" and w.device.type == "cpu":
            from . import recipe_cpu

            return recipe_cpu.fp8_quantize(recipe_cpu.load(), w, self.threads)
        from . import fp8_block

        return fp8_block.quantize(w)

    def _reference_chunked(self, w: torch.Tensor, s2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        from . import reference

        w2 = w.reshape(-1, w.shape[-1])
        rows = max(1, CHUNK_ELEMENTS // max(1, w2.shape[1]))
        s2 = s2.to(self.device)
        parts = [reference.quantize(self.to_device(w2[i : i + rows]), s2) for i in range(0, w2.shape[0], rows)]
        k = w.shape[-1]
        p = torch.cat([x[0] for x in parts]) if parts else torch.empty((0, k // 2), dtype=torch.uint8)
        s = torch.cat([x[1] for x in parts]) if parts else torch.empty((0, k // 16), dtype=torch.float8_e4m3fn)
        return p.reshape(*w.shape[:-1], -1), s.reshape(*w.shape[:-1], -1)


def make_backend(kind: str, index: int | None = None, threads: int = 1) -> Backend:
    """The backend of a resolved device (``kimi_convert.devices.get_backend`` resolves ``--device``'s spelling
    against the machine, so the kernels need nothing of the application): ``kind`` ``reference``, ``cpu``,
    ``triton`` or ``cuda`` (also ``auto``'s GPU), ``index`` the GPU, ``threads`` the C kernel's threads.

    ``triton`` runs the Triton kernel on the CPU under ``TRITON_INTERPRET=1`` (tests) or on the GPU.
    """
    import torch

    if kind == "reference":
        return Backend("reference", torch.device("cpu"), threads)
    if kind == "cpu":
        from . import nvfp4_cpu

        return Backend("cpu" if nvfp4_cpu.load() is not None else "reference", torch.device("cpu"), threads)
    if kind == "triton":
        interpret = os.environ.get("TRITON_INTERPRET") == "1"
        return Backend("triton", torch.device("cpu" if interpret or not torch.cuda.is_available() else "cuda"),
                       threads)
    # cuda, and auto's GPU (a pipeline measures the CPU against it: pipeline.choose)
    if not torch.cuda.is_available():  # cuda: resolve_device saw the GPU; torch must be able to start it
        device = kind if index is None else f"{kind}:{index}"
        raise ValueError(f"--device {device}: torch sees no CUDA device")
    return Backend("triton", torch.device("cuda", index), threads)
