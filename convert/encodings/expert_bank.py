"""Fused 3-D expert banks in high precision (BF16, F16 or F32): one stored tensor holding every routed expert of a
layer and projection, split into the per-expert modules both engines load.

IBM Granite 3.x / 4.0 (``GraniteMoeForCausalLM``, ``GraniteMoeSharedForCausalLM``, ``GraniteMoeHybridForCausalLM``)
store a MoE layer's experts as ``block_sparse_moe.input_linear.weight`` [E, 2I, H] (each expert's gate rows, then its
up rows: transformers' ``GraniteMoeParallelExperts`` / ``GraniteMoeMoE.forward`` chunks the output in two, the first
half activated) and ``block_sparse_moe.output_linear.weight`` [E, H, I]. NVFP4 has one global scale per expert and
projection, so the output holds one module per expert and projection, named as both engines' loaders read a
per-expert quantized checkpoint:

- vLLM 0.33: ``model_executor/layers/fused_moe/routed_experts.py`` ``RoutedExperts.load_weights`` with
  ``build_expert_params_mapping``'s per-expert entries ``experts.{e}.gate_proj.`` / ``up_proj.`` / ``down_proj.``
  (``GraniteMoeMoE`` builds ``FusedMoEFactory`` with the default checkpoint names ``gate_proj`` / ``up_proj`` /
  ``down_proj``; ``granitemoeshared.py`` reuses ``GraniteMoeModel.load_weights``); ``granitemoehybrid.py``
  ``GraniteMoeHybridModel.get_expert_mapping`` / ``load_weights._load_quant_expert``, the same names;
- SGLang 0.5.23: ``models/granitemoe.py`` ``GraniteMoeForCausalLM._split_expert_params_mapping`` and
  ``granitemoe_load_split_experts`` (its comment: llm-compressor "emits one tensor per expert per projection
  (``experts.{e}.gate_proj.weight``, ``.weight_scale``, ...)"), which ``GraniteMoeSharedForCausalLM`` inherits;
  ``granitemoehybrid.py`` ``GraniteMoeHybridForCausalLM.get_expert_mapping``, the same names.

Google's Gemma 4 MoE (``Gemma4ForCausalLM``, ``model_type`` ``gemma4_text``; ``gemma4`` for the multimodal release)
stores ``layers.N.experts.gate_up_proj`` [E, 2I, H] (gate rows, then up rows) and ``experts.down_proj`` [E, H, I]
under the experts module itself; both engines read per-expert ``experts.{e}.gate_proj`` / ``up_proj`` /
``down_proj`` (vLLM 0.33 ``gemma4.py`` ``Gemma4DecoderLayer`` builds ``FusedMoEFactory`` with the default names:
``RoutedExperts.load_weights`` as above; SGLang 0.5.23 ``gemma4_causal.py`` ``Gemma4ForCausalLM.load_weights``,
its "per-expert checkpoint layout ... ModelOpt NVFP4 like nvidia/Gemma-4-*-NVFP4" mapping). Yandex's AliceAI
(``AliceAIForCausalLM``, ``model_type`` ``alice_ai``: ``yandex/AliceAI-Foundation-80B-A3B-Base``) stores the same
banks under ``mlp.experts`` (gate rows, then up: vLLM 0.33 ``routed_experts.py`` ``RoutedExperts.load_weights`` splits
its bank with ``chunk(2, dim=1)``), and vLLM reads its per-expert names alike (``alice_ai.py`` builds
``FusedMoEFactory`` with the default checkpoint names). These two layouts are read for Gemma 4's and AliceAI's
model types only: gpt-oss's BF16 release names its bank ``experts.gate_up_proj`` too, stored [E, H, 2I] with gate and
up interleaved.

One claim on a bank gives ``block_sparse_moe.experts.{e}.gate_proj`` / ``up_proj`` (rows ``0:I`` and ``I:2I`` of
expert e) and ``block_sparse_moe.experts.{e}.down_proj``. Each is a byte range of the stored tensor (``base.narrow``
twice), so each is a plain dense weight, read on its own, and the same weights stored per expert give the same
bytes (``tests/test_encodings.py``).

Llama 4 (``Llama4ForCausalLM``, ``model_type`` ``llama4_text``; ``llama4`` for the multimodal release) stores its
banks transposed: ``feed_forward.experts.gate_up_proj`` [E, H, 2I] (gate columns, then up: transformers'
``Llama4TextExperts`` ``gate_up.chunk(2, dim=-1)``) and ``feed_forward.experts.down_proj`` [E, I, H]. vLLM 0.33 reads
per-expert ``feed_forward.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj`` [out, in] (``llama4.py``
``Llama4Model.load_weights``, its non-fused ``expert_params_mapping``; the fused bank it transposes on load,
``load_moe_expert_weights``); SGLang 0.5.23's text class reads no experts in any form (``llama4.py``
``Llama4ForCausalLM`` inherits ``llama.py`` ``LlamaForCausalLM.load_weights``). An expert's weight is then its
columns of the bank, swapped: no byte range, so those claims are this encoding's (``Slice`` on the columns, then
:meth:`ExpertBank.decode` transposes, exactly).

StepFun's Step-3.5-Flash (``Step3p5ForCausalLM``, ``model_type`` ``step3p5``) stores one bank per projection:
``moe.gate_proj.weight`` and ``moe.up_proj.weight`` [E, I, H], ``moe.down_proj.weight`` [E, H, I] (the expert count
``moe_num_experts``). vLLM 0.33 ``step3p5.py`` ``Step3p5Model.load_weights`` reads per-expert
``moe.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj`` (its "Per-expert MoE weights (new format from LLM
Compressor)" branch, ``fused_moe_make_expert_params_mapping``); expert e is the bank's e-th slice, a byte range.
SGLang 0.5.23 reads Step-3.5 experts only as banks, and does not read the release's config.json at all
(docs/families.md, "Step-3.5-Flash"). Read for ``step3p5`` only: Step-3 text (``step3_text``) stores the same
names, but vLLM's loader for it has no per-expert branch.

Refused, one line naming the tensor: a bank whose dtype is not a float one, that is not 3-D, whose first dimension
is not the config's expert count, or whose rows do not split in equal parts (an odd 2I).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..safetensors_format import TensorInfo
from .base import Claim, Encoding, Slice, SourceEncoding, SourceTensor, narrow, refused

if TYPE_CHECKING:
    import torch

NAME = "expert_bank"
FLOATS = frozenset({"BF16", "F16", "F32"})
GEMMA4 = frozenset({"gemma4", "gemma4_text"})
ALICE_AI = frozenset({"alice_ai"})
LLAMA4 = frozenset({"llama4", "llama4_text"})
STEP3P5 = frozenset({"step3p5"})


@dataclass(frozen=True)
class Bank:
    """How one family stores one projection of its experts as a bank: the stored tensor's name ending, the parent
    of the per-expert modules the engines read (in the same layer), the leaves its rows split into (in row order,
    equal parts), the config key of the expert count, the bank's dimension that is the model's width (1 for
    [E, H, I], 2 for [E, 2I, H]: a bank stored the other way round is refused, not misread) and the model types
    it is read for (none: any; a name as common as ``experts.gate_up_proj`` is another layout in gpt-oss's BF16
    release, [E, H, 2I] with gate and up interleaved)."""

    stored: str
    experts: str
    leaves: tuple[str, ...]
    count_key: str
    hidden: int
    model_types: frozenset[str] = frozenset()
    transposed: bool = False  # stored [E, in, out] (Llama 4): each expert's weight is its columns, swapped

    @property
    def split(self) -> int:
        """The bank's dimension its leaves split (an expert's output dimension)."""
        return 2 if self.transposed else 1


#: Every bank layout this encoding splits (the sources: the module docstring).
BANKS = (Bank("block_sparse_moe.input_linear.weight", "block_sparse_moe.experts", ("gate_proj", "up_proj"),
              "num_local_experts", 2),
         Bank("block_sparse_moe.output_linear.weight", "block_sparse_moe.experts", ("down_proj",),
              "num_local_experts", 1),
         Bank("experts.gate_up_proj", "experts", ("gate_proj", "up_proj"), "num_experts", 2, GEMMA4 | ALICE_AI),
         Bank("experts.down_proj", "experts", ("down_proj",), "num_experts", 1, GEMMA4 | ALICE_AI),
         Bank("feed_forward.experts.gate_up_proj", "feed_forward.experts", ("gate_proj", "up_proj"),
              "num_local_experts", 1, LLAMA4, transposed=True),
         Bank("feed_forward.experts.down_proj", "feed_forward.experts", ("down_proj",), "num_local_experts", 2, LLAMA4,
              transposed=True),
         Bank("moe.gate_proj.weight", "moe.experts", ("gate_proj",), "moe_num_experts", 2, STEP3P5),
         Bank("moe.up_proj.weight", "moe.experts", ("up_proj",), "moe_num_experts", 2, STEP3P5),
         Bank("moe.down_proj.weight", "moe.experts", ("down_proj",), "moe_num_experts", 1, STEP3P5))


def _text(config: dict) -> dict:
    sub = config.get("text_config")
    return sub if isinstance(sub, dict) else config


#: each layout's name ending, in ``BANKS``' order: one ``str.endswith`` turns away the names of no bank (every
#: ``*.weight`` tensor of a checkpoint is offered to this encoding, since Granite's and Step-3.5's banks end so)
_ENDINGS = tuple(f".{b.stored}" for b in BANKS)


def bank_of(name: str, config: dict | None = None) -> Bank | None:
    """The bank layout a stored tensor's name ends with, for ``config``'s model type (without a config: only a
    layout read for any model type), or None."""
    if not name.endswith(_ENDINGS):
        return None
    types = {config.get("model_type"), _text(config).get("model_type")} if config is not None else set()
    return next((b for b, end in zip(BANKS, _ENDINGS, strict=True)
                 if name.endswith(end) and (not b.model_types or b.model_types & types)), None)


def _source(bank: Bank, info: TensorInfo, x: int, j: int, module: str) -> SourceTensor:
    """Expert ``x``'s ``j``-th leaf: rows of its slice of the bank, a dense byte range; in a transposed bank, columns
    of its slice, swapped by :meth:`ExpertBank.decode` (no byte range holds them)."""
    n = info.shape[bank.split] // len(bank.leaves)
    shape = (n, info.shape[3 - bank.split])
    whole = narrow(info, x)
    if bank.transposed:
        view = (Slice(1, j * n, (j + 1) * n),) if len(bank.leaves) > 1 else ()
        return SourceTensor(module, f"{module}.weight", NAME, info.dtype, shape, (whole,), view)
    part = narrow(whole, j * n, (j + 1) * n) if len(bank.leaves) > 1 else whole
    return SourceTensor(module, f"{module}.weight", Encoding.DENSE, info.dtype, shape, (part,))


class ExpertBank(SourceEncoding):
    name = NAME
    label = "BF16"  # the same word as dense: labels() names it once
    anchors = frozenset(b.stored.rpartition(".")[2] for b in BANKS)

    def claim(self, name: str, tensors: Mapping[str, TensorInfo], config: dict) -> tuple[Claim, ...]:
        bank = bank_of(name, config)
        if bank is None:
            return ()
        info = tensors[name]
        self.check((info,), config)
        layer = name[: -len(bank.stored)]
        out = []
        for x in range(info.shape[0]):
            for j, leaf in enumerate(bank.leaves):
                m = f"{layer}{bank.experts}.{x}.{leaf}"
                out.append(Claim(m, "weight", _source(bank, info, x, j, m)))
        return tuple(out)

    def splits_experts(self, name: str, config: dict) -> bool:
        """Granite's banks (``input_linear``) and Step-3.5's (``moe.gate_proj``) give experts under another module
        (``experts``)."""
        return bank_of(name, config) is not None

    def check(self, parts: Sequence[TensorInfo], config: dict) -> None:
        """A float dtype; [E, N, K] with E the config's expert count, the bank's width dimension the config's
        ``hidden_size`` and N a multiple of the bank's leaves."""
        (info,) = parts
        bank = bank_of(info.name, config)
        assert bank is not None
        if info.dtype not in FLOATS:
            raise refused(info, f"expert bank must be {', '.join(sorted(FLOATS))}, is {info.dtype} (a quantized "
                                "bank of this layout is not read)")
        if len(info.shape) != 3:
            raise refused(info, f"expert bank must be 3-D [experts, rows, columns], is {list(info.shape)}")
        text = _text(config)
        count, width = text.get(bank.count_key), text.get("hidden_size")
        if isinstance(count, int) and info.shape[0] != count:
            raise refused(info, f"expert bank holds {info.shape[0]} experts, config.json {bank.count_key} says "
                                f"{count}")
        if isinstance(width, int) and info.shape[bank.hidden] != width:
            want = "[experts, N, hidden_size]" if bank.hidden == 2 else "[experts, hidden_size, N]"
            raise refused(info, f"expert bank {list(info.shape)} is not {want} for config.json hidden_size {width} "
                                "(a bank in the other orientation is not read as this layout)")
        if info.shape[bank.split] % len(bank.leaves):
            what = "columns" if bank.transposed else "rows"
            raise refused(info, f"{info.shape[bank.split]} {what} do not split into {' and '.join(bank.leaves)} of "
                                "equal size")

    def decode(self, src: SourceTensor, parts: Sequence[torch.Tensor], block: tuple[int, int]) -> torch.Tensor:
        """A transposed bank's expert (the other layouts' claims are dense byte ranges, never decoded here): its
        [in, out] columns as [out, in], exact."""
        return parts[0].t().contiguous()
