"""A Hub repository as the input (issue 25): ``plan``/``inspect``/``pack``/``verify-manifest --input``
``hf://OWNER/REPO[@REV]`` against tests/fakehub.py through the real huggingface_hub client.

Checked: plan and inspect read config.json, the index and each shard's header only (the server counts the
bytes it sent: headers and small files, no weight byte), the revision resolved to one commit and shown;
pack from the Hub writes the same bytes as pack of the same folder (the manifest adds only its ``source``),
downloads each weight file once, keeps the scratch folder within --max-scratch (sampled while a throttled
download runs) and removes it; a bound too small and a corrupted shard are one line before any output is
derived; a killed pack resumes without downloading again what it had verified, nor converting or uploading
again what it had finished; with --upload the Hub's repository equals a local pack's upload;
verify-manifest --input hf:// checks the inputs against the Hub's LFS sha256 without a weight byte.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

import fault_inject
from fakehub import TOKEN, FakeHub, hub_cli
from helpers import one_line_error, run, synth_and_pack

PACK_ARGS = ["--layout", "sglang", "--recipe", "nvfp4-w4a16", "--max-shard-size", "1MB", "-q", "--device", "cpu"]
REPO = "user/src"


@pytest.fixture(scope="module")
def medium(tmp_path_factory) -> tuple[Path, Path]:
    """tiny-k3 with 32 experts a layer in 4 input shards (1.1 to 6.3 MB), and its local pack (the reference)."""
    return synth_and_pack(tmp_path_factory.mktemp("hubin"), PACK_ARGS, "--experts", "32", "--shards", "8")


@pytest.fixture
def hub(medium):
    with FakeHub(TOKEN) as h:
        h.commit_sha = h.seed(REPO, medium[0])
        yield h


def cli(hub: FakeHub, *args, tmp: Path, **env):
    return hub_cli(hub, *args, tmp=tmp, KIMI_CONVERT_UPLOAD_QUEUE="2", **env)


def weights(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(folder.glob("*.safetensors"))}


def header_bytes(folder: Path) -> int:
    """What a header reader needs of each shard: the 8-byte length and the JSON header."""
    return sum(8 + int.from_bytes(p.read_bytes()[:8], "little") for p in folder.glob("*.safetensors"))


def assert_same_as_local(ref: Path, out: Path, commit: str) -> None:
    """Every file of the local pack, byte for byte; the manifest equal but for its ``source`` and its inputs'
    digests: the Hub's sha256 (its LFS object ids, each download verified against them) where a local folder's
    pack records the files' BLAKE3."""
    assert fault_inject.same_tree(ref, out) == ["manifest.json"]
    a, b = json.loads((ref / "manifest.json").read_text()), json.loads((out / "manifest.json").read_text())
    assert b.pop("source") == {"hub": REPO, "commit": commit}
    assert_same_but_inputs(a, b)


def assert_same_but_inputs(local: dict, hub: dict) -> None:
    """A Hub input's manifest (``source`` removed) is a local folder's but for the inputs' digests: the local pack
    records their BLAKE3, the Hub's pack their sha256 (its LFS object ids, each download verified against them)."""
    a, b = local.pop("inputs"), hub.pop("inputs")
    assert [(e["file"], e["size"], sorted(e)) for e in a] == [(e["file"], e["size"], ["blake3", "file", "size"])
                                                               for e in b]
    assert all(sorted(e) == ["file", "sha256", "size"] for e in b)
    assert local == hub


def test_plan_and_inspect_read_only_headers(hub, medium, tmp_path):
    src, _ = medium
    r = cli(hub, "plan", f"hf://{REPO}", tmp=tmp_path)
    assert r.code == 0, r.stderr
    assert r.stdout.startswith(f"plan for hf://{REPO}@{hub.commit_sha} ")  # the commit it resolved to
    assert hub.weight_bytes_served(REPO) == header_bytes(src)  # no weight byte
    small = sum(p.stat().st_size for p in (src / "config.json", src / "model.safetensors.index.json"))
    assert sum(hub.served.values()) == header_bytes(src) + small
    hub.served.clear()
    r = cli(hub, "plan", f"hf://{REPO}@{hub.commit_sha}", "--json", tmp=tmp_path)
    assert r.code == 0, r.stderr
    assert json.loads(r.stdout)["source"] == {"hub": REPO, "commit": hub.commit_sha}
    assert hub.weight_bytes_served(REPO) == header_bytes(src)
    hub.served.clear()
    r = cli(hub, "inspect", f"hf://{REPO}", tmp=tmp_path)
    assert r.code == 0 and "KimiK3" in r.stdout, r.stderr
    assert r.stdout == run("inspect", src).stdout
    assert hub.weight_bytes_served(REPO) == header_bytes(src)


