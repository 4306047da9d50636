"""Mistral Large 3 in Mistral's own layout, without an engine: the tiny preset is laid out as the release
(params.json, consolidated-*.safetensors and their index, Mistral's names), the tool reads params.json as the
DeepSeek V3 config the engines make of it, the table derived from the engines (mappings/derived/mistral_large_3.toml,
no hand table) in Mistral's names is deepseek_v3.toml through the engines' renames, the output keeps the layout, and
bad input is one line.

The expected values are written here by hand from the engines' source (vLLM 0.33
transformers_utils/configs/mistral.py ``_remap_general_mistral_args`` / ``_remap_moe_args``, models/mistral_large_3.py
``hf_to_vllm_mapper``; docs/families.md, "Mistral Large 3"), not produced by the code under test.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import copy_ckpt, edit_json, one_line_error, run, write_synth
from kimi_convert.mistral_checkpoint import build_keys

PRESET = "tiny-mistral-large-3"
ROOT = Path(__file__).resolve().parent.parent
INDEX = "consolidated.safetensors.index.json"

# vLLM 0.33 models/mistral_large_3.py MistralLarge3ForCausalLM.hf_to_vllm_mapper, copied by hand (the module
# names only: the engines' regexes add the trailing parameter name).
VLLM_RENAMES = [
    (r"layers\.(\d+)\.attention_norm", r"model.layers.\1.input_layernorm"),
    (r"layers\.(\d+)\.attention\.wq_a", r"model.layers.\1.self_attn.q_a_proj"),
    (r"layers\.(\d+)\.attention\.q_a_norm", r"model.layers.\1.self_attn.q_a_layernorm"),
    (r"layers\.(\d+)\.attention\.wq_b", r"model.layers.\1.self_attn.q_b_proj"),
    (r"layers\.(\d+)\.attention\.wkv_a_with_mqa", r"model.layers.\1.self_attn.kv_a_proj_with_mqa"),
    (r"layers\.(\d+)\.attention\.kv_a_norm", r"model.layers.\1.self_attn.kv_a_layernorm"),
    (r"layers\.(\d+)\.attention\.wkv_b", r"model.layers.\1.self_attn.kv_b_proj"),
    (r"layers\.(\d+)\.attention\.wo", r"model.layers.\1.self_attn.o_proj"),
    (r"layers\.(\d+)\.ffn_norm", r"model.layers.\1.post_attention_layernorm"),
    (r"layers\.(\d+)\.feed_forward\.w1", r"model.layers.\1.mlp.gate_proj"),
    (r"layers\.(\d+)\.feed_forward\.w2", r"model.layers.\1.mlp.down_proj"),
    (r"layers\.(\d+)\.feed_forward\.w3", r"model.layers.\1.mlp.up_proj"),
    (r"layers\.(\d+)\.gate", r"model.layers.\1.mlp.gate"),
    (r"layers\.(\d+)\.shared_experts\.w1", r"model.layers.\1.mlp.shared_experts.gate_proj"),
    (r"layers\.(\d+)\.shared_experts\.w2", r"model.layers.\1.mlp.shared_experts.down_proj"),
    (r"layers\.(\d+)\.shared_experts\.w3", r"model.layers.\1.mlp.shared_experts.up_proj"),
    (r"layers\.(\d+)\.experts\.(\d+)\.w1", r"model.layers.\1.mlp.experts.\2.gate_proj"),
    (r"layers\.(\d+)\.experts\.(\d+)\.w2", r"model.layers.\1.mlp.experts.\2.down_proj"),
    (r"layers\.(\d+)\.experts\.(\d+)\.w3", r"model.layers.\1.mlp.experts.\2.up_proj"),
    (r"norm", "model.norm"),
    (r"tok_embeddings", "model.embed_tokens"),
    (r"output", "lm_head"),
]


def vllm_name(module: str) -> str:
    for pat, new in VLLM_RENAMES:
        if re.fullmatch(pat, module):
            return re.sub(pat, new, module)
    raise AssertionError(f"vLLM's mapper has no rule for {module}")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_synth(PRESET, tmp_path_factory.mktemp("ml3") / "tiny-mistral-large-3")


def test_laid_out_as_the_release(ckpt):
    files = sorted(p.name for p in ckpt.iterdir())
    assert files == ["consolidated-00001-of-00003.safetensors", "consolidated-00002-of-00003.safetensors",
                     "consolidated-00003-of-00003.safetensors", INDEX, "params.json"]
    params = json.loads((ckpt / "params.json").read_text())
    assert params["moe"]["num_shared_experts"] == 1 and set(params["llama_4_scaling"]) == {
        "original_max_position_embeddings", "beta"}
    names = set(json.loads((ckpt / INDEX).read_text())["weight_map"])
    assert {"tok_embeddings.weight", "norm.weight", "output.weight", "layers.0.feed_forward.w1.weight",
            "layers.1.gate.weight", "layers.1.shared_experts.w3.weight", "layers.1.experts.7.w2.weight",
            "layers.1.attention.wkv_a_with_mqa.weight"} <= names
    # every name is one vLLM's mapper renames (SGLang's remapping drops any other with "Unrecognized weight")
    assert all(vllm_name(n.rsplit(".", 1)[0]) for n in names)


def test_params_read_as_the_engines_deepseek_v3_config(ckpt):
    from kimi_convert.checkpoint import open_checkpoint

    cfg = open_checkpoint(ckpt).config
    want = {"model_type": "deepseek_v3", "architectures": ["MistralLarge3ForCausalLM"], "hidden_size": 256,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 256,
            "rms_norm_eps": 1e-06, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
            "n_shared_experts": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1, "routed_scaling_factor": 1.0,
            "n_group": 1, "topk_group": 1, "tie_word_embeddings": False, "q_lora_rank": 128, "kv_lora_rank": 128,
            "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "vocab_size": 1000}
    assert {k: cfg.get(k) for k in want} == want
    assert "moe" not in cfg and "dim" not in cfg


def _table(ckpt):
    from kimi_convert.checkpoint import open_checkpoint
    from kimi_convert.derive.lookup import mapping_for

    return mapping_for(open_checkpoint(ckpt))


def test_the_table_is_the_derived_one_not_deepseek_v3s(ckpt):
    """params.json reads as model_type deepseek_v3, whose hand table names other tensors: the architecture's derived
    table comes first (the engines dispatch on the architecture), and it claims no model_type."""
    m = _table(ckpt)
    assert (m.name, m.path, m.model_types) == ("derived-mistral_large_3", "mappings/derived/mistral_large_3.toml", ())


def test_table_is_deepseek_v3_through_the_engines_renames(ckpt):
    """Each group, scale group and the MoE members of the derived Mistral table, renamed as vLLM renames them, are
    deepseek_v3.toml's; what it keeps (router, head) is what deepseek_v3.toml excludes."""
    from kimi_convert.mapping import builtin_by_name

    ml3, ds = _table(ckpt), builtin_by_name("deepseek_v3")

    def groups(m, rename):
        return {(g.name, tuple(rename(p.format(layer=3, expert=5) + "." + x) for x in g.members for p in g.parents))
                for g in m.groups}

    assert groups(ml3, vllm_name) == groups(ds, lambda x: x)
    assert sorted(vllm_name(r.text.replace("*", "3")) for r in (*ml3.keep, *ml3.exclude)) == sorted(
        r.text.replace("*", "3") for r in ds.exclude)
    member = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    assert sorted(member[x] for x in ml3.moe.members) == sorted(ds.moe.members)
    assert ml3.lm_head.module == "output" and ml3.lm_head.tie == "tie_word_embeddings"


