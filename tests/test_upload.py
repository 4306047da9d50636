"""upload and verify-manifest --remote against a local server speaking the Hub's HTTP API, through the
real huggingface_hub client (Xet off). Checked before any verification: the repo id's form, a token,
the Hub's answer (no network: one line in seconds). Faults: 401/403/404 (never retried, never
"resume"), 429 (Retry-After) and 5xx (retried), dropped connections midway (retried), an interrupted
upload resumed by re-running; the token never appears in any output. Every environment is
hermetic: no HF_* variable of the caller's, and HF_HOME in the test's own folder."""

from __future__ import annotations

import json
import shutil
import socket
import time
from pathlib import Path

import pytest

from fakehub import TOKEN, FakeHub, assert_arrived
from fakehub import hub_cli as cli
from helpers import manifest_with_modules, one_line_error, run, without_hub_digests


@pytest.fixture
def hub():
    with FakeHub(TOKEN) as h:
        yield h


@pytest.fixture
def out(packed_k3, tmp_path) -> Path:
    return Path(shutil.copytree(packed_k3, tmp_path / "out"))


def requests_to(hub: FakeHub, path_part: str) -> int:
    return sum(1 for _, p, _ in hub.log if path_part in p)


def break_verification(out: Path) -> None:
    """Make the offline verification fail: a check that ran it would say 'refusing to upload'."""
    (out / "hf_quant_config.json").write_text("{}")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_upload_verifies_sends_everything_and_checks_remote(hub, out, tmp_path):
    r = cli(hub, "upload", out, "user/k3-nvfp4", "--private", tmp=tmp_path)
    assert r.code == 0, r.stderr
    assert hub.log[0][1] == "/api/whoami-v2"  # the probe, before anything else
    man = json.loads((out / "manifest.json").read_text())
    # shards, their records files, configs/index/side files, the manifest
    n = len(man["outputs"]) + len(man["records"]) + len(man["files"]) + 1
    assert f"all {n} files present, sizes and sha256 match the manifest" in r.stdout
    repo = hub.repos["user/k3-nvfp4"]
    assert repo.private and len(repo.commits) == 1
    assert_arrived(hub, "user/k3-nvfp4", out)
    assert all(f["lfs"] for p, f in repo.files.items() if p.endswith(".safetensors"))  # LFS, not git blobs
    card = (out / "README.md").read_text()
    assert card.startswith("---\n") and "- nvfp4" in card and "- modelopt" in card and "library_name:" in card
    assert "quantized to NVFP4" in card and "Kept in high precision" in card
    kinds = [m["kind"] for m in manifest_with_modules(out)["modules"]]  # the card counts the records files' modules
    assert f"| quantized to NVFP4 | {kinds.count('nvfp4')}" in card and f"| {kinds.count('copy')} |" in card
    from huggingface_hub import ModelCard
    parsed = ModelCard.load(out / "README.md")  # the Hub's own parser reads the metadata back
    assert "nvfp4" in parsed.data.tags and parsed.data.library_name == "transformers"
    # the token went to the server in the Authorization header, nowhere else
    assert all(h in ("", f"Bearer {TOKEN}") for h in hub.headers_seen)
    # and verify-manifest --remote agrees, without downloading any weights
    r = cli(hub, "verify-manifest", out, "--remote", "user/k3-nvfp4", "--json", tmp=tmp_path)
    assert r.code == 0 and json.loads(r.stdout)["ok"], r.stdout + r.stderr
    assert not [m for m, p, _ in hub.log if m == "GET" and "/resolve/" in p]


