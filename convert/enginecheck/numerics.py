"""The numeric check: what the engine will compute with, row for row, against the source's own weight.

The engine runner (``runner_numerics``) hands over every linear and MoE layer dequantized as the engine's
GEMM reads it (its fused scale tensors, its one global scale per fused layer, its w13 order) and, for
every checkpoint tensor, the rows (and expert) of the engine parameter its bytes landed in. Here each
placed block of rows is compared with the **source** weight of the same rows: the input's BF16 tensor as
stored, its MXFP4 or block-FP8 tensor decoded. The source of an output tensor is the manifest's record
(which source tensors, at which rows) or, for a checkpoint this tool did not write, the source tensor of
the same module name.

Each row is held to its scheme's own error on that row (the layer's ``scheme`` as the engine reads it), computed
from the source alone:

* a quantization scheme (``nvfp4``, ``fp8-block``): the scheme module's ``engine_bound`` (``convert/schemes``):
  ``nvfp4``: ModelOpt's NVFP4 quantizer (``kernels.reference``) with the global scale of the engine's
  fused layer (the amax of every source row placed in it, for an expert: in its w13 or w2); where the
  source is MXFP4 and the output is NVIDIA's closed-form cast, the blocks the cast keeps exactly
  (``k_j - (k_max - 8)`` inside e4m3's power-of-two window, ``k_max`` over the fused layer) must be read
  back **exactly**, the others are held to the quantizer with the cast's global scale ``2^(k_max - 8)``;
  ``fp8-block``: ModelOpt's 128x128 block FP8 (``kernels.fp8_block``) on the output tensor's own tiles;
* ``dense``: the source rounded to the parameter's dtype (exactly 0 for BF16 kept as BF16).
* ``mxfp4``: bit-exact: this tool writes no MXFP4, so an MXFP4 layer is one kept as its source stores it
  (DeepSeek V4's MTP experts under ``nvidia-dsv4``), read back as the source's own decode.

A row passes when its relative error (L2 over the row) is at most ``SLACK`` times its bound plus
``FLOOR``; a zero bound means bit-exact. Tolerating the slack lets another tool's rounding (a different
but valid encoder) pass, while a misplaced scale, a wrong global scale or swapped rows do not.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import torch

from .. import encodings, filenames, schemes
from ..errors import ConvertError
from ..plan import Encoding
from ..schemes.base import row_err
from ..sources import Source

SLACK = 1.25
FLOOR = 1e-6


@dataclass(frozen=True)
class LoadTransform:
    """What an engine does to a weight as it loads it, by a config value (the model's own constant folded into the
    weight, not a reading of the checkpoint): ``how`` "scale" multiplies it by the value (in fp32, as the engines
    compute it); "normalize" divides each column by its L2 norm where the value is true, computed by the engines in
    the weight's own dtype: the norm's rounding and the quotient's, ``roundings`` 2 (the reference is the exact fp32
    quotient, held to that many of the dtype's roundings). ``part``: a substring of the tensor's name."""

    part: str
    key: str
    how: str
    roundings: int = 1

    def apply(self, values: torch.Tensor, value: object) -> torch.Tensor | None:
        """The reference's values as the engine loads them, or None where the config's value asks for nothing."""
        if self.how == "scale" and isinstance(value, int | float) and not isinstance(value, bool):
            return values * torch.tensor(float(value), dtype=torch.float32)
        if self.how == "normalize" and value is True:
            return torch.nn.functional.normalize(values, p=2.0, dim=0, eps=1e-7)
        return None


#: (engine, architecture) -> what it does to some weights as it loads them (the check holds the engine's weight to the
#: source transformed the same way):
#: - SGLang 0.5.23 ``models/grok.py`` ``Grok1ForCausalLM.load_weights.load_weight_wrapper``: ``if "lm_head" in name``,
#:   ``loaded_weight.to(torch.float32) * model_config.output_multiplier_scale``;
#: - Ling 1.x under ``norm_head``: vLLM 0.33 ``bailing_moe.py`` ``BailingMoeForCausalLM._normalize_lm_head`` and SGLang
#:   0.5.23 ``bailing_moe.py`` ``BailingMoEForCausalLM.load_weights``: ``F.normalize(loaded_weight, dim=0, p=2,
#:   eps=1e-7)`` on ``lm_head.weight`` as stored (BF16).
_NORM_HEAD = (LoadTransform("lm_head.weight", "norm_head", "normalize", roundings=2),)
LOAD_TRANSFORMS: dict[tuple[str, str], tuple[LoadTransform, ...]] = {
    ("sglang", "Grok1ForCausalLM"): (LoadTransform("lm_head", "output_multiplier_scale", "scale"),),
    ("vllm", "BailingMoeForCausalLM"): _NORM_HEAD, ("sglang", "BailingMoeForCausalLM"): _NORM_HEAD}


def load_transforms(engine: str, config: dict) -> list[tuple[LoadTransform, object]]:
    """``LOAD_TRANSFORMS``' rules for ``engine`` and the config's architecture, each with the config's value."""
    arch = (config.get("architectures") or [""])[0]
    return [(t, config.get(t.key)) for t in LOAD_TRANSFORMS.get((engine, arch), ())]