def test_unknown_repo_and_revision_are_one_line(hub, tmp_path):
    line = one_line_error(cli(hub, "plan", "hf://user/nope", tmp=tmp_path))
    assert "user/nope" in line and "repository not found" in line
    line = one_line_error(cli(hub, "plan", f"hf://{REPO}@{'f' * 40}", tmp=tmp_path))
    assert REPO in line and "revision not found" in line
    line = one_line_error(cli(hub, "pack", f"hf://{REPO}@", tmp_path / "out", tmp=tmp_path))
    assert "empty revision" in line and not (tmp_path / "out").exists()


def test_pack_from_the_hub_equals_pack_of_the_folder(hub, medium, tmp_path):
    src, ref = medium
    out = tmp_path / "out"
    r = cli(hub, "pack", f"hf://{REPO}", out, *PACK_ARGS, "--stats", tmp_path / "stats.json", tmp=tmp_path)
    assert r.code == 0, r.stderr
    assert_same_as_local(ref, out, hub.commit_sha)
    man = json.loads((out / "manifest.json").read_text())
    lfs = {p: f["lfs"] for p, f in hub.repos[REPO].files.items() if f["lfs"]}
    assert {i["file"]: i["sha256"] for i in man["inputs"]} == lfs  # the Hub's LFS sha256, each verified
    for name, size in weights(src).items():  # each weight file downloaded once (plus its header, by the plan)
        n = hub.served[f"{REPO}/{name}"]
        assert size <= n <= size + 8 + int.from_bytes((src / name).read_bytes()[:8], "little"), (name, n)
    stats = json.loads((tmp_path / "stats.json").read_text())["downloads"]
    assert stats["downloaded"] == len(weights(src)) and stats["peak_scratch"] <= stats["bound"]
    assert not (tmp_path / ".out.hub-scratch").exists()  # the scratch folder goes with its last file


def test_a_hub_input_planned_apart_is_the_same_output(hub, medium, tmp_path):
    """The plan made in a child process (``planprocess``, issue 43: a large input's) reads the headers from the Hub
    there; the pack here downloads and converts the same."""
    out = tmp_path / "out"
    r = cli(hub, "pack", f"hf://{REPO}", out, *PACK_ARGS, tmp=tmp_path, KIMI_CONVERT_PLAN_APART="0")
    assert r.code == 0, r.stderr
    assert_same_as_local(medium[1], out, hub.commit_sha)


