"""IBM Granite 4.0 hybrid MoE (GraniteMoeHybridForCausalLM) without an engine: the tests' preset is laid out as the
release (granite-4.0-h-tiny's config.json keys and values, Mamba-2 and attention layers by ``layer_types``, the
routed experts as two 3-D BF16 banks per layer, the router ``router.layer``, the shared MLP ``shared_mlp``, tied
embeddings, every tensor BF16).

The expected names are written here by hand from the engines' loaders, not produced by the code under test:
- vLLM 0.33 granitemoehybrid.py GraniteMoeHybridModel.load_weights: the banks by their endings
  (``.block_sparse_moe.input_linear.weight`` chunked per expert into w1 / w3, ``.block_sparse_moe.output_linear.weight``
  per expert into w2), ``.block_sparse_moe.router.layer.weight`` into ``block_sparse_moe.gate``, q/k/v into
  ``qkv_proj``, ``A_log`` renamed ``A``, everything else by name: GraniteMoeHybridMambaDecoderLayer's ``mamba``
  (MambaMixer2: in_proj, conv1d, dt_bias, A, D, norm, out_proj), GraniteMoeHybridAttentionDecoderLayer's ``self_attn``
  (qkv_proj, o_proj), GraniteMoeSharedMLP ``shared_mlp`` (input_linear, output_linear), the two RMSNorms, the model's
  embed_tokens / norm; ParallelLMHead tied to embed_tokens (tie_word_embeddings);
- SGLang 0.5.23 granitemoehybrid.py GraniteMoeHybridForCausalLM.load_weights: the same branches.
Public evidence for the layout: docs/families.md ("Granite 4.0 hybrid").
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import MODEL_DIRS, config_keys_read, engine_file_or_skip, read_tensors, run, weight_map, write_synth

REPO = Path(__file__).resolve().parent.parent

# ibm-granite/granite-4.0-h-tiny config.json: the values that are not sizes (sizes: the preset's)
RELEASE = {
    "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
    "attention_bias": False, "attention_dropout": 0.0, "attention_multiplier": 0.0078125,
    "bos_token_id": 100257, "eos_token_id": 100257, "pad_token_id": 100256, "embedding_multiplier": 12,
    "hidden_act": "silu", "initializer_range": 0.1, "logits_scaling": 6, "mamba_chunk_size": 256,
    "mamba_conv_bias": True, "mamba_d_conv": 4, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_expand": 2,
    "mamba_n_groups": 1, "mamba_proj_bias": False, "max_position_embeddings": 131072,
    "normalization_function": "rmsnorm", "output_router_logits": False, "position_embedding_type": "nope",
    "residual_multiplier": 0.22, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000,
    "router_aux_loss_coef": 0.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
}

EVERY_LAYER = {"input_layernorm.weight", "post_attention_layernorm.weight",
               "block_sparse_moe.input_linear.weight", "block_sparse_moe.output_linear.weight",
               "block_sparse_moe.router.layer.weight",
               "shared_mlp.input_linear.weight", "shared_mlp.output_linear.weight"}
MAMBA = {"mamba.A_log", "mamba.D", "mamba.dt_bias", "mamba.conv1d.weight", "mamba.conv1d.bias",
         "mamba.in_proj.weight", "mamba.norm.weight", "mamba.out_proj.weight"}
ATTENTION = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
             "self_attn.o_proj.weight"}
KINDS = ["mamba", "mamba", "attention", "mamba"]  # the tiny preset's layer_types


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_synth("tiny-granitemoehybrid", tmp_path_factory.mktemp("granitemoehybrid") / "src")


def test_config_is_the_releases(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    assert {k: cfg[k] for k in RELEASE} == RELEASE
    assert cfg["num_hidden_layers"] == 4 and cfg["num_local_experts"] == 8 and cfg["num_experts_per_tok"] == 2
    # the release's legacy layer names ("mamba" / "attention"), which transformers remaps to linear_attention /
    # full_attention for vLLM and SGLang's own config class maps back
    assert cfg["layer_types"] == KINDS
    # transformers registers the class: no remote code; no MTP, no dense-first or RoPE keys
    assert not {"auto_map", "num_nextn_predict_layers", "first_k_dense_replace", "rope_parameters",
                "head_dim"} & set(cfg)
    assert cfg["mamba_d_head"] * cfg["mamba_n_heads"] == cfg["mamba_expand"] * cfg["hidden_size"]  # both validate it


def test_the_release_rule_for_layer_types_at_full_depth():
    """The family's own layer_types rule (the preset file's [config]) gives the release's 40 layers: attention at 5,
    15, 25, 35, nine Mamba-2 layers to one attention layer, as granite-4.0-h-tiny's config.json lists them."""
    import tomllib

    from kimi_convert.synth.expr import parse

    rule = tomllib.loads((REPO / "tests/presets/granitemoehybrid.toml").read_text())["config"]["layer_types"]
    got = parse(rule.removeprefix("="))({"num_hidden_layers": 40}.__getitem__)
    assert len(got) == 40 and set(got) == {"mamba", "attention"}
    assert [i for i, t in enumerate(got) if t == "attention"] == [5, 15, 25, 35]


