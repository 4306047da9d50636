"""Side files: every non-weight file of the input tree is copied byte for byte (sub-folders, dot-files,
empty folders) or skipped with a reason; the manifest lists both; verify checks the copies, and with
--input that the input still hashes the same and that nothing was dropped; every output file has the
same mode."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
from pathlib import Path

import blake3
import pytest

import fault_inject
from helpers import one_line_error, run, run_process, write_synth
from kimi_convert.errors import ConvertError
from kimi_convert.pack import pack
from kimi_convert.plan import Options
from kimi_convert.sidefiles import Skipped, scan
from kimi_convert.verify import verify

#: The side files the fixture adds to tiny-kimi-linear, and their content.
ADDED = {
    "1_Pooling/config.json": b'{"word_embedding_dimension": 384, "pooling_mode_mean_tokens": true}\n',
    ".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.json -text\n",
    "tokenizer/vocab/merges.txt": b"#version: 0.2\nh e\nl l\n",
    "3_Dense/.hidden-note": b"a dot-file in a sub-folder\n",
    "empty.txt": b"",
}
#: What the fixture adds that is skipped, and why (words of the reason).
SKIPPED = {
    ".git/": "version control",
    ".cache/": "download cache",
    "__pycache__/": "bytecode",
    "tokenizer/__pycache__/": "bytecode",
    "consolidated.safetensors": "unconverted weights",
    "original/consolidated.00.pth": "unconverted weights",
    "stale.safetensors.partial": "unfinished write",
}


def digest(data: bytes) -> str:
    """A file's digest in the manifest of a local pack: BLAKE3 (the blake3 package's own)."""
    return blake3.blake3(data).hexdigest()


def add_side_tree(ck: Path) -> None:
    """A sentence-transformers-like tree, a Hub download's leftovers and an unreferenced weight file."""
    for rel, data in ADDED.items():
        (ck / rel).parent.mkdir(parents=True, exist_ok=True)
        (ck / rel).write_bytes(data)
    (ck / "2_Normalize").mkdir()  # empty, as sentence-transformers saves it
    for rel in (".git/HEAD", ".git/objects/ab/cdef", ".cache/huggingface/download/x.metadata",
                "__pycache__/m.cpython-311.pyc", "tokenizer/__pycache__/t.pyc", "original/consolidated.00.pth",
                "stale.safetensors.partial"):
        (ck / rel).parent.mkdir(parents=True, exist_ok=True)
        (ck / rel).write_bytes(b"x" * 10)
    shutil.copyfile(sorted(ck.glob("model-*.safetensors"))[0], ck / "consolidated.safetensors")
    (ck / "tokenizer" / "tokenizer.model").symlink_to("../tiktoken.model")  # inside: copied as its content


@pytest.fixture(scope="module")
def st_in(tiny_kl, tmp_path_factory) -> Path:
    ck = Path(shutil.copytree(tiny_kl, tmp_path_factory.mktemp("st") / "in", symlinks=True))
    add_side_tree(ck)
    return ck


