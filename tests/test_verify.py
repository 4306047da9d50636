"""verify-manifest: a good output verifies; every kind of tampering is caught and named."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from helpers import (
    as_format_3,
    as_format_4,
    blake3_hex,
    edit_json,
    manifest_with_modules,
    one_line_error,
    run,
    tensor_bytes,
)
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
    assert "tensors: names, dtypes, shapes and blake3" in names  # the manifest's tensor_digest
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
    assert f"{shard.name}: blake3" in problems(rep)
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
    assert "config.json: blake3" in problems(rep)
    assert "quantization_config.ignore differs" in problems(rep)


def test_edited_manifest(out):
    man = manifest_with_modules(out)
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


def test_index_names_another_file_or_is_cut_short(out):
    """The index is read an entry at a time (compared as a digest per file): a tensor moved to another
    file is still named, and a truncated index is one problem line."""
    index = out / "model.safetensors.index.json"
    good = index.read_text()
    files = sorted({f for f in json.loads(good)["weight_map"].values()})
    name = sorted(json.loads(good)["weight_map"])[5]
    was = json.loads(good)["weight_map"][name]
    other = next(f for f in files if f != was)
    edit_json(index, lambda i: i["weight_map"].update({name: other}))
    rc, rep = verify(out)
    assert rc == 1 and f"model.safetensors.index.json: {name} in {other}, manifest says {was}" in problems(rep)
    index.write_text(good[: len(good) // 2])
    rc, rep = verify(out)
    assert rc == 1 and "model.safetensors.index.json: unreadable (ValueError: " in problems(rep)


def test_unfinished_or_foreign_folder(out, tmp_path):
    (out / ".kimi-convert-pack.json").write_text("{}")
    rc, err = verify(out)
    assert rc == 2 and "unfinished pack" in err
    (out / ".kimi-convert-pack.json").unlink()
    (out / "manifest.json").unlink()
    rc, err = verify(out)
    assert rc == 2 and "no manifest.json" in err


def edit_records(out: Path, shard: str, fn, relist: bool = True) -> str:
    """Let ``fn`` change the list of ``shard``'s module records (dicts, one a line); rewrite its
    records file and, with ``relist``, manifest.json's listing of it (size, digest, count) to match,
    as a consistent forger would. Returns the records file's name."""
    man = json.loads((out / "manifest.json").read_text())
    entry = next(e for e in man["records"] if e["shard"] == shard)
    path = out / entry["file"]
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    fn(recs)
    data = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in recs).encode()
    path.write_bytes(data)
    if relist:
        entry.update(size=len(data), **{k: (blake3_hex(data) if k == "blake3" else hashlib.sha256(data).hexdigest())
                                        for k in ("blake3", "sha256") if k in entry}, modules=len(recs))
        (out / "manifest.json").write_text(json.dumps(man))
    return entry["file"]


def test_consistent_lie_is_caught_only_by_rederiving(out, tiny_k3):
    """Wrong NVFP4 bytes with every hash rewritten to match: offline checks pass, --input --full does not."""
    man = manifest_with_modules(out)
    mod = next(m for m in man["modules"] if m["kind"] == "nvfp4" and m.get("group") == "gate_up_proj")
    t = mod["tensors"][0]
    shard = out / t["file"]
    header, _ = parse_header(shard, shard.name)
    info = header[t["name"]]
    data = bytearray(shard.read_bytes())
    data[info.start] ^= 0x11
    shard.write_bytes(bytes(data))
    digest = blake3_hex(data[info.start : info.end])
    edit_records(out, t["file"], lambda recs: [x.update(blake3=digest) for r in recs for x in r["tensors"]
                                               if x["name"] == t["name"]])
    edit_json(out / "manifest.json", lambda m: [f.update(blake3=blake3_hex(data))
                                                for f in m["outputs"] if f["file"] == t["file"]])
    rc, rep = verify(out)
    assert rc == 0, rep
    rc, rep = verify(out, "--input", tiny_k3, "--full")
    assert rc == 1 and f"tensor {t['name']}: re-quantized from its sources, the bytes differ" in problems(rep)