def test_tensors_are_exactly_the_names_the_loaders_consume(tiny):
    want = {"model.embed_tokens.weight", "model.norm.weight"}  # tied: no lm_head.weight
    for i, kind in enumerate(KINDS):
        want |= {f"model.layers.{i}.{n}" for n in EVERY_LAYER | (MAMBA if kind == "mamba" else ATTENTION)}
    assert set(weight_map(tiny)) == want


def test_shapes_and_dtypes_are_the_releases(tiny):
    import torch

    t = read_tensors(tiny)
    h, e, i, s = 256, 8, 128, 256
    heads, kv, hd = 2, 1, 128  # head_dim 128, as granite-4.0-h-tiny's 1536 / 12
    mw, mh, state = 2 * h, 8, 128  # Mamba-2: expand 2, 8 heads of 64, one group, state 128
    conv = mw + 2 * state
    layer = "model.layers.0"
    assert t[f"{layer}.block_sparse_moe.input_linear.weight"].shape == (e, 2 * i, h)  # gate rows, then up rows
    assert t[f"{layer}.block_sparse_moe.output_linear.weight"].shape == (e, h, i)
    assert t[f"{layer}.block_sparse_moe.router.layer.weight"].shape == (e, h)
    assert t[f"{layer}.shared_mlp.input_linear.weight"].shape == (2 * s, h)
    assert t[f"{layer}.shared_mlp.output_linear.weight"].shape == (h, s)
    assert t[f"{layer}.mamba.in_proj.weight"].shape == (mw + conv + mh, h)  # z, x B C, dt
    assert t[f"{layer}.mamba.conv1d.weight"].shape == (conv, 1, 4)
    assert t[f"{layer}.mamba.conv1d.bias"].shape == (conv,)
    assert {t[f"{layer}.mamba.{n}"].shape for n in ("A_log", "D", "dt_bias")} == {(mh,)}
    assert t[f"{layer}.mamba.norm.weight"].shape == (mw,)
    assert t[f"{layer}.mamba.out_proj.weight"].shape == (h, mw)
    assert t["model.layers.2.self_attn.q_proj.weight"].shape == (heads * hd, h)
    assert t["model.layers.2.self_attn.k_proj.weight"].shape == (kv * hd, h)
    assert t["model.layers.2.self_attn.o_proj.weight"].shape == (h, heads * hd)
    assert {v.dtype for v in t.values()} == {torch.bfloat16}


# not config.json keys: what the engines' config classes derive (vLLM: transformers' rope_parameters, read only for
# position_embedding_type "rope"; SGLang: its GraniteMoeHybridConfig.mamba2_cache_params property)
DERIVED = {"rope_parameters", "mamba2_cache_params"}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_config_holds_every_key_the_engine_reads_without_a_default(tiny, engine):
    """Each ``config.X`` the engine's model file reads directly (no getattr default, no hasattr guard) is in
    config.json."""
    path = engine_file_or_skip(engine, f"{MODEL_DIRS[engine]}/granitemoehybrid.py")
    cfg = json.loads((tiny / "config.json").read_text())
    read = config_keys_read(path.read_text())
    assert {"layer_types", "mamba_n_groups", "position_embedding_type", "residual_multiplier"} <= read
    assert sorted(k for k in read - DERIVED if k not in cfg) == []


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_loaders_read_the_release_banks_by_name(engine):
    """Both loaders hold a branch for each stored bank name and the router (what the preset writes), and read a
    per-expert name (what an NVFP4 output holds: one module per expert and projection) through get_expert_mapping."""
    text = engine_file_or_skip(engine, f"{MODEL_DIRS[engine]}/granitemoehybrid.py").read_text()
    for name in (".block_sparse_moe.input_linear.weight", ".block_sparse_moe.output_linear.weight",
                 ".block_sparse_moe.router.layer.weight"):
        assert f'n.endswith("{name}")' in text or f'"{name}"' in text, name
    assert 'f"block_sparse_moe.experts.{expert_id}.{weight_name}."' in text
    assert '("w1", ckpt_gate_proj_name)' in text and '("w3", ckpt_up_proj_name)' in text


