"""upload and verify-manifest --remote against a local server speaking the Hub's HTTP API, through the
real huggingface_hub client (Xet off). Faults: 401/403/404, 429 and 5xx, a dropped connection,
an interrupted upload resumed by re-running; the token never appears in any output."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fakehub import FakeHub

TOKEN = "hf_kimiConvertTestSecret0123456789"


@pytest.fixture
def hub():
    with FakeHub(TOKEN) as h:
        yield h


@pytest.fixture
def out(packed_k3, tmp_path) -> Path:
    return Path(shutil.copytree(packed_k3, tmp_path / "out"))


def cli(hub: FakeHub, *args, token: str | None = TOKEN, env_token: str | None = None, tmp: Path | None = None):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    env.update(HF_ENDPOINT=hub.url, HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1",
               HF_HOME=str(tmp or Path(os.environ.get("TMPDIR", "/tmp")) / "kc-hf-home"),
               KIMI_CONVERT_RETRY_BASE="0.01", TQDM_DISABLE="1")
    if env_token:
        env["HF_TOKEN"] = env_token
    extra = ["--token", token] if token else []
    r = subprocess.run([sys.executable, "-m", "kimi_convert.cli", *map(str, args), *extra], capture_output=True,
                       text=True, env=env, timeout=300)
    assert TOKEN not in r.stdout and TOKEN not in r.stderr, "the token leaked into the output"
    return r


def assert_arrived(hub: FakeHub, repo_id: str, out: Path, files: dict | None = None) -> None:
    repo_files = files if files is not None else hub.repos[repo_id].files
    local = {str(p.relative_to(out)): p for p in out.rglob("*") if p.is_file()}
    assert set(repo_files) == set(local), set(repo_files) ^ set(local)
    for name, p in local.items():
        f = repo_files[name]
        data = hub.lfs[f["lfs"]] if f["lfs"] else f["content"]
        assert data == p.read_bytes(), name


def test_upload_verifies_sends_everything_and_checks_remote(hub, out, tmp_path):
    r = cli(hub, "upload", out, "user/k3-nvfp4", "--private", tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    man = json.loads((out / "manifest.json").read_text())
    n = len(man["outputs"]) + len(man["files"]) + 1  # shards, configs/index/side files, the manifest
    assert f"all {n} files present, sizes and sha256 match the manifest" in r.stdout
    repo = hub.repos["user/k3-nvfp4"]
    assert repo.private and len(repo.commits) == 1
    assert_arrived(hub, "user/k3-nvfp4", out)
    assert all(f["lfs"] for p, f in repo.files.items() if p.endswith(".safetensors"))  # LFS, not git blobs
    card = (out / "README.md").read_text()
    assert card.startswith("---\n") and "- nvfp4" in card and "- modelopt" in card and "library_name:" in card
    assert "quantized to NVFP4" in card and "Kept in high precision" in card
    # the token went to the server in the Authorization header, nowhere else
    assert all(h in ("", f"Bearer {TOKEN}") for h in hub.headers_seen)
    # and verify-manifest --remote agrees, without downloading any weights
    r = cli(hub, "verify-manifest", out, "--remote", "user/k3-nvfp4", "--json", tmp=tmp_path)
    assert r.returncode == 0 and json.loads(r.stdout)["ok"], r.stdout + r.stderr
    assert not [m for m, p, _ in hub.log if m == "GET" and "/resolve/" in p]


def test_token_from_environment(hub, out, tmp_path):
    r = cli(hub, "upload", out, "user/env-token", token=None, env_token=TOKEN, tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    assert_arrived(hub, "user/env-token", out)


def test_refuses_to_upload_what_fails_verification(hub, out, tmp_path):
    (out / "hf_quant_config.json").write_text("{}")
    r = cli(hub, "upload", out, "user/bad", tmp=tmp_path)
    assert r.returncode == 2 and "refusing to upload" in r.stderr
    assert hub.log == [] or all("/repos/create" not in p for _, p, _ in hub.log)


@pytest.mark.parametrize(("token", "msg"), [("hf_wrong", "not authenticated (401)"),
                                            ("read-only", "forbidden (403)")])
def test_auth_errors(hub, out, tmp_path, token, msg):
    r = cli(hub, "upload", out, "user/auth", token=token, tmp=tmp_path)
    assert r.returncode == 2 and msg in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_missing_repo_for_remote_check(hub, out, tmp_path):
    r = cli(hub, "verify-manifest", out, "--remote", "user/nope", tmp=tmp_path)
    assert r.returncode == 2 and "not found (404)" in r.stderr


def test_rate_limits_and_server_errors_are_retried(hub, out, tmp_path):
    hub.fail("POST", r"/preupload/", 429, times=2)
    hub.fail("POST", r"/commit/", 503, times=2)
    hub.fail("POST", r"/repos/create", 500, times=1)
    r = cli(hub, "upload", out, "user/flaky", tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    assert_arrived(hub, "user/flaky", out)
    assert sum(1 for m, p, s in hub.log if s in (429, 500, 503)) == 5


def test_dropped_connection_mid_upload(hub, out, tmp_path):
    hub.fail("PUT", r"/lfs-upload/", 0, times=1)
    r = cli(hub, "upload", out, "user/dropped", tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    assert_arrived(hub, "user/dropped", out)


def test_interrupted_upload_resumes_by_rerunning(hub, out, tmp_path):
    hub.fail("POST", r"/commit/", 500, times=100)  # the commit never goes through this time
    r = cli(hub, "upload", out, "user/resume", tmp=tmp_path)
    assert r.returncode == 2 and "re-run the same command to resume" in r.stderr, r.stderr
    assert hub.repos["user/resume"].files == {}
    puts_first = sum(1 for m, p, s in hub.log if m == "PUT" and s == 200)
    assert puts_first == len([p for p in out.iterdir() if p.suffix == ".safetensors"]) + 1  # + manifest.json
    hub.faults.clear()
    r = cli(hub, "upload", out, "user/resume", tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    assert_arrived(hub, "user/resume", out)
    # nothing uploaded twice: the second run only committed what the first had sent
    assert sum(1 for m, p, s in hub.log if m == "PUT" and s == 200) == puts_first


def test_create_pr(hub, out, tmp_path):
    assert cli(hub, "upload", out, "user/pr", tmp=tmp_path).returncode == 0
    (out / "README.md").write_text("---\nlicense: other\n---\nA hand-written card.\n")
    r = cli(hub, "upload", out, "user/pr", "--create-pr", tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "/discussions/1" in r.stdout
    repo = hub.repos["user/pr"]
    assert repo.files["README.md"]["content"] != (out / "README.md").read_bytes()  # main untouched
    assert_arrived(hub, "user/pr", out, files=repo.prs[0]["files"])


def test_remote_tampering_is_reported(hub, out, tmp_path):
    assert cli(hub, "upload", out, "user/tamper", tmp=tmp_path).returncode == 0
    repo = hub.repos["user/tamper"]
    shard = next(p for p in repo.files if p.endswith(".safetensors"))
    repo.files[shard] = {**repo.files[shard], "lfs": "0" * 64}
    del repo.files["config.json"]
    r = cli(hub, "verify-manifest", out, "--remote", "user/tamper", "--json", tmp=tmp_path)
    rep = json.loads(r.stdout)
    assert r.returncode == 1 and not rep["ok"]
    text = "\n".join(rep["problems"])
    assert f"{shard}: the Hub's sha256" in text and "config.json is missing" in text


def test_quota_error_is_not_retried(hub, out, tmp_path):
    hub.fail("POST", r"/commit/", 403, times=100)
    r = cli(hub, "upload", out, "user/quota", tmp=tmp_path)
    assert r.returncode == 2 and "forbidden (403)" in r.stderr and "quota" in r.stderr
    assert sum(1 for m, p, s in hub.log if "/commit/" in p) == 1  # a 403 is final: no retry loop