def test_upload_records_the_hubs_sha256_and_remote_checks_a_blake3_manifest_from_the_local_files(hub, out, tmp_path,
                                                                                                monkeypatch):
    """A local pack records each file's BLAKE3 only; upload adds each output file's sha256 (its LFS object id,
    hashlib's own over the file) beside it. A manifest without them (uploaded by other means) is still checked
    against the Hub by --remote, from the local files' sha256 read with their BLAKE3; a local file that no longer
    matches the manifest gives no sha256, and the remote check says so for it."""
    from huggingface_hub import HfApi

    before = json.loads((out / "manifest.json").read_text())
    assert all("sha256" not in e and "blake3" in e for e in [*before["outputs"], *before["records"], *before["files"]])
    plain = Path(shutil.copytree(out, tmp_path / "plain"))
    r = cli(hub, "upload", out, "user/k3-nvfp4", tmp=tmp_path)
    assert r.code == 0, r.stderr
    assert without_hub_digests(out) == before  # (each sha256 checked against its file's bytes)
    out = plain  # the same folder uploaded by other means (huggingface_hub itself): its manifest as the pack wrote it
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_DISABLE_XET", True)  # (the fake Hub speaks LFS)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    HfApi(endpoint=hub.url, token=TOKEN).create_repo("user/plain")
    HfApi(endpoint=hub.url, token=TOKEN).upload_folder(repo_id="user/plain", folder_path=str(out))
    r = cli(hub, "verify-manifest", out, "--remote", "user/plain", tmp=tmp_path)
    assert r.code == 0, r.stdout + r.stderr
    assert "ok    Hub repo user/plain: files, sizes and sha256" in r.stdout, r.stdout
    shard = out / before["outputs"][0]["file"]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    r = cli(hub, "verify-manifest", out, "--remote", "user/plain", tmp=tmp_path)
    assert r.code == 1, r.stdout + r.stderr
    assert (f"user/plain: {shard.name}: the manifest records its BLAKE3, and no local copy matched it to give the "
            "sha256 the Hub names it by") in r.stdout + r.stderr


def test_token_from_environment(hub, out, tmp_path):
    r = cli(hub, "upload", out, "user/env-token", token=None, env_token=TOKEN, tmp=tmp_path)
    assert r.code == 0, r.stderr
    assert_arrived(hub, "user/env-token", out)


def test_token_from_the_stored_login(hub, out, tmp_path):
    (tmp_path / "hf-home").mkdir()
    (tmp_path / "hf-home" / "token").write_text(TOKEN)  # where `hf auth login` stores it, under HF_HOME
    r = cli(hub, "upload", out, "user/login-token", token=None, tmp=tmp_path)
    assert r.code == 0, r.stderr
    assert_arrived(hub, "user/login-token", out)


def test_no_token_fails_before_verifying(hub, out, tmp_path):
    break_verification(out)
    line = one_line_error(cli(hub, "upload", out, "user/no-token", token=None, tmp=tmp_path))
    assert "user/no-token: no Hugging Face token" in line
    assert "--token" in line and "HF_TOKEN" in line and "hf auth login" in line and "resume" not in line
    assert "refusing" not in line and hub.log == []  # nothing verified, nothing sent


@pytest.mark.parametrize("repo_id", ["no-owner", "a/b/c", "user/bad name", "user/x..y", "user/-x"])
def test_bad_repo_id_fails_before_verifying(hub, out, tmp_path, repo_id):
    break_verification(out)
    # in-process: the id's form is checked before the library's environment (the token, the Hub) is read
    line = one_line_error(run("upload", out, repo_id, "--token", TOKEN))
    assert TOKEN not in line
    assert f"{repo_id!r} is not a Hub repo id" in line and "owner/name" in line, line
    assert "refusing" not in line and "resume" not in line
    assert hub.log == []


def test_bad_repo_id_for_remote_check(hub, out, tmp_path):
    line = one_line_error(run("verify-manifest", out, "--remote", "user/a/b", "--token", TOKEN))
    assert "'user/a/b' is not a Hub repo id" in line and hub.log == []


@pytest.mark.parametrize("command", ["upload", "verify-manifest"])
@pytest.mark.parametrize("network", ["refused", "silent"])
def test_no_network_fails_fast_with_one_line(out, tmp_path, command, network):
    """No Hub at HF_ENDPOINT: a closed port (refused at once), or a server that accepts connections and
    never answers (the probe's short timeout, here 1 s). Not retried (at the default retry base, 2 s,
    a retry would show), one line, no "resume". Before: 63 s (upload) and 207 s (verify-manifest
    --remote) for a closed port, and a silent server held them for good."""
    args = ["upload", out, "user/offline"] if command == "upload" else ["verify-manifest", out, "--remote",
                                                                         "user/offline"]
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # connections complete in the kernel's backlog; nothing reads them
        port = silent.getsockname()[1] if network == "silent" else closed_port()
        t = time.monotonic()
        r = cli(None, *args, tmp=tmp_path, endpoint=f"http://127.0.0.1:{port}", KIMI_CONVERT_RETRY_BASE="2",
                KIMI_CONVERT_CONNECT_TIMEOUT="1")
        elapsed = time.monotonic() - t
    line = one_line_error(r)
    step = "checking the token" if command == "upload" else "looking up the repository"
    what = "cannot connect (" if network == "refused" else "no answer (ReadTimeout)"
    assert f"user/offline: {step}: 127.0.0.1: {what}" in line and "check the network or HF_ENDPOINT" in line, line
    assert "resume" not in line and "retry" not in r.stderr
    assert elapsed < 10, elapsed