def test_sglang_fused_moe_weight_loader_takes_no_return_success():
    """SGLang 0.5.23's own mismatch (docs/families.md, "Granite 4.0 hybrid"): granitemoehybrid.py's
    ``_load_quant_expert`` passes ``return_success=True`` to ``FusedMoE.weight_loader``, whose signature
    (layers/moe/fused_moe_triton/layer.py) has no such parameter: every per-expert name (any NVFP4 output) raises
    TypeError there, while the release's BF16 banks take the bank branch and load."""
    model = engine_file_or_skip("sglang", "srt/models/granitemoehybrid.py").read_text()
    assert "return_success=True" in model
    layer = engine_file_or_skip("sglang", "srt/layers/moe/fused_moe_triton/layer.py").read_text()
    sig = re.search(r"    def weight_loader\(\n(.*?)\) -> None:", layer, re.S)
    assert sig is not None and "expert_id" in sig.group(1)
    assert "return_success" not in sig.group(1) and "**" not in sig.group(1)


def test_the_banks_split_into_the_per_expert_modules_the_loaders_read(tiny):
    """The expert_bank encoding knows the hybrid's banks (its Granite layouts hold for any model type): each expert
    and projection a module under block_sparse_moe.experts, a byte range of its bank, the banks themselves no
    module."""
    from kimi_convert.checkpoint import open_checkpoint
    from kimi_convert.plan import discover_sources

    modules = discover_sources(open_checkpoint(tiny))
    layer = "model.layers.2.block_sparse_moe"
    for x in range(8):
        for leaf, rows in (("gate_proj", (0, 128)), ("up_proj", (128, 256))):
            w = modules[f"{layer}.experts.{x}.{leaf}"]["weight"]
            assert (w.encoding, w.shape) == ("dense", (128, 256))
            assert w.parts[0].name == f"{layer}.input_linear.weight[{x}][{rows[0]}:{rows[1]}]"
        down = modules[f"{layer}.experts.{x}.down_proj"]["weight"]
        assert (down.shape, down.parts[0].name) == ((256, 128), f"{layer}.output_linear.weight[{x}]")
    assert not {f"{layer}.input_linear", f"{layer}.output_linear"} & set(modules)


def test_inspect_reads_its_layer_kinds_and_expert_banks(tiny):
    r = run("inspect", tiny)
    assert r.code == 0, r.stderr
    assert "layers           4: mamba 3 [0-1,3], attention 1 [2]" in r.stdout, r.stdout
    assert "benchmark_moe    E=8 topk=2 moe_intermediate_size=128 hidden_size=256" in r.stdout
    assert "8 experts per layer, expert gate weight [128, 256]" in r.stdout
    assert "warning" not in r.stdout


def test_plan_with_the_shipped_derived_table(tiny):
    """Where a derived table ships (mappings/derived/granitemoehybrid.toml), plan reads it with no engine: the
    per-expert modules NVFP4, gate and up of one expert under one global scale, the router kept."""
    if not (REPO / "mappings/derived/granitemoehybrid.toml").is_file():
        pytest.skip("no shipped derived table: SGLang 0.5.23 loads no per-expert GraniteMoeHybrid checkpoint "
                    "(docs/families.md, \"Granite 4.0 hybrid\")")
    r = run("plan", tiny, "--json")
    assert r.code == 0, r.stderr
    mods = {m["name"]: m for m in json.loads(r.stdout)["modules"]}
    for x in range(8):
        for p in ("gate_proj", "up_proj", "down_proj"):
            assert mods[f"model.layers.1.block_sparse_moe.experts.{x}.{p}"]["kind"] == "nvfp4"
    gate, up = (mods[f"model.layers.1.block_sparse_moe.experts.3.{p}"] for p in ("gate_proj", "up_proj"))
    assert gate["quantization"]["shared_scale"] == up["quantization"]["shared_scale"] is not None
    assert mods["model.layers.1.block_sparse_moe.router.layer"]["kind"] == "keep"