def test_the_derived_engine_names_are_vllms_mapper_for_every_module_an_exclude_list_names(ckpt):
    """The derivation's [engine_names] (from vLLM's mapper, as the runner saw it rename each weight and not the
    module's own name) give the hand-copied mapper's name for every module with a 2-D weight, and each expert set."""
    m = _table(ckpt)
    shapes = json.loads((ROOT / "tests" / "derived" / f"{PRESET}.answers.json").read_text())["shapes"]
    modules = sorted(n.removesuffix(".weight") for n, s in shapes.items() if len(s) == 2)
    assert modules and all(m.engine_spellings(x) == [vllm_name(x)] for x in modules)
    assert m.engine_spellings("layers.1.experts") == ["model.layers.1.mlp.experts"]
    assert m.engine_spellings("layers.1.ffn_norm") == []  # a norm: no exclude list names it


def test_plan_pack_keep_the_layout(ckpt, tmp_path):
    out = tmp_path / "out-mistral-large-3"
    r = run("pack", ckpt, out)
    assert r.code == 0, r.stderr
    assert (out / "params.json").read_bytes() == (ckpt / "params.json").read_bytes()  # the engines read it
    assert not (out / INDEX).exists()  # the source's index is not copied over the new shards
    wm = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(wm.values()) == {f"consolidated-0000{i}-of-00003.safetensors" for i in (1, 2, 3)}
    assert "layers.1.experts.0.w1.weight_packed" not in wm and "layers.1.experts.0.w1.weight_scale_2" in wm
    assert wm["layers.1.gate.weight"] and wm["output.weight"]  # kept: router and head
    hq = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    # the kept modules in both spellings: the engines match the list against their own names
    assert hq["quant_algo"] == "W4A16_NVFP4" and hq["exclude_modules"] == [
        "layers.1.gate", "lm_head", "model.layers.1.mlp.gate", "output"]


