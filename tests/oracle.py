"""An independent re-implementation of docs/nvfp4.md in numpy, for the tests.

It shares no code with kimi_convert: e4m3 and E2M1 rounding are done by searching the tables of
representable values (nearest, ties to the even code), not by casts or comparison chains.
"""

from __future__ import annotations

import numpy as np
import torch

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _e4m3_table() -> np.ndarray:
    sub = [m / 8 * 2.0**-6 for m in range(8)]
    normal = [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8) if not (e == 15 and m == 7)]
    return np.array(sub + normal)


E4M3 = _e4m3_table()  # 127 non-negative values; index parity == mantissa parity


def nearest_even(x: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Index of the nearest table value to x >= 0, ties to the even index, saturating at the top."""
    x = x.astype(np.float64)
    hi = np.clip(np.searchsorted(table, x, side="left"), 1, len(table) - 1)
    lo = hi - 1
    dlo, dhi = x - table[lo], table[hi] - x
    idx = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    idx = np.where(x >= table[-1], len(table) - 1, idx)
    return np.where(x <= table[0], 0, idx)


def to_f32(w: torch.Tensor) -> np.ndarray:
    return w.detach().to(torch.float32).cpu().numpy()


def quantize(w: np.ndarray, amax: np.float32 | None = None):
    """(packed uint8 [N, K/2], e4m3 bytes uint8 [N, K/16], s2 float32) per nvfp4.md."""
    w = w.astype(np.float32)
    n, k = w.shape
    a = np.float32(np.max(np.abs(w))) if amax is None else np.float32(amax)
    s2 = np.float32(a / np.float32(2688.0))
    s2e = s2 if s2 > 0 else np.float32(1.0)
    blocks = w.reshape(n, k // 16, 16)
    bamax = np.abs(blocks).max(axis=-1).astype(np.float32)
    sb = (bamax / (np.float32(6.0) * s2e)).astype(np.float32)
    sb = np.where(sb == 0, np.float32(1.0), sb)
    sb = np.clip(sb, np.float32(2.0**-9), np.float32(448.0)).astype(np.float32)
    sq_idx = nearest_even(sb, E4M3)
    sq = E4M3[sq_idx].astype(np.float32)
    denom = (sq * s2e).astype(np.float32)
    x = (blocks / denom[..., None]).astype(np.float32).reshape(n, k)
    mag = nearest_even(np.abs(x), E2M1).astype(np.uint8)
    codes = mag | ((w < 0).astype(np.uint8) << 3)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scale_bytes = torch.tensor(sq).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(torch.from_numpy(scale_bytes).view(torch.float8_e4m3fn).float().numpy(), sq)
    return packed.astype(np.uint8), scale_bytes, s2


def dequantize(packed: np.ndarray, scales: np.ndarray, s2: float) -> np.ndarray:
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    vals = E2M1[codes & 7] * np.where(codes & 8, -1.0, 1.0)
    sc = torch.from_numpy(scales.copy()).view(torch.float8_e4m3fn).float().numpy().astype(np.float64)
    return (vals.reshape(*sc.shape, 16) * sc[..., None] * float(s2)).reshape(vals.shape)


def decode_mxfp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    vals = E2M1[codes & 7] * np.where(codes & 8, -1.0, 1.0)
    exp = scale.astype(np.float64) - 127
    return (vals.reshape(*scale.shape, 32) * np.exp2(exp)[..., None]).reshape(vals.shape).astype(np.float32)
