"""Mistral's own checkpoint layout (Mistral Large 3): ``params.json`` as the config, ``consolidated*.safetensors``
as the shards (``consolidated.safetensors.index.json`` when there is one), Mistral's tensor names.

Both engines read such a release only as such, and both turn ``params.json`` into a DeepSeek V3 config: vLLM 0.33
``transformers_utils/configs/mistral.py`` ``adapt_config_dict`` (``_remap_general_mistral_args``,
``_remap_moe_args``; ``model_type`` deepseek_v3, ``architectures`` [MistralLarge3ForCausalLM] when ``moe`` has
shared experts), SGLang 0.5.23 ``utils/hf_transformers/mistral_utils.py`` ``adapt_config_dict`` (the same remaps).
:func:`config_view` is that adaptation, restricted to the keys the plan, ``inspect`` and the mapping table read;
the tensors keep Mistral's names (the table, derived from the engines: ``mappings/derived/mistral_large_3.toml``, is
written in them, and the engines' own renames, vLLM ``MistralLarge3ForCausalLM.hf_to_vllm_mapper`` / SGLang
``MistralLarge3ForCausalLM.remapping``, turn them into DeepSeek V3's at load time: the table's ``[engine_names]``).
docs/families.md, "Mistral Large 3"."""

from __future__ import annotations

from .errors import ConvertError

PARAMS = "params.json"
INDEX = "consolidated.safetensors.index.json"  # vLLM default_loader.py: the index of load_format "mistral"
SHARD_PREFIX = "consolidated"  # vLLM / SGLang: allow_patterns ["consolidated*.safetensors"]
#: the derived table's name (``mappings/derived/mistral_large_3.toml``): the view's model_type is the engines'
TABLE = "mistral_large_3"

#: Mistral key -> the DeepSeek V3 config key (vLLM / SGLang ``_remap_general_mistral_args``).
GENERAL = {"dim": "hidden_size", "norm_eps": "rms_norm_eps", "n_kv_heads": "num_key_value_heads",
           "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads", "hidden_dim": "intermediate_size"}
#: ``moe.KEY`` -> the DeepSeek V3 config key (``_remap_moe_args``).
MOE = {"route_every_n": "moe_layer_freq", "first_k_dense_replace": "first_k_dense_replace",
       "num_experts_per_tok": "num_experts_per_tok", "num_experts": "n_routed_experts",
       "expert_hidden_dim": "moe_intermediate_size", "routed_scale": "routed_scaling_factor",
       "num_shared_experts": "n_shared_experts", "num_expert_groups": "n_group",
       "num_expert_groups_per_tok": "topk_group"}
#: What the tool needs of params.json (the engines' model then needs these too: vLLM deepseek_v2.py reads
#: first_k_dense_replace / moe_layer_freq / the MLA ranks without defaults).
REQUIRED = ("dim", "n_layers", "n_heads", "vocab_size", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
            "qk_nope_head_dim", "v_head_dim")
REQUIRED_MOE = ("num_experts", "num_experts_per_tok", "expert_hidden_dim", "num_shared_experts",
                "first_k_dense_replace", "route_every_n")


def is_shard(rel: str) -> bool:
    """A weight file the engines read in Mistral's format (top level, ``consolidated*.safetensors``)."""
    return "/" not in rel and rel.startswith(SHARD_PREFIX) and rel.endswith(".safetensors")


def _need_int(where: dict, key: str, shown: str, rel: str, minimum: int) -> int:
    v = where.get(key)
    if v is None:
        raise ConvertError(f"{rel}: {shown} is missing (Mistral Large 3's params.json states it)")
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise ConvertError(f"{rel}: {shown} is {v!r}, expected an integer >= {minimum}")
    return v


def _check(params: dict, rel: str) -> dict:
    """Refuse, one line naming the field, what the tool cannot read or the engines would refuse."""
    moe = params.get("moe")
    if not isinstance(moe, dict):
        raise ConvertError(f"{rel}: moe is missing: not Mistral Large 3 (vLLM adapt_config_dict builds "
                           "MistralLarge3ForCausalLM only for a moe with shared experts)")
    for key in REQUIRED:
        _need_int(params, key, key, rel, 1)
    for key in REQUIRED_MOE:
        _need_int(moe, key, f"moe.{key}", rel, 0 if key == "first_k_dense_replace" else 1)
    if moe["first_k_dense_replace"] > 0:
        _need_int(params, "hidden_dim", "hidden_dim (the dense layers' width)", rel, 1)
    scaling = params.get("llama_4_scaling")
    if not isinstance(scaling, dict) or not {"original_max_position_embeddings", "beta"} <= scaling.keys():
        raise ConvertError(f"{rel}: llama_4_scaling needs original_max_position_embeddings and beta "
                           "(vLLM adapt_config_dict asserts them for MistralLarge3)")
    if params.get("quantization"):
        raise ConvertError(f"{rel}: quantization {params['quantization']!r}: Mistral's FP8 per-tensor release is "
                           "not read yet; convert the -BF16 release")
    if params.get("vision_encoder") or (params.get("multimodal") or {}).get("vision_encoder_args"):
        raise ConvertError(f"{rel}: a vision encoder (Pixtral) is not supported yet; the text model only")
    return moe


def config_view(params: object, rel: str = PARAMS) -> dict:
    """``params.json`` as the DeepSeek V3 config the engines make of it (module docstring): Mistral's keys
    renamed, ``moe`` flattened, MLA keys as they are; the Mistral-only keys kept as they are (the plan never
    reads them; ``inspect`` shows the architecture). Raises ``ConvertError`` naming the field at fault."""
    if not isinstance(params, dict):
        raise ConvertError(f"{rel}: not a JSON object")
    moe = _check(params, rel)
    view = {k: v for k, v in params.items() if k not in GENERAL and k != "moe"}
    view.update({new: params[old] for old, new in GENERAL.items() if old in params})
    view.update({new: moe[old] for old, new in MOE.items() if old in moe})
    view["tie_word_embeddings"] = bool(params.get("tied_embeddings", False))
    view.pop("tied_embeddings", None)
    view["model_type"] = "deepseek_v3"
    view["architectures"] = ["MistralLarge3ForCausalLM"]
    return view


def in_layout(source) -> bool:
    """Whether ``source`` is in Mistral's layout: ``params.json`` and no ``config.json``."""
    return source.entry("config.json") is None and source.entry(PARAMS) is not None


def build_keys(view: dict) -> dict:
    """What both engines' adaptation sets whatever ``params.json`` says and their DeepSeek V3 model reads as it is
    built (``_remap_moe_args``: ``topk_method`` None, ``scoring_func`` softmax; ``_remap_general_mistral_args``:
    ``hidden_act`` from ``activation``), which the plan never reads: ``mapping derive`` builds the engines' model from
    the view and these (SGLang: "'DeepseekV3Config' object has no attribute 'topk_method'" without them). Not in
    :func:`config_view`, which the output's ``config.json`` is written from; ``view`` is that view, which keeps
    ``activation`` as params.json has it."""
    return {"topk_method": None, "scoring_func": "softmax", "hidden_act": view.get("activation", "silu")}
