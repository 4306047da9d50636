"""``inspect``: architecture, layer kinds and the MoE parameters a kernel tuner needs, from
config.json alone, checked against the tensors' real shapes where the weights are present.

vLLM's ``benchmark_moe.py`` once fell through to Mixtral's ``num_local_experts`` on Kimi K3; this
reads the text config (nested ``text_config`` or flat) and every family's spelling of the fields.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import mistral_checkpoint
from .checkpoint import INDEX_NAME, load_json, open_checkpoint
from .encodings.expert_bank import bank_of
from .errors import ConvertError
from .mapping import layer_numbers
from .sources import EntryKind, Source
from .sources.hub import is_hub_spec
from .sources.local import LocalFolder

EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOPK_KEYS = ("num_experts_per_token", "num_experts_per_tok", "moe_topk", "moe_top_k", "top_k")
INTER_KEYS = ("moe_intermediate_size", "expert_ffn_hidden_size")  # LongCat-Flash: expert_ffn_hidden_size


@dataclass
class ModelInfo:
    architecture: str
    model_type: str
    text_config: str  # "text_config" or "(flat)"
    hidden_size: int | None
    num_layers: int | None
    layer_kinds: dict[str, list[int]] = field(default_factory=dict)  # kind -> 0-based layers
    num_experts: int | None = None
    top_k: int | None = None
    moe_intermediate_size: int | None = None
    moe_layers: list[int] = field(default_factory=list)
    expert_input_size: int | None = None  # routed_expert_hidden_size, or hidden_size
    weights_present: bool = False
    tensor_experts: int | None = None
    tensor_expert_shape: list[int] | None = None  # [intermediate, input] of one expert's gate weight
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _first(cfg: dict, keys: tuple[str, ...]) -> tuple[str | None, object]:
    for k in keys:
        if cfg.get(k) is not None:
            return k, cfg[k]
    return None, None


def text_config(config: dict) -> tuple[dict, str]:
    for key in ("text_config", "language_config", "llm_config"):
        if isinstance(config.get(key), dict):
            return config[key], key
    return config, "(flat)"


def from_config(config: dict) -> ModelInfo:
    text, where = text_config(config)
    archs = config.get("architectures") or ["?"]
    info = ModelInfo(
        architecture=archs[0],
        model_type=str(config.get("model_type", "?")),
        text_config=where,
        hidden_size=text.get("hidden_size"),
        num_layers=text.get("num_hidden_layers", text.get("num_layers")),  # LongCat-Flash: num_layers
    )
    _, info.num_experts = _first(text, EXPERT_KEYS)
    _, info.top_k = _first(text, TOPK_KEYS)
    _, info.moe_intermediate_size = _first(text, INTER_KEYS)
    if info.moe_intermediate_size is None and info.num_experts:
        info.moe_intermediate_size = text.get("intermediate_size")  # Mixtral: experts use intermediate_size
    info.expert_input_size = text.get("routed_expert_hidden_size") or info.hidden_size
    lac = text.get("linear_attn_config") or {}
    n = info.num_layers or 0
    if isinstance(lac, dict) and lac.get("kda_layers") is not None:
        kda, mla = list(lac.get("kda_layers", [])), list(lac.get("full_attn_layers", []))
        base = 0 if 0 in kda + mla else 1  # K3 / Kimi Linear count from 1, GLM-5.3-Flash from 0
        info.layer_kinds = {"kda": [i - base for i in kda], "mla": [i - base for i in mla]}
    elif isinstance(text.get("layer_types"), list):
        kinds: dict[str, list[int]] = {}
        for i, k in enumerate(text["layer_types"]):
            kinds.setdefault(str(k), []).append(i)
        info.layer_kinds = kinds
    elif isinstance(sparse := (text.get("sparse_attention_config") or {}).get("sparse_attention_freq"), list):
        info.layer_kinds = {"attention": [i for i, f in enumerate(sparse) if not f],  # MiniMax M3
                            "sparse_attention": [i for i, f in enumerate(sparse) if f]}
    elif n:
        info.layer_kinds = {"mla" if "kv_lora_rank" in text else "attention": list(range(n))}
    if info.num_experts:
        info.moe_layers = _moe_layers(text, n)
    return info


def _moe_layers(text: dict, n: int) -> list[int]:
    """The MoE layers: DeepSeek's ``first_k_dense_replace`` / ``moe_layer_freq`` (an integer step), Qwen's
    ``decoder_sparse_step`` and ``mlp_only_layers``, MiniMax M3's ``moe_layer_freq`` as one 0/1 flag a layer (vLLM
    models/minimax_m3/nvidia/model.py ``_is_moe_layer``), or Step-3.5's ``moe_layers_enum``, the MoE layers' indices
    as one comma-separated string (vLLM 0.33 step3p5.py ``Step3p5DecoderLayer``)."""
    if (listed := layer_numbers(text.get("moe_layers_enum"))) is not None:
        return sorted({i for i in listed if i < n})
    freq = text.get("moe_layer_freq", 1)
    if isinstance(freq, list):
        return [i for i, f in enumerate(freq[:n]) if f]
    first = int(text.get("first_k_dense_replace", 0) or 0)
    step = int(text.get("decoder_sparse_step", 1) or 1)
    dense = set(layer_numbers(text.get("mlp_only_layers")) or ())  # Qwen-MoE's / IQuest-Q1's dense layers
    return [i for i in range(n) if i >= first and i % int(freq or 1) == 0 and (i + 1) % step == 0 and i not in dense]


#: a routed expert's first projection; Mistral's own names have no block between the layer and ``experts``
_EXPERT = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:(?:block_sparse_moe|mlp|ffn)\.)?experts\.(\d+)\.(w1|gate_proj)\.weight(_packed)?$"
)


#: gpt-oss's MXFP4 3-D bank of a layer's experts (convert/encodings/gpt_oss_mxfp4.py)
_BANK = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts\.gate_up_proj_blocks$")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _fused_bank(name: str, t, info: ModelInfo) -> tuple[int, list[int]] | None:
    """The layer of a BF16 bank of every expert's gate projection (Granite's ``block_sparse_moe.input_linear``, Gemma
    4's and Llama 4's ``experts.gate_up_proj`` with the up rows too, Step-3.5's ``moe.gate_proj.weight`` alone: the
    layouts convert/encodings/expert_bank.py splits) and one expert's gate weight's [rows, columns], or None."""
    bank = bank_of(name, {"model_type": info.model_type})
    layer = _LAYER.search(name)
    if bank is None or bank.leaves[0] != "gate_proj" or len(t.shape) != 3 or layer is None:
        return None
    return int(layer.group(1)), [t.shape[bank.split] // len(bank.leaves), t.shape[3 - bank.split]]


def _unsplit_bank(name: str, t, info: ModelInfo) -> bool:
    """A 3-D tensor of a decoder layer whose first dimension is the config's expert count, under an ``experts`` or
    ``moe`` module, that no bank layout of convert/encodings/expert_bank.py names: every routed expert of the layer
    in one tensor, which ``inspect`` counts but cannot measure (which rows are the gate's it does not know)."""
    return (len(t.shape) == 3 and getattr(t, "dtype", None) in ("BF16", "F16", "F32")  # not a bank's scales
            and info.num_experts is not None and t.shape[0] == info.num_experts
            and (".experts." in name or ".moe." in name) and _LAYER.search(name) is not None
            and bank_of(name, {"model_type": info.model_type}) is None)


def add_tensors(info: ModelInfo, tensors: dict) -> None:
    """Report the experts' real shapes and flag config fields that disagree with them."""
    info.weights_present = True
    found: dict[int, set[int]] = {}
    shape, unsplit = None, []
    for name, t in tensors.items():
        if (b := _BANK.search(name)) and len(t.shape) == 4:  # [E, 2I, H/32, 16]: gate and up interleaved
            found.setdefault(int(b.group(1)), set()).update(range(t.shape[0]))
            shape = shape or [t.shape[1] // 2, t.shape[2] * t.shape[3] * 2]
            continue
        if (fused := _fused_bank(name, t, info)) is not None:  # [E, 2I, H] or [E, I, H] in BF16 ([E, H, 2I] transposed)
            found.setdefault(fused[0], set()).update(range(t.shape[0]))
            shape = shape or fused[1]
            continue
        if _unsplit_bank(name, t, info):  # a 3-D bank no source encoding splits (Step 5's, IQuest-Q1's)
            found.setdefault(int(_LAYER.search(name).group(1)), set()).update(range(t.shape[0]))
            unsplit.append(name)
            continue
        m = _EXPERT.search(name)
        if not m:
            continue
        found.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
        if shape is None:  # MXFP4 codes, two a byte: K/2 stored (compressed-tensors weight_packed, DeepSeek V4's I8);
            dtype = getattr(t, "dtype", None)  # INT4 codes, eight an I32 (compressed-tensors pack-quantized): K/8
            per = 8 if m.group(4) and dtype == "I32" else 2 if m.group(4) or dtype == "I8" else 1
            shape = [t.shape[0], t.shape[1] * per]
    if not found:
        if info.num_experts:
            info.warnings.append("config declares experts but no expert weights were found")
        return
    info.tensor_experts = max(len(v) for v in found.values())
    info.tensor_expert_shape = shape
    if unsplit:
        info.warnings.append(f"routed experts stored as 3-D banks no source encoding splits ({unsplit[0]} "
                             f"{list(tensors[unsplit[0]].shape)}, {len(unsplit)} bank(s)): pack writes them as 3-D "
                             "NVFP4 banks where the mapping table's [stacked] names them (as stored under its "
                             "keep = true), and copies them otherwise")
    if info.num_experts is not None and info.tensor_experts != info.num_experts:
        info.warnings.append(f"num_experts={info.num_experts} but layers hold {info.tensor_experts} experts")
    if shape and info.moe_intermediate_size is not None and shape[0] != info.moe_intermediate_size:
        info.warnings.append(
            f"moe_intermediate_size={info.moe_intermediate_size} but expert weights have {shape[0]} rows"
        )
    if shape and info.hidden_size is not None and shape[1] != info.hidden_size:
        info.warnings.append(
            f"hidden_size={info.hidden_size} but experts take {shape[1]} inputs "
            + ("(routed_expert_hidden_size: latent MoE; tune kernels for the tensors' width)"
               if shape[1] == info.expert_input_size else "(config disagrees with the tensors)")
        )


def inspect_path(path: str | Path) -> ModelInfo:
    """``inspect`` of a config.json file, or of a checkpoint folder (read as a source: ``inspect_source``)."""
    if is_hub_spec(str(path)):  # a Hub repository: config.json and the headers by range requests
        from .sources import open_source

        return inspect_source(open_source(str(path)))
    path = Path(path)
    if path.is_dir():
        return inspect_source(LocalFolder(path))
    if not path.exists():
        raise ConvertError(f"{path}: missing")
    return from_config(load_json(path, str(path)))


def inspect_source(source: Source) -> ModelInfo:
    """The model's facts from a source's config.json, and from its weights' headers where it has weights; a
    release in Mistral's own layout (params.json, no config.json) through the config the engines make of it
    (``mistral_checkpoint.config_view``, read with the checkpoint)."""
    if not _exists(source, "config.json") and _exists(source, mistral_checkpoint.PARAMS):
        ckpt = open_checkpoint(source)
        info = from_config(ckpt.config)
        add_tensors(info, ckpt.tensors)
        return info
    if not _exists(source, "config.json"):
        raise ConvertError(f"{source.shown('config.json')}: missing")
    info = from_config(source.read_json("config.json"))
    top = (e.rel for e in source.list_files(prune=lambda rel: True) if "/" not in e.rel)  # (a glob's view)
    if any(rel.endswith(".safetensors") for rel in top) or _exists(source, INDEX_NAME):
        add_tensors(info, open_checkpoint(source).tensors)
    return info


def _exists(source: Source, rel: str) -> bool:
    """``Path.exists``: there, symlinks followed (a dangling one is not)."""
    e = source.entry(rel)
    return e is not None and e.kind is not EntryKind.BROKEN


def render(info: ModelInfo) -> str:
    lines = [
        f"architecture     {info.architecture} (model_type {info.model_type}, text config: {info.text_config})",
        f"hidden_size      {info.hidden_size}",
        f"layers           {info.num_layers}: "
        + ", ".join(f"{k} {len(v)} {_ranges(v)}" for k, v in info.layer_kinds.items()),
    ]
    if info.num_experts:
        lines += [
            f"MoE layers       {len(info.moe_layers)} {_ranges(info.moe_layers)}",
            "benchmark_moe    "
            f"E={info.num_experts} topk={info.top_k} moe_intermediate_size={info.moe_intermediate_size} "
            f"hidden_size={info.hidden_size}",
        ]
        if info.expert_input_size != info.hidden_size:
            lines.append(f"expert input     {info.expert_input_size} (routed_expert_hidden_size: latent MoE)")
    else:
        lines.append("MoE              none (dense model)")
    if info.weights_present:
        lines.append(
            f"tensors          {info.tensor_experts} experts per layer"
            + (f", expert gate weight {info.tensor_expert_shape}" if info.tensor_expert_shape else "")
            if info.tensor_experts else "tensors          no expert weights"
        )
    else:
        lines.append("tensors          not present (config only)")
    lines += [f"warning          {w}" for w in info.warnings]
    return "\n".join(lines)


def _ranges(xs: list[int]) -> str:
    if not xs:
        return "[]"
    out, start, prev = [], xs[0], xs[0]
    for x in [*xs[1:], None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return "[" + ",".join(out) + "]"
