"""The compute stage without torch: the units whose every item is a dense BF16 or FP32 weight made NVFP4 (either
format's arithmetic; or a DeepSeek-style FP8 or Kimi K2.5 INT4 one, decoded here), a BF16 weight made 128x128 block
FP8, a Kimi K3 MXFP4 weight cast to NVFP4 by NVIDIA's closed form, or a stored tensor kept as it is, computed by the C
kernels on the read buffers (``kernels.clib``), with the bytes and notes ``compute.compute_unit`` gives on the CPU
backend (tests/test_early.py holds them to it, unit by unit and pack by pack).

Why: ``import torch`` takes 3.6-5 s on the H200 machine, and until it returns a stream's compute waited (2.8-5.5 s
of a 10 GB one-file input's 13-16 s: docs/compressed-tensors.md). A stream now computes the units this module
takes while torch loads (``--device auto``: until its runner is made, then the runner measures and chooses), and
with ``--device cpu`` always: a dense, FP8, Kimi K3 or Kimi K2.5 checkpoint is then converted without importing
torch at all. Anything else (an MXFP4 weight not cast, fp16 weights, an FP8 weight kept, a slice of a stored
tensor, NVIDIA's recipe with ``KIMI_CONVERT_RECIPE_KERNELS=torch``) is ``compute.compute_unit``'s.
"""

from __future__ import annotations

import ctypes
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kimi_convert.kernels import RECIPE_KERNELS_ENV, clib, scales
from kimi_convert.kernels.outputs import Arena
from kimi_convert.kernels.scales import FP8_SCALE_MAX, INT4_OVERFLOW, INT4_SCALE_NOT_FINITE, fp8_scale_fault

from . import encodings, formats
from .encodings.base import refused
from .encodings.int4_pack import NAME as INT4
from .encodings.int4_pack import check_weight_shape
from .errors import ConvertError
from .operations import Operation, operations
from .plan import FP8, NVFP4, Encoding, Item, SourceTensor, Unit

if TYPE_CHECKING:
    from .readers import BufferPool, TensorSource

Chunk = memoryview | np.ndarray
GROUP = 16  # NVFP4's block: K must be a multiple of it
_ITEMSIZE = {"BF16": 2, "F32": 4}


@dataclass
class Output:
    chunks: list[Chunk]  # written back to back at the tensor's offset


@dataclass
class UnitResult:
    outputs: dict[str, Output]
    notes: dict[str, dict] = field(default_factory=dict)  # per item: how it was produced


def sink_bytes(unit: Unit) -> int:
    """The pool buffer lent for a unit's outputs: their bytes, each one's alignment (64 bytes), a page of slack."""
    return unit.nbytes_out + 4096 + 64 * sum(len(it.sources) * len(it.outputs) for it in unit.items)


def raw_chunks(item: Item, reader: TensorSource) -> list[Chunk]:
    """A kept or copied item's bytes: its sources' stored bytes, member after member."""
    return [reader.raw(p) for s in item.sources for p in s.parts[:1]]


def takes(unit: Unit) -> bool:
    """Whether this module computes ``unit`` (a pure function of the plan, and of $KIMI_CONVERT_RECIPE_KERNELS:
    ``torch`` has NVIDIA's recipe computed by its torch code, which the tests compare the C kernels with): each
    item's operation (``operations``) on the inputs the C kernels read."""
    torch_recipe = os.environ.get(RECIPE_KERNELS_ENV, "auto") == "torch"
    ops = operations(unit)
    return all(_takes(it, ops[it.name], torch_recipe) for it in unit.items)


