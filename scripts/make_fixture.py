"""A tiny random checkpoint of any architecture the installed transformers knows, written by its own
``save_pretrained`` (so in the checkpoint naming transformers writes for the architecture's releases).

    ENGINE_PYTHON scripts/make_fixture.py ARCHITECTURE OUT [--seed N]

Run it with the vLLM environment's python (``~/.cache/kimi-convert/engines/vllm-0.33.0/bin/python``: its
transformers knows the 2026 architectures); it is a script of the breadth run (``scripts/derive_breadth.py``), never
imported by the tool. Nothing in it names a family:

1. the model type is the one transformers' causal-LM registry maps to ARCHITECTURE (a ``*_text`` type first);
2. its config class's defaults (the flagship's sizes) are shrunk by key name, wherever the key is: widths to 256,
   dense MLPs to 512, expert / shared-expert MLPs to 128, 4 attention heads, at most 2 KV heads (4 where the
   config has as many KV heads as heads), head dims at most 128, latent ranks 128, 8 experts, top-k 2, vocab
   1024, 4096 positions; every other key (structure flags, layer patterns, routing) is kept;
3. the layer count is the shortest prefix of the full-depth model (built on the meta device at the shrunk widths)
   that holds every distinct layer (its submodules' names, classes and shapes): dense-first layers, hybrid layer
   patterns and interleaved MoE layers stay; per-layer lists are cut to it, layer-index keys counted from the end
   moved with it;
4. the model is built in BF16, every weight of two or more dimensions drawn from N(0, 0.02) (seeded) in BF16 (also
   a module the class keeps in FP32), and saved;
5. the keys a release's config.json carries and transformers' save leaves out are added: the legacy keys its
   config class reads and converts (``kwargs.pop("KEY", DEFAULT)``, with that default), ``first_k_dense_replace``
   / ``moe_layer_freq`` from transformers' ``mlp_layer_types``, ``head_dim`` where the model derived it, and a
   short data table of release keys per model type that an engine reads with no default (``RELEASE_KEYS``, each
   with its source), a key transformers spells apart replaced by the release's (``RELEASE_SPELLS``); a key the
   config class leaves None and its own model reads is set before the build (``BUILD_KEYS``);
6. tensors transformers saves that the release does not store are dropped (``RELEASE_DROPS``, each with its
   source).

Prints one JSON line: the model type, the shrunk config's layer count, the layer kinds kept, the tensors written,
3-D expert tensors (a fused layout transformers did not revert at save), and any structure the cut lost.
Exit 3 with one line when transformers has no causal-LM class for ARCHITECTURE.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

HIDDEN = 256
DENSE_MLP = 512
EXPERT_MLP = 128
HEADS = 4
KV_HEADS = 2
MAX_HEAD_DIM = 128
LATENT = 128
EXPERTS = 8
TOP_K = 2
VOCAB = 1024
POSITIONS = 4096

MAMBA_HEADS = ("mamba_n_heads", "mamba_num_heads")
LAYER_KEYS = ("num_hidden_layers", "n_layers", "num_layers")
HIDDEN_KEYS = ("hidden_size", "d_model", "n_embd")
HEAD_KEYS = ("num_attention_heads", "n_heads", "num_heads", "swa_num_attention_heads", "index_n_heads",
             "linear_num_value_heads", "linear_num_heads", *MAMBA_HEADS)
KV_KEYS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "kv_n_heads", "swa_num_key_value_heads",
           "linear_num_key_heads")
HEAD_DIM = re.compile(r"(^|_)(head_dim|d_head|linear_head_dim)$")
LATENT_KEYS = ("q_lora_rank", "kv_lora_rank", "o_lora_rank", "mamba_dt_rank")
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "zero_expert_num")
TOPK_KEYS = ("num_experts_per_tok", "moe_topk", "moe_top_k", "moe_k", "top_k_experts")
MAMBA_HEAD_DIM = ("mamba_d_head", "mamba_head_dim")
MAMBA_EXPAND = ("mamba_expand", "expand")
MOE_SWITCH = re.compile(r"^(enable|use)_moe")
MLP = re.compile(r"intermediate|ffn_hidden|ffn_dim")
EXPERT_WORD = re.compile(r"moe|expert|shared")
POSITION_KEYS = ("max_position_embeddings", "max_seq_len", "model_max_length")
ROUTED = re.compile(r"experts?\.\d+\.")
SKIP_SUBCONFIGS = ("vision_config", "audio_config", "vision_tower_config")


#: transformers' registries a fixture's class is looked up in, in order (registry name, the auto class that builds it):
#: the causal LMs, then the image-text-to-text models (a release with a vision tower: Llama 4's
#: ``Llama4ForConditionalGeneration``)
REGISTRIES = (("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM"),
              ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "AutoModelForImageTextToText"))


def model_type_for(arch: str) -> str | None:
    found = registry_for(arch)
    return found[0] if found else None


def registry_for(arch: str) -> tuple[str, str] | None:
    """(model type, auto class) of the first registry in :data:`REGISTRIES` that maps a model type to ARCH."""
    from transformers.models.auto import modeling_auto

    for names, auto in REGISTRIES:
        hits = [mt for mt, cls in getattr(modeling_auto, names).items() if cls.lower() == arch.lower()]
        hits.sort(key=lambda mt: (not mt.endswith("_text"), mt))
        if hits:
            return hits[0], auto
    return None


def _shrink_int(key: str, v: int, heads_were: int | None) -> int:
    """The tiny value of one integer size key (unchanged where the key is no size this knows)."""
    if key in HIDDEN_KEYS:
        return min(v, HIDDEN)
    if key in HEAD_KEYS:
        return min(v, HEADS)
    if key in KV_KEYS:
        return min(v, HEADS if heads_were is not None and v == heads_were else KV_HEADS)
    if HEAD_DIM.search(key):
        return min(v, MAX_HEAD_DIM)
    if key in LATENT_KEYS:
        return min(v, LATENT)
    if key in EXPERT_KEYS:
        return min(v, EXPERTS)
    if key in TOPK_KEYS:
        return min(v, TOP_K)
    if key == "n_group":
        return min(v, 2)
    if key == "topk_group":
        return min(v, 1)
    if key.startswith("vocab_size"):
        return min(v, VOCAB)
    if key in POSITION_KEYS:
        return POSITIONS  # the engine checks ask for this context length
    if MLP.search(key) and "layer" not in key:
        return min(v, EXPERT_MLP if EXPERT_WORD.search(key) else DENSE_MLP)
    return v


def shrink_widths(d: dict) -> dict:
    """Every known size key of ``d`` and its sub-configs made tiny (the layer count is left to :func:`cut_layers`)."""
    out = {}
    heads_were = next((d[k] for k in HEAD_KEYS if isinstance(d.get(k), int)), None)
    for k, v in d.items():
        if isinstance(v, dict) and k not in SKIP_SUBCONFIGS:
            out[k] = shrink_widths(v)
        elif isinstance(v, int) and not isinstance(v, bool):
            out[k] = _shrink_int(k, v, heads_were)
        else:
            out[k] = v
    _mamba_heads(out)
    heads, hidden = out.get("num_attention_heads"), out.get("hidden_size")
    if "head_dim" in out and out["head_dim"] is None and isinstance(heads, int) and isinstance(hidden, int):
        out["head_dim"] = hidden // heads  # a class that reads head_dim but defaults it to None (HunYuan V1 MoE)
    if isinstance(out.get("qk_head_dim"), int) and "qk_nope_head_dim" in out and "qk_rope_head_dim" in out:
        out["qk_head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    vocab = out.get("vocab_size")
    if isinstance(vocab, int):
        for k, v in list(out.items()):
            if k.endswith("token_id") and isinstance(v, int) and v >= vocab:
                out[k] = v % vocab
            elif k.endswith("token_id") and isinstance(v, list):
                out[k] = [x % vocab if isinstance(x, int) else x for x in v]
    return out


def _mamba_heads(d: dict) -> None:
    """Mamba heads x head dim is the mamba width (expand x hidden): the head count follows the shrunk widths."""
    heads = next((k for k in MAMBA_HEADS if isinstance(d.get(k), int)), None)
    dim = next((d[k] for k in MAMBA_HEAD_DIM if isinstance(d.get(k), int)), None)
    expand = next((d[k] for k in MAMBA_EXPAND if isinstance(d.get(k), int)), None)
    hidden = next((d[k] for k in HIDDEN_KEYS if isinstance(d.get(k), int)), None)
    if heads and dim and expand and hidden and expand * hidden % dim == 0:
        d[heads] = expand * hidden // dim


def switch_moe_on(d: dict) -> dict | None:
    """``d`` with its MoE switch (``enable_moe_*`` / ``use_moe*``) on and unset expert sizes given the tiny ones;
    None where it has no switch that is off (a config whose defaults build a dense model)."""
    keys = [k for k, v in d.items() if MOE_SWITCH.match(k) and v is False]
    if not keys:
        return None
    out = {**d, **dict.fromkeys(keys, True)}
    for k, v in d.items():
        if v is None and k in EXPERT_KEYS:
            out[k] = EXPERTS
        elif v is None and k in TOPK_KEYS:
            out[k] = TOP_K
        elif v is None and MLP.search(k) and EXPERT_WORD.search(k):
            out[k] = EXPERT_MLP
    return out


def layer_count(d: dict) -> tuple[str, int] | None:
    for k in LAYER_KEYS:
        if isinstance(d.get(k), int):
            return k, d[k]
    return None


def cut_layers(d: dict, old: int, new: int) -> dict:
    """``d`` with ``new`` layers instead of ``old``: per-layer lists cut, layer-index lists filtered, integer keys
    naming a layer counted from the end moved with it (recursively, skipping vision sub-configs)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k not in SKIP_SUBCONFIGS:
            if v and all(re.fullmatch(r"\d+", str(x)) for x in v):  # per-layer dict keyed by index
                out[k] = {x: y for x, y in v.items() if int(x) < new}
            else:
                out[k] = cut_layers(v, old, new)
        elif k in LAYER_KEYS and v == old:
            out[k] = new
        elif isinstance(v, list) and len(v) == old and old != new:
            out[k] = v[:new]
        elif isinstance(v, list) and "layer" in k and v and all(isinstance(x, int) and 0 <= x < old for x in v) \
                and v == sorted(set(v)):
            out[k] = [x for x in v if x < new]
        elif isinstance(v, int) and not isinstance(v, bool) and "layer" in k and k not in LAYER_KEYS \
                and new <= old - 1 <= v <= old:  # the last layer, or the count: counted from the end
            out[k] = v - (old - new)
        else:
            out[k] = v
    return out


