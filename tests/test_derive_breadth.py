"""The derived tables shipped for the engines' MoE architectures (``mappings/derived/``, issue 38 item 4).

Each was written by ``scripts/derive_breadth.py --ship`` from a fixture both registering engines loaded, and shipped
only once both read the output packed with it right; the engines' raw answers are kept in
``tests/derived/breadth/ARCH.answers.json``. Here, without the engines: the table rules give each shipped table from
its answers (a change to the rules that would change a shipped table fails here, naming it), ``plan`` / ``pack``
find the shipped table for the architecture with no engine environment, and the docs table is the one its JSONL
gives (it is generated, never edited).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from kimi_convert.derive import from_answers, load_answers
from kimi_convert.derive.lookup import shipped_for

ROOT = Path(__file__).resolve().parent.parent
ANSWERS = ROOT / "tests" / "derived" / "breadth"
#: the tables the breadth run shipped (the 2026 families' own, from their presets, are held by their family tests)
SHIPPED = sorted(p for p in (ROOT / "mappings" / "derived").glob("*.toml")
                 if (ANSWERS / f"{tomllib.loads(p.read_text())['architectures'][0]}.answers.json").is_file())


def _answers_for(table: dict) -> Path:
    (arch,) = table["architectures"]
    return ANSWERS / f"{arch}.answers.json"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_the_rules_give_the_shipped_table_from_the_engines_answers(path):
    text = path.read_text()
    answers = _answers_for(tomllib.loads(text))
    assert answers.is_file(), f"{path.name}: no recorded answers at {answers}"
    # the recorded answers as derive reads them: the drafts' too, and a table's name where it is not its model_type
    # (derive.TABLE_NAMES)
    assert from_answers(answers).text == text, f"{path.name}: the rules now give another table"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_plan_finds_the_shipped_table_without_engines(path, monkeypatch, tmp_path):
    monkeypatch.setenv("KIMI_CONVERT_ENGINE_ENVS", str(tmp_path / "none"))  # no engine environment
    table = tomllib.loads(path.read_text())
    _, config, _ = load_answers(_answers_for(table))
    found = shipped_for(config)
    assert found is not None and found.name == table["name"]


def test_every_shipped_table_has_its_architecture_verified_in_the_docs(monkeypatch):
    """Every engine that registers the architecture read the output right, but one the script names as not serving
    the release (``NOT_SERVED``) whose fixture check failed, or as loading no quantized checkpoint of it
    (``NOT_SERVED_QUANTIZED``): at least one engine read it right."""
    script = _script("derive_breadth", monkeypatch)
    not_served, quantized = script.NOT_SERVED, script.NOT_SERVED_QUANTIZED
    rows = {d["arch"]: d for d in map(json.loads, (ROOT / "docs" / "derived-architectures.jsonl").read_text()
                                      .splitlines())}
    for path in SHIPPED:
        (arch,) = tomllib.loads(path.read_text())["architectures"]
        out, fixture = rows[arch]["output_check"], rows[arch]["fixture_check"]
        engines = [e for e in ("vllm", "sglang") if rows[arch].get(e)]
        left = [e for e in engines if not fixture[e]["loads"]]
        assert all(e in not_served.get(arch, {}) for e in left), (arch, left)
        engines = [e for e in engines if e not in left and e not in quantized.get(arch, {})]
        assert engines and all(out[e]["read_right"] for e in engines), arch
        assert rows[arch]["shipped"] == f"mappings/derived/{path.name}"


def test_an_engine_that_loads_the_release_but_no_quantized_checkpoint_is_left_out_after_the_fixture_check(
        monkeypatch):
    """``NOT_SERVED`` leaves an engine out only where its fixture check failed; ``NOT_SERVED_QUANTIZED`` whatever the
    check says (the engine loads the BF16 release, no output of it); any other failure still stops the row."""
    m = _script("derive_breadth", monkeypatch)
    monkeypatch.setattr(m, "NOT_SERVED", {"A": {"sglang": "its config"}})
    monkeypatch.setattr(m, "NOT_SERVED_QUANTIZED", {"B": {"sglang": "its quantized loader"}})
    a, b = m.Arch("A", "a.py", "a.py", None), m.Arch("B", "b.py", "b.py", None)
    ok, bad = {"loads": True}, {"loads": False}
    assert m.carried(a, {"vllm": ok, "sglang": ok}) == ("vllm", "sglang")
    assert m.carried(a, {"vllm": ok, "sglang": bad}) == ("vllm",)
    assert m.carried(a, {"vllm": bad, "sglang": bad}) == ()
    assert m.carried(b, {"vllm": ok, "sglang": ok}) == ("vllm",)
    assert m.not_served("B", {"vllm": ok, "sglang": ok}) == {"sglang": "its quantized loader"}
    assert m.carried(b, {"vllm": bad, "sglang": ok}) == ()
    rec = {"arch": "B", "vllm": "b.py", "sglang": "b.py", "fixture_check": {"vllm": ok, "sglang": ok},
           "output_check": {"vllm": {"read_right": True}}}
    assert m.shippable(rec)
    assert not m.shippable({**rec, "output_check": {"vllm": {"read_right": False}}})
    assert "quantized not served" in m._engine_cell(rec, "output_check", "sglang", "read_right", m.Notes())


def test_a_draft_that_cannot_load_the_release_is_kept_beside_the_fixture_cell_not_held_to_it(monkeypatch, tmp_path):
    """``DRAFT_NOT_SERVED``: the fixture check holds that engine's main model alone (its draft's verdict kept beside,
    the docs cell saying so); any other engine's draft, and every draft in the output check, still must hold."""
    m = _script("derive_breadth", monkeypatch)
    main = {"engine": "sglang", "loaded": True, "verdict": "main loads"}
    draft = {"engine": "sglang", "loaded": True, "unfilled": ["x.weight_scale_inv"], "verdict": "draft: 1 unfilled"}
    monkeypatch.setattr(m, "run", lambda cmd, env, **kw: (1, json.dumps({"engines": [main, draft]}), ""))
    held = m.engine_check(tmp_path / "fx", None, ("sglang",), {})
    assert held["sglang"]["loads"] is False and held["sglang"]["verdict"] == "draft: 1 unfilled"
    left = m.engine_check(tmp_path / "fx", None, ("sglang",), {}, drafts_left={"sglang"})
    assert left["sglang"]["loads"] is True and left["sglang"]["verdict"] == "main loads"
    assert left["sglang"]["draft"]["loads"] is False
    monkeypatch.setattr(m, "DRAFT_NOT_SERVED", {"A": {"sglang": "its draft's own prefix"}})
    rec = {"arch": "A", "vllm": None, "sglang": "a.py", "fixture_check": left}
    notes = m.Notes()
    assert m._fixture_check_cell(rec, "sglang", notes).startswith("yes (its draft: release not served [1]")
    assert notes.items == ["A: its draft's own prefix"]


