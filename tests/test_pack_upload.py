"""``pack --upload``: each shard sent to the Hub as it is final, against tests/fakehub.py through the real
huggingface_hub client (Xet off). Checked: the Hub's repository equals a local pack followed by
``upload`` (same files, same bytes, same LFS sha256 list); the upload overlaps the conversion (the
server's request times against the shards' write times); ``--no-keep-output`` never holds more than the
shards in flight (sampled, the upload throttled); kills at fault points and at random times, resumed
without sending a shard twice; 429/5xx retried; the Hub gone at the start is one line, fast, nothing packed.
"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

import fault_inject
from fakehub import TOKEN, FakeHub, hub_cli
from helpers import cli_command, one_line_error, run

# as tests/test_resume.py: 14 shards of 1 MB at most, one worker and one stream (which shards a kill leaves
# finished depends on them)
#: test_random_kills_resume_identically: the throttled upload's seconds, whatever the machine's speed
UPLOAD_S = 6.0
PACK_ARGS = ["--layout", "sglang", "--recipe", "nvfp4-w4a16", "--max-shard-size", "1MB", "-q", "--device", "cpu",
             "--workers", "1", "--streams", "1"]
QUEUE = 2  # convert/upload/live.py's default, pinned here by the environment of every run


@pytest.fixture
def hub():
    with FakeHub(TOKEN) as h:
        yield h


@pytest.fixture(scope="module")
def medium(tmp_path_factory) -> tuple[Path, Path, dict]:
    """tiny-k3 with 32 experts a layer; its local pack followed by ``upload`` (the reference: the local
    folder, and the repository's files as the fake Hub holds them)."""
    work = tmp_path_factory.mktemp("medium")
    assert run("synth", "tiny-k3", work / "in", "--experts", "32").code == 0
    r = run("pack", work / "in", work / "ref", *PACK_ARGS)
    assert r.code == 0, r.stderr
    with FakeHub(TOKEN) as h:
        r = hub_cli(h, "upload", work / "ref", "user/ref", tmp=work)
        assert r.code == 0, r.stderr
        files = {p: h.file_bytes("user/ref", p) for p in h.repos["user/ref"].files}
        lfs = sorted(f["lfs"] for f in h.repos["user/ref"].files.values() if f["lfs"])
    return work / "in", work / "ref", {"files": files, "lfs": lfs}


def cli(hub: FakeHub, *args, tmp: Path, **env):
    return hub_cli(hub, *args, tmp=tmp, KIMI_CONVERT_UPLOAD_QUEUE=str(QUEUE), **env)


def assert_same_repo(hub: FakeHub, repo_id: str, ref: dict) -> None:
    """The repository holds exactly the reference's files, byte for byte, with the same LFS objects."""
    repo = hub.repos[repo_id]
    assert set(repo.files) == set(ref["files"]), set(repo.files) ^ set(ref["files"])
    for p in repo.files:
        assert hub.file_bytes(repo_id, p) == ref["files"][p], p
    assert sorted(f["lfs"] for f in repo.files.values() if f["lfs"]) == ref["lfs"]


def puts(hub: FakeHub) -> list[str]:
    """The LFS objects the server took (successful PUTs), in order."""
    return [p.rsplit("/", 1)[1] for m, p, s in hub.log if m == "PUT" and s == 200]


def test_pack_upload_equals_pack_then_upload(hub, medium, tmp_path):
    src, ref, ref_repo = medium
    out = tmp_path / "out"
    r = cli(hub, "pack", src, out, *PACK_ARGS, "--upload", "user/live", "--private", tmp=tmp_path)
    assert r.code == 0, r.stderr
    assert hub.log[0][1] == "/api/whoami-v2"  # the probe, before anything else
    assert_same_repo(hub, "user/live", ref_repo)
    assert hub.repos["user/live"].private and len(hub.repos["user/live"].commits) == 1
    assert sorted(puts(hub)) == ref_repo["lfs"]  # each shard sent once, through LFS
    man = json.loads((out / "manifest.json").read_text())
    n = len(man["outputs"]) + len(man["records"]) + len(man["files"]) + 1
    assert f"user/live: all {n} files present, sizes and sha256 match the manifest" in r.stdout
    assert "14 shard(s) uploaded by this run" in r.stdout
    # the local folder is the local pack's, with the card upload writes: nothing of the upload left in it
    assert fault_inject.same_tree(ref, out) == []
    # the commit lists manifest.json last
    commit = [i for i, (m, p, _) in enumerate(hub.log) if "/commit/" in p]
    assert len(commit) == 1 and all(i < commit[0] for i, (m, p, _) in enumerate(hub.log) if m == "PUT")


def test_upload_overlaps_conversion(hub, medium, tmp_path):
    """The first shard is on the Hub before the last shard is written: the server's clock (monotonic, in
    this process) against the shards' modification times (the wall clock), one offset apart."""
    src, _, ref_repo = medium
    out = tmp_path / "out"
    offset = time.time() - time.monotonic()
    r = cli(hub, "pack", src, out, *PACK_ARGS, "--upload", "user/overlap", tmp=tmp_path)
    assert r.code == 0, r.stderr
    first_put = next(t for t, (m, _, s) in zip(hub.times, hub.log, strict=True) if m == "PUT" and s == 200)
    last_written = max(p.stat().st_mtime for p in out.glob("*.safetensors"))
    assert first_put + offset < last_written, (first_put + offset, last_written)
    assert_same_repo(hub, "user/overlap", ref_repo)


def test_no_keep_output_holds_only_the_shards_in_flight(hub, medium, tmp_path):
    """Uploads throttled to 4 MB/s (a 1 MB shard each 0.25 s, slower than the conversion): the local
    folder, sampled every 20 ms, never holds more shards (finished or being written) than the queue, the
    one being sent and one a stream opens while it has another open; at the end, none."""
    src, _, ref_repo = medium
    out = tmp_path / "out"
    hub.upload_bps = 4e6
    seen: list[tuple[int, int]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            if out.is_dir():
                names = [p.name for p in out.iterdir()]
                seen.append((sum(n.endswith(".safetensors") for n in names),
                             sum(n.endswith(".safetensors.partial") for n in names)))
            time.sleep(0.02)
    t = threading.Thread(target=sample)
    t.start()
    try:
        r = cli(hub, "pack", src, out, *PACK_ARGS, "--upload", "user/bounded", "--no-keep-output", tmp=tmp_path)
    finally:
        done.set()
        t.join()
    assert r.code == 0, r.stderr
    peak = max(f + p for f, p in seen)  # finished or being written
    assert 0 < peak <= QUEUE + 2, seen
    assert max(f for f, _ in seen) > 0  # the sampling saw finished shards wait for the uploader
    assert not list(out.glob("*.safetensors"))
    assert (out / "manifest.json").is_file() and (out / "config.json").is_file()
    assert_same_repo(hub, "user/bounded", ref_repo)


def test_rate_limits_and_server_errors_are_retried(hub, medium, tmp_path):
    src, _, ref_repo = medium
    hub.fail("POST", r"/preupload/", 429, times=2)
    hub.fail("PUT", r"/lfs-upload/", 503, times=2)
    hub.fail("POST", r"/info/lfs/objects/batch", 502, times=1)
    hub.fail("POST", r"/commit/", 503, times=2)
    hub.fail("POST", r"/repos/create", 500, times=1)
    r = cli(hub, "pack", src, tmp_path / "out", *PACK_ARGS, "--upload", "user/flaky", tmp=tmp_path)
    assert r.code == 0, r.stderr
    assert sum(1 for _, _, s in hub.log if s in (429, 500, 502, 503)) == 8
    assert_same_repo(hub, "user/flaky", ref_repo)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_hub_gone_at_the_start_is_one_line_and_nothing_is_packed(medium, tmp_path):
    src, _, _ = medium
    out = tmp_path / "out"
    t = time.monotonic()
    r = hub_cli(None, "pack", src, out, *PACK_ARGS, "--upload", "user/offline", tmp=tmp_path,
                endpoint=f"http://127.0.0.1:{closed_port()}", KIMI_CONVERT_RETRY_BASE="2")
    elapsed = time.monotonic() - t  # the process's start (imports) included
    line = one_line_error(r)
    assert "user/offline: checking the token: 127.0.0.1: cannot connect (" in line, line
    assert "check the network or HF_ENDPOINT" in line and "resume" not in line and "retry" not in r.stderr
    assert elapsed < 10, elapsed
    assert not out.exists()  # not even the folder


def test_checks_before_packing(hub, medium, tmp_path):
    src, _, _ = medium
    out = tmp_path / "out"
    line = one_line_error(run("pack", src, out, *PACK_ARGS, "--upload", "no-owner", "--token", TOKEN))
    assert "'no-owner' is not a Hub repo id" in line and not out.exists()
    line = one_line_error(cli(hub, "pack", src, out, *PACK_ARGS, "--upload", "user/x", token=None, tmp=tmp_path))
    assert "user/x: no Hugging Face token" in line and not out.exists() and hub.log == []
    line = one_line_error(cli(hub, "pack", src, out, *PACK_ARGS, "--upload", "user/x", token="read-only",
                              tmp=tmp_path))
    assert "read-only" in line and not out.exists()
    r = run("pack", src, out, *PACK_ARGS, "--no-keep-output")
    assert r.code == 2 and "--no-keep-output needs --upload REPO_ID" in r.stderr


def resume_command(out: Path) -> list[str]:
    """The journal's resume command (the token is never in it), as arguments of kimi-convert."""
    text = (out / ".kimi-convert-pack.json").read_text()
    assert TOKEN not in text
    return shlex.split(json.loads(text)["command"])[1:]


@pytest.mark.parametrize("point", ["shard:3", "upload:1", "upload:5", "journal:9", "records:8", "json:2"])
def test_killed_at_a_fault_point_resumes_without_resending(hub, medium, tmp_path, point):
    """Killed at a fault point (``upload``: a shard on the Hub, not yet journaled), then resumed with the
    journal's command: the Hub ends equal to pack + upload, and no shard was sent twice (a shard sent but
    not journaled is found on the Hub by the LFS batch, a journaled one is re-checked there)."""
    src, _, ref_repo = medium
    out = tmp_path / "out"
    args = ["pack", src, out, *PACK_ARGS, "--upload", "user/killed", "--no-keep-output"]
    r = cli(hub, *args, tmp=tmp_path, KIMI_CONVERT_FAULT=point)
    assert r.code == -signal.SIGKILL, (r.code, r.stderr)
    assert not hub.repos["user/killed"].files  # nothing committed yet
    sent_first = puts(hub)
    r = cli(hub, *resume_command(out), tmp=tmp_path)
    assert r.code == 0, r.stderr
    assert_same_repo(hub, "user/killed", ref_repo)
    assert sorted(puts(hub)) == ref_repo["lfs"], (len(sent_first), len(puts(hub)))  # each object once
    assert not list(out.glob("*.safetensors")) and not (out / ".kimi-convert-pack.json").exists()


def test_killed_after_the_commit_resumes_to_a_check(hub, medium, tmp_path):
    """Killed once the commit is in, before the remote check and the journal's removal: the resume sends
    no shard again, commits the same files, and ends with the remote check."""
    src, _, ref_repo = medium
    out = tmp_path / "out"
    args = ["pack", src, out, *PACK_ARGS, "--upload", "user/after", "--no-keep-output"]
    r = cli(hub, *args, tmp=tmp_path, KIMI_CONVERT_FAULT="commit:1")
    assert r.code == -signal.SIGKILL, (r.code, r.stderr)
    assert_same_repo(hub, "user/after", ref_repo)  # the commit was in
    n = len(puts(hub))
    r = cli(hub, *resume_command(out), tmp=tmp_path)
    assert r.code == 0, r.stderr
    assert "all " in r.stdout and "0 shard(s) uploaded by this run" in r.stdout and len(puts(hub)) == n
    assert_same_repo(hub, "user/after", ref_repo)
    assert not (out / ".kimi-convert-pack.json").exists()


def _hub_env(hub: FakeHub, tmp: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE_"))}
    env.update(HF_ENDPOINT=hub.url, HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1",
               HF_HOME=str(tmp / "hf-home"), KIMI_CONVERT_RETRY_BASE="0.01", TQDM_DISABLE="1",
               KIMI_CONVERT_UPLOAD_QUEUE=str(QUEUE))
    return env


@pytest.mark.slow
@pytest.mark.parametrize("seed", [25, 26])
def test_random_kills_resume_identically(medium, tmp_path, seed):
    """SIGKILL at random times (seeded), the upload throttled so that kills land mid-conversion,
    mid-upload and mid-commit alike; each run resumed with the journal's command until one finishes. The
    Hub ends equal to pack + upload and took each LFS object once."""
    src, _, ref_repo = medium
    rng = random.Random(seed)
    out, repo = tmp_path / "out", "user/random"
    first = ["pack", str(src), str(out), *PACK_ARGS, "--upload", repo, "--no-keep-output"]
    with FakeHub(TOKEN) as hub:
        # the upload alone outlasts the latest first kill (4 s) on any machine: the first run is always killed
        hub.upload_bps = sum(len(ref_repo["files"][p]) for p in ref_repo["files"]) / UPLOAD_S
        env = _hub_env(hub, tmp_path)
        args, kills = first, 0
        for _ in range(8):
            p = subprocess.Popen([*cli_command(*args), "--token", TOKEN], env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
            try:
                p.wait(timeout=rng.uniform(0.5, UPLOAD_S - 2.0))
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGKILL)
                p.wait()
                hub.wait_idle()  # its transfers in flight end (fakehub.FakeHub.wait_idle)
                kills += 1
            if p.returncode == 0:
                break
            if (out / ".kimi-convert-pack.json").exists():
                args = [str(a) for a in resume_command(out)]
            elif (out / "manifest.json").exists():  # killed after the journal went: complete, checked again
                args = [*first, "--resume"]
        else:
            r = cli(hub, *args, tmp=tmp_path)
            assert r.code == 0, r.stderr
        assert kills >= 1
        assert_same_repo(hub, repo, ref_repo)
        assert sorted(puts(hub)) == ref_repo["lfs"]


def test_resume_command_has_no_token(hub, medium, tmp_path):
    src, _, _ = medium
    out = tmp_path / "out"
    r = cli(hub, "pack", src, out, *PACK_ARGS, "--upload", "user/tok", tmp=tmp_path, KIMI_CONVERT_FAULT="shard:2")
    assert r.code == -signal.SIGKILL
    cmd = resume_command(out)
    assert "--token" not in cmd and "--upload" in cmd and "--resume" in cmd
    assert re.search(r"\buser/tok\b", " ".join(cmd))


def test_hub_gone_costs_milliseconds_in_process(medium, tmp_path, monkeypatch):
    """The same refusal timed inside the process (no interpreter start): the probe fails at once, and the
    plan is never made."""
    src, _, _ = medium
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setattr("kimi_convert.transport._bounded", True)  # leave this process's HTTP client be
    planned = []
    monkeypatch.setattr("kimi_convert.pack.load_plan", lambda *a, **k: planned.append(a))
    t = time.monotonic()
    r = run("pack", src, tmp_path / "out", *PACK_ARGS, "--upload", "user/offline", "--token", TOKEN)
    elapsed = time.monotonic() - t
    assert "user/offline: checking the token: 127.0.0.1: cannot connect (" in one_line_error(r)
    assert elapsed < 0.5 and planned == [] and not (tmp_path / "out").exists(), elapsed


def test_large_repositories_commit_in_several_commits(hub, medium, tmp_path):
    """Above KIMI_CONVERT_MAX_COMMIT_FILES operations, several commits; the repository ends the same."""
    src, _, ref_repo = medium
    r = cli(hub, "pack", src, tmp_path / "out", *PACK_ARGS, "--upload", "user/split", tmp=tmp_path,
            KIMI_CONVERT_MAX_COMMIT_FILES="10")
    assert r.code == 0, r.stderr
    commits = hub.repos["user/split"].commits
    assert len(commits) >= len(ref_repo["files"]) // 10, commits  # at most 10 files a commit
    assert commits[-1]["summary"].endswith(f"({len(commits)}/{len(commits)})")
    assert_same_repo(hub, "user/split", ref_repo)