def make_config(model_type: str, d: dict):
    from transformers import AutoConfig

    base = AutoConfig.for_model(model_type)
    return type(base).from_dict(d)


def layer_lists(model) -> list:
    """The model's decoder layers: its longest ModuleList."""
    import torch.nn as nn

    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return max(lists, key=len) if lists else []


def signature(layer) -> tuple:
    return tuple((n, type(m).__name__, tuple((pn, tuple(p.shape)) for pn, p in m.named_parameters(recurse=False)))
                 for n, m in layer.named_modules())


def build(model_type: str, d: dict, device: str, dtype=None, auto: str = "AutoModelForCausalLM"):
    import torch
    import transformers

    cfg = make_config(model_type, d)
    with torch.device(device):
        return cfg, getattr(transformers, auto).from_config(cfg, dtype=dtype or torch.bfloat16)


def choose_layers(model_type: str, d: dict, auto: str = "AutoModelForCausalLM") -> tuple[int, int, set]:
    """(full depth, tiny depth, the full-depth model's layer kinds); a config without a layer-count key (one
    derived from a layer pattern) keeps its depth. A multimodal config's depth is its ``text_config``'s."""
    _, meta = build(model_type, d, "meta", auto=auto)
    sigs = [signature(layer) for layer in layer_lists(meta)]
    last = max((sigs.index(s) for s in set(sigs)), default=0)
    found = layer_count(d) or layer_count(d.get("text_config") or {})
    if found is None:
        return len(sigs), len(sigs), set(sigs)
    return found[1], max(2, last + 1), set(sigs)