@pytest.mark.parametrize(("token", "msg"), [
    ("hf_wrong", "checking the token: not authenticated (401: Invalid user token."),
    ("read-only", "the token of 'user' is read-only")])
def test_auth_errors_fail_before_verifying_and_are_not_retried(hub, out, tmp_path, token, msg):
    break_verification(out)
    line = one_line_error(cli(hub, "upload", out, "user/auth", token=token, tmp=tmp_path))
    assert f"user/auth: {msg}" in line and "resume" not in line and "refusing" not in line, line
    assert hub.log == [("GET", "/api/whoami-v2", 401 if token == "hf_wrong" else 200)]  # once, nothing else


def test_forbidden_is_not_retried(hub, out, tmp_path):
    hub.fail("POST", r"/repos/create", 403, times=100, headers={"X-Error-Message": "no write access to 'user'"})
    line = one_line_error(cli(hub, "upload", out, "user/forbidden", tmp=tmp_path))
    assert "user/forbidden: creating the repository: forbidden (403)" in line and "resume" not in line, line
    assert requests_to(hub, "/repos/create") == 1


def test_repo_gone_midway_is_not_retried_and_not_resumable(hub, out, tmp_path):
    """A 404 during the upload step (where other failures say "resume") is final: no retry, no resume."""
    hub.fail("POST", r"/preupload/", 404, times=100, headers={"X-Error-Code": "RepoNotFound"})
    line = one_line_error(cli(hub, "upload", out, "user/gone", tmp=tmp_path))
    assert "user/gone: uploading: repository not found (404)" in line and "resume" not in line, line
    assert requests_to(hub, "/preupload/") == 1


def test_missing_repo_for_remote_check_fails_before_hashing(hub, out, tmp_path, monkeypatch):
    line = one_line_error(cli(hub, "verify-manifest", out, "--remote", "user/nope", tmp=tmp_path))
    assert "user/nope: looking up the repository: repository not found (404)" in line and "resume" not in line
    assert requests_to(hub, "/user/nope") == 1  # one lookup, not retried, no tree listing
    # in-process, to see that the local verification (hashing every file) never started
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", hub.url)
    # leave this process's HTTP client and environment be
    monkeypatch.setattr("kimi_convert.transport._bounded", True)
    verified = []
    monkeypatch.setattr("kimi_convert.verify.verify", lambda *a, **k: verified.append(a))
    r = run("verify-manifest", out, "--remote", "user/nope", "--token", TOKEN)
    assert "repository not found (404)" in one_line_error(r) and verified == []


def test_rate_limits_and_server_errors_are_retried(hub, out, tmp_path):
    hub.fail("POST", r"/preupload/", 429, times=2)
    hub.fail("POST", r"/commit/", 503, times=2)
    hub.fail("POST", r"/repos/create", 500, times=1)
    r = cli(hub, "upload", out, "user/flaky", tmp=tmp_path)
    assert r.code == 0, r.stderr
    assert_arrived(hub, "user/flaky", out)
    assert sum(1 for m, p, s in hub.log if s in (429, 500, 503)) == 5


def test_server_errors_are_retried_within_a_budget(hub, out, tmp_path):
    """Backoff 0.4 s then 0.8 s against a 1 s budget: with no useful answer since the step began, the
    second retry would end past it, so it is not made; the step before the upload says to try again
    later, not to resume. A step that keeps getting answers (the commit fails, the uploads before it
    work) is not out of budget."""
    slow = {"KIMI_CONVERT_RETRY_BASE": "0.4", "KIMI_CONVERT_RETRY_BUDGET": "1"}
    hub.fail("POST", r"/repos/create", 503, times=100)
    r = cli(hub, "upload", out, "user/down", tmp=tmp_path, **slow)
    assert r.code == 2 and requests_to(hub, "/repos/create") == 2
    line = r.stderr.strip().splitlines()[-1]
    assert "user/down: creating the repository: the Hub answered 503" in line and "(after 2 attempts)" in line
    assert line.endswith("; try again later") and "resume" not in r.stderr
    hub.faults.clear()
    hub.fail("POST", r"/commit/", 503, times=2)
    r = cli(hub, "upload", out, "user/blips", tmp=tmp_path, **slow)
    assert r.code == 0, r.stderr
    assert requests_to(hub, "/commit/") == 3 and "retry 2/3 in 0.8 s" in r.stderr


