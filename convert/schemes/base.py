"""The vocabulary every scheme module and its callers share: how one output format spells a scheme
(``Spelling``), the numeric check's measure (``row_err``), and the constant activation scale's checks. A leaf: it
imports nothing of the package. (The enum of scheme names, ``SchemeName``, is built from the registry in
``schemes/__init__``.)"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


#: (suffix, dtype, shape) of one output tensor, as the plan sizes it
TensorSpec = tuple[str, str, tuple[int, ...]]


@dataclass(frozen=True)
class Spelling:
    """How one output format writes one scheme: the tensors a module becomes (each a role of the scheme's
    result, named by the format), the format's names for the scheme in its configs, and its conventions for
    scalars. The scheme module holds one per output format it can be written in (``SPELLINGS``); a format that
    has none refuses the scheme."""

    #: (role, name suffix) of each output tensor, in the order they are written; the role ``input`` (the recipe's
    #: constant activation scale) only where the recipe pins one
    tensors: tuple[tuple[str, str], ...]
    #: the format's quant_algo of a module: (weight only, with a constant activation scale)
    algos: tuple[str, ...]
    #: the shape a scalar (a global or an activation scale) is written in
    scalar: tuple[int, ...] = ()
    #: the activation scale is written as its reciprocal (compressed-tensors' ``input_global_scale``)
    reciprocal_input: bool = False
    #: what a per-layer quantization map (ModelOpt's ``quantized_layers``) adds to a module's quant_algo
    layer_keys: tuple[tuple[str, object], ...] = ()
    #: the format's config group of one quant_algo and its targets (None: ``{"quant_algo": ..., "targets": ...}``)
    group: Callable[[str, list[str]], dict] | None = None
    #: whose arithmetic makes the bytes (the kernels' reference: "modelopt"; or the format's own, which the compute
    #: stage then runs: "compressed-tensors")
    arithmetic: str = "modelopt"

    def algo(self, input_scale: float | None) -> str:
        """The format's name for a module of this scheme (with or without a constant activation scale)."""
        return self.algos[1] if input_scale is not None and len(self.algos) > 1 else self.algos[0]


def row_err(w: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Relative L2 error of each row of ``w`` against ``r``; inf where the source row is 0 and the read is not (the
    numeric check's measure, and each scheme's bound in it)."""
    import torch

    d = (w - r).norm(dim=-1)
    n = r.norm(dim=-1)
    return torch.where(n > 0, d / n.clamp_min(1e-38), torch.where(d > 0, torch.inf, 0.0))


#: The largest finite F32 value: a constant scale is written as F32 (ModelOpt's ``input_scale``) or as its
#: reciprocal (compressed-tensors' ``input_global_scale``).
F32_MAX = 3.4028234663852886e38


def scale_error(x: object) -> str | None:
    """Why ``x`` cannot be a constant activation scale, or None: it must be a positive number whose F32 value and
    F32 reciprocal are both finite and non-zero (1e39 would be written as ``inf``, 1e-39 as 0 or its
    reciprocal as ``inf``: values no engine can use)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return "must be a number"
    if not 0 < x < float("inf"):
        return f"{x} is not a positive finite number"
    if not 1 / F32_MAX <= x <= F32_MAX:
        return (f"{x} is outside the F32 range it is written in ({1 / F32_MAX:.3g} to {F32_MAX:.3g}, "
                "for the scale and its reciprocal)")
    return None
