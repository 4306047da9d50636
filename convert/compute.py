"""Compute stage: turn one planned unit into output bytes.

Kept and copied tensors are the source bytes themselves (views of the buffers they were read into,
concatenated in member order), so they are byte-identical to their sources. NVFP4 tensors are built from the members one
at a time under one global scale taken over the whole fused module (or scale group): the fused
high-precision tensor is never materialised, and its quantized rows are the members' rows in order.
"""

from __future__ import annotations

import numpy as np
import torch

from kimi_convert.kernels import Backend, ct_nvfp4, fp8_block, outputs, reference
from kimi_convert.kernels.outputs import Arena

from . import encodings, formats
from .compute_early import Chunk, Output, UnitResult, raw_chunks
from .errors import ConvertError
from .operations import Operation, operations
from .plan import FP8, NVFP4, Encoding, Item, SourceTensor, Unit
from .readers import TensorSource

__all__ = ["Chunk", "HostSink", "Output", "UnitResult", "as_bytes", "compute_unit", "decode"]


class HostSink(Arena):
    """Host memory that a unit's GPU results are copied into, asynchronously, on the current CUDA stream:
    one synchronization a unit (``finish``) instead of one blocking copy a tensor into fresh pageable memory,
    and DMA at full speed where ``buf`` is page-locked (the pipeline's pooled buffers are, on a GPU). A result
    that does not fit is read back the ordinary way. The arrays ``take`` returns hold their bytes only once
    ``finish`` has returned. (On the CPUs the same buffer is the kernels' ``Arena``: they write into it.)"""

    def take(self, t: torch.Tensor) -> np.ndarray | None:
        dst = self.carve(t.numel() * t.element_size())
        if dst is not None and dst.nbytes:
            torch.from_numpy(dst).copy_(t.reshape(-1).view(torch.uint8), non_blocking=True)
        return dst

    def finish(self) -> None:
        torch.cuda.current_stream().synchronize()


def as_bytes(t: torch.Tensor | np.ndarray) -> np.ndarray:
    """A contiguous tensor's bytes on the host as a flat uint8 array (fp8 and bf16 have no numpy dtype); a
    GPU tensor goes into the ``HostSink`` lent for this thread's unit when there is one (``outputs.use_arena``).
    A numpy array (a format's constant: ``input_scale``) is its own bytes."""
    if isinstance(t, np.ndarray):
        return np.ascontiguousarray(t).reshape(-1).view(np.uint8)
    t = t.detach().contiguous()
    sink = outputs.current()
    if t.device.type == "cuda" and isinstance(sink, HostSink) and (out := sink.take(t)) is not None:
        return out
    return t.cpu().reshape(-1).view(torch.uint8).numpy()


def decode(src: SourceTensor, reader: TensorSource, block: tuple[int, int], backend: Backend) -> torch.Tensor:
    """The source's values on the backend's device: the stored tensor for dense sources (a zero-copy
    view on the CPU), decoded fp32 otherwise (decoded on the GPU when there is one), by its encoding
    (``encodings.decode``)."""
    return encodings.decode(src, [backend.to_device(reader.tensor(p)) for p in src.parts], block)


def _keep_decoded(item: Item, reader: TensorSource, block, backend: Backend) -> list[Chunk]:
    """A kept linear layer whose source is MXFP4 or FP8: decoded to bf16 (exact for MXFP4); a dense source
    with a view (a gpt-oss expert's half of a bias): its view's values, in their stored dtype."""
    return [as_bytes(v if s.encoding == Encoding.DENSE else v.to(torch.bfloat16))
            for s in item.sources for v in (decode(s, reader, block, backend),)]


def compute_unit(unit: Unit, reader: TensorSource, backend: Backend, block: tuple[int, int]) -> UnitResult:
    """Each item by its operation (``operations``: decided once for every backend), the NVFP4 items last, together."""
    res = UnitResult({})
    ops = operations(unit)
    quant = [it for it in unit.items if it.kind == NVFP4]
    for it in unit.items:
        op = ops[it.name]
        if op is Operation.FP8_BLOCK:
            _fp8_block(it, reader, block, backend, res)
        elif op in (Operation.COPY, Operation.DECODE):
            chunks = raw_chunks(it, reader) if op is Operation.COPY else _keep_decoded(it, reader, block, backend)
            res.outputs[it.outputs[0].name] = Output(chunks)
            if not all(s.encoding == Encoding.DENSE for s in it.sources):
                res.notes[it.name] = {"decoded_from": it.sources[0].encoding, "to": "BF16"}
    if quant:
        if ops[quant[0].name] is Operation.CAST:
            _cast_mxfp4(quant, reader, backend, res)
        else:
            _quantize(quant, reader, backend, block, res)
    return res


