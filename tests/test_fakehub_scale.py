"""The fake Hub's release-scale modes (benchmarks/whole_release.py): weight files served from disk, their sha256
computed once through a cache, and a sink that checks each uploaded object's sha256 and size and keeps no bytes.
Driven through the real huggingface_hub client, as pack drives it."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from huggingface_hub import CommitOperationAdd, HfApi, hf_hub_download

from fakehub import TOKEN, FakeHub, OnDisk, Received, file_sha256

SPARSE = 48 << 20  # a sparse file: no disk, read as zeros


@pytest.fixture
def env(monkeypatch, tmp_path):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_DISABLE_XET", True)  # read at import: set here
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))


def _folder(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "model.safetensors", "wb") as f:
        f.write(b"head")
        f.truncate(SPARSE)
    (src / "config.json").write_text("{}")
    return src


def test_seeded_files_are_served_from_disk_and_hashed_once(env, tmp_path):
    src, cache = _folder(tmp_path), tmp_path / "sha.json"
    want = hashlib.sha256(b"head" + bytes(SPARSE - 4)).hexdigest()
    assert file_sha256(src / "model.safetensors", cache) == want
    (key,) = json.loads(cache.read_text())
    # the cached value is what a second call returns (not hashed again): planted, it comes back
    cache.write_text(json.dumps({key: "0" * 64}))
    assert file_sha256(src / "model.safetensors", cache) == "0" * 64
    os.utime(src / "model.safetensors", ns=(1, 1))  # another mtime: another key, hashed again
    assert file_sha256(src / "model.safetensors", cache) == want
    with FakeHub(TOKEN) as hub:
        hub.seed("user/src", src, on_disk=True, sha_cache=cache)
        assert hub.lfs[want] == OnDisk(src / "model.safetensors", SPARSE)
        got = hf_hub_download("user/src", "model.safetensors", endpoint=hub.url, token=TOKEN,
                              local_dir=tmp_path / "dl")
        assert file_sha256(Path(got)) == want
        hub.corrupt["model.safetensors"] = 2  # the fault still applies to a file served from disk
        bad = hf_hub_download("user/src", "model.safetensors", endpoint=hub.url, token=TOKEN,
                              local_dir=tmp_path / "dl2")
        assert Path(bad).read_bytes()[:4] == b"he" + bytes([ord("a") ^ 0xFF]) + b"d"
        assert hub.tree_sha256("user/src") == {"config.json": hashlib.sha256(b"{}").hexdigest(),
                                               "model.safetensors": want}


def test_the_sink_checks_and_records_uploads_without_their_bytes(env, tmp_path):
    src = _folder(tmp_path)
    want = file_sha256(src / "model.safetensors")
    with FakeHub(TOKEN, keep_uploads=False) as hub:
        api = HfApi(endpoint=hub.url, token=TOKEN)
        api.create_repo("user/out")
        ops = [CommitOperationAdd(f.name, str(f)) for f in sorted(src.iterdir())]
        api.preupload_lfs_files("user/out", ops)  # what pack --upload sends, a shard at a time
        api.create_commit("user/out", ops, commit_message="up")
        rec = hub.lfs[want]
        assert isinstance(rec, Received) and rec.size == SPARSE
        assert [oid for oid, _ in hub.received] == [want]
        assert hub.tree_sha256("user/out")["model.safetensors"] == want
        with pytest.raises(AssertionError, match="keeps no bytes"):
            hub.file_bytes("user/out", "model.safetensors")


def test_the_sink_refuses_a_size_other_than_announced(env, tmp_path):
    data = b"x" * 200_000  # above the fake Hub's LFS threshold
    oid = hashlib.sha256(data).hexdigest()
    with FakeHub(TOKEN, keep_uploads=False) as hub:
        api = HfApi(endpoint=hub.url, token=TOKEN)
        api.create_repo("user/out")
        hub.announced = _Pinned({oid: len(data) + 1}, oid)  # as if the batch had announced another size
        with pytest.raises(Exception, match="Error while uploading"):
            api.preupload_lfs_files("user/out", [CommitOperationAdd("w.safetensors", data)])
        assert oid not in hub.lfs and not hub.received
        assert ("PUT", f"/lfs-upload/{oid}", 400) in hub.log


class _Pinned(dict):
    """A mapping whose entry for ``oid`` the LFS batch cannot overwrite (the announced size stays wrong)."""

    def __init__(self, pinned: dict, oid: str):
        super().__init__(pinned)
        self.oid = oid

    def __setitem__(self, key, value):
        if key != self.oid:
            super().__setitem__(key, value)
