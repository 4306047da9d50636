"""gpt-oss's MXFP4 experts (openai/gpt-oss-20b, -120b; ``quant_method: mxfp4``): one 3-D bank a layer and
projection, ``mlp.experts.gate_up_proj_blocks`` U8 [E, 2I, H/32, 16] (two E2M1 codes a byte, low nibble
first), ``gate_up_proj_scales`` U8 E8M0 [E, 2I, H/32], ``gate_up_proj_bias`` [E, 2I]; ``down_proj_*`` [E, H,
I/32, 16], [E, H, I/32], [E, H]. Gate rows are at even, up rows at odd indices of ``gate_up_proj``
(transformers' ``GptOssExperts``: ``gate, up = gate_up[..., ::2], gate_up[..., 1::2]``).

One claim on a bank gives every expert's logical weights, named as the mapping table
(``mappings/gpt_oss.toml``) knows them: ``mlp.experts.{e}.gate_proj`` / ``up_proj`` (the even / odd rows:
``Slice(0, j, None, 2)``) and ``mlp.experts.{e}.down_proj``, each with its ``bias`` (dense, the same view).
Each expert reads only its own bytes (``base.narrow``: ``NAME[e]``), gate and up the same ones.

The cast's ``k_max`` is the **bank's** (all experts, gate and up together; down on its own): NVIDIA Model
Optimizer's ``examples/hf_ptq/cast_mxfp4_to_nvfp4.py`` takes one ``global_amax`` a ``*_scales`` tensor
(``mxfp4_to_nvfp4_global_amax(scales)``), so each weight's claim carries the whole ``_scales`` tensor as a
last part, read whole (``sliced`` False for it) and used only for ``k_max``. The scales are 1/16 of the
codes' bytes, and each of the E units of a bank reads them (w13 and down apart): E/16 times the bank's code
bytes read again in all (2x for gpt-oss-20b's 32 experts, 8x for -120b's 128, mostly from the page cache),
the price of planning experts one at a time with NVIDIA's per-bank scale (docs/families.md, "Left").

Decoded exactly to fp32 (``kernels.encodings.decode_mxfp4`` on codes reshaped [N, K/32, 16] -> [N, K/2]);
an E8M0 byte 0xFF (NaN) is refused naming the scale tensor."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

from ..safetensors_format import TensorInfo
from .base import Claim, Encoding, MxCodes, Slice, SourceEncoding, SourceTensor, module_of, narrow, refused

if TYPE_CHECKING:
    import torch

GROUP = 32  # values an E8M0 scale covers along K
NAME = "gpt_oss_mxfp4"
#: bank -> its logical leaves: (leaf, row view) in the bank's row order.
BANKS: dict[str, tuple[tuple[str, Slice | None], ...]] = {
    "gate_up_proj": (("gate_proj", Slice(0, 0, None, 2)), ("up_proj", Slice(0, 1, None, 2))),
    "down_proj": (("down_proj", None),),
}
BANK_SCALES = 2  # the index of the whole-bank scales among a weight's parts


class GptOssMXFP4(SourceEncoding):
    name = NAME
    label = "MXFP4"  # the same word as compressed-tensors' MXFP4: labels() names it once
    anchors = frozenset(f"{b}_blocks" for b in BANKS)
    companions = frozenset(f"{b}_scales" for b in BANKS)
    quant_configs: ClassVar[Mapping[str, frozenset[str]]] = {"mxfp4": frozenset({"mxfp4"})}
    holds_mxfp4 = True

    def claim(self, name: str, tensors: Mapping[str, TensorInfo], config: dict) -> tuple[Claim, ...]:
        base = name[: -len("_blocks")]
        mod, bank = module_of(base)
        blocks, scales, bias = tensors[name], tensors.get(f"{base}_scales"), tensors.get(f"{base}_bias")
        if scales is None:
            raise refused(blocks, f"MXFP4 expert bank without its {base}_scales")
        self.check((blocks, scales), config)
        e, n, kb = blocks.shape[:3]
        if bias is not None and bias.shape != (e, n):
            raise refused(bias, f"expert bias must be [{e}, {n}] for blocks {list(blocks.shape)}, "
                                f"is {list(bias.shape)}")
        k, leaves = kb * GROUP, BANKS[bank]
        rows = n // len(leaves)
        out = []
        for x in range(e):
            b, s = narrow(blocks, x), narrow(scales, x)
            for leaf, view in leaves:
                m = f"{mod}.{x}.{leaf}"
                v = (view,) if view else ()
                out.append(Claim(m, "weight", SourceTensor(m, f"{m}.weight", NAME, "MXFP4", (rows, k),
                                                           (b, s, scales), v)))
                if bias is not None:
                    out.append(Claim(m, "bias", SourceTensor(m, f"{m}.bias", Encoding.DENSE, bias.dtype, (rows,),
                                                             (narrow(bias, x),), v)))
        return tuple(out)

    def check(self, parts: Sequence[TensorInfo], config: dict) -> None:
        """The bank's blocks and scales: U8, [E, N, K/32, 16] and [E, N, K/32]; gate_up's N even."""
        blocks, scales = parts
        if blocks.dtype != "U8" or len(blocks.shape) != 4 or blocks.shape[3] != GROUP // 2:
            raise refused(blocks, f"MXFP4 expert bank must be U8 [E, N, K/32, 16], is {blocks.dtype}"
                                  f"{list(blocks.shape)}")
        e, n, kb = blocks.shape[:3]
        if scales.dtype != "U8" or scales.shape != (e, n, kb):
            raise refused(scales, f"MXFP4 expert scales must be U8 {[e, n, kb]} for blocks {list(blocks.shape)}, "
                                  f"is {scales.dtype}{list(scales.shape)}")
        if module_of(blocks.name)[1] == "gate_up_proj_blocks" and n % 2:
            raise refused(blocks, f"gate_up_proj has {n} rows: gate and up interleaved need an even number")

    def refuse_leftover(self, name: str, tensors: Mapping[str, TensorInfo]) -> None:
        base = name[: -len("_scales")]
        if f"{base}_blocks" not in tensors:
            raise refused(tensors[name], f"MXFP4 scales without their {base}_blocks")

    def sliced(self, part: int) -> bool:
        return part != BANK_SCALES

    def decode(self, src: SourceTensor, parts: Sequence[torch.Tensor], block: tuple[int, int]) -> torch.Tensor:
        from ..kernels.encodings import DecodeError, decode_mxfp4

        try:
            return decode_mxfp4(parts[0].reshape(parts[0].shape[0], -1), parts[1])
        except DecodeError as e:
            raise refused(src.parts[1], str(e)) from None

    def mxfp4_codes(self, src: SourceTensor, parts: Sequence[torch.Tensor]) -> MxCodes:
        """The weight's codes [N, K/2] and scales [N, K/32]; ``k_max`` is its whole bank's."""
        from ..kernels.encodings import DecodeError
        from ..kernels.mxfp4_cast import k_max

        for i in (1, BANK_SCALES):  # a NaN byte: named in the weight's own scales when it is there
            try:
                top = k_max(parts[i])
            except DecodeError as e:
                raise refused(src.parts[i], str(e)) from None
        return MxCodes(parts[0].reshape(parts[0].shape[0], -1), parts[1], top)
