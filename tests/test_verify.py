"""verify-manifest: a good output verifies; every kind of tampering is caught and named."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from helpers import edit_json, one_line_error, run
from kimi_convert.safetensors_format import parse_header


def verify(*args) -> tuple[int, dict | str]:
    """``verify-manifest ARGS --json``: the exit code and the report, or the one-line error."""
    r = run("verify-manifest", *args, "--json")
    if r.code == 2:
        return r.code, one_line_error(r)
    return r.code, json.loads(r.stdout)


@pytest.fixture
def out(packed_k3, tmp_path) -> Path:
    return Path(shutil.copytree(packed_k3, tmp_path / "out"))


def problems(rep: dict) -> str:
    return "\n".join(rep["problems"])


def first_shard(folder: Path) -> Path:
    return sorted(folder.glob("model-*.safetensors"))[0]


def test_good_output_verifies_offline_and_against_input(packed_k3, tiny_k3):
    rc, rep = verify(packed_k3)
    assert rc == 0 and rep["ok"], rep
    rc, rep = verify(packed_k3, "--input", tiny_k3, "--full")
    assert rc == 0 and rep["ok"], rep
    names = [c["check"] for c in rep["checks"]]
    assert "re-plan from the input and the recorded options" in names
    assert any("all of" in c["detail"] for c in rep["checks"])


def test_tampered_byte(out):
    shard = first_shard(out)
    header, _ = parse_header(shard, shard.name)
    victim = next(t for t in header.values() if t.dtype == "U8" and t.nbytes > 64)
    data = bytearray(shard.read_bytes())
    data[victim.start + 10] ^= 0x40
    shard.write_bytes(bytes(data))
    rc, rep = verify(out)
    assert rc == 1
    assert f"{shard.name}: sha256" in problems(rep)
    assert f"tensor {victim.name}: bytes do not match" in problems(rep)


def test_missing_file(out):
    first_shard(out).unlink()  # model-00001-of-...
    rc, rep = verify(out)
    assert rc == 1 and "model-00001-of-" in problems(rep) and "missing" in problems(rep)
    (out / "tokenizer_config.json").unlink()
    rc, rep = verify(out)
    assert "tokenizer_config.json: missing" in problems(rep)


def test_renamed_tensor(out):
    shard = first_shard(out)
    data = shard.read_bytes()
    n = int.from_bytes(data[:8], "little")
    head = json.loads(data[8 : 8 + n])
    old = next(k for k in head if k != "__metadata__")
    new = old[:-1] + ("X" if old[-1] != "X" else "Y")
    text = data[8 : 8 + n].replace(json.dumps(old).encode(), json.dumps(new).encode(), 1)
    shard.write_bytes(data[:8] + text + data[8 + n :])
    rc, rep = verify(out)
    assert rc == 1
    assert f"tensor {new} is not in the manifest" in problems(rep)
    assert f"tensor {old} (in the manifest) is missing" in problems(rep)


def test_edited_config(out):
    edit_json(out / "config.json", lambda c: c["quantization_config"]["ignore"].pop(0))
    rc, rep = verify(out)
    assert rc == 1
    assert "config.json: sha256" in problems(rep)
    assert "quantization_config.ignore differs" in problems(rep)


def test_edited_manifest(out):
    man = json.loads((out / "manifest.json").read_text())
    mod = next(m for m in man["modules"] if m["kind"] == "keep" and "lm_head" in m["name"])
    edit_json(out / "manifest.json", lambda m: m["exclude_modules"].remove(mod["name"]))  # as if quantized
    rc, rep = verify(out)
    assert rc == 1
    assert "quantization_config.ignore differs from the manifest's exclude_modules" in problems(rep)
    assert f"vllm would quantize {mod['name']}" in problems(rep)
    assert f"sglang would quantize {mod['name']}" in problems(rep)


def test_index_lists_extra_tensor(out):
    name = first_shard(out).name
    edit_json(out / "model.safetensors.index.json", lambda i: i["weight_map"].update({"ghost.weight": name}))
    rc, rep = verify(out)
    assert rc == 1 and "lists ghost.weight, which the manifest does not" in problems(rep)


def test_unfinished_or_foreign_folder(out, tmp_path):
    (out / ".kimi-convert-pack.json").write_text("{}")
    rc, err = verify(out)
    assert rc == 2 and "unfinished pack" in err
    (out / ".kimi-convert-pack.json").unlink()
    (out / "manifest.json").unlink()
    rc, err = verify(out)
    assert rc == 2 and "no manifest.json" in err


def test_consistent_lie_is_caught_only_by_rederiving(out, tiny_k3):
    """Wrong NVFP4 bytes with every hash rewritten to match: offline checks pass, --input --full does not."""
    man = json.loads((out / "manifest.json").read_text())
    mod = next(m for m in man["modules"] if m["kind"] == "nvfp4" and m.get("group") == "gate_up_proj")
    t = mod["tensors"][0]
    shard = out / t["file"]
    header, _ = parse_header(shard, shard.name)
    info = header[t["name"]]
    data = bytearray(shard.read_bytes())
    data[info.start] ^= 0x11
    shard.write_bytes(bytes(data))
    t["sha256"] = hashlib.sha256(bytes(data[info.start : info.end])).hexdigest()
    for f in man["outputs"]:
        if f["file"] == t["file"]:
            f["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
    (out / "manifest.json").write_text(json.dumps(man))
    rc, rep = verify(out)
    assert rc == 0, rep
    rc, rep = verify(out, "--input", tiny_k3, "--full")
    assert rc == 1 and f"tensor {t['name']}: re-quantized from its sources, the bytes differ" in problems(rep)


def test_input_mismatch(packed_k3, tiny_k3, tmp_path):
    inp = Path(shutil.copytree(tiny_k3, tmp_path / "in"))
    shard = sorted(inp.glob("*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    rc, rep = verify(packed_k3, "--input", inp)
    assert rc == 1 and "differs from the input recorded in the manifest" in problems(rep)


def test_other_options_do_not_replan_the_same(packed_k3, tiny_k3, tmp_path):
    out = Path(shutil.copytree(packed_k3, tmp_path / "out"))
    man = json.loads((out / "manifest.json").read_text())
    man["options"]["max_shard_size"] = 10**9
    (out / "manifest.json").write_text(json.dumps(man))
    rc, rep = verify(out, "--input", tiny_k3)
    assert rc == 1 and "plan rebuilt from the input and the recorded options differs" in problems(rep)
