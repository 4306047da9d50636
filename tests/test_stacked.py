"""Stacked expert banks (a mapping table's ``[stacked]``): routed experts an engine reads only as 3-D banks
(vLLM 0.33's Step-3 text and Step 5 loaders: docs/stacked-banks.md) are written as 3-D NVFP4 banks with one global
scale per expert. Held to the per-expert path: each expert's slice of a stacked bank must be, byte for byte, what
``pack`` writes for the same weights stored one module per expert (the path held to NVIDIA's converter elsewhere),
gate and up sharing expert e's global scale as a ``w13`` scale group does."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import edit_config, one_line_error, read_tensors, replace_tensor, run, spec

PRESET = "tiny-step3-text"
BANKS = ("gate_proj", "up_proj", "down_proj")

_LAYOUTS = """
[layout.vllm]
formats = []
reason = "test table"

[layout.sglang]
formats = []
reason = "test table"
"""

_COMMON = """
architectures = ["Step3TextForCausalLM"]
model_types = ["step3_text"]
not_linear = ["model.embed_tokens"]
""" + _LAYOUTS + """
[[keep]]
pattern = "model.layers.*.moe.gate"
reason = "the router"

[[group]]
name = "gate_up_proj"
members = ["gate_proj", "up_proj"]
parents = ["model.layers.{layer}.mlp", "model.layers.{layer}.share_expert"]
"""

STACKED = 'name = "test-stacked"' + _COMMON + """
[stacked]
modules = ["model.layers.*.moe.gate_proj", "model.layers.*.moe.up_proj", "model.layers.*.moe.down_proj"]
experts = "moe_num_experts"
reason = "test: the engine reads the routed experts only as 3-D banks"

[[scale_group]]
name = "w13"
members = ["gate_proj", "up_proj"]
parents = ["model.layers.{layer}.moe"]
same_rows = true

[moe]
experts = "moe_num_experts"
members = ["down_proj", "gate_proj", "up_proj"]
layers = "model.layers.{layer}"
num_layers = "num_hidden_layers"
moe_list = "moe_layers_enum"
"""

PER_EXPERT = 'name = "test-per-expert"\nexpert_sets = ["model.layers.{layer}.moe.experts"]' + _COMMON + """

