"""Block FP8: E4M3 values, one F32 scale per ``BLOCK`` x ``BLOCK`` tile, weight only (ModelOpt's ``FP8_PB_WO``,
NVIDIA's K3 recipe for its attention). Everything the tool knows of the scheme itself, apart from its kernels'
arithmetic (``kernels/src``: ``fp8_block`` in torch, ``recipe_cpu.c`` and ``recipe_triton`` held to its bytes):
the tensors a module becomes (``roles``), each output format's names for them (``SPELLINGS``: ModelOpt only;
compressed-tensors refuses the scheme), the weights it can take (``shape_error``), the manifest's record
(``record``) and the numeric check's bound (``engine_bound``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .base import Spelling, row_err

if TYPE_CHECKING:
    import torch

NAME = "fp8-block"  # the recipes' and the plan's name (``SchemeName.FP8_BLOCK``)
TITLE = "block FP8"  # the summaries' word (plan's totals, pack's line)
CARD = "128x128 block FP8"  # the model card's "quantized to ..." row
TOTALS = "fp8_block"  # the manifest's totals key
BLOCK = 128  # the tile (rows and columns)
INPUT_SCALE = False  # weight only: no activation scale


def roles(shape: tuple[int, ...], scalar: tuple[int, ...]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """dtype and shape of each role: the e4m3 values, and one F32 scale a tile in the shape NVIDIA's K3 converter
    writes (``[ceil(N/128), 1, ceil(K/128), 1]``)."""
    n, k = shape
    return {"codes": ("F8_E4M3", shape), "scales": ("F32", (-(-n // BLOCK), 1, -(-k // BLOCK), 1))}


def shape_error(shape: tuple[int, ...], fused: bool, stacked: bool) -> str | None:
    """Why a weight cannot be block FP8 (the words after "selected for block FP8"), or None: 2-D, not a stack of
    experts, K a multiple of the tile (the engines refuse another)."""
    if len(shape) != 2 or stacked:
        return "is not 2-D"
    if shape[1] % BLOCK:
        return f"but K={shape[1]} is not a multiple of {BLOCK} (the engines refuse it)"
    return None


def record(algo: str, shared_scale: str | None, input_scale: float | None) -> dict:
    """The manifest record's ``quantization`` entry (no global scale, no activation scale)."""
    return {"format": NAME, "block": [BLOCK, BLOCK], "quant_algo": algo}


SPELLINGS = {
    "modelopt": Spelling(tensors=(("codes", ".weight"), ("scales", ".weight_scale")), algos=("FP8_PB_WO",)),
}


def engine_bound(placed: list, layer: dict, expert: int | None, rows: Callable) -> list[tuple[torch.Tensor,
                                                                                              torch.Tensor]]:
    """Per placed source block (``numerics.Ref``, first row, rows): each row's error ModelOpt's 128x128 block FP8
    (``kernels.fp8_block``) makes on the stored tensor's own tile grid, then the rows this write placed; no element
    is read back exactly."""
    import torch

    return [(_bound(r)[s0: s0 + n], torch.zeros((n, r.values.shape[1]), dtype=torch.bool)) for r, s0, n in placed]


def _bound(r) -> torch.Tensor:
    import torch

    from ..kernels import fp8_block

    src = r.dense if r.dense is not None and r.dense.dtype == torch.bfloat16 else r.values
    q, s = fp8_block.quantize(src)
    return row_err(fp8_block.dequantize(q, s), r.values)