def _transformed(r: Ref | None, tensor: str, rules: list[tuple[LoadTransform, object]]) -> Ref | None:
    """``r`` as the engine loads it where a ``LOAD_TRANSFORMS`` rule names the tensor and the config asks for it (no
    stored dense values then: the engine's are the result's rounding, bounded as any dense weight's, times the
    rule's roundings)."""
    for t, value in rules:
        if r is not None and t.part in tensor and (v := t.apply(r.values, value)) is not None:
            return Ref(v, None, r.e8m0, r.cast, r.sources, t.roundings)
    return r


@dataclass
class Ref:
    """The source's weight for one output tensor: fp32 values, the stored dense values (for block FP8's
    own rounding), and per row block the MXFP4 E8M0 bytes (None where not MXFP4)."""

    values: torch.Tensor
    dense: torch.Tensor | None
    e8m0: torch.Tensor | None
    cast: bool | None  # the output claims NVIDIA's closed-form MXFP4 cast (manifest); None: decide from the scale
    sources: list[str]
    roundings: int = 1  # the roundings to the engine's dtype a dense value went through (``LoadTransform``)


class Spot(NamedTuple):
    """One write of a checkpoint tensor into one parameter (or one expert of it), as the runner placed it
    (``runner_numerics.placements``): the parameter's first row and rows, the stored tensor's first row (None: all of
    it, or derived from all of it), the engine's reordering of its rows, its offer order, for a stored 3-D tensor (an
    expert bank) the leading index the rows came from (``src_expert``), and the stored rows from one row written to
    the next (``src_step``: 1 as stored, 2 for every other row, 0 where the write is not rows of it)."""

    tensor: str
    row: int
    rows: int
    src_row: int | None
    order: tuple[torch.Tensor, str] | None
    seq: int | None
    src_expert: int | None = None
    src_step: int = 1

    @property
    def origin(self) -> str:
        """The stored tensor as the report names it: ``T`` or, for one expert of a bank, ``T[e]``."""
        return self.tensor if self.src_expert is None else f"{self.tensor}[{self.src_expert}]"


