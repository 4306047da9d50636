"""Quantization schemes: one module per scheme a recipe can choose for a linear module (``nvfp4``,
``fp8_block``; ``keep`` is the absence of one), each owning everything about it that is not a kernel's
arithmetic: its output tensors and their dtypes and shapes, each output format's names for them and for the
scheme in its configs, the weights it can take, its manifest record, the numeric check's bound, and its items'
operations with their compute steps, one a backend (``OPERATIONS``, ``operation``, ``STEPS``: its kernels' entry,
which ``convert/steps.py`` dispatches to). Callers ask
this registry (``get``, ``quantized``, ``tensor_specs``, ``outputs``) instead of testing a scheme's name; an output
format (``convert/formats``) spells any scheme through its ``Spelling``.

A new scheme is one module here with what :class:`Scheme` lists and its ``SCHEMES`` entry (which gives it its
``SchemeName`` member, the plan's ``Kind`` and its ``Operation`` members), and its kernels (``kernels/src``, reached
through ``kernels.Backend`` or the C library): docs/architecture.md, "Adding a quantization scheme". A leaf: nothing
here imports the rest of the package (the kernels and torch only inside the steps, when they run).
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

from . import fp8_block, nvfp4
from .base import F32_MAX, Spelling, Step, TensorSpec, scale_error

if TYPE_CHECKING:
    import torch

__all__ = ["F32_MAX", "GROUP_SIZE", "SCHEMES", "Scheme", "SchemeName", "Spelling", "TensorSpec", "by_algo", "get",
           "outputs", "quantized", "scale_error", "spelled_by", "spelling", "tensor_specs"]

GROUP_SIZE = nvfp4.GROUP_SIZE  # the block of the nvfp4 scheme (values per e4m3 scale)


class Scheme(Protocol):
    """What each scheme module defines (module-level names)."""

    NAME: str  # the recipe's and the plan's name (a ``SchemeName`` value)
    TITLE: str  # the summaries' word ("NVFP4 modules")
    CARD: str  # the model card's ("quantized to ...")
    TOTALS: str  # the manifest's totals key
    INPUT_SCALE: bool  # a recipe may pin a constant activation scale for it
    #: output format name -> how that format writes the scheme (a format with none refuses it)
    SPELLINGS: dict[str, Spelling]
    #: its items' operations (the plan's ``Operation`` members: name -> value); each value's compute step, one a
    #: backend, is in ``STEPS``
    OPERATIONS: dict[str, str]
    #: (operation, backend) -> its compute step (``base.Step``): the kernels' entry, read by ``convert/steps.py``
    STEPS: dict[tuple[str, str], Step]

    def operation(self, arithmetic: str, from_mxfp4: bool, stacked: bool) -> str:
        """An item's operation, from its format's arithmetic, whether every source holds MXFP4 codes and whether it
        is a stacked expert bank (quantized one expert at a time)."""

    def roles(self, shape: tuple[int, ...], scalar: tuple[int, ...]) -> dict[str, tuple[str, tuple[int, ...]]]:
        """role -> (dtype, shape) of a module whose weight has ``shape``."""

    def shape_error(self, shape: tuple[int, ...], fused: bool, stacked: bool, experts: int) -> str | None:
        """Why a weight of ``shape`` cannot take the scheme (after "selected for TITLE"), or None (``experts``: a
        stacked expert bank's count, 0 for another weight)."""

    def record(self, algo: str, shared_scale: str | None, input_scale: float | None) -> dict:
        """The manifest record's ``quantization`` entry."""

    def engine_bound(self, refs: list, layer: dict, expert: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The numeric check's bound: per placed source block, (each row's relative error the scheme itself
        makes, the elements it must read back exactly)."""


SCHEMES: dict[str, Scheme] = {nvfp4.NAME: nvfp4, fp8_block.NAME: fp8_block}  # type: ignore[dict-item]

#: A module's quantization scheme as a recipe names it: every registered scheme (``NVFP4``, ``FP8_BLOCK``: its name
#: upper-cased, ``-`` as ``_``), and ``KEEP`` (none: the module stays in high precision). The plan's ``Kind`` adds
#: ``COPY``.
SchemeName = StrEnum("SchemeName", [*((n.upper().replace("-", "_"), n) for n in SCHEMES), ("KEEP", "keep")],
                     module=__name__)


def get(kind: str) -> Scheme:
    """The scheme module of a quantized plan kind (a ``KeyError`` for ``keep`` / ``copy``)."""
    return SCHEMES[kind]


def quantized(kind: str) -> bool:
    """Whether ``kind`` (a plan kind, a manifest record's ``kind``) is a quantization scheme."""
    return kind in SCHEMES


def spelling(kind: str, fmt: str) -> Spelling:
    """How output format ``fmt`` writes scheme ``kind``; a ValueError where it cannot."""
    try:
        return SCHEMES[kind].SPELLINGS[fmt]
    except KeyError:
        raise ValueError(f"the {fmt} format does not spell {kind} modules") from None


def spelled_by(fmt: str) -> frozenset[str]:
    """The plan kinds an output format can write: the schemes it spells, and ``keep``."""
    return frozenset({SchemeName.KEEP.value, *(n for n, s in SCHEMES.items() if fmt in s.SPELLINGS)})


def tensor_specs(kind: str, fmt: str, shape: tuple[int, ...], input_scale: bool, experts: int = 0
                 ) -> tuple[TensorSpec, ...]:
    """(suffix, dtype, shape) of each output tensor of one module, in the order ``outputs`` fills them (a stacked
    bank's scalars one per expert: [experts] and the format's scalar shape after it)."""
    sp = spelling(kind, fmt)
    by_role = SCHEMES[kind].roles(shape, (experts, *sp.scalar) if experts else sp.scalar)
    return tuple((suffix, *by_role[role]) for role, suffix in sp.tensors if role != "input" or input_scale)


def outputs(kind: str, fmt: str, names: tuple[str, ...], input_scale: float | None, parts: dict[str, list],
            experts: int = 0) -> list[tuple[str, list]]:
    """Output tensor name -> its parts (one per source member, or per expert of a stacked bank), from a unit's result
    by role (the constant activation scale added, as the format writes it: once per expert of a stacked bank)."""
    sp = spelling(kind, fmt)
    if input_scale is not None:
        import numpy as np

        value = 1.0 / input_scale if sp.reciprocal_input else input_scale
        parts = {**parts, "input": [np.full(max(experts, 1), value, dtype=np.float32)]}
    return [(name, parts[role]) for name, (role, _) in zip(names, sp.tensors, strict=False)]


def by_algo(fmt: str, algo: str) -> Spelling | None:
    """The spelling in ``fmt`` whose scheme a quant_algo names (None: no scheme's, e.g. ``MIXED_PRECISION``)."""
    return next((s.SPELLINGS[fmt] for s in SCHEMES.values() if fmt in s.SPELLINGS and algo in s.SPELLINGS[fmt].algos),
                None)
