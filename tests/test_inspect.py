"""inspect: MoE parameters from config.json alone, for every family's field names."""

from __future__ import annotations

import json

from helpers import run
from kimi_convert.modelinfo import from_config

K3_TEXT = {
    "model_type": "kimi_linear", "hidden_size": 7168, "num_hidden_layers": 93, "num_experts": 896,
    "num_experts_per_token": 16, "num_shared_experts": 2, "moe_intermediate_size": 3072,
    "routed_expert_hidden_size": 3584, "use_full_rank_gate": True, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "first_k_dense_replace": 1,
    "linear_attn_config": {"num_heads": 96, "head_dim": 128,
                           "kda_layers": [i for i in range(1, 94) if i % 4 != 0],
                           "full_attn_layers": [i for i in range(1, 94) if i % 4 == 0]},
}


def test_k3_released_values_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
        "text_config": K3_TEXT, "vision_config": {"hidden_size": 1152}}))
    r = run("inspect", tmp_path)
    assert r.code == 0, r.stderr
    assert "E=896 topk=16 moe_intermediate_size=3072 hidden_size=7168" in r.stdout
    assert "not present" in r.stdout and "3584" in r.stdout
    d = json.loads(run("inspect", tmp_path, "--json").stdout)
    assert (d["num_experts"], d["top_k"], d["moe_intermediate_size"], d["hidden_size"]) == (896, 16, 3072, 7168)
    assert len(d["layer_kinds"]["kda"]) == 70 and len(d["layer_kinds"]["mla"]) == 23
    assert d["weights_present"] is False


def test_other_families():
    mixtral = from_config({"architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32,
                           "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 14336})
    assert (mixtral.num_experts, mixtral.top_k, mixtral.moe_intermediate_size) == (8, 2, 14336)
    ds = from_config({"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168, "num_hidden_layers": 61,
                      "n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
                      "first_k_dense_replace": 3, "kv_lora_rank": 512})
    assert (ds.num_experts, ds.top_k, ds.moe_intermediate_size) == (256, 8, 2048)
    assert ds.moe_layers[0] == 3 and len(ds.moe_layers) == 58
    qwen = from_config({"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 48,
                        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768})
    assert (qwen.num_experts, qwen.top_k, qwen.moe_intermediate_size) == (128, 8, 768)
    kl = from_config({"architectures": ["KimiLinearForCausalLM"], "hidden_size": 2304, "num_hidden_layers": 27,
                      "num_experts": 256, "num_experts_per_token": 8, "moe_intermediate_size": 1024})
    assert (kl.num_experts, kl.top_k, kl.text_config) == (256, 8, "(flat)")


def test_tensors_checked_against_config(tiny_k3, tmp_path):
    d = json.loads(run("inspect", tiny_k3, "--json").stdout)
    assert d["weights_present"] and d["tensor_experts"] == 8 and d["tensor_expert_shape"] == [128, 256]
    assert any("latent" in w for w in d["warnings"])
    import shutil
    ck = tmp_path / "c"
    shutil.copytree(tiny_k3, ck)
    cfg = json.loads((ck / "config.json").read_text())
    cfg["text_config"]["num_experts"] = 16
    cfg["text_config"]["moe_intermediate_size"] = 96
    (ck / "config.json").write_text(json.dumps(cfg))
    d = json.loads(run("inspect", ck, "--json").stdout)
    assert any("num_experts=16 but layers hold 8" in w for w in d["warnings"])
    assert any("moe_intermediate_size=96 but expert weights have 128 rows" in w for w in d["warnings"])


# zai-org/GLM-5.1's and GLM-4.7-Flash's config.json (the MoE keys; docs/families.md "GLM-5.x", "GLM-4.7-Flash").
GLM51 = {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "hidden_size": 6144,
         "num_hidden_layers": 78, "first_k_dense_replace": 3, "n_routed_experts": 256, "num_experts_per_tok": 8,
         "moe_intermediate_size": 2048, "intermediate_size": 12288, "n_shared_experts": 1, "kv_lora_rank": 512,
         "q_lora_rank": 2048, "index_n_heads": 32, "index_head_dim": 128, "num_nextn_predict_layers": 1}
GLM47_FLASH = {"architectures": ["Glm4MoeLiteForCausalLM"], "model_type": "glm4_moe_lite", "hidden_size": 2048,
               "num_hidden_layers": 47, "first_k_dense_replace": 1, "n_routed_experts": 64, "num_experts_per_tok": 4,
               "moe_intermediate_size": 1536, "intermediate_size": 10240, "n_shared_experts": 1, "kv_lora_rank": 512,
               "q_lora_rank": 768, "num_nextn_predict_layers": 1}


def test_glm_mla_families_give_benchmark_moe_values(tmp_path):
    """vLLM benchmark_moe.py's get_model_params reads GlmMoeDsaForCausalLM and Glm4MoeLiteForCausalLM as DeepSeek:
    E = n_routed_experts, topk = num_experts_per_tok, moe_intermediate_size, hidden_size."""
    for cfg, line, moe in ((GLM51, "E=256 topk=8 moe_intermediate_size=2048 hidden_size=6144", 75),
                           (GLM47_FLASH, "E=64 topk=4 moe_intermediate_size=1536 hidden_size=2048", 46)):
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        r = run("inspect", tmp_path)
        assert r.code == 0, r.stderr
        assert f"benchmark_moe    {line}" in r.stdout, r.stdout
        info = from_config(cfg)
        assert info.moe_layers[0] == cfg["first_k_dense_replace"] and len(info.moe_layers) == moe


def test_kimi_k25_gives_benchmark_moe_values_and_reads_int4_experts(tmp_path):
    """Kimi K2.5 / K2.6: the DeepSeek V3 text model in text_config (benchmark_moe.py's DeepSeek fields), its routed
    experts INT4 pack-quantized (eight codes an I32: K = 8 x the packed width)."""
    from helpers import write_synth

    src = write_synth("tiny-kimi-k25", tmp_path / "k25")
    r = run("inspect", src)
    assert r.code == 0, r.stderr
    assert "benchmark_moe    E=8 topk=2 moe_intermediate_size=128 hidden_size=256" in r.stdout, r.stdout
    assert "expert gate weight [128, 256]" in r.stdout and "warning" not in r.stdout, r.stdout
    cfg = json.loads((src / "config.json").read_text())
    cfg["text_config"].update({"hidden_size": 7168, "num_hidden_layers": 61, "n_routed_experts": 384,
                               "num_experts_per_tok": 8, "moe_intermediate_size": 2048})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = run("inspect", tmp_path)
    assert "benchmark_moe    E=384 topk=8 moe_intermediate_size=2048 hidden_size=7168" in r.stdout, r.stdout
    assert len(from_config(cfg).moe_layers) == 60


def test_mlp_only_layers_are_dense():
    """Qwen-MoE's (and IQuest-Q1's) ``mlp_only_layers``: those layers are dense, whatever the step says (vLLM 0.33
    qwen2_moe.py ``Qwen2MoeDecoderLayer``: ``layer_idx not in mlp_only_layers``)."""
    cfg = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 64,
           "num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           "decoder_sparse_step": 1, "mlp_only_layers": [0, 2]}
    assert from_config(cfg).moe_layers == [1, 3]