def _emit(it: Item, packed: list[torch.Tensor], scales: list[torch.Tensor], s2: torch.Tensor, res: UnitResult,
          note: dict) -> None:
    for name, parts in formats.outputs(it, {"codes": packed, "scales": scales, "global": [s2.reshape(1)]}):
        res.outputs[name] = Output([as_bytes(p) for p in parts])
    res.notes[it.name] = {"source_encoding": it.sources[0].encoding, **note}


def _cast_mxfp4(items: list[Item], reader: TensorSource, backend: Backend, res: UnitResult) -> None:
    """NVIDIA's closed-form MXFP4 -> NVFP4 cast, one ``k_max`` shared by the unit (w1 and w3)."""
    codes = {s.name: _mxfp4_codes(s, reader) for it in items for s in it.sources}  # a NaN scale refused here
    shared = max(c.k_max for c in codes.values())
    for it in items:
        outs = [backend.cast_mxfp4(c.packed, c.scale, shared, c.k_max) for c in (codes[s.name] for s in it.sources)]
        blocks, lossless = sum(o[3].blocks for o in outs), sum(o[3].lossless for o in outs)
        _emit(it, [o[0] for o in outs], [o[1] for o in outs], outs[0][2], res,
              {"method": "mxfp4-cast", "k_max": shared, "blocks": blocks, "lossless_blocks": lossless})


def _mxfp4_codes(src: SourceTensor, reader: TensorSource) -> encodings.MxCodes:
    """The source's MXFP4 codes, scales and own ``k_max`` on the host (the backend moves them)."""
    codes = encodings.mxfp4_codes(src, [reader.tensor(p) for p in src.parts])
    assert codes is not None, src.encoding  # compute_unit casts only sources that hold MXFP4
    return codes


def _fp8_block(it: Item, reader: TensorSource, block: tuple[int, int], backend: Backend, res: UnitResult) -> None:
    """128x128 block FP8 of a 2-D weight (an MXFP4 or FP8 source is decoded to BF16 first). A module fused
    on disk is quantized on its own tile grid: where every member but the last has whole tiles of rows,
    that is its members' quantizations stacked row-wise (member by member, no concatenated copy); where
    a member ends mid-tile (K3's ``[q_a | kv_a | g]``), the tiles straddle members and the fused weight is
    quantized as one tensor, so that each 128-row tile has the one scale the engine's GEMM reads for it
    (docs/engines.md, "Numerics")."""
    qs, scales, zero = [], [], 0
    weights = []
    for src in it.sources:
        w = decode(src, reader, block, backend)
        if src.encoding != Encoding.DENSE:
            w = w.to(torch.bfloat16)
        if not bool(torch.isfinite(backend.amax(w))):
            raise ConvertError(f"{src.file}: tensor {src.name}: holds NaN or Inf; refusing to quantize it")
        weights.append(w)
    if any(w.shape[0] % fp8_block.BLOCK for w in weights[:-1]):
        weights = [torch.cat(weights)]
    for w in weights:
        q, scale = backend.fp8_block(w)
        qs.append(as_bytes(q))
        scales.append(as_bytes(scale))
        zero += int((scale == 0).sum())
    for name, parts in formats.outputs(it, {"codes": qs, "scales": scales}):
        res.outputs[name] = Output(parts)
    res.notes[it.name] = {"source_encoding": it.sources[0].encoding, "method": FP8, "zero_tiles": zero}


def _quantize(items: list[Item], reader: TensorSource, backend: Backend, block, res: UnitResult) -> None:
    values = {s.name: decode(s, reader, block, backend) for it in items for s in it.sources}
    amax = None
    for name, v in values.items():
        a = backend.amax(v)
        if not bool(torch.isfinite(a)):
            src = next(s for it in items for s in it.sources if s.name == name)
            raise ConvertError(f"{src.file}: tensor {name}: holds NaN or Inf; refusing to quantize it")
        amax = a if amax is None else torch.maximum(amax, a)
    ct = formats.arithmetic(items[0]) == "compressed-tensors"
    # compressed-tensors' own global scale is computed in the weights' dtype (kernels/src/ct_nvfp4.py)
    s2 = ct_nvfp4.global_scale(amax, next(iter(values.values())).dtype) if ct else reference.global_scale(amax)
    for it in items:
        outs = [backend.quantize_ct(values[s.name], s2) if ct else backend.quantize(values[s.name], amax)
                for s in it.sources]
        note = {"method": "requantized" if it.sources[0].encoding != Encoding.DENSE else "quantized",
                "amax": float(amax)}
        _emit(it, [o[0] for o in outs], [o[1] for o in outs], s2, res, note)
