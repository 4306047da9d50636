"""pack end to end: every output byte checked against its sources through an independent path.

Outputs are read with the safetensors library (not the tool's reader), NVFP4 tensors are compared
bit for bit with tests/oracle.py quantizing the fused sources, kept and copied tensors byte for byte
with their sources, and the exclude list is re-read with the engines' matching rules.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

import oracle
from helpers import (
    blake3_hex,
    copy_ckpt,
    interpreter_note,
    manifest_with_modules,
    one_line_error,
    replace_tensor,
    run,
)
from kimi_convert.engine_rules import sglang_is_excluded, vllm_is_skipped
from kimi_convert.mapping import builtin_by_name


def load_all(folder: Path) -> dict[str, torch.Tensor]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    out = {}
    for f in sorted(set(index["weight_map"].values())):
        with safe_open(str(folder / f), framework="pt") as h:
            for k in h.keys():  # noqa: SIM118 - safe_open is not a dict
                out[k] = h.get_tensor(k)
                assert index["weight_map"][k] == f
    return out


def manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def source_values(src: dict, inp: dict[str, torch.Tensor]) -> np.ndarray:
    if src["encoding"] == "mxfp4":
        packed, scale = (inp[p["name"]].numpy() for p in src["parts"])
        return oracle.decode_mxfp4(packed, scale)
    if src["encoding"] == "fp8_block":
        w, s = (oracle.to_f32(inp[p["name"]]) for p in src["parts"])
        full = np.repeat(np.repeat(s, 128, 0), 128, 1)[: w.shape[0], : w.shape[1]]
        return (w * full).astype(np.float32)
    return oracle.to_f32(inp[src["name"]])


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


@pytest.mark.parametrize("which", ["k3", "kl", "ds"])
def test_every_output_tensor_against_its_sources(which, request):
    inp_dir = request.getfixturevalue({"k3": "tiny_k3", "kl": "tiny_kl", "ds": "tiny_ds"}[which])
    out_dir = request.getfixturevalue({"k3": "packed_k3", "kl": "packed_kl", "ds": "packed_ds"}[which])
    inp, out, man = load_all(inp_dir), load_all(out_dir), manifest_with_modules(out_dir)
    modules = man["modules"]
    assert sorted(t["name"] for m in modules for t in m["tensors"]) == sorted(out)
    shared: dict[str, float] = {}
    for m in modules:
        if m["kind"] == "nvfp4" and m["quantization"]["shared_scale"]:
            vals = [source_values(s, inp) for s in m["sources"]]
            key = m["quantization"]["shared_scale"]
            shared[key] = max(shared.get(key, 0.0), max(float(np.abs(v).max()) for v in vals))
    n_nvfp4 = n_exact = 0
    for m in modules:
        name = m["name"]
        if m["kind"] == "nvfp4" and m["quantization"]["method"] == "mxfp4-cast":
            n_exact += m["quantization"]["lossless_blocks"] == m["quantization"]["blocks"]
            check_cast(m, inp, out)
        elif m["kind"] == "nvfp4":
            n_nvfp4 += 1
            vals = [source_values(s, inp) for s in m["sources"]]
            fused = np.concatenate([v.reshape(-1, v.shape[-1]) for v in vals])
            amax = shared.get(m["quantization"]["shared_scale"])
            p, s, s2 = oracle.quantize(fused, amax)
            w, ws, ws2 = out[f"{name}.weight"], out[f"{name}.weight_scale"], out[f"{name}.weight_scale_2"]
            assert w.dtype == torch.uint8 and ws.dtype == torch.float8_e4m3fn and ws2.dtype == torch.float32
            assert ws2.shape == () and w.shape[-1] * 2 == fused.shape[-1]
            np.testing.assert_array_equal(w.reshape(-1, w.shape[-1]).numpy(), p, err_msg=name)
            np.testing.assert_array_equal(ws.view(torch.uint8).reshape(p.shape[0], -1).numpy(), s, err_msg=name)
            assert ws2.numpy().tobytes() == s2.tobytes(), name
            deq = oracle.dequantize(w.reshape(-1, w.shape[-1]).numpy(), ws.view(torch.uint8).reshape(p.shape[0], -1)
                                    .numpy(), float(ws2))
            rel = np.linalg.norm(deq - fused) / max(np.linalg.norm(fused), 1e-30)
            assert rel < 0.2, (name, rel)
            # each manifest row range slices the fused rows back to exactly its source's quantization
            joint = amax if amax is not None else np.abs(fused).max()
            for src, v in zip(m["sources"], vals, strict=True):
                a, b = src["rows"]
                sp, _, _ = oracle.quantize(v.reshape(-1, v.shape[-1]), joint)
                np.testing.assert_array_equal(w.reshape(-1, w.shape[-1]).numpy()[a:b], sp, err_msg=src["name"])
        else:
            t = out[m["tensors"][0]["name"]]
            srcs = m["sources"]
            if all(s["encoding"] == "dense" for s in srcs):
                # kept and copied tensors: byte-identical to the concatenated sources
                assert raw_bytes(t) == b"".join(raw_bytes(inp[s["name"]]) for s in srcs), name
                for s in srcs:
                    a, b = s["rows"]
                    part = t[a:b] if m["op"] == "cat" else (t[a] if m["op"] == "stack" else t)
                    assert raw_bytes(part) == raw_bytes(inp[s["name"]]), s["name"]
            else:
                want = np.concatenate([source_values(s, inp) for s in srcs])
                assert t.dtype == torch.bfloat16
                np.testing.assert_array_equal(t.float().numpy(), want)
    assert n_nvfp4 >= 10
    if which == "ds":  # FP8 scales are consumed, never copied
        assert not [k for k in out if k.endswith("weight_scale_inv")]
        # every FP8 weight is re-quantized, and kv_a_proj_with_mqa (bf16 here) is found as a linear layer by shape
        assert all(s["encoding"] == "fp8_block" or m["name"].endswith("kv_a_proj_with_mqa")
                   for m in modules if m["kind"] == "nvfp4" for s in m["sources"])
        assert sum(m["name"].endswith("kv_a_proj_with_mqa") and m["kind"] == "nvfp4" for m in modules) == 3
    if which == "k3":  # MXFP4 experts: all but the one planted with a too-wide exponent span are exact
        n_experts = sum(".experts." in m["name"] for m in modules if m["kind"] == "nvfp4")
        assert n_experts > 30 and n_exact == n_experts - 1
        wide = next(m for m in modules if m["name"].endswith("layers.1.block_sparse_moe.experts.0.w2"))
        q = wide["quantization"]
        assert q["method"] == "mxfp4-cast" and q["blocks"] - q["lossless_blocks"] == 1


def check_cast(m: dict, inp: dict, out: dict) -> None:
    """NVIDIA's cast: power-of-two global scale shared by w1/w3, and every value of a lossless tensor
    identical to the source's (codes kept but for negative zeros); a lossy tensor's other blocks too."""
    name = m["name"]
    (src,) = m["sources"]
    packed, scale = (inp[p["name"]].numpy() for p in src["parts"])
    w, ws, ws2 = out[f"{name}.weight"].numpy(), out[f"{name}.weight_scale"], float(out[f"{name}.weight_scale_2"])
    assert np.log2(ws2) == int(np.log2(ws2))
    deq = oracle.dequantize(w, ws.view(torch.uint8).numpy(), ws2)
    want = oracle.decode_mxfp4(packed, scale).astype(np.float64)
    same = (deq == want).reshape(w.shape[0], -1, 32).all(-1)
    assert int((~same).sum()) == m["quantization"]["blocks"] - m["quantization"]["lossless_blocks"], name
    if m["quantization"]["lossless_blocks"] == m["quantization"]["blocks"]:
        lo, hi = packed & 0xF, packed >> 4
        lo, hi = np.where(lo == 8, 0, lo), np.where(hi == 8, 0, hi)
        np.testing.assert_array_equal(w, (lo | (hi << 4)).astype(np.uint8))
    if m["quantization"]["shared_scale"]:
        mate = name[:-1] + ("3" if name.endswith("1") else "1")
        assert float(out[f"{mate}.weight_scale_2"]) == ws2


def test_manifest_records_hashes_and_provenance(tiny_k3, packed_k3):
    man = manifest_with_modules(packed_k3)
    assert man["tool"]["name"] == "kimi-convert" and man["mapping"]["name"] == "kimi_k3"
    assert man["mapping"]["sha256"] == hashlib.sha256((Path(__file__).parents[1] / "mappings/kimi_k3.toml")
                                                      .read_bytes()).hexdigest()
    # every file by BLAKE3 under its own key: a local input, an output packed without --upload
    for f in man["inputs"]:
        data = (tiny_k3 / f["file"]).read_bytes()
        assert f["size"] == len(data) and f["blake3"] == blake3_hex(data) and "sha256" not in f
    for f in [*man["outputs"], *man["records"], *man["files"]]:
        data = (packed_k3 / f["file"]).read_bytes()
        assert f["size"] == len(data) and f["blake3"] == blake3_hex(data) and "sha256" not in f
    out = load_all(packed_k3)
    inp = load_all(tiny_k3)
    fused = 0
    # tensors by BLAKE3 under its own key too (docs/output-format.md, "Digests")
    assert man["format_version"] == 5 and man["tensor_digest"] == "blake3"
    for m in man["modules"]:
        for t in m["tensors"]:
            assert t["blake3"] == blake3_hex(raw_bytes(out[t["name"]])) and "sha256" not in t
            assert t["dtype"] in ("U8", "F8_E4M3", "F32", "BF16")
        for s in m["sources"]:
            for p in s["parts"]:
                assert p["blake3"] == blake3_hex(raw_bytes(inp[p["name"]])) and "sha256" not in p
        if m.get("group"):
            fused += 1
            rows = [tuple(s["rows"]) for s in m["sources"]]
            assert rows[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(rows))
        if m["kind"] == "keep":
            assert m["rule"]
    assert fused > 0
    assert man["options"]["max_shard_size"] == 1_000_000 and man["recipe"]["name"] == "nvfp4-w4a16"


def test_index_config_and_side_files(tiny_k3, packed_k3):
    index = json.loads((packed_k3 / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1  # 400 kB shards
    total = 0
    for f in files:
        with safe_open(str(packed_k3 / f), framework="pt") as h:
            for k in h.keys():  # noqa: SIM118
                t = h.get_tensor(k)
                total += t.numel() * t.element_size()
        assert (packed_k3 / f).stat().st_size <= 1_000_000 + 100_000
        head = (packed_k3 / f).read_bytes()[:8]
        assert (8 + struct.unpack("<Q", head)[0]) % 16 == 0  # data starts 16-byte aligned
    assert index["metadata"]["total_size"] == total
    cfg = json.loads((packed_k3 / "config.json").read_text())
    q = cfg["quantization_config"]
    assert q["quant_method"] == "modelopt" and q["quant_algo"] == "W4A16_NVFP4" and q["group_size"] == 16
    hq = json.loads((packed_k3 / "hf_quant_config.json").read_text())
    assert hq["quantization"]["exclude_modules"] == q["ignore"]
    src_text = json.loads((tiny_k3 / "config.json").read_text())["text_config"]
    assert "quantization_config" in src_text  # the release's MXFP4 config sits there ...
    src_text.pop("quantization_config")  # ... and is removed, or a loader reads the NVFP4 experts as MXFP4
    assert cfg["text_config"] == src_text
    for f in ("tokenizer_config.json", "tiktoken.model", "chat_template.jinja", "configuration_kimi_k3.py"):
        assert (packed_k3 / f).read_bytes() == (tiny_k3 / f).read_bytes()
    assert not list(packed_k3.rglob("*.partial"))


def written_formats(folder: Path) -> dict[str, str]:
    """Each ``X.weight`` of the output -> 'nvfp4' when the files hold it as NVIDIA's NVFP4 (a U8 weight with
    ``weight_scale`` and ``weight_scale_2`` beside it), else its dtype; read with safetensors, not the manifest."""
    dtypes: dict[str, str] = {}
    for f in sorted(set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values())):
        with safe_open(str(folder / f), framework="pt") as h:
            for k in h.keys():  # noqa: SIM118 - safe_open is not a dict
                dtypes[k] = h.get_slice(k).get_dtype()
    return {k[: -len(".weight")]: "nvfp4" if v == "U8" and {f"{k}_scale", f"{k}_scale_2"} <= dtypes.keys() else v
            for k, v in dtypes.items() if k.endswith(".weight")}


@pytest.mark.parametrize("which", ["k3", "kl", "ds"])
def test_exclude_list_read_by_engine_rules_selects_exactly_kept(which, request):
    """What each engine reads (the exclude list of config.json and hf_quant_config.json) selects exactly the
    layers the files hold unquantized: the formats come from the files, the engines' layers from the
    mapping table's fused groups, neither from the manifest's own kinds (which verify-manifest checks)."""
    out_dir = request.getfixturevalue({"k3": "packed_k3", "kl": "packed_kl", "ds": "packed_ds"}[which])
    man = manifest_with_modules(out_dir)
    m = builtin_by_name(man["mapping"]["name"])
    ignore = json.loads((out_dir / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    assert json.loads((out_dir / "config.json").read_text())["quantization_config"]["ignore"] == ignore
    assert not any("*" in e or "?" in e for e in ignore)
    formats = written_formats(out_dir)
    packed = {g.name: list(g.members) for g in m.groups}
    linear = [mod["name"] for mod in man["modules"] if mod["kind"] in ("nvfp4", "keep")]  # the linear layers
    engine_modules: dict[str, bool] = {}
    experts: dict[str, list[bool]] = {}
    for name in linear:
        kept = formats[name] != "nvfp4"
        assert kept == (formats[name] in ("BF16", "F16", "F32")), (name, formats[name])  # NVFP4 or high precision
        engine_modules[name] = kept
        if ".experts." in name:
            experts.setdefault(name.rsplit(".", 2)[0], []).append(kept)
    engine_modules.update({k: all(v) for k, v in experts.items()})
    assert any(engine_modules.values()) and not all(engine_modules.values())
    for prefix, kept in engine_modules.items():
        assert vllm_is_skipped(prefix, ignore, packed) == kept, prefix
        assert sglang_is_excluded(prefix, ignore, m.text_prefix) == kept, prefix


def test_verify_catches_an_exclude_entry_the_engines_misread(packed_kl, tmp_path):
    """A planted defect only the engine-rules check can see: the exclude list gains ``o_proj``, consistently in
    the manifest, config.json and hf_quant_config.json (their hashes rewritten): vLLM's substring test and
    SGLang's per-part match would then skip every o_proj, which the files hold in NVFP4."""
    import shutil

    from kimi_convert.verify import verify

    out = Path(shutil.copytree(packed_kl, tmp_path / "out"))
    assert verify(out).ok
    man = manifest(out)
    man["exclude_modules"].append("o_proj")
    for f, key in (("config.json", ("quantization_config", "ignore")),
                   ("hf_quant_config.json", ("quantization", "exclude_modules"))):
        cfg = json.loads((out / f).read_text())
        cfg[key[0]][key[1]].append("o_proj")
        (out / f).write_text(json.dumps(cfg))
        rec = next(r for r in man["files"] if r["file"] == f)
        rec["size"], rec["blake3"] = (out / f).stat().st_size, blake3_hex((out / f).read_bytes())
    (out / "manifest.json").write_text(json.dumps(man))
    rep = verify(out)
    failed = [name for name, ok, _ in rep.checks if not ok]
    assert failed == ["exclude list / quantized_layers under vLLM's and SGLang's matching rules"], rep.problems
    o_projs = [n for n, f in written_formats(out).items() if n.endswith(".o_proj") and f == "nvfp4"]
    assert o_projs
    for name in o_projs:
        assert f"vllm would skip {name}, which is written nvfp4" in rep.problems
        assert f"sglang would skip {name}, which is written nvfp4" in rep.problems


