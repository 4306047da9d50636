"""LongCat-Flash-Lite (LongcatFlashNgramForCausalLM: meituan-longcat/LongCat-Flash-Lite) without an engine: the tests'
preset is laid out as the release (config.json with the release's keys, no model_type, its remote config class; the
names vLLM's loader consumes: LongCat-Flash's decoder, router and experts, the n-gram embedding's 12 tables and 12
projections, BF16 with the router in F32, the MTP layer under ``model.mtp.``).

The expected names and shapes are written here by hand from vLLM 0.33, not produced by the code under test:
longcat_flash_ngram.py (NgramEmbedding: k = emb_split_num, n = emb_neighbor_num, k * (n - 1) tables, table i of
``ngram_vocab_size_ratio * vocab_size + 2 i + 1`` rows, ``hidden_size // (k * (n - 1))`` wide; ``load_weight`` reads
``ngram_embeddings.embedders.N`` rows into its concatenated ``oe_embedder`` and ``ngram_embeddings.post_projs.N`` into
``oe_projection[N]`` transposed; FlashNgramModel.load_weights gives every other name to FlashModel.load_weights;
``hf_to_vllm_mapper`` maps ``model.mtp.`` to None), longcat_flash.py (the decoder as LongCat-Flash's) and
longcat_flash_mtp.py (the MTP layer's ``new_to_old_names_mapping``). SGLang 0.5.23 registers no entry class of the
name. Public evidence: /tmp/s40/longcat_flash_ngram-families.md (docs/families.md, "LongCat-Flash-Lite").
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

# the Lite's decoder layers and MTP layer are LongCat-Flash's, named as its loaders name them
from test_family_longcat_flash import LAYER, MTP, experts, shapes_hold, zero_experts_hold

from helpers import config_keys_read, engine_file_or_skip, plan_kinds, read_tensors, weight_map, write_synth

# meituan-longcat/LongCat-Flash-Lite config.json: the values that are not sizes (sizes: the preset's). No
# model_type: the release's config.json has none (vLLM maps the architecture to longcat_flash for such checkpoints).
RELEASE = {
    "architectures": ["LongcatFlashNgramForCausalLM"],
    "auto_map": {"AutoConfig": "configuration_longcat_ngram.LongcatFlashNgramConfig",
                 "AutoModel": "modeling_longcat_ngram.LongcatFlashNgramModel",
                 "AutoModelForCausalLM": "modeling_longcat_ngram.LongcatFlashNgramForCausalLM"},
    "attention_bias": False, "attention_dropout": 0.0, "attention_method": "MLA", "bos_token_id": 1,
    "eos_token_id": 2, "max_position_embeddings": 327680, "mla_scale_kv_lora": True, "mla_scale_q_lora": True,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "rms_norm_eps": 1e-05,
    "rope_theta": 5000000.0, "routed_scaling_factor": 6.0, "use_cache": True, "zero_expert_type": "identity",
    "torch_dtype": "bfloat16", "ngram_vocab_size_ratio": 78, "emb_neighbor_num": 4, "emb_split_num": 4,
    "rope_scaling": {"type": "yarn", "factor": 10.0, "original_max_position_embeddings": 32768, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
}
# the release's size keys (the preset reduces their values)
SIZES = {"expert_ffn_hidden_size", "ffn_hidden_size", "hidden_size", "kv_lora_rank", "moe_topk", "n_routed_experts",
         "num_attention_heads", "num_layers", "q_lora_rank", "vocab_size", "zero_expert_num"}

H, HEADS, Q_LORA, KV_LORA, NOPE, ROPE, V, FFN, EXPERT, E, Z = 384, 2, 128, 128, 128, 64, 128, 512, 128, 8, 4
VOCAB = 1000
TABLES = 4 * (4 - 1)  # emb_split_num x (emb_neighbor_num - 1)
TABLE_DIM = H // TABLES  # 32 (the release: 3072 // 12 = 256)

NGRAM = ({f"model.ngram_embeddings.embedders.{i}.weight" for i in range(TABLES)}
         | {f"model.ngram_embeddings.post_projs.{i}.weight" for i in range(TABLES)})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_synth("tiny-longcat-flash-ngram", tmp_path_factory.mktemp("longcat-flash-ngram") / "src")


def test_config_is_the_releases(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    assert {k: cfg[k] for k in RELEASE} == RELEASE
    assert set(cfg) == set(RELEASE) | SIZES  # the release's keys, no other
    assert (cfg["num_layers"], cfg["n_routed_experts"], cfg["zero_expert_num"], cfg["moe_topk"]) == (2, E, Z, 2)
    # no model_type (vLLM: _ARCHITECTURE_TO_MODEL_TYPE; SGLang: its LongCat archs), LongCat's own key names, none of
    # DeepSeek's or transformers', no MTP count (vLLM's draft builds one layer)
    assert not {"model_type", "num_hidden_layers", "intermediate_size", "moe_intermediate_size",
                "num_experts_per_tok", "num_nextn_predict_layers", "first_k_dense_replace", "rope_parameters",
                "num_key_value_heads", "router_bias"} & set(cfg)
    assert cfg["hidden_size"] % (cfg["emb_split_num"] * (cfg["emb_neighbor_num"] - 1)) == 0
    assert (tiny / "configuration_longcat_ngram.py").is_file()  # the class auto_map names, shipped alongside


def test_tensors_are_exactly_the_names_the_loader_consumes(tiny):
    want = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} | NGRAM | MTP
    want |= {f"model.layers.{i}.{n}" for i in range(2) for n in LAYER | experts(E)}  # every layer alike
    assert set(weight_map(tiny)) == want


def test_ngram_tables_are_the_sizes_vllm_builds(tiny):
    """vLLM NgramEmbedding._init_ngram_embeddings: table i holds ``m + 2 i + 1`` rows (m = ngram_vocab_size_ratio x
    vocab_size), ``hidden // tables`` wide (load_weight asserts the row count against its offsets); a projection is
    nn.Linear(table width, hidden) as stored, [hidden, width] (load_weight copies its transpose into
    oe_projection[i], [width, hidden])."""
    t = read_tensors(tiny)
    m = 78 * VOCAB
    for i in range(TABLES):
        assert t[f"model.ngram_embeddings.embedders.{i}.weight"].shape == (m + 2 * i + 1, TABLE_DIM)
        assert t[f"model.ngram_embeddings.post_projs.{i}.weight"].shape == (H, TABLE_DIM)
    assert t["model.embed_tokens.weight"].shape == (VOCAB, H)  # the word embedding NgramEmbedding wraps


def test_zero_experts_have_router_rows_and_no_weights(tiny):
    """The router scores n_routed_experts + zero_expert_num experts (vLLM LongcatRouter); the zero (identity) experts
    store nothing: vLLM maps experts 0..n_routed_experts-1 only (longcat_flash.py get_expert_mapping)."""
    zero_experts_hold(tiny, E, Z, H)


def test_shapes_and_dtypes_are_the_releases(tiny):
    """LongCat-Flash's shapes at the Lite's sizes, its router float32 as vLLM builds it, the rest (the n-gram tables
    and projections too) BF16."""
    t = shapes_hold(tiny, (H, HEADS, Q_LORA, KV_LORA, NOPE, ROPE, V, FFN, EXPERT))
    assert {v.dtype for n, v in t.items() if ".mlp.router." not in n} == {torch.bfloat16}


def test_vllm_ngram_loader_reads_these_names():
    """vLLM's FlashNgramModel.load_weights routes exactly the two n-gram families to NgramEmbedding.load_weight, the
    table index the number after the family's prefix; everything else goes to FlashModel.load_weights; the main model
    maps ``model.mtp.`` to None (its draft LongCatFlashMTP loads the MTP layer)."""
    text = engine_file_or_skip("vllm", "model_executor/models/longcat_flash_ngram.py").read_text()
    assert '"ngram_embeddings.embedders." in name' in text and '"ngram_embeddings.post_projs." in name' in text
    assert 'weight_name.split("ngram_embeddings.embedders.")[1].split(".")[0]' in text
    assert "self.oe_projection.data[index].copy_(loaded_weight.t())" in text
    assert 'orig_to_new_prefix={"model.mtp.": None}' in text
    assert "sizes = [int(self.m + i * 2 + 1) for i in range(self.num_embedders)]" in text
    assert "oe_dim = self.config.hidden_size // self.num_embedders" in text


def _mapped_mtp_names(text: str, table: str) -> set[str]:
    body = text[text.index(f"{table} = {{"):]
    body = body[:body.index("\n        }")]
    return {n for n in re.findall(r'"(model\.mtp\.[\w.]+)"\s*:', body) if not n.endswith("weight_scale_inv")}


def test_mtp_names_are_the_drafts(tiny):
    """The MTP layer's names are exactly those vLLM's draft renames (longcat_flash_mtp.py
    LongCatFlashMTP.load_weights ``new_to_old_names_mapping``)."""
    path = engine_file_or_skip("vllm", "model_executor/models/longcat_flash_mtp.py")
    assert _mapped_mtp_names(path.read_text(), "new_to_old_names_mapping") == MTP
    assert {n for n in weight_map(tiny) if n.startswith("model.mtp.")} == MTP


# keys vLLM reads as config.X that are not config.json keys: attributes of transformers' LongcatFlashConfig, which
# vLLM builds for this architecture (transformers_utils/config.py: no model_type, _ARCHITECTURE_TO_MODEL_TYPE
# longcat_flash): attribute_map intermediate_size -> ffn_hidden_size, moe_intermediate_size ->
# expert_ffn_hidden_size, hidden_act "silu"; pad_token_id (PretrainedConfig's, None)
DERIVED = {"intermediate_size", "moe_intermediate_size", "hidden_act", "pad_token_id"}


@pytest.mark.parametrize("rel", ["model_executor/models/longcat_flash_ngram.py",
                                 "model_executor/models/longcat_flash.py",
                                 "model_executor/models/longcat_flash_mtp.py"])
def test_config_holds_every_key_vllm_reads_without_a_default(tiny, rel):
    """Each ``config.X`` vLLM's LongCat files read directly (no getattr default) is in config.json or is one its
    config class derives (DERIVED)."""
    path = engine_file_or_skip("vllm", rel)
    cfg = json.loads((tiny / "config.json").read_text())
    read = config_keys_read(path.read_text())
    assert sorted(k for k in read - DERIVED if k not in cfg) == []


def test_vllm_reaches_it_without_a_model_type():
    """A config.json with no model_type: vLLM's HFConfigParser takes the model type from the architecture
    (``_ARCHITECTURE_TO_MODEL_TYPE``) and builds transformers' LongcatFlashConfig, not the remote class."""
    text = engine_file_or_skip("vllm", "transformers_utils/config.py").read_text()
    assert '"LongcatFlashNgramForCausalLM": "longcat_flash",' in text
    assert "model_type = _ARCHITECTURE_TO_MODEL_TYPE.get(architectures[0])" in text