def routed(model) -> int:
    """Routed-expert weights: per-expert modules (``experts.N``) or 3-D banks whose first dimension is the expert
    count."""
    cfg = model.config.to_dict()
    cfg = {**(cfg.get("text_config") or {}), **cfg}  # a multimodal config's experts are its text_config's
    n_experts = {v for k, v in cfg.items() if k in EXPERT_KEYS and isinstance(v, int)}
    return sum(1 for name, p in model.named_parameters()
               if ROUTED.search(name) or (p.ndim == 3 and p.shape[0] in n_experts))


def randomize(model, seed: int) -> None:
    """Every floating weight of two or more dimensions drawn from N(0, 0.02) and stored in BF16, also where the
    class keeps a module in FP32 (Ernie 4.5 MoE's router ``mlp.gate`` and ``moe_statics``): an FP32 tensor SGLang's
    loader narrows to its BF16 parameter is a "bad cast" to the engine check, a fault of the fixture's dtype, not
    of the checkpoint's layout the fixture stands for."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters(), key=lambda x: x[0]):
            if p.ndim >= 2 and p.is_floating_point():
                p.data = (torch.randn(p.shape, generator=g, dtype=torch.float32) * 0.02).to(torch.bfloat16)


def written(out: Path) -> dict:
    from safetensors import safe_open

    names, three_d, nbytes = 0, [], 0
    for f in sorted(out.glob("*.safetensors")):
        nbytes += f.stat().st_size
        with safe_open(str(f), "pt") as s:
            for k in s.keys():  # noqa: SIM118 (a safe_open handle has no __iter__)
                names += 1
                if len(s.get_slice(k).get_shape()) == 3 and "expert" in k:
                    three_d.append(k)
    return {"tensors": names, "bytes": nbytes, "expert_3d": three_d[:4],
            "expert_3d_count": len(three_d)}


LEGACY = re.compile(r"kwargs\.(?:pop|get)\(\s*[\"'](\w+)[\"']\s*,\s*([^()]+?)\s*\)")
NOT_LEGACY = re.compile(r"^(rope|tie_|out_|use_timm|backbone|num_labels|model_type|trust_remote|torch_dtype|dtype)")


def legacy_keys(config_class, saved: dict) -> dict:
    """The release-only keys the config class reads from ``kwargs`` and converts (``kwargs.pop("KEY", DEFAULT)``),
    with their literal defaults, where the saved config lacks them: transformers writes only its own fields, the
    engines read the releases' keys (``full_attention_interval``, ``first_k_dense_replace``...)."""
    import ast
    import inspect

    try:
        text = inspect.getsource(inspect.getmodule(config_class))
    except (OSError, TypeError):
        return {}
    out = {}
    for key, default in LEGACY.findall(text):
        if key in saved or NOT_LEGACY.match(key):
            continue
        try:
            value = ast.literal_eval(default)
        except (ValueError, SyntaxError):
            continue
        if value is not None and value not in ({}, [], ""):  # an empty default is no release's value
            out.setdefault(key, value)
    return out