def test_the_docs_table_is_the_one_its_jsonl_gives(monkeypatch):
    spec = importlib.util.spec_from_file_location("derive_breadth", ROOT / "scripts" / "derive_breadth.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    results = mod.load_results()
    assert mod.render(results, list(results)) == (ROOT / "docs" / "derived-architectures.md").read_text()


def _script(name: str, monkeypatch):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)
    spec.loader.exec_module(mod)
    return mod


def test_the_fixtures_release_keys_fill_only_what_transformers_left_out(monkeypatch):
    """make_fixture's RELEASE_KEYS: a key the saved config lacks or holds as None gets the release's value (a
    function of the saved config where the release spells a transformers field apart); a value transformers wrote
    stays; a model type with no entry gets nothing."""
    mf = _script("make_fixture", monkeypatch)
    saved = {"model_type": "deepseek_v2", "n_group": None, "topk_group": 4, "num_experts_per_tok": None}
    got = mf.table_keys("deepseek_v2", saved)
    assert got["n_group"] == 1 and got["num_experts_per_tok"] == mf.TOP_K and got["scoring_func"] == "softmax"
    assert "topk_group" not in got  # transformers wrote it
    assert mf.table_keys("hy_v3", {"moe_intermediate_size": 128})["expert_hidden_dim"] == 128
    flags = mf.table_keys("exaone_moe", {"mlp_layer_types": ["dense", "sparse", "sparse"]})
    assert flags == {"is_moe_layer": [False, True, True]}
    types = {"layers_block_type": ["linear_attention", "moe", "full_attention", "mlp"],
             "mtp_layers_block_type": ["full_attention", "moe"]}
    assert mf.table_keys("nemotron_h", types) == {"hybrid_override_pattern": "ME*-",
                                                  "mtp_hybrid_override_pattern": "*E"}
    assert mf.table_keys("qwen3_moe", {}) == {}