def test_retry_after_is_honoured(hub, out, tmp_path):
    hub.fail("POST", r"/repos/create", 429, times=1, headers={"Retry-After": "1"})
    r = cli(hub, "upload", out, "user/patient", tmp=tmp_path)
    assert r.code == 0, r.stderr
    first, second = [t for t, (_, p, _) in zip(hub.times, hub.log, strict=True) if "/repos/create" in p]
    assert second - first >= 1.0  # the retry base is 0.01 s: only the server's Retry-After explains the wait


def test_retry_after_beyond_reason_is_not_waited_for(hub, out, tmp_path):
    hub.fail("POST", r"/repos/create", 429, times=1, headers={"Retry-After": "3600"})
    line = one_line_error(cli(hub, "upload", out, "user/later", tmp=tmp_path))
    assert "rate limited (429)" in line and "asks to wait 3600 s" in line and "resume" not in line, line
    assert requests_to(hub, "/repos/create") == 1


def test_dropped_connection_mid_upload(hub, out, tmp_path):
    hub.fail("PUT", r"/lfs-upload/", 0, times=1)  # retried by the library's own backoff
    hub.fail("POST", r"/commit/", 0, times=1)  # the library sends the commit once: retried here
    r = cli(hub, "upload", out, "user/dropped", tmp=tmp_path)
    assert r.code == 0, r.stderr
    assert "connection dropped" in r.stderr and "retry 1/" in r.stderr
    assert_arrived(hub, "user/dropped", out)
    assert requests_to(hub, "/commit/") == 2


def test_interrupted_upload_resumes_by_rerunning(hub, out, tmp_path):
    hub.fail("POST", r"/commit/", 500, times=100)  # the commit never goes through this time
    r = cli(hub, "upload", out, "user/resume", tmp=tmp_path)
    assert r.code == 2 and "re-run the same command to resume" in r.stderr, r.stderr
    assert "uploading: the Hub answered 500" in r.stderr and "(after 4 attempts)" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("kimi-convert: error: user/resume: ")
    assert hub.repos["user/resume"].files == {}
    puts_first = sum(1 for m, p, s in hub.log if m == "PUT" and s == 200)
    # the files the Hub takes through LFS (fakehub: .safetensors, or over 100 kB): the shards, maybe records files
    lfs = [p for p in out.rglob("*") if p.is_file() and (p.suffix == ".safetensors" or p.stat().st_size > 100_000)]
    assert puts_first == len(lfs)
    hub.faults.clear()
    r = cli(hub, "upload", out, "user/resume", tmp=tmp_path)
    assert r.code == 0, r.stderr
    assert_arrived(hub, "user/resume", out)
    # nothing uploaded twice: the second run only committed what the first had sent
    assert sum(1 for m, p, s in hub.log if m == "PUT" and s == 200) == puts_first


def test_create_pr(hub, out, tmp_path):
    assert cli(hub, "upload", out, "user/pr", tmp=tmp_path).code == 0
    (out / "README.md").write_text("---\nlicense: other\n---\nA hand-written card.\n")
    r = cli(hub, "upload", out, "user/pr", "--create-pr", tmp=tmp_path)
    assert r.code == 0, r.stderr
    assert "/discussions/1" in r.stdout
    repo = hub.repos["user/pr"]
    assert repo.files["README.md"]["content"] != (out / "README.md").read_bytes()  # main untouched
    assert_arrived(hub, "user/pr", out, files=repo.prs[0]["files"])


def test_remote_tampering_is_reported(hub, out, tmp_path):
    assert cli(hub, "upload", out, "user/tamper", tmp=tmp_path).code == 0
    repo = hub.repos["user/tamper"]
    shard = next(p for p in repo.files if p.endswith(".safetensors"))
    repo.files[shard] = {**repo.files[shard], "lfs": "0" * 64}
    del repo.files["config.json"]
    r = cli(hub, "verify-manifest", out, "--remote", "user/tamper", "--json", tmp=tmp_path)
    rep = json.loads(r.stdout)
    assert r.code == 1 and not rep["ok"]
    text = "\n".join(rep["problems"])
    assert f"{shard}: the Hub's sha256" in text and "config.json is missing" in text


def test_quota_error_is_not_retried(hub, out, tmp_path):
    hub.fail("POST", r"/commit/", 403, times=100)
    r = cli(hub, "upload", out, "user/quota", tmp=tmp_path)
    line = one_line_error(r)
    assert "forbidden (403)" in line and "quota" in line and "resume" not in line
    assert sum(1 for m, p, s in hub.log if "/commit/" in p) == 1  # a 403 is final: no retry loop