[[scale_group]]
name = "w13"
members = ["gate_proj", "up_proj"]
parents = ["model.layers.{layer}.moe.experts.{expert}"]
same_rows = true
"""


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    w = tmp_path_factory.mktemp("stacked")
    assert run("synth", spec(PRESET), w / "src").code == 0
    (w / "stacked.toml").write_text(STACKED)
    (w / "per_expert.toml").write_text(PER_EXPERT)
    _split_banks(w / "src", w / "split")
    r = run("pack", w / "src", w / "out", "--mapping", w / "stacked.toml", "-q")
    assert r.code == 0, r.stderr
    return w


def _split_banks(src: Path, dst: Path) -> None:
    """The same checkpoint with each 3-D bank stored one module per expert (``moe.experts.E.gate_proj``): the input
    of the per-expert path."""
    dst.mkdir()
    index = json.loads((src / "model.safetensors.index.json").read_text())
    wm = {}
    for f in sorted(set(index["weight_map"].values())):
        out = {}
        for name, t in load_file(src / f).items():
            bank = next((b for b in BANKS if name.endswith(f".moe.{b}.weight")), None)
            if bank is None:
                out[name] = t
                continue
            layer = name[: -len(f"{bank}.weight")]
            out.update({f"{layer}experts.{e}.{bank}.weight": t[e].clone() for e in range(t.shape[0])})
        save_file(out, dst / f, metadata={"format": "pt"})
        wm.update(dict.fromkeys(out, f))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    (dst / "config.json").write_text((src / "config.json").read_text())


def test_a_stacked_bank_is_each_experts_module_stacked(work):
    """Expert e's codes, block scales and global scale in each stacked bank are the per-expert path's bytes for
    ``experts.e`` of the same layer (gate and up under one global scale per expert, down alone)."""
    r = run("pack", work / "split", work / "per", "--mapping", work / "per_expert.toml", "-q")
    assert r.code == 0, r.stderr
    stacked, per = read_tensors(work / "out"), read_tensors(work / "per")
    experts = json.loads((work / "src" / "config.json").read_text())["moe_num_experts"]
    for bank in BANKS:
        w = stacked[f"model.layers.1.moe.{bank}.weight"]
        assert w.dtype == torch.uint8 and w.shape[0] == experts
        for suffix in ("weight", "weight_scale", "weight_scale_2"):
            got = stacked[f"model.layers.1.moe.{bank}.{suffix}"]
            assert got.shape[0] == experts, (bank, suffix, got.shape)
            for e in range(experts):
                want = per[f"model.layers.1.moe.experts.{e}.{bank}.{suffix}"]
                assert _same(got[e].reshape(-1), want.reshape(-1)), (bank, suffix, e)
    s2 = {b: stacked[f"model.layers.1.moe.{b}.weight_scale_2"] for b in BANKS}
    assert torch.equal(s2["gate_proj"], s2["up_proj"])  # one per expert, shared by gate and up (vLLM's w13)
    assert len(set(s2["gate_proj"].tolist())) > 1  # not one scale for the whole bank


def test_the_manifest_records_each_experts_amax_and_verifies(work):
    """The record names the expert count and every expert's amax; ``verify-manifest --input --full`` re-quantizes
    every bank (the torch code) to the bytes pack wrote (the C kernels), and the exclude list passes the engines'
    rules with the banks folded into their experts module."""
    man = json.loads((work / "out" / "manifest.json").read_text())
    recs = [json.loads(line) for f in (work / "out" / "manifest-records").iterdir()
            for line in f.read_text().splitlines() if line.strip().startswith("{")]
    rec = next((m for m in recs if m.get("name") == "model.layers.1.moe.gate_proj"), None)
    if rec is None:  # records embedded in the manifest
        rec = next(m for m in man.get("modules", []) if m["name"] == "model.layers.1.moe.gate_proj")
    assert rec["experts"] == 8 and rec["kind"] == "nvfp4"
    assert len(rec["quantization"]["amax"]) == 8
    r = run("verify-manifest", work / "out", "--input", work / "src", "--full")
    assert r.code == 0, r.stdout + r.stderr
    assert "all of" in r.stdout


def test_the_torch_code_writes_the_c_kernels_bytes(work, tmp_path):
    """``--device reference`` (torch, ModelOpt's arithmetic) and the default C kernels write the same banks, and
    so do both for compressed-tensors' format."""
    r = run("pack", work / "src", tmp_path / "ref", "--mapping", work / "stacked.toml", "--device", "reference", "-q")
    assert r.code == 0, r.stderr
    a, b = read_tensors(work / "out"), read_tensors(tmp_path / "ref")
    assert a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    outs = {}
    for dev in ("cpu", "reference"):
        r = run("pack", work / "src", tmp_path / f"ct-{dev}", "--mapping", work / "stacked.toml", "--format",
                "compressed-tensors", "--device", dev, "-q")
        assert r.code == 0, r.stderr
        outs[dev] = read_tensors(tmp_path / f"ct-{dev}")
    g = outs["cpu"]["model.layers.1.moe.gate_proj.weight_global_scale"]
    assert g.shape == (8, 1)  # one per expert in compressed-tensors' scalar shape [1]
    assert all(_same(outs["cpu"][k], outs["reference"][k]) for k in outs["cpu"])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def test_a_kept_layer_of_banks_excludes_its_experts_module(work, tmp_path):
    """Kept, a layer's banks are copied as stored and the exclude list names the module the engine asks its quant
    method with (``moe.experts``); one bank kept and another quantized is refused, naming both."""
    r = run("pack", work / "src", tmp_path / "kept", "--mapping", work / "stacked.toml", "-q",
            "--exclude", "model.layers.1.moe.*")
    assert r.code == 0, r.stderr
    q = json.loads((tmp_path / "kept" / "hf_quant_config.json").read_text())["quantization"]
    assert "model.layers.1.moe.experts" in q["exclude_modules"]
    t = read_tensors(tmp_path / "kept")
    assert t["model.layers.1.moe.gate_proj.weight"].dtype == torch.bfloat16
    assert run("verify-manifest", tmp_path / "kept").code == 0
    err = one_line_error(run("pack", work / "src", tmp_path / "mixed", "--mapping", work / "stacked.toml",
                             "--exclude", "model.layers.1.moe.down_proj"))
    assert "model.layers.1.moe.gate_proj" in err and "model.layers.1.moe.down_proj" in err
    assert "model.layers.1.moe.experts" in err
    assert not (tmp_path / "mixed").exists() or not (tmp_path / "mixed" / "manifest.json").exists()


def test_a_bank_that_is_not_the_configs_experts_is_refused(work, tmp_path):
    """A bank whose first dimension is not the config's expert count (or that is not 3-D) is one line naming the
    tensor, before any output."""
    src = tmp_path / "src"
    assert run("synth", spec(PRESET), src).code == 0
    edit_config(src, lambda c: c.update(moe_num_experts=4))
    err = one_line_error(run("pack", src, tmp_path / "out", "--mapping", work / "stacked.toml"))
    assert "model.layers.1.moe." in err and "moe_num_experts" in err and "[8, " in err
    assert not (tmp_path / "out" / "manifest.json").exists()


@pytest.mark.parametrize("device", ["cpu", "reference"])
def test_a_nan_in_one_expert_of_a_bank_is_refused_naming_the_bank(work, tmp_path, device):
    """One NaN in expert 5 of a stacked bank: one line naming the stored bank and its file, from the C kernels and
    from torch alike; no manifest written."""
    src = tmp_path / "src"
    assert run("synth", spec(PRESET), src).code == 0
    name = "model.layers.1.moe.up_proj.weight"
    bank = read_tensors(src)[name].clone()
    bank[5, 3, 7] = float("nan")
    replace_tensor(src, name, bank)
    err = one_line_error(run("pack", src, tmp_path / "out", "--mapping", work / "stacked.toml", "--device", device))
    assert f"tensor {name}: holds NaN or Inf" in err and ".safetensors" in err
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_the_config_check_counts_a_layers_banks_as_its_experts(work, tmp_path):
    """``[moe]`` holds the config's MoE layers against the stored banks (``plan.consistency``): a layer the config
    calls MoE that stores no bank is one line naming it."""
    src = tmp_path / "src"
    assert run("synth", spec(PRESET), src).code == 0
    edit_config(src, lambda c: c.update(moe_layers_enum="1,2"))
    err = one_line_error(run("pack", src, tmp_path / "out", "--mapping", work / "stacked.toml"))
    assert "layer 2" in err and "model.layers.2 holds no routed experts" in err


IQUEST = """
name = "test-iquest-kept-banks"
architectures = ["IQuestQ1ForCausalLM"]
model_types = ["iquest_q1"]
not_linear = ["model.embed_tokens"]
""" + _LAYOUTS + """
[[keep]]
pattern = "model.layers.*.mlp.router"
reason = "the router"

[stacked]
modules = ["model.layers.*.mlp.experts.fc", "model.layers.*.mlp.experts.proj"]
experts = "num_experts"
keep = true
reason = "test: the engine reads the banks only in BF16"

[moe]
experts = "num_experts"
members = ["fc", "proj"]
layers = "model.layers.{layer}"
num_layers = "num_hidden_layers"
dense_list = "mlp_only_layers"

[[group]]
name = "gate_up_proj"
members = ["gate_proj", "up_proj"]
parents = ["model.layers.{layer}.mlp"]

[[group]]
name = "qkv_proj"
members = ["q_proj", "k_proj", "v_proj"]
parents = ["model.layers.{layer}.self_attn"]
"""


def test_banks_stored_without_weight_are_copied_and_their_experts_excluded(tmp_path):
    """IQuest-Q1's banks (``mlp.experts.fc`` / ``.proj``, no ``.weight``) under ``[stacked] keep = true``: copied as
    stored, byte for byte, the exclude list naming each layer's ``mlp.experts`` (what SGLang 0.5.23's ModelOpt config
    builds unquantized), the records counting the experts; without ``keep`` one line naming the bank. The config
    check counts the banks as the layer's experts: a dense layer the config calls MoE is refused."""
    src = tmp_path / "src"
    assert run("synth", spec("tiny-iquest-q1"), src).code == 0
    table = tmp_path / "iq.toml"
    table.write_text(IQUEST)
    r = run("pack", src, tmp_path / "out", "--mapping", table, "-q")
    assert r.code == 0, r.stderr
    a, b = read_tensors(src), read_tensors(tmp_path / "out")
    banks = [n for n in a if n.endswith((".mlp.experts.fc", ".mlp.experts.proj"))]
    assert banks and all(_same(a[n], b[n]) for n in banks)
    assert b["model.layers.1.self_attn.o_proj.weight"].dtype == torch.uint8  # the rest NVFP4
    q = json.loads((tmp_path / "out" / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    layers = sorted({n.split(".")[2] for n in banks}, key=int)
    assert [f"model.layers.{i}.mlp.experts" for i in layers] == [e for e in q if e.endswith(".mlp.experts")]
    assert run("verify-manifest", tmp_path / "out", "--input", src).code == 0
    table.write_text(IQUEST.replace("keep = true\n", ""))
    err = one_line_error(run("pack", src, tmp_path / "nokeep", "--mapping", table))
    assert "model.layers.1.mlp.experts.fc" in err and "keep = true" in err
    table.write_text(IQUEST)
    edit_config(src, lambda c: c.update(mlp_only_layers=[0, 3]))
    err = one_line_error(run("pack", src, tmp_path / "dense", "--mapping", table))
    assert "layer 3" in err and "model.layers.3.mlp.experts" in err


def test_a_kept_stacked_table_keeps_weight_banks_too(work, tmp_path):
    """``keep = true`` over banks stored as ``X.weight``: every bank kept BF16, each layer's experts module
    excluded, nothing of them quantized."""
    table = tmp_path / "kept.toml"
    kept = STACKED.replace('experts = "moe_num_experts"\nreason', 'experts = "moe_num_experts"\nkeep = true\nreason')
    assert kept != STACKED
    table.write_text(kept)
    r = run("pack", work / "src", tmp_path / "out", "--mapping", table, "-q")
    assert r.code == 0, r.stderr
    t = read_tensors(tmp_path / "out")
    assert all(t[f"model.layers.1.moe.{b}.weight"].dtype == torch.bfloat16 for b in BANKS)
    q = json.loads((tmp_path / "out" / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    assert "model.layers.1.moe.experts" in q


@pytest.mark.parametrize("device", ["cpu", "reference"])
def test_a_bank_larger_than_a_slice_streams_a_run_of_experts_at_a_time(work, tmp_path, device):
    """A stacked unit larger than ``Tuning.slice_bytes`` is read, computed and written a run of experts at a time
    (a release's [352, 1536, 4096] bank is 4.4 GB: as one piece it alone would pass the memory budget), and the
    output is the same files, byte for byte, as the unit computed whole (the CLI's pack above, one piece a bank),
    manifest records included (every expert's amax, in order), for the C kernels and the torch code."""
    from kimi_convert import pipeline
    from kimi_convert.pack import load_plan, pack
    from kimi_convert.plan import Options
    from kimi_convert.tuning import Tuning

    opts = Options(mapping=str(work / "stacked.toml"))
    ckpt, plan = load_plan(work / "src", opts)
    stacked = [u for u in plan.units if u.items[0].experts]
    one_expert = min(p.nbytes for u in stacked for p in u.parts) // 8
    cut = 3 * one_expert  # runs of one to three experts, the last one short
    ps = pipeline.pieces(list(plan.units), {f: i for i, f in enumerate(ckpt.files)}, slice_bytes=cut)
    runs = [pc for pc in ps if pc.experts is not None]
    assert len(runs) > len(stacked)  # the banks were cut
    assert all(pc.nbytes <= cut or pc.unit.items[0].experts == 1 for pc in runs)
    for u in stacked:  # every expert once, in order, and the reads cover each part's bytes once
        mine = [pc for pc in runs if pc.unit.items[0].name == u.items[0].name]
        assert mine[0].experts.lo == 0 and mine[-1].experts.hi == 8
        assert all(a.experts.hi == b.experts.lo for a, b in itertools.pairwise(mine))
        assert [pc.last for pc in mine] == [False] * (len(mine) - 1) + [True]
    pack(work / "src", tmp_path / "runs", opts, device=device, progress=False, tuning=Tuning(slice_bytes=cut))
    want, got = work / "out", tmp_path / "runs"
    for f in sorted(p.name for p in want.glob("*.safetensors")):
        assert (got / f).read_bytes() == (want / f).read_bytes(), f
    for f in sorted((want / "manifest-records").iterdir()):
        assert (got / "manifest-records" / f.name).read_bytes() == f.read_bytes(), f.name
    r = run("verify-manifest", got, "--input", work / "src", "--full")
    assert r.code == 0, r.stdout + r.stderr


def test_expert_runs_write_compressed_tensors_banks_as_the_whole_unit(work, tmp_path):
    """compressed-tensors' stacked banks (global scales [E, 1], packed codes, block scales) cut into runs of one expert
    are the files the whole unit writes, byte for byte."""
    from kimi_convert.pack import load_plan, pack
    from kimi_convert.pipeline.slicing import expert_runs
    from kimi_convert.plan import Options
    from kimi_convert.tuning import Tuning

    opts = Options(mapping=str(work / "stacked.toml"), format="compressed-tensors")
    _, plan = load_plan(work / "src", opts)
    one = min(p.nbytes for u in plan.units if u.items[0].experts for p in u.parts) // 8  # the smallest bank's expert
    assert all(len(expert_runs(u, one)) == 8 for u in plan.units if u.items[0].experts)  # one expert a run
    pack(work / "src", tmp_path / "whole", opts, device="cpu", progress=False)
    pack(work / "src", tmp_path / "runs", opts, device="cpu", progress=False, tuning=Tuning(slice_bytes=one))
    names = sorted(p.name for p in (tmp_path / "whole").glob("*.safetensors"))
    assert names and names == sorted(p.name for p in (tmp_path / "runs").glob("*.safetensors"))
    for f in names:
        assert (tmp_path / "runs" / f).read_bytes() == (tmp_path / "whole" / f).read_bytes(), f
    assert read_tensors(tmp_path / "runs")["model.layers.1.moe.gate_proj.weight_global_scale"].shape == (8, 1)


def _fp8_banks(src: Path, dst: Path, decoded: Path | None = None) -> None:
    """``src`` with each 3-D bank stored as block FP8 (F8_E4M3 [E, N, K] and its ``weight_scale_inv`` F32 [E, N/128,
    K/128], the loader's expert mapping taking both: vLLM 0.33 step3_text.py matches ``.moe.gate_proj.weight`` in
    either name) under an fp8 ``quantization_config``; with ``decoded``, also the same checkpoint holding each bank's
    exact decoded values as F32 (code x its tile's scale)."""
    for d in (dst, decoded):
        if d is not None:
            d.mkdir()
    index = json.loads((src / "model.safetensors.index.json").read_text())
    wm, wm_dec = {}, {}
    for f in sorted(set(index["weight_map"].values())):
        out, dec = {}, {}
        for name, t in load_file(src / f).items():
            if not (name.endswith(tuple(f".moe.{b}.weight" for b in BANKS)) and t.dim() == 3):
                out[name] = dec[name] = t
                continue
            e, n, k = t.shape
            tiles = t.float().reshape(e, n // 128, 128, k // 128, 128)
            scale = tiles.abs().amax(dim=(2, 4)).clamp(min=1e-4) / 448.0
            codes = (tiles / scale[:, :, None, :, None]).to(torch.float8_e4m3fn)
            out[name], out[f"{name}_scale_inv"] = codes.reshape(e, n, k), scale
            dec[name] = (codes.float() * scale[:, :, None, :, None]).reshape(e, n, k)
        save_file(out, dst / f, metadata={"format": "pt"})
        wm.update(dict.fromkeys(out, f))
        if decoded is not None:
            save_file(dec, decoded / f, metadata={"format": "pt"})
            wm_dec.update(dict.fromkeys(dec, f))
    config = json.loads((src / "config.json").read_text())
    for d, m, c in ((dst, wm, {**config, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                                 "weight_block_size": [128, 128]}}),
                    (decoded, wm_dec, config)):
        if d is not None:
            (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": m}))
            (d / "config.json").write_text(json.dumps(c))


def test_a_bank_stored_as_block_fp8_quantizes_as_its_decoded_values(work, tmp_path):
    """A stacked bank stored as block FP8 (a release's FP8 checkpoint of a model whose engine reads banks: Step-3's
    stepfun-ai/step3-fp8) is decoded expert by expert, exactly, and quantized: each bank's codes, block and global
    scales are the bytes the same bank stored as its decoded F32 values gives, by the C kernels (from the codes, a row
    at a time) and by the torch code alike, whole or a run of experts at a time; ``verify-manifest --full`` re-derives
    them; a layer kept decodes its banks to BF16 [E, N, K], the same from both; a NaN tile scale in one expert is
    refused in one line naming the scale tensor and the expert, by both."""
    from kimi_convert.pack import pack
    from kimi_convert.plan import Options
    from kimi_convert.tuning import Tuning

    _fp8_banks(work / "src", tmp_path / "fp8", tmp_path / "dec")
    for src in ("fp8", "dec"):
        r = run("pack", tmp_path / src, tmp_path / f"{src}-out", "--mapping", work / "stacked.toml", "-q")
        assert r.code == 0, r.stderr
    got, want = read_tensors(tmp_path / "fp8-out"), read_tensors(tmp_path / "dec-out")
    banks = [k for k in want if ".moe." in k and any(f".{b}." in k for b in BANKS)]
    assert len(banks) == 9 and all(_same(got[k], want[k]) for k in banks)
    pack(tmp_path / "fp8", tmp_path / "runs", Options(mapping=str(work / "stacked.toml")), device="cpu",
         progress=False, tuning=Tuning(slice_bytes=64 << 10))
    runs = read_tensors(tmp_path / "runs")
    assert runs.keys() == got.keys() and all(_same(runs[k], got[k]) for k in got)
    r = run("verify-manifest", tmp_path / "fp8-out", "--input", tmp_path / "fp8", "--full")
    assert r.code == 0, r.stdout + r.stderr
    kept = {}
    for dev in ("cpu", "reference"):
        r = run("pack", tmp_path / "fp8", tmp_path / f"ref-{dev}", "--mapping", work / "stacked.toml", "-q",
                "--device", dev)
        assert r.code == 0, r.stderr
        r = run("pack", tmp_path / "fp8", tmp_path / f"kept-{dev}", "--mapping", work / "stacked.toml", "-q",
                "--device", dev, "--exclude", "model.layers.1.moe.*_proj")
        assert r.code == 0, r.stderr
        kept[dev] = read_tensors(tmp_path / f"kept-{dev}")
    ref = read_tensors(tmp_path / "ref-reference")
    assert ref.keys() == got.keys() and all(_same(ref[k], got[k]) for k in got)
    bank = kept["cpu"]["model.layers.1.moe.gate_proj.weight"]
    assert bank.dtype == torch.bfloat16 and bank.shape == (8, 128, 256)
    assert kept["cpu"].keys() == kept["reference"].keys()
    assert all(_same(kept["cpu"][k], kept["reference"][k]) for k in kept["cpu"])

    name = "model.layers.1.moe.up_proj.weight_scale_inv"
    scale = read_tensors(tmp_path / "fp8")[name].clone()
    scale[5, 0, 1] = float("nan")
    replace_tensor(tmp_path / "fp8", name, scale)
    for dev in ("cpu", "reference"):
        err = one_line_error(run("pack", tmp_path / "fp8", tmp_path / f"bad-{dev}", "--mapping",
                                 work / "stacked.toml", "--device", dev))
        assert name in err and "expert 5" in err, (dev, err)
        assert not (tmp_path / f"bad-{dev}" / "manifest.json").exists()
