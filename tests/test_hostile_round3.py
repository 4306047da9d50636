"""Hostile inputs, round 3 (issue 41): a config that contradicts the tensors, user tables and recipes that break
the schema, values no engine can use.

Each case is built here from a tiny preset and run through ``plan`` and ``pack`` as a real process with a
timeout: one line naming the config field and the tensor or module (or the file and key), exit 2, no
traceback, no hang, no ``manifest.json``, the input unchanged.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from test_hostile_files import snapshot

from helpers import copy_ckpt, edit_config, one_line_error, rewrite_tensors, run, run_process, write_synth
from kimi_convert.mapping import builtin_mappings, parse_mapping
from kimi_convert.recipe import builtin_recipes


@pytest.fixture(scope="module")
def presets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("r3")
    return {p: write_synth(p, root / p) for p in ("tiny-k3", "tiny-kimi-linear", "tiny-qwen3-moe", "tiny-glm4-moe",
                                                    "tiny-deepseek-v3", "tiny-gpt-oss", "tiny-minimax-m2",
                                                    "tiny-qwen3-5-moe")}


def refused(ck: Path, tmp_path: Path, *args, commands=("plan", "pack")) -> str:
    """Run each command on ``ck``; every one a single line, exit 2, nothing finished-looking, the input as it
    was. The line of the last."""
    before = snapshot(ck)
    err = ""
    for command in commands:
        out = tmp_path / f"out-{command}"
        extra = [out, "--device", "cpu", "-q"] if command == "pack" else []
        err = one_line_error(run_process(command, ck, *extra, *args, timeout=120))
        assert not (out / "manifest.json").exists()
    assert snapshot(ck) == before
    return err


def _set(path: str, value):
    """A config edit: the dotted ``path`` (into text_config where the config nests one) set to ``value``."""
    def fn(c: dict) -> None:
        d = c.get("text_config", c)
        *head, last = path.split(".")
        for k in head:
            d = d[k]
        d[last] = value
    return fn


def _drop(*prefixes: str):
    def fn(tensors: dict) -> None:
        for k in [k for k in tensors if k.startswith(prefixes)]:
            del tensors[k]
    return fn


# (preset, config edit or None, tensor edit or None, what the line must name)
CONTRADICTIONS = {
    "more experts announced": ("tiny-kimi-linear", _set("num_experts", 10), None,
                               ["num_experts is 10", "model.layers.1.block_sparse_moe.experts.8 is missing"]),
    "fewer experts announced": ("tiny-k3", _set("num_experts", 6), None,
                                ["text_config.num_experts is 6", "language_model.model.layers.1.block_sparse_moe"
                                 ".experts.6 exists"]),
    "one expert of one layer missing": ("tiny-kimi-linear", None,
                                        _drop("model.layers.2.block_sparse_moe.experts.3."),
                                        ["num_experts is 8", "model.layers.2.block_sparse_moe.experts.3 is missing"]),
    "one expert without its down projection": ("tiny-qwen3-moe", None,
                                               _drop("model.layers.1.mlp.experts.5.down_proj."),
                                               ["model.layers.1.mlp.experts.5.down_proj is missing", "num_experts"]),
    "first_k_dense_replace names a MoE layer": ("tiny-kimi-linear", _set("first_k_dense_replace", 2), None,
                                                ["first_k_dense_replace 2", "layer 1 dense",
                                                 "model.layers.1.block_sparse_moe.experts"]),
    "first_k_dense_replace on GLM": ("tiny-glm4-moe", _set("first_k_dense_replace", 2), None,
                                     ["first_k_dense_replace 2", "model.layers.1.mlp.experts"]),
    "mlp_only_layers names a MoE layer": ("tiny-qwen3-moe", _set("mlp_only_layers", [1]), None,
                                          ["mlp_only_layers [1]", "model.layers.1.mlp.experts"]),
    "a MoE layer without experts": ("tiny-deepseek-v3", _set("first_k_dense_replace", 0), None,
                                    ["n_routed_experts 8 makes layer 0 a MoE layer", "model.layers.0"]),
    "untied embeddings with no lm_head": ("tiny-deepseek-v3", None, _drop("lm_head."),
                                          ["tie_word_embeddings is false", "lm_head.weight"]),
    "untied K3 with no lm_head": ("tiny-k3", None, _drop("language_model.lm_head."),
                                  ["tie_word_embeddings is false", "language_model.lm_head.weight"]),
    "kda_layers leaves out a KDA layer": ("tiny-kimi-linear", _set("linear_attn_config.kda_layers", [1, 2]), None,
                                          ["linear_attn_config.kda_layers leaves out layer 3",
                                           "model.layers.2.self_attn.q_conv1d"]),
    "kda_layers lists an MLA layer": ("tiny-kimi-linear", _set("linear_attn_config.kda_layers", [1, 2, 3, 4]), None,
                                      ["layer 4 is listed as both"]),
    "use_full_rank_gate the string false": ("tiny-k3", _set("linear_attn_config.use_full_rank_gate", "false"), None,
                                            ["use_full_rank_gate is the string 'false'", "expected true or false"]),
    "a bank of fewer experts than num_local_experts": ("tiny-gpt-oss", _set("num_local_experts", 8), None,
                                                       ["num_local_experts is 8", "model.layers.0.mlp.experts.4 is"]),
    "MiniMax experts count a string": ("tiny-minimax-m2", _set("num_local_experts", "8"), None,
                                       ["num_local_experts is the string '8'", "expected an integer"]),
    "Qwen3.5 one expert missing": ("tiny-qwen3-5-moe", None, _drop("model.language_model.layers.1.mlp.experts.7."),
                                   ["text_config.num_experts is 8",
                                    "model.language_model.layers.1.mlp.experts.7 is missing"]),
}


@pytest.mark.parametrize("case", list(CONTRADICTIONS))
def test_config_contradicting_tensors_is_refused(presets, tmp_path, case):
    preset, config_edit, tensor_edit, names = CONTRADICTIONS[case]
    ck = copy_ckpt(presets[preset], tmp_path / "c")
    if config_edit is not None:
        edit_config(ck, config_edit)
    if tensor_edit is not None:
        rewrite_tensors(ck, tensor_edit)
    err = refused(ck, tmp_path)
    for name in names:
        assert name in err, err


@pytest.mark.parametrize("preset", ["tiny-k3", "tiny-kimi-linear", "tiny-qwen3-moe", "tiny-glm4-moe",
                                    "tiny-deepseek-v3", "tiny-gpt-oss", "tiny-minimax-m2", "tiny-qwen3-5-moe"])
def test_every_preset_fits_its_config(presets, preset):
    """The check refuses nothing a release-shaped input holds (the cases above are not refused by default)."""
    r = run("plan", presets[preset])
    assert r.code == 0, r.stderr


def test_kda_layer_listed_as_nothing_names_both(presets, tmp_path):
    """KDA layer 3 listed in neither list: it would lose its shared global scale (its groups apply per layer
    type); the line names the field and the module."""
    ck = copy_ckpt(presets["tiny-k3"], tmp_path / "c")
    edit_config(ck, _set("linear_attn_config.kda_layers", [1, 2]))
    err = refused(ck, tmp_path, commands=("plan",))
    assert "text_config.linear_attn_config.kda_layers leaves out layer 3" in err, err
    assert "language_model.model.layers.2.self_attn.q_conv1d" in err and "no layer list names it" in err, err


# ---------------------------------------------------------------------------------------------------------
# User mapping tables and recipes: one reader, one schema (convert/tomlfile.py)

K3_TABLE = (Path(__file__).parent.parent / "mappings" / "kimi_k3.toml").read_text()
RECIPE = (Path(__file__).parent.parent / "recipes" / "nvfp4-w4a16.toml").read_text()


def _sub(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


# name -> (table text, what the line must name); each run as --mapping FILE on tiny-k3
TABLES = {
    "text_config an integer": (_sub(K3_TABLE, 'text_config = "text_config"', "text_config = 3"),
                               ["text_config: expected a string, got an integer 3"]),
    "a group's quantize a string": (_sub(K3_TABLE, "quantize = false", 'quantize = "no"'),
                                    ["quantize: expected true or false, got a string 'no'"]),
    "keep a string": (_sub(K3_TABLE, "[[keep]]", 'keep = "x"\n[[keepx]]'), ["unknown key(s) keepx"]),
    "layer_types base a string": (_sub(K3_TABLE, "base = 1", 'base = "1"'),
                                  ["layer_types.kda.base: expected an integer, got a string '1'"]),
    "an unknown placeholder": (_sub(K3_TABLE, 'expert_sets = ["model.layers.{layer}',
                                    'expert_sets = ["model.layers.{layr}'),
                               ["expert_sets: [0]: unknown placeholder {layr}"]),
    "a layout listing an unknown format": (_sub(K3_TABLE, 'formats = ["keep", "fp8-block"]',
                                                'formats = ["keep", "fp8_block"]'),
                                           ["layout.sglang.formats: [1]: unknown format 'fp8_block'"]),
    "a restrict's formats an integer": (_sub(K3_TABLE, "[[keep]]", "[[restrict]]\npattern = \"x\"\nformats = 4\n"
                                                                   "[[keep]]"),
                                        ["restrict[0].formats: expected a list of", "got an integer 4"]),
    "moe experts an integer": (_sub(K3_TABLE, 'experts = "num_experts"', "experts = 8"),
                               ["moe.experts: expected a string, got an integer 8"]),
    "a when value a table": (_sub(K3_TABLE, 'when = { "linear_attn_config.use_full_rank_gate" = true }',
                                  'when = { "linear_attn_config.use_full_rank_gate" = { x = 1 } }'),
                             ["when.linear_attn_config.use_full_rank_gate: expected a string, number or boolean"]),
    "rows naming a config key no config has": (_sub(K3_TABLE, 'rows = { q_a_proj = "q_lora_rank"',
                                                    'rows = { q_a_proj = "q_lora_rnk"'),
                                               ["config.json: q_lora_rnk is absent, expected an integer",
                                                "mapping kimi_k3"]),
}


@pytest.mark.parametrize("case", list(TABLES))
def test_bad_mapping_table_is_one_line(presets, tmp_path, case):
    text, names = TABLES[case]
    table = tmp_path / "t.toml"
    table.write_text(text)
    err = refused(presets["tiny-k3"], tmp_path, "--mapping", table)
    for name in names:
        assert name in err, err
    if not case.startswith("rows"):
        assert str(table) in err, err


def test_group_whose_members_exist_nowhere_fails_strict(presets, tmp_path):
    table = tmp_path / "t.toml"
    table.write_text(K3_TABLE + '\n[[group]]\nname = "typo"\nmembers = ["q_prj", "k_prj"]\n'
                                'parents = ["model.layers.{layer}.self_attn"]\n')
    assert run("plan", presets["tiny-k3"], "--mapping", table).code == 0  # a warning without --strict
    err = refused(presets["tiny-k3"], tmp_path, "--mapping", table, "--strict", commands=("plan",))
    assert "group typo: members q_prj, k_prj: none is a module of the input" in err, err


RECIPES = {
    "a rule's format an integer": (_sub(RECIPE, 'format = "keep"', "format = 4"),
                                   ["rule[0].format: expected one of nvfp4, fp8-block, keep, got an integer 4"]),
    "input_scale a string": (_sub(RECIPE, "input_scale = 1.0", 'input_scale = "1.0"'),
                             ["rule[1].input_scale: expected a positive number, got a string '1.0'"]),
    "input_scale past F32": (_sub(RECIPE, "input_scale = 1.0", "input_scale = 1e39"),
                             ["rule[1].input_scale: 1e+39 is outside the F32 range"]),
    "a reason an integer": (_sub(RECIPE, 'reason = "linear layer: NVFP4 weight-only"', "reason = 5"),
                            ["rule[2].reason: expected a string, got an integer 5"]),
    "aliases a string": (_sub(RECIPE, 'quant_algo = "W4A16_NVFP4"', 'quant_algo = "W4A16_NVFP4"\naliases = "yes"'),
                         ["aliases: expected true or false"]),
    "default_for an integer": (_sub(RECIPE, 'default_for = ["*"]', "default_for = 5"),
                               ["default_for: expected a list of strings, got an integer 5"]),
    "config a string": (_sub(RECIPE, 'default_for = ["*"]', 'default_for = ["*"]\nconfig = "x"'),
                        ["config: expected a table, got a string 'x'"]),
    "rule a table": (_sub(RECIPE.split("[[rule]]")[0], 'quant_algo = "W4A16_NVFP4"',
                          'quant_algo = "W4A16_NVFP4"\nrule = { format = "keep" }'),
                     ["rule: expected an array of tables ([[rule]]), got a table"]),
    "W4A4 without an input scale": (_sub(RECIPE, 'quant_algo = "W4A16_NVFP4"', 'quant_algo = "NVFP4"'),
                                    ["rule[2]: quant_algo 'NVFP4' quantizes activations too (W4A4)"]),
}


@pytest.mark.parametrize("case", list(RECIPES))
def test_bad_recipe_is_one_line(presets, tmp_path, case):
    text, names = RECIPES[case]
    recipe = tmp_path / "r.toml"
    recipe.write_text(text)
    err = refused(presets["tiny-kimi-linear"], tmp_path, "--recipe", recipe)
    assert str(recipe) in err, err
    for name in names:
        assert name in err, err


@pytest.mark.parametrize("flag", ["--mapping", "--recipe"])
def test_table_not_utf8_or_a_fifo(presets, tmp_path, flag):
    bad = tmp_path / "latin1.toml"
    bad.write_bytes('name = "caf\u00e9"\n'.encode("latin-1"))
    err = refused(presets["tiny-kimi-linear"], tmp_path, flag, bad, commands=("plan",))
    assert f"{bad}: not UTF-8 text" in err, err
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    err = refused(presets["tiny-kimi-linear"], tmp_path, flag, fifo)  # the timeout fails a hang
    assert f"{fifo}: is a FIFO" in err, err


def test_every_builtin_table_and_recipe_passes_the_schema():
    """The schema reads every shipped table unchanged (and the test above shows it refuses what it should)."""
    assert {m.name for m in builtin_mappings()} >= {"kimi_k3", "kimi_linear", "deepseek_v3", "qwen3_moe"}
    assert {r.name for r in builtin_recipes()} >= {"nvidia-k3", "nvfp4-w4a16", "ct-nvfp4-a16"}
    for m in builtin_mappings():
        assert parse_mapping(m.source, m.path).moe is not None, m.name


# ---------------------------------------------------------------------------------------------------------
# Values no engine can use

def _scale(name: str, value: float):
    def fn(tensors: dict) -> None:
        if name in tensors:
            t = tensors[name].clone()
            t[0, 0] = value
            tensors[name] = t
    return fn


def _add(name: str, value: torch.Tensor, beside: str):
    def fn(tensors: dict) -> None:
        if beside in tensors:
            tensors[name] = value
    return fn


def _to(name: str, dtype: torch.dtype):
    def fn(tensors: dict) -> None:
        if name in tensors:
            tensors[name] = tensors[name].to(dtype)
    return fn


O_PROJ = "model.layers.0.self_attn.o_proj"
# (preset, tensor edit, extra options, commands, what the line must name)
VALUES = {
    "NaN block scale of a kept FP8 weight": (
        "tiny-deepseek-v3", _scale(f"{O_PROJ}.weight_scale_inv", float("nan")), ["--exclude", O_PROJ], ("pack",),
        [f"{O_PROJ}.weight_scale_inv", "block scale [0, 0] is nan (not a number)", f"{O_PROJ}.weight cannot be"]),
    "Inf block scale of a quantized FP8 weight": (
        "tiny-deepseek-v3", _scale(f"{O_PROJ}.weight_scale_inv", float("inf")), [], ("pack",),
        [f"{O_PROJ}.weight_scale_inv", "block scale [0, 0] is inf"]),
    "a block scale that overflows fp32 when decoded": (
        "tiny-deepseek-v3", _scale(f"{O_PROJ}.weight_scale_inv", 3e38), [], ("pack",),
        [f"{O_PROJ}.weight_scale_inv", "is 3e+38 (past fp32 once times e4m3's 448)"]),
    "weight_scale_inv beside a BF16 weight": (
        "tiny-kimi-linear", _add(f"{O_PROJ}.weight_scale_inv", torch.ones(1, 1), f"{O_PROJ}.weight"), [],
        ("plan", "pack"), [f"{O_PROJ}.weight_scale_inv", "beside a BF16 weight"]),
    "an F8_E5M2 weight": (
        "tiny-kimi-linear", _to(f"{O_PROJ}.weight", torch.float8_e5m2), [], ("plan", "pack"),
        [f"{O_PROJ}.weight", "F8_E5M2 weight"]),
}


@pytest.mark.parametrize("case", list(VALUES))
def test_values_no_engine_can_use(presets, tmp_path, case):
    preset, edit, options, commands, names = VALUES[case]
    ck = copy_ckpt(presets[preset], tmp_path / "c")
    rewrite_tensors(ck, edit)
    err = refused(ck, tmp_path, *options, commands=commands)  # one line: no numpy RuntimeWarning before it
    for name in names:
        assert name in err, err


@pytest.mark.parametrize("options, names", [
    (["--input-scale", "1e39"], ["--input-scale", "outside the F32 range"]),
    (["--input-scale", "1e-39"], ["--input-scale", "outside the F32 range"]),
    (["--format", "compressed-tensors", "--input-scale", "2.0"],
     ["--input-scale 2", "in --format compressed-tensors is weight-only"]),
    (["--exclude", "*"], ["quantizes no module of the input", "--exclude *"]),
])
def test_options_no_engine_can_use(presets, tmp_path, options, names):
    err = refused(presets["tiny-kimi-linear"], tmp_path, *options)
    for name in names:
        assert name in err, err


def test_recipe_keeping_every_module_is_refused(presets, tmp_path):
    recipe = tmp_path / "all-keep.toml"
    recipe.write_text('name = "all-keep"\n[[rule]]\nmodules = ["*"]\nformat = "keep"\n')
    err = refused(presets["tiny-qwen3-moe"], tmp_path, "--recipe", recipe)
    assert f"recipe 'all-keep' ({recipe}) quantizes no module of the input" in err, err


# ---------------------------------------------------------------------------------------------------------
# --resume on a finished output: the same plan from the same inputs, or refused

def test_resume_of_a_finished_output_checks_plan_and_inputs(presets, tmp_path):
    ck = copy_ckpt(presets["tiny-qwen3-moe"], tmp_path / "c")
    out = tmp_path / "out"
    assert run("pack", ck, out, "--device", "cpu", "-q").code == 0
    finished = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    r = run("pack", ck, out, "--device", "cpu", "-q", "--resume")
    assert r.code == 0, r.stderr  # the same run: already complete

    err = one_line_error(run("pack", ck, out, "--device", "cpu", "-q", "--resume", "--recipe", "ct-nvfp4-a16"))
    assert "already finished, but by recipe 'nvfp4-w4a16', not 'ct-nvfp4-a16'" in err, err
    err = one_line_error(run("pack", ck, out, "--device", "cpu", "-q", "--resume", "--exclude", "lm_head",
                             "--exclude", "model.layers.0.self_attn.o_proj"))
    assert "already finished, but by another plan" in err, err

    name = "model.layers.1.self_attn.o_proj.weight"  # same header, other values: only the sha256 tells
    shard = json.loads((ck / "model.safetensors.index.json").read_text())["weight_map"][name]
    raw = bytearray((ck / shard).read_bytes())
    raw[-1] ^= 0x01
    (ck / shard).write_bytes(bytes(raw))
    err = one_line_error(run("pack", ck, out, "--device", "cpu", "-q", "--resume"))
    assert "already finished, but from another" in err and shard in err, err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == finished


# ---------------------------------------------------------------------------------------------------------
# Index paths: one normal form for pack and verify

def test_index_naming_shards_with_dot_slash_packs_and_verifies(presets, tmp_path):
    ck = copy_ckpt(presets["tiny-kimi-linear"], tmp_path / "c")
    index = ck / "model.safetensors.index.json"
    idx = json.loads(index.read_text())
    idx["weight_map"] = {k: (f"./{v}" if i % 2 else f".//{v}") for i, (k, v) in enumerate(idx["weight_map"].items())}
    index.write_text(json.dumps(idx))
    out = tmp_path / "out"
    assert run("plan", ck).code == 0
    r = run("pack", ck, out, "--device", "cpu", "-q")
    assert r.code == 0, r.stderr
    written = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert all(not v.startswith(".") and "/" not in v for v in written.values())
    r = run("verify-manifest", out, "--input", ck, "-q")
    assert r.code == 0, r.stdout + r.stderr
    reference = tmp_path / "ref"
    assert run("pack", presets["tiny-kimi-linear"], reference, "--device", "cpu", "-q").code == 0
    for name in ("model.safetensors.index.json", *sorted(p.name for p in reference.glob("*.safetensors"))):
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name


# ---------------------------------------------------------------------------------------------------------
# The first hour: the help texts

def test_help_names_every_family_and_synth_lists_every_user_preset():
    from kimi_convert.synth import builtin_presets

    top = run("--help").stdout
    for family in ("Kimi K3", "Kimi Linear", "DeepSeek V3", "Qwen3 MoE", "GLM-4.5", "MiniMax-M2", "gpt-oss"):
        assert family in top, top
    text = run("synth", "--help").stdout
    section = text.split("Presets:")[1].split("Options:")[0]
    listed = {line.split()[0] for line in section.splitlines() if line.startswith("  ") and line[2] != " "}
    assert listed == set(builtin_presets()) and "tiny-qwen3-moe" in listed
    assert "tiny-deepseek-fp8" not in text
    err = one_line_error(run("synth", "tiny-deepseek-fp8", "/nonexistent/x"))
    assert "unknown preset 'tiny-deepseek-fp8'" in err and "tiny-deepseek-v3" in err, err
