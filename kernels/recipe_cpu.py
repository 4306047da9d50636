"""NVIDIA's K3 recipe on the CPU: ``recipe_cpu.c`` (the MXFP4 -> NVFP4 cast, 128x128 block FP8), built at first
use and called like ``nvfp4_cpu`` (same compiler, flags, cache and thread pool).

Bit-identical to :mod:`.mxfp4_cast` and :mod:`.fp8_block` (the tests hold them to it). Where the C code has no
answer of its own (a block-FP8 weight that is not 2-D bf16, or holds a NaN or an Inf, whose torch bytes depend
on torch's version and vector width) the torch function runs instead.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from . import fp8_block, mxfp4_cast
from .nvfp4_cpu import _pool, _split, open_library


@cache
def load() -> ctypes.CDLL | None:
    """The recipe kernels, argument types set (None: the caller runs the torch code)."""
    lib = open_library("recipe_cpu", "fast CPU recipe kernels")
    if lib is None:
        return None
    i64, i32, p = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
    lib.kc_cast_mxfp4.argtypes = [p, p, i64, i64, i32, i32, p, p]
    lib.kc_cast_mxfp4.restype = i64
    lib.kc_fp8_block_bf16.argtypes = [p, i64, i64, i64, i64, p, p]
    lib.kc_fp8_block_bf16.restype = i32
    return lib


def cast(lib: ctypes.CDLL, packed: torch.Tensor, scale: torch.Tensor, shared_k_max: int, own_k_max: int | None = None,
         threads: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, mxfp4_cast.CastStats]:
    """As :func:`.mxfp4_cast.cast` (``own_k_max``: the tensor's own ``k_max`` when the caller has it)."""
    if (packed.dtype != torch.uint8 or scale.dtype != torch.uint8 or packed.dim() != 2
            or packed.shape[:-1] != scale.shape[:-1] or packed.shape[-1] != 16 * scale.shape[-1]):
        return mxfp4_cast.cast(packed, scale, shared_k_max)
    own = mxfp4_cast.k_max(scale) if own_k_max is None else own_k_max
    p2, s2d = packed.contiguous(), scale.contiguous()
    rows, kb = s2d.shape
    out = torch.empty_like(p2)
    sb = torch.empty((rows, 2 * kb), dtype=torch.uint8)
    lossless = cast_into(lib, p2, s2d, shared_k_max, own, out, sb, threads)
    s2 = torch.tensor(2.0 ** (shared_k_max - mxfp4_cast.E4M3_KMAX), dtype=torch.float32).reshape(())
    lead = packed.shape[:-1]
    return (out.reshape(packed.shape), sb.view(torch.float8_e4m3fn).reshape(*lead, 2 * kb), s2,
            mxfp4_cast.CastStats(scale.numel(), lossless))


def cast_into(lib: ctypes.CDLL, packed: torch.Tensor, scale: torch.Tensor, shared: int, own: int, out: torch.Tensor,
              sb: torch.Tensor, threads: int = 1) -> int:
    """The kernel alone on contiguous 2-D operands (benchmarks): writes ``out`` and ``sb``, returns the lossless
    count."""
    rows, kb = scale.shape

    def run(r: tuple[int, int]) -> int:
        a, b = r
        return lib.kc_cast_mxfp4(packed.data_ptr() + a * 16 * kb, scale.data_ptr() + a * kb, b - a, kb, own, shared,
                                 out.data_ptr() + a * 16 * kb, sb.data_ptr() + a * 2 * kb)
    return sum(_pool(threads).map(run, _split(rows, 32 * kb, threads))) if rows and kb else 0


def fp8_quantize(lib: ctypes.CDLL, w: torch.Tensor, threads: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`.fp8_block.quantize` (bf16 weights in C, anything else, or NaN / Inf, by the torch code)."""
    if w.dim() != 2 or w.dtype != torch.bfloat16 or w.device.type != "cpu" or not w.numel():
        return fp8_block.quantize(w)
    x = w.contiguous()
    n, k = x.shape
    q = torch.empty((n, k), dtype=torch.uint8)
    scales = torch.empty(fp8_block.scale_shape(n, k), dtype=torch.float32)
    if not fp8_into(lib, x, q, scales, threads):
        return fp8_block.quantize(w)
    return q.view(torch.float8_e4m3fn), scales


def fp8_into(lib: ctypes.CDLL, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, threads: int = 1) -> bool:
    """The kernel alone (benchmarks): bf16 x [n, k] contiguous into uint8 q and fp32 scales; False where a tile
    holds NaN or Inf."""
    n, k = x.shape
    bands = -(-n // fp8_block.BLOCK)

    def run(r: tuple[int, int]) -> int:
        return lib.kc_fp8_block_bf16(x.data_ptr(), n, k, r[0], r[1], q.data_ptr(), scales.data_ptr())
    return not any(list(_pool(threads).map(run, _split(bands, 128 * k, threads))))