def test_index_is_optional(ckpt, tmp_path):
    src = copy_ckpt(ckpt, tmp_path / "noindex")
    (src / INDEX).unlink()
    a, b = run("plan", ckpt, "--json"), run("plan", src, "--json")
    assert a.code == b.code == 0, (a.stderr, b.stderr)
    assert json.loads(a.stdout)["modules"] == json.loads(b.stdout)["modules"]


def test_inspect(ckpt):
    r = run("inspect", ckpt, "--json")
    assert r.code == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["architecture"] == "MistralLarge3ForCausalLM" and info["num_experts"] == 8
    assert info["moe_intermediate_size"] == 128 and info["hidden_size"] == 256 and info["top_k"] == 2
    assert info["tensor_experts"] == 8 and info["tensor_expert_shape"] == [128, 256]


@pytest.mark.parametrize(("edit", "says"), [
    (lambda p: p.pop("dim"), "params.json: dim is missing"),
    (lambda p: p["moe"].pop("expert_hidden_dim"), "params.json: moe.expert_hidden_dim is missing"),
    (lambda p: p["moe"].update(num_experts="8"), "params.json: moe.num_experts is '8'"),
    (lambda p: p.pop("moe"), "params.json: moe is missing"),
    (lambda p: p.pop("llama_4_scaling"), "params.json: llama_4_scaling needs"),
    (lambda p: p.update(quantization={"qformat_weight": "fp8_e4m3"}), "params.json: quantization"),
    (lambda p: p.update(vision_encoder={"hidden_size": 8}), "params.json: a vision encoder"),
])
def test_bad_params_one_line(ckpt, tmp_path, edit, says):
    src = copy_ckpt(ckpt, tmp_path / "bad")
    edit_json(src / "params.json", edit)
    before = sorted(p.name for p in src.iterdir())
    err = one_line_error(run("pack", src, tmp_path / "out"))
    assert says in err, err
    assert sorted(p.name for p in src.iterdir()) == before and not (tmp_path / "out").exists()


def test_missing_shard_one_line(ckpt, tmp_path):
    src = copy_ckpt(ckpt, tmp_path / "bad")
    (src / "consolidated-00002-of-00003.safetensors").unlink()
    err = one_line_error(run("plan", src))
    assert "consolidated-00002-of-00003.safetensors" in err, err
    (src / INDEX).unlink()
    for f in src.glob("consolidated-*.safetensors"):
        f.unlink()
    err = one_line_error(run("plan", src))
    assert "no consolidated*.safetensors files" in err, err


ADAPT = {  # each engine's own adaptation of params.json, run in its own python: the keys of the DeepSeek V3 view
    "vllm": "from vllm.transformers_utils.configs.mistral import adapt_config_dict as a\n"
            "d = json.load(open(sys.argv[1])); a(d, {})",
    "sglang": "from sglang.srt.utils.hf_transformers.mistral_utils import adapt_config_dict as a\n"
              "d, _ = a(json.load(open(sys.argv[1])), sys.argv[1])",
}


