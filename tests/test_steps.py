"""Decide once, dispatch once: each item's operation is the plan's (``Item.operation``, set by
``plan/operations.py``), and one table (``convert/steps.py``) maps (operation, backend) to the step that runs it, the
scheme modules' ``STEPS`` its scheme rows; the C backend takes a unit exactly where that table has an accepting step
for each of its items (``compute_early.takes``), and ``--device auto``'s kinds of work name the same value."""

from __future__ import annotations

import dataclasses

from kimi_convert import compute_early, schemes, steps
from kimi_convert.options import Options
from kimi_convert.pack import load_plan
from kimi_convert.pipeline import choose
from kimi_convert.plan import NVFP4, Operation, Unit
from kimi_convert.plan.operations import agreed


def test_every_operation_has_a_torch_step_and_each_scheme_registers_its_own():
    """torch computes every unit (the C backend only some): a scheme whose operation had no torch step would fail
    at pack time; each scheme's rows are its module's, keyed by its own operations."""
    for op in Operation:
        assert (op, steps.TORCH) in steps.STEPS, op
    for scheme in schemes.SCHEMES.values():
        assert {op for op, _ in scheme.STEPS} <= set(scheme.OPERATIONS.values())
        assert set(scheme.OPERATIONS.values()) <= {op for op, backend in scheme.STEPS if backend == steps.TORCH}


def test_the_plan_sets_each_operation_and_the_units_members_agree(tiny_k3):
    """nvidia-k3: the experts cast (MXFP4 codes), the attention block FP8, kept tensors copied; a unit's members one
    operation."""
    _, plan = load_plan(tiny_k3, Options())
    ops = {it.operation for u in plan.units for it in u.items}
    assert {Operation.CAST, Operation.FP8_BLOCK, Operation.COPY} <= ops
    for u in plan.units:
        quant = {it.operation for it in u.items if it.kind == NVFP4}
        assert len(quant) <= 1, [it.name for it in u.items]


def test_members_that_disagree_are_all_quantized(tiny_k3):
    """One member's MXFP4 codes cast and another's values quantized cannot share one global scale: ``agreed`` makes
    every member quantized; members that agree are left as they are."""
    _, plan = load_plan(tiny_k3, Options())
    unit = next(u for u in plan.units if len(u.items) > 1 and u.items[0].operation == Operation.CAST)
    assert agreed(unit) is unit
    mixed = Unit((unit.items[0], *(dataclasses.replace(it, operation=Operation.QUANTIZE) for it in unit.items[1:])),
                 unit.shared_scale, unit.shard)
    assert {it.operation for it in agreed(mixed).items} == {Operation.QUANTIZE}


def test_the_c_backend_takes_a_unit_by_the_table(tiny_k3, monkeypatch):
    """``compute_early.takes`` asks the table: without the C cast step the experts' units are torch's, and a unit
    whose operation is changed is taken (or not) by the new operation's step; ``work_kind`` names it."""
    _, plan = load_plan(tiny_k3, Options())
    cast = next(u for u in plan.units if any(it.operation == Operation.CAST for it in u.items))
    assert compute_early.takes(cast) and choose.work_kind(cast).startswith("mxfp4-cast@")
    monkeypatch.delitem(steps.STEPS, (Operation.CAST, steps.C))
    assert not compute_early.takes(cast)
    monkeypatch.undo()
    decoded = Unit(tuple(dataclasses.replace(it, operation=Operation.DECODE) for it in cast.items), None, cast.shard)
    assert not compute_early.takes(decoded)  # no C step decodes a kept MXFP4 weight (FP8 ones: test_early.py)
    assert choose.work_kind(decoded).startswith("decode-")