@pytest.fixture(scope="module")
def st_out(st_in, tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("st") / "out"
    r = run("pack", st_in, out, "-q", "--device", "cpu")
    assert r.code == 0, r.stderr
    return out, r.stdout


def expected_side(ck: Path) -> dict[str, bytes]:
    """Every file of the input that should be in the output as is, found without the tool's code."""
    weights = set(json.loads((ck / "model.safetensors.index.json").read_text())["weight_map"].values())
    out = {}
    for p in ck.rglob("*"):
        rel = p.relative_to(ck).as_posix()
        if not p.is_file() or rel in weights or rel in ("config.json", "model.safetensors.index.json"):
            continue
        if any(rel == s or rel.startswith(s) for s in SKIPPED if s.endswith("/")) or rel in SKIPPED \
                or "/__pycache__/" in rel:
            continue
        out[rel] = p.read_bytes()
    return out


def test_every_side_file_copied_byte_identical_and_recorded(st_in, st_out):
    out, _ = st_out
    want = expected_side(st_in)
    assert set(ADDED) | {"tokenizer/tokenizer.model", "tiktoken.model", "docs/deploy_guidance.md"} <= set(want)
    for rel, data in want.items():
        assert (out / rel).read_bytes() == data, rel
        assert not (out / rel).is_symlink(), rel  # a symlink's content, not the link
    # the sub-folder's config.json is not the model's: copied as is, while the top-level one is rewritten
    assert (out / "1_Pooling/config.json").read_bytes() == ADDED["1_Pooling/config.json"]
    assert "quantization_config" in json.loads((out / "config.json").read_text())
    assert (out / "2_Normalize").is_dir() and not any((out / "2_Normalize").iterdir())
    man = json.loads((out / "manifest.json").read_text())
    assert man["format_version"] == 5 and man["tensor_digest"] == "blake3"  # files by BLAKE3 too (below)
    assert {e["file"]: (e["size"], e["blake3"]) for e in man["side_files"]} == {
        rel: (len(data), digest(data)) for rel, data in want.items()}
    files = {e["file"]: e["blake3"] for e in man["files"]}
    assert all(files[rel] == digest(data) for rel, data in want.items())  # listed with the other files too
    assert man["side_folders"] == ["2_Normalize"]
    skipped = {e["file"]: e["reason"] for e in man["skipped_files"]}
    assert set(skipped) == set(SKIPPED)
    for rel, words in SKIPPED.items():
        assert words in skipped[rel], (rel, skipped[rel])
        assert not (out / rel).exists(), rel


def test_pack_and_plan_print_the_skipped_files(st_in, st_out):
    _, said = st_out
    line = next(ln for ln in said.splitlines() if ln.startswith("skipped "))
    assert line.startswith(f"skipped {len(SKIPPED)} input files: ")
    assert ".git/ (version control)" in line and "consolidated.safetensors" in line
    r = run("plan", st_in)
    assert r.code == 0 and line in r.stdout  # every reason has at most 3 names: the same line
    assert "1_Pooling/config.json" in r.stdout and "empty folders recreated: 2_Normalize/" in r.stdout
    plan = json.loads(run("plan", st_in, "--json").stdout)
    assert {e["file"] for e in plan["side_files"]} == set(expected_side(st_in))
    assert {e["file"] for e in plan["skipped_files"]} == set(SKIPPED)


def test_verify_checks_side_files(st_in, st_out, tmp_path):
    good, _ = st_out
    assert verify(good).ok and verify(good, st_in).ok
    for rel, damage in (("1_Pooling/config.json", "delete"), ("1_Pooling/config.json", "edit"),
                        ("tokenizer/vocab/merges.txt", "edit"), (".gitattributes", "delete"),
                        ("2_Normalize", "rmdir")):
        out = Path(shutil.copytree(good, tmp_path / f"{damage}-{rel.replace('/', '_')}"))
        p = out / rel
        if damage == "delete":
            p.unlink()
        elif damage == "rmdir":
            p.rmdir()
        else:
            p.write_bytes(p.read_bytes().replace(b"e", b"E", 1))
        rep = verify(out)
        assert not rep.ok and any(pr.startswith(rel) for pr in rep.problems), (rel, rep.problems)
        r = run("verify-manifest", out)
        assert r.code == 1 and rel in r.stdout, r.stdout + r.stderr


def test_verify_input_finds_a_dropped_or_changed_side_file(st_in, st_out, tmp_path):
    out, _ = st_out
    ck = Path(shutil.copytree(st_in, tmp_path / "in", symlinks=True))
    (ck / "1_Pooling" / "extra.json").write_text("{}")  # a file the output does not account for
    (ck / "tokenizer/vocab/merges.txt").write_bytes(b"changed\n")
    rep = verify(out, ck)
    assert not rep.ok
    text = "\n".join(rep.problems)
    assert "1_Pooling/extra.json: neither copied nor skipped" in text
    assert "tokenizer/vocab/merges.txt: differs from the copy" in text


def test_old_manifest_without_side_records_still_verifies(st_in, st_out, tmp_path):
    """A format_version 1 manifest: side_files were names only, no skipped_files."""
    out = Path(shutil.copytree(st_out[0], tmp_path / "old"))
    man = json.loads((out / "manifest.json").read_text())
    man["format_version"] = 1
    man["side_files"] = [e["file"] for e in man["side_files"]]
    del man["side_folders"], man["skipped_files"]
    (out / "manifest.json").write_text(json.dumps(man))
    rep = verify(out, st_in)
    assert rep.ok, rep.problems
    (out / "1_Pooling/config.json").unlink()  # still checked, through "files"
    assert "1_Pooling/config.json: missing" in verify(out).problems


def test_scan_decides_each_kind_of_entry(tmp_path):
    ck = tmp_path / "ck"
    for rel in ("config.json", "model.safetensors.index.json", "a.safetensors", "hf_quant_config.json",
                "manifest.json", ".kimi-convert-pack.json", "sub/hf_quant_config.json", "sub/manifest.json",
                "sub/config.json", "sub/model.safetensors", "pytorch_model.bin", ".gitattributes", "x/.git",
                "README.md", "manifest-records/model.jsonl", "sub/manifest-records/a.jsonl"):
        (ck / rel).parent.mkdir(parents=True, exist_ok=True)
        (ck / rel).write_text("{}")
    (ck / "empty" / "nested").mkdir(parents=True)
    side = scan(ck, ["a.safetensors", "config.json", "model.safetensors.index.json"])
    # a sub-folder's config, manifest (and its records) or hf_quant_config is not the model's: copied
    assert side.copied == (".gitattributes", "README.md", "sub/config.json", "sub/hf_quant_config.json",
                           "sub/manifest-records/a.jsonl", "sub/manifest.json")
    assert side.folders == ("empty/nested",)
    assert side.skipped == (
        Skipped(".kimi-convert-pack.json", "a resume journal of kimi-convert"),
        Skipped("hf_quant_config.json", "the output writes its own"),
        Skipped("manifest-records/", "the output writes its own (manifest records)"),
        Skipped("manifest.json", "the output writes its own"),
        Skipped("pytorch_model.bin", "unconverted weights: not among the shards pack reads"),
        Skipped("sub/model.safetensors", "unconverted weights: not among the shards pack reads"),
        Skipped("x/.git", "version control"),
    )


@pytest.mark.parametrize("case", ["outside", "dangling", "folder"])
def test_symlinks_other_than_to_a_file_inside_are_refused(tiny_kl, tmp_path, case):
    ck = Path(shutil.copytree(tiny_kl, tmp_path / "in"))
    secret = tmp_path / "secret.txt"
    secret.write_text("not part of the model")
    if case == "outside":
        (ck / "tokenizer.json").symlink_to(secret)
    elif case == "dangling":
        (ck / "tokenizer.json").symlink_to(ck / "gone.json")
    else:
        (ck / "1_Pooling").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(ConvertError, match="1_Pooling|tokenizer.json"):
        pack(ck, tmp_path / "out", Options(), device="cpu", progress=False)
    assert not (tmp_path / "out" / "manifest.json").exists()
    assert "symlink" in one_line_error(run("pack", ck, tmp_path / "out2", "-q", "--device", "cpu"))


def _modes(folder: Path) -> dict[str, int]:
    return {p.relative_to(folder).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in folder.rglob("*")
            if p.is_file()}


def test_every_output_file_has_the_same_mode(tmp_path):
    """0o666 less the umask, as open(..., "w") gives: under umask 002 that is 0o664 (safetensors' save_file
    made synth's shards 0o600, pack created its shards 0o644)."""
    old = os.umask(0o002)
    try:
        src = write_synth("tiny-kimi-linear", tmp_path / "in")
        add_side_tree(src)
        os.chmod(src / "1_Pooling" / "config.json", 0o600)  # a copy takes the output's mode, not the input's
        pack(src, tmp_path / "out", Options(), device="cpu", progress=False)
    finally:
        os.umask(old)
    synth = _modes(write_synth("tiny-kimi-linear", tmp_path / "again"))
    assert len(synth) > 5 and set(synth.values()) == {0o666 & ~old}  # and under the test's own umask
    modes = _modes(tmp_path / "out")
    assert {"model-00001-of-00004.safetensors", "manifest.json", "config.json", "hf_quant_config.json",
            "model.safetensors.index.json", "1_Pooling/config.json", ".gitattributes"} <= set(modes)
    assert set(modes.values()) == {0o664}, modes
    src_modes = {k: v for k, v in _modes(src).items() if not k.startswith((".git/", ".cache/"))}
    assert set(src_modes.values()) == {0o664, 0o600}  # synth wrote 0o664 everywhere; the chmod above


@pytest.mark.slow
def test_resumed_pack_copies_side_files_identically(st_in, st_out, tmp_path):
    """Killed mid-copy of a side file, then resumed: the same tree, manifest included."""
    ref, _ = st_out
    out = tmp_path / "out"
    args = ["pack", st_in, out, "-q", "--device", "cpu"]
    r = run_process(*args, env={"KIMI_CONVERT_FAULT": "side:3"})
    assert r.code == -signal.SIGKILL, r.stderr
    assert not (out / "manifest.json").exists() and list(out.rglob("*.partial"))
    r = run(*args, "--resume")
    assert r.code == 0, r.stderr
    assert fault_inject.same_tree(ref, out) == []
    assert (out / "manifest.json").read_bytes() == (ref / "manifest.json").read_bytes()


def test_upload_sends_and_checks_sub_folder_side_files(st_out, tmp_path):
    """upload sends the whole tree (sub-folders and dot-files included) and verify-manifest --remote
    checks the sub-folder files against the manifest like the others."""
    from fakehub import TOKEN, FakeHub, assert_arrived, hub_cli

    out = Path(shutil.copytree(st_out[0], tmp_path / "out"))
    with FakeHub(TOKEN) as hub:
        r = hub_cli(hub, "upload", out, "user/st", tmp=tmp_path)
        assert r.code == 0, r.stderr
        assert_arrived(hub, "user/st", out)  # every local file, 1_Pooling/config.json and .gitattributes too
        files = hub.repos["user/st"].files
        assert {"1_Pooling/config.json", "tokenizer/vocab/merges.txt", ".gitattributes"} <= set(files)
        del files["1_Pooling/config.json"]
        files["tokenizer/vocab/merges.txt"] = {**files["tokenizer/vocab/merges.txt"], "blob": "0" * 40}
        r = hub_cli(hub, "verify-manifest", out, "--remote", "user/st", "--json", tmp=tmp_path)
    text = "\n".join(json.loads(r.stdout)["problems"])
    assert r.code == 1
    assert "1_Pooling/config.json is missing" in text and "tokenizer/vocab/merges.txt: the Hub's blob id" in text


def test_overwrite_removes_the_previous_runs_side_files_only(st_out, tiny_kl, tmp_path):
    """--overwrite with another input: the side files the previous manifest lists go (they would be
    stale: in the folder, in no manifest), a file of the user's stays, and the manifest cannot name
    a file outside the output for removal."""
    out = Path(shutil.copytree(st_out[0], tmp_path / "out"))
    (out / "1_Pooling" / "mine.txt").write_text("the user's")
    outside = tmp_path / "keep.txt"
    outside.write_text("outside")
    man = json.loads((out / "manifest.json").read_text())
    man["side_files"].append({"file": "../keep.txt", "size": 7, "blake3": "0" * 64})
    (out / "manifest.json").write_text(json.dumps(man))
    r = run("pack", tiny_kl, out, "-q", "--device", "cpu", "--overwrite")
    assert r.code == 0, r.stderr
    assert not (out / "1_Pooling" / "config.json").exists() and not (out / "tokenizer/vocab/merges.txt").exists()
    assert (out / "1_Pooling" / "mine.txt").read_text() == "the user's" and outside.read_text() == "outside"
    assert verify(out, tiny_kl).ok


def test_resume_without_journal_accepts_top_level_side_files(st_in, st_out, tmp_path):
    """A folder holding only what pack writes (top-level side files included) may be started afresh by
    --resume when it has neither journal nor manifest; a file of someone else's still refuses it."""
    out = Path(shutil.copytree(st_out[0], tmp_path / "out"))
    (out / "manifest.json").unlink()
    r = run("pack", st_in, out, "-q", "--device", "cpu", "--resume")
    assert r.code == 0, r.stderr
    assert (out / "manifest.json").read_bytes() == (st_out[0] / "manifest.json").read_bytes()
    (out / "manifest.json").unlink()
    (out / "notes-of-mine.txt").write_text("x")
    assert "nothing to resume" in one_line_error(run("pack", st_in, out, "-q", "--device", "cpu", "--resume"))