def _moe_flags(c: dict) -> list[bool]:
    return [t != "dense" for t in c["mlp_layer_types"]]


def _swa_flags(c: dict) -> list[int]:
    return [int(t == "sliding_attention") for t in c["layer_types"]]


def _hybrid_pattern(types: list[str]) -> str:
    """transformers configuration_nemotron_h.py ``hybrid_override_pattern``'s letters for its layer types."""
    return "".join({"linear_attention": "M", "moe": "E", "full_attention": "*", "mlp": "-"}[t] for t in types)


#: Release config keys that transformers' config class neither holds nor writes (or writes as None) and that an
#: engine reads with no default, per model type: data, not code. A value is a literal or a function of the saved
#: config (a key the release spells apart from transformers: the same value under the release's name). Sources:
#: the release's config as an engine or transformers cites it, else the other engine's own default for the key.
RELEASE_KEYS: dict[str, dict] = {
    # transformers modeling_afmoe.py AfmoeTokenChoiceRouter: "sigmoid scores, matching the released checkpoints",
    # top-k scores renormalized; no expert groups (SGLang afmoe.py: getattr(config, "n_group", 1), "topk_group" 1)
    "afmoe": {"score_func": "sigmoid", "route_norm": True, "n_group": 1, "topk_group": 1},
    # deepseek-ai/DeepSeek-V2-Lite config.json: n_group 1, topk_group 1, moe_layer_freq 1, scoring_func softmax
    # (vLLM deepseek_v2.py: getattr(config, "moe_layer_freq", 1), getattr(config, "scoring_func", "softmax"));
    # top-k the fixture's (transformers' default is None, which vLLM's router refuses)
    "deepseek_v2": {"n_group": 1, "topk_group": 1, "moe_layer_freq": 1, "scoring_func": "softmax",
                    "num_experts_per_tok": TOP_K},
    # DeepSeek-V3's config.json as presets/deepseek_v3.toml gives it: sigmoid routing with the correction bias
    # (vLLM deepseek_v2.py builds e_score_correction_bias only under topk_method "noaux_tc"), MoE every layer
    # after the dense ones (SGLang deepseek_v2.py reads config.moe_layer_freq)
    "deepseek_v3": {"moe_layer_freq": 1, "scoring_func": "sigmoid", "topk_method": "noaux_tc"},
    # K-EXAONE's config.json writes is_moe_layer beside mlp_layer_types (SGLang exaone_moe.py stage_facts reads
    # config.is_moe_layer[layer_id])
    "exaone_moe": {"is_moe_layer": _moe_flags},
    # Hunyuan-A13B's config.json keys SGLang's hunyuan.py reads with no default, valued as transformers'
    # modeling_hunyuan_v1_moe.py builds: the experts' width is intermediate_size, one shared MLP always
    # (use_mixed_mlp_moe, num_shared_expert 1), attention_head_dim the head_dim, q/k norms (query_layernorm /
    # key_layernorm; SGLang getattr(config, "use_qk_norm", False))
    "hunyuan_v1_moe": {"moe_intermediate_size": lambda c: c["intermediate_size"], "use_mixed_mlp_moe": 1,
                       "num_shared_expert": 1, "attention_head_dim": lambda c: c["head_dim"], "use_qk_norm": True},
    # Hy3's config.json names the expert width expert_hidden_dim (transformers: moe_intermediate_size; vLLM
    # hy_v3.py reads config.expert_hidden_dim) and route_norm (transformers modeling_hy_v3.py renormalizes the
    # top-k weights; both engines read config.route_norm) and qk_norm (transformers builds q_norm / k_norm; both
    # engines read getattr(config, "qk_norm", False) and skip the norms' tensors without it)
    "hy_v3": {"expert_hidden_dim": lambda c: c["moe_intermediate_size"], "route_norm": True, "qk_norm": True},
    # vLLM reads transformers' InklingTextConfig with the keys of its own InklingModelConfig
    # (vllm/models/inkling/configs.py): its defaults (padded_vocab_size the vocab_size, no q / o bias, w13
    # interleaved, no softcap, no MTP layer), where transformers' modeling_inkling.py builds the part on: the
    # embedding norm, the experts' global_scale, the sigmoid router with its correction bias (use_gate_bias)
    "inkling_text": {"padded_vocab_size": lambda c: c["vocab_size"],
                     "dense_intermediate_size": lambda c: c["intermediate_size"], "use_embed_norm": True,
                     "use_global_scale": True, "gate_activation": "sigmoid", "use_gate_bias": True,
                     "norm_after_topk": True, "inference_moe_w13_interleaved": True, "q_bias": False,
                     "o_bias": False, "final_logit_softcapping": None, "num_nextn_predict_layers": 0,
                     # the sliding-window layers, which transformers 5 writes as layer_types "hybrid_sliding"
                     "local_layer_ids": lambda c: [i for i, t in enumerate(c["layer_types"]) if "sliding" in t]},
    # LongCat-Flash's config.json keys both engines read with no default, valued as transformers'
    # modeling_longcat_flash.py computes (the a-projection norms always scaled by sqrt(hidden / lora rank), the zero
    # experts nn.Identity, the router without bias: getattr(config, "router_bias", False)); the router in FP32 and
    # no n-gram embedding (SGLang longcat_flash.py: rounter_params_dtype float32 is its own default, the n-gram
    # embedding is LongcatFlashNgram's); rope_theta at the top as the release writes it
    "longcat_flash": {"mla_scale_q_lora": True, "mla_scale_kv_lora": True, "zero_expert_type": "identity",
                      "router_bias": False, "rounter_params_dtype": "float32", "use_ngram_embedding": False,
                      "rope_theta": lambda c: c["rope_parameters"]["rope_theta"]},
    # MiMo-V2-Flash's config.json (both engines' mimo_v2.py): the sliding layers as hybrid_layer_pattern 1 (SGLang
    # model_config.py: 1 sliding, 0 full), their heads and window under swa_* (transformers builds both kinds with
    # the same heads), layernorm_epsilon; sigmoid routing with a correction bias (transformers
    # modeling_mimo_v2_flash.py; vLLM mimo_v2.py hard-codes scoring_func "sigmoid", SGLang reads topk_method
    # "noaux_tc" for the bias)
    "mimo_v2_flash": {"hybrid_layer_pattern": _swa_flags, "layernorm_epsilon": lambda c: c["rms_norm_eps"],
                      "sliding_window_size": lambda c: c["sliding_window"],
                      "swa_head_dim": lambda c: c["head_dim"],
                      "swa_num_attention_heads": lambda c: c["num_attention_heads"],
                      "swa_num_key_value_heads": lambda c: c["num_key_value_heads"],
                      "scoring_func": "sigmoid", "topk_method": "noaux_tc",
                      # transformers builds attention_sink_bias on the sliding layers only (both engines:
                      # getattr(config, "add_swa_attention_sink_bias", False), "add_full_attention_sink_bias")
                      "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False,
                      # one 0/1 flag a layer (both engines' is_moe_layer index it: an integer is "no MoE layer")
                      "moe_layer_freq": lambda c: [int(f) for f in _moe_flags(c)]},
    # MiniMax-M2's config.json as presets/minimax_m2.toml gives it: partial rotary (rotary_dim 64 of head_dim
    # 128), sigmoid routing with the correction bias (vLLM minimax_m2.py reads config.rotary_dim,
    # config.scoring_func), q/k norms over the whole projection (use_qk_norm, qk_norm_type per_layer: SGLang
    # minimax_m2.py getattr(config, "use_qk_norm", False) skips the norms' tensors without it)
    "minimax_m2": {"rotary_dim": lambda c: c["head_dim"] // 2, "scoring_func": "sigmoid", "use_routing_bias": True,
                   "use_qk_norm": True, "qk_norm_type": "per_layer"},
    # Nemotron-H releases write the layer kinds as hybrid_override_pattern ("M" mamba, "E" MoE, "*" attention, "-"
    # MLP), which transformers' and SGLang's config classes both convert; transformers 5 saves layers_block_type
    # in its own words ("linear_attention", "full_attention"), which SGLang's NemotronHConfig refuses
    # (_validate_layers_block_type): the release's key replaces it (RELEASE_SPELLS)
    "nemotron_h": {"hybrid_override_pattern": lambda c: _hybrid_pattern(c["layers_block_type"]),
                   "mtp_hybrid_override_pattern": lambda c: _hybrid_pattern(c["mtp_layers_block_type"])},
}