def test_records_file_missing_truncated_or_edited(out):
    """A records file that is gone, cut short mid-line, or edited without its listing: one problem
    line naming the file (and the line where one is bad), exit 1."""
    shard = first_shard(out).name
    man = json.loads((out / "manifest.json").read_text())
    rel = next(e["file"] for e in man["records"] if e["shard"] == shard)
    path = out / rel
    good = path.read_bytes()
    path.unlink()
    rc, rep = verify(out)
    assert rc == 1 and f"{rel}: missing (the records of shard {shard})" in problems(rep)
    # the shard's tensors are then without a record: said once, not once per tensor (nor per index entry)
    n = len(parse_header(out / shard, shard)[0])
    assert f"{shard}: {n} tensor(s) without a record, {rel} being unreadable" in problems(rep)
    assert "is not in the manifest" not in problems(rep) and "lists " not in problems(rep)

    lines = good.split(b"\n")
    path.write_bytes(b"\n".join(lines[:3]) + b"\n" + lines[3][: len(lines[3]) // 2])
    rc, rep = verify(out)
    assert rc == 1 and f"{rel} line 4: truncated (no end of line)" in problems(rep)

    path.write_bytes(good)
    name = json.loads(lines[1])["tensors"][0]["name"]
    edit_records(out, shard, lambda recs: recs[1]["tensors"][0].update(blake3="0" * 64), relist=False)
    rc, rep = verify(out)
    assert rc == 1 and f"{rel}: " in problems(rep) and "(edited or truncated)" in problems(rep)
    assert f"tensor {name}: bytes do not match the manifest's blake3 ({rel} line 2)" in problems(rep)

    path.write_bytes(good[:-1] + b"x\n")  # the last line no longer JSON
    rc, rep = verify(out)
    assert rc == 1 and f"{rel} line {len(lines) - 1}: not a JSON record" in problems(rep)


def test_record_without_tensor_and_tensor_without_record(out):
    """Records rewritten consistently (listing updated): a record of a tensor the shard does not hold,
    and a tensor of the shard whose record was removed, are each named with file and line."""
    shard = first_shard(out).name
    dropped: list[str] = []

    def forge(recs: list[dict]) -> None:
        dropped.extend(t["name"] for t in recs.pop(0)["tensors"])
        ghost = json.loads(json.dumps(recs[-1]))
        ghost["name"] = ghost["tensors"][0]["name"] = "ghost.weight"
        ghost["tensors"] = ghost["tensors"][:1]
        recs.append(ghost)
    rel = edit_records(out, shard, forge)
    n = json.loads((out / "manifest.json").read_text())
    lines = next(e["modules"] for e in n["records"] if e["shard"] == shard)
    rc, rep = verify(out)
    assert rc == 1
    assert f"{shard}: tensor ghost.weight (in the manifest) is missing ({rel} line {lines})" in problems(rep)
    assert f"{shard}: tensor {dropped[0]} is not in the manifest ({rel} has no record of it)" in problems(rep)
    assert "model.safetensors.index.json: does not list ghost.weight" in problems(rep)
    assert f"model.safetensors.index.json: lists {dropped[0]}, which the manifest does not" in problems(rep)


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


#: main's HEAD when format_version 3 came: its pack writes a format_version 2 manifest (every module
#: in manifest.json), which verify-manifest no longer reads (no released output has one).
V2_COMMIT = "61ddba4"


@pytest.fixture(scope="module")
def v2_out(tiny_k3, tmp_path_factory) -> Path:
    """tiny-k3 packed by the code of V2_COMMIT, taken from git (not written by the code under test)."""
    from test_same_bytes import _old_package, _run

    tmp = tmp_path_factory.mktemp("v2")
    old = _old_package(tmp / "old", V2_COMMIT)
    if old is None:
        pytest.skip(f"no git history with commit {V2_COMMIT} to take the earlier code from")
    _run(old, "pack", tiny_k3, tmp / "out", "--device", "cpu", "-q")
    man = json.loads((tmp / "out" / "manifest.json").read_text())
    assert man["format_version"] == 2 and "modules" in man and not (tmp / "out" / "manifest-records").exists()
    return tmp / "out"


def test_a_format_2_manifest_is_refused_in_one_line(v2_out, tiny_k3):
    rc, err = verify(v2_out, "--input", tiny_k3)
    assert rc == 2 and "format_version 2" in err and "pack the input again" in err, err


#: main's HEAD before the per-tensor digests became BLAKE3 (format_version 4): its pack writes format_version 3,
#: each tensor's and source part's sha256 under ``sha256``, which verify-manifest still reads.
V3_COMMIT = "869d31a"


@pytest.fixture(scope="module")
def v3_out(tiny_k3, tmp_path_factory) -> Path:
    """tiny-k3 packed by the code of V3_COMMIT, taken from git (not written by the code under test), with
    ``packed_k3``'s options."""
    from test_same_bytes import _old_package, _run

    tmp = tmp_path_factory.mktemp("v3")
    old = _old_package(tmp / "old", V3_COMMIT)
    if old is None:
        pytest.skip(f"no git history with commit {V3_COMMIT} to take the earlier code from")
    _run(old, "pack", tiny_k3, tmp / "out", "--device", "cpu", "-q", "--max-shard-size", "1000000",
         "--recipe", "nvfp4-w4a16", "--layout", "vllm")
    man = json.loads((tmp / "out" / "manifest.json").read_text())
    assert man["format_version"] == 3 and "tensor_digest" not in man
    return tmp / "out"


def test_a_format_3_output_still_verifies_by_its_sha256(v3_out, tiny_k3, tmp_path):
    """An output of the version before BLAKE3: its records' sha256 are what verify checks, offline and against
    the input (--full: every tensor); a flipped byte and a forged record are still caught, named by sha256."""
    rc, rep = verify(v3_out)
    assert rc == 0 and rep["ok"], rep
    assert "tensors: names, dtypes, shapes and sha256" in [c["check"] for c in rep["checks"]]
    rc, rep = verify(v3_out, "--input", tiny_k3, "--full")
    assert rc == 0 and rep["ok"], rep

    out = Path(shutil.copytree(v3_out, tmp_path / "out"))
    man = manifest_with_modules(out)
    t = next(t for m in man["modules"] if m["kind"] == "nvfp4" for t in m["tensors"])
    assert "blake3" not in t and t["sha256"] == hashlib.sha256(tensor_bytes(out)[t["name"]]).hexdigest()
    edit_records(out, t["file"], lambda recs: [x.update(sha256="0" * 64) for r in recs for x in r["tensors"]
                                               if x["name"] == t["name"]])
    rc, rep = verify(out)
    assert rc == 1 and f"tensor {t['name']}: bytes do not match the manifest's sha256" in problems(rep), rep
    rc, rep = verify(out, "--input", tiny_k3, "--full")
    assert rc == 1 and f"tensor {t['name']}: re-quantized from its sources, the bytes differ" in problems(rep)


def test_this_versions_output_is_the_format_3_one_but_for_the_digests(v3_out, packed_k3, tiny_k3, tmp_path):
    """This version's output of the same input, its files' and records' BLAKE3 (each checked against the bytes)
    turned into sha256 (``as_format_3``): the records are the earlier version's, line for line, and it verifies."""
    out = Path(shutil.copytree(packed_k3, tmp_path / "out"))
    as_format_3(out, tiny_k3)
    for e in json.loads((v3_out / "manifest.json").read_text())["records"]:
        assert (out / e["file"]).read_bytes() == (v3_out / e["file"]).read_bytes(), e["file"]
    rc, rep = verify(out, "--input", tiny_k3)
    assert rc == 0 and rep["ok"], rep


def test_an_unknown_or_missing_tensor_digest_is_refused_in_one_line(out):
    edit_json(out / "manifest.json", lambda m: m.update(tensor_digest="sha3_256"))
    rc, err = verify(out)
    assert rc == 2 and "tensor_digest 'sha3_256' is not one this version knows (blake3, sha256)" in err, err
    edit_json(out / "manifest.json", lambda m: m.pop("tensor_digest"))
    rc, err = verify(out)
    assert rc == 2 and "format_version 5 without tensor_digest" in err, err


#: main's HEAD before the files' digests became BLAKE3 (format_version 5): its pack writes format_version 4, every
#: file's sha256 under ``sha256``, which verify-manifest still reads.
V4_COMMIT = "b813d8c"


def test_a_format_4_output_still_verifies_by_its_files_sha256(tiny_k3, tmp_path):
    """tiny-k3 packed by the code of V4_COMMIT (taken from git): it verifies offline and against the input, its
    files checked by the sha256 it records; an edited shard is named by sha256; and this version's output of the
    same input is the same bytes but for the manifest's file digests (``as_format_4``)."""
    from test_same_bytes import _old_package, _run

    old = _old_package(tmp_path / "old", V4_COMMIT)
    if old is None:
        pytest.skip(f"no git history with commit {V4_COMMIT} to take the earlier code from")
    args = ["--device", "cpu", "-q", "--max-shard-size", "1000000"]
    _run(old, "pack", tiny_k3, tmp_path / "v4", *args)
    _run(None, "pack", tiny_k3, tmp_path / "v5", *args)
    v4 = tmp_path / "v4"
    man = json.loads((v4 / "manifest.json").read_text())
    assert man["format_version"] == 4 and all("sha256" in e and "blake3" not in e for e in man["outputs"])
    rc, rep = verify(v4, "--input", tiny_k3)
    assert rc == 0 and rep["ok"], rep
    ours = json.loads((tmp_path / "v5" / "manifest.json").read_text())
    assert ours["format_version"] == 5 and all("blake3" in e and "sha256" not in e for e in ours["outputs"])
    assert as_format_4(tmp_path / "v5", tiny_k3) == man
    shard = v4 / man["outputs"][0]["file"]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    rc, rep = verify(v4)
    assert rc == 1 and f"{shard.name}: sha256" in problems(rep), rep
