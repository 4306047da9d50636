"""gpt-oss presets: the stored layout is the release's (openai/gpt-oss-20b's index, docs/families.md
"gpt-oss"), and the 3-D MXFP4 banks decode (by the OCP MX rule, written out here) to the weights they
were quantized from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from helpers import blake3_hex, entry_matches, synth_preset, tensor_bytes, tree, write_synth
from kimi_convert.synth import config

#: E2M1 code -> value (OCP MX spec, table of FP4 E2M1), low nibble first as transformers'
#: integrations/mxfp4.py convert_moe_packed_tensors reads the release.
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _tiny() -> SimpleNamespace:
    """tiny-gpt-oss's sizes, from the config.json it writes."""
    cfg = config(synth_preset("tiny-gpt-oss"))
    return SimpleNamespace(experts=cfg["num_local_experts"], moe_inter=cfg["intermediate_size"],
                           hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"])


def _release_layer(i: int, h: int, inter: int, e: int, heads: int, kv: int, hd: int) -> dict:
    """One layer of gpt-oss-20b's model.safetensors.index.json, with its shapes and dtypes."""
    p = f"model.layers.{i}"
    out = {f"{p}.input_layernorm.weight": ("BF16", [h]), f"{p}.post_attention_layernorm.weight": ("BF16", [h]),
           f"{p}.mlp.router.weight": ("BF16", [e, h]), f"{p}.mlp.router.bias": ("BF16", [e]),
           f"{p}.self_attn.sinks": ("BF16", [heads])}
    for name, rows, cols in (("q_proj", heads * hd, h), ("k_proj", kv * hd, h), ("v_proj", kv * hd, h),
                             ("o_proj", h, heads * hd)):
        out[f"{p}.self_attn.{name}.weight"] = ("BF16", [rows, cols])
        out[f"{p}.self_attn.{name}.bias"] = ("BF16", [rows])
    for name, n, k in (("gate_up_proj", 2 * inter, h), ("down_proj", h, inter)):
        out[f"{p}.mlp.experts.{name}_blocks"] = ("U8", [e, n, k // 32, 16])
        out[f"{p}.mlp.experts.{name}_scales"] = ("U8", [e, n, k // 32])
        out[f"{p}.mlp.experts.{name}_bias"] = ("BF16", [e, n])
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_synth("tiny-gpt-oss", tmp_path_factory.mktemp("gptoss") / "src")


def _stored(folder) -> dict:
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for fname in sorted(set(index.values())):
        with safe_open(str(folder / fname), "pt") as f:
            for k in f.keys():  # noqa: SIM118
                s = f.get_slice(k)
                out[k] = (s.get_dtype(), list(s.get_shape()))
    assert set(out) == set(index)
    return out


def test_tiny_is_the_release_layout(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["architectures"] == ["GptOssForCausalLM"] and cfg["quantization_config"]["quant_method"] == "mxfp4"
    h, inter, e = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"]
    want = {"model.embed_tokens.weight": ("BF16", [cfg["vocab_size"], h]), "model.norm.weight": ("BF16", [h]),
            "lm_head.weight": ("BF16", [cfg["vocab_size"], h])}
    for i in range(cfg["num_hidden_layers"]):
        want.update(_release_layer(i, h, inter, e, cfg["num_attention_heads"], cfg["num_key_value_heads"],
                                   cfg["head_dim"]))
    assert _stored(tiny) == want


def _decode(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    lut = torch.tensor(E2M1)
    lo, hi = (blocks & 0x0F).long(), (blocks >> 4).long()
    vals = torch.stack([lut[lo], lut[hi]], dim=-1).flatten(-2)  # [.., K/32, 32]
    vals = vals * torch.exp2(scales.float() - 127).unsqueeze(-1)
    return vals.flatten(-2)


def test_banks_decode_to_their_experts_weights(tiny):
    """Each expert's [2I, H] gate_up matrix (rows interleaved as stored) is its seeded weight within
    MXFP4's bound (half a code step at the block's scale: 1/4 of the block scale, times 2 at the top)."""
    from kimi_convert.synth import weight

    name = "model.layers.0.mlp.experts.gate_up_proj"
    with safe_open(str(tiny / "model-00000-of-00001.safetensors"), "pt") as f:
        w = _decode(f.get_tensor(f"{name}_blocks"), f.get_tensor(f"{name}_scales"))
        scales = f.get_tensor(f"{name}_scales")
    p = _tiny()
    assert w.shape == (p.experts, 2 * p.moe_inter, p.hidden)
    for x in range(p.experts):
        ref = weight(f"{name}.{x}", (2 * p.moe_inter, p.hidden), 0, torch.float32)
        step = torch.exp2(scales[x].float() - 127).repeat_interleave(32, dim=-1)
        assert ((w[x] - ref).abs() <= step + 1e-12).all()


# -- conversion: the MXFP4 banks cast to NVFP4 per expert (convert/encodings/gpt_oss_mxfp4.py) ----------------

E4M3_KMAX = 8  # NVIDIA's closed form: weight_scale_2 = 2^(k_max - 8), k_max over the bank's E8M0 scales


def _load(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update((k, h.get_tensor(k)) for k in h.keys())  # noqa: SIM118
    return out


def _nvfp4_values(packed: torch.Tensor, scale: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """NVFP4 as the engines dequantize it: E2M1 code (low nibble first) x e4m3 block scale (16) x scale_2."""
    lut = torch.tensor(E2M1)
    codes = torch.stack([lut[(packed & 0x0F).long()], lut[(packed >> 4).long()]], dim=-1).flatten(-2)
    return codes * scale.float().repeat_interleave(16, dim=-1) * s2.float()


@pytest.fixture(scope="module")
def packed(tiny, tmp_path_factory):
    from helpers import run

    out = tmp_path_factory.mktemp("gptoss-out") / "out"
    r = run("pack", tiny, out, "-q", "--device", "cpu")
    assert r.code == 0, r.stderr
    return out


def test_default_pack_casts_each_expert_from_its_bank(tiny, packed):
    """Every expert's gate (even rows of gate_up), up (odd rows) and down weight, dequantized as the engines
    do, equals the source's MXFP4 values (decoded here by the OCP rule) on every block but the one the preset
    planted 2^-24 below its bank; weight_scale_2 is 2^(k_max - 8) with k_max the whole bank's, though the
    experts' own k_max differ (so a per-expert scale would differ); the biases are the bank's rows."""
    src, out = _load(tiny), _load(packed)
    p = _tiny()
    own_differs = False
    inexact = 0
    for li in range(p.layers):
        pre = f"model.layers.{li}.mlp.experts"
        for bank, leaves in (("gate_up_proj", (("gate_proj", 0), ("up_proj", 1))),
                             ("down_proj", (("down_proj", None),))):
            blocks, scales, bias = (src[f"{pre}.{bank}_{s}"] for s in ("blocks", "scales", "bias"))
            k_max = int(scales.max()) - 127
            values = _decode(blocks, scales)
            for x in range(p.experts):
                for leaf, half in leaves:
                    rows = slice(None) if half is None else slice(half, None, 2)
                    m = f"{pre}.{x}.{leaf}"
                    s2 = out[f"{m}.weight_scale_2"]
                    assert s2.dtype == torch.float32 and float(s2) == 2.0 ** (k_max - E4M3_KMAX), m
                    own_differs |= int(scales[x][rows].max()) - 127 != k_max
                    got = _nvfp4_values(out[f"{m}.weight"], out[f"{m}.weight_scale"], s2)
                    want = values[x][rows]
                    bad = (got != want).reshape(want.shape[0], -1, 32).any(-1)
                    inexact += int(bad.sum())
                    assert torch.equal(out[f"{m}.bias"], bias[x][rows]), m
                    assert float(out[f"{m}.input_scale"]) == 1.0
    assert own_differs, "the preset must have experts whose own k_max is below their bank's"
    assert inexact == 1  # the planted block (presets/gpt_oss.toml: last layer, expert 0, down_proj)
    for name in src:
        if "mlp.experts" not in name:
            assert torch.equal(out[name], src[name]), name  # attention, router, norms, embed, lm_head as stored


def test_output_config_names_what_stays_unquantized(packed):
    cfg = json.loads((packed / "config.json").read_text())
    q = cfg["quantization_config"]
    assert (q["quant_method"], q["quant_algo"]) == ("modelopt", "W4A16_NVFP4")
    ignore = set(q["ignore"])
    for li in range(_tiny().layers):
        assert {f"model.layers.{li}.mlp.router", *(f"model.layers.{li}.self_attn.{x}_proj" for x in "qkvo")} <= ignore
    assert "lm_head" in ignore and not any("experts" in n for n in ignore)


def test_manifest_records_views_and_expert_parts(packed, tiny):
    """Gate and up of one expert read the same parts (the expert's bytes of the bank, named NAME[e]) and are
    told apart by their views; the whole-bank scales (for k_max) are a part of their own. Each part's BLAKE3 is
    that of its bytes: the bank's, or expert e's slice of it."""
    recs = [json.loads(line) for f in sorted((packed / "manifest-records").glob("*"))
            for line in f.read_text().splitlines()]
    by = {r["name"]: r for r in recs}
    pre = "model.layers.0.mlp.experts"
    gate, up = (by[f"{pre}.2.{x}"]["sources"][0] for x in ("gate_proj", "up_proj"))
    names = [q["name"] for q in gate["parts"]]
    assert names == [f"{pre}.gate_up_proj_blocks[2]", f"{pre}.gate_up_proj_scales[2]", f"{pre}.gate_up_proj_scales"]
    assert [q["name"] for q in up["parts"]] == names
    assert (gate["view"], up["view"]) == ([[0, 0, None, 2]], [[0, 1, None, 2]])
    stored = tensor_bytes(tiny)  # NAME[e]: expert e's rows of the bank NAME
    assert len(stored[names[0]]) * _tiny().experts == len(stored[names[0].removesuffix("[2]")])
    assert [q["blake3"] for q in gate["parts"]] == [blake3_hex(stored[q["name"]]) for q in gate["parts"]]
    assert len({q["blake3"] for q in gate["parts"]}) == 3 and "sha256" not in gate["parts"][0]
    assert "view" not in by[f"{pre}.2.down_proj"]["sources"][0]
    q = by[f"{pre}.2.gate_proj"]["quantization"]
    assert q["method"] == "mxfp4-cast" and q["blocks"] == q["lossless_blocks"] > 0


def test_output_verifies_against_its_input(tiny, packed):
    from helpers import run

    r = run("verify-manifest", packed, "--input", tiny)
    assert r.code == 0, r.stdout + r.stderr


@pytest.mark.parametrize("case", ["scales-without-blocks", "blocks-shape", "odd-gate-up", "nan-scale"])
def test_malformed_bank_is_one_line_error(tiny, tmp_path, case):
    from helpers import copy_ckpt, one_line_error, rewrite_tensors, run

    src = copy_ckpt(tiny, tmp_path / "src")
    name = "model.layers.0.mlp.experts.gate_up_proj"

    def fn(t):
        if f"{name}_blocks" not in t:
            return
        if case == "scales-without-blocks":
            del t[f"{name}_blocks"]
        elif case == "nan-scale":  # E8M0 0xFF is NaN (OCP MX): in another expert than the first
            t[f"{name}_scales"][3, 5, 0] = 255
        elif case == "blocks-shape":
            t[f"{name}_blocks"] = t[f"{name}_blocks"].reshape(*t[f"{name}_blocks"].shape[:2], -1)
        else:
            for s in ("blocks", "scales", "bias"):
                t[f"{name}_{s}"] = t[f"{name}_{s}"][:, :-1].contiguous()

    rewrite_tensors(src, fn)
    err = one_line_error(run("pack", src, tmp_path / "out", "-q"))
    want = {"scales-without-blocks": f"tensor {name}_scales: MXFP4 scales without their {name}_blocks",
            "blocks-shape": f"tensor {name}_blocks: MXFP4 expert bank must be U8 [E, N, K/32, 16]",
            "odd-gate-up": f"tensor {name}_blocks: gate_up_proj has 511 rows",
            "nan-scale": f"tensor {name}_scales"}[case]
    assert want in err, err
    if case == "nan-scale":
        assert "0xFF" in err or "NaN" in err, err


# -- NVIDIA Model Optimizer's own cast (examples/hf_ptq/cast_mxfp4_to_nvfp4.py, PR #1372) as the peer --------

REPO = Path(__file__).resolve().parents[1]


def _peer() -> tuple[str, Path] | str:
    """(peer python, Model Optimizer checkout), or why the peer cannot run here."""
    py = os.environ.get("KIMI_CONVERT_PEER_PYTHON") or str(REPO / ".venv-peer" / "bin" / "python")
    repo = os.environ.get("KIMI_CONVERT_MODELOPT_REPO")
    if not repo or not (Path(repo) / "examples/hf_ptq/cast_mxfp4_to_nvfp4.py").is_file():
        return ("KIMI_CONVERT_MODELOPT_REPO names no Model Optimizer checkout with "
                "examples/hf_ptq/cast_mxfp4_to_nvfp4.py")
    if not Path(py).is_file():
        return f"no peer python at {py} (scripts/gptoss-peer-env.sh makes one; or set KIMI_CONVERT_PEER_PYTHON)"
    r = subprocess.run([py, "-c", "import modelopt.torch.quantization, transformers"], capture_output=True)
    if r.returncode:
        return f"{py} cannot import nvidia-modelopt and transformers"
    return py, Path(repo)


def test_byte_identical_to_modelopts_own_cast(tiny, packed, tmp_path):
    """ModelOpt's cast, run as its hf_ptq.py --cast_mxfp4_to_nvfp4 runs it (benchmarks/gptoss_modelopt_peer.py),
    on the same input: every tensor of ours is byte-identical to its part of ModelOpt's (input_scale apart:
    calibrated there, pinned here), every byte of ModelOpt's is one of ours, and the lossless-block counts
    are the same (ModelOpt's as its script prints it)."""
    peer = _peer()
    if isinstance(peer, str):
        pytest.skip(peer)
    sys.path.insert(0, str(REPO / "benchmarks"))
    import compare_gptoss_cast as cmp

    theirs = tmp_path / "modelopt"
    lossless = cmp.run_peer(peer[0], peer[1], tiny, theirs)
    r = cmp.compare(packed, theirs)
    r.theirs_lossless = lossless
    assert r.ok, r.summary()
    assert r.byte_identical == r.ours_tensors - r.input_scales_not_compared
    assert lossless[1] - lossless[0] == 1  # the one planted block, by ModelOpt's own count


def test_input_hashes_from_overlapping_reads(tiny, packed, tmp_path):
    """Each expert's unit reads its rows of a bank's scales and the whole scales (for the bank's k_max): reads
    that overlap. With the file hashes taken from the pipeline's reads (no eager head start), the pack is the
    same bytes and the manifest's input digests are the files' (the overlapping bytes read by the hash itself)."""

    from kimi_convert.pack import pack
    from kimi_convert.plan import Options
    from kimi_convert.tuning import Tuning

    # no eager head start (and no eager share of the start-up readahead), small pieces, a tiny budget
    tuning = Tuning(eager_hash=0, startup_readahead=0, slice_bytes=4096, read_ahead=1, min_in_flight=1)
    out = tmp_path / "out"
    r = pack(tiny, out, Options(), device="cpu", progress=False, streams=2, tuning=tuning)
    assert r.stats.hashed_from_pipeline > 0
    assert tree(out) == tree(packed)
    man = json.loads((out / "manifest.json").read_text())
    inputs = {f["file"]: f for f in man["inputs"]}
    assert inputs and all(entry_matches(e, (tiny / f).read_bytes()) for f, e in inputs.items())


def test_inspect_reads_the_experts_from_the_banks(tiny):
    """inspect counts the experts of a 3-D bank (no false "no expert weights" warning) and gives one
    expert's gate weight [I, H] (gate_up_proj_blocks [E, 2I, H/32, 16])."""
    from helpers import run

    r = run("inspect", tiny)
    assert r.code == 0, r.stderr
    p = _tiny()
    assert f"{p.experts} experts per layer, expert gate weight [{p.moe_inter}, {p.hidden}]" in r.stdout
    assert "warning" not in r.stdout
