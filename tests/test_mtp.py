"""MTP (speculative-decoding draft) layers without an engine: the ``[mtp]`` table (convert/mtp.py), the plan's
default (kept where a draft cannot take them quantized) and ``--quantize-mtp``, the draft's names in the exclude list,
bad input (a config and a checkpoint that disagree on MTP layers, a missing MTP shard), and the derivation of the
``[mtp]`` table from the engines' draft answers (convert/derive/draft.py).

The expected names are written by hand from the engines' sources (docs/families.md, "MTP layers and the engines'
drafts"), not produced by the code under test.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import one_line_error, run, write_synth
from kimi_convert import mtp
from kimi_convert.derive import draft
from kimi_convert.errors import ConvertError

GLM_MTP = {
    "prefix": "model.layers.{n}.", "first": "num_hidden_layers", "count": ["num_nextn_predict_layers"],
    "draft": [
        {"engine": "vllm", "model_class": "Glm4MoeMTP", "quantized": ["modelopt"],
         "unquantized": {"modelopt": ["model.layers.{n}.eh_proj"]},
         "names": [["model.layers.{n}.self_attn.q_proj", "model.layers.{n}.self_attn.qkv_proj"],
                   ["model.layers.{n}.self_attn.k_proj", "model.layers.{n}.self_attn.qkv_proj"],
                   ["model.layers.{n}.self_attn.v_proj", "model.layers.{n}.self_attn.qkv_proj"],
                   ["lm_head", "model.layers.{n}.head"]]},
        {"engine": "sglang", "model_class": "Glm4MoeForCausalLMNextN", "quantized": []},
    ],
}


def value_of(config: dict):
    return lambda path: config.get(path)


def test_prefixes_follow_the_config():
    m = mtp.parse(GLM_MTP, "t")
    assert m.prefixes(value_of({"num_hidden_layers": 92, "num_nextn_predict_layers": 1})) == ("model.layers.92.",)
    assert m.prefixes(value_of({"num_hidden_layers": 3, "num_nextn_predict_layers": 2})) == (
        "model.layers.3.", "model.layers.4.")
    assert m.prefixes(value_of({"num_hidden_layers": 3, "num_nextn_predict_layers": 0})) == ()
    block = mtp.parse({"prefix": "mtp.", "count": ["mtp_num_hidden_layers"]}, "t")
    assert block.prefixes(value_of({"mtp_num_hidden_layers": 1})) == ("mtp.",)
    assert block.prefixes(value_of({})) == ()


def test_parse_refuses_unknown_keys_and_bad_prefix():
    with pytest.raises(ConvertError, match="unknown key"):
        mtp.parse({**GLM_MTP, "layers": 1}, "t")
    with pytest.raises(ConvertError, match="prefix"):
        mtp.parse({**GLM_MTP, "prefix": "model.layers.{n}"}, "t")
    with pytest.raises(ConvertError, match=r"draft\[0\]: engine"):
        mtp.parse({**GLM_MTP, "draft": [{"engine": "trt"}]}, "t")


def test_default_keeps_where_a_draft_builds_unquantized_and_quantize_mtp_follows_both():
    m = mtp.parse(GLM_MTP, "t")
    p = ("model.layers.3.",)
    why = mtp.decide("model.layers.3.mlp.experts.0.gate_proj", m, p, "modelopt", quantize=False)
    assert why and "sglang Glm4MoeForCausalLMNextN" in why and "unquantized under a modelopt config" in why
    assert mtp.decide("model.layers.2.mlp.experts.0.gate_proj", m, p, "modelopt", quantize=False) is None
    # --quantize-mtp: quantized where no draft keeps the module; a module a draft builds unquantized stays kept
    assert mtp.decide("model.layers.3.mlp.experts.0.gate_proj", m, p, "modelopt", quantize=True) is None
    assert "vllm Glm4MoeMTP" in mtp.decide("model.layers.3.eh_proj", m, p, "modelopt", quantize=True)
    # every draft builds it quantized under this format: the recipe decides, by default too
    both = mtp.parse({**GLM_MTP, "draft": [{**d, "quantized": ["modelopt"]} for d in GLM_MTP["draft"]]}, "t")
    assert mtp.decide("model.layers.3.mlp.experts.0.gate_proj", both, p, "modelopt", quantize=False) is None


def test_draft_aliases_name_what_the_draft_asks_for_only_when_all_its_sources_are_kept():
    m = mtp.parse(GLM_MTP, "t")
    present = {"lm_head", "model.layers.3.self_attn.q_proj", "model.layers.3.self_attn.k_proj",
               "model.layers.3.self_attn.v_proj", "model.layers.2.self_attn.q_proj"}
    kept = {"lm_head", "model.layers.3.self_attn.q_proj", "model.layers.3.self_attn.k_proj",
            "model.layers.3.self_attn.v_proj"}
    layers = m.layer_values(value_of({"num_hidden_layers": 3, "num_nextn_predict_layers": 1}))
    assert mtp.draft_aliases(kept, present, m, ("model.layers.3.",), layers) == [
        "model.layers.3.head", "model.layers.3.self_attn.qkv_proj"]
    # v_proj quantized: qkv_proj is not excluded for the draft (it would be built unquantized over NVFP4 codes)
    assert mtp.draft_aliases(kept - {"model.layers.3.self_attn.v_proj"}, present, m, ("model.layers.3.",),
                             layers) == ["model.layers.3.head"]


def _shipped_mtp(table: str) -> mtp.Mtp:
    import tomllib

    from kimi_convert.derive import merge

    root = Path(__file__).resolve().parents[1] / "mappings"
    t = tomllib.loads((root / "derived" / f"{table}.toml").read_text())
    overlay = root / "overlays" / f"{table}.toml"
    if overlay.is_file():
        t = merge(t, tomllib.loads(overlay.read_text()))
    return mtp.parse(t["mtp"], table)


def test_a_block_prefixs_draft_names_follow_the_real_config_not_the_stand_ins():
    """DeepSeek V4's MTP block ``mtp.{i}.``: vLLM's DeepSeekV4MTP numbers its layer num_hidden_layers + i
    (deepseek_v4/nvidia/mtp.py ``mtp_start_layer_idx = config.num_hidden_layers``), 43 in the release and 4 in the
    tiny stand-in the table was derived from: the exclude list's aliases of the kept MTP modules follow the
    config planned, never the stand-in's number."""
    m = _shipped_mtp("deepseek_v4")
    present = {"lm_head", "mtp.0.e_proj", "mtp.0.attn.wq_a", "mtp.0.attn.wkv", "mtp.0.ffn.experts.3.w1",
               "mtp.1.e_proj"}
    for hidden, count in ((43, 1), (61, 2)):
        layers = m.layer_values(value_of({"num_hidden_layers": hidden, "num_nextn_predict_layers": count}))
        got = mtp.draft_aliases(present, present, m, ("mtp.",), layers)
        assert f"model.layers.{hidden}.e_proj" in got and f"model.layers.{hidden}.head" in got
        assert f"model.layers.{hidden}.attn.fused_wqa_wkv" in got and f"model.layers.{hidden}.ffn.experts" in got
        assert ("model.layers.62.e_proj" in got) == (count == 2)  # mtp.1's, under the second layer's number
        assert "model.decoder.self_attn.wqkv_a" in got  # SGLang's NextN: one decoder, no number
        assert not any(a.startswith("model.layers.4.") for a in got), got


