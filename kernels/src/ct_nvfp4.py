"""compressed-tensors' NVFP4 arithmetic (what llm-compressor's ``model_free_ptq`` writes), step by step.

The bytes differ from ModelOpt's (``reference``) on some modules because compressed-tensors rounds at
other points. Each step is the peer's own expression, written with the same torch operations in the same
dtypes, so that both give the same bytes by construction (docs/compressed-tensors.md cites each):

1. global scale (``compressed_tensors/quantization/utils/helpers.py: generate_gparam``), in the weight's
   dtype ``D`` (BF16 for a BF16 checkpoint): ``g = 448*6 / clamp(amax, tiny(D))``, NaN/Inf -> 1, then fp32.
   The reciprocal convention: the engines dequantize with ``1/g``.
2. block scales (``helpers.py: calculate_qparams``): ``s = fp32(g) * fp32(D(block_amax / D(6)))``, clamped to
   e4m3's range and rounded to e4m3; a zero scale becomes 0.125 (``_get_dtype_eps`` of e4m3).
3. codes (``quantization/lifecycle/forward_helpers.py: _quantize`` and
   ``quantization/utils/fp4_utils.py: cast_to_fp4``, the CPU path): ``x = fp32(W) / (fp32(s) / g)``, clamped to
   [-6, 6], rounded to E2M1 with the thresholds 0.25 / 0.75 / 1.25 / 1.75 / 2.5 / 3.5 / 5 (ties to the even
   code), the sign taken as ``signbit(value * sign(x))`` (a negative value rounding to 0 keeps code 8).
4. packing (``compressors/nvfp4/helpers.py: pack_fp4_to_uint8``): even element in the low nibble.

Torch on any device (the CPU or a GPU), chunked by rows to bound the fp32 temporaries.
"""

from __future__ import annotations

import torch

GROUP = 16
FP8_MAX = 448.0
FP4_MAX = 6.0
ZERO_SCALE = 0.125  # compressed-tensors' _get_dtype_eps(float8_e4m3fn): replaces a zero block scale
CHUNK_ELEMENTS = 1 << 22


def global_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight_global_scale`` (fp32 [1]) of a tensor (or fused group) whose |max| is ``amax``, computed in the
    weights' ``dtype`` as ``generate_gparam`` does."""
    a = amax.detach().reshape(1).to(dtype)
    a = torch.clamp(a, min=torch.finfo(dtype).tiny)
    g = FP8_MAX * FP4_MAX / a
    g = torch.nan_to_num(g, nan=1.0, posinf=1.0, neginf=1.0)
    return g.to(torch.float32).reshape(1)


def block_scales(blocks: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """fp32 block scales (values of e4m3) of ``blocks`` [..., K/16, 16] (the weights' dtype)."""
    bamax = blocks.abs().amax(dim=-1)
    local = bamax / (torch.tensor(2 * FP4_MAX, dtype=torch.float32, device=blocks.device).to(bamax.dtype) / 2)
    s = g * local
    s = torch.clamp(s, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(s.dtype)
    return torch.where(s == 0, torch.tensor(ZERO_SCALE, dtype=s.dtype, device=s.device), s)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """4-bit codes of fp32 ``x`` as ``cast_to_fp4`` rounds it and ``pack_fp4_to_uint8`` indexes it: the same
    codes as ModelOpt's rounding (``reference.e2m1_codes``). cast_to_fp4's clamp to +-6 is its saturation; its
    ``sign(x) * magnitude`` sign bit is ``x < 0`` (torch's ``sign(-0.0)`` is +0, so -0.0 gives code 0, and a
    negative value rounding to 0 gives code 8), as ``tests/test_compressed_tensors.py`` checks against the peer."""
    from .reference import e2m1_codes as modelopt_codes

    return modelopt_codes(x)


def _quantize_rows(w: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = w.reshape(*w.shape[:-1], w.shape[-1] // GROUP, GROUP)
    s = block_scales(blocks, g).to(w.dtype)  # the module's weight_scale parameter holds it in the weights' dtype
    x = blocks / (s / g).unsqueeze(-1)
    codes = e2m1_codes(x).reshape(w.shape)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), s.to(torch.float8_e4m3fn)


def quantize(w: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed codes uint8 [..., K/2] and e4m3 scales [..., K/16] of ``w`` [..., K] under global scale ``g``."""
    if w.shape[-1] % GROUP:
        raise ValueError(f"K={w.shape[-1]} is not a multiple of {GROUP}")
    g = g.to(w.device)
    w2 = w.reshape(-1, w.shape[-1])
    rows = max(1, CHUNK_ELEMENTS // max(1, w2.shape[1]))
    parts = [_quantize_rows(w2[i:i + rows], g) for i in range(0, w2.shape[0], rows)]
    k = w.shape[-1]
    p = torch.cat([x[0] for x in parts]) if parts else torch.empty((0, k // 2), dtype=torch.uint8, device=w.device)
    s = torch.cat([x[1] for x in parts]) if parts else torch.empty((0, k // GROUP), dtype=torch.float8_e4m3fn,
                                                                   device=w.device)
    return p.reshape(*w.shape[:-1], -1), s.reshape(*w.shape[:-1], -1)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """fp32 ``e2m1[code] * fp32(scale) / g`` (how the engines read this format)."""
    from .reference import code_values

    vals = code_values(packed)
    k = vals.shape[-1]
    blocks = vals.reshape(*vals.shape[:-1], k // GROUP, GROUP)
    return (blocks * (scales.float() / g.float().to(packed.device)).unsqueeze(-1)).reshape(vals.shape)