@dataclass
class LayerCheck:
    engine_param: str
    module: str
    scheme: str  # nvfp4, fp8-block, mxfp4, fp8-tensor, dense, or an unread dtype (the report's "format")
    rule: str
    processed: str
    members: list[str] = field(default_factory=list)
    rows: int = 0
    max_rel_err: float = 0.0
    mean_rel_err: float = 0.0
    max_bound: float = 0.0
    exact: bool = True  # every row held to a bound of 0
    exact_elements: int = 0
    worst: list[dict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    kernel_read: dict | None = None  # the engine's own GEMM read the weight (runner_numerics._kernel_read)
    reordered: dict[str, str] = field(default_factory=dict)  # tensor -> the engine step that reorders its rows

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class NumericReport:
    engine: str
    layers: list[LayerCheck] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    unplaced: list[str] = field(default_factory=list)  # checkpoint weights placed in no layer read here
    # "TENSOR by LATER in PARAM": a checkpoint weight whose rows the engine's own loader wrote again with another's
    # (SGLang's MiMo-V2 draft loads each stored MTP layer into its one layer): not read, so not held to anything
    overwritten: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and all(c.ok for c in self.layers)

    def failures(self) -> list[str]:
        return self.problems + [p for c in self.layers for p in c.problems]

    def summary(self) -> dict:
        """Per scheme: layers, the largest relative error against its bound, exact layers."""
        by: dict[str, dict] = {}
        for c in self.layers:
            if not c.rows:
                continue
            s = by.setdefault(c.scheme, {"layers": 0, "max_rel_err": 0.0, "max_bound": 0.0, "exact_layers": 0,
                                         "worst_ratio": 0.0, "kernel_read_layers": 0})
            s["layers"] += 1
            s["kernel_read_layers"] += c.kernel_read is not None
            s["max_rel_err"] = max(s["max_rel_err"], c.max_rel_err)
            s["max_bound"] = max(s["max_bound"], c.max_bound)
            s["exact_layers"] += c.exact and c.max_rel_err == 0
            for w in c.worst[:1]:
                s["worst_ratio"] = max(s["worst_ratio"], w["ratio"])
        return by

    def to_dict(self) -> dict:
        return {"engine": self.engine, "ok": self.ok, "problems": self.failures(), "summary": self.summary(),
                "unplaced": self.unplaced, "overwritten": self.overwritten,
                "layers": [_layer_dict(c) for c in self.layers]}


def _layer_dict(c: LayerCheck) -> dict:
    """One layer of the JSON report: its fields in order, the scheme under the report's key ``format`` (the
    verify-manifest --json output users read keeps its keys)."""
    return {("format" if k == "scheme" else k): v for k, v in asdict(c).items()} | {"ok": c.ok}


class Sources:
    """Source weights by output tensor name: the manifest's records, else the same module in the input."""

    def __init__(self, input_dir: Source | str | Path, output_dir: Path, manifest: dict | None):
        """``input_dir``: the input checkpoint, a ``Source`` or a folder (``sources.open_source``)."""
        from ..checkpoint import open_checkpoint
        from ..plan.discover import discover_sources, fp8_block_size
        from ..readers import MappedReader

        self.ckpt = open_checkpoint(input_dir)
        self.config = self.ckpt.config
        self.block = fp8_block_size(self.ckpt.config)
        self.modules = discover_sources(self.ckpt)
        self.by_name = {s.name: s for m in self.modules.values() for s in m.values()}
        self.reader = MappedReader(self.ckpt.source)
        self.records: dict[str, dict] = {}
        if manifest is not None:
            from ..manifest import iter_modules

            for _, m in iter_modules(output_dir, manifest):
                for t in m.get("tensors", []):
                    if t["name"].endswith((".weight", ".weight_packed")):
                        self.records[t["name"]] = m

    def _decode(self, src) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(fp32 values, the stored values where dense, the E8M0 bytes where MXFP4), decoded as ``pack``
        decodes them (``encodings.decode``)."""
        parts = [self.reader.tensor(p) for p in src.parts]
        values = encodings.decode(src, parts, self.block)
        codes = encodings.mxfp4_codes(src, parts)
        return values.float(), values if src.encoding == Encoding.DENSE else None, codes.scale if codes else None

    def ref(self, tensor: str) -> Ref | None:
        rec = self.records.get(tensor)
        if rec is None:  # by name: a compressed-tensors X.weight_packed holds the source's X.weight
            src = self.by_name.get(tensor) or self.by_name.get(tensor.removesuffix("_packed"))
            if src is None:
                return None
            v, d, e = self._decode(src)
            return Ref(v, d, e, None, [src.name])
        srcs = [(s, self.by_name.get(s["name"])) for s in rec.get("sources", [])]
        if not srcs or any(st is None for _, st in srcs):
            return None
        decoded = [(s["rows"], *self._decode(st)) for s, st in srcs]
        cat = lambda xs: None if any(x is None for x in xs) else torch.cat(xs)  # noqa: E731
        order = sorted(range(len(decoded)), key=lambda i: decoded[i][0][0])
        q = rec.get("quantization") or {}
        return Ref(torch.cat([decoded[i][1] for i in order]), cat([decoded[i][2] for i in order]),
                   cat([decoded[i][3] for i in order]), q.get("method") == "mxfp4-cast",
                   [s["name"] for s, _ in srcs])


def _dense_bound(r: Ref, dtype: str) -> torch.Tensor:
    dt = getattr(torch, dtype.replace("torch.", ""), torch.float32)
    return row_err(r.values.to(dt).float(), r.values) * r.roundings


def compare(engine: str, result: dict, folder: Path, sources: Sources) -> NumericReport:
    """Hold every placed row of every layer the runner read to its source and its bound."""
    from safetensors import safe_open

    rep = NumericReport(engine)
    num = result.get("numerics") or {}
    if "error" in num:
        err = num["error"]
        rep.problems.append(f"{engine}: the numeric read failed: {err.get('type')}: {err.get('message')}")
        return rep
    placed: dict[tuple[str, int | None], list[Spot]] = {}
    read = {layer["param"] for layer in num.get("layers", [])}
    for tensor, spots in num.get("placements", {}).items():
        for s in [s for s in spots if s["param"] in read]:  # a conv or other weight is not a GEMM's
            if s.get("rows") is None:
                rep.problems.append(f"{engine}: {tensor} was written across experts {s.get('experts')} of "
                                    f"{s['param']}")
                continue
            placed.setdefault((s["param"], s.get("expert")), []).append(
                Spot(tensor, s["row"], s["rows"], s.get("src_row"), _order(s), s.get("seq"), s.get("src_expert"),
                     s.get("src_step", 1)))
    used: set[str] = set()
    for key, spots in placed.items():
        gone = _overwritten(spots)
        placed[key] = [s for s in spots if s[0] not in gone]
        rep.overwritten += [f"{t} by {by} in {key[0]}" + (f" expert {key[1]}" if key[1] is not None else "")
                            for t, by in sorted(gone.items())]
        used.update(gone)
    transforms = load_transforms(engine, sources.config)
    with safe_open(str(folder / "numerics.safetensors"), framework="pt") as f:
        for layer in num.get("layers", []):
            c = _check_layer(engine, layer, f, placed, sources, used, transforms)
            if c is not None:
                rep.layers.append(c)
    rep.unplaced = sorted({spot.tensor for spots in placed.values() for spot in spots} - used)
    return rep


def _overwritten(spots: list[Spot]) -> dict[str, str]:
    """The tensors among one parameter's (or expert's) placements whose rows a tensor offered after them was written
    to whole, the same rows from the same source row (and bank expert): {earlier tensor: the last one written there}.
    The engine holds the last; the earlier ones it read and threw away (its own loader's doing, whatever the
    checkpoint)."""
    seqs = {s.tensor: s.seq for s in spots}
    over: dict[str, list[str | None]] = {}
    for s in spots:
        same = (s.row, s.rows, s.src_row, s.src_expert, s.src_step)
        later = [u.tensor for u in spots if u.tensor != s.tensor
                 and (u.row, u.rows, u.src_row, u.src_expert, u.src_step) == same
                 and s.seq is not None and seqs[u.tensor] is not None and seqs[u.tensor] > s.seq]
        over.setdefault(s.tensor, []).append(max(later, key=seqs.__getitem__) if later else None)
    return {t: by[-1] for t, by in over.items() if all(by)}  # every spot of it written over


def _check_layer(engine: str, layer: dict, f, placed: dict, sources: Sources, used: set[str],
                 transforms: list[tuple[LoadTransform, object]]) -> LayerCheck | None:
    """One layer the runner read: each expert's (or the layer's) placed rows held to their sources and bounds.
    None where no checkpoint tensor reached the layer (a derived or engine-made one)."""
    param = layer["param"]
    c = LayerCheck(param, layer["module"], layer.get("scheme", "?"), layer.get("rule", ""),
                   layer.get("processed", ""), kernel_read=layer.get("kernel_read"))
    if layer.get("error"):
        c.problems.append(f"{engine}: {layer['module']}: the engine's own processing failed: {layer['error']}")
        return c
    groups = sorted(k for k in placed if k[0] == param)
    if not groups:
        return None  # no checkpoint tensor reached it (a derived or engine-made layer)
    if layer.get("unread"):
        c.problems.append(f"{engine}: {param}: {layer.get('rule')} ({layer.get('method')}); not checked")
        return c
    w_all = f.get_tensor(layer["key"])
    errs, bounds = [], []
    decoded: dict[str, Ref | None] = {}  # a stored tensor an engine splits over several slots: decoded once
    for key in groups:
        expert = key[1]
        w = w_all[expert] if expert is not None else w_all
        where = f"{param}" + (f" expert {expert}" if expert is not None else "")
        refs, ok_spots = _placed_refs(f"{engine}: {where}", placed[key], w, sources, decoded, used, c, transforms)
        if not refs:
            continue
        refs, bl = _bounds(c.scheme, refs, layer, expert)
        for spot, r, (bound, exact) in zip(ok_spots, refs, bl, strict=True):
            errs.append(_check_rows(f"{engine}: {where}", layer, c, expert, spot, w, r, bound, exact))
            bounds.append(bound)
    if errs:
        e, b = torch.cat(errs), torch.cat(bounds)
        finite = e[torch.isfinite(e)]
        c.max_rel_err = float(e.max())
        c.mean_rel_err = float(finite.mean()) if finite.numel() else math.inf
        c.max_bound = float(b.max())
    c.worst = sorted(c.worst, key=lambda w: -w["ratio"])[:3]
    return c


def _placed_refs(where: str, spots: list[Spot], w: torch.Tensor, sources: Sources, decoded: dict[str, Ref | None],
                 used: set[str], c: LayerCheck, transforms: list[tuple[LoadTransform, object]]
                 ) -> tuple[list[tuple[Ref, int, int]], list[tuple[str, int, int]]]:
    """The source rows behind each placement of one expert (or layer), in the parameter's row order, as
    (reference, its first row, rows) beside (the stored tensor as named, row, rows); a placement from one expert
    of a stored bank is held to that expert's slice of the source (``_bank_expert``). A placement without a source
    weight or with rows that cannot be where the write put them is a problem of ``c`` instead (checked apart, so
    the report names each)."""
    refs, ok_spots = [], []
    for spot in sorted(spots, key=lambda s: s.row):
        tensor, row, n, src_row, order = spot.tensor, spot.row, spot.rows, spot.src_row, spot.order
        used.add(tensor)
        if tensor not in decoded:
            decoded[tensor] = _transformed(sources.ref(tensor), tensor, transforms)
        r = decoded[tensor]
        if r is not None and spot.src_expert is not None:
            if (r := _bank_expert(r, spot.src_expert)) is None:
                c.problems.append(f"{where} rows {row}..{row + n - 1} hold expert {spot.src_expert} of {tensor}, "
                                  f"whose source {list(decoded[tensor].values.shape)} has no such expert")
                continue
            tensor = spot.origin
        if r is not None and spot.src_step != 1:
            if (r := _strided(r, src_row, n, spot.src_step)) is None:
                c.problems.append(f"{where} rows {row}..{row + n - 1} hold {tensor} " + (
                    "read across its rows (a transposed view: not rows of it)" if spot.src_step <= 0 else
                    f"read every {spot.src_step} rows from row {src_row}, past its "
                    f"{decoded[spot.tensor].values.shape[-2]} rows"))
                continue
            src_row = 0
        if r is not None and order is not None:
            c.reordered[tensor] = order[1]
            if (r := _reordered(r, order[0])) is None:
                c.problems.append(f"{where} rows {row}..{row + n - 1}: {order[1]} gives {tensor} a row order that is "
                                  "not a permutation of its rows")
                continue
        if r is None:
            c.problems.append(f"{where} rows {row}..{row + n - 1}: no source weight found for {tensor}")
            continue
        s0 = src_row if src_row is not None else 0
        if (bad := _misplaced(tensor, row, n, src_row, r.values.shape, tuple(w.shape))) is not None:
            c.problems.append(f"{where} {bad}")
            continue
        refs.append((r, s0, n))
        ok_spots.append((tensor, row, n))
        if spot.tensor not in c.members:
            c.members.append(spot.tensor)
    return refs, ok_spots


def _bounds(scheme: str, refs: list[tuple[Ref, int, int]], layer: dict, expert: int | None
            ) -> tuple[list[Ref], list[tuple[torch.Tensor, torch.Tensor]]]:
    """The placed rows' references and, per reference, its rows' error bound and which elements must be exact,
    by the layer's scheme: a quantization scheme's by the scheme itself (``schemes/*.engine_bound``: NVFP4's rows
    are independent but for the layer's one global scale, block FP8's follow the stored tensor's own tile grid); a
    dense layer's by its dtype."""
    if schemes.quantized(scheme):
        return [_rows(r, s0, n) for r, s0, n in refs], schemes.get(scheme).engine_bound(refs, layer, expert, _rows)
    rows = [_rows(r, s0, n) for r, s0, n in refs]
    return rows, [(_dense_bound(r, layer.get("dtype", "float32")), torch.ones_like(r.values, dtype=torch.bool))
                  for r in rows]


def _check_rows(where: str, layer: dict, c: LayerCheck, expert: int | None, spot: tuple[str, int, int],
                w: torch.Tensor, r: Ref, bound: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """The rows one placement wrote, held to their reference: counted in ``c``, its three worst rows noted, a
    row beyond its bound (or an element that must be exact and is not) a problem. Returns the rows' relative
    errors, which the layer's summary takes."""
    tensor, row, n = spot
    got = w[row: row + n].float()
    err = row_err(got, r.values)
    if c.scheme == "dense":  # exact only the rows the parameter's dtype holds exactly
        exact = exact & (bound == 0).unsqueeze(-1)
    differ = exact & (got != r.values)
    exact_bad = int(differ.sum())
    c.exact_elements += int(exact.sum())
    lim = torch.where(bound == 0, torch.zeros_like(bound), bound * SLACK + FLOOR)
    bad = (err > lim) | differ.any(dim=-1)
    c.rows += n
    c.exact = c.exact and bool((bound == 0).all())
    ratio = torch.where(lim > 0, err / lim, torch.where(err > 0, torch.inf, 0.0))
    top = torch.argsort(ratio, descending=True)[:3]
    for i in top.tolist():
        c.worst.append({"tensor": tensor, "expert": expert, "row": row + i, "source_row": i,
                        "rel_err": float(err[i]), "bound": float(bound[i]), "ratio": float(ratio[i])})
    if bool(bad.any()):
        rows = torch.nonzero(bad).flatten().tolist()
        what = (f"{exact_bad} element(s) the recipe keeps exactly differ" if exact_bad else
                f"relative error up to {float(err[bad].max()):.3g} against a bound of "
                f"{float(bound[bad].max()):.3g}")
        c.problems.append(f"{where} rows {row + rows[0]}..{row + rows[-1]} ({len(rows)} of {n}, "
                          f"from {tensor}): {what} ({c.scheme}: {_why(layer)})")
    return err


def _misplaced(tensor: str, row: int, n: int, src_row: int | None, src: tuple, read: tuple) -> str | None:
    """Why the ``n`` rows a write placed at ``row`` cannot be held to ``tensor``'s source rows, or None: the engine's
    read is not rows of that shape (rows past its end or before its start, a 3-D read without an expert: the Afmoe
    fixture's traceback once),
    or the source has other rows or columns than placed."""
    s0 = src_row if src_row is not None else 0
    if len(read) != len(src) or row < 0 or row + n > read[0]:
        return (f"rows {row}..{row + n - 1} hold {tensor} {list(src)}, but the engine's read of the parameter is "
                f"{list(read)}: the rows placed are not rows of it")
    if (src_row is None and src[0] != n) or s0 + n > src[0] or src[-1] != read[-1]:
        return f"rows {row}..{row + n - 1} hold {tensor}, whose source is {list(src)} (placed: {n} rows of " \
               f"{read[-1]} columns)"
    return None


def _order(spot: dict) -> tuple[torch.Tensor, str] | None:
    """The engine's own reordering of a tensor's rows before its write (``runner_numerics.row_orders``: vLLM's and
    SGLang's Llama 4 ``permute_qk_weight_for_rotary``), with where it is; None where rows are written as stored."""
    if spot.get("row_order") is None:
        return None
    return torch.tensor(spot["row_order"], dtype=torch.long), spot.get("row_order_by", "the engine's loader")


def _reordered(r: Ref, order: torch.Tensor) -> Ref | None:
    """The source's rows in the order the engine's loader writes them (row i of the write is source row
    ``order[i]``); None where the order is not a permutation of the source's rows (nothing to compare with)."""
    n = r.values.shape[0]
    if order.numel() != n or not torch.equal(order.sort().values, torch.arange(n)):
        return None
    return _indexed(r, order)


def _bank_expert(r: Ref, expert: int) -> Ref | None:
    """Expert ``expert``'s slice of a stored 3-D bank's reference (the engine's loader hands ``loaded_weight[expert]``
    to its expert weight loader); None where the source is not a bank with that expert."""
    if r.values.dim() < 3 or not 0 <= expert < r.values.shape[0]:
        return None
    return _indexed(r, expert)


def _strided(r: Ref, start: int | None, n: int, step: int) -> Ref | None:
    """The ``n`` source rows a write took every ``step`` rows from row ``start`` (vLLM 0.33's Inkling loader:
    ``w13[e][0::2]`` / ``[1::2]`` of an interleaved bank); None where they are not rows of it (``step`` 0, no first
    row) or run past its end."""
    if step <= 0 or start is None or start + (n - 1) * step >= r.values.shape[0]:
        return None
    return _indexed(r, slice(start, start + (n - 1) * step + 1, step))


def _rows(r: Ref, start: int, n: int) -> Ref:
    """The source rows one write placed (an engine may split one stored tensor over several slots)."""
    if start == 0 and n == r.values.shape[0]:
        return r
    return _indexed(r, slice(start, start + n))


def _indexed(r: Ref, index) -> Ref:
    """``r`` with the same index (rows, a permutation of them, one expert of a bank) taken of its values, its stored
    dense values and its E8M0 bytes alike."""
    pick = lambda t: None if t is None else t[index]  # noqa: E731
    return replace(r, values=r.values[index], dense=pick(r.dense), e8m0=pick(r.e8m0))


def _why(layer: dict) -> str:
    slots = layer.get("global_slots")
    if layer.get("scheme") != "nvfp4" or not slots:
        return "scales as the engine reads them"
    flat = [x for s in slots for x in (s if isinstance(s, list) else [s])]
    if len(set(flat)) > 1 and layer.get("kind") == "linear":
        return f"the engine keeps one global scale, the max of {sorted(set(flat))}"
    if layer.get("kind") == "moe" and any(isinstance(s, list) and len(set(s)) > 1 for s in slots):
        return "the engine reads w13 with the gate's global scale; the up half's differs"
    return "global scale as the engine keeps it"


def run(engine: str, result_file: Path, folder: Path, input_dir: Source | str | Path, output_dir: Path
        ) -> NumericReport:
    """The numeric check of one engine run (``result_file``: the runner's JSON, ``folder``: its dump)."""
    man = None
    mp = output_dir / filenames.MANIFEST
    if mp.is_file():
        try:
            man = json.loads(mp.read_text())
        except (OSError, ValueError) as e:
            raise ConvertError(f"{mp}: cannot read it ({e})") from None
    return compare(engine, json.loads(result_file.read_text()), folder, Sources(input_dir, output_dir, man))