def test_minimax_m3_keeps_main_layer_i_attention_with_the_mtp_layers_and_sglang_has_no_draft():
    """MiniMax M3: vLLM's MiniMaxM3MTP asks for the kept MTP attention as model.layers.{i}.self_attn.qkv_proj,
    which both engines' exclusion rules also read as the main model's layer i (vLLM modelopt.py
    is_layer_excluded: a substring; SGLang: full match after removing language_model.): main layer i's q/k/v are
    kept where MTP layer i exists, and only there. SGLang has no M3 draft: it keeps nothing of the MTP layer."""
    m = _shipped_mtp("minimax_m3_vl")
    assert [d.engine for d in m.present()] == ["vllm"]
    mtp_q = "language_model.model.mtp.layers.0.transformer_layer.self_attn.q_proj"
    present = {mtp_q, "language_model.model.layers.0.self_attn.q_proj",
               "language_model.model.layers.1.self_attn.q_proj"}
    pre = ("language_model.model.mtp.",)
    why = mtp.decide("language_model.model.layers.0.self_attn.q_proj", m, pre, "modelopt", False, present)
    assert why is not None and mtp_q in why and "MiniMaxM3MTP" in why
    assert mtp.decide("language_model.model.layers.1.self_attn.q_proj", m, pre, "modelopt", False, present) is None
    assert mtp.decide("language_model.model.layers.0.self_attn.o_proj", m, pre, "modelopt", False, present) is None
    # the MTP layer itself: quantized by the recipe (vLLM's draft reads it NVFP4) but the router
    assert mtp.decide("language_model.model.mtp.layers.0.eh_proj", m, pre, "modelopt", False, present) is None
    gate = "language_model.model.mtp.layers.0.transformer_layer.block_sparse_moe.gate"
    assert "builds it unquantized" in mtp.decide(gate, m, pre, "modelopt", False, present)
    layers = m.layer_values(value_of({"num_mtp_modules": 1}))
    kept = {mtp_q.replace("q_proj", p) for p in ("q_proj", "k_proj", "v_proj", "index_q_proj", "index_k_proj")}
    assert mtp.draft_aliases(kept | {"language_model.lm_head"}, kept | {"language_model.lm_head"}, m, pre,
                             layers) == ["lm_head", "model.layers.0.self_attn.qkv_proj"]


