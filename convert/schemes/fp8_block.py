"""Block FP8: E4M3 values, one F32 scale per ``BLOCK`` x ``BLOCK`` tile, weight only (ModelOpt's ``FP8_PB_WO``,
NVIDIA's K3 recipe for its attention). Everything the tool knows of the scheme itself, apart from its kernels'
arithmetic (``kernels/src``: ``fp8_block`` in torch, ``recipe_cpu.c`` and ``recipe_triton`` held to its bytes):
the tensors a module becomes (``roles``), each output format's names for them (``SPELLINGS``: ModelOpt only;
compressed-tensors refuses the scheme), the weights it can take (``shape_error``), the manifest's record
(``record``) and the numeric check's bound (``engine_bound``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from .base import Spelling, Step, recipe_kernels, row_err

if TYPE_CHECKING:
    import torch

NAME = "fp8-block"  # the recipes' and the plan's name (``SchemeName.FP8_BLOCK``)
TITLE = "block FP8"  # the summaries' word (plan's totals, pack's line)
CARD = "128x128 block FP8"  # the model card's "quantized to ..." row
TOTALS = "fp8_block"  # the manifest's totals key
BLOCK = 128  # the tile (rows and columns)
INPUT_SCALE = False  # weight only: no activation scale
OPERATIONS = {"FP8_BLOCK": "fp8-block"}  # the plan's operation of its items (``plan.Operation``): one, its name


def operation(arithmetic: str, from_mxfp4: bool, stacked: bool = False) -> str:
    """Every item's operation: the scheme's one (a coded source is decoded to BF16 first; a stacked bank is refused
    by ``shape_error`` before)."""
    return OPERATIONS["FP8_BLOCK"]


def roles(shape: tuple[int, ...], scalar: tuple[int, ...]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """dtype and shape of each role: the e4m3 values, and one F32 scale a tile in the shape NVIDIA's K3 converter
    writes (``[ceil(N/128), 1, ceil(K/128), 1]``)."""
    n, k = shape
    return {"codes": ("F8_E4M3", shape), "scales": ("F32", (-(-n // BLOCK), 1, -(-k // BLOCK), 1))}


def shape_error(shape: tuple[int, ...], fused: bool, stacked: bool, experts: int = 0) -> str | None:
    """Why a weight cannot be block FP8 (the words after "selected for block FP8"), or None: 2-D, not a stack of
    experts (fused, or a stacked bank: ``experts``), K a multiple of the tile (the engines refuse another)."""
    if experts:
        return "is a stacked expert bank (only NVFP4 writes one per expert)"
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


# -- its kernels' entry: the compute step of its operation (convert/steps.py's table) --------------------------
# ``unit`` is the backend's view of the unit being computed (``compute.TorchUnit``, ``compute_early.CUnit``).


def quantize_torch(items: list, unit) -> None:
    """128x128 block FP8 of a 2-D weight (an MXFP4 or FP8 source is decoded to BF16 first). A module fused
    on disk is quantized on its own tile grid: where every member but the last has whole tiles of rows,
    that is its members' quantizations stacked row-wise (member by member, no concatenated copy); where
    a member ends mid-tile (K3's ``[q_a | kv_a | g]``), the tiles straddle members and the fused weight is
    quantized as one tensor, so that each 128-row tile has the one scale the engine's GEMM reads for it
    (docs/engines.md, "Numerics")."""
    import torch

    (it,) = items
    weights = []
    for src in it.sources:
        w = unit.values(src)
        if src.encoding != "dense":
            w = w.to(torch.bfloat16)
        unit.amax(src, w)  # a NaN or an Inf refused
        weights.append(w)
    if any(w.shape[0] % BLOCK for w in weights[:-1]):
        weights = [torch.cat(weights)]
    qs, scales, zero = [], [], 0
    for w in weights:
        q, scale = unit.backend.fp8_block(w)
        qs.append(q)
        scales.append(scale)
        zero += int((scale == 0).sum())
    unit.store(it, {"codes": qs, "scales": scales}, {"method": NAME, "zero_tiles": zero})


def quantize_c(items: list, unit) -> None:
    """As ``quantize_torch``, by the C kernel on BF16 weights' stored bytes, into the pool buffer lent for the unit."""
    import numpy as np

    from ..kernels import clib, scales

    (it,) = items
    rlib = clib.load_recipe()
    weights = []
    for src in it.sources:
        v = unit.values(src)
        v.finite_amax()  # a NaN or an Inf refused
        weights.append((v.buf, src.shape))
    if any(shape[0] % BLOCK for _, shape in weights[:-1]):
        weights = [(np.concatenate([b for b, _ in weights]), (sum(sh[0] for _, sh in weights), weights[0][1][1]))]
    qs, tile_scales, zero = [], [], 0
    for buf, (n, k) in weights:
        q = unit.carve(n * k)
        sc = unit.carve(4 * math.prod(scales.fp8_scale_shape(n, k))).view(np.float32)
        if rlib.kc_fp8_block_bf16_mt(buf.ctypes.data, n, k, q.ctypes.data, sc.ctypes.data, unit.threads,
                                     q.nbytes >= clib.STREAM_MIN_BYTES):
            raise AssertionError(f"{it.name}: a tile with NaN or Inf past the amax check")
        qs.append(q)
        tile_scales.append(sc)
        zero += int((sc == 0).sum())
    unit.store(it, {"codes": qs, "scales": tile_scales}, {"method": NAME, "zero_tiles": zero})


def c_quantizes(it, form: Callable) -> bool:
    """The C kernel quantizes 2-D BF16 weights as stored (``form``)."""
    return recipe_kernels() and all(form(s) == "dense" and s.dtype == "BF16" and len(s.shape) == 2
                                    and math.prod(s.shape) for s in it.sources)


STEPS = {
    ("fp8-block", "torch"): Step(quantize_torch),
    ("fp8-block", "c"): Step(quantize_c, accepts=c_quantizes),
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