def test_sglang_registers_no_entry_class_of_the_name():
    """SGLang 0.5.23 registers LongcatFlashForCausalLM only (longcat_flash.py EntryClass); its config loader renames a
    LongcatFlashNgramForCausalLM config to it (utils/hf_transformers/config.py), which the breadth run, reading the
    registries, does not follow (docs/families.md, "LongCat-Flash-Lite")."""
    text = engine_file_or_skip("sglang", "srt/models/longcat_flash.py").read_text()
    assert re.search(r"^EntryClass = \[LongcatFlashForCausalLM\]$", text, re.M)


def test_plan_with_the_shipped_table(tiny):
    """``kimi-convert plan`` with the table that ships for the architecture (derived, named by
    ``kimi_convert.derive.TABLE_NAMES``: the config has no model_type) and its overlay
    (mappings/overlays/longcat_flash_ngram.toml): the routed experts and the
    decoder's linear layers NVFP4, the routers kept, the word embedding and the n-gram tables and projections copied
    as stored (vLLM holds the projections in a plain parameter), the MTP layer kept (its draft loads .weight only)."""
    from kimi_convert.derive.lookup import shipped_table
    from kimi_convert.mapping import UnknownArchitecture

    try:
        table = shipped_table(json.loads((tiny / "config.json").read_text()))
    except UnknownArchitecture:
        pytest.skip("no table ships for LongcatFlashNgramForCausalLM yet (docs/families.md, LongCat-Flash-Lite)")
    assert table.name == "derived-longcat_flash_ngram"
    kinds = {n: k.value for n, k in plan_kinds(tiny).items()}
    assert {kinds[n] for n in NGRAM} == {"copy"} and kinds["model.embed_tokens.weight"] == "copy"
    mtp_linear = {n: kinds[n] for n in kinds if n.startswith("model.mtp.layers.0.") and not n.endswith(".weight")}
    assert len(mtp_linear) == 9 and set(mtp_linear.values()) == {"keep"}  # eh_proj, 5 MLA, 3 MLP
    assert kinds["model.layers.1.mlp.router.classifier"] == "keep"
    assert {kinds[f"model.layers.1.mlp.experts.3.{p}_proj"] for p in ("gate", "up", "down")} == {"nvfp4"}
    assert kinds["model.layers.0.self_attn.1.q_b_proj"] == kinds["model.layers.0.mlps.0.gate_proj"] == "nvfp4"
