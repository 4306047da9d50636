"""DeepSeek V4 (``DeepseekV4ForCausalLM``): the preset laid out as the release (presets/deepseek_v4.toml), its source
encoding (MXFP4 experts I8 + F8_E8M0, block-FP8 with E8M0 ``.scale``), and NVIDIA's recipe (``nvidia-dsv4``) against
Model Optimizer's own converter. docs/families.md, "DeepSeek V4"."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from helpers import run, weight_map, write_synth

REPO = Path(__file__).resolve().parents[1]
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return write_synth("tiny-deepseek-v4", tmp_path_factory.mktemp("dsv4") / "src")


@pytest.fixture(scope="module")
def out(src: Path, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("dsv4") / "out"
    r = run("pack", str(src), str(dst), "--device", "cpu")
    assert r.code == 0, r.stderr
    return dst


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("model-*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():  # noqa: SIM118
                out[k] = h.get_tensor(k)
    return out


def test_preset_at_release_sizes_is_deepseek_v4_flash():
    """The family's own config (no preset's sizes) is DeepSeek-V4-Flash's, and its tensor list gives the release's
    counts: 69,187 tensors, 159,609,485,896 bytes (the figures a public static checker of the release holds;
    docs/families.md)."""
    import dataclasses

    from kimi_convert.synth import builtin_presets, tensors
    from kimi_convert.synth.resolve import make_preset

    family, tiny = builtin_presets()["tiny-deepseek-v4"]
    parts = [part for t in tensors(make_preset(family, dataclasses.replace(tiny, config={}))) for part in t.parts]
    size = {"BF16": 2, "F32": 4, "I64": 8, "I8": 1, "F8_E4M3": 1, "F8_E8M0": 1}
    assert len(parts) == 69187
    assert sum(math.prod(p.shape) * size[p.dtype] for p in parts) == 159_609_485_896
    names = {p.name for p in parts}
    assert "layers.2.attn.indexer.wq_b.weight" in names and "layers.3.attn.indexer.wq_b.weight" not in names
    assert "layers.0.ffn.gate.tid2eid" in names and "layers.3.ffn.gate.bias" in names
    assert "mtp.0.ffn.experts.255.w2.scale" in names and "mtp.0.emb.tok_emb.weight" not in names


def _e8m0(t: torch.Tensor) -> torch.Tensor:
    return torch.tensor([2.0 ** (int(b) - 127) for b in t.view(torch.uint8).reshape(-1)]).reshape(t.shape)


def test_decodes_as_the_format_defines(src: Path):
    """Each encoding decodes to the values DeepSeek's format defines, computed here element by element: FP8 times
    its tile's power of two; each MXFP4 byte's low nibble first, times its group's power of two."""
    from kimi_convert.checkpoint import open_checkpoint
    from kimi_convert.encodings import decode
    from kimi_convert.plan.discover import discover_sources

    ckpt = open_checkpoint(src)
    mods = discover_sources(ckpt)
    t = _tensors(src)
    fp8 = mods["layers.1.attn.wq_a"]["weight"]
    assert fp8.encoding == "dsv4_fp8"
    w, s = t["layers.1.attn.wq_a.weight"], t["layers.1.attn.wq_a.scale"]
    tile = _e8m0(s).repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
    assert torch.equal(decode(fp8, [w, s], (128, 128)), w.float() * tile)
    mx = mods["layers.2.ffn.experts.3.w2"]["weight"]
    assert mx.encoding == "dsv4_mxfp4" and mx.shape == (256, 256)
    p, s = t["layers.2.ffn.experts.3.w2.weight"], t["layers.2.ffn.experts.3.w2.scale"]
    b = p.view(torch.uint8)[0, :16]
    want = [E2M1[int(x) & 15] if i % 2 == 0 else E2M1[int(x) >> 4] for x in b for i in (0, 1)]
    got = decode(mx, [p, s], (128, 128))[0, :32]
    assert torch.equal(got, torch.tensor(want) * 2.0 ** (int(s.view(torch.uint8)[0, 0]) - 127))