@pytest.mark.engine
@pytest.mark.parametrize("engine", list(ADAPT))
def test_view_is_the_engines_own_adaptation(ckpt, engine, tmp_path):
    """config_view agrees, key for key, with vLLM's / SGLang's adapt_config_dict on the preset's params.json."""
    import subprocess

    from kimi_convert.checkpoint import open_checkpoint
    from kimi_convert.enginecheck import EngineUnavailable, find_python

    try:
        py = find_python(engine)
    except EngineUnavailable as e:
        pytest.skip(f"{engine} environment absent: {e}")
    code = f"import json, sys\n{ADAPT[engine]}\nprint(json.dumps(d, default=str))"
    r = subprocess.run([str(py), "-c", code, str(ckpt / "params.json")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    theirs = json.loads(r.stdout.strip().splitlines()[-1])
    ours = open_checkpoint(ckpt).config
    keys = ["model_type", "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "intermediate_size", "rms_norm_eps", "n_routed_experts", "num_experts_per_tok",
            "moe_intermediate_size", "n_shared_experts", "first_k_dense_replace", "moe_layer_freq",
            "routed_scaling_factor", "n_group", "topk_group", "tie_word_embeddings", "q_lora_rank", "kv_lora_rank",
            "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "vocab_size"]
    assert {k: ours.get(k) for k in keys} == {k: theirs.get(k) for k in keys}
    built = build_keys(ours)  # what mapping derive adds for the build
    assert built == {k: theirs[k] for k in built}


@pytest.mark.engine
def test_engine_names_are_vllms_mapper(ckpt):
    """The table's engine_names give, for every module of the preset, the name vLLM's own
    MistralLarge3ForCausalLM.hf_to_vllm_mapper gives its weight (run in vLLM's python)."""
    import subprocess

    from kimi_convert.enginecheck import EngineUnavailable, find_python

    try:
        py = find_python("vllm")
    except EngineUnavailable as e:
        pytest.skip(f"vllm environment absent: {e}")
    names = sorted(json.loads((ckpt / INDEX).read_text())["weight_map"])
    code = ("import json, sys\nfrom vllm.model_executor.models.mistral_large_3 import MistralLarge3ForCausalLM as M\n"
            "print(json.dumps({n: M.hf_to_vllm_mapper._map_name(n) for n in json.loads(sys.argv[1])}))")
    r = subprocess.run([str(py), "-c", code, json.dumps(names)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    theirs = json.loads(r.stdout.strip().splitlines()[-1])
    m = _table(ckpt)
    norms = {n for n in names if "norm" in n}  # layer norms: not modules an exclude list names
    ours = {n: f"{m.engine_spellings(n.rpartition('.')[0])[0]}.{n.rpartition('.')[2]}" for n in names if n not in norms}
    assert ours == {n: theirs[n] for n in ours}


@pytest.mark.engine
def test_the_runner_reports_the_renames_an_exclude_entry_cannot_follow(ckpt):
    """``vllm_runner.unmapped_renames`` in vLLM's python: for Mistral Large 3's class, every module of the preset
    whose weight vLLM's mapper renames (its suffix-anchored regexes leave a module name as written) maps to the
    hand-copied mapper's name, norms included (the table keeps only 2-D weights); a prefix mapper's renames
    (Qwen3.5's ``model.language_model.`` -> ``language_model.model.``) reach the module name, and a rename whose
    entry is found within the new name (``lm_head`` in ``language_model.lm_head``, vLLM's substring test) is none."""
    import subprocess

    from kimi_convert.enginecheck import EngineUnavailable, find_python

    try:
        py = find_python("vllm")
    except EngineUnavailable as e:
        pytest.skip(f"vllm environment absent: {e}")
    names = sorted(json.loads((ckpt / INDEX).read_text())["weight_map"])
    qwen = ["model.language_model.layers.0.mlp.gate.weight", "lm_head.weight", "model.visual.merger.linear_fc1.weight"]
    code = ("import json, sys\nsys.path.insert(0, sys.argv[1])\nfrom vllm_runner import unmapped_renames\n"
            "from vllm.model_executor.models.mistral_large_3 import MistralLarge3ForCausalLM as M\n"
            "from vllm.model_executor.models.qwen3_5 import Qwen3_5MoeForConditionalGeneration as Q\n"
            "a, b = json.loads(sys.argv[2]), json.loads(sys.argv[3])\n"
            "print(json.dumps([unmapped_renames(M, a), unmapped_renames(Q, b)]))")
    runners = ROOT / "convert" / "enginecheck"
    r = subprocess.run([str(py), "-c", code, str(runners), json.dumps(names), json.dumps(qwen)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    mistral, qwen_renames = json.loads(r.stdout.strip().splitlines()[-1])
    weights = [n.removesuffix(".weight") for n in names if n.endswith(".weight")]
    # every weight renamed, but "norm" -> "model.norm" (the entry "norm" is found within the new name)
    assert mistral == {m: vllm_name(m) for m in weights if m != "norm"}
    assert qwen_renames == {}