def test_nvidia_style_excludes_in_output(tiny_k3, tmp_path):
    f = tmp_path / "nv.json"
    f.write_text(json.dumps({"quantization": {"exclude_modules": [
        f"language_model.model.layers.{i}.self_attn.{x}_conv1d" for i in (0, 1, 3) for x in "qkv"]}}))
    r = run("pack", tiny_k3, tmp_path / "o", "--exclude-from", f, "-q", "--recipe", "nvfp4-w4a16", "--layout", "sglang")
    assert r.code == 0, r.stderr
    ex = json.loads((tmp_path / "o/hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    for x in ("qkv_conv1d", "q_conv1d", "k_conv1d", "v_conv1d"):
        assert f"language_model.model.layers.1.self_attn.{x}" in ex


def _tree(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {p.relative_to(folder).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file()}


def test_deterministic_and_input_untouched(tiny_kl, tmp_path):
    before = _tree(tiny_kl)
    for d in ("a", "b"):
        assert run("pack", tiny_kl, tmp_path / d, "-q").code == 0
    a, b = _tree(tmp_path / "a"), _tree(tmp_path / "b")
    assert sorted(a) == sorted(b) and "docs/deploy_guidance.md" in a
    for n in a:
        assert a[n][0] == b[n][0], n
    assert _tree(tiny_kl) == before


def test_triton_path_gives_the_same_output(tiny_kl, packed_kl, tmp_path, monkeypatch):
    """A whole pack through the Triton kernel (interpreted here; compiled on the GPU) == the CPU kernel's."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kimi_convert.pack import pack
    from kimi_convert.plan import Options
    pack(tiny_kl, tmp_path / "t", Options(), device="triton", progress=False)
    a, b = _tree(packed_kl), _tree(tmp_path / "t")
    assert sorted(a) == sorted(b)
    for n in a:
        assert a[n][0] == b[n][0], f"{n}: {interpreter_note()}"


def test_output_folder_refusals(tiny_kl, tmp_path):
    assert "must not be the input folder" in one_line_error(run("pack", tiny_kl, tiny_kl))
    assert "inside it" in one_line_error(run("pack", tiny_kl, tiny_kl / "sub"))
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("x")
    err = one_line_error(run("pack", tiny_kl, tmp_path / "busy", "-q"))
    assert "not empty" in err and "--overwrite" in err
    r = run("pack", tiny_kl, tmp_path / "busy", "-q", "--overwrite")
    assert r.code == 0 and (tmp_path / "busy" / "keep.txt").exists()
    assert not os.path.exists(tiny_kl / "sub")


def test_nan_in_weight_is_bad_input(tiny_kl, tmp_path):
    from safetensors.torch import load_file

    ck = copy_ckpt(tiny_kl, tmp_path / "c")
    name = "model.layers.1.self_attn.o_proj.weight"
    index = json.loads((ck / "model.safetensors.index.json").read_text())
    bad = load_file(str(ck / index["weight_map"][name]))[name].clone()
    bad[3, 5] = float("nan")
    replace_tensor(ck, name, bad)
    out = tmp_path / "o"
    assert f"tensor {name}: holds NaN or Inf" in one_line_error(run("pack", ck, out, "-q"))
    assert not (out / "manifest.json").exists()
    # with several streams (4 CPUs a stream) another may have finished its shard before the stop: kept whole and
    # journaled for --resume, never a shard under its final name that is not
    shards = list(out.glob("*.safetensors"))
    if shards:
        done = json.loads((out / ".kimi-convert-pack.json").read_text())["shards"]
        assert all("blake3:" + blake3_hex(p.read_bytes()) == done[p.name]["digest"] for p in shards)
