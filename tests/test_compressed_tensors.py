"""The compressed-tensors output format: its arithmetic, its tensors and config, and byte-identity with
llm-compressor's ``model_free_ptq`` (the peer).

The peer test runs ``benchmarks/compare_llmcompressor.py`` and is skipped, with the reason, where the peer's
python is absent (``KIMI_CONVERT_LLMC_PYTHON``, default /work/peers/llmc/bin/python; ``scripts/peer-env.sh``
creates it). ``PEER_INPUTS``: Kimi Linear and Qwen3 MoE (BF16), and DeepSeek V3's FP8 blocks, which the peer reads
only decoded (by transformers' own FP8 dequantization: ``PEER_DECODE``) while this tool packs the FP8 input itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from helpers import one_line_error, run, spec
from kimi_convert.kernels import ct_nvfp4

ROOT = Path(__file__).resolve().parents[1]
PEER_PY = os.environ.get("KIMI_CONVERT_LLMC_PYTHON", "/work/peers/llmc/bin/python")
#: synth presets the peer is compared on (and the --exclude each needs on both sides)
PEER_INPUTS = {"tiny-kimi-linear": [], "tiny-qwen3-moe": [], "tiny-deepseek-v3": []}
#: presets the peer is given decoded (compare_llmcompressor.py --decode-fp8): to the dtype the FP8 decode is exact in
PEER_DECODE = {"tiny-deepseek-v3": "float32"}


def _e4m3(v: float) -> int:
    return int(torch.tensor(v).to(torch.float8_e4m3fn).view(torch.uint8))


def test_global_scale_is_rounded_to_the_weights_dtype():
    # 2688 / bf16(0.3) = 2688 / 0.30078125 = 8936.7; bf16 keeps 8 significant bits: 8960 (steps of 64 there)
    a = torch.tensor(0.3, dtype=torch.bfloat16).float()
    assert float(ct_nvfp4.global_scale(a, torch.bfloat16)) == 8960.0
    assert float(ct_nvfp4.global_scale(a, torch.float32)) == pytest.approx(2688 / 0.30078125, rel=1e-7)
    # all zero: clamped to bf16's tiny, 2688 / tiny overflows bf16, NaN/Inf -> 1.0
    assert float(ct_nvfp4.global_scale(torch.tensor(0.0), torch.bfloat16)) == 1.0


def test_zero_block_scale_and_negative_zero_code():
    w = torch.zeros(1, 32, dtype=torch.bfloat16)
    w[0, 16] = 6.0  # block 1: amax 6 -> global 448 and block scale 448 * 6 / 6 = 448
    w[0, 17] = -0.001  # rounds to zero: compressed-tensors keeps its sign (code 8)
    w[0, 18] = 3.0
    packed, scales = ct_nvfp4.quantize(w, ct_nvfp4.global_scale(w.abs().amax().float(), w.dtype))
    assert scales.view(torch.uint8).tolist() == [[_e4m3(0.125), _e4m3(448.0)]]  # block 0 all zero -> 0.125
    codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(1, 32)
    assert codes[0, :16].tolist() == [0] * 16
    assert codes[0, 16:19].tolist() == [7, 8, 5]  # 6.0, -0 (sign kept), 3.0


@pytest.fixture(scope="module")
def kl(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ct") / "kl"
    assert run("synth", "tiny-kimi-linear", out).code == 0
    return out


def test_format_flag_writes_compressed_tensors(kl, tmp_path):
    out = tmp_path / "out"
    r = run("pack", kl, out, "-q", "--device", "cpu", "--format", "compressed-tensors")
    assert r.code == 0, r.stderr
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (q["quant_method"], q["format"], q["quantization_status"]) == (
        "compressed-tensors", "nvfp4-pack-quantized", "compressed")
    assert list(q["config_groups"]) == ["NVFP4A16"] and "model.embed_tokens" in q["ignore"]
    assert not (out / "hf_quant_config.json").exists()
    name = "model.layers.1.block_sparse_moe.experts.0.w1"
    shard = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"][f"{name}.weight_packed"]
    with safe_open(out / shard, "pt") as f:
        assert f.get_tensor(f"{name}.weight_packed").dtype == torch.uint8
        assert f.get_tensor(f"{name}.weight_scale").dtype == torch.float8_e4m3fn
        g = f.get_tensor(f"{name}.weight_global_scale")
        assert g.shape == (1,) and g.dtype == torch.float32
        assert f"{name}.input_global_scale" not in set(f.keys())  # the W4A16 recipe's input_scale is ModelOpt's only
    man = json.loads((out / "manifest.json").read_text())
    assert man["options"]["format"] == "compressed-tensors"
    assert run("verify-manifest", out, "--input", kl).code == 0


def test_format_flag_refuses_a_recipe_it_cannot_spell(kl, tmp_path):
    k3 = tmp_path / "k3"
    assert run("synth", "tiny-k3", k3).code == 0
    err = one_line_error(run("plan", k3, "--format", "compressed-tensors"))
    assert "nvidia-k3" in err and "fp8-block" in err


def _peer_absent() -> str | None:
    return None if Path(PEER_PY).exists() else f"llm-compressor's python {PEER_PY} absent (scripts/peer-env.sh)"


@pytest.mark.slow
@pytest.mark.skipif(_peer_absent() is not None, reason=_peer_absent() or "")
@pytest.mark.parametrize("preset", sorted(PEER_INPUTS))
def test_byte_identical_to_model_free_ptq(preset, tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "compare_llmcompressor.py"), "--preset", spec(preset),
           "--work", str(tmp_path), "--json", str(tmp_path / "report.json")]
    for e in PEER_INPUTS[preset]:
        cmd += ["--exclude", e]
    if preset in PEER_DECODE:
        probe = subprocess.run([PEER_PY, "-c", "from transformers.integrations.finegrained_fp8 import Fp8Dequantize; "
                                "Fp8Dequantize._dequantize_one"], capture_output=True, text=True, timeout=300)
        if probe.returncode != 0:
            pytest.skip(f"the peer's transformers has no Fp8Dequantize._dequantize_one: {probe.stderr.strip()[-200:]}")
        cmd += ["--decode-fp8", PEER_DECODE[preset]]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["config_equal"] and not rep["unexplained"] and not rep["only_ours"] and not rep["only_peer"]
    assert rep["same_group_tensors_equal"] > 0 and rep["equal"] + len(rep["differ"]) == rep["tensors_ours"]
    # every differing tensor is in a module whose global-scale group this tool widens to the engine's
    assert all(any(m in n for m in rep["group_differs"]) for n in rep["differ"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_c_kernel_gives_the_torch_bytes(dtype):
    """The CPU backend's C kernel (nvfp4_cpu.c: kc_ct_quant_mt) against ct_nvfp4's torch steps, over magnitudes
    from subnormal block scales to saturated ones, zero blocks, -0.0 and negative values that round to zero."""
    from kimi_convert.devices import get_backend

    backend = get_backend("cpu")
    gen = torch.Generator().manual_seed(5)
    for scale in (1e-30, 1e-6, 0.02, 1.0, 300.0):
        w = (torch.randn(96, 512, generator=gen) * scale).to(dtype)
        w[0, :16] = 0
        w[1, 3] = -0.0
        w[2, :8] = -1e-9 * scale
        w[3] *= torch.logspace(-8, 0, 512, dtype=torch.float32).to(dtype)  # blocks far below the tensor's amax
        g = ct_nvfp4.global_scale(w.abs().amax().float(), w.dtype)
        p1, s1 = ct_nvfp4.quantize(w, g)
        p2, s2 = backend.quantize_ct(w, g)
        assert torch.equal(p1, p2) and torch.equal(s1.view(torch.uint8), s2.view(torch.uint8)), scale


def test_constant_activation_scale_is_input_global_scale(kl, tmp_path):
    """A compressed-tensors recipe that pins an activation scale: ``input_global_scale`` is its reciprocal (the
    format's divisor convention) and those modules form the NVFP4 group, named exactly."""
    recipe = tmp_path / "ct-a4.toml"
    recipe.write_text('name = "ct-a4"\noutput_format = "compressed-tensors"\nquant_method = "compressed-tensors"\n'
                      'quant_algo = "NVFP4"\n[[rule]]\nexperts = true\nformat = "nvfp4"\ninput_scale = 0.5\n'
                      '[[rule]]\nmodules = ["*"]\nformat = "nvfp4"\n')
    out = tmp_path / "out"
    assert run("pack", kl, out, "-q", "--device", "cpu", "--recipe", recipe).code == 0
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    name = "model.layers.1.block_sparse_moe.experts.0.w1"
    assert name in q["config_groups"]["NVFP4"]["targets"]
    assert q["config_groups"]["NVFP4"]["input_activations"]["dynamic"] == "local"
    assert q["config_groups"]["NVFP4A16"]["targets"] == ["Linear"]
    shard = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"][f"{name}.input_global_scale"]
    with safe_open(out / shard, "pt") as f:
        assert f.get_tensor(f"{name}.input_global_scale").tolist() == [2.0]
