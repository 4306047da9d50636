"""The synthetic values: deterministic for a seed, each tensor from its own generator seeded by its name
(so any sharding, order or ``--jobs`` gives the same bytes), with a realistic spread: rows of varying
scale (log-normal), std ~ 1/sqrt(fan-in), and rare outliers; norms around 1.
"""

from __future__ import annotations

import hashlib
import math

import torch

from kimi_convert.kernels.reference import e2m1_codes, pack

from .layout import INT4_GROUP, MX_GROUP, Logical

DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32}


def _gen(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def weight(name: str, shape: tuple[int, ...], seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    """Gaussian rows of varying scale (log-normal), std ~ 1/sqrt(fan-in), and rare outliers."""
    g = _gen(seed, name)
    fan_in = shape[-1] if len(shape) > 1 else 1
    w = torch.randn(shape, generator=g, dtype=torch.float32)
    if len(shape) >= 2:
        rows = torch.exp(0.5 * torch.randn((*shape[:-1], 1), generator=g))
        w.mul_(rows / math.sqrt(fan_in))
        n_out = max(1, w.numel() // 20000)
        idx = torch.randint(0, w.numel(), (n_out,), generator=g)
        w.view(-1)[idx] *= 8 + 24 * torch.rand(n_out, generator=g)
    else:
        w.mul_(0.05).add_(1.0 if name.endswith(("norm.weight", "norm0.weight", "norm1.weight")) else 0.0)
    return w.to(dtype)


def mxfp4(name: str, shape: tuple[int, int], seed: int, wide: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """An MXFP4 tensor (packed codes, E8M0 scales) quantized from a realistic weight.

    ``wide`` scales a few blocks down by 2^-24 so the exponents span more than e4m3 can hold
    around one global scale (the case exact transcoding must refuse).
    """
    w = weight(name, shape, seed, torch.float32)
    n, k = shape
    blocks = w.view(n, k // MX_GROUP, MX_GROUP)
    if wide:
        blocks[0, 0].mul_(2.0**-24)
    amax = blocks.abs().amax(-1)
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax)).clamp(-127, 127)
    x = blocks / torch.exp2(exp).unsqueeze(-1)
    codes = e2m1_codes(x.reshape(n, k))
    return pack(codes), (exp + 127).to(torch.uint8)


def int4(name: str, shape: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """compressed-tensors' symmetric INT4 ``pack-quantized`` (group 32): ``weight_packed`` int32 [N, K/8] (codes
    + 8, lowest nibble first, as ``pack_to_int32``), BF16 ``weight_scale`` amax/7 a group, ``weight_shape``."""
    w = weight(name, shape, seed, torch.float32)
    n, k = shape
    blocks = w.view(n, k // INT4_GROUP, INT4_GROUP)
    scale = (blocks.abs().amax(-1) / 7.0).clamp(min=2.0**-100).to(torch.bfloat16)
    q = torch.clamp(torch.round(blocks / scale.float().unsqueeze(-1)), -8, 7).to(torch.int64).reshape(n, k // 8, 8) + 8
    words = (q << torch.arange(0, 32, 4, dtype=torch.int64)).sum(-1)
    packed = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return packed, scale, torch.tensor([n, k], dtype=torch.int64)


def fp8_block(name: str, shape: tuple[int, int], seed: int, block: int = 128, pow2: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 e4m3 weight and its fp32 weight_scale_inv [ceil(M/128), ceil(N/128)], DeepSeek style; ``pow2``:
    each tile's scale the power of two at or above amax/448, returned as its E8M0 byte (DeepSeek's ``ue8m0``
    scale_fmt, V3.1 on: V4 stores them F8_E8M0)."""
    w = weight(name, shape, seed, torch.float32)
    m, n = shape
    bm, bn = -(-m // block), -(-n // block)
    padded = torch.zeros(bm * block, bn * block)
    padded[:m, :n] = w
    amax = padded.view(bm, block, bn, block).abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / 448.0
    if pow2:
        exp = torch.ceil(torch.log2(scale)).clamp(-127, 127)
        scale = torch.exp2(exp)
    q = (padded.view(bm, block, bn, block) / scale[:, None, :, None]).view(bm * block, bn * block)[:m, :n]
    q = q.to(torch.float8_e4m3fn).contiguous()
    return (q, (exp + 127).to(torch.uint8)) if pow2 else (q, scale.float())


def expert_ids(name: str, shape: tuple[int, int], seed: int, below: int) -> torch.Tensor:
    """A hash-routing table (DeepSeek V4's ``tid2eid`` [vocab, top-k]): each row ``top-k`` distinct expert
    numbers below ``below``, drawn uniformly."""
    rows, k = shape
    g = _gen(seed, name)
    return torch.rand((rows, below), generator=g).argsort(-1)[:, :k].contiguous()


def _bank(t: Logical, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's bank: expert x's [N, K] matrix drawn as ``NAME.x``, its codes [N, K/32, 16] and scales
    [N, K/32] stacked over the experts."""
    e, n, k = t.shape
    codes, scales = [], []
    for x in range(e):
        c, s = mxfp4(f"{t.name}.{x}", (n, k), seed, wide=x in t.wide)
        codes.append(c.view(n, k // MX_GROUP, 16))
        scales.append(s)
    return torch.stack(codes), torch.stack(scales)


def tensor_values(t: Logical, seed: int) -> list[torch.Tensor]:
    """The values of ``t``'s parts, in ``t.parts``'s order (E8M0 scales as torch's float8_e8m0fnu)."""
    values = _values(t, seed)
    views = {"F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8}  # the same bytes, the release's dtype
    return [v.view(views[p.dtype]) if p.dtype in views else v for p, v in zip(t.parts, values, strict=True)]


def _values(t: Logical, seed: int) -> list[torch.Tensor]:
    if t.storage in ("bf16", "f32"):
        w = weight(t.name, t.shape, seed, DTYPES[t.parts[0].dtype])
        if t.zero_from is not None:
            w[t.zero_from :] = 0
        return [w]
    if t.storage == "fp8-block":
        return list(fp8_block(t.name, t.shape, seed, pow2=t.parts[1].dtype == "F8_E8M0"))
    if t.storage == "expert-ids":
        return [expert_ids(t.name, t.shape, seed, t.below)]
    if t.storage == "mxfp4-pack":
        return list(mxfp4(t.name, t.shape, seed, bool(t.wide)))
    if t.storage == "int4-pack":
        return list(int4(t.name, t.shape, seed))
    return list(_bank(t, seed))
