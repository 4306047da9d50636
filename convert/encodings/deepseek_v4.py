"""DeepSeek V4's own storage (deepseek-ai/DeepSeek-V4-Flash, -Pro; ``DeepseekV4ForCausalLM``): every quantized
weight is ``X.weight`` with its scale in ``X.scale`` (not ``weight_scale_inv``), under DeepSeek's native names
(``layers.N.attn.wq_a``, ``layers.N.ffn.experts.E.w1``, ``mtp.0...``):

- **MXFP4 routed experts** (``expert_dtype: fp4``): ``weight`` I8 ``[N, K/2]``, two E2M1 codes a byte, low nibble
  first, and ``scale`` F8_E8M0 ``[N, K/32]`` (one power of two a group of 32 along K). The engines read them so:
  vLLM ``models/deepseek_v4/nvidia/model.py`` ``_make_deepseek_v4_weights_mapper`` renames an expert's ``.scale``
  to ``weight_scale`` for ``Mxfp4MoEMethod`` and ``DeepseekV4Model.load_weights`` views the E8M0 bytes as uint8;
  DeepSeek's own ``inference/convert.py`` decodes the nibbles low first. Claimed as MXFP4 (``holds_mxfp4``):
  NVIDIA's closed-form cast to NVFP4 applies, as Model Optimizer's
  ``examples/deepseek/deepseek_v4/quantize_to_nvfp4.py --cast_mxfp4_to_nvfp4`` does it.
- **block-FP8 linear layers** (attention, shared experts, the indexer's ``wq_b``, MTP ``e_proj``/``h_proj``):
  ``weight`` F8_E4M3 ``[N, K]`` and ``scale`` ``[ceil(N/128), ceil(K/128)]``, F8_E8M0 in the FP4-expert releases
  (``quantization_config.scale_fmt: ue8m0``) and F32 in the FP8-expert ones (DeepSeek-V4-Flash-Base: vLLM
  ``models/deepseek_v4/quant_config.py`` ``DeepseekV4FP8Config.is_scale_e8m0``). Decoded exactly to fp32:
  ``fp32(w) * 2**(e - 127)`` (or times the F32 scale), one tile of ``weight_block_size``.

Both claim a ``weight`` only where its ``scale`` sibling exists, and come before ``fp8_block`` in the registry (a
bare F8_E4M3 ``weight`` is that encoding's). A ``scale`` left over without its weight is refused. An E8M0 byte
0xFF (NaN in the OCP MX spec) is refused naming the scale tensor, on every path.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ..errors import ConvertError
from ..safetensors_format import TensorInfo
from .base import Claim, MxCodes, SourceEncoding, SourceTensor, module_of, refused
from .fp8_block import check_blocks

if TYPE_CHECKING:
    import torch

GROUP = 32  # values an MXFP4 E8M0 scale covers along K
SCALE = "scale"
MXFP4_NAME = "dsv4_mxfp4"
FP8_NAME = "dsv4_fp8"
SCALE_FMTS = frozenset({"ue8m0"})  # quantization_config.scale_fmt values this encoding reads


def _scaled(name: str, tensors: Mapping[str, TensorInfo], dtype: str) -> TensorInfo | None:
    """The ``scale`` sibling of a ``weight`` of ``dtype``, or None when this is not DeepSeek V4's storage."""
    w = tensors[name]
    if w.dtype != dtype:
        return None
    return tensors.get(f"{module_of(name)[0]}.{SCALE}")


def _e8m0_bytes(src: SourceTensor, scale: torch.Tensor) -> torch.Tensor:
    """The scale's E8M0 bytes (uint8), a NaN byte (0xFF) refused naming the scale tensor and where it is."""
    import torch

    from ..kernels.mxfp4_cast import nan_scale_message

    b = scale.view(torch.uint8)
    if bool((b == 255).any()):
        if src.encoding == MXFP4_NAME:
            raise refused(src.parts[1], nan_scale_message(b))
        row, col = (int(v) for v in (b == 255).nonzero()[0])
        raise refused(src.parts[1], f"E8M0 scale byte 0xFF (NaN in the OCP MX spec) for tile ({row}, {col})")
    return b


#: the dtypes DeepSeek V4's weight scales are stored in (MXFP4: F8_E8M0; block-FP8: F8_E8M0 or F32)
SCALE_DTYPES = frozenset({"F8_E8M0", "F32"})


def _refuse_stray_scale(name: str, tensors: Mapping[str, TensorInfo]) -> bool:
    """Whether a ``scale`` no claim consumed is a stray part of DeepSeek V4's storage: only one in a scale dtype.
    Other models store plain tensors under that name (Gemma 4's router ``scale``, a BF16 vector transformers'
    ``Gemma4TextRouter`` multiplies in), which are dense weights, not scales."""
    return tensors[name].dtype in SCALE_DTYPES