def _takes(it: Item, op: Operation, torch_recipe: bool) -> bool:
    if op is Operation.CAST:  # NVIDIA's cast of MXFP4 codes as stored (gpt-oss's banks: torch decodes them)
        return not torch_recipe and all(_mxfp4(s) for s in it.sources)
    if op is Operation.QUANTIZE:
        return all((_dense(s) or _fp8_block(s) or _int4(s)) and s.shape and not s.shape[-1] % GROUP
                   and math.prod(s.shape) for s in it.sources)
    if op is Operation.FP8_BLOCK:
        return not torch_recipe and all(_dense(s) and s.dtype == "BF16" and len(s.shape) == 2 and math.prod(s.shape)
                                        for s in it.sources)
    return op is Operation.COPY


def _mxfp4(s: SourceTensor) -> bool:
    """MXFP4 as stored, codes [N, K/2] and E8M0 bytes [N, K/32], two parts: Kimi K3's (``weight_packed`` U8,
    ``weight_scale`` U8) and DeepSeek V4's (``weight`` I8, ``scale`` F8_E8M0; the same bytes): the cast's input.
    gpt-oss's banks (a third part, a view) go through torch."""
    return encodings.holds_mxfp4(s) and not s.view and len(s.parts) == 2 and len(s.parts[0].shape) == 2


def _dense(s: SourceTensor) -> bool:
    return encodings.as_stored(s) and s.dtype in _ITEMSIZE and len(s.parts) == 1


def _fp8_block(s: SourceTensor) -> bool:
    """DeepSeek-style FP8 (e4m3 values, an F32 or BF16 scale a tile), decoded here as the torch code does."""
    return s.encoding == Encoding.FP8_BLOCK and not s.view and len(s.parts) == 2 and len(s.shape) == 2 \
        and s.parts[0].dtype == "F8_E4M3" and s.parts[1].dtype in ("F32", "BF16")


