"""NVIDIA's K3 recipe on the CPU: ``recipe_cpu.c`` (the MXFP4 -> NVFP4 cast, 128x128 block FP8; and the INT4
decode of Kimi K2.5's experts), built at first use and called like ``nvfp4_cpu`` (same compiler, flags, cache, and
a thread pool of the C library's own).

Bit-identical to :mod:`.mxfp4_cast` and :mod:`.fp8_block` (the tests hold them to it). Where the C code has no
answer of its own (a block-FP8 weight that is not 2-D bf16, or holds a NaN or an Inf, whose torch bytes depend
on torch's version and vector width) the torch function runs instead.
"""

from __future__ import annotations

import ctypes

import torch

from . import clib, fp8_block, mxfp4_cast, outputs

#: Output bytes from which the codes are stored non-temporally (``clib.STREAM_MIN_BYTES``; patched by the tests)
STREAM_MIN_BYTES = clib.STREAM_MIN_BYTES


def load() -> ctypes.CDLL | None:
    """The recipe kernels, argument types set (None: the caller runs the torch code): ``clib.load_recipe``."""
    return clib.load_recipe()


def cast(lib: ctypes.CDLL, packed: torch.Tensor, scale: torch.Tensor, shared_k_max: int, own_k_max: int | None = None,
         threads: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, mxfp4_cast.CastStats]:
    """As :func:`.mxfp4_cast.cast` (``own_k_max``: the tensor's own ``k_max`` when the caller has it)."""
    if (packed.dtype != torch.uint8 or scale.dtype != torch.uint8 or packed.dim() != 2
            or packed.shape[:-1] != scale.shape[:-1] or packed.shape[-1] != 16 * scale.shape[-1]):
        return mxfp4_cast.cast(packed, scale, shared_k_max)
    own = mxfp4_cast.k_max(scale) if own_k_max is None else own_k_max
    p2, s2d = packed.contiguous(), scale.contiguous()
    rows, kb = s2d.shape
    out = outputs.empty(p2.shape, torch.uint8)
    sb = outputs.empty((rows, 2 * kb), torch.uint8)
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
    return lib.kc_cast_mxfp4_mt(packed.data_ptr(), scale.data_ptr(), rows, kb, own, shared, out.data_ptr(),
                                sb.data_ptr(), threads, out.numel() >= STREAM_MIN_BYTES) if rows and kb else 0


def fp8_quantize(lib: ctypes.CDLL, w: torch.Tensor, threads: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`.fp8_block.quantize` (bf16 weights in C, anything else, or NaN / Inf, by the torch code)."""
    if w.dim() != 2 or w.dtype != torch.bfloat16 or w.device.type != "cpu" or not w.numel():
        return fp8_block.quantize(w)
    x = w.contiguous()
    n, k = x.shape
    q = outputs.empty((n, k), torch.uint8)
    scales = outputs.empty(fp8_block.scale_shape(n, k), torch.float32)
    if not fp8_into(lib, x, q, scales, threads):
        return fp8_block.quantize(w)
    return q.view(torch.float8_e4m3fn), scales


def fp8_into(lib: ctypes.CDLL, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, threads: int = 1) -> bool:
    """The kernel alone (benchmarks): bf16 x [n, k] contiguous into uint8 q and fp32 scales; False where a tile
    holds NaN or Inf."""
    n, k = x.shape
    return not lib.kc_fp8_block_bf16_mt(x.data_ptr(), n, k, q.data_ptr(), scales.data_ptr(), threads,
                                        q.numel() >= STREAM_MIN_BYTES)


def int4_decode(lib: ctypes.CDLL, packed: torch.Tensor, scale: torch.Tensor, threads: int = 1) -> torch.Tensor | None:
    """fp32 [N, K] of an INT4 ``pack-quantized`` weight (``packed`` int32 [N, K/8], ``scale`` fp32 [N, K/G] with
    every scale finite), as :func:`.encodings.decode_int4`'s torch code; None where a value overflows fp32 (the
    caller's torch code then names it) or a group is not whole bytes (G odd: the torch code)."""
    n, words = packed.shape
    groups = scale.shape[1]
    if packed.dtype != torch.int32 or scale.dtype != torch.float32 or not groups or (8 * words // groups) % 2:
        return None
    p, s = packed.contiguous(), scale.contiguous()
    out = outputs.empty((n, 8 * words), torch.float32)
    if n and words and lib.kc_int4_decode_mt(p.data_ptr(), s.data_ptr(), n, words, groups, out.data_ptr(), threads):
        return None
    return out
