"""Compressed-tensors symmetric INT4 ``pack-quantized`` (Kimi K2 Thinking / K2.5 / K2.6's routed experts):
``weight_packed`` (I32 [N, K/8], eight 4-bit codes a word, lowest nibble first, stored as ``code + 8``),
``weight_scale`` (BF16 [N, K/G], one scale a group of G along K; the release's G is 32) and ``weight_shape``
(I64 or I32 [2], the weight's [N, K]), declared by ``quant_method: compressed-tensors`` with format
``pack-quantized`` and weights ``{num_bits: 4, type: int, symmetric: true, strategy: group}``.

Names, dtypes and layout are compressed-tensors' own (``PackedQuantizationCompressor.compress``:
``pack_to_int32``, ``weight_shape = torch.tensor(weight.shape)``), which both engines' WNA16 MoE loaders read
(vLLM ``CompressedTensorsWNA16MoEMethod.create_weights``: ``w13_weight_packed`` int32 [E, 2I, H/8],
``w13_weight_scale`` [E, 2I, H/G], ``w13_weight_shape`` [E, 2]).

Decoded exactly to fp32 (``kernels.encodings.decode_int4``): the product of a code in [-8, 7] and a BF16 scale
has at most 11 significant bits. It is not always a BF16 value (7 x (1 + 2^-7) needs 10 bits), so
compressed-tensors' own ``decompress`` (``dequantize`` in the scale's dtype) and a BF16 kernel round it; NVFP4
is quantized here from the exact product. Asymmetric weights (``weight_zero_point``), ``actorder: group``
(``weight_g_idx``), other bit widths and a group size that does not divide K are refused."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

from ..errors import ConvertError
from ..safetensors_format import TensorInfo
from .base import Claim, SourceEncoding, SourceTensor, module_of, refused

if TYPE_CHECKING:
    import torch

NAME = "int4_pack"
FORMAT = "pack-quantized"
PER_WORD = 8  # 4-bit codes an int32 holds


def _quant_configs(config: dict) -> list[tuple[str, dict]]:
    """(where, quantization_config) of a ``pack-quantized`` compressed-tensors config, at the top level
    or in ``text_config`` (where the Kimi releases keep it)."""
    out = []
    for where, cfg in (("quantization_config", config), ("text_config.quantization_config",
                                                         config.get("text_config"))):
        q = cfg.get("quantization_config") if isinstance(cfg, dict) else None
        if isinstance(q, dict) and q.get("quant_method") == "compressed-tensors" and _formats(q) & {FORMAT}:
            out.append((where, q))
    return out


def _formats(q: dict) -> set[str]:
    groups = [g for g in (q.get("config_groups") or {}).values() if isinstance(g, dict)]
    return {str(g.get("format", q.get("format"))) for g in groups} or {str(q.get("format"))}


def group_size(config: dict) -> int | None:
    """The ``pack-quantized`` groups' one group size (None when the config declares none), after
    :meth:`Int4Pack.check_config` has accepted the config."""
    sizes = {g["weights"]["group_size"] for _, q in _quant_configs(config) for g in _int4_groups(q)}
    return next(iter(sizes)) if sizes else None


def _int4_groups(q: dict) -> list[dict]:
    return [g for g in (q.get("config_groups") or {}).values()
            if isinstance(g, dict) and str(g.get("format", q.get("format"))) == FORMAT]


def _check_weights(where: str, w: object) -> None:
    """One config group's ``weights``: what this decoder reads, or a one-line refusal naming the key."""
    if not isinstance(w, dict):
        raise ConvertError(f"config.json: {where}.weights: missing (a pack-quantized group needs its weights)")
    want = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
    for key, value in want.items():
        if w.get(key) != value:
            raise ConvertError(f"config.json: {where}.weights.{key} is {w.get(key)!r}: the INT4 pack-quantized "
                               f"weights this tool reads have {key} {value!r}")
    g = w.get("group_size")
    if type(g) is not int or g <= 0:
        raise ConvertError(f"config.json: {where}.weights.group_size is {g!r}: a positive integer")
    if w.get("actorder") not in (None, "static", False):
        raise ConvertError(f"config.json: {where}.weights.actorder is {w.get('actorder')!r}: weight_g_idx "
                           "reordering is not read")


