"""Dense: a stored tensor that is its own logical tensor (BF16, F32, ... as stored).

The fallback of discovery: it claims every stored tensor that no other encoding consumed, so its claim
cannot refuse anything; the refusals of stray parts (a scale without its weight) belong to the
encodings whose parts they are (``refuse_leftover``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ..safetensors_format import TensorInfo
from .base import Claim, Encoding, SourceEncoding, SourceTensor

if TYPE_CHECKING:
    import torch


class Dense(SourceEncoding):
    name = Encoding.DENSE
    label = "BF16"
    anchors = None

    def claim(self, name: str, tensors: Mapping[str, TensorInfo], config: dict) -> tuple[Claim, ...]:
        info = tensors[name]
        mod, _, suffix = name.rpartition(".")
        return (Claim(mod, suffix, SourceTensor(mod, name, Encoding.DENSE, info.dtype, info.shape, (info,))),)

    def decode(self, src: SourceTensor, parts: Sequence[torch.Tensor], block: tuple[int, int]) -> torch.Tensor:
        """The stored tensor itself (a zero-copy view of the buffer it was read into, on the CPU)."""
        return parts[0]
