"""NVFP4: E2M1 codes, one E4M3 scale per ``GROUP_SIZE`` values, one F32 global scale per module (or per engine
packed module: its members share it), and optionally the recipe's constant activation scale. Everything the tool
knows of the scheme itself, apart from its kernels' arithmetic (``kernels/src``: ``reference`` is ModelOpt's
math, ``ct_nvfp4`` compressed-tensors', ``nvfp4_cpu.c`` / ``nvfp4_triton`` / ``recipe_*`` the fast paths held to
their bytes):

* the tensors a module becomes and their dtypes and shapes (``roles``), and each output format's names for them,
  its quant_algo names and config groups (``SPELLINGS``; docs/nvfp4.md and docs/compressed-tensors.md cite the
  formats' sources);
* which weights it can take (``shape_error``);
* the manifest's record of a module (``record``);
* the numeric check's bound (``engine_bound``: what ``verify-manifest --engine`` holds each row to).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from .base import Spelling, Step, recipe_kernels, row_err

if TYPE_CHECKING:
    import torch

NAME = "nvfp4"  # the recipes' and the plan's name (``SchemeName.NVFP4``)
TITLE = "NVFP4"  # the summaries' word (plan's totals, pack's line)
CARD = "NVFP4"  # the model card's "quantized to ..." row
TOTALS = "nvfp4"  # the manifest's totals key
GROUP_SIZE = 16  # values per e4m3 scale
INPUT_SCALE = True  # a recipe may pin a constant activation scale (written with the module: W4A4)
#: The plan's operations of an NVFP4 item (``plan.Operation`` members): quantized from the source's values, NVIDIA's
#: closed-form cast of MXFP4 codes (ModelOpt's arithmetic; no value decoded), or a stacked expert bank quantized one
#: expert at a time (``_per_expert``: a global scale per expert).
OPERATIONS = {"QUANTIZE": "nvfp4", "CAST": "mxfp4-cast", "STACKED": "nvfp4-stacked"}


def operation(arithmetic: str, from_mxfp4: bool, stacked: bool = False) -> str:
    """An item's operation (a value of ``OPERATIONS``): a stacked expert bank quantized one expert at a time (one
    global scale per expert); NVIDIA's cast where every source holds MXFP4 codes and the output format computes
    ModelOpt's arithmetic; else quantized. The plan decides it once (``plan.operations``; a unit's members together:
    w1 and w3 share one ``k_max`` or one amax, a stacked gate and up bank one amax per expert)."""
    if stacked:
        return OPERATIONS["STACKED"]
    return OPERATIONS["CAST"] if from_mxfp4 and arithmetic == "modelopt" else OPERATIONS["QUANTIZE"]
#: how compressed-tensors names the packed NVFP4 layout (its ``format``; also every config group's)
CT_PACK_FORMAT = "nvfp4-pack-quantized"


def roles(shape: tuple[int, ...], scalar: tuple[int, ...]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """dtype and shape of each role of a module of weight ``shape``: two codes a byte (even element in the low
    nibble), one e4m3 scale per group, the global and activation scales as scalars of the format's shape."""
    lead, k = shape[:-1], shape[-1]
    return {"codes": ("U8", (*lead, k // 2)), "scales": ("F8_E4M3", (*lead, k // GROUP_SIZE)),
            "global": ("F32", scalar), "input": ("F32", scalar)}


def shape_error(shape: tuple[int, ...], fused: bool, stacked: bool, experts: int = 0) -> str | None:
    """Why a weight cannot be NVFP4 (the words after "selected for NVFP4"), or None: 2-D (a fused bank of
    experts may be 3-D, a stacked bank is), K a multiple of the group."""
    if experts and len(shape) != 3:
        return "is not 3-D (a stacked expert bank)"
    if not fused and not experts and len(shape) != 2:
        return "is not 2-D"
    if shape[-1] % GROUP_SIZE:
        return f"but K={shape[-1]} is not a multiple of {GROUP_SIZE}"
    return None


def record(algo: str, shared_scale: str | None, input_scale: float | None) -> dict:
    """The manifest record's ``quantization`` entry (in every format; a format may add its own keys)."""
    return {"format": NAME, "group_size": GROUP_SIZE, "quant_algo": algo, "shared_scale": shared_scale,
            "input_scale": input_scale}


def modelopt_group(algo: str, targets: list[str]) -> dict:
    """ModelOpt's compressed-tensors-style config group of one NVFP4 quant_algo (its convert_hf_config;
    written here because ModelOpt is not a dependency of this tool)."""
    weights = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": GROUP_SIZE}
    if algo == "NVFP4":
        return {"input_activations": dict(weights), "weights": weights, "targets": targets}
    return {"weights": weights, "targets": targets}


def _ct_weights() -> dict:
    """The NVFP4 presets' weights (``compressed_tensors/quantization/quant_scheme.py: NVFP4A16``), as
    ``QuantizationArgs.model_dump`` writes them (a symmetric scheme's zp_dtype None)."""
    return {"actorder": None, "block_structure": None, "dynamic": False, "group_size": GROUP_SIZE, "num_bits": 4,
            "observer": None, "observer_kwargs": {}, "scale_dtype": "torch.float8_e4m3fn",
            "strategy": "tensor_group", "symmetric": True, "type": "float", "zp_dtype": None}


def _ct_inputs() -> dict:
    """The NVFP4 preset's input_activations (``quant_scheme.py: NVFP4``): local scales dynamic, the global
    static (the ``input_global_scale`` tensor)."""
    return {"actorder": None, "block_structure": None, "dynamic": "local", "group_size": GROUP_SIZE, "num_bits": 4,
            "observer": "static_minmax", "observer_kwargs": {}, "scale_dtype": "torch.float8_e4m3fn",
            "strategy": "tensor_group", "symmetric": True, "type": "float", "zp_dtype": None}


def ct_group(algo: str, targets: list[str]) -> dict:
    """compressed-tensors' config group of one preset scheme (``NVFP4A16``, or ``NVFP4`` with a constant
    activation global scale)."""
    return {"format": CT_PACK_FORMAT, "input_activations": _ct_inputs() if algo == "NVFP4" else None,
            "output_activations": None, "targets": targets, "weights": _ct_weights()}


SPELLINGS = {
    # ModelOpt: value = code * weight_scale * weight_scale_2; vLLM's and SGLang's ModelOpt FP4 loaders
    "modelopt": Spelling(tensors=(("codes", ".weight"), ("scales", ".weight_scale"), ("global", ".weight_scale_2"),
                                  ("input", ".input_scale")),
                         algos=("W4A16_NVFP4", "NVFP4"), layer_keys=(("group_size", GROUP_SIZE),),
                         group=modelopt_group),
    # compressed-tensors: the global scale's reciprocal convention (code * weight_scale / weight_global_scale), the
    # activation scale as 1/input_scale (compressors/nvfp4/base.py: NVFP4PackedCompressor.compression_param_names)
    "compressed-tensors": Spelling(tensors=(("codes", ".weight_packed"), ("scales", ".weight_scale"),
                                            ("global", ".weight_global_scale"), ("input", ".input_global_scale")),
                                   algos=("NVFP4A16", "NVFP4"), scalar=(1,), reciprocal_input=True, group=ct_group,
                                   arithmetic="compressed-tensors"),
}


# -- its kernels' entry: the compute steps of its operations (convert/steps.py's table) ---------------------------
# ``unit`` is the backend's view of the unit being computed (``compute.TorchUnit``, ``compute_early.CUnit``); the
# items of one step share one global scale (``joint``): w1 and w3 one amax, or one ``k_max``.


def _method(it) -> str:
    return "requantized" if it.sources[0].encoding != "dense" else "quantized"  # a coded source decoded first


def _first_by_name(items: list) -> dict:
    """The units' sources by name, once each (a bank's views may share one), the first of a name kept."""
    out: dict = {}
    for it in items:
        for s in it.sources:
            out.setdefault(s.name, s)
    return out


def quantize_torch(items: list, unit) -> None:
    """One global scale over the unit's members (its fused module or scale group), each member quantized by the
    backend (ModelOpt's arithmetic, or compressed-tensors' where the format computes its own)."""
    import torch

    from ..kernels import ct_nvfp4, reference

    named = _first_by_name(items)
    values = {n: unit.values(s) for n, s in named.items()}
    amax = None
    for n, v in values.items():
        a = unit.amax(named[n], v)
        amax = a if amax is None else torch.maximum(amax, a)
    ct = SPELLINGS[items[0].output_format].arithmetic == "compressed-tensors"
    # compressed-tensors' own global scale is computed in the weights' dtype (kernels/src/ct_nvfp4.py)
    s2 = ct_nvfp4.global_scale(amax, next(iter(values.values())).dtype) if ct else reference.global_scale(amax)
    for it in items:
        outs = [unit.backend.quantize_ct(values[s.name], s2) if ct else unit.backend.quantize(values[s.name], amax)
                for s in it.sources]
        unit.store(it, {"codes": [o[0] for o in outs], "scales": [o[1] for o in outs], "global": [s2.reshape(1)]},
                   {"method": _method(it), "amax": float(amax)})


def cast_torch(items: list, unit) -> None:
    """NVIDIA's closed-form MXFP4 -> NVFP4 cast, one ``k_max`` shared by the unit (w1 and w3)."""
    codes = {s.name: unit.codes(s) for it in items for s in it.sources}  # a NaN scale refused here
    shared = max(c.k_max for c in codes.values())
    for it in items:
        outs = [unit.backend.cast_mxfp4(c.packed, c.scale, shared, c.k_max)
                for c in (codes[s.name] for s in it.sources)]
        blocks, lossless = sum(o[3].blocks for o in outs), sum(o[3].lossless for o in outs)
        unit.store(it, {"codes": [o[0] for o in outs], "scales": [o[1] for o in outs],
                        "global": [outs[0][2].reshape(1)]},
                   {"method": "mxfp4-cast", "k_max": shared, "blocks": blocks, "lossless_blocks": lossless})


def quantize_c(items: list, unit) -> None:
    """As ``quantize_torch``, by the C kernels on the read buffers (``unit.values``: a dense weight's stored bytes,
    an FP8 one decoded, an INT4 one's codes), into the pool buffer lent for the unit."""
    import numpy as np

    from ..kernels import scales

    values = {n: unit.values(s) for n, s in _first_by_name(items).items()}
    amax = max(v.finite_amax() for v in values.values())
    ct = SPELLINGS[items[0].output_format].arithmetic == "compressed-tensors"
    first = next(iter(values.values()))
    s2 = scales.compressed_tensors(amax, first.dtype) if ct else scales.modelopt(amax)
    for it in items:
        packed, block_scales = [], []
        for s in it.sources:
            k = s.shape[-1]
            m = math.prod(s.shape) // k
            p, sc = unit.carve(m * k // 2), unit.carve(m * k // GROUP_SIZE)
            _nvfp4_c(unit, values[s.name], m, k, ct, s2, p, sc)
            packed.append(p)
            block_scales.append(sc)
        unit.store(it, {"codes": packed, "scales": block_scales, "global": [np.array([s2], dtype=np.float32)]},
                   {"method": _method(it), "amax": amax})


def _nvfp4_c(unit, v, m: int, k: int, ct: bool, s2: float, packed, block_scales) -> None:
    """NVFP4 codes and E4M3 block scales of ``v``'s ``m`` x ``k`` values under global scale ``s2`` (compressed-tensors'
    arithmetic where ``ct``, else ModelOpt's): from its BF16 / FP32 values, or from INT4 or FP8 codes decoded a row
    at a time (``v.rows_from_codes``)."""
    from ..kernels import clib

    if v.rows_from_codes:
        v.quant(unit.lib, m, k, ct, s2, packed.ctypes.data, block_scales.ctypes.data, unit.threads)
    else:
        kernel = clib.ct_quant if ct else clib.quant
        kernel(unit.lib, v.buf.ctypes.data, m, k, v.dtype == "F32", s2, packed.ctypes.data, block_scales.ctypes.data,
               unit.threads)


def cast_c(items: list, unit) -> None:
    """As ``cast_torch``, by the C kernel on the stored codes and E8M0 scales."""
    import numpy as np

    from ..kernels import clib, scales

    rlib = clib.load_recipe()
    own = {s.name: unit.k_max(s) for it in items for s in it.sources}  # a NaN scale refused here
    shared = max(own.values())
    for it in items:
        packed, block_scales, blocks, lossless = [], [], 0, 0
        for s in it.sources:
            codes, e8m0 = unit.raw(s.parts[0]), unit.raw(s.parts[1])
            rows, kb = s.parts[1].shape
            out, sb = unit.carve(codes.nbytes), unit.carve(rows * 2 * kb)
            if rows and kb:
                lossless += rlib.kc_cast_mxfp4_mt(codes.ctypes.data, e8m0.ctypes.data, rows, kb, own[s.name], shared,
                                                  out.ctypes.data, sb.ctypes.data, unit.threads,
                                                  out.nbytes >= clib.STREAM_MIN_BYTES)
            blocks += e8m0.size
            packed.append(out)
            block_scales.append(sb)
        s2 = np.array([2.0 ** (shared - scales.E4M3_KMAX)], dtype=np.float32)
        unit.store(it, {"codes": packed, "scales": block_scales, "global": [s2.reshape(1)]},
                   {"method": "mxfp4-cast", "k_max": shared, "blocks": blocks, "lossless_blocks": lossless})


def c_quantizes(it, form: Callable) -> bool:
    """The C kernels quantize dense BF16 / FP32, FP8 and INT4 sources (``form``), K a multiple of the group."""
    return all(form(s) in ("dense", "fp8", "int4") and s.shape and not s.shape[-1] % GROUP_SIZE
               and math.prod(s.shape) for s in it.sources)


def c_casts(it, form: Callable) -> bool:
    """The C kernel casts MXFP4 codes as stored (gpt-oss's banks, a view: torch decodes them)."""
    return recipe_kernels() and all(form(s) == "mxfp4" for s in it.sources)


class _Expert:
    """The backend's view of a unit narrowed to one expert of its stacked banks: ``values`` gives each source's
    slice ``e`` (the torch values' first index; the C kernels' stored bytes, a byte range), ``store`` collects each
    item's parts by role, expert after expert; everything else is the unit's (``__getattr__``)."""

    def __init__(self, unit, narrow: Callable, banks: dict) -> None:
        self._unit, self._narrow, self._banks, self.e = unit, narrow, banks, 0
        self._whole: dict = {}
        self.parts: dict[str, dict[str, list]] = {}
        self.amaxes: dict[str, list[float]] = {}

    def __getattr__(self, name: str):
        return getattr(self._unit, name)

    def values(self, src):
        """Expert ``e``'s values of ``src`` (an expert's source: the bank's name, its shape less the first
        dimension); the whole bank read once."""
        if src.name not in self._whole:
            self._whole[src.name] = self._unit.values(self._banks[src.name])
        return self._narrow(self._whole[src.name], self.e, src, self._unit)

    def store(self, it, roles: dict[str, list], note: dict) -> None:
        into = self.parts.setdefault(it.name, {})
        for role, parts in roles.items():
            into.setdefault(role, []).extend(parts)
        self.amaxes.setdefault(it.name, []).append(float(note["amax"]))

    def finish(self, items: list) -> None:
        """Each item's stacked parts (expert after expert: the [experts, ...] tensors' bytes in order) into the
        unit, with every expert's amax."""
        for it in items:
            self._unit.store(it, self.parts[it.name], {"method": _method(it), "amax": self.amaxes[it.name]})


def _per_expert(step: Callable, narrow: Callable) -> Callable:
    """``step`` (one global scale over a unit's members) run once per expert of the unit's stacked banks, on each
    source's slice ``e``: one global scale per expert over the members' slices ``e`` (gate and up of a stacked
    ``w13``), as the engines read a stacked bank (docs/stacked-banks.md)."""
    from dataclasses import replace

    def run(items: list, unit) -> None:
        banks = {s.name: s for it in items for s in it.sources}
        one = [replace(it, sources=tuple(s._replace(shape=s.shape[1:]) for s in it.sources)) for it in items]
        view = _Expert(unit, narrow, banks)
        for e in range(items[0].experts):
            view.e = e
            step(one, view)
        view.finish(items)
    return run


def _narrow_torch(v, e: int, src, unit):
    return v[e]


def _narrow_c(v, e: int, src, unit):
    """Expert ``e`` of a stored bank as the C kernels read it: its byte range of a dense bank, or its codes and tile
    scales of a block-FP8 one with that expert's own amax (the view's ``expert``: ``compute_early.Stored``,
    ``compute_early.Fp8Rows``)."""
    return v.expert(e, src, unit)


def c_quantizes_stacked(it, form: Callable) -> bool:
    """The C kernels quantize a stacked bank stored dense (BF16 / FP32) or block FP8, a byte range per expert."""
    return all(form(s) in ("dense", "fp8") for s in it.sources) and c_quantizes(it, form)


STEPS = {
    ("nvfp4", "torch"): Step(quantize_torch, joint=True),
    ("nvfp4", "c"): Step(quantize_c, joint=True, accepts=c_quantizes),
    ("nvfp4-stacked", "torch"): Step(_per_expert(quantize_torch, _narrow_torch), joint=True),
    ("nvfp4-stacked", "c"): Step(_per_expert(quantize_c, _narrow_c), joint=True, accepts=c_quantizes_stacked),
    ("mxfp4-cast", "torch"): Step(cast_torch, joint=True),
    ("mxfp4-cast", "c"): Step(cast_c, joint=True, accepts=c_casts),
}


# -- the numeric check's bound (verify-manifest --engine, enginecheck/numerics.py) ----------------------------

E4M3_WINDOW = (-9, 8)  # the powers of two an e4m3 scale holds exactly relative to the global scale (the cast's window)


def engine_bound(placed: list, layer: dict, expert: int | None, rows: Callable) -> list[tuple[torch.Tensor,
                                                                                              torch.Tensor]]:
    """Per placed source block (``numerics.Ref``, first row, rows): (each row's error ModelOpt's quantizer makes
    with the global scale of the engine's fused layer: the amax of every source row placed in it; the elements
    read back exactly). Where the source is MXFP4 and the output NVIDIA's closed-form cast, the blocks the cast
    keeps exactly (``k_j - (k_max - 8)`` inside e4m3's window, ``k_max`` over the fused layer) must be read back
    exactly, the others are held to the quantizer with the cast's global scale ``2^(k_max - 8)``. A
    compressed-tensors layer: that format's own arithmetic."""
    refs = [rows(r, s0, n) for r, s0, n in placed]
    kmax = _kmax(refs)
    glob = _global_of(layer, expert)
    claims = [r.cast if r.cast is not None else (kmax is not None and glob == 2.0 ** (kmax - 8)) for r in refs]
    if layer.get("convention", "modelopt") == "compressed-tensors" and refs:
        return _ct_bound(refs)
    return _modelopt_bound(refs, claims, kmax)


def _ct_bound(refs: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """compressed-tensors' own error (kernels' ct_nvfp4) of each member under the members' one global scale."""
    import torch

    from ..kernels import ct_nvfp4

    srcs = [r.dense if r.dense is not None else r.values for r in refs]
    amax = max(float(v.abs().max().float()) for v in srcs)
    g = ct_nvfp4.global_scale(torch.tensor(amax), srcs[0].dtype)
    return [(row_err(ct_nvfp4.dequantize(*ct_nvfp4.quantize(v, g), g), r.values),
             torch.zeros_like(r.values, dtype=torch.bool)) for v, r in zip(srcs, refs, strict=True)]


def _modelopt_bound(refs: list, cast_claim: list[bool], kmax: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    import torch

    from ..kernels import reference

    amax = max(float(r.values.abs().max()) for r in refs) if refs else 0.0
    s2 = reference.global_scale(torch.tensor(amax))
    out = []
    for r, cast in zip(refs, cast_claim, strict=True):
        v = r.values
        if cast and r.e8m0 is not None and kmax is not None:
            kj = (r.e8m0.to(torch.int32) - 127).repeat_interleave(32, dim=-1)[:, : v.shape[1]]
            delta = kj - (kmax - 8)
            exact = ((delta >= E4M3_WINDOW[0]) & (delta <= E4M3_WINDOW[1])) | (r.e8m0 == 0).repeat_interleave(
                32, dim=-1)[:, : v.shape[1]]
            q = reference.dequantize(*reference.quantize(v, torch.tensor(2.0 ** (kmax - 8))),
                                     torch.tensor(2.0 ** (kmax - 8)))
            q = torch.where(exact, v, q)
        else:
            exact = torch.zeros_like(v, dtype=torch.bool)
            q = reference.dequantize(*reference.quantize(v, s2), s2)
        out.append((row_err(q, v), exact))
    return out


def _kmax(refs: list) -> int | None:
    """The fused layer's ``k_max`` (the largest MXFP4 E8M0 exponent), None unless every member is MXFP4."""
    tops = [int(r.e8m0.max()) for r in refs if r.e8m0 is not None and r.e8m0.numel()]
    if len(tops) != len(refs) or not tops:
        return None
    top = max(tops)
    return top - 127 if top else 0


def _global_of(layer: dict, expert: int | None) -> float | None:
    """The global scale the engine keeps for the layer (an expert: its gate's slot)."""
    slots = layer.get("global_slots")
    if slots is None:
        return None
    if expert is None:
        return float(layer.get("global_scale", max(slots)))
    row = slots[expert]
    return float(row[0] if isinstance(row, list) else row)