def test_scratch_stays_within_the_bound(hub, medium, tmp_path):
    """Downloads throttled to 16 MB/s (slower than the conversion): the scratch folder, sampled every 10 ms,
    never holds more than --max-scratch, counting partial downloads; and it held two files at once at
    some point (the downloads run ahead of the conversion within the bound)."""
    src, ref = medium
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    hub.download_bps = 16e6
    bound = 8_000_000
    assert max(weights(src).values()) < bound < sum(weights(src).values())
    seen: list[tuple[int, int]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            files = [p for p in scratch.rglob("*") if p.is_file()] if scratch.is_dir() else []
            with contextlib.suppress(FileNotFoundError):  # deleted while listed
                seen.append((sum(p.stat().st_size for p in files), len(files)))
            time.sleep(0.01)
    t = threading.Thread(target=sample)
    t.start()
    try:
        r = cli(hub, "pack", f"hf://{REPO}", out, *PACK_ARGS, "--scratch", scratch, "--max-scratch", "8MB",
                tmp=tmp_path)
    finally:
        done.set()
        t.join()
    assert r.code == 0, r.stderr
    assert_same_as_local(ref, out, hub.commit_sha)
    assert max(n for n, _ in seen) <= bound, max(seen)
    assert max(k for _, k in seen) >= 2, seen
    assert not scratch.exists()


def test_a_bound_below_one_file_is_one_line_before_any_download(hub, medium, tmp_path):
    src, _ = medium
    out = tmp_path / "out"
    big = max(weights(src).items(), key=lambda kv: kv[1])[0]
    line = one_line_error(cli(hub, "pack", f"hf://{REPO}", out, *PACK_ARGS, "--max-scratch", "2MB", tmp=tmp_path))
    assert "--max-scratch 2.00 MB" in line and big in line and "raise it to at least" in line, line
    assert not out.exists() and hub.weight_bytes_served(REPO) == header_bytes(src)


def test_a_corrupted_shard_is_one_line_and_no_output_is_derived_from_it(hub, medium, tmp_path):
    src, _ = medium
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    bad = sorted(weights(src))[2]
    hub.corrupt[bad] = weights(src)[bad] - 10  # in the data (the plan reads the header, intact)
    line = one_line_error(cli(hub, "pack", f"hf://{REPO}", out, *PACK_ARGS, "--scratch", scratch, tmp=tmp_path))
    assert f"hf://{REPO}@{hub.commit_sha}/{bad}: the downloaded bytes' sha256" in line, line
    assert "not the one the Hub recorded" in line and "no output shard made from it was finished" in line
    assert not (out / "manifest.json").exists() and not list(out.rglob("*.partial"))
    assert not (scratch / bad).exists() and not (scratch / (bad + ".incomplete")).exists()
    j = json.loads((out / ".kimi-convert-pack.json").read_text())
    man_ref = json.loads((medium[1] / "manifest.json").read_text())
    from_bad = {m["shard"] for m in _modules(medium[1], man_ref) if bad in m["inputs"]}
    assert not from_bad & set(j["shards"])  # no finished shard holds anything read from it


def _modules(ref: Path, man: dict) -> list[dict]:
    """Per module of the reference: its output shard and the input files its sources' parts lie in."""
    from kimi_convert.manifest import iter_modules

    return [{"shard": mod["tensors"][0]["file"], "inputs": {p["file"] for s in mod["sources"] for p in s["parts"]}}
            for _, mod in iter_modules(ref, man)]


def test_workers_ray_and_scratch_inside_the_output_are_refused(hub, medium, tmp_path):
    out = tmp_path / "out"
    line = one_line_error(cli(hub, "pack", f"hf://{REPO}", out, *PACK_ARGS, "--workers", "2", tmp=tmp_path))
    assert "--workers 2: a Hub input packs with one worker and one stream" in line
    line = one_line_error(cli(hub, "pack", f"hf://{REPO}", out, *PACK_ARGS, "--scratch", out / "dl", tmp=tmp_path))
    assert "must be outside the output folder" in line and not out.exists()
    line = one_line_error(run("pack", medium[0], out, *PACK_ARGS, "--max-scratch", "1GB"))
    assert "applies to a Hub input" in line


def resume_command(out: Path) -> list[str]:
    text = (out / ".kimi-convert-pack.json").read_text()
    assert TOKEN not in text
    return shlex.split(json.loads(text)["command"])[1:]


@pytest.mark.parametrize("point", ["download:2", "shard:3"])
def test_killed_pack_resumes_without_downloading_or_converting_again(hub, medium, tmp_path, point):
    """Killed after the second verified download, or after the third output shard: the resume (the journal's
    command, which names the commit) downloads none of the files left verified in the scratch folder and keeps
    the finished shards; the output is the local pack's."""
    src, ref = medium
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    r = cli(hub, "pack", f"hf://{REPO}", out, *PACK_ARGS, "--scratch", scratch, tmp=tmp_path, KIMI_CONVERT_FAULT=point)
    assert r.code == -signal.SIGKILL, (r.code, r.stderr)
    args = resume_command(out)
    assert f"hf://{REPO}@{hub.commit_sha}" in args
    left = [p.name for p in scratch.glob("*.safetensors")]  # verified, not yet consumed
    assert left
    finished = len(json.loads((out / ".kimi-convert-pack.json").read_text())["shards"])
    hub.served.clear()
    r = cli(hub, *args, "--stats", tmp_path / "stats.json", tmp=tmp_path)
    assert r.code == 0, r.stderr
    assert_same_as_local(ref, out, hub.commit_sha)
    for name in left:  # the re-plan's header read only
        assert hub.served[f"{REPO}/{name}"] == 8 + int.from_bytes((src / name).read_bytes()[:8], "little"), name
    stats = json.loads((tmp_path / "stats.json").read_text())["downloads"]
    assert stats["reused"] == len(left)
    if finished:
        assert f"({finished} finished shard(s) verified and kept)" in r.stdout


def puts(hub: FakeHub) -> list[str]:
    return [p.rsplit("/", 1)[1] for m, p, s in hub.log if m == "PUT" and s == 200]


@pytest.fixture(scope="module")
def uploaded_ref(medium, tmp_path_factory) -> dict:
    """The local pack uploaded with ``upload``: the repository's files and LFS objects."""
    work = tmp_path_factory.mktemp("hubref")
    shutil.copytree(medium[1], work / "ref")  # (upload writes a model card into the folder it uploads)
    with FakeHub(TOKEN) as h:
        r = hub_cli(h, "upload", work / "ref", "user/ref", tmp=work)
        assert r.code == 0, r.stderr
        return {"files": {p: h.file_bytes("user/ref", p) for p in h.repos["user/ref"].files},
                "lfs": sorted(f["lfs"] for f in h.repos["user/ref"].files.values() if f["lfs"])}


def assert_same_repo(hub: FakeHub, repo_id: str, ref: dict) -> None:
    repo = hub.repos[repo_id]
    assert set(repo.files) == set(ref["files"]), set(repo.files) ^ set(ref["files"])
    for p in repo.files:
        if p != "manifest.json":
            assert hub.file_bytes(repo_id, p) == ref["files"][p], p
    got, want = json.loads(hub.file_bytes(repo_id, "manifest.json")), json.loads(ref["files"]["manifest.json"])
    assert got.pop("source")["hub"] == REPO
    assert_same_but_inputs(want, got)


@pytest.mark.parametrize("point", [None, "upload:3"])
def test_hub_to_hub_equals_a_local_packs_upload(hub, medium, uploaded_ref, tmp_path, point):
    """pack hf://SRC OUT --upload DST --no-keep-output: DST ends with the local pack's upload, byte for byte
    (its manifest adds the source); killed after the third upload and resumed, no LFS object sent twice."""
    out = tmp_path / "out"
    args = ["pack", f"hf://{REPO}", out, *PACK_ARGS, "--upload", "user/dst", "--no-keep-output"]
    if point:
        r = cli(hub, *args, tmp=tmp_path, KIMI_CONVERT_FAULT=point)
        assert r.code == -signal.SIGKILL, (r.code, r.stderr)
        args = resume_command(out)
    r = cli(hub, *args, tmp=tmp_path)
    assert r.code == 0, r.stderr
    assert_same_repo(hub, "user/dst", uploaded_ref)
    assert sorted(puts(hub)) == uploaded_ref["lfs"]  # each object once, across the kill
    assert not list(out.glob("*.safetensors")) and not (tmp_path / ".out.hub-scratch").exists()


def test_verify_manifest_against_the_hub_downloads_no_weights(hub, medium, tmp_path):
    src, _ = medium
    out = tmp_path / "out"
    assert cli(hub, "pack", f"hf://{REPO}", out, *PACK_ARGS, tmp=tmp_path).code == 0
    hub.served.clear()
    r = cli(hub, "verify-manifest", out, "--input", f"hf://{REPO}@{hub.commit_sha}", "-q", tmp=tmp_path)
    assert r.code == 0, r.stdout + r.stderr
    assert f"ok    input files: sizes and digests (4 files, against the sha256 the Hub records at {hub.commit_sha})" \
        in r.stdout
    assert "outputs re-derived from the input (skipped: the input is on the Hub" in r.stdout
    assert hub.weight_bytes_served(REPO) == header_bytes(src)  # the re-plan's headers, nothing else
    # a new commit with one shard changed: the default branch now differs from what the manifest records
    changed = tmp_path / "changed"
    shutil.copytree(src, changed)
    victim = changed / sorted(weights(src))[1]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    new = hub.seed(REPO, changed)
    r = cli(hub, "verify-manifest", out, "--input", f"hf://{REPO}", "-q", tmp=tmp_path)
    assert r.code != 0
    assert f"hf://{REPO}@{new}/{victim.name}: differs from the input recorded in the manifest" in r.stdout + r.stderr
    assert f"(the manifest records commit {hub.commit_sha})" in r.stdout


def test_a_local_packs_output_verifies_against_the_hub_by_reading_its_inputs(hub, medium, tmp_path):
    """An output packed from a local copy records its inputs' BLAKE3, which the Hub does not know: verify-manifest
    --input hf:// reads those files through the Hub (streamed, hashed, not kept) and says so, and they match."""
    src, ref = medium
    hub.served.clear()
    r = cli(hub, "verify-manifest", ref, "--input", f"hf://{REPO}@{hub.commit_sha}", "-q", tmp=tmp_path)
    assert r.code == 0, r.stdout + r.stderr
    assert (f"ok    input files: sizes and digests (4 files, against the sha256 the Hub records at {hub.commit_sha}"
            " (the manifest records no Hub source); 4 read from the Hub (the manifest records their BLAKE3))") \
        in r.stdout, r.stdout
    assert hub.weight_bytes_served(REPO) >= sum(weights(src).values())


def test_a_partial_download_is_continued_not_restarted(hub, medium, tmp_path):
    """What a killed download leaves, ``NAME.incomplete`` (a prefix of the file), here for every weight file: the
    pack hashes each prefix again and fetches only the missing bytes; the output is the local pack's."""
    src, ref = medium
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    scratch.mkdir()
    have = {}
    for name, size in weights(src).items():
        have[name] = size // 2
        (scratch / (name + ".incomplete")).write_bytes((src / name).read_bytes()[: have[name]])
    r = cli(hub, "pack", f"hf://{REPO}", out, *PACK_ARGS, "--scratch", scratch, "--stats", tmp_path / "stats.json",
            tmp=tmp_path)
    assert r.code == 0, r.stderr
    assert_same_as_local(ref, out, hub.commit_sha)
    for name, size in weights(src).items():
        header = 8 + int.from_bytes((src / name).read_bytes()[:8], "little")
        assert hub.served[f"{REPO}/{name}"] == header + size - have[name], name
    stats = json.loads((tmp_path / "stats.json").read_text())["downloads"]
    assert stats["resumed_bytes"] == sum(have.values()) and stats["bytes"] == sum(weights(src).values()) - sum(
        have.values())
    assert not scratch.exists()


@pytest.mark.parametrize("path, what", [
    (rf"^/api/models/{REPO}(/revision/[^/]+)?$", "looking up the repository"),
    (rf"^/api/models/{REPO}/tree/", "listing the repository"),
    (rf"^/{REPO}/resolve/[^/]+/config\.json$", "reading config.json"),
    (rf"^/{REPO}/resolve/[^/]+/model-00001-", "reading model-00001-"),
])
def test_a_hub_that_never_answers_is_one_line_quickly(hub, tmp_path, path, what):
    """A server that accepts the connection and sends nothing: each metadata step fails within the bound
    (KIMI_CONVERT_HUB_METADATA_TIMEOUT, here 2 s), in one line naming the repository and the step; the library's
    own retries of its timeout are not waited through."""
    hub.stall("GET", path)
    started = time.monotonic()
    line = one_line_error(cli(hub, "plan", f"hf://{REPO}", tmp=tmp_path, KIMI_CONVERT_HUB_METADATA_TIMEOUT="2"))
    took = time.monotonic() - started
    assert REPO in line and what in line and "sent no answer within 2 s" in line, line
    assert took < 20, took  # the interpreter's start, plus the 2 s bound and one retry's pause


def test_metadata_timeout_setting_is_checked(hub, tmp_path):
    line = one_line_error(cli(hub, "plan", f"hf://{REPO}", tmp=tmp_path, KIMI_CONVERT_HUB_METADATA_TIMEOUT="soon"))
    assert "KIMI_CONVERT_HUB_METADATA_TIMEOUT=soon: expected a positive number of seconds" in line
