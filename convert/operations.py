"""What computing each item of a unit is, decided once: the one answer that ``compute.compute_unit`` (torch),
``compute_early.takes`` (the C kernels without torch) and ``pipeline.choose.work_kind`` (``--device auto``'s kinds
of work) all read, instead of each deriving cast vs quantize vs block FP8 vs keep again.

A function of the plan alone (the item's kind, its sources' encodings, its output format's NVFP4 arithmetic), so
the same unit gets the same operation in every process and on every backend."""

from __future__ import annotations

from enum import StrEnum

from . import encodings, formats, schemes
from .plan import NVFP4, Item, Unit


class Operation(StrEnum):
    COPY = "copy"  # the stored bytes as they are (dense, no view): a kept or copied tensor
    DECODE = "decode"  # kept in high precision, decoded to BF16 (an MXFP4 or FP8 source, or a view)
    FP8_BLOCK = "fp8-block"  # 128x128 block FP8 (a coded source decoded to BF16 first)
    QUANTIZE = "nvfp4"  # NVFP4 (a coded source decoded to BF16 first), the unit's members under one amax
    CAST = "mxfp4-cast"  # NVIDIA's closed-form MXFP4 -> NVFP4 cast (every NVFP4 member MXFP4, ModelOpt's math)


def nvfp4_operation(quant: list[Item]) -> Operation:
    """The unit's NVFP4 items, decided together (w1 and w3 share one ``k_max`` or one amax): NVIDIA's cast where
    every source holds MXFP4 codes and the output format computes ModelOpt's arithmetic, else quantized."""
    modelopt_math = formats.arithmetic(quant[0]) == "modelopt"
    if modelopt_math and all(encodings.holds_mxfp4(s) for it in quant for s in it.sources):
        return Operation.CAST
    return Operation.QUANTIZE


def operations(unit: Unit) -> dict[str, Operation]:
    """Each item's operation, by item name."""
    quant = [it for it in unit.items if it.kind == NVFP4]
    nvfp4 = nvfp4_operation(quant) if quant else Operation.QUANTIZE
    out = {}
    for it in unit.items:
        if it.kind == NVFP4:
            out[it.name] = nvfp4
        elif schemes.quantized(it.kind):  # another scheme: its own step, named as the scheme
            out[it.name] = Operation(it.kind)
        else:
            stored = all(encodings.as_stored(s) for s in it.sources)
            out[it.name] = Operation.COPY if stored else Operation.DECODE
    return out