#: LFM2-8B-A1B's config.json layer_types (24 layers, attention at 2, 6, 10, 14, 18, 21)
_LFM2_MOE_LAYERS = ["full_attention" if i in (2, 6, 10, 14, 18, 21) else "conv" for i in range(24)]

#: Keys whose config-class default is no release's, per model type, set before the model is built: a key the class
#: defaults to None but its own model class reads (transformers' Lfm2MoeDecoderLayer indexes config.layer_types;
#: the release writes it), an expert count of 1 (HunYuan V1 MoE's class default, a dense model to SGLang's
#: hunyuan.py; Hunyuan-A13B has 64 experts, top-8: the fixture's tiny 8 / 2)
BUILD_KEYS: dict[str, dict] = {
    "lfm2_moe": {"layer_types": lambda c: (_LFM2_MOE_LAYERS + ["conv"] * c["num_hidden_layers"])[
        :c["num_hidden_layers"]]},
    "hunyuan_v1_moe": {"num_experts": EXPERTS, "moe_topk": TOP_K},
    # Phi-3.5-MoE's attention and head biases: vLLM phimoe.py builds qkv_proj, o_proj and lm_head with bias=True
    # whatever the config says, SGLang phimoe.py its lm_head (transformers' PhimoeConfig defaults both off)
    "phimoe": {"attention_bias": True, "lm_head_bias": True},
    # GraniteMoeShared's shared MLP: transformers' GraniteMoeSharedConfig defaults shared_intermediate_size to 0, and
    # vLLM granitemoeshared.py GraniteMoeSharedDecoderLayer / SGLang granitemoe.py build shared_mlp only when it is > 0
    "granitemoeshared": {"shared_intermediate_size": DENSE_MLP},
}

