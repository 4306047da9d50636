"""``pack hf://OWNER/REPO OUT --ray`` (issue 25, item 5): each Ray task downloads its own job's inputs into a
folder of its own and, with ``--upload --no-keep-output``, uploads its own shards; the driver journals and
makes the one commit. Against tests/fakehub.py (the real huggingface_hub client, in the driver and in the
tasks: they get the endpoint and the token through their environment) and a local Ray cluster (a head that
runs no task and two nodes of one CPU, as tests/test_ray.py).

Checked: the destination repository is byte for byte the one a local ``pack hf:// --upload`` makes (every
file, the manifest too, the same LFS objects, each sent once); the tasks' downloads went to their own folders
under the ``--scratch`` given as a node path (none beside OUTPUT, nothing of the shards in OUTPUT), which are
gone at the end; without --upload the shards land in a shared OUTPUT, the same bytes as a local pack; a
per-task --max-scratch too small and a node that does not see OUTPUT are one line.
"""

from __future__ import annotations

import json
import re
import shlex
import signal
from pathlib import Path

import pytest

import fault_inject
from fakehub import TOKEN, FakeHub, hub_cli
from helpers import local_ray_cluster, needs_ray, one_line_error, run, wait_ray_tasks_end, without_hub_digests

# tiny-k3 with 16 experts a layer in 4 input files; 1 MB output shards (a few a task)
PACK_ARGS = ["--layout", "sglang", "--recipe", "nvfp4-w4a16", "--max-shard-size", "1MB", "-q", "--device", "cpu"]
REPO = "user/src"


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("rayhub")
    assert run("synth", "tiny-k3", work / "in", "--experts", "16", "--shards", "4").code == 0
    return work / "in"


@pytest.fixture(scope="module")
def cluster():
    with local_ray_cluster() as c:
        yield c


@pytest.fixture
def hub(src):
    with FakeHub(TOKEN) as h:
        h.commit_sha = h.seed(REPO, src)
        yield h


@pytest.fixture(scope="module")
def local_upload(src, tmp_path_factory) -> tuple[dict[str, bytes], list[str]]:
    """``pack hf://SRC OUT --upload DST --no-keep-output`` on this machine (its own fake Hub, seeded alike:
    the same commit): DST's files and the LFS objects PUT."""
    work = tmp_path_factory.mktemp("rayhub-local")
    with FakeHub(TOKEN) as h:
        h.seed(REPO, src)
        r = cli(h, "pack", f"hf://{REPO}", work / "out", *PACK_ARGS, "--upload", "user/dst", "--no-keep-output",
                tmp=work)
        assert r.code == 0, r.stderr
        return repo_files(h, "user/dst"), sorted(puts(h))


def cli(hub: FakeHub, *args, tmp: Path, **env):
    return hub_cli(hub, *args, tmp=tmp, KIMI_CONVERT_UPLOAD_QUEUE="2", **env)


def repo_files(hub: FakeHub, repo_id: str) -> dict[str, bytes]:
    return {p: hub.file_bytes(repo_id, p) for p in hub.repos[repo_id].files}


def puts(hub: FakeHub) -> list[str]:
    return [p.rsplit("/", 1)[1] for m, p, s in hub.log if m == "PUT" and s == 200]


@needs_ray
@pytest.mark.slow
def test_ray_hub_to_hub_equals_a_local_packs_upload(hub, local_upload, cluster, tmp_path):
    want, lfs_local = local_upload
    out, nodes = tmp_path / "out", tmp_path / "node-scratch"
    r = cli(hub, "pack", f"hf://{REPO}", out, *PACK_ARGS, "--upload", "user/dst", "--no-keep-output",
            "--ray", cluster.address, "--scratch", nodes, "--stats", tmp_path / "stats.json", tmp=tmp_path)
    assert r.code == 0, r.stderr
    got = repo_files(hub, "user/dst")
    assert set(got) == set(want), set(got) ^ set(want)
    assert [p for p in want if got[p] != want[p]] == []  # byte for byte, manifest.json and the card included
    assert sorted(puts(hub)) == lfs_local  # each LFS object once
    assert len(hub.repos["user/dst"].commits) == 1
    commit = [p for m, p, _ in hub.log if "/commit/" in p]
    assert len(commit) == 1
    # the tasks' downloads: in folders of their own under the node path given, removed at the end; nothing
    # beside OUTPUT, no shard ever written to OUTPUT (the driver only wrote what the tasks sent: records files)
    tasks = json.loads((tmp_path / "stats.json").read_text())["downloads"]["tasks"]
    assert len(tasks) == 2 and len({t["scratch"] for t in tasks}) == 2
    assert all(Path(t["scratch"]).is_relative_to(nodes) and not Path(t["output"]).is_relative_to(out) for t in tasks)
    assert sum(t["downloaded"] for t in tasks) >= 4 and all(t["peak_scratch"] <= t["bound"] for t in tasks)
    assert not (tmp_path / ".out.hub-scratch").exists()
    assert [p for p in nodes.rglob("*") if p.is_file()] == [] and not any(Path(t["scratch"]).exists() for t in tasks)
    assert not list(out.glob("*.safetensors")) and not (out / ".kimi-convert-pack.json").exists()
    assert not (out / ".kimi-convert-ray-probe").exists()
    assert re.search(r"user/dst: all \d+ files present", r.stdout), r.stdout
    shards = int(re.search(r"(\d+) shards, ", r.stdout)[1])
    assert f"{shards} shard(s) uploaded by this run" in r.stdout  # by its tasks