def test_the_fixtures_drop_what_the_release_does_not_store(monkeypatch, tmp_path):
    """make_fixture's RELEASE_DROPS: LongCat-Flash's zero (identity) experts, indices n_routed_experts.., whose
    gate_proj / up_proj transformers' save writes (its gate_up_proj bank holds every expert, zero ones too) and the
    release does not store (vLLM's expert mapping has n_routed_experts experts: expert 8 was a KeyError), leave the
    file and the index; the routed experts and everything else stay."""
    from safetensors.torch import load_file, save_file

    mf = _script("make_fixture", monkeypatch)
    names = ["model.layers.0.mlp.experts.7.gate_proj.weight", "model.layers.0.mlp.experts.8.gate_proj.weight",
             "model.layers.0.mlp.experts.15.up_proj.weight", "model.layers.0.mlps.0.gate_proj.weight"]
    save_file({n: torch.zeros(2, 2) for n in names}, str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: "model.safetensors" for n in names}}))
    drop = mf.RELEASE_DROPS["longcat_flash"]({"n_routed_experts": 8})
    assert mf.drop_tensors(tmp_path, drop) == 2
    kept = [names[0], names[3]]
    assert sorted(load_file(str(tmp_path / "model.safetensors"))) == sorted(kept)
    assert sorted(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]) == sorted(kept)
    assert mf.drop_tensors(tmp_path, drop) == 0


def test_the_breadth_pack_uses_the_table_merged_with_its_overlay(monkeypatch, tmp_path):
    """A derived table with a hand overlay (mappings/overlays/qwen3_next.toml) is packed merged, as plan merges it
    over the shipped table: the overlay's keeps are in the table given to pack; one without an overlay is given
    as derived."""
    db = _script("derive_breadth", monkeypatch)
    (tmp_path / "derived.toml").write_text('name = "derived-qwen3_next"\n\n[[keep]]\npattern = "a.gate"\n'
                                          'reason = "derived"\n')
    table, overlay = db.with_overlay(tmp_path)
    assert overlay == "mappings/overlays/qwen3_next.toml" and table.name == "derived+overlay.toml"
    keeps = [k["pattern"] for k in tomllib.loads(table.read_text())["keep"]]
    assert keeps == ["a.gate", "model.layers.*.linear_attn.in_proj_qkvz", "model.layers.*.linear_attn.in_proj_ba"]
    (tmp_path / "derived.toml").write_text('name = "derived-no_such_family"\n')
    assert db.with_overlay(tmp_path) == (tmp_path / "derived.toml", None)


def test_the_breadth_engine_check_holds_each_engines_main_and_draft_model(monkeypatch, tmp_path):
    """verify-manifest reports an engine's main model, then its draft where the checkpoint holds MTP layers: the
    cell holds only when both do, and tells the failing one's verdict. A fixture's narrowing cast is the engine's
    reading of the release (not a fault); an output's is a fault, and a draft checked without numerics is read right
    when it loads (its weights are the main model's)."""
    db = _script("derive_breadth", monkeypatch)
    narrow = [{"tensor": "wk.weight_scale_inv", "from": "float32", "to": "bfloat16", "class": "narrowing"}]

    def rep(engine, verdict, numerics=None, **faults):
        return {"engine": engine, "loaded": True, "verdict": verdict, "params": 3, "numerics": numerics, **faults}

    def check(reports, source):
        monkeypatch.setattr(db, "run", lambda *a, **k: (0, json.dumps({"engines": reports}), ""))
        return db.engine_check(tmp_path / "x", source, ("vllm", "sglang"), {})

    got = check([rep("vllm", "main", bad_casts=narrow), rep("vllm", "draft", unfilled=["mtp.w"]),
                 rep("sglang", "main"), rep("sglang", "draft", bad_casts=narrow)], None)
    assert (got["vllm"]["loads"], got["vllm"]["verdict"]) == (False, "draft")
    assert (got["sglang"]["loads"], got["sglang"]["verdict"], got["sglang"]["read_right"]) == (True, "main", None)
    ok = {"ok": True, "summary": "read right"}
    got = check([rep("vllm", "main", ok), rep("vllm", "draft"),
                 rep("sglang", "main", {"ok": False, "summary": "misread"}), rep("sglang", "draft"),
                 ], tmp_path / "src")
    assert (got["vllm"]["loads"], got["vllm"]["read_right"], got["vllm"]["numerics"]) == (True, True, "read right")
    assert (got["sglang"]["read_right"], got["sglang"]["verdict"]) == (False, "main")
    got = check([rep("vllm", "main", ok, bad_casts=narrow), rep("sglang", "main", ok), rep("sglang", "draft",
                                                                                          bad_casts=narrow)],
                tmp_path / "src")
    assert not got["vllm"]["loads"] and not got["vllm"]["read_right"]
    assert (got["sglang"]["loads"], got["sglang"]["read_right"], got["sglang"]["verdict"]) == (False, False, "draft")