#: A sub-config :func:`shrink_widths` leaves as is (a vision tower's: its widths are tied to each other in ways no key
#: name says), given per model type at the release's values with its sizes shrunk, consistently. Llama 4
#: (meta-llama/Llama-4-Scout-17B-16E and -Maverick-17B-128E's config.json ``vision_config``: hidden 1408, 16 heads,
#: 34 layers, intermediate 5632, image 336, patch 14, pixel_shuffle_ratio 0.5, projector dims 4096): transformers'
#: modeling_llama4.py ties ``intermediate_size`` to ``hidden_size / pixel_shuffle_ratio^2`` (the pixel-shuffled
#: patches enter ``vision_adapter.mlp.fc1``) and the projector's input ``vision_output_dim`` to
#: ``projector_output_dim``; vLLM's and SGLang's ``mllama4.py`` build the same shapes from the same keys
SUBCONFIGS: dict[str, dict[str, dict]] = {
    "llama4": {"vision_config": {"hidden_size": HIDDEN, "num_attention_heads": HEADS, "num_hidden_layers": 2,
                                 "intermediate_size": HIDDEN * 4, "image_size": 336, "patch_size": 14,
                                 "pixel_shuffle_ratio": 0.5, "projector_input_dim": HIDDEN,
                                 "projector_output_dim": HIDDEN, "vision_output_dim": HIDDEN,
                                 "multi_modal_projector_bias": False, "vision_feature_layer": -1,
                                 "vision_feature_select_strategy": "default"}},
    # databricks/dbrx-instruct config.json: attn_config {"clip_qkv": 8, "kv_n_heads": 8, "rope_theta": 500000};
    # transformers 5.20's DbrxAttentionConfig has no rope_theta of its own, which its DbrxAttention reads
    # ("'DbrxAttentionConfig' object has no attribute 'rope_theta'" building the model)
    "dbrx": {"attn_config": {"rope_theta": 500000, "clip_qkv": 8}},
}


