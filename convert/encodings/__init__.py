"""Source encodings: one module per way a source checkpoint stores a weight, and their registry.

- ``dense``: the stored tensor is the weight (BF16, F32...); the fallback of discovery;
- ``int4_pack``: compressed-tensors INT4 ``pack-quantized``, ``weight_packed`` I32 + ``weight_scale`` BF16 +
  ``weight_shape`` (Kimi K2.5 / K2.6's routed experts); before ``mxfp4``, which refuses a non-U8 ``weight_packed``;
- ``mxfp4``: compressed-tensors MXFP4, ``weight_packed`` + ``weight_scale`` (Kimi K3's routed experts);
- ``fp8_block``: ``weight`` F8_E4M3 + ``weight_scale_inv``, tiles from ``weight_block_size`` (DeepSeek V3);
- ``gpt_oss_mxfp4``: gpt-oss's 3-D MXFP4 expert banks, ``*_blocks`` + ``*_scales`` (+ ``*_bias``);
- ``expert_bank``: fused 3-D expert banks in BF16 / F16 / F32 (IBM Granite's ``block_sparse_moe.input_linear`` /
  ``output_linear``), split into per-expert dense byte ranges; after every claimer of a ``weight``, before dense;
- ``deepseek_v4``: DeepSeek V4's ``weight`` + ``scale``: MXFP4 experts (I8 + F8_E8M0 [N, K/32], ``dsv4_mxfp4``) and
  block-FP8 linears (F8_E4M3 + F8_E8M0 or F32 tiles, ``dsv4_fp8``); before ``fp8_block``, which takes a bare
  F8_E4M3 ``weight``.

Each module holds one :class:`~.base.SourceEncoding`: its discovery (``claim``), its refusal rules
(``check``, ``check_config``, ``refuse_leftover``, the ``quantization_config`` values it accepts, values
it cannot decode) and its decoding (calling ``kernels.encodings``). The interface is in ``base``.

**A new encoding** is one new module here and its line in ``REGISTRY`` (the order is discovery's: the
first encoding to claim a stored tensor has it; the fallback last). Nothing in ``plan/``, ``compute`` or
the numeric check names an encoding: they call :func:`claimers`, :func:`strays`, :func:`fallbacks`, :func:`decode`,
:func:`mxfp4_codes`, :func:`source_formats` and :func:`of`. ``tests/test_encodings.py`` registers one
from a test module and packs with it.

**gpt-oss** (``gpt_oss_mxfp4``: ``*_blocks``/``*_scales`` MXFP4 3-D expert banks, gate/up interleaved,
biases, ``quant_method: mxfp4``) is one claim a bank giving a claim per expert and per gate/up half
(``base.narrow`` for the expert, ``Slice(0, j, None, 2)`` for the interleave, biases as ``bias`` claims).
What it needed outside its module, generic: a narrowed part is named ``NAME[i]`` (``base.narrow``;
discovery marks the stored tensor consumed through ``base.stored_name``), so that the pipeline's read
buffers, source hashes and the manifest's source records (all keyed by part name) tell the parts of one
stored tensor apart; a unit reads a part its sources share once (``Unit.parts``); a dense source with a
view is not a pass-through (:func:`as_stored`) but its view's bytes; the manifest's and ``plan --json``'s
source records carry the view; an encoding may read a part whole past the view (``SourceEncoding.sliced``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .base import Claim, Encoding, MxCodes, Slice, SourceEncoding, SourceTensor, narrow, stored_name
from .deepseek_v4 import DeepseekV4FP8, DeepseekV4MXFP4
from .dense import Dense
from .expert_bank import ExpertBank
from .fp8_block import FP8Block, block_size
from .gpt_oss_mxfp4 import GptOssMXFP4
from .int4_pack import Int4Pack
from .mxfp4 import MXFP4

if TYPE_CHECKING:
    import torch

#: Every encoding, in discovery order (claimers first, the dense fallback last).
REGISTRY: list[SourceEncoding] = [Int4Pack(), MXFP4(), DeepseekV4MXFP4(), DeepseekV4FP8(), FP8Block(), GptOssMXFP4(),
                                  ExpertBank(), Dense()]


def of(src: SourceTensor) -> SourceEncoding:
    """The encoding that claimed ``src``."""
    for enc in REGISTRY:
        if enc.name == src.encoding:
            return enc
    raise KeyError(f"no source encoding {src.encoding!r} is registered")


def claimers() -> dict[str, list[SourceEncoding]]:
    """Last name component -> the encodings a stored tensor with it is offered to, in registry order."""
    out: dict[str, list[SourceEncoding]] = {}
    for enc in REGISTRY:
        for suffix in sorted(enc.anchors or ()):
            out.setdefault(suffix, []).append(enc)
    return out


def strays() -> dict[str, list[SourceEncoding]]:
    """Last name component -> the encodings whose ``refuse_leftover`` a stored tensor with it, consumed by
    no claim, goes through (their scales without their weights)."""
    out: dict[str, list[SourceEncoding]] = {}
    for enc in REGISTRY:
        for suffix in sorted(enc.companions):
            out.setdefault(suffix, []).append(enc)
    return out


def fallbacks() -> list[SourceEncoding]:
    """The encodings offered what no claimer consumed (dense), in registry order."""
    return [enc for enc in REGISTRY if enc.anchors is None]


def source_formats() -> dict[str, set[str]]:
    """``quant_method`` -> the formats some encoding reads: the ``quantization_config`` values a source
    checkpoint may declare (anything else is a converted checkpoint, which ``check_convertible`` refuses)."""
    out: dict[str, set[str]] = {}
    for enc in REGISTRY:
        for method, formats in enc.quant_configs.items():
            out.setdefault(method, set()).update(formats)
    return out


def labels() -> str:
    """The encodings as the refusals name them: "BF16, MXFP4 or block-FP8"."""
    names = list(dict.fromkeys(enc.label for enc in sorted(REGISTRY, key=lambda e: e.anchors is not None)))
    return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else names[0]


def decode(src: SourceTensor, parts: Sequence[torch.Tensor], block: tuple[int, int]) -> torch.Tensor:
    """``src``'s values from its parts as read (on whatever device they are): the stored tensor for dense,
    decoded fp32 otherwise. ``src.view`` is applied to every part first."""
    return of(src).decode(src, _viewed(src, parts), block)


def mxfp4_codes(src: SourceTensor, parts: Sequence[torch.Tensor]) -> MxCodes | None:
    """``src`` as MXFP4 codes, scales and ``k_max`` for NVIDIA's cast, or None when it is not MXFP4."""
    return of(src).mxfp4_codes(src, _viewed(src, parts))


