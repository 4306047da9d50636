"""Compute stage: turn one planned unit into output bytes.

Kept and copied tensors are the source bytes themselves (views of the buffers they were read into,
concatenated in member order), so they are byte-identical to their sources. NVFP4 tensors are built from the members one
at a time under one global scale taken over the whole fused module (or scale group): the fused
high-precision tensor is never materialised, and its quantized rows are the members' rows in order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kimi_convert.kernels import Backend, outputs
from kimi_convert.kernels.outputs import Arena

from . import encodings, steps
from .compute_early import Chunk, Output, Results, UnitResult, not_finite
from .plan import Encoding, Item, SourceTensor, Unit
from .readers import TensorSource

__all__ = ["Chunk", "HostSink", "Output", "TorchUnit", "UnitResult", "as_bytes", "compute_unit", "decode"]


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


@dataclass
class TorchUnit(Results):
    """A unit being computed with torch (``kernels.Backend``: the CPUs, the reference or a GPU): what a scheme's
    torch step (``steps.STEPS``, the ``torch`` rows) reads and where its outputs go."""

    reader: TensorSource
    backend: Backend
    block: tuple[int, int]  # the checkpoint's FP8 tile (``plan.fp8_block_size``)
    res: UnitResult

    def values(self, src: SourceTensor) -> torch.Tensor:
        """``src``'s values on the backend's device (``decode``)."""
        return decode(src, self.reader, self.block, self.backend)

    def codes(self, src: SourceTensor) -> encodings.MxCodes:
        """The source's MXFP4 codes, scales and own ``k_max`` on the host (the backend moves them); a NaN scale
        refused here."""
        codes = encodings.mxfp4_codes(src, [self.reader.tensor(p) for p in src.parts])
        assert codes is not None, src.encoding  # the plan casts only sources that hold MXFP4
        return codes

    def amax(self, src: SourceTensor, v: torch.Tensor) -> torch.Tensor:
        """fp32 amax of ``v`` (``src``'s values); a NaN or an Inf refused, naming the tensor."""
        a = self.backend.amax(v)
        if not bool(torch.isfinite(a)):
            raise not_finite(src)
        return a

    @staticmethod
    def flat(part) -> Chunk:
        """An output part as the writer takes it: its bytes on the host (``as_bytes``)."""
        return as_bytes(part)

    def decoded(self, it: Item) -> None:
        """A kept linear layer whose source is MXFP4 or FP8, decoded to bf16 (exact for MXFP4), or a dense source
        with a view (a gpt-oss expert's half of a bias): its view's values, in their stored dtype
        (``Operation.DECODE``)."""
        self.res.outputs[it.outputs[0].name] = Output([
            as_bytes(v if s.encoding == Encoding.DENSE else v.to(torch.bfloat16))
            for s in it.sources for v in (self.values(s),)])
        if not all(s.encoding == Encoding.DENSE for s in it.sources):
            self.res.notes[it.name] = {"decoded_from": it.sources[0].encoding, "to": "BF16"}


def compute_unit(unit: Unit, reader: TensorSource, backend: Backend, block: tuple[int, int]) -> UnitResult:
    """Each item by its operation (the plan's, ``Item.operation``) through the dispatcher's torch steps
    (``steps.run``): the same for every torch backend."""
    res = UnitResult({})
    steps.run(unit, steps.TORCH, TorchUnit(reader, backend, block, res))
    return res
