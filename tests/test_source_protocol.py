"""The input-source seam (issue 22, item 3): a checkpoint held only in memory (``memsource.MemorySource``, a dict
of bytes, its folder deleted before it is read) is planned, packed and verified through the ``Source``
protocol alone, and gives what the same checkpoint as a local folder gives: the same plan, the same output
bytes. Anything above the protocol that still opened a path would fail here (the folder is gone)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from memsource import MemorySource

from helpers import write_synth
from kimi_convert.checkpoint import open_checkpoint
from kimi_convert.errors import ConvertError
from kimi_convert.mapping import find_mapping
from kimi_convert.pack import pack
from kimi_convert.plan import Options, make_plan
from kimi_convert.plan.serialize import plan_dict, plan_hash
from kimi_convert.sources import EntryKind, Source, SourceFile, open_source
from kimi_convert.sources.local import LocalFolder
from kimi_convert.verify import verify


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def local_and_memory(tmp_path_factory) -> tuple[Path, MemorySource]:
    """The tiny K3 on disk, with side files in a sub-folder, and the same bytes as a memory source."""
    ck = write_synth("tiny-k3", tmp_path_factory.mktemp("in") / "ck", seed=0)
    (ck / "1_Pooling").mkdir()
    (ck / "1_Pooling" / "config.json").write_text('{"pooling": "mean"}\n')
    (ck / "extra.bin").write_bytes(b"unconverted")  # skipped: a weight format the plan does not read
    return ck, MemorySource.from_folder(ck)


def test_protocols_hold():
    assert isinstance(MemorySource({}), Source)
    assert isinstance(LocalFolder(Path(".")), Source)
    mem = MemorySource({"a": b"xy"})
    assert open_source(mem) is mem
    with mem.open("a") as f:
        assert isinstance(f, SourceFile)


def test_plan_from_memory_equals_plan_from_folder(local_and_memory, tmp_path):
    ck, _ = local_and_memory
    local = open_checkpoint(ck)
    moved = tmp_path / "ck"
    shutil.copytree(ck, moved)
    mem = MemorySource.from_folder(moved)
    shutil.rmtree(moved)  # nothing of it on disk any more: only the protocol can reach its bytes
    ckpt = open_checkpoint(mem)
    assert ckpt.source is mem
    opts = Options()
    p_local = make_plan(local, find_mapping(local.config, None), opts)
    p_mem = make_plan(ckpt, find_mapping(ckpt.config, None), opts)
    assert plan_hash(plan_dict(p_mem)) == plan_hash(plan_dict(p_local))
    assert (p_mem.side_files, p_mem.skipped_files) == (p_local.side_files, p_local.skipped_files)
    assert "1_Pooling/config.json" in p_mem.side_files
    # the plan read headers only: each shard opened once (header), never a tensor's bytes
    assert sorted(set(mem.opened)) == sorted({"config.json", "model.safetensors.index.json", *ckpt.files})


def test_pack_and_verify_from_memory(local_and_memory, tmp_path):
    """pack from a memory source writes the bytes pack from the folder writes (manifest included: it records
    the inputs' sizes and sha256, not where they were read); verify --input reads the memory source too."""
    ck, mem = local_and_memory
    opts = Options(max_shard_size=1_000_000)
    pack(ck, tmp_path / "a", opts, device="cpu", progress=False)
    pack(mem, tmp_path / "b", opts, device="cpu", progress=False)
    a, b = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert a.keys() == b.keys() and len([f for f in a if f.endswith(".safetensors")]) > 1
    assert [f for f in a if a[f] != b[f]] == []
    rep = verify(tmp_path / "b", mem)
    assert rep.ok, rep.problems
    assert any(rel.endswith(".safetensors") for rel in mem.opened)


def test_memory_source_refusals_name_the_source(tmp_path):
    mem = MemorySource({"config.json": b"{}"})
    with pytest.raises(ConvertError, match=r"^mem://ckpt: no \*\.safetensors files"):
        open_checkpoint(mem)
    mem = MemorySource({"config.json": b"[1]"})
    with pytest.raises(ConvertError, match=r"^mem://ckpt/config.json: not a JSON object"):
        open_checkpoint(mem)


def test_local_listing_order_and_identity(tmp_path):
    """LocalFolder lists top-down (each folder's sub-folders, then its files, sorted), symlinks as entries
    with their refusal, and gives the journal size and mtime."""
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x").write_text("1")
    (tmp_path / "a.txt").write_text("22")
    (tmp_path / "link").symlink_to("/etc/hostname")
    src = LocalFolder(tmp_path)
    rows = src.list_files()
    assert [e.rel for e in rows] == ["b", "a.txt", "link", "b/x"]
    assert rows[0].kind is EntryKind.FOLDER and rows[1].size == 2
    assert "outside the input folder" in (rows[2].refusal or "")
    st = (tmp_path / "a.txt").stat()
    assert src.entry("a.txt").stamp == [st.st_size, st.st_mtime_ns]
    assert src.entry("nothing") is None


def test_engine_check_compares_outputs_with_the_source_through_the_protocol(tmp_path):
    """``enginecheck._same_as_source`` (the engine check without a manifest) reads the input through its
    source: an output that stores a tensor byte for byte as the input does is found unchanged, a changed one not."""
    from kimi_convert.enginecheck import _same_as_source

    ck = write_synth("tiny-kimi-linear", tmp_path / "ck", seed=0)
    out = tmp_path / "out"
    shutil.copytree(ck, out)
    mem = MemorySource.from_folder(ck)
    shutil.rmtree(ck)
    tensors = open_checkpoint(mem).tensors
    names = set(sorted(tensors)[:6])
    assert _same_as_source(out, mem, names) == names
    victim = sorted(names)[0]
    t = tensors[victim]
    with open(out / t.file, "r+b") as f:
        f.seek(t.start)
        first = f.read(1)
        f.seek(t.start)
        f.write(bytes([first[0] ^ 1]))
    assert _same_as_source(out, mem, names) == names - {victim}
