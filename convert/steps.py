"""The one dispatcher of the compute stage: a table from (an item's operation, a backend) to the step that runs it,
read by both backends' entries (``compute.compute_unit``: torch on the CPUs or a GPU, through
``kernels.make_backend``; ``compute_early.EarlyCompute``: the C kernels without torch) and, through ``takes``, by the
pipeline's choice of a unit's backend. The operation is the plan's (``Item.operation``, decided once); a scheme's
steps are its module's ``STEPS`` (``convert/schemes/``), so a new scheme adds its rows there, not here. Torch-free:
the torch steps import it when they run."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .schemes import SCHEMES
from .schemes.base import Step

if TYPE_CHECKING:
    from .plan import Item, Unit

#: The backends: the C kernels on the read buffers, without torch (``compute_early``), and torch (``compute``:
#: ``kernels.Backend``, on the CPUs, the reference or a GPU).
C, TORCH = "c", "torch"


def _copy(items: list[Item], unit) -> None:
    for it in items:
        unit.copy(it)


def _decode(items: list[Item], unit) -> None:
    for it in items:
        unit.decoded(it)


def _c_decodes(it: Item, form: Callable[[object], str | None]) -> bool:
    """The C backend decodes FP8 sources only (``compute_early.CUnit.decoded``); MXFP4 kept and views: torch's."""
    return all(form(s) == "fp8" for s in it.sources)


def _table() -> dict[tuple[str, str], Step]:
    """Copies and decodes (the backends' own, no scheme's), and every scheme's steps."""
    table = {("copy", C): Step(_copy), ("copy", TORCH): Step(_copy), ("decode", TORCH): Step(_decode),
             ("decode", C): Step(_decode, accepts=_c_decodes)}
    for scheme in SCHEMES.values():
        table.update(scheme.STEPS)
    return table


STEPS = _table()


def takes(unit: Unit, backend: str, form: Callable[[object], str | None]) -> bool:
    """Whether ``backend`` has a step for each item's operation that accepts its sources (``Step.accepts``)."""
    for it in unit.items:
        step = STEPS.get((it.operation, backend))
        if step is None or (step.accepts is not None and not step.accepts(it, form)):
            return False
    return True


def run(unit: Unit, backend: str, on) -> None:
    """Each item by its operation's step on ``backend`` into ``on`` (the backend's view of the unit): the items one
    at a time in order, then each joint operation's items together (NVFP4's members under one global scale)."""
    joint: dict[str, list[Item]] = {}
    for it in unit.items:
        step = STEPS[(it.operation, backend)]
        if step.joint:
            joint.setdefault(it.operation, []).append(it)
        else:
            step.run([it], on)
    for op, items in joint.items():
        STEPS[(op, backend)].run(items, on)