def _int4(s: SourceTensor) -> bool:
    """Compressed-tensors' INT4 ``pack-quantized`` (Kimi K2.5's experts: I32 codes [N, K/8], a BF16, F16 or F32
    scale a group, ``weight_shape``), quantized here from its codes (``int4_rows``), each row decoded as
    ``kernels.encodings.decode_int4`` decodes it; a group of an odd size (not whole bytes) is the torch code's."""
    if s.encoding != INT4 or s.view or len(s.parts) != 3 or len(s.shape) != 2:
        return False
    packed, scale, _ = s.parts
    groups = scale.shape[1] if len(scale.shape) == 2 else 0
    return packed.dtype == "I32" and scale.dtype in ("BF16", "F16", "F32") and groups > 0 \
        and not s.shape[1] % groups and not (s.shape[1] // groups) % 2


def _e4m3_values() -> np.ndarray:
    """fp32 value of each e4m3 byte (``float8_e4m3fn``: no infinities, S.1111.111 is NaN)."""
    b = np.arange(256, dtype=np.uint32)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, (b & 7).astype(np.float64)
    mag = np.where(exp == 0, man / 8 * 2.0 ** -6, (1 + man / 8) * 2.0 ** (exp.astype(np.float64) - 7))
    out = (sign * mag).astype(np.float32)
    out[(b & 0x7F) == 0x7F] = np.nan
    return out


E4M3 = _e4m3_values()


def _as_f32(raw: np.ndarray, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """A stored F32 or BF16 tensor's values as fp32 (bf16 widened: exact)."""
    if dtype == "F32":
        return raw.view(np.float32).reshape(shape)
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)


def decode_fp8_block(s: SourceTensor, reader: TensorSource, block: tuple[int, int]) -> np.ndarray:
    """fp32 ``weight[i, j] * scale_inv[i // bm, j // bn]``, one IEEE multiply a value, as
    ``kernels.encodings.decode_fp8_block`` (the bytes: tests/test_early.py)."""
    w, sc = s.parts
    m, n = s.shape
    bm, bn = block
    out = E4M3[reader.raw(w)].reshape(m, n)
    scale = _as_f32(reader.raw(sc), sc.dtype, tuple(sc.shape))
    bad = ~(np.abs(scale) <= FP8_SCALE_MAX)  # NaN compares false; no tile can then overflow (no RuntimeWarning)
    if bad.any():
        i, j = (int(x) for x in np.argwhere(bad)[0])
        raise ConvertError(f"{sc.file}: tensor {sc.name}: {fp8_scale_fault(i, j, float(scale[i, j]))}: "
                           f"{w.name} cannot be decoded")
    for i in range(scale.shape[0]):
        out[i * bm:(i + 1) * bm] *= np.repeat(scale[i], bn)[:n]
    return out


@dataclass
class Int4Rows:
    """An INT4 weight as the C kernels read it (``kc_int4_*_mt``: decoded a row at a time, never whole): its codes,
    its scales widened to fp32, and the amax of its values."""

    codes: np.ndarray
    scale: np.ndarray
    groups: int
    amax: float


def int4_rows(s: SourceTensor, reader: TensorSource, lib: ctypes.CDLL, threads: int) -> Int4Rows:
    """An INT4 weight (``_int4``) and its amax, refused where ``encodings.int4_pack``'s decode refuses it (a
    ``weight_shape`` not the weight's, a scale not finite, a product beyond fp32), in its words
    (tests/test_early.py)."""
    packed, scale, shape = s.parts
    stored = np.asarray(reader.raw(shape)).view(np.int64 if shape.dtype == "I64" else np.int32)
    check_weight_shape(s, stored.tolist())
    raw, count = np.asarray(reader.raw(scale)), math.prod(scale.shape)
    sc = raw.view(np.float16).astype(np.float32) if scale.dtype == "F16" else _as_f32(raw, scale.dtype, (count,))
    if not np.isfinite(sc).all():
        raise refused(scale, INT4_SCALE_NOT_FINITE)
    n, k = s.shape
    codes, groups = np.asarray(reader.raw(packed)), scale.shape[1]
    bits = clib.int4_amax_bits(lib, codes.ctypes.data, sc.ctypes.data, n, k, groups, threads)
    amax = float(np.array(bits, dtype=np.uint32).view(np.float32))
    if not math.isfinite(amax):
        raise refused(scale, INT4_OVERFLOW)
    return Int4Rows(codes, sc, groups, amax)


class EarlyCompute:
    """The C kernels of one worker (its ``threads``), loaded on first use; ``lib`` None: no C compiler (then
    nothing is taken here: the torch code computes, with its warning)."""

    def __init__(self, threads: int, block: tuple[int, int]):
        """``block``: the checkpoint's FP8 tile (``plan.fp8_block_size``)."""
        self.threads, self.block = threads, block

    @property
    def lib(self) -> ctypes.CDLL | None:
        return clib.load()

    def takes(self, unit: Unit) -> bool:
        return takes(unit) and self.lib is not None

    def compute(self, unit: Unit, reader: TensorSource, pool: BufferPool) -> tuple[UnitResult, np.ndarray | None]:
        """``unit``'s outputs, and the pool buffer lent for them (None: none taken), which goes back to the pool
        once the writer has written and hashed them. The items in ``compute.compute_unit``'s order."""
        res = UnitResult({})
        quant = [it for it in unit.items if it.kind == NVFP4]
        if all(it.kind not in (NVFP4, FP8) for it in unit.items):
            for it in unit.items:
                res.outputs[it.outputs[0].name] = Output(raw_chunks(it, reader))
            return res, None
        arena = Arena(pool.get(sink_bytes(unit)))
        try:
            for it in unit.items:
                if it.kind == FP8:
                    self._fp8_block(it, reader, arena, res)
                elif it.kind != NVFP4:
                    res.outputs[it.outputs[0].name] = Output(raw_chunks(it, reader))
            if quant and any(encodings.holds_mxfp4(s) for it in quant for s in it.sources):
                self._cast(quant, reader, arena, res)
            elif quant:
                self._quantize(quant, reader, arena, res)
        except BaseException:
            pool.put(arena.buf)
            raise
        return res, arena.buf

    def _finite_amax(self, src: SourceTensor, name: str, buf: np.ndarray, dtype: str) -> float:
        """fp32 amax of ``src``'s values in ``buf`` (BF16 or F32); a NaN or an Inf refused in compute's words."""
        bits = clib.amax_bits(self.lib, buf.ctypes.data, buf.nbytes // _ITEMSIZE[dtype], dtype == "F32", self.threads)
        a = float(np.array(bits, dtype=np.uint32).view(np.float32))
        if not math.isfinite(a):
            raise ConvertError(f"{src.file}: tensor {name}: holds NaN or Inf; refusing to quantize it")
        return a

    def _fp8_block(self, it: Item, reader: TensorSource, arena: Arena, res: UnitResult) -> None:
        """128x128 block FP8 of BF16 weights, as ``compute._fp8_block``: member by member where every member but
        the last has whole tiles of rows, else the members stacked and quantized as one."""
        rlib = clib.load_recipe()
        weights = []
        for src in it.sources:
            buf = reader.raw(src.parts[0])
            self._finite_amax(src, src.name, buf, "BF16")
            weights.append((buf, src.shape))
        if any(shape[0] % scales.FP8_TILE for _, shape in weights[:-1]):
            weights = [(np.concatenate([b for b, _ in weights]), (sum(sh[0] for _, sh in weights), weights[0][1][1]))]
        qs, tile_scales, zero = [], [], 0
        for buf, (n, k) in weights:
            q = _carve(arena, n * k)
            sc = _carve(arena, 4 * math.prod(scales.fp8_scale_shape(n, k))).view(np.float32)
            if rlib.kc_fp8_block_bf16_mt(buf.ctypes.data, n, k, q.ctypes.data, sc.ctypes.data, self.threads,
                                         q.nbytes >= clib.STREAM_MIN_BYTES):
                raise AssertionError(f"{it.name}: a tile with NaN or Inf past the amax check")
            qs.append(q)
            tile_scales.append(sc)
            zero += int((sc == 0).sum())
        _store(res, formats.outputs(it, {"codes": qs, "scales": tile_scales}))
        res.notes[it.name] = {"source_encoding": it.sources[0].encoding, "method": FP8, "zero_tiles": zero}

    def _cast(self, items: list[Item], reader: TensorSource, arena: Arena, res: UnitResult) -> None:
        """NVIDIA's closed-form MXFP4 -> NVFP4 cast, one ``k_max`` shared by the unit, as ``compute._cast_mxfp4``."""
        rlib = clib.load_recipe()
        own = {s.name: _k_max(s, reader) for it in items for s in it.sources}  # a NaN scale refused here
        shared = max(own.values())
        for it in items:
            packed, block_scales, blocks, lossless = [], [], 0, 0
            for s in it.sources:
                codes, e8m0 = reader.raw(s.parts[0]), reader.raw(s.parts[1])
                rows, kb = s.parts[1].shape
                out, sb = _carve(arena, codes.nbytes), _carve(arena, rows * 2 * kb)
                if rows and kb:
                    lossless += rlib.kc_cast_mxfp4_mt(codes.ctypes.data, e8m0.ctypes.data, rows, kb, own[s.name],
                                                      shared, out.ctypes.data, sb.ctypes.data, self.threads,
                                                      out.nbytes >= clib.STREAM_MIN_BYTES)
                blocks += e8m0.size
                packed.append(out)
                block_scales.append(sb)
            s2 = np.array([2.0 ** (shared - scales.E4M3_KMAX)], dtype=np.float32)
            _store(res, formats.outputs(it, {"codes": packed, "scales": block_scales, "global": [s2.reshape(1)]}))
            res.notes[it.name] = {"source_encoding": it.sources[0].encoding, "method": "mxfp4-cast", "k_max": shared,
                                  "blocks": blocks, "lossless_blocks": lossless}

    def _quantize(self, items: list[Item], reader: TensorSource, arena: Arena, res: UnitResult) -> None:
        """One global scale over the unit's members (its fused module or scale group), as ``compute._quantize``."""
        lib, threads = self.lib, self.threads
        srcs = {s.name: s for it in items for s in it.sources}
        # each source's values (``_values``), held for the unit
        values = {n: self._values(s, reader) for n, s in srcs.items()}
        amax = max(v.amax if isinstance(v, Int4Rows) else self._finite_amax(srcs[n], n, *v) for n, v in values.items())
        ct = formats.arithmetic(items[0]) == "compressed-tensors"
        first = next(iter(values.values()))
        s2 = scales.compressed_tensors(amax, "F32" if isinstance(first, Int4Rows) else first[1]) if ct \
            else scales.modelopt(amax)
        kernel = clib.ct_quant if ct else clib.quant
        for it in items:
            packed, block_scales = [], []
            for s in it.sources:
                k = s.shape[-1]
                m = math.prod(s.shape) // k
                p, sc = _carve(arena, m * k // 2), _carve(arena, m * k // GROUP)
                v = values[s.name]
                if isinstance(v, Int4Rows):
                    clib.int4_quant(lib, v.codes.ctypes.data, v.scale.ctypes.data, m, k, v.groups, ct, s2,
                                    p.ctypes.data, sc.ctypes.data, threads)
                else:
                    kernel(lib, v[0].ctypes.data, m, k, v[1] == "F32", s2, p.ctypes.data, sc.ctypes.data, threads)
                packed.append(p)
                block_scales.append(sc)
            _store(res, formats.outputs(it, {"codes": packed, "scales": block_scales,
                                             "global": [np.array([s2], dtype=np.float32)]}))
            method = "requantized" if it.sources[0].encoding != Encoding.DENSE else "quantized"
            res.notes[it.name] = {"source_encoding": it.sources[0].encoding, "method": method, "amax": amax}

    def _values(self, s: SourceTensor, reader: TensorSource) -> tuple[Chunk, str] | Int4Rows:
        """A source's values as the kernels read them: its stored bytes (dense), decoded to fp32 (FP8), or its
        codes (INT4: decoded a row at a time by the kernels)."""
        if _dense(s):
            return reader.raw(s.parts[0]), s.dtype
        if s.encoding == INT4:
            return int4_rows(s, reader, self.lib, self.threads)
        return decode_fp8_block(s, reader, self.block).reshape(-1).view(np.uint8), "F32"


def _k_max(s: SourceTensor, reader: TensorSource) -> int:
    """A weight's own ``k_max`` (``kernels.mxfp4_cast.k_max``); an E8M0 NaN byte refused in its words."""
    e8m0 = reader.raw(s.parts[1])
    top = int(e8m0.max()) if e8m0.size else 0
    if top == scales.E8M0_NAN:
        hits = np.argwhere(e8m0.reshape(s.parts[1].shape) == scales.E8M0_NAN)
        raise refused(s.parts[1], scales.mxfp4_nan_message(int(hits[0][0]), int(hits[0][1]), len(hits)))
    return top - scales.E8M0_BIAS if top else 0


def flat_bytes(a) -> np.ndarray:
    """A contiguous array's bytes as a flat uint8 view (no copy)."""
    return np.asarray(a).reshape(-1).view(np.uint8)


def _store(res: UnitResult, outputs: list[tuple[str, list]]) -> None:
    """A format's tensors (name, parts) into the result, each part as its flat bytes."""
    for name, parts in outputs:
        res.outputs[name] = Output([flat_bytes(a) for a in parts])


def _carve(arena: Arena, nbytes: int) -> np.ndarray:
    """``nbytes`` of the unit's pool buffer, or a fresh array where they do not fit (never: it is sized for them)."""
    got = arena.carve(nbytes)
    return got if got is not None else np.empty(nbytes, dtype=np.uint8)