def test_check_layers_refuses_a_config_and_checkpoint_that_disagree():
    m = mtp.parse(GLM_MTP, "t")
    names = ["model.layers.0.mlp.gate.weight", "model.layers.3.eh_proj.weight"]
    mtp.check_layers(names, value_of({"num_hidden_layers": 3, "num_nextn_predict_layers": 1}), m)
    with pytest.raises(ConvertError, match=r"announces MTP layer model\.layers\.4\.\* but the checkpoint stores"):
        mtp.check_layers(names, value_of({"num_hidden_layers": 3, "num_nextn_predict_layers": 2}), m)
    with pytest.raises(ConvertError, match=r"model\.layers\.3\.eh_proj\.weight: an MTP-layer tensor, but .* no MTP"):
        mtp.check_layers(names, value_of({"num_hidden_layers": 3, "num_nextn_predict_layers": 0}), m)


def test_a_numbered_block_is_held_to_the_config_count():
    """DeepSeek V4's ``mtp.0.*`` (and Qwen3.5's ``mtp.layers.0.*``) under a block prefix: the count is checked per
    numbered layer too."""
    m = mtp.parse({"prefix": "mtp.", "count": ["num_nextn_predict_layers"]}, "t")
    names = ["layers.0.ffn.gate.weight", "mtp.0.e_proj.weight", "mtp.0.ffn.gate.weight"]
    mtp.check_layers(names, value_of({"num_nextn_predict_layers": 1}), m)
    with pytest.raises(ConvertError, match=r"announces MTP layer mtp\.1\.\* but the checkpoint stores no tensor"):
        mtp.check_layers(names, value_of({"num_nextn_predict_layers": 2}), m)
    with pytest.raises(ConvertError, match=r"mtp\.1\.\*: an MTP layer, but .* announces only 1"):
        mtp.check_layers([*names, "mtp.1.e_proj.weight"], value_of({"num_nextn_predict_layers": 1}), m)
    q = ["mtp.fc.weight", "mtp.layers.0.mlp.gate.weight"]
    with pytest.raises(ConvertError, match=r"announces MTP layer mtp\.layers\.1\.\*"):
        mtp.check_layers(q, value_of({"mtp_num_hidden_layers": 2}), mtp.parse({"prefix": "mtp.", "count": [
            "mtp_num_hidden_layers"]}, "t"))


def test_layers_no_config_key_counts_are_the_ones_stored_under_the_block():
    """LongCat-Flash's and MiMo-V2-Flash's ``model.mtp.layers.{i}.``: no config key counts them, so the layers stored
    under the block are the count (``count_stored``); ``first`` may be a multiple of a config path (vLLM's
    LongCatFlashMTP numbers its layer ``2 * num_layers``)."""
    m = mtp.parse({"prefix": "model.mtp.", "count": [], "count_stored": True, "first": "2 * num_layers"}, "t")
    cfg = value_of({"num_layers": 28})
    one = ["model.layers.0.mlps.0.up_proj.weight", "model.mtp.embed_tokens.weight", "model.mtp.layers.0.eh_proj.weight"]
    three = [*one, "model.mtp.layers.1.eh_proj.weight", "model.mtp.layers.2.eh_proj.weight"]
    assert m.layers(cfg, one) == 1 and m.layers(cfg, three) == 3 and m.layers(cfg, one[:1]) == 0
    assert m.prefixes(cfg, one) == ("model.mtp.",) and m.prefixes(cfg, one[:1]) == ()
    assert m.layer_values(cfg, three) == ({"i": "0", "n": "56"}, {"i": "1", "n": "57"}, {"i": "2", "n": "58"})
    mtp.check_layers(three, cfg, m)
    mtp.check_layers(one[:1], cfg, m)  # no MTP tensor at all: nothing to count, nothing to refuse
    with pytest.raises(ConvertError, match=r"^model\.mtp\.embed_tokens\.weight: an MTP-layer tensor, but the "
                                           r"checkpoint stores no numbered MTP layer under model\.mtp\."):
        mtp.check_layers(one[:2], cfg, m)
    with pytest.raises(ConvertError, match=r"model\.mtp\.layers\.: MTP layers stored as 0, 2, no 1: .* no gap"):
        mtp.check_layers([*one, "model.mtp.layers.2.eh_proj.weight"], cfg, m)
    # a config key that counts them still decides, the storage held to it as before
    counted = mtp.parse({"prefix": "model.mtp.", "count": ["num_nextn_predict_layers"], "count_stored": True}, "t")
    with pytest.raises(ConvertError, match=r"model\.mtp\.layers\.1\.\*: an MTP layer, but .* announces only 1"):
        mtp.check_layers(three, value_of({"num_nextn_predict_layers": 1}), counted)
    with pytest.raises(ConvertError, match=r"num_layers must be an integer"):
        m.layer_values(value_of({"num_layers": "28"}), one)


