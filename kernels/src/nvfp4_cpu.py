"""The fast CPU path for torch tensors: ``nvfp4_cpu.c``'s kernels (built and loaded by ``clib``) on a tensor's
memory, their outputs from the pipeline's arena (``outputs``)."""

from __future__ import annotations

import ctypes

import torch

from . import clib, outputs
from .clib import FLAGS, build, load, open_library, set_pool_types  # noqa: F401 - this module's names, kept


def _prepare(x: torch.Tensor) -> torch.Tensor:
    """bf16 and fp32 go in as they are; fp16 (rare) is widened to fp32, which is exact."""
    x = x.contiguous()
    return x if x.dtype in (torch.bfloat16, torch.float32) else x.float()


def amax(lib: ctypes.CDLL, x: torch.Tensor, threads: int) -> torch.Tensor:
    x = _prepare(x).reshape(-1)
    bits = clib.amax_bits(lib, x.data_ptr(), x.numel(), x.dtype == torch.float32, threads)
    return torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32).reshape(())


def quantize(lib: ctypes.CDLL, x: torch.Tensor, s2: torch.Tensor, threads: int, packed: torch.Tensor | None = None,
             scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``packed`` [M, K/2] / ``scales`` [M, K/16] uint8 may be given (benchmarks time the kernel without the page
    faults of fresh outputs); else they come from ``outputs.empty`` (the pipeline's arena)."""
    x2 = _prepare(x).reshape(-1, x.shape[-1])
    fp32 = x2.dtype == torch.float32
    return _by_rows(x2, x.shape[:-1], lambda m, k, p, s: clib.quant(lib, x2.data_ptr(), m, k, fp32, float(s2), p, s,
                                                                    threads), packed, scales)


def ct_quantize(lib: ctypes.CDLL, x: torch.Tensor, g: torch.Tensor, threads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' NVFP4 (``ct_nvfp4``) of bf16 or fp32 ``x`` [..., K] under ``weight_global_scale`` ``g``:
    the C kernel ``kc_ct_quant_mt`` (fp16 goes to the torch code, whose block division is in fp16)."""
    x2 = x.contiguous().reshape(-1, x.shape[-1])
    fp32 = x2.dtype == torch.float32
    return _by_rows(x2, x.shape[:-1], lambda m, k, p, s: clib.ct_quant(
        lib, x2.data_ptr(), m, k, fp32, float(g.reshape(())), p, s, threads))


def _by_rows(x2: torch.Tensor, lead: torch.Size, run, packed: torch.Tensor | None = None,
             scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A row kernel's outputs: ``run(m, k, packed_ptr, scales_ptr)`` fills [M, K/2] codes and [M, K/16] e4m3 scales
    of the rows ``x2`` (given, or from ``outputs.empty``), returned shaped as the input's ``lead`` dimensions."""
    m, k = x2.shape
    packed = outputs.empty((m, k // 2), torch.uint8) if packed is None else packed
    scales = outputs.empty((m, k // 16), torch.uint8) if scales is None else scales
    if m:
        run(m, k, packed.data_ptr(), scales.data_ptr())
    return packed.reshape(*lead, k // 2), scales.view(torch.float8_e4m3fn).reshape(*lead, k // 16)
