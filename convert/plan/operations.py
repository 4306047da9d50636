"""Each item's operation, decided once when the plan is made: the one answer that every backend's compute step
(``convert/steps.py``: the C kernels without torch, torch on the CPUs or a GPU) and ``--device auto``'s kinds of
work (``pipeline.choose.work_kind``) read from ``Item.operation``, instead of each deriving cast vs quantize vs
block FP8 vs keep again.

A function of the plan alone (the item's kind, its sources' encodings, its output format's arithmetic), so the same
unit gets the same operation in every process and on every backend."""

from __future__ import annotations

import functools
from dataclasses import replace

from .. import encodings, schemes
from .model import Kind, Operation, SourceTensor, Unit


def of_item(kind: Kind, output_format: str | None, sources: list[SourceTensor], experts: int = 0) -> Operation:
    """A quantized item's operation is its scheme's (``operation``: NVFP4's cast where every source holds MXFP4
    codes, its stacked bank's where ``experts``); another item's bytes are its sources' as stored (``COPY``) or
    their values decoded (``DECODE``)."""
    if schemes.quantized(kind):
        return scheme_operation(kind, output_format, all(encodings.holds_mxfp4(s) for s in sources), bool(experts))
    for s in sources:
        if not encodings.as_stored(s):
            return Operation.DECODE
    return Operation.COPY


@functools.cache
def scheme_operation(kind: Kind, output_format: str | None, from_mxfp4: bool, stacked: bool = False) -> Operation:
    """The scheme's answer, asked once per (scheme, format, MXFP4 or not, stacked bank or not): the plan of the
    released K3 asks it for half a million items."""
    return Operation(schemes.get(kind).operation(schemes.spelling(kind, output_format).arithmetic, from_mxfp4,
                                                 stacked))


def agreed(unit: Unit) -> Unit:
    """A unit's items (members under one global scale) decided together: where their sources disagree (one
    member's MXFP4 codes cast, another's values quantized), each is computed from its values, under one amax."""
    if len(unit.items) < 2 or len({it.operation for it in unit.items}) < 2:
        return unit
    return replace(unit, items=tuple(replace(it, operation=scheme_operation(it.kind, it.output_format, False,
                                                                             bool(it.experts)))
                                     for it in unit.items))
