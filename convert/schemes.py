"""The quantization schemes a recipe chooses between, and their fixed sizes: a leaf every stage reads
(recipes name a scheme per module, the plan sizes tensors by it, each output format spells it)."""

from __future__ import annotations

from enum import StrEnum


class Format(StrEnum):
    """A module's quantization scheme (the plan's ``Kind`` of a linear module)."""

    NVFP4 = "nvfp4"
    FP8_BLOCK = "fp8-block"
    KEEP = "keep"


FP8_BLOCK = 128  # the tile of the fp8-block scheme (rows and columns)
GROUP_SIZE = 16  # the block of the nvfp4 scheme (values per e4m3 scale)


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