def test_parse_refuses_a_stored_count_under_numbered_layers_and_a_first_that_is_no_path():
    with pytest.raises(ConvertError, match="count_stored"):
        mtp.parse({**GLM_MTP, "count_stored": True}, "t")
    with pytest.raises(ConvertError, match="count_stored"):
        mtp.parse({"prefix": "mtp.", "count_stored": "yes"}, "t")
    for bad in ("2 *", "num_layers + 1", "x * num_layers", "2 * 3"):
        with pytest.raises(ConvertError, match=r"first = .*expected a config path or INTEGER \* a config path"):
            mtp.parse({"prefix": "mtp.", "first": bad}, "t")
    assert mtp.parse({"prefix": "mtp.", "first": "3*n_layers"}, "t").first_number(value_of({"n_layers": 5})) == 15


# -- the derivation's rules, on answers written by hand in the runners' format -----------------------------------


def test_locate_reads_layers_and_blocks_from_the_main_models_mtp_names():
    cfg = {"num_hidden_layers": 3, "num_nextn_predict_layers": 1}
    assert draft.locate(["model.layers.3.eh_proj.weight", "model.layers.3.mlp.gate.weight"], cfg) == {
        "prefix": "model.layers.{n}.", "first": "num_hidden_layers", "count": ["num_nextn_predict_layers"]}
    q = {"text_config": {"num_hidden_layers": 4, "mtp_num_hidden_layers": 1}}
    assert draft.locate(["mtp.fc.weight", "mtp.layers.0.mlp.gate.weight"], q) == {
        "prefix": "mtp.", "count": ["mtp_num_hidden_layers"]}
    # a block under the text model's own prefix (MiniMax M3): the block, not the whole text model
    m3 = {"text_config": {"num_hidden_layers": 3, "num_mtp_modules": 1}}
    assert draft.locate(["language_model.model.mtp.layers.0.eh_proj.weight",
                         "language_model.model.mtp.layers.0.transformer_layer.self_attn.q_proj.weight"], m3) == {
        "prefix": "language_model.model.mtp.", "count": ["num_mtp_modules"]}
    # a block indexed without a layers list (DeepSeek V4's mtp.0.)
    assert draft.locate(["mtp.0.attn.wkv.weight", "mtp.0.ffn.gate.weight"], q)["prefix"] == "mtp."
    assert draft.locate([], cfg) is None
    # no config key counts the block's layers (LongCat-Flash): the stored ones do
    assert draft.locate(["model.mtp.embed_tokens.weight", "model.mtp.layers.0.eh_proj.weight"], {"num_layers": 2}) == {
        "prefix": "model.mtp.", "count": [], "count_stored": True}


def test_the_drafts_layer_number_is_read_as_the_decoder_count_or_its_double():
    """vLLM's LongCatFlashMTP asks its quant method under ``model.layers.{2 * num_layers}.`` (the stand-in's 4 for 2
    layers): the table says ``first = "2 * num_layers"`` and the names template ``{n}``; where no draft numbers a
    layer so, no ``first``."""
    spans = [{"tensor": "model.mtp.layers.0.self_attn.q_a_proj.weight",
              "param": "model.layers.4.self_attn.fused_qkv_a_proj.weight"}]
    mods = {"model.layers.4.self_attn.fused_qkv_a_proj": _module("linear", "Lin",
                                                                 "model.layers.4.self_attn.fused_qkv_a_proj")}
    answers = {"vllm": {"trace": {"model_class": "x.LongCatFlashMTP", "version": "0.33.0", "spans": spans,
                                  "from_target": []}, "builds": {"modelopt": {"modules": mods}}}}
    names = ["model.mtp.layers.0.self_attn.q_a_proj.weight", "model.mtp.norm.weight"]
    sec = draft.section(names, {"num_layers": 2}, answers)
    assert sec["first"] == "2 * num_layers" and sec["count_stored"] and sec["count"] == []
    assert sec["draft"][0]["names"] == [["model.mtp.layers.{i}.self_attn.q_a_proj",
                                         "model.layers.{n}.self_attn.fused_qkv_a_proj"]]
    by_index = {"model.layers.0.self_attn.fused_qkv_a_proj": _module("linear", "Lin",
                                                                     "model.layers.0.self_attn.fused_qkv_a_proj")}
    answers["vllm"]["builds"]["modelopt"]["modules"] = by_index
    answers["vllm"]["trace"]["spans"] = [{**spans[0], "param": "model.layers.0.self_attn.fused_qkv_a_proj.weight"}]
    sec = draft.section(names, {"num_layers": 2}, answers)
    assert "first" not in sec and sec["draft"][0]["names"] == [["model.mtp.layers.{i}.self_attn.q_a_proj",
                                                               "model.layers.{i}.self_attn.fused_qkv_a_proj"]]