def with_subconfigs(model_type: str, d: dict) -> dict:
    """``d`` with the model type's :data:`SUBCONFIGS` laid over its sub-configs."""
    return {**d, **{k: {**(d.get(k) or {}), **v} for k, v in SUBCONFIGS.get(model_type, {}).items()}}


def _zero_experts(c: dict):
    """LongCat-Flash's zero (identity) experts, indices n_routed_experts.. : transformers' LongcatFlashExperts
    allocates gate_up_proj for all n_routed_experts + zero_expert_num of them (its forward never reads the zero
    experts' rows: ``expert_idx >= self.num_routed_experts`` is the identity) and its save writes their per-expert
    gate_proj / up_proj; the release stores none: both engines map only n_routed_experts experts (vLLM
    longcat_flash.py ``get_expert_mapping(num_experts=self.config.n_routed_experts)``, where expert 8's name is a
    KeyError in ``load_weights``)."""
    n = c["n_routed_experts"]
    return lambda name: (m := re.search(r"\.experts\.(\d+)\.", name)) is not None and int(m.group(1)) >= n


#: Per model type: which saved tensors the release does not store (config -> predicate on the tensor name)
RELEASE_DROPS = {"longcat_flash": _zero_experts}


def drop_tensors(out: Path, drop) -> int:
    """Rewrite the saved safetensors files without the tensors ``drop`` names (and the index's entries for them)."""
    from safetensors.torch import load_file, save_file

    gone = 0
    for f in sorted(out.glob("*.safetensors")):
        ts = load_file(str(f))
        keep = {k: v for k, v in ts.items() if not drop(k)}
        if len(keep) != len(ts):
            gone += len(ts) - len(keep)
            save_file(keep, str(f), metadata={"format": "pt"})
    index = out / "model.safetensors.index.json"
    if gone and index.is_file():
        d = json.loads(index.read_text())
        d["weight_map"] = {k: v for k, v in d["weight_map"].items() if not drop(k)}
        index.write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")
    return gone


def write_index(out: Path) -> None:
    """``model.safetensors.index.json`` beside a fixture saved as one file, as a multimodal release ships it (sharded,
    with its index): SGLang's ``mllama4.py`` ``Llama4ForConditionalGeneration._has_vision_weights`` looks for the
    vision tower's names in that index and, without one, builds no tower and skips its weights."""
    from safetensors import safe_open

    index = out / "model.safetensors.index.json"
    files = sorted(out.glob("*.safetensors"))
    if index.is_file() or len(files) != 1:
        return
    with safe_open(str(files[0]), "pt") as f:
        names = sorted(f.keys())
    index.write_text(json.dumps({"metadata": {"total_size": files[0].stat().st_size},
                                 "weight_map": dict.fromkeys(names, files[0].name)}, indent=2, sort_keys=True) + "\n")


