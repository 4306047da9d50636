"""Preset spec files (docs/presets.md) and the one generator that reads them: the expression evaluator
refuses what is not data, a spec mistake is one line naming the file and the entry, the generator writes
the bytes the per-family ``synth_*`` modules wrote (hashes taken from that old code, not from this one),
and ``synth --help`` lists the built-in presets."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from synth_hashes import folder_hashes

from helpers import TEST_PRESETS, all_presets, one_line_error, read_tensors, run, spec, synth_preset, write_synth
from kimi_convert.synth import builtin_presets, config, load_preset, tensors
from kimi_convert.synth.expr import ExprError, parse

ROOT = Path(__file__).resolve().parents[1]


# --- the evaluator ---------------------------------------------------------------------------------------

VALUES = {"hidden_size": 384, "num_hidden_layers": 5, "linear_attn_config.num_heads": 2,
          "layer_types": ["linear_attention", "full_attention"], "q_lora_rank": None}


def _eval(text: str):
    def lookup(name):
        if name not in VALUES:
            raise ExprError(f"unknown key {name!r}")
        return VALUES[name]
    return parse(text)(lookup)


@pytest.mark.parametrize(("text", "want"), [
    ("hidden_size // 2 + linear_attn_config.num_heads * 3 - 1 % 4", 197),
    ("[i + 1 for i in range(num_hidden_layers) if (i + 1) % 4 == 0 or i == num_hidden_layers - 1]", [4, 5]),
    ("[i for i in range(2) if layer_types[i] == 'full_attention']", [1]),
    ("range(2, num_hidden_layers)", [2, 3, 4]),
    ("min(3, hidden_size) if not q_lora_rank else max(1, 2)", 3),
    ("len(layer_types) == 2 and 1 in [1, 2] and 3 not in range(3)", True),
    ("None", None), ("-hidden_size", -384),
])
def test_the_evaluator_computes_what_the_language_allows(text, want):
    assert _eval(text) == want


@pytest.mark.parametrize("text", [
    "__import__('os').system('true')", "open('/etc/passwd')", "eval('1')", "(lambda: 1)()", "2 ** 100",
    "hidden_size.__class__", "().__class__.__bases__", "[1, 2][0:1]", "{'a': 1}", "{1, 2}", "x := 1",
    "range(stop=3)", "'a' + 'b'", "f'{hidden_size}'", "[1] * 3", "1 << 40", "hidden_size if True",
    "_private", "[x for x, y in [(1, 2)]]", "(1, 2)", "b'x'",
])
def test_the_evaluator_refuses_anything_else(text):
    with pytest.raises(ExprError):
        _eval(text)


def test_the_evaluator_caps_what_a_spec_can_allocate():
    for text in ("1" + " + 1" * 100, "-" * 500 + "1", "not " * 300 + "1", "1" + "+1" * 5000):
        with pytest.raises(ExprError, match="nested deeper|longer than"):
            parse(text)
    with pytest.raises(ExprError, match="range of"):
        _eval("range(100000000)")
    with pytest.raises(ExprError, match="more than"):
        _eval("[i for i in range(1048576) for j in range(2)]")


# --- spec mistakes: one line naming the file and the entry, exit 2, nothing written -----------------------


def _bad_spec(tmp_path: Path, old: str, new: str, count: int = 1) -> Path:
    text = (ROOT / "presets" / "kimi_k3.toml").read_text()
    assert old in text, old
    path = tmp_path / "bad.toml"
    path.write_text(text.replace(old, new, count))
    return path


@pytest.mark.parametrize(("old", "new", "says"), [
    ('shape = ["kda_width", "hidden_size"] },', 'shape = ["kda_widht", "hidden_size"] },',
     "blocks[1].tensors[2].tensors[0] ({pre}.self_attn.q_proj.weight): shape: 'kda_widht': unknown key 'kda_widht'"),
    ('kda = "[i - 1 for', 'kda = "__import__(1) or [i - 1 for',
     "sets.kda: '__import__(1) or"),
    ("\nvocab_size = 1000\n", "\nvocab_sise = 1000\n",
     "presets.tiny-k3: config: unknown key 'vocab_sise' (not in the family's [config])"),
    ("\nhidden_size = 384\n", '\nhidden_size = "wide"\n',
     "(language_model.model.embed_tokens.weight): shape must be a list of integers, got [1000, 'wide']"),
    ('storage = "mxfp4-pack" },', 'storage = "mxfp5" },', "unknown storage 'mxfp5'"),
    ('{ name = "{pre}.input_layernorm.weight", shape = ["hidden_size"] },',
     '{ name = "{pre}.input_layernorm.weight", shape = ["hidden_size"], dtype = "bf16" },',
     "blocks[1].tensors[0] ({pre}.input_layernorm.weight): unknown key 'dtype'"),
    ('names = { pre = "language_model.model.layers.{layer}" }', 'names = { pre = "x.{layer.__class__}" }',
     "blocks[1]: names.pre: name field {layer.__class__}"),
    ('num_key_value_heads = "= num_attention_heads"', 'num_key_value_heads = "= num_key_value_heads"',
     "text_config.num_key_value_heads depends on itself"),
])
def test_a_spec_mistake_is_one_line_naming_the_file_and_the_entry(tmp_path, old, new, says):
    path = _bad_spec(tmp_path, old, new)
    r = run("synth", f"{path}:tiny-k3", tmp_path / "out")
    msg = one_line_error(r)
    assert r.code == 2 and msg.startswith(f"kimi-convert: error: {path}: ") and says in msg, msg
    assert not (tmp_path / "out").exists()


def test_a_spec_file_that_is_not_toml_or_names_no_known_preset(tmp_path):
    bad = tmp_path / "x.toml"
    bad.write_text("[config\n")
    assert "not a TOML preset spec" in one_line_error(run("synth", bad, tmp_path / "o"))
    r = run("synth", f"{ROOT / 'presets' / 'kimi_k3.toml'}:tiny-k9", tmp_path / "o")
    assert "no preset 'tiny-k9' (it holds tiny-k3, bench-k3, bench-k3-shards, k3-full-sparse)" in one_line_error(r)
    r = run("synth", ROOT / "presets" / "kimi_k3.toml", tmp_path / "o")
    assert "holds 4 presets" in one_line_error(r) and "name one as" in one_line_error(r)
    assert "unknown preset 'tiny-k9'" in one_line_error(run("synth", "tiny-k9", tmp_path / "o"))
    assert not (tmp_path / "o").exists()


# --- the bytes of the old per-family code ----------------------------------------------------------------

#: sha256 of json.dumps(scripts/synth_hashes.py folder_hashes(OUT), sort_keys=True), computed by that script
#: from the OLD code (convert/synth*.py at bb9cacd, before this generator), never from the code under test
OLD_CODE = {
    ("tiny-k3", ()): "ae499fad2bd2701b837979b6e8da09cb7ff14374ddfc3b04b42921738d37e4c7",
    ("tiny-k3", (("layers", 6), ("experts", 5), ("shards", 3), ("seed", 1))):
        "2792b84b655a3d82d8432af188f92014f36cf53b047be8c7126fa6c7ce6b0058",
    ("tiny-deepseek-fp8", ()): "851bf30e69b21c79dcd4958a36d8e8e0638de0b84e498f0f04534a13b4e516f0",
    ("tiny-gpt-oss", ()): "13058a4add0fe633122736b747db0028952ba84d5ce443b5c58cbe2f6f05ef3a",
    ("tiny-qwen3-5-moe", ()): "ffdc059fcd91de70ac805960d0d1a4802fd52ab66a43c878fc6b346d7b9e0faa",
    ("tiny-kimi-k2", ()): "47a80d6b13282d7b5234079c306a9643ff2712bc392061a73ecf1a8393a7f717",
    ("k3-full-sparse", (("layers", 5), ("experts", 16))):
        "629701a07d29d25c234fa05b49a3e427efffb742385a1fa1ecd50d3d43502902",
}


#: the commit whose synth code OLD_CODE was computed from
OLD_COMMIT = "bb9cacd"


def _old_codes_hashes(tmp_path: Path, name: str, over: tuple) -> dict[str, str] | None:
    """``folder_hashes`` of what OLD_COMMIT's own code writes for the case, run here (a subprocess with that
    commit's package first on its path: tests/test_same_bytes.py ``_old_package``); None without git history."""
    from test_same_bytes import _old_package

    old = _old_package(tmp_path / "old", OLD_COMMIT)
    if old is None:
        return None
    code = ("import json, sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); "
            "from synth_hashes import folder_hashes, write; out = Path(sys.argv[2]); "
            "write(sys.argv[3], out, json.loads(sys.argv[4])); print(json.dumps(folder_hashes(out)))")
    r = subprocess.run([sys.executable, "-c", code, str(ROOT / "scripts"), str(tmp_path / "old-out"), name,
                        json.dumps(dict(over))], env={**os.environ, "PYTHONPATH": str(old)}, cwd=old,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize(("name", "over"), list(OLD_CODE), ids=lambda v: v if isinstance(v, str) else "")
def test_the_generator_writes_the_old_codes_bytes(tmp_path, name, over):
    """The generator writes what OLD_COMMIT's code wrote. OLD_CODE holds that code's hashes as computed on the
    machine of the time; another CPU's arithmetic can differ in the last bits of a weight (torch's float ops take
    MKL's and SLEEF's per-CPU paths), so where the frozen hash differs, the old code itself is run here and is the
    reference."""
    out = write_synth(name, tmp_path / "out", **dict(over))
    hashes = folder_hashes(out)
    got = hashlib.sha256(json.dumps(hashes, sort_keys=True).encode()).hexdigest()
    if got == OLD_CODE[name, over]:
        return
    old = _old_codes_hashes(tmp_path, name, over)
    assert old is not None, f"differs from OLD_CODE and no git history to run {OLD_COMMIT}'s code: " + json.dumps(
        hashes, indent=1)
    assert hashes == old


# --- what ships, what the tests keep -----------------------------------------------------------------------


def test_synth_help_lists_the_built_in_presets():
    r = run("synth", "--help")
    assert r.code == 0
    for name in builtin_presets():
        assert name in r.stdout, name
    assert {"tiny-k3", "tiny-qwen3-moe", "bench-k3-shards", "k3-full-sparse"} <= set(builtin_presets())
    assert "tiny-deepseek-fp8" not in r.stdout and "tiny-deepseek-fp8" not in builtin_presets()


def test_the_tests_presets_live_with_the_tests():
    """The installed package holds no fixture only the tests use (tiny-deepseek-fp8); each resolves to its
    spec file under tests/presets/."""
    names = all_presets()
    assert len(names) == len(set(names)) >= 20 and "tiny-deepseek-fp8" in names
    for name in set(names) - set(builtin_presets()):
        assert spec(name).startswith(f"{TEST_PRESETS}/"), name


@pytest.mark.parametrize("name", all_presets())
def test_every_preset_resolves(name):
    """Every preset's config and tensor list evaluate (k3-full-sparse with 16 of its experts)."""
    p = synth_preset(name, experts=16) if name == "k3-full-sparse" else synth_preset(name)
    cfg = config(p)
    if p.family.config_file == "params.json":  # Mistral's own layout: the config the engines make of it
        from kimi_convert.mistral_checkpoint import config_view

        cfg = config_view(cfg)
    assert cfg["architectures"] and len(list(tensors(p))) > 20
    assert load_preset(spec(name)).description


def test_overrides_change_what_derives_from_them():
    cfg = config(synth_preset("tiny-k3", layers=9))["text_config"]
    assert cfg["num_hidden_layers"] == 9 and cfg["linear_attn_config"]["full_attn_layers"] == [4, 8, 9]
    q35 = config(synth_preset("tiny-qwen3-5-moe", layers=8, experts=3))["text_config"]
    assert q35["layer_types"].count("full_attention") == 2 and q35["num_experts"] == 3


NEW_FAMILY = """
[family]
layers = "num_hidden_layers"
experts = "n_routed_experts"

[config]
architectures = ["ToyMoeForCausalLM"]
hidden_size = 256
num_hidden_layers = 2
n_routed_experts = 3
moe_intermediate_size = 64
layer_types = "= ['dense' if i == 0 else 'moe' for i in range(num_hidden_layers)]"
rope_scaling = "= None"

[sets]
moe = "[i for i in range(num_hidden_layers) if layer_types[i] == 'moe']"

[let]
mtp = "layer - num_hidden_layers"

[[blocks]]
loop = "range(num_hidden_layers)"
names = { pre = "model.layers.{layer}" }
tensors = [
  { name = "{pre}.attn.wq.weight", shape = ["hidden_size", "hidden_size"], storage = "fp8-block" },
  { name = "{pre}.attn.wo.weight", shape = ["hidden_size", 384], storage = "fp8-block", \
stored = ["{base}.weight", "{base}.scale"], scale_dtype = "e8m0" },
  { layers = "moe", tensors = [
    { name = "{pre}.ffn.gate.bias", shape = ["n_routed_experts"], storage = "f32" },
    { name = "{pre}.ffn.gate.tid2eid", shape = [64, "n_routed_experts"], storage = "expert-ids" },
    { experts = "n_routed_experts", tensors = [
      { name = "{pre}.ffn.experts.{expert}.w1.weight", shape = ["moe_intermediate_size", "hidden_size"], \
storage = "mxfp4-pack", stored = ["{base}.weight", "{base}.scale"], scale_dtype = "e8m0", code_dtype = "i8" },
    ] },
    { name = "{pre}.ffn.bank", shape = ["n_routed_experts", 64, "hidden_size"], storage = "mxfp4-bank" },
  ] },
]

[[blocks]]
loop = "range(num_hidden_layers, num_hidden_layers + 1)"
names = { pre = "mtp.{mtp}" }
tensors = [{ name = "{pre}.norm.weight", shape = ["hidden_size"], when = "layer == num_hidden_layers" }]

[files]
"generation_config.json" = "{}"

[presets.toy]
description = "a family no code knows"
shards = 2
"""


def test_a_new_family_is_a_spec_file(tmp_path):
    """A family the package has never seen, written here as data: names (a block's named by a ``let`` over its loop),
    storages, renamed MXFP4 parts with I8 codes and F8_E8M0 scales, FP8 with power-of-two E8M0 tile scales, a
    hash-routing table, the config with its derived keys and the side files come out as the spec says."""
    path = tmp_path / "toy.toml"
    path.write_text(NEW_FAMILY)
    r = run("synth", path, tmp_path / "out", "--experts", "2")
    assert r.code == 0, r.stderr
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["layer_types"] == ["dense", "moe"] and cfg["rope_scaling"] is None and cfg["n_routed_experts"] == 2
    assert (tmp_path / "out" / "generation_config.json").read_text() == "{}"
    t = read_tensors(tmp_path / "out")
    assert sorted(t) == sorted([
        *(f"model.layers.{i}.attn.{p}" for i in range(2) for p in ("wq.weight", "wq.weight_scale_inv", "wo.weight",
                                                                    "wo.scale")),
        "model.layers.1.ffn.gate.bias", "model.layers.1.ffn.gate.tid2eid",
        *(f"model.layers.1.ffn.experts.{e}.w1.{p}" for e in range(2) for p in ("weight", "scale")),
        "model.layers.1.ffn.bank_blocks", "model.layers.1.ffn.bank_scales", "mtp.0.norm.weight"])
    assert str(t["model.layers.1.ffn.experts.0.w1.scale"].dtype) == "torch.float8_e8m0fnu"
    assert str(t["model.layers.1.ffn.experts.0.w1.weight"].dtype) == "torch.int8"
    assert tuple(t["model.layers.1.ffn.experts.0.w1.weight"].shape) == (64, 128)
    ids = t["model.layers.1.ffn.gate.tid2eid"]  # two experts (--experts 2): each row both, in some order
    assert str(ids.dtype) == "torch.int64" and ids.sort(-1).values.tolist() == [[0, 1]] * 64
    assert len({tuple(r) for r in ids.tolist()}) == 2
    w, s = t["model.layers.0.attn.wo.weight"], t["model.layers.0.attn.wo.scale"]
    assert str(s.dtype) == "torch.float8_e8m0fnu" and tuple(s.shape) == (2, 3)
    tiles = w.float().abs().view(2, 128, 3, 128).amax(dim=(1, 3))  # the smallest power of two holding amax/448
    assert bool(((tiles >= 224) & (tiles <= 448)).all()), tiles  # (e4m3 may round amax/scale down to 224)
    assert tuple(t["model.layers.1.ffn.bank_blocks"].shape) == (2, 64, 8, 16)
    assert str(t["model.layers.0.attn.wq.weight"].dtype) == "torch.float8_e4m3fn"


@pytest.mark.parametrize(("old", "new", "says"), [
    ('code_dtype = "i8" }', 'code_dtype = "i4" }', "code_dtype: 'i4': u8 or i8, for the mxfp4-pack storage"),
    ('storage = "fp8-block" },', 'storage = "fp8-block", code_dtype = "i8" },', "code_dtype: 'i8': u8 or i8, for the"),
    ('shape = [64, "n_routed_experts"]', 'shape = [64, "n_routed_experts + 1"]',
     "({pre}.ffn.gate.tid2eid): expert-ids takes [rows, k], k distinct experts of 2, got [64, 3]"),
])
def test_a_storage_option_misused_is_one_line(tmp_path, old, new, says):
    """I8 codes only where the storage packs MXFP4 codes; an expert-ids row cannot hold more distinct experts than
    the family has: one line naming the file and the entry, exit 2, nothing written."""
    assert old in NEW_FAMILY
    path = tmp_path / "toy.toml"
    path.write_text(NEW_FAMILY.replace(old, new, 1))
    r = run("synth", path, tmp_path / "out", "--experts", "2")
    msg = one_line_error(r)
    assert r.code == 2 and msg.startswith(f"kimi-convert: error: {path}: ") and says in msg, msg
    assert not (tmp_path / "out").exists()


def test_a_spec_on_a_built_in_family_holds_only_its_presets(tmp_path):
    """base = "FAMILY": the built-in family's layout with this file's sizes; a layout table next to it is
    refused (one source for a family's layout)."""
    path = tmp_path / "mine.toml"
    path.write_text('base = "qwen3_moe"\n\n[presets.mine]\ndescription = "mine"\nshards = 1\n'
                    "[presets.mine.config]\nhidden_size = 128\nnum_experts = 2\nmoe_intermediate_size = 64\n")
    p = load_preset(str(path))
    cfg = config(p)
    assert (cfg["hidden_size"], cfg["num_experts"], cfg["max_window_layers"]) == (128, 2, cfg["num_hidden_layers"])
    assert config(p)["architectures"] == config(synth_preset("tiny-qwen3-moe"))["architectures"]
    path.write_text(path.read_text() + '\n[sets]\nx = "range(1)"\n')
    r = run("synth", path, tmp_path / "o")
    assert "a spec with base = ... holds only [presets.*], not 'sets'" in one_line_error(r)
