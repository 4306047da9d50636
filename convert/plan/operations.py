"""Each item's operation, decided once when the plan is made: the one answer that every backend's compute step
(``convert/steps.py``: the C kernels without torch, torch on the CPUs or a GPU) and ``--device auto``'s kinds of
work (``pipeline.choose.work_kind``) read from ``Item.operation``, instead of each deriving cast vs quantize vs
block FP8 vs keep again.

A function of the plan alone (the item's kind, its sources' encodings, its output format's arithmetic), so the same
unit gets the same operation in every process and on every backend."""

from __future__ import annotations

from dataclasses import replace

from .. import encodings, schemes
from .model import Kind, Operation, SourceTensor, Unit


def of_item(kind: Kind, output_format: str | None, sources: list[SourceTensor]) -> Operation:
    """A quantized item's operation is its scheme's (``operation``: NVFP4's cast where every source holds MXFP4
    codes); another item's bytes are its sources' as stored (``COPY``) or their values decoded (``DECODE``)."""
    if schemes.quantized(kind):
        arithmetic = schemes.spelling(kind, output_format).arithmetic
        return Operation(schemes.get(kind).operation(arithmetic, all(encodings.holds_mxfp4(s) for s in sources)))
    return Operation.COPY if all(encodings.as_stored(s) for s in sources) else Operation.DECODE


def agreed(unit: Unit) -> Unit:
    """A unit's items (members under one global scale) decided together: where their sources disagree (one
    member's MXFP4 codes cast, another's values quantized), each is computed from its values, under one amax."""
    if len(unit.items) < 2 or len({it.operation for it in unit.items}) < 2:
        return unit
    return replace(unit, items=tuple(replace(it, operation=Operation(schemes.get(it.kind).operation(
        schemes.spelling(it.kind, it.output_format).arithmetic, False))) for it in unit.items))
