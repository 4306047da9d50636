"""FP8 with block scales (DeepSeek V3 style): ``weight`` (F8_E4M3 [N, K]) and ``weight_scale_inv`` (F32 or
BF16, one a ``weight_block_size`` tile: ``quantization_config.weight_block_size``, 128x128 when absent),
declared by ``quant_method: fp8`` with format ``e4m3`` (DeepSeek V3) or ``float8_e4m3fn`` (MiniMax-M2's
spelling of the same format).

Decoded exactly to fp32: one multiply a value by its tile's scale (``kernels.encodings.decode_fp8_block``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

from ..errors import ConvertError
from ..safetensors_format import TensorInfo
from .base import Claim, Encoding, SourceEncoding, SourceTensor, module_of, refused

if TYPE_CHECKING:
    import torch

DEFAULT_BLOCK = [128, 128]


def block_size(config: dict) -> tuple[int, int]:
    """The checkpoint's FP8 tile (rows, cols): what decoding needs besides the tensors (the pipeline
    carries it to its workers)."""
    q = config.get("quantization_config") or {}
    b = q.get("weight_block_size", DEFAULT_BLOCK) if isinstance(q, dict) else DEFAULT_BLOCK
    if not (isinstance(b, list) and len(b) == 2 and all(type(v) is int and v > 0 for v in b)):
        raise ConvertError(f"config.json: quantization_config.weight_block_size {b!r} is not [rows, cols]")
    return b[0], b[1]


def check_blocks(parts: Sequence[TensorInfo], config: dict, dtypes: tuple[str, ...], said: str) -> None:
    """A 2-D FP8 weight and its scale of one value per tile (``weight_block_size``), the scale in one of ``dtypes``
    (named ``said`` in the refusal): the one shape check of every block-scaled FP8 encoding. A 3-D weight is a stacked
    expert bank (Step-3's FP8 release: ``moe.gate_proj.weight`` [E, N, K]), its scales each expert's [E, ., .]; where
    the plan reads it as anything but a ``[stacked]`` bank, the scheme refuses its shape."""
    w, s = parts
    block = block_size(config)
    if len(w.shape) not in (2, 3):
        raise refused(w, f"FP8 block-scaled weight must be 2-D (or a 3-D stacked expert bank), is {list(w.shape)}")
    want = [*w.shape[:-2], math.ceil(w.shape[-2] / block[0]), math.ceil(w.shape[-1] / block[1])]
    if s.dtype not in dtypes or list(s.shape) != want:
        raise refused(s, f"FP8 scale must be {said} {want} for {list(w.shape)} with blocks {list(block)}, "
                         f"is {s.dtype}{list(s.shape)}")


class FP8Block(SourceEncoding):
    name = Encoding.FP8_BLOCK
    label = "block-FP8"
    anchors = frozenset({"weight"})
    companions = frozenset({"weight_scale_inv"})
    quant_configs: ClassVar[Mapping[str, frozenset[str]]] = {"fp8": frozenset({"e4m3", "float8_e4m3fn"})}

    def check_config(self, config: dict) -> None:
        block_size(config)

    def claim(self, name: str, tensors: Mapping[str, TensorInfo], config: dict) -> tuple[Claim, ...]:
        w = tensors[name]
        if w.dtype.startswith("F8_") and w.dtype != "F8_E4M3":  # F8_E5M2: no engine's block-FP8 path reads it
            raise refused(w, f"{w.dtype} weight: the FP8 source format this tool reads is F8_E4M3 with "
                             "weight_scale_inv block scales")
        if w.dtype != "F8_E4M3":
            return ()
        mod, _ = module_of(name)
        s = tensors.get(f"{mod}.weight_scale_inv")
        if s is None:
            raise refused(w, f"FP8 weight without its {mod}.weight_scale_inv")
        self.check((w, s), config)
        return (Claim(mod, "weight", SourceTensor(mod, w.name, Encoding.FP8_BLOCK, "F8_E4M3", w.shape, (w, s))),)

    def check(self, parts: Sequence[TensorInfo], config: dict) -> None:
        check_blocks(parts, config, ("F32", "BF16"), "F32")

    def refuse_leftover(self, name: str, tensors: Mapping[str, TensorInfo]) -> None:
        """A ``weight_scale_inv`` no FP8 weight consumed: without its weight, or beside a weight of another
        dtype (a BF16 weight with block scales is no format: copied through, the engines would read the
        scale as a parameter of a module they build unquantized)."""
        mod, suffix = module_of(name)
        w = tensors.get(f"{mod}.weight")
        if suffix in self.companions and w is not None:
            raise refused(tensors[name], f"block scale beside a {w.dtype} weight {w.name}: only an F8_E4M3 "
                                         "weight has one")
        super().refuse_leftover(name, tensors)

    def decode(self, src: SourceTensor, parts: Sequence[torch.Tensor], block: tuple[int, int]) -> torch.Tensor:
        from ..kernels.encodings import DecodeError, decode_fp8_block

        try:
            return decode_fp8_block(parts[0], parts[1], block)
        except DecodeError as e:
            raise refused(src.parts[1], f"{e}: {src.parts[0].name} cannot be decoded") from None