def holds_mxfp4(src: SourceTensor) -> bool:
    """Whether ``src`` is stored as MXFP4 codes that NVIDIA's closed-form cast reads (no parts needed)."""
    return of(src).holds_mxfp4


def as_stored(src: SourceTensor) -> bool:
    """Whether ``src``'s values are its stored bytes as they are (dense, no view): a pass-through."""
    return src.encoding == Encoding.DENSE and not src.view


def _viewed(src: SourceTensor, parts: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    if not src.view:
        return parts
    enc = of(src)
    out = []
    for i, p in enumerate(parts):
        if enc.sliced(i):
            for s in src.view:
                p = p[_index(p.dim(), s)]
        out.append(p.contiguous())
    return out


def _index(ndim: int, s: Slice) -> tuple[slice, ...]:
    return (slice(None),) * s.dim + (slice(s.start, s.stop, s.step),) + (slice(None),) * (ndim - s.dim - 1)


__all__ = [
    "MXFP4",
    "REGISTRY",
    "Claim",
    "DeepseekV4FP8",
    "DeepseekV4MXFP4",
    "Dense",
    "Encoding",
    "ExpertBank",
    "FP8Block",
    "GptOssMXFP4",
    "Int4Pack",
    "MxCodes",
    "Slice",
    "SourceEncoding",
    "SourceTensor",
    "as_stored",
    "block_size",
    "claimers",
    "decode",
    "fallbacks",
    "holds_mxfp4",
    "labels",
    "mxfp4_codes",
    "narrow",
    "of",
    "source_formats",
    "stored_name",
    "strays",
]
