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