class Int4Pack(SourceEncoding):
    name = NAME
    label = "INT4"
    anchors = frozenset({"weight_packed"})
    companions = frozenset({"weight_scale", "weight_shape"})
    quant_configs: ClassVar[Mapping[str, frozenset[str]]] = {"compressed-tensors": frozenset({FORMAT})}

    def check_config(self, config: dict) -> None:
        qs = _quant_configs(config)
        for where, q in qs:
            groups = q.get("config_groups") or {}
            for gname, g in groups.items():
                if isinstance(g, dict) and g in _int4_groups(q):
                    _check_weights(f"{where}.config_groups.{gname}", g.get("weights"))
        sizes = {g["weights"]["group_size"] for _, q in qs for g in _int4_groups(q)}
        if len(sizes) > 1:
            raise ConvertError(f"config.json: quantization_config: pack-quantized groups of different group "
                               f"sizes {sorted(sizes)}: one is read")

    def claim(self, name: str, tensors: Mapping[str, TensorInfo], config: dict) -> tuple[Claim, ...]:
        packed = tensors[name]
        if packed.dtype != "I32":  # U8 codes are MXFP4's (mxfp4.py)
            return ()
        mod, _ = module_of(name)
        parts = (packed, tensors.get(f"{mod}.weight_scale"), tensors.get(f"{mod}.weight_shape"))
        for part, suffix in zip(parts[1:], ("weight_scale", "weight_shape"), strict=True):
            if part is None:
                raise refused(packed, f"INT4 packed weight without its {mod}.{suffix}")
        self.check(parts, config)
        n, k = packed.shape[0], packed.shape[1] * PER_WORD
        return (Claim(mod, "weight", SourceTensor(mod, f"{mod}.weight", NAME, "INT4", (n, k), parts)),)

    def check(self, parts: Sequence[TensorInfo], config: dict) -> None:
        packed, scale, shape = parts
        if len(packed.shape) != 2 or 0 in packed.shape:
            raise refused(packed, f"INT4 packed weight must be I32 [N, K/8], is {packed.dtype}{list(packed.shape)}")
        n, k = packed.shape[0], packed.shape[1] * PER_WORD
        if shape.dtype not in ("I64", "I32") or shape.shape != (2,):
            raise refused(shape, f"INT4 weight_shape must be I64 or I32 [2], is {shape.dtype}{list(shape.shape)}")
        g = group_size(config)
        if g is None:
            raise refused(packed, "INT4 packed weight, but config.json declares no compressed-tensors "
                                  "pack-quantized quantization_config (its group size)")
        if k % g:
            raise refused(packed, f"INT4 group size {g} does not divide K = {k} of the [{n}, {k}] weight")
        want = (n, k // g)
        if scale.dtype not in ("BF16", "F16", "F32") or scale.shape != want:
            raise refused(scale, f"INT4 scale must be BF16 {list(want)} for a [{n}, {k}] weight in groups of "
                                 f"{g}, is {scale.dtype}{list(scale.shape)}")

    def refuse_leftover(self, name: str, tensors: Mapping[str, TensorInfo]) -> None:
        """A ``weight_shape`` (or ``weight_scale``) no packed weight consumed."""
        mod, suffix = module_of(name)
        if suffix == "weight_shape" and f"{mod}.weight_packed" not in tensors:
            raise refused(tensors[name], f"INT4 weight_shape without its weight {mod}.weight_packed")
        if suffix == "weight_scale":
            super().refuse_leftover(name, tensors)

    def decode(self, src: SourceTensor, parts: Sequence[torch.Tensor], block: tuple[int, int]) -> torch.Tensor:
        from ..kernels.encodings import DecodeError, decode_int4

        check_weight_shape(src, [int(v) for v in parts[2].reshape(-1).tolist()])
        try:
            return decode_int4(parts[0], parts[1])
        except DecodeError as e:
            raise refused(src.parts[1], str(e)) from None


def check_weight_shape(src: SourceTensor, stored: list[int]) -> None:
    """Refuse a ``weight_shape`` whose values are not the packed weight's shape, in the same words on the torch
    decode's path (:meth:`Int4Pack.decode`) and the C kernels' (``compute_early.int4_rows``)."""
    if stored != list(src.shape):
        raise refused(src.parts[2], f"INT4 weight_shape {stored} is not the packed weight's {list(src.shape)}")