def _module(kind, method, prefix=None, weight=(256, 512)):
    d = {"kind": kind, "quant_method": method, "params": {"weight": list(weight)}}
    if prefix:
        d["quant_prefix"] = prefix
    return d


def test_draft_entry_from_answers():
    """A vLLM-like draft: the MTP block under mtp_block, quant prefixes without it and no packed mapping, the
    target's lm_head loaded into the layer's head; under compressed-tensors the block is built quantized."""
    blk = "model.layers.3.mtp_block"
    spans = [{"tensor": "model.layers.3.self_attn.q_proj.weight", "param": f"{blk}.self_attn.qkv_proj.weight"},
             {"tensor": "model.layers.3.mlp.experts.0.gate_proj.weight", "param": f"{blk}.mlp.experts.w13_weight"},
             {"tensor": "model.layers.3.eh_proj.weight", "param": "model.layers.3.eh_proj.weight"},
             {"tensor": "model.layers.3.enorm.weight", "param": "model.layers.3.enorm.weight"},
             {"tensor": "lm_head.weight", "param": "model.layers.3.shared_head.head.weight"}]
    mods = {f"{blk}.self_attn.qkv_proj": _module("linear", "Lin", "model.layers.3.self_attn.qkv_proj"),
            f"{blk}.mlp.experts": _module("moe", "Moe", "model.layers.3.mlp.experts"),
            "model.layers.3.eh_proj": _module("other", None),
            "model.layers.3.enorm": _module("other", None, weight=(256,)),  # a norm: not a linear layer
            "model.layers.3.shared_head.head": _module("embedding", "Lin", "model.layers.3.head")}
    answers = {"trace": {"model_class": "x.Glm4MoeMTP", "version": "0.33.0", "spans": spans, "from_target": []},
               "builds": {"compressed-tensors": {"modules": mods}}}
    loc = {"prefix": "model.layers.{n}.", "first": "num_hidden_layers", "count": ["num_nextn_predict_layers"]}
    e = draft.draft_entry("vllm", answers, loc, ["model.layers.3."])
    assert e["quantized"] == ["compressed-tensors"]
    assert e["unquantized"] == {"compressed-tensors": ["model.layers.{n}.eh_proj"]}
    assert e["names"] == [["lm_head", "model.layers.{n}.head"],
                          ["model.layers.{n}.mlp.experts.{expert}.gate_proj", "model.layers.{n}.mlp.experts"],
                          ["model.layers.{n}.self_attn.q_proj", "model.layers.{n}.self_attn.qkv_proj"]]


# -- bad input through the command line --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def glm(tmp_path_factory) -> Path:
    return write_synth("tiny-glm4-moe", tmp_path_factory.mktemp("mtp") / "glm")


def _config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def test_plan_refuses_mtp_layers_the_checkpoint_lacks(glm, tmp_path):
    bad = _config(glm, tmp_path / "more", num_nextn_predict_layers=2)
    r = run("plan", bad)
    assert r.code == 2
    assert "announces MTP layer model.layers.4.* but the checkpoint stores no tensor under it" in one_line_error(r)


def test_plan_refuses_mtp_tensors_the_config_does_not_announce(glm, tmp_path):
    bad = _config(glm, tmp_path / "none", num_nextn_predict_layers=0)
    r = run("plan", bad)
    assert r.code == 2
    err = one_line_error(r)
    assert err.startswith("kimi-convert: error: model.layers.3.") and "announces no MTP layer" in err


