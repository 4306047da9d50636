"""Compressed-tensors MXFP4 (Kimi K3's routed experts): ``weight_packed`` (U8 [N, K/2], two E2M1 codes a
byte) and ``weight_scale`` (U8 [N, K/32], one E8M0 exponent a group of 32 along K), declared by
``quant_method: compressed-tensors`` with format ``mxfp4-pack-quantized``.

Decoded exactly to fp32 (``kernels.encodings.decode_mxfp4``); a weight cast to NVFP4 by NVIDIA's closed form
hands over its codes instead (``mxfp4_codes``). An E8M0 byte 0xFF is NaN in the OCP MX spec: both paths
refuse it, naming the scale tensor."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

from ..safetensors_format import TensorInfo
from .base import Claim, Encoding, MxCodes, SourceEncoding, SourceTensor, module_of, refused

if TYPE_CHECKING:
    import torch

GROUP = 32  # values an E8M0 scale covers along K (kernels.encodings.MXFP4_GROUP)


class MXFP4(SourceEncoding):
    name = Encoding.MXFP4
    label = "MXFP4"
    anchors = frozenset({"weight_packed"})
    companions = frozenset({"weight_scale"})
    quant_configs: ClassVar[Mapping[str, frozenset[str]]] = {"compressed-tensors": frozenset({"mxfp4-pack-quantized"})}
    holds_mxfp4 = True

    def claim(self, name: str, tensors: Mapping[str, TensorInfo], config: dict) -> tuple[Claim, ...]:
        mod, _ = module_of(name)
        packed, scale = tensors[name], tensors.get(f"{mod}.weight_scale")
        if scale is None:
            raise refused(packed, f"MXFP4 weight without its {mod}.weight_scale")
        self.check((packed, scale), config)
        n, k = packed.shape[0], packed.shape[1] * 2
        return (Claim(mod, "weight", SourceTensor(mod, f"{mod}.weight", Encoding.MXFP4, "MXFP4", (n, k),
                                                  (packed, scale))),)

    def check(self, parts: Sequence[TensorInfo], config: dict) -> None:
        packed, scale = parts
        if packed.dtype != "U8" or len(packed.shape) != 2:
            raise refused(packed, f"MXFP4 packed weight must be U8 [N, K/2], is {packed.dtype}{list(packed.shape)}")
        n, k = packed.shape[0], packed.shape[1] * 2
        want = [n, math.ceil(k / GROUP)]
        if scale.dtype != "U8" or scale.shape != tuple(want) or k % GROUP:
            raise refused(scale, f"MXFP4 scale must be U8 {want} for a [{n}, {k}] weight (K a multiple of "
                                 f"{GROUP}), is {scale.dtype}{list(scale.shape)}")

    def decode(self, src: SourceTensor, parts: Sequence[torch.Tensor], block: tuple[int, int]) -> torch.Tensor:
        from ..kernels.encodings import DecodeError, decode_mxfp4

        try:
            return decode_mxfp4(parts[0], parts[1])
        except DecodeError as e:
            raise refused(src.parts[1], str(e)) from None

    def mxfp4_codes(self, src: SourceTensor, parts: Sequence[torch.Tensor]) -> MxCodes:
        from ..kernels.encodings import DecodeError
        from ..kernels.mxfp4_cast import k_max

        try:  # a NaN scale byte (0xFF) is refused here, before any backend casts
            return MxCodes(parts[0], parts[1], k_max(parts[1]))
        except DecodeError as e:
            raise refused(src.parts[1], str(e)) from None
