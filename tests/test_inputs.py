"""Inputs that are refused before any work: converted checkpoints (ours, ModelOpt's, llm-compressor's,
GPTQ-style), each with one line that says what the input is and what to do, exit 2, nothing written."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import copy_ckpt, edit_config, one_line_error, rewrite_tensors, run


def _refused(args, tmp_path, *needles):
    out = tmp_path / "never"
    for cmd in (["plan", *args], ["pack", *args, out]):
        r = run(*cmd)
        err = one_line_error(r)
        assert r.stdout == "", (cmd, r.stdout)
        for n in needles:
            assert n in err, (n, err)
    assert not out.exists(), "refused before any output was created"
    return err


def test_own_output_is_refused(packed_k3, tmp_path):
    msg = _refused([packed_k3], tmp_path, "output of kimi-convert", "original", "verify-manifest")
    assert str(packed_k3) in msg


def test_modelopt_checkpoint_is_refused(tiny_k3, tmp_path):
    ck = copy_ckpt(tiny_k3, tmp_path / "mo")
    (ck / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "NVFP4"}}))
    _refused([ck], tmp_path, "NVIDIA Model Optimizer", "quant_algo NVFP4", "original")


@pytest.mark.parametrize("qc, needle", [
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "modelopt, NVFP4"),
    ({"quant_method": "gptq", "bits": 4}, "gptq, 4"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
      "config_groups": {"group_0": {"format": "nvfp4-pack-quantized"}}}, "nvfp4-pack-quantized"),
])
def test_quantization_config_of_a_converted_checkpoint_is_refused(tiny_kl, tmp_path, qc, needle):
    ck = copy_ckpt(tiny_kl, tmp_path / "q")
    edit_config(ck, lambda c: c.__setitem__("quantization_config", qc))
    _refused([ck], tmp_path, "config.json: quantization_config", needle)


def test_quantized_tensors_are_refused_without_any_config_hint(tiny_kl, tmp_path):
    """The dtypes alone give it away: a U8 weight with a weight_scale (ModelOpt's NVFP4 on disk)."""
    ck = copy_ckpt(tiny_kl, tmp_path / "t")
    name = "model.layers.0.self_attn.o_proj"

    def pack_one(t):
        w = t.pop(f"{name}.weight")
        t[f"{name}.weight"] = torch.zeros(w.shape[0], w.shape[1] // 2, dtype=torch.uint8)
        t[f"{name}.weight_scale"] = torch.ones(w.shape[0], w.shape[1] // 16).to(torch.float8_e4m3fn)
    rewrite_tensors(ck, lambda t: pack_one(t) if f"{name}.weight" in t else None)
    _refused([ck], tmp_path, f"tensor {name}.weight", "already quantized", "U8")


def test_source_formats_are_accepted(tiny_k3, tiny_ds):
    """K3's MXFP4 release and DeepSeek's block FP8 are what the tool reads: never refused."""
    for ck in (tiny_k3, tiny_ds):
        r = run("plan", ck)
        assert r.code == 0, r.stderr


# ---- a mapping table that does not fit the model: a warning naming the entry, an error with --strict

def _user_mapping(tmp_path, edit):
    from kimi_convert.mapping import builtin_by_name
    text = edit(builtin_by_name("kimi_linear").source)
    path = tmp_path / "mine.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("edit, needle", [
    (lambda t: t.replace('linear = ["*_conv1d"]', 'linear = ["*_conv1d", "*.no_such_conv"]'),
     "linear '*.no_such_conv' matches no module"),
    (lambda t: t.replace('parents = ["model.layers.{layer}.block_sparse_moe.experts.{expert}"]',
                         'parents = ["model.layer.{layer}.moe.experts.{expert}"]'),
     "parents 'model.layer.{layer}.moe.experts.{expert}' matches no module"),
    (lambda t: t.replace('architectures = ["KimiLinearForCausalLM"]', 'architectures = ["BertModel"]')
                .replace('model_types = ["kimi_linear"]', 'model_types = ["bert"]'),
     "is for BertModel, bert; config.json says KimiLinearForCausalLM"),
])
def test_mapping_entries_that_match_nothing_warn_and_fail_with_strict(tiny_kl, tmp_path, edit, needle):
    mine = _user_mapping(tmp_path, edit)
    assert mine.read_text() != _user_mapping(tmp_path / "..", lambda t: t).read_text(), "the edit applied"
    r = run("plan", tiny_kl, "--mapping", mine)
    assert r.code == 0, r.stderr
    warned = [ln for ln in r.stderr.splitlines() if ln.startswith("kimi-convert: warning:") and needle in ln]
    assert len(warned) == 1 and str(mine) in warned[0], r.stderr
    out = tmp_path / "out"
    err = one_line_error(run("pack", tiny_kl, out, "--mapping", mine, "--strict"))
    assert needle in err and "--strict" in err, err
    assert not out.exists()


def test_builtin_tables_fit_their_presets(tiny_k3, tiny_kl, tiny_ds):
    for ck in (tiny_k3, tiny_kl, tiny_ds):
        r = run("plan", ck, "--strict")
        assert r.code == 0 and r.stderr == "", r.stderr


def test_unknown_mapping_name_lists_the_tables(tiny_kl):
    err = one_line_error(run("plan", tiny_kl, "--mapping", "kimi_k4"))
    assert "no such table" in err and "kimi_k3, kimi_linear" in err


# ---- exclusion patterns: warn only for what names nothing

def test_reusing_an_outputs_exclude_list_warns_only_for_names_absent_from_the_input(tiny_k3, packed_k3):
    hq = packed_k3 / "hf_quant_config.json"
    r = run("plan", tiny_k3, "--exclude-from", hq, "--exclude", "lm_head", "--exclude", "nothing.here")
    assert r.code == 0, r.stderr
    warnings = [ln for ln in r.stderr.splitlines() if ln.startswith("kimi-convert: warning:")]
    names = json.loads(hq.read_text())["quantization"]["exclude_modules"]
    from kimi_convert.checkpoint import open_checkpoint
    from kimi_convert.globs import match
    modules = {n.rpartition(".")[0] for n in open_checkpoint(tiny_k3).tensors}
    absent = [p for p in names if not any(match(p, mod, "language_model.") for mod in modules)]
    assert any("'nothing.here' (--exclude) matches no module" in w for w in warnings)
    assert all(repr(p) in "".join(warnings) for p in absent)
    assert "lm_head" not in "".join(warnings), "lm_head exists: it is kept anyway, not unmatched"
    assert len(warnings) == 2, warnings  # one line for --exclude, one for the file
    notes = [ln for ln in (r.stdout + r.stderr).splitlines() if "kept anyway" in ln]
    assert len(notes) == 1, notes  # said once, as a plan note


# ---- a model no preset wrote: a sentence-transformers BERT with a user mapping table

BERT_MAPPING = '''
name = "bert"
description = "BERT encoder (sentence-transformers): a user table"
architectures = ["BertModel"]
model_types = ["bert"]
not_linear = ["embeddings.*"]

[[group]]
name = "qkv_proj"
members = ["query", "key", "value"]
parents = ["encoder.layer.{layer}.attention.self"]
on_disk = false
'''


def _bert(folder):
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(0)
    h, inter = 64, 128
    t = {"embeddings.word_embeddings.weight": torch.randn(100, h, generator=g),
         "embeddings.position_embeddings.weight": torch.randn(32, h, generator=g),
         "embeddings.LayerNorm.weight": torch.ones(h), "embeddings.LayerNorm.bias": torch.zeros(h)}
    for i in range(2):
        p = f"encoder.layer.{i}."
        for name, shape in (("attention.self.query", (h, h)), ("attention.self.key", (h, h)),
                            ("attention.self.value", (h, h)), ("attention.output.dense", (h, h)),
                            ("intermediate.dense", (inter, h)), ("output.dense", (h, inter))):
            t[p + name + ".weight"] = torch.randn(*shape, generator=g)
            t[p + name + ".bias"] = torch.zeros(shape[0])
    folder.mkdir()
    save_file({k: v.to(torch.bfloat16) for k, v in t.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert",
                                                    "hidden_size": h, "num_hidden_layers": 2}))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": h}))
    (folder / "modules.json").write_text(json.dumps([{"idx": 0, "path": ""}, {"idx": 1, "path": "1_Pooling"}]))
    (folder / "config_sentence_transformers.json").write_text("{}")
    return folder


def test_a_bert_with_a_user_mapping_packs_and_verifies_with_its_side_files(tmp_path):
    src = _bert(tmp_path / "bert")
    table = tmp_path / "bert.toml"
    table.write_text(BERT_MAPPING)
    r = run("plan", src, "--mapping", table, "--strict")
    assert r.code == 0, r.stderr
    out = tmp_path / "out"
    r = run("pack", src, out, "--mapping", table, "--strict", "-q", "--device", "cpu")
    assert r.code == 0, r.stderr
    for side in ("1_Pooling/config.json", "modules.json", "config_sentence_transformers.json"):
        assert (out / side).read_bytes() == (src / side).read_bytes(), side
    man = json.loads((out / "manifest.json").read_text())
    assert man["recipe"]["name"] == "nvfp4-w4a16"
    r = run("verify-manifest", out, "--input", src, "--full", "-q")
    assert r.code == 0, r.stdout + r.stderr
    (out / "1_Pooling" / "config.json").write_text("{}")
    r = run("verify-manifest", out, "-q")
    assert r.code == 1 and "1_Pooling/config.json" in r.stdout, r.stdout + r.stderr