def test_pack_casts_main_experts_and_keeps_the_rest_as_stored(src: Path, out: Path):
    """nvidia-dsv4: routed experts of the main layers NVFP4; attention / shared experts FP8 with their E8M0
    scales, the MTP layer's MXFP4 experts and every other tensor byte for byte as the source stores them;
    NVIDIA's config keys; the lossless count NVIDIA's rule gives (k_j >= k_max - 17 or e8m0 == 0, k_max over w1
    and w3)."""
    a, o = _tensors(src), _tensors(out)
    e = "layers.3.ffn.experts.0"
    assert o[f"{e}.w1.weight"].dtype == torch.uint8 and o[f"{e}.w1.weight_scale"].dtype == torch.float8_e4m3fn
    assert float(o[f"{e}.w1.input_scale"]) == 1.0 and f"{e}.w1.scale" not in o
    for k in ("mtp.0.ffn.experts.5.w1.weight", "mtp.0.ffn.experts.5.w1.scale", "layers.1.attn.wq_b.weight",
              "layers.1.attn.wq_b.scale", "layers.0.ffn.gate.tid2eid", "layers.2.attn.compressor.ape"):
        assert o[k].dtype == a[k].dtype and torch.equal(o[k].view(torch.uint8), a[k].view(torch.uint8)), k
    blocks = lossless = 0
    for name, t in a.items():
        if name.startswith("layers.") and ".ffn.experts." in name and name.endswith(".scale"):
            pair = [a[name.replace(".w2.", f".{w}.")] for w in ("w1", "w3")] if ".w2." not in name else [t]
            k_max = max(int(x.view(torch.uint8).max()) for x in pair) - 127
            k = t.view(torch.uint8).int() - 127
            blocks += k.numel()
            lossless += int(((k >= k_max - 17) | (t.view(torch.uint8) == 0)).sum())
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert q["quant_method"] == "fp8" and q["moe_quant_algo"] == "NVFP4" and q["quant_algo"] == "MIXED_PRECISION"
    assert q["scale_fmt"] == "ue8m0" and sorted(q["quantized_layers"]) == [f"layers.{i}.ffn.experts" for i in range(4)]
    assert q["ignore"][:4] == ["*.attn.*", "*.ffn.shared_experts.*", "head", "mtp.*"]
    assert blocks == 196608 and lossless == blocks - 1
    r = run("pack", str(src), str(out.parent / "again"), "--device", "cpu")
    assert f"MXFP4 cast: {lossless}/{blocks} blocks lossless" in r.stdout + r.stderr


