"""Step-3's text model (Step3TextForCausalLM) without an engine: the tests' preset is the text part of the release
(stepfun-ai/step3) laid out as vLLM serves it (config.json with the text config's keys, model_type "step3_text", the
names vLLM's loader consumes, BF16, the routed experts as three 3-D banks per MoE layer).

The expected names are written here by hand from vLLM 0.33's model_executor/models/step3_text.py
(Step3TextModel.load_weights: qkv_params_mapping .q_proj / .k_proj / .v_proj into the ReplicatedLinear qkv_proj,
stacked_params_mapping .gate_proj / .up_proj -> .gate_up_proj for the dense and shared MLPs, expert_params_mapping
.moe.gate_proj.weight / .moe.up_proj.weight -> w13_weight and .moe.down_proj.weight -> w2_weight, each indexed
loaded_weight[expert_id]; Step3TextAttention's inter_norm and wq; FusedMoEBlock's gate), not produced by the code under
test. SGLang 0.5.23 does not register the architecture. Evidence: docs/families.md ("Step-3 text").

The shipped table (mappings/derived/step3_text.toml, derived from vLLM 0.33, with the hand overlay
mappings/overlays/step3_text.toml) writes the routed experts as stacked 3-D NVFP4 banks ([stacked]: vLLM reads no
per-expert name) with one global scale per expert shared by gate and up (vLLM's w13_weight_scale_2[:, 0]), and keeps
q/k/v BF16 (the loader narrows qkv_proj's parameters by an output_dim NVFP4's weight_scale_2 has not), naming vLLM's
own prefix .layers.N.self_attn.qkv_proj in the exclude list.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import config_keys_read, engine_file_or_skip, read_tensors, run, weight_map, write_synth

# stepfun-ai/step3 text_config: the values that are not sizes (sizes: the preset's)
RELEASE = {
    "architectures": ["Step3TextForCausalLM"], "model_type": "step3_text", "num_attention_groups": 1,
    "head_dim": 256, "moe_top_k": 3, "rope_theta": 500000, "rope_scaling": None, "rms_norm_eps": 1e-05,
    "norm_expert_weight": False, "torch_dtype": "bfloat16",
}

ATTN = {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.inter_norm.weight",
        "self_attn.wq.weight", *(f"self_attn.{p}_proj.weight" for p in ("q", "k", "v", "o"))}
DENSE = {f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
MOE = ({"moe.gate.weight"} | {f"moe.{p}_proj.weight" for p in ("gate", "up", "down")}
       | {f"share_expert.{p}_proj.weight" for p in ("gate", "up", "down")})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_synth("tiny-step3-text", tmp_path_factory.mktemp("step3_text") / "src")


def test_config_is_the_releases(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    assert {k: cfg[k] for k in RELEASE} == RELEASE
    assert cfg["num_hidden_layers"] == 3 and cfg["moe_num_experts"] == 8
    assert cfg["moe_layers_enum"] == "1"  # a comma-separated string: vLLM's decoder layer splits it
    assert "auto_map" not in cfg  # vLLM's own Step3TextConfig reads it


def test_tensors_are_exactly_the_names_the_loader_consumes(tiny):
    want = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    want |= {f"model.layers.{i}.{n}" for i in (0, 2) for n in ATTN | DENSE}  # dense first and last layers
    want |= {f"model.layers.1.{n}" for n in ATTN | MOE}
    assert set(weight_map(tiny)) == want


def test_shapes_and_dtypes_are_the_releases(tiny):
    import torch

    t = read_tensors(tiny)
    h, hd, heads, sq, e, inter = 256, 256, 4, 128, 8, 128
    pre = "model.layers.1"
    assert t[f"{pre}.self_attn.q_proj.weight"].shape == (sq, h)  # the shared low-rank query
    assert t[f"{pre}.self_attn.inter_norm.weight"].shape == (sq,)
    assert t[f"{pre}.self_attn.wq.weight"].shape == (heads * hd, sq)
    assert t[f"{pre}.self_attn.k_proj.weight"].shape == t[f"{pre}.self_attn.v_proj.weight"].shape == (hd, h)  # 1 KV
    assert t[f"{pre}.self_attn.o_proj.weight"].shape == (h, heads * hd)
    assert t[f"{pre}.moe.gate.weight"].shape == (e, h)
    # the routed experts as 3-D banks [E, out, in]
    assert t[f"{pre}.moe.gate_proj.weight"].shape == t[f"{pre}.moe.up_proj.weight"].shape == (e, inter, h)
    assert t[f"{pre}.moe.down_proj.weight"].shape == (e, h, inter)
    assert t[f"{pre}.share_expert.down_proj.weight"].shape == (h, 128)
    assert t["model.layers.0.mlp.gate_proj.weight"].shape == (512, h)
    assert {v.dtype for v in t.values()} == {torch.bfloat16}


def test_config_holds_every_key_the_engine_reads_without_a_default(tiny):
    """Each ``config.X`` vLLM's step3_text.py reads directly (no getattr default, no hasattr guard) is in
    config.json."""
    path = engine_file_or_skip("vllm", "model_executor/models/step3_text.py")
    cfg = json.loads((tiny / "config.json").read_text())
    read = config_keys_read(path.read_text())
    # not config.json keys: what vLLM's Step3TextConfig derives (rope_parameters from rope_theta / rope_scaling) and
    # PretrainedConfig gives every config (tie_word_embeddings; the model's lm_head is its own tensor either way)
    derived = {"rope_parameters", "tie_word_embeddings"}
    assert {"moe_num_experts", "share_q_dim", "hidden_size"} <= read  # the reading found the file's keys
    missing = sorted(k for k in read - derived if k not in cfg)
    assert missing == []


def test_the_shipped_table_writes_the_routed_experts_as_stacked_banks(tiny):
    """``plan`` finds the shipped derived table (and its overlay) for the architecture: each routed-expert bank is one
    3-D NVFP4 module (codes [E, N, K/2], block scales [E, N, K/16], one global scale per expert, no input scale:
    vLLM's loader has no name for one), gate and up share expert e's global scale (the w13 scale group); q/k/v are
    kept, their exclude entries also in vLLM's spelling of the prefix it asks (``.layers.N.self_attn.qkv_proj``: the
    model is built under ``prefix=""``)."""
    r = run("plan", tiny, "--json")
    assert r.code == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["mapping"]["file"] == "mappings/derived/step3_text.toml"
    mods = {m["name"]: m for m in plan["modules"]}
    e, h, inter = 8, 256, 128
    for leaf, (n, k) in {"gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}.items():
        m = mods[f"model.layers.1.moe.{leaf}"]
        assert m["kind"] == "nvfp4" and m["experts"] == e
        assert {t["name"].rpartition(".")[2]: (t["dtype"], t["shape"]) for t in m["tensors"]} == {
            "weight": ("U8", [e, n, k // 2]), "weight_scale": ("F8_E4M3", [e, n, k // 16]),
            "weight_scale_2": ("F32", [e])}
    shared = {leaf: mods[f"model.layers.1.moe.{leaf}"]["quantization"]["shared_scale"]
              for leaf in ("gate_proj", "up_proj", "down_proj")}
    assert shared == {"gate_proj": "model.layers.1.moe.w13", "up_proj": "model.layers.1.moe.w13", "down_proj": None}
    assert {mods[f"model.layers.{i}.self_attn.{p}_proj"]["kind"] for i in range(3) for p in "qkv"} == {"keep"}
    for n in ("o_proj", "wq"):
        assert mods[f"model.layers.1.self_attn.{n}"]["kind"] == "nvfp4"
    assert mods["model.layers.1.moe.gate"]["kind"] == "keep"  # GateLinear: built unquantized
    exclude = set(plan["exclude_modules"])
    for i in range(3):
        assert {f".layers.{i}.self_attn.qkv_proj", *(f"model.layers.{i}.self_attn.{p}_proj" for p in "qkv")} <= exclude
    assert not any("moe.experts" in x or (".moe." in x and "_proj" in x) for x in exclude)  # the banks are quantized


def test_a_packed_bank_holds_one_global_scale_per_expert_shared_by_gate_and_up(tiny, tmp_path):
    """The packed banks: gate's and up's ``weight_scale_2`` are equal, expert by expert, and are each expert's own
    (NVIDIA's rule: max(amax(gate_e), amax(up_e)) / (6 * 448)); down's is its own expert's amax; the codes and block
    scales are 3-D, one [N, K] slice per expert."""
    import torch

    out = tmp_path / "out"
    r = run("pack", tiny, out, "--device", "cpu", "-q")
    assert r.code == 0, r.stderr
    src, t = read_tensors(tiny), read_tensors(out)
    pre = "model.layers.1.moe"
    gate, up = t[f"{pre}.gate_proj.weight_scale_2"], t[f"{pre}.up_proj.weight_scale_2"]
    assert gate.shape == (8,) and torch.equal(gate, up)
    amax = lambda w: w.float().abs().amax(dim=(1, 2))  # noqa: E731
    want = torch.maximum(amax(src[f"{pre}.gate_proj.weight"]), amax(src[f"{pre}.up_proj.weight"])) / (6 * 448)
    assert torch.allclose(gate, want, rtol=1e-6) and len(set(gate.tolist())) == 8
    assert torch.allclose(t[f"{pre}.down_proj.weight_scale_2"], amax(src[f"{pre}.down_proj.weight"]) / (6 * 448),
                          rtol=1e-6)
    assert t[f"{pre}.down_proj.weight"].shape == (8, 256, 64) and t[f"{pre}.down_proj.weight"].dtype == torch.uint8
    assert not any(n.endswith("input_scale") for n in t)
    assert t["model.layers.1.self_attn.q_proj.weight"].dtype == torch.bfloat16


def test_the_shipped_tables_moe_section_holds_the_config_against_the_banks(tiny, tmp_path):
    """The derived ``[moe]`` (``moe_list = "moe_layers_enum"``, members the three banks): a config that calls a layer
    MoE where no bank is stored is refused before any work, naming the layer."""
    from helpers import edit_config, one_line_error

    src = tmp_path / "src"
    shutil.copytree(tiny, src)
    edit_config(src, lambda c: c.update(moe_layers_enum="1,2"))
    err = one_line_error(run("plan", src))
    assert "layer 2" in err and "holds no routed experts" in err