def test_llama4s_vision_tower_is_shrunk_with_its_widths_tied_as_transformers_ties_them(monkeypatch):
    """make_fixture's SUBCONFIGS: Llama 4's vision_config (which shrink_widths leaves alone) is laid over at tiny sizes
    that keep transformers' ties: the pixel-shuffled patches (hidden / ratio^2) are vision_adapter.mlp.fc1's input
    (intermediate_size), the adapter's output is the projector's input; keys the saved config has and the table does
    not name stay; another model type's sub-configs are untouched."""
    mf = _script("make_fixture", monkeypatch)
    d = mf.with_subconfigs("llama4", {"vision_config": {"num_channels": 3, "hidden_size": 768}, "text_config": {}})
    v = d["vision_config"]
    assert v["intermediate_size"] == v["hidden_size"] / v["pixel_shuffle_ratio"] ** 2
    assert v["vision_output_dim"] == v["projector_output_dim"] and v["num_channels"] == 3
    assert v["hidden_size"] % v["num_attention_heads"] == 0 and v["hidden_size"] <= mf.HIDDEN
    assert mf.with_subconfigs("qwen3_moe", {"vision_config": {"hidden_size": 768}}) == {
        "vision_config": {"hidden_size": 768}}


def test_a_multimodal_fixture_gets_the_index_its_release_ships(monkeypatch, tmp_path):
    """make_fixture's write_index: one saved file gets model.safetensors.index.json naming every tensor in it (SGLang's
    mllama4.py looks for the vision tower's names there); an index already written, or several files, are left."""
    from safetensors.torch import save_file

    mf = _script("make_fixture", monkeypatch)
    names = ["language_model.model.norm.weight", "vision_model.patch_embedding.linear.weight"]
    save_file({n: torch.zeros(2, 2) for n in names}, str(tmp_path / "model.safetensors"))
    mf.write_index(tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == dict.fromkeys(names, "model.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    mf.write_index(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").read_text() == "{}"


def test_sglang_serves_a_checkpoint_with_a_vision_tower_with_the_tower_on(tmp_path):
    """sglang_runner.deployment_args: a config with a vision_config is checked with ``enable_multimodal`` (SGLang turns
    it off by default for Llama4ForConditionalGeneration, then skips the tower's weights); a text config is not."""
    sys.path.insert(0, str(ROOT / "convert" / "enginecheck"))
    try:
        import sglang_runner
    finally:
        sys.path.remove(str(ROOT / "convert" / "enginecheck"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Llama4ForConditionalGeneration"],
                                                      "text_config": {}, "vision_config": {"hidden_size": 256}}))
    assert sglang_runner.deployment_args(str(tmp_path)) == {"enable_multimodal": True}
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Llama4ForCausalLM"]}))
    assert sglang_runner.deployment_args(str(tmp_path)) == {}


def _breadth_presets() -> list[tuple[str, str, bool]]:
    """(architecture, FILE.toml:NAME, whether its config class is remote code) for each breadth fixture that is a
    test preset (tests/presets)."""
    spec = importlib.util.spec_from_file_location("derive_breadth_presets", ROOT / "scripts" / "derive_breadth.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return sorted((a, p, a in mod.TRUST_REMOTE_CODE) for a, p in mod.PRESET_FIXTURES.items()
                  if p.startswith("tests/presets/"))


BREADTH_PRESETS = _breadth_presets()


@pytest.mark.parametrize("arch, spec, remote", BREADTH_PRESETS, ids=[a for a, _, _ in BREADTH_PRESETS])
def test_a_breadth_preset_is_its_architectures_and_carries_its_config_code_where_remote(arch, spec, remote, tmp_path):
    """Each breadth fixture written from a test preset names the architecture it stands for; an architecture whose
    config class is the release's own code (``TRUST_REMOTE_CODE``: neither engine nor transformers registers its
    model_type) gets the file its ``auto_map`` names for ``AutoConfig`` beside config.json, and the stand-in folders
    the derivation builds carry that code only when told to trust it (``standin.make(..., with_code=True)``); one not
    remote, none."""
    from helpers import write_synth
    from kimi_convert.checkpoint import open_checkpoint
    from kimi_convert.derive import standin

    src = write_synth(spec.rpartition(":")[2], tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    assert arch in cfg["architectures"]
    config_class = cfg.get("auto_map", {}).get("AutoConfig")  # the engines read only the config through it
    code = [config_class.partition(".")[0] + ".py"] if config_class else []
    ckpt = open_checkpoint(src)
    if remote:
        assert code and all((src / f).is_file() for f in code)
        assert not set(code) & set(standin.make(ckpt).side_files)
        assert set(code) <= set(standin.make(ckpt, with_code=True).side_files)
    else:
        assert not any((src / f).is_file() for f in code)