def test_nvfp4_w4a16_keeps_wq_a_and_wkv_and_names_sglangs_fused_layer(src: Path, tmp_path: Path):
    """Under nvfp4-w4a16 each attention's wq_a and wkv stay unquantized (SGLang 0.5.23 deepseek_v4.py load_weights
    fuses them into wqkv_a from their weights alone, dropping NVFP4 scales: mappings/overlays/deepseek_v4.toml), and
    the exclude list names that fused layer as SGLang asks its quant method (``model.layers.N.self_attn.wqkv_a``,
    the NextN draft's ``model.decoder.self_attn.wqkv_a``) beside the checkpoint's names; wq_b stays NVFP4."""
    dst = tmp_path / "w4a16"
    r = run("pack", str(src), str(dst), "--recipe", "nvfp4-w4a16", "--device", "cpu")
    assert r.code == 0, r.stderr
    o = _tensors(dst)
    pres = ("layers.0", "layers.1", "layers.2", "layers.3", "mtp.0")
    kept = [f"{pre}.attn.{p}" for pre in pres for p in ("wq_a", "wkv")]
    for m in kept:
        assert o[f"{m}.weight"].dtype == torch.bfloat16 and f"{m}.weight_scale" not in o, m
    assert o["layers.1.attn.wq_b.weight"].dtype == torch.uint8 and "layers.1.attn.wq_b.weight_scale_2" in o
    excl = json.loads((dst / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    want = {f"model.layers.{i}.self_attn.wqkv_a" for i in range(4)} | {"model.decoder.self_attn.wqkv_a"}
    want |= {f"layers.{i}.attn.{p}" for i in range(4) for p in ("wq_a", "wkv")}
    assert want <= set(excl)
    assert not any("wq_b" in x for x in excl)


def test_nan_scale_refused_naming_the_tensor(src: Path, tmp_path: Path):
    """An E8M0 byte 0xFF (NaN) in an expert's scale: one line naming the file and tensor, exit 2, no output."""
    import shutil

    bad = shutil.copytree(src, tmp_path / "bad")
    name = weight_map(src)["layers.1.ffn.experts.2.w3.scale"]
    t = _tensors(src)
    with safe_open(str(src / name), "pt") as h:
        data = {k: t[k] for k in h.keys()}  # noqa: SIM118
    s = data["layers.1.ffn.experts.2.w3.scale"].view(torch.uint8).clone()
    s[4, 1] = 255
    data["layers.1.ffn.experts.2.w3.scale"] = s.view(torch.float8_e8m0fnu)
    save_file(data, str(bad / name), metadata={"format": "pt"})
    r = run("pack", str(bad), str(tmp_path / "o"), "--device", "cpu")
    assert r.code == 2
    line = r.stderr.strip().splitlines()[-1]
    assert name in line and "layers.1.ffn.experts.2.w3.scale" in line and "row 4, block 1" in line
    assert "Traceback" not in r.stderr and not (tmp_path / "o" / "manifest.json").exists()


def test_inspect_gives_benchmark_moe_values(src: Path):
    """transformers' DeepseekV4Config maps num_local_experts -> n_routed_experts and intermediate_size ->
    moe_intermediate_size (attribute_map), so benchmark_moe.py's Mixtral default reads DeepSeek V4's own keys."""
    r = run("inspect", str(src))
    assert "E=8 topk=2 moe_intermediate_size=256 hidden_size=256" in r.stdout
    assert "8 experts per layer, expert gate weight [256, 256]" in r.stdout


def _peer() -> tuple[str, str] | str:
    py = os.environ.get("KIMI_CONVERT_PEER_PYTHON") or str(REPO / ".venv-peer" / "bin" / "python")
    repo = os.environ.get("KIMI_CONVERT_MODELOPT_REPO")
    if not repo or not (Path(repo) / "examples/deepseek/deepseek_v4/quantize_to_nvfp4.py").is_file():
        return "KIMI_CONVERT_MODELOPT_REPO names no Model Optimizer checkout with examples/deepseek/deepseek_v4/"
    if not Path(py).is_file():
        return f"no peer python at {py} (scripts/gptoss-peer-env.sh makes one; or set KIMI_CONVERT_PEER_PYTHON)"
    return py, repo


def test_byte_identical_to_modelopts_own_converter(src: Path, tmp_path: Path):
    """Every tensor of ``pack --recipe nvidia-dsv4`` equals Model Optimizer's own
    ``quantize_to_nvfp4.py --cast_mxfp4_to_nvfp4`` output on the same input, byte for byte (the routed experts'
    NVFP4 tensors included), and both count the same lossless blocks."""
    peer = _peer()
    if isinstance(peer, str):
        pytest.skip(peer)
    py, repo = peer
    report = tmp_path / "r.json"
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "compare_dsv4_cast.py"), "--modelopt-repo", repo,
                        "--peer-python", py, "--input", str(src), "--work", str(tmp_path / "w"),
                        "--json", str(report)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads(report.read_text())
    assert r["ok"] and r["byte_identical"] == r["theirs_tensors"] == 608 and r["expert_tensors_identical"] == 384
