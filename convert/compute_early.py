"""The compute stage without torch: the units whose every item is a dense BF16 or FP32 weight made NVFP4 (either
format's arithmetic; or a DeepSeek-style FP8 or Kimi K2.5 INT4 one, decoded here), a BF16 weight made 128x128 block
FP8, a Kimi K3 MXFP4 weight cast to NVFP4 by NVIDIA's closed form, or a stored tensor kept as it is, computed by the C
kernels on the read buffers (``kernels.clib``), with the bytes and notes ``compute.compute_unit`` gives on the CPU
backend (tests/test_early.py holds them to it, unit by unit and pack by pack).

Why: ``import torch`` takes 3.6-5 s on the H200 machine, and until it returns a stream's compute waited (2.8-5.5 s
of a 10 GB one-file input's 13-16 s: docs/compressed-tensors.md). A stream now computes the units this module
takes while torch loads (``--device auto``: until its runner is made, then the runner measures and chooses), and
with ``--device cpu`` always: a dense, FP8, Kimi K3 or Kimi K2.5 checkpoint is then converted without importing
torch at all (an FP8 weight kept is decoded to BF16 here too). Anything else (an MXFP4 weight not cast, fp16
weights, a slice of a stored tensor, NVIDIA's recipe with ``KIMI_CONVERT_RECIPE_KERNELS=torch``) is
``compute.compute_unit``'s.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kimi_convert.kernels import clib, scales
from kimi_convert.kernels.outputs import Arena
from kimi_convert.kernels.scales import FP8_SCALE_MAX, INT4_OVERFLOW, INT4_SCALE_NOT_FINITE, fp8_scale_fault

from . import encodings, formats, steps
from .encodings.base import refused
from .encodings.int4_pack import NAME as INT4
from .encodings.int4_pack import check_weight_shape
from .errors import ConvertError
from .plan import Encoding, Item, Operation, SourceTensor, Unit

if TYPE_CHECKING:
    from .readers import BufferPool, TensorSource

Chunk = memoryview | np.ndarray
_ITEMSIZE = {"BF16": 2, "F32": 4}


@dataclass
class Output:
    chunks: list[Chunk]  # written back to back at the tensor's offset


@dataclass
class UnitResult:
    outputs: dict[str, Output]
    notes: dict[str, dict] = field(default_factory=dict)  # per item: how it was produced


def sink_bytes(unit: Unit) -> int:
    """The pool buffer lent for a unit's outputs: their bytes, each part's alignment (64 bytes: a part per source, or
    per expert of a stacked bank), a page of slack."""
    return unit.nbytes_out + 4096 + 64 * sum(max(len(it.sources), it.experts) * len(it.outputs) for it in unit.items)


def raw_chunks(item: Item, reader: TensorSource) -> list[Chunk]:
    """A kept or copied item's bytes: its sources' stored bytes, member after member."""
    return [reader.raw(p) for s in item.sources for p in s.parts[:1]]


def takes(unit: Unit) -> bool:
    """Whether this module computes ``unit`` (a pure function of the plan, and of $KIMI_CONVERT_RECIPE_KERNELS:
    ``torch`` has NVIDIA's recipe computed by its torch code, which the tests compare the C kernels with): whether
    the dispatcher's C backend has a step for each item's operation (``Item.operation``) that accepts its sources
    (``form``)."""
    return steps.takes(unit, steps.C, form)


def form(s: SourceTensor) -> str | None:
    """What the C kernels read of a source (``schemes.base.Step.accepts`` asks): ``dense`` (its stored BF16 or FP32
    bytes), ``fp8`` or ``int4`` (decoded here: ``CUnit.values``), ``mxfp4`` (codes and E8M0 scales as stored,
    NVIDIA's cast's input), or None (torch's: fp16, a view, a part more or less)."""
    if _dense(s):
        return "dense"
    if _fp8_block(s):
        return "fp8"
    if _int4(s):
        return "int4"
    return "mxfp4" if _mxfp4(s) else None


def _mxfp4(s: SourceTensor) -> bool:
    """MXFP4 as stored, codes [N, K/2] and E8M0 bytes [N, K/32], two parts: Kimi K3's (``weight_packed`` U8,
    ``weight_scale`` U8) and DeepSeek V4's (``weight`` I8, ``scale`` F8_E8M0; the same bytes): the cast's input.
    gpt-oss's banks (a third part, a view) go through torch."""
    return encodings.holds_mxfp4(s) and not s.view and len(s.parts) == 2 and len(s.parts[0].shape) == 2


def _dense(s: SourceTensor) -> bool:
    return encodings.as_stored(s) and s.dtype in _ITEMSIZE and len(s.parts) == 1


def _fp8_block(s: SourceTensor) -> bool:
    """DeepSeek-style FP8 (e4m3 values, an F32 or BF16 scale a tile; a stacked bank's [E, N, K] too), decoded here as
    the torch code does."""
    return s.encoding == Encoding.FP8_BLOCK and not s.view and len(s.parts) == 2 and len(s.shape) in (2, 3) \
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


def _as_f32(raw: np.ndarray, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """A stored F32 or BF16 tensor's values as fp32 (bf16 widened: exact)."""
    if dtype == "F32":
        return raw.view(np.float32).reshape(shape)
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)


def fp8_scales(s: SourceTensor, reader: TensorSource) -> np.ndarray:
    """An FP8 weight's tile scales as fp32, refused where one is not finite or beyond ``FP8_SCALE_MAX`` (so that no
    product overflows), in the torch code's words."""
    w, sc = s.parts
    scale = _as_f32(reader.raw(sc), sc.dtype, tuple(sc.shape))
    bad = ~(np.abs(scale) <= FP8_SCALE_MAX)  # NaN compares false; no tile can then overflow (no RuntimeWarning)
    if bad.any():
        *e, i, j = (int(x) for x in np.argwhere(bad)[0])  # a stacked bank's scales: [expert, i, j]
        fault = fp8_scale_fault(i, j, float(scale[(*e, i, j)]))
        raise ConvertError(f"{sc.file}: tensor {sc.name}: {f'expert {e[0]}: ' if e else ''}{fault}: "
                           f"{w.name} cannot be decoded")
    return np.ascontiguousarray(scale)


@dataclass
class Stored:
    """A dense BF16 or FP32 weight's stored bytes as the C kernels read
    them (``CUnit.values``)."""

    src: SourceTensor
    buf: Chunk
    dtype: str  # BF16 or F32
    lib: ctypes.CDLL
    threads: int
    rows_from_codes = False  # the values themselves (``Int4Rows``: codes a kernel decodes a row at a time)

    def expert(self, e: int, src: SourceTensor, unit: CUnit) -> Stored:
        """Expert ``e`` of a stored bank (``src``: that expert's source): its byte range."""
        n = self.buf.nbytes // self.src.shape[0]
        return dataclasses.replace(self, buf=self.buf[e * n: (e + 1) * n], src=src)

    def finite_amax(self) -> float:
        """fp32 amax of the values; a NaN or an Inf refused in the torch code's words."""
        n = self.buf.nbytes // _ITEMSIZE[self.dtype]
        bits = clib.amax_bits(self.lib, self.buf.ctypes.data, n, self.dtype == "F32", self.threads)
        return finite_amax(self.src, bits)


def amax_of(bits: int) -> float:
    """The fp32 amax whose bits a kernel returned."""
    return float(np.array(bits, dtype=np.uint32).view(np.float32))


def finite_amax(src: SourceTensor, bits: int) -> float:
    """``amax_of(bits)``, refused where it is NaN or Inf (``not_finite``)."""
    a = amax_of(bits)
    if not math.isfinite(a):
        raise not_finite(src)
    return a


def not_finite(src: SourceTensor) -> ConvertError:
    """The one-line refusal of a weight holding a NaN or an Inf, both backends' words."""
    return ConvertError(f"{src.file}: tensor {src.name}: holds NaN or Inf; refusing to quantize it")


@dataclass
class Int4Rows:
    """An INT4 weight as the C kernels read it (``kc_int4_*_mt``: decoded a row at a time, never whole): its codes,
    its scales widened to fp32, and the amax of its values."""

    codes: np.ndarray
    scale: np.ndarray
    groups: int
    amax: float
    dtype: str = "F32"  # the values' dtype as a global scale reads it (decoded: fp32)
    rows_from_codes = True  # a kernel reads the codes (``quant``), not values

    def finite_amax(self) -> float:
        return self.amax  # refused where it is not finite already (``int4_rows``)

    def quant(self, lib: ctypes.CDLL, m: int, k: int, ct: bool, s2: float, packed: int, scales: int,
              threads: int) -> None:
        """The NVFP4 codes and block scales of the rows decoded (``clib.int4_quant``)."""
        clib.int4_quant(lib, self.codes.ctypes.data, self.scale.ctypes.data, m, k, self.groups, ct, s2, packed, scales,
                        threads)


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
    amax = amax_of(clib.int4_amax_bits(lib, codes.ctypes.data, sc.ctypes.data, n, k, groups, threads))
    if not math.isfinite(amax):
        raise refused(scale, INT4_OVERFLOW)
    return Int4Rows(codes, sc, groups, amax)


@dataclass
class Fp8Rows:
    """A block FP8 weight as the C kernels read it (``kc_fp8_*_mt``: decoded a row at a time, never whole): its
    e4m3 codes, its tile scales as fp32, the tile, and the amax of its values."""

    codes: np.ndarray
    scale: np.ndarray
    block: tuple[int, int]
    amax: float
    dtype: str = "F32"  # the values' dtype as a global scale reads it (decoded: fp32)
    rows_from_codes = True

    def finite_amax(self) -> float:
        return self.amax  # refused where it is not finite already (``fp8_rows``)

    def expert(self, e: int, src: SourceTensor, unit: CUnit) -> Fp8Rows:
        """Expert ``e`` of a stacked bank (``src``: that expert's source): its codes and tile scales, and its own
        amax."""
        experts = self.scale.shape[0]
        return fp8_expert_rows(src, self.codes.reshape(experts, -1)[e], self.scale[e], self.block, unit.lib,
                               unit.threads)

    def quant(self, lib: ctypes.CDLL, m: int, k: int, ct: bool, s2: float, packed: int, scales: int,
              threads: int) -> None:
        clib.fp8_quant(lib, self.codes.ctypes.data, self.scale.ctypes.data, m, k, self.block, ct, s2, packed, scales,
                       threads)


def fp8_rows(s: SourceTensor, reader: TensorSource, block: tuple[int, int], lib: ctypes.CDLL,
             threads: int) -> Fp8Rows:
    """An FP8 weight (``_fp8``) and its amax, refused where ``decode_fp8_block`` and the torch code refuse it (a scale
    not finite or too large; a NaN code: "holds NaN or Inf", as ``Stored.finite_amax`` of the decoded values)."""
    scale = fp8_scales(s, reader)
    codes = np.asarray(reader.raw(s.parts[0]))
    if len(s.shape) == 3:  # a stacked bank: each expert's rows and amax once narrowed (schemes.nvfp4._narrow_c)
        return Fp8Rows(codes, scale, block, math.nan)
    return fp8_expert_rows(s, codes, scale, block, lib, threads)


def fp8_expert_rows(s: SourceTensor, codes: np.ndarray, scale: np.ndarray, block: tuple[int, int], lib: ctypes.CDLL,
                    threads: int) -> Fp8Rows:
    """2-D FP8 codes and their tile scales (a weight's, or one expert's of a bank) with their amax, a NaN code refused
    naming ``s``."""
    m, k = s.shape
    bits = clib.fp8_amax_bits(lib, codes.ctypes.data, scale.ctypes.data, m, k, block, threads)
    return Fp8Rows(codes, scale, block, finite_amax(s, bits))


class Results:
    """What both backends' views of a unit (``CUnit`` here, ``compute.TorchUnit``) do alike with its outputs: a
    copied item's stored bytes, and a quantized item's tensors by role, each part through the view's ``flat``."""

    reader: TensorSource
    res: UnitResult

    def store(self, it: Item, roles: dict[str, list], note: dict) -> None:
        """A quantized item's tensors by role (``formats.outputs``) into the result, each part as its flat bytes
        (``flat``), and its note."""
        for name, parts in formats.outputs(it, roles):
            self.res.outputs[name] = Output([self.flat(p) for p in parts])
        self.res.notes[it.name] = {"source_encoding": it.sources[0].encoding, **note}

    def copy(self, it: Item) -> None:
        """A kept or copied item's stored bytes (``Operation.COPY``)."""
        self.res.outputs[it.outputs[0].name] = Output(raw_chunks(it, self.reader))

    @staticmethod
    def flat(part) -> Chunk:
        raise NotImplementedError


@dataclass
class CUnit(Results):
    """A unit being computed by the C kernels on its read buffers: what a scheme's C step (``steps.STEPS``, the
    ``c`` rows) reads, and the pool buffer lent for its outputs (``arena``: written in place, no fresh memory)."""

    reader: TensorSource
    lib: ctypes.CDLL
    threads: int
    block: tuple[int, int]  # the checkpoint's FP8 tile (``plan.fp8_block_size``)
    arena: Arena
    res: UnitResult

    def values(self, s: SourceTensor) -> Stored | Int4Rows | Fp8Rows:
        """A source's values as the kernels read them (``form``): its stored bytes (dense), or its codes (INT4, FP8:
        decoded a row at a time by the kernels)."""
        if _dense(s):
            return Stored(s, self.reader.raw(s.parts[0]), s.dtype, self.lib, self.threads)
        if s.encoding == INT4:
            return int4_rows(s, self.reader, self.lib, self.threads)
        return fp8_rows(s, self.reader, self.block, self.lib, self.threads)

    def decoded(self, it: Item) -> None:
        """A kept linear layer stored FP8 (``Operation.DECODE``: the C row of ``steps`` takes only these), each
        source decoded (``kernels.encodings.decode_fp8_block``'s values) and rounded to bf16 as torch rounds on the CPU
        a row at a time by ``kc_fp8_decode_bf16_mt``, into the unit's pool buffer: ``compute.TorchUnit.decoded``'s bytes
        and note."""
        chunks = []
        for s in it.sources:
            scale, codes = fp8_scales(s, self.reader), np.asarray(self.reader.raw(s.parts[0]))
            *lead, m, k = s.shape  # a stacked bank (kept): expert by expert, each its own tiles
            experts = lead[0] if lead else 1
            for e in range(experts):
                out = self.carve(2 * m * k)
                clib.fp8_decode_bf16(self.lib, codes.reshape(experts, -1)[e].ctypes.data,
                                     scale.reshape(experts, -1)[e].ctypes.data, m, k, self.block, out.ctypes.data,
                                     self.threads)
                chunks.append(out)
        self.res.outputs[it.outputs[0].name] = Output(chunks)
        self.res.notes[it.name] = {"decoded_from": it.sources[0].encoding, "to": "BF16"}

    def raw(self, part) -> np.ndarray:
        """A stored tensor's bytes as read."""
        return self.reader.raw(part)

    def k_max(self, s: SourceTensor) -> int:
        """A weight's own ``k_max`` (``kernels.mxfp4_cast.k_max``); an E8M0 NaN byte refused in its words."""
        e8m0 = self.reader.raw(s.parts[1])
        top = int(e8m0.max()) if e8m0.size else 0
        if top == scales.E8M0_NAN:
            hits = np.argwhere(e8m0.reshape(s.parts[1].shape) == scales.E8M0_NAN)
            raise refused(s.parts[1], scales.mxfp4_nan_message(int(hits[0][0]), int(hits[0][1]), len(hits)))
        return top - scales.E8M0_BIAS if top else 0

    def carve(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of the unit's pool buffer, or a fresh array where they do not fit (never: it is sized for
        them)."""
        got = self.arena.carve(nbytes)
        return got if got is not None else np.empty(nbytes, dtype=np.uint8)

    @staticmethod
    def flat(part) -> Chunk:
        """An output part as the writer takes it: its bytes, flat (``flat_bytes``)."""
        return flat_bytes(part)


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
        once the writer has written and hashed them. Each item by its operation's C step (``steps.run``), in
        ``compute.compute_unit``'s order."""
        res = UnitResult({})
        if all(it.operation == Operation.COPY for it in unit.items):  # the read buffers themselves: no pool buffer
            for it in unit.items:
                res.outputs[it.outputs[0].name] = Output(raw_chunks(it, reader))
            return res, None
        arena = Arena(pool.get(sink_bytes(unit)))
        try:
            steps.run(unit, steps.C, CUnit(reader, self.lib, self.threads, self.block, arena, res))
        except BaseException:
            pool.put(arena.buf)
            raise
        return res, arena.buf


def flat_bytes(a) -> np.ndarray:
    """A contiguous array's bytes as a flat uint8 view (no copy)."""
    return np.asarray(a).reshape(-1).view(np.uint8)