@needs_ray
@pytest.mark.slow
@pytest.mark.parametrize("upload", [False, True])
def test_ray_hub_input_into_a_shared_output_equals_a_local_pack(hub, local_upload, cluster, tmp_path, upload):
    """Without --no-keep-output the tasks write into OUTPUT (shared here: one machine); with --upload (the shards
    kept) they also upload them. The folder is the local pack's (with the card and the sha256 upload writes), the
    repository the local pack's upload."""
    local = cli(hub, "pack", f"hf://{REPO}", tmp_path / "local", *PACK_ARGS, tmp=tmp_path)
    assert local.code == 0, local.stderr
    more = ["--upload", "user/dst"] if upload else []
    r = cli(hub, "pack", f"hf://{REPO}", tmp_path / "out", *PACK_ARGS, "--ray", cluster.address,
            "--scratch", tmp_path / "node-scratch", *more, tmp=tmp_path)
    assert r.code == 0, r.stderr
    if upload:
        assert repo_files(hub, "user/dst") == local_upload[0]
        assert sorted(puts(hub)) == local_upload[1]
        (tmp_path / "out" / "README.md").unlink()  # the card
        assert fault_inject.same_tree(tmp_path / "local", tmp_path / "out") == ["manifest.json"]
        # the manifest gained each output file's sha256 (its LFS object id), as upload writes it
        assert without_hub_digests(tmp_path / "out") == json.loads((tmp_path / "local" / "manifest.json").read_text())
        return
    assert fault_inject.same_tree(tmp_path / "local", tmp_path / "out") == []


@needs_ray
def test_a_task_bound_too_small_is_one_line_before_any_download(hub, cluster, src, tmp_path):
    out = tmp_path / "out"
    line = one_line_error(cli(hub, "pack", f"hf://{REPO}", out, *PACK_ARGS, "--upload", "user/dst",
                              "--no-keep-output", "--ray", cluster.address, "--max-scratch", "100kB", tmp=tmp_path))
    assert "--max-scratch 100.00 kB" in line and "raise it to at least" in line, line
    assert not out.exists() and hub.weight_bytes_served(REPO) == sum(
        8 + int.from_bytes(p.read_bytes()[:8], "little") for p in src.glob("*.safetensors"))


def test_a_node_that_does_not_see_the_output_is_one_line(tmp_path):
    from kimi_convert.errors import ConvertError
    from kimi_convert.sources.hubstage import check_probe, remove_probe, write_probe

    nonce = write_probe(tmp_path)
    check_probe(tmp_path, nonce)  # the driver's folder
    remove_probe(tmp_path)
    for seen in ("another pack's", None):  # a folder of the same name on a node: another nonce, or none
        if seen:
            (tmp_path / ".kimi-convert-ray-probe").write_text(seen)
        with pytest.raises(ConvertError, match="no shared filesystem.*add --upload REPO_ID --no-keep-output"):
            check_probe(tmp_path, nonce)
        remove_probe(tmp_path)


def resume_command(out: Path) -> list[str]:
    text = (out / ".kimi-convert-pack.json").read_text()
    assert TOKEN not in text
    return shlex.split(json.loads(text)["command"])[1:]


@needs_ray
@pytest.mark.slow
@pytest.mark.parametrize("point", ["upload:2", "journal:5"])
def test_killed_and_resumed_uploads_each_object_once(hub, local_upload, cluster, tmp_path, point):
    """``upload:2``: the first task to have the Hub take its 2nd shard dies before telling the driver (its
    worker SIGKILLed); Ray re-runs it, whose uploads the LFS batch finds there. ``journal:5``: the driver dies
    mid-journal (two shards journaled as uploaded), resumed with the journal's command: those are not
    converted nor sent again. Either way the repository is the local pack's upload, each object PUT once."""
    want, lfs_local = local_upload
    out = tmp_path / "out"
    args = ["pack", f"hf://{REPO}", out, *PACK_ARGS, "--upload", "user/dst", "--no-keep-output", "--ray",
            cluster.address, "--scratch", tmp_path / "node-scratch"]
    r = cli(hub, *args, tmp=tmp_path, KIMI_CONVERT_FAULT=point, KIMI_CONVERT_FAULT_ONCE=str(tmp_path / "hit"))
    assert (tmp_path / "hit").exists(), r.stderr
    if point.startswith("journal"):
        assert r.code == -signal.SIGKILL, (r.code, r.stderr)
        done = json.loads((out / ".kimi-convert-pack.json").read_text())["uploaded"]
        assert len(done) == 2
        wait_ray_tasks_end(cluster)  # the dead driver's tasks, and their uploads, end first
        hub.wait_idle()
        r = cli(hub, *resume_command(out), tmp=tmp_path)
        assert f"({len(done)} finished shard(s) verified and kept)" in r.stdout, r.stdout + r.stderr
    assert r.code == 0, r.stderr
    assert repo_files(hub, "user/dst") == want
    assert sorted(puts(hub)) == lfs_local