def test_a_missing_mtp_shard_is_named_with_what_the_index_lists_in_it(glm, tmp_path):
    bad = tmp_path / "lost"
    shutil.copytree(glm, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"]
    shard = index["model.layers.3.eh_proj.weight"]
    (bad / shard).unlink()
    r = run("plan", bad)
    assert r.code == 2
    err = one_line_error(r)
    assert f"names missing file '{shard}'" in err and "model.layers.3.eh_proj.weight" in err


#: The 2026 families' MTP layers (issue 39 item 4): preset, the layer's prefix with two layers announced, the
#: tensor its shard holds (each writer's own layout: docs/families.md).
NEW_FAMILIES = {
    "tiny-glm5": ("model.layers.5.", "model.layers.4.eh_proj.weight"),
    "tiny-glm4-moe-lite": ("model.layers.3.", "model.layers.2.eh_proj.weight"),
    "tiny-deepseek-v3-2": ("model.layers.3.", "model.layers.2.eh_proj.weight"),
    "tiny-deepseek-v4": ("mtp.1.", "mtp.0.e_proj.weight"),
    "tiny-glm5-next": ("model.language_model.layers.5.", "model.language_model.layers.4.eh_proj.weight"),  # GLM-5.3
    "tiny-qwen4-exp": ("mtp.layers.1.", "mtp.fc_hidden.weight"),  # Qwen3.8-Flash-Next
    "tiny-minimax-m3": ("language_model.model.mtp.layers.1.", "language_model.model.mtp.layers.0.eh_proj.weight"),
}
#: Where a family's config counts its MTP layers, if not the top level's num_nextn_predict_layers (the [mtp] count)
COUNT_KEY = {"tiny-glm5-next": ("text_config", "num_nextn_predict_layers"),
             "tiny-qwen4-exp": ("text_config", "mtp_num_hidden_layers"),
             "tiny-minimax-m3": ("text_config", "num_mtp_modules")}


def _count(src: Path, dst: Path, preset: str, n: int) -> Path:
    """A copy of ``src`` whose config announces ``n`` MTP layers (under the key the family's [mtp] counts by)."""
    where = COUNT_KEY.get(preset)
    if where is None:
        return _config(src, dst, num_nextn_predict_layers=n)
    cfg = json.loads((src / "config.json").read_text())
    return _config(src, dst, **{where[0]: {**cfg[where[0]], where[1]: n}})


@pytest.mark.parametrize("preset", sorted(NEW_FAMILIES))
def test_new_families_mtp_bad_input_is_one_line_before_any_work(preset, tmp_path):
    """Each bad input of issue 39 item 4 on the 2026 families' own layouts: exit 2, one line naming it, in plan
    (before any tensor is read)."""
    more, tensor = NEW_FAMILIES[preset]
    src = write_synth(preset, tmp_path / "src")
    assert run("plan", src).code == 0
    r = run("plan", _count(src, tmp_path / "more", preset, 2))
    assert r.code == 2 and f"announces MTP layer {more}* but the checkpoint stores no tensor" in one_line_error(r)
    r = run("plan", _count(src, tmp_path / "none", preset, 0))
    assert r.code == 2 and "announces no MTP layer" in one_line_error(r)
    assert one_line_error(r).startswith(f"kimi-convert: error: {tensor.split('.')[0]}.")
    lost = tmp_path / "lost"
    shutil.copytree(src, lost)
    index = json.loads((lost / "model.safetensors.index.json").read_text())["weight_map"]
    shard = index[tensor]
    (lost / shard).unlink()
    r = run("plan", lost)
    assert r.code == 2
    held = sum(f == shard for f in index.values())  # the line says how much the index lists in the lost file
    assert f"names missing file '{shard}' (the index lists {held} tensor(s) in it" in one_line_error(r)


def test_mtp_layers_counted_from_the_storage_refuse_a_gap_in_one_line(tmp_path):
    """MiMo-V2-Flash's three MTP layers, which no config key counts (``count_stored``): its shipped table plans them
    all; with layer 1's tensors gone from the checkpoint, plan stops before any work, exit 2, one line naming the
    gap."""
    from safetensors.torch import load_file, save_file

    src = write_synth("tiny-mimo-v2-flash", tmp_path / "src")
    assert run("plan", src).code == 0
    gap = tmp_path / "gap"
    shutil.copytree(src, gap)
    index_file = gap / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    gone = [n for n in index["weight_map"] if n.startswith("model.mtp.layers.1.")]
    assert gone
    for shard in sorted({index["weight_map"][n] for n in gone}):
        kept = {k: v for k, v in load_file(gap / shard).items() if not k.startswith("model.mtp.layers.1.")}
        save_file(kept, gap / shard, metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k not in gone}
    index_file.write_text(json.dumps(index))
    r = run("plan", gap)
    assert r.code == 2
    assert "model.mtp.layers.: MTP layers stored as 0, 2, no 1: their numbers must run from 0" in one_line_error(r)


@pytest.mark.parametrize(("preset", "table"), [("tiny-glm4-moe", "glm4_moe"), ("tiny-deepseek-v3", "deepseek_v3"),
                                               ("tiny-qwen3-5-moe", "qwen3_5_moe")])
def test_tables_mtp_is_what_the_engines_drafts_answered(preset, table):
    """The shipped tables' [mtp] is derive/draft.py's reading of the engines' own answers, recorded by
    `kimi-convert mapping derive --answers` (tests/derived/PRESET.draft-answers.json, main and draft answers; named
    apart from test_derive.py's PRESET.answers.json, whose tables it compares whole). Only the hand rules differ:
    DeepSeek's quantize rule (it names the engine check that needs it) and Qwen3.5's count path (its hand table
    reads the top-level config)."""
    import tomllib

    from kimi_convert.derive import load_answers, load_draft_answers

    path = Path(__file__).parent / "derived" / f"{preset}.draft-answers.json"
    views, config, _ = load_answers(path)
    derived = draft.section(sorted({n for v in views for n in v.mtp_skipped}), config, load_draft_answers(path))
    text = (Path(__file__).resolve().parents[1] / "mappings" / f"{table}.toml").read_text()
    hand = {k: v for k, v in tomllib.loads(text)["mtp"].items() if k not in ("quantize", "quantize_reason")}
    hand["count"] = [c.removeprefix("text_config.") for c in hand["count"]]
    assert derived == hand
    assert {d["engine"] for d in derived["draft"]} == {"vllm", "sglang"}
    sglang = next(d for d in derived["draft"] if d["engine"] == "sglang")
    assert "modelopt" not in sglang["quantized"]  # SGLang's draft builds the MTP layer unquantized under ModelOpt


#: The 2026 families' derived tables (mappings/derived/) with the [mtp] their drafts answered (each the table its
#: recorded answers give: tests/test_derive.py, test_a_shipped_derived_table_is_its_recorded_answers)
DERIVED_WITH_DRAFTS = {"tiny-glm5": "glm_moe_dsa", "tiny-glm4-moe-lite": "glm4_moe_lite",
                       "tiny-deepseek-v3-2": "deepseek_v32", "tiny-deepseek-v4": "deepseek_v4"}


@pytest.mark.parametrize("preset", sorted(DERIVED_WITH_DRAFTS))
def test_derived_tables_mtp_names_both_engines_drafts(preset):
    """mappings/derived/TABLE.toml's [mtp] names both engines' drafts, and SGLang's as building the MTP layer
    quantized under ModelOpt only where its draft does."""
    import tomllib

    shipped = Path(__file__).resolve().parents[1] / "mappings" / "derived" / f"{DERIVED_WITH_DRAFTS[preset]}.toml"
    table = tomllib.loads(shipped.read_text())["mtp"]
    assert {x["engine"] for x in table["draft"]} == {"vllm", "sglang"}
    sglang = next(x for x in table["draft"] if x["engine"] == "sglang")
    # SGLang's DeepSeek / GLM NextN set quant_config None under modelopt_fp4 (deepseek_nextn.py, glm4_moe_nextn.py);
    # its DeepSeek V4 NextN (deepseek_v4_nextn.py DeepseekV4ModelNextN) builds the layer with the model's quant config
    assert ("modelopt" in sglang["quantized"]) == (preset == "tiny-deepseek-v4")


def test_plan_says_why_the_mtp_layer_is_kept_and_quantize_mtp_follows_the_drafts(glm):
    """Default: the MTP layer kept, each module's reason naming the draft that builds it unquantized under ModelOpt
    NVFP4 (SGLang's Glm4MoeForCausalLMNextN); --quantize-mtp quantizes only what every draft builds quantized, which
    under ModelOpt is nothing here (SGLang's draft builds all of it unquantized), and is recorded in the manifest's
    options only when given."""
    def plan(*extra):
        r = run("plan", glm, "--json", *extra)
        assert r.code == 0, r.stderr
        return json.loads(r.stdout)

    d = plan()
    mods = {m["name"]: m for m in d["modules"]}
    rule = mods["model.layers.3.mlp.experts.0.gate_proj"]["rule"]
    assert "Glm4MoeForCausalLMNextN" in rule and "unquantized under a modelopt config" in rule
    assert mods["model.layers.2.mlp.experts.0.gate_proj"]["kind"] == "nvfp4"
    assert "quantize_mtp" not in d["options"]
    q = plan("--quantize-mtp")
    qm = {m["name"]: m for m in q["modules"]}
    assert qm["model.layers.3.mlp.experts.0.gate_proj"]["kind"] == "keep"
    assert "MTP module kept: sglang" in qm["model.layers.3.mlp.experts.0.gate_proj"]["rule"]
    assert q["options"]["quantize_mtp"] is True
    ct = {m["name"]: m for m in plan("--format", "compressed-tensors")["modules"]}
    assert ct["model.layers.3.mlp.experts.0.gate_proj"]["kind"] == "nvfp4"  # both drafts build it quantized there


def test_an_engine_whose_draft_config_builds_the_main_class_again_has_no_draft(monkeypatch):
    """SGLang 0.5.23 and MiniMax M3: ModelConfig(is_draft_model=True) keeps MiniMaxM3SparseForConditionalGeneration
    (no draft model for it), whose loader drops the MTP layers again: verify-manifest says the engine has no draft
    and does not fail the checkpoint (it did: "draft ... loads ... but 127 skipped tensor(s)", rc 1); a real draft
    (another class) is still checked and fails where it fails."""
    from types import SimpleNamespace

    from kimi_convert import cli, enginecheck
    from kimi_convert.verify import Report

    main = "sglang.srt.models.minimax_m3_vl.MiniMaxM3SparseForConditionalGeneration"

    def fake(draft_class):
        def check(output_dir, engine, *, python, any_version, source, draft, trust_remote_code=False):
            cls = draft_class if draft else main
            return SimpleNamespace(model_class=cls, version="0.5.23", loads=not draft, verdict="skipped 127",
                                   load_verdict="loads", seconds=1.0, numerics=None, mtp_skipped=[{"tensor": "x"}])
        return check

    monkeypatch.setattr(enginecheck, "resolve", lambda *a: None)
    monkeypatch.setattr(enginecheck, "check", fake(main))
    rep = Report()
    reports = cli._engine_checks(rep, "out", ("sglang",), None, False, None, True, False)
    assert rep.ok and [r.model_class for r in reports] == [main]
    assert any("draft: none for MiniMaxM3SparseForConditionalGeneration" in name for name, _, _ in rep.checks)
    monkeypatch.setattr(enginecheck, "check", fake("sglang.srt.models.x_nextn.XForCausalLMNextN"))
    rep = Report()
    assert len(cli._engine_checks(rep, "out", ("sglang",), None, False, None, True, False)) == 2
    assert not rep.ok and rep.problems == ["skipped 127"]


def test_an_engine_that_refuses_the_draft_method_has_no_draft(monkeypatch):
    """vLLM 0.33 and A.X K1: its speculative config maps axk1 to no MTP model and refuses the method before any model
    exists ("NotImplementedError: Unsupported speculative method: 'mtp'", config/speculative.py __post_init__):
    verify-manifest says vLLM has no draft and does not fail the checkpoint; any other failure to build the draft
    still fails it."""
    from types import SimpleNamespace

    from kimi_convert import cli, enginecheck
    from kimi_convert.verify import Report

    main = "vllm.model_executor.models.AXK1.AXK1ForCausalLM"

    def fake(error):
        def check(output_dir, engine, *, python, any_version, source, draft, trust_remote_code=False):
            if not draft:
                return SimpleNamespace(model_class=main, version="0.33.0", loads=True, verdict="loads", loaded=True,
                                       load_verdict="loads", seconds=1.0, numerics=None, mtp_skipped=[{"tensor": "x"}],
                                       error=None)
            return SimpleNamespace(model_class=None, version="0.33.0", loads=False, verdict=f"draft: {error[1]}",
                                   loaded=False, load_verdict="no", seconds=1.0, numerics=None, mtp_skipped=[],
                                   error={"type": error[0], "message": error[1]})
        return check

    monkeypatch.setattr(enginecheck, "resolve", lambda *a: None)
    monkeypatch.setattr(enginecheck, "check", fake(("NotImplementedError", "Unsupported speculative method: 'mtp'")))
    rep = Report()
    assert [r.model_class for r in cli._engine_checks(rep, "out", ("vllm",), None, False, None, True, False)] == [main]
    assert rep.ok and any("draft: none for AXK1ForCausalLM" in name for name, _, _ in rep.checks)
    monkeypatch.setattr(enginecheck, "check", fake(("RuntimeError", "CUDA out of memory")))
    rep = Report()
    cli._engine_checks(rep, "out", ("vllm",), None, False, None, True, False)
    assert not rep.ok