#: Keys transformers saves where the release writes another (:data:`RELEASE_KEYS`): left out of the fixture's config
RELEASE_SPELLS: dict[str, tuple[str, ...]] = {"nemotron_h": ("layers_block_type", "mtp_layers_block_type")}


def table_keys(model_type: str, saved: dict, table: dict | None = None) -> dict:
    """The keys of ``table`` (:data:`RELEASE_KEYS`) for the model type that the saved config lacks (or holds as
    None)."""
    table = RELEASE_KEYS if table is None else table
    return {k: (v(saved) if callable(v) else v) for k, v in table.get(model_type, {}).items()
            if saved.get(k) is None}


def release_keys(model, saved: dict) -> dict:
    """Keys a release's config.json carries that transformers' save leaves out: the legacy keys its config class
    converts, the dense-first count (and MoE every layer after it) that transformers writes as ``mlp_layer_types``,
    ``head_dim`` where the model derived it (hidden / heads), and the model type's :data:`RELEASE_KEYS`."""
    extra = legacy_keys(type(model.config), saved)
    mlp = saved.get("mlp_layer_types")
    if isinstance(mlp, list) and mlp and "first_k_dense_replace" not in saved:
        dense = next((i for i, t in enumerate(mlp) if t != "dense"), len(mlp))
        extra["first_k_dense_replace"] = dense
        if "moe_layer_freq" not in saved and all(t != "dense" for t in mlp[dense:]):
            extra["moe_layer_freq"] = 1
    heads = saved.get("num_attention_heads")
    if "head_dim" not in saved and isinstance(heads, int) and isinstance(saved.get("hidden_size"), int):
        extra["head_dim"] = saved["hidden_size"] // heads
    return {**extra, **table_keys(saved.get("model_type", ""), saved)}  # the release's own values win


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("architecture")
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    import torch
    import transformers
    from transformers import AutoConfig

    found = registry_for(a.architecture)
    if found is None:
        print(f"{a.architecture}: transformers {transformers.__version__} has no causal-LM class for it",
              file=sys.stderr)
        return 3
    mt, auto = found
    d = shrink_widths(AutoConfig.for_model(mt).to_dict())
    d = {**d, **{k: (v(d) if callable(v) else v) for k, v in BUILD_KEYS.get(mt, {}).items()}}
    d = with_subconfigs(mt, d)
    switched = False
    if not routed(build(mt, d, "meta", auto=auto)[1]) and switch_moe_on(d) is not None:
        d, switched = switch_moe_on(d), True
    full, tiny, kinds_full = choose_layers(mt, d, auto)
    d = cut_layers(d, full, tiny)
    torch.manual_seed(a.seed)
    _, model = build(mt, d, "cpu", auto=auto)
    kinds_tiny = {signature(layer) for layer in layer_lists(model)}
    lost = len(kinds_full - kinds_tiny)
    randomize(model, a.seed)
    model.config.architectures = [a.architecture]
    out = Path(a.out)
    model.save_pretrained(out)
    saved = json.loads((out / "config.json").read_text())
    extra = release_keys(model, saved)
    cfg = {k: v for k, v in {**saved, **extra}.items() if k not in RELEASE_SPELLS.get(mt, ())}
    # the registry's name, as the release writes it: save_pretrained writes the class's own (transformers'
    # PhimoeForCausalLM for Phi-3.5-MoE's PhiMoEForCausalLM, which SGLang's registry does not know)
    cfg["architectures"] = [a.architecture]
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    dropped = drop_tensors(out, RELEASE_DROPS[mt](cfg)) if mt in RELEASE_DROPS else 0
    if auto != REGISTRIES[0][1]:
        write_index(out)
    rep = {"architecture": a.architecture, "model_type": mt, "model_class": type(model).__name__,
           "transformers": transformers.__version__, "layers_full": full, "layers": tiny,
           "layer_kinds": len(kinds_tiny), "kinds_lost": lost, "moe_switched_on": switched, "release_keys": extra,
           "dropped": dropped, "routed_expert_tensors": routed(model), **written(out)}
    print(json.dumps(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