class _DeepseekV4Scaled(SourceEncoding):
    """What both of DeepSeek V4's encodings do alike: a ``weight`` stored as ``stored`` claimed only with its ``scale``
    sibling, checked (``check``) against the config's ``scale_fmt``; a leftover ``scale`` refused."""

    anchors = frozenset({"weight"})
    companions = frozenset({SCALE})
    stored: str  # the weight's dtype

    def check_config(self, config: dict) -> None:
        _check_scale_fmt(config)

    def refuse_leftover(self, name: str, tensors: Mapping[str, TensorInfo]) -> None:
        if _refuse_stray_scale(name, tensors):
            super().refuse_leftover(name, tensors)

    def claim(self, name: str, tensors: Mapping[str, TensorInfo], config: dict) -> tuple[Claim, ...]:
        scale = _scaled(name, tensors, self.stored)
        if scale is None:
            return ()
        w = tensors[name]
        self.check((w, scale), config)
        mod, _ = module_of(name)
        return (Claim(mod, "weight", self.source(mod, name, w, scale)),)

    def source(self, mod: str, name: str, w: TensorInfo, scale: TensorInfo) -> SourceTensor:
        raise NotImplementedError


class DeepseekV4MXFP4(_DeepseekV4Scaled):
    name = MXFP4_NAME
    label = "MXFP4"  # labels() names MXFP4 once
    stored = "I8"
    holds_mxfp4 = True

    def source(self, mod: str, name: str, w: TensorInfo, scale: TensorInfo) -> SourceTensor:
        return SourceTensor(mod, name, MXFP4_NAME, "MXFP4", (w.shape[0], w.shape[1] * 2), (w, scale))

    def check(self, parts: Sequence[TensorInfo], config: dict) -> None:
        packed, scale = parts
        if len(packed.shape) != 2:
            raise refused(packed, f"MXFP4 expert weight must be I8 [N, K/2], is {packed.dtype}{list(packed.shape)}")
        n, k = packed.shape[0], packed.shape[1] * 2
        want = [n, math.ceil(k / GROUP)]
        if scale.dtype != "F8_E8M0" or list(scale.shape) != want or k % GROUP:
            raise refused(scale, f"MXFP4 scale must be F8_E8M0 {want} for a [{n}, {k}] weight (K a multiple of "
                                 f"{GROUP}), is {scale.dtype}{list(scale.shape)}")

    def decode(self, src: SourceTensor, parts: Sequence[torch.Tensor], block: tuple[int, int]) -> torch.Tensor:
        import torch

        from ..kernels.encodings import decode_mxfp4

        return decode_mxfp4(parts[0].view(torch.uint8), _e8m0_bytes(src, parts[1]))

    def mxfp4_codes(self, src: SourceTensor, parts: Sequence[torch.Tensor]) -> MxCodes:
        import torch

        from ..kernels.mxfp4_cast import k_max

        scale = _e8m0_bytes(src, parts[1])
        return MxCodes(parts[0].view(torch.uint8), scale, k_max(scale))


class DeepseekV4FP8(_DeepseekV4Scaled):
    name = FP8_NAME
    label = "block-FP8"
    stored = "F8_E4M3"

    def source(self, mod: str, name: str, w: TensorInfo, scale: TensorInfo) -> SourceTensor:
        return SourceTensor(mod, name, FP8_NAME, "F8_E4M3", w.shape, (w, scale))

    def check(self, parts: Sequence[TensorInfo], config: dict) -> None:
        check_blocks(parts, config, ("F8_E8M0", "F32"), "F8_E8M0 or F32")

    def decode(self, src: SourceTensor, parts: Sequence[torch.Tensor], block: tuple[int, int]) -> torch.Tensor:
        import torch

        from ..kernels.encodings import decode_fp8_block

        scale = parts[1]
        if scale.dtype != torch.float32:
            scale = torch.exp2(_e8m0_bytes(src, scale).to(torch.float32) - 127)
        return decode_fp8_block(parts[0], scale, block)


def _check_scale_fmt(config: dict) -> None:
    q = config.get("quantization_config")
    fmt = q.get("scale_fmt") if isinstance(q, dict) else None
    if fmt is not None and fmt not in SCALE_FMTS:
        raise ConvertError(f"config.json: quantization_config.scale_fmt {fmt!r} is not one of "
                           f"{', '.join(sorted(SCALE_FMTS))}")
