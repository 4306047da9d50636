"""``upload``: publish a verified output to the Hugging Face Hub, then confirm what arrived.

huggingface_hub does the transfer: ``upload_folder`` (with ``hf_xet`` installed it streams through
Xet in several commits; without it, one commit of LFS uploads; either way re-running the same call
skips what is already there). Around it this module adds what a multi-hundred-GB upload needs:
verification before anything is sent, bounded retries with backoff on rate limits, server errors and
dropped connections (re-running upload_folder resumes), one-line errors for auth, missing repos and
quotas, a model card, and a check of every remote file's size and sha256 against the manifest.
The token is handed to the library only: never printed, logged or written.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from .errors import ConvertError
from .verify import load, verify
from .write import sha256_file

T = TypeVar("T")
RETRY_STATUS = (408, 429, 500, 502, 503, 504)
MAX_ATTEMPTS = 6
IGNORE = [".kimi-convert-pack.json", "*.partial", ".cache/*"]


def _retry_base() -> float:
    return float(os.environ.get("KIMI_CONVERT_RETRY_BASE", "2.0"))


def _status(e: BaseException) -> int | None:
    resp = getattr(e, "response", None)
    return getattr(resp, "status_code", None)


def _is_network_error(e: BaseException) -> bool:
    names = {c.__name__ for c in type(e).__mro__}
    return bool(names & {"ConnectionError", "TimeoutException", "TransportError", "NetworkError",
                         "RemoteProtocolError", "ReadError", "WriteError", "ConnectError", "Timeout"})


def _explain(e: BaseException, what: str, repo_id: str) -> ConvertError:
    status = _status(e)
    server = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
    if status == 401:
        return ConvertError(f"{repo_id}: {what}: not authenticated (401); pass --token, set HF_TOKEN or run "
                            "`hf auth login`")
    if status == 403:
        return ConvertError(f"{repo_id}: {what}: forbidden (403): the token lacks write access to this repo, or "
                            f"a quota is exceeded ({server})")
    if status == 404:
        return ConvertError(f"{repo_id}: {what}: repository or revision not found (404), or not visible "
                            "with this token")
    if status == 413 or "quota" in server.lower() or "storage" in server.lower():
        return ConvertError(f"{repo_id}: {what}: refused by the Hub: {server}")
    return ConvertError(f"{repo_id}: {what}: {server}; re-run the same command to resume")


def with_retries(fn: Callable[[], T], what: str, repo_id: str, say: Callable[[str], None]) -> T:
    """Retry rate limits (429, honouring Retry-After), 5xx and dropped connections, MAX_ATTEMPTS times."""
    for attempt in range(1, MAX_ATTEMPTS + 1):
        try:
            return fn()
        except Exception as e:  # the library raises its own HTTP errors and the transport's
            status = _status(e)
            retriable = status in RETRY_STATUS or (status is None and _is_network_error(e))
            if not retriable or attempt == MAX_ATTEMPTS:
                raise _explain(e, what, repo_id) from None
            resp = getattr(e, "response", None)
            after = getattr(resp, "headers", {}).get("Retry-After") if resp is not None else None
            delay = min(float(after) if after and after.isdigit() else _retry_base() * 2 ** (attempt - 1), 60.0)
            say(f"{what}: {status or type(e).__name__}; retry {attempt}/{MAX_ATTEMPTS - 1} in {delay:.1f} s")
            time.sleep(delay)
    raise AssertionError("unreachable")


def model_card(man: dict, config: dict, base_model: str | None) -> str:
    mods = man["modules"]
    counts = {k: sum(m["kind"] == k for m in mods) for k in ("nvfp4", "fp8-block", "keep", "copy")}
    cast = [m["quantization"] for m in mods if m.get("quantization", {}).get("method") == "mxfp4-cast"]
    lossless = f"{sum(q['lossless_blocks'] for q in cast)} of {sum(q['blocks'] for q in cast)}"
    recipe = man.get("recipe") or {"name": "?", "quant_method": "modelopt", "quant_algo": "W4A16_NVFP4"}
    base = base_model or config.get("_name_or_path") or ""
    front = ["---", *([f"base_model: {base}"] if base else []), "library_name: transformers",
             "tags:", "- nvfp4", "- modelopt", "- kimi-convert", "- quantized", "---", ""]
    kept = [m for m in mods if m["kind"] == "keep"]
    reasons: dict[str, int] = {}
    for m in kept:
        reasons[m["rule"]] = reasons.get(m["rule"], 0) + 1
    body = [
        f"# {(config.get('architectures') or ['model'])[0]}, NVFP4",
        "",
        f"NVFP4 checkpoint (ModelOpt layout; recipe `{recipe['name']}`, `quant_method` {recipe['quant_method']}, "
        f"`quant_algo` {recipe['quant_algo']}) written by "
        f"kimi-convert {man['tool']['version']}"
        + (f" from `{base}`" if base else "") + ". `manifest.json` records the source of every tensor and "
        "the sha256 of every file; `kimi-convert verify-manifest` checks it (`--engine vllm|sglang` loads it "
        "with the engine's own code).",
        "",
        "| | modules |",
        "|---|---|",
        f"| quantized to NVFP4 | {counts['nvfp4']}"
        + (f" ({len(cast)} cast from MXFP4; {lossless} blocks lossless)" if cast else "") + " |",
        f"| quantized to 128x128 block FP8 | {counts['fp8-block']} |",
        f"| linear layers kept in high precision | {counts['keep']} |",
        f"| other tensors copied unchanged | {counts['copy']} |",
        "",
        "Kept in high precision, and why:",
        "",
        "| rule | modules |",
        "|---|---|",
        *[f"| {r.replace('|', '/')} | {n} |" for r, n in sorted(reasons.items(), key=lambda kv: -kv[1])],
        "",
        f"Mapping `{man['mapping']['name']}` (sha256 `{man['mapping']['sha256'][:16]}`); "
        f"{len(man['exclude_modules'])} names in `exclude_modules`.",
        "",
    ]
    return "\n".join(front + body)


def git_blob_sha1(path: Path) -> str:
    h = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())  # git's object id
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


@dataclass
class RemoteCheck:
    checked: int
    problems: list[str]


def check_remote(api, repo_id: str, revision: str | None, output: Path, man: dict,
                 say: Callable[[str], None]) -> RemoteCheck:
    """Every file of the manifest is in the repo; LFS files carry the manifest's sha256, the rest the
    local file's git blob id. Nothing is downloaded."""
    entries = with_retries(lambda: list(api.list_repo_tree(repo_id, revision=revision, recursive=True)),
                           "listing the repository", repo_id, say)
    remote = {e.path: e for e in entries if hasattr(e, "size")}
    problems: list[str] = []
    expected = {f["file"]: f for f in [*man["outputs"], *man.get("files", [])]}
    expected["manifest.json"] = None
    for name, rec in sorted(expected.items()):
        e = remote.get(name)
        if e is None:
            problems.append(f"{repo_id}: {name} is missing")
            continue
        lfs = getattr(e, "lfs", None)
        sha = (lfs.get("sha256") if isinstance(lfs, dict) else getattr(lfs, "sha256", None)) if lfs else None
        if rec is None:
            local = output / name
            if local.exists() and e.blob_id != git_blob_sha1(local) and sha != sha256_file(local):
                problems.append(f"{repo_id}: {name} differs from the local manifest.json")
            continue
        if e.size != rec["size"]:
            problems.append(f"{repo_id}: {name} has {e.size} bytes, manifest says {rec['size']}")
        if sha is not None:
            if sha != rec["sha256"]:
                problems.append(f"{repo_id}: {name}: the Hub's sha256 {sha[:16]}... is not the manifest's")
        elif (output / name).exists() and e.blob_id != git_blob_sha1(output / name):
            problems.append(f"{repo_id}: {name}: the Hub's blob id does not match the local file")
    return RemoteCheck(len(expected), problems)


@dataclass
class UploadResult:
    commit_url: str
    pr_url: str | None
    remote: RemoteCheck
    card_written: bool


def upload(output: str | Path, repo_id: str, *, private: bool = False, revision: str | None = None,
           create_pr: bool = False, token: str | None = None, base_model: str | None = None,
           say: Callable[[str], None] = print) -> UploadResult:
    from huggingface_hub import HfApi

    output = Path(output)
    rep = verify(output)
    if not rep.ok:
        raise ConvertError(f"{output}: verify-manifest found {len(rep.problems)} problem(s), refusing to upload; "
                           f"first: {rep.problems[0] if rep.problems else 'a failed check'}")
    man = load(output)
    api = HfApi(token=token)
    with_retries(lambda: api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model"),
                 "creating the repository", repo_id, say)
    card = output / "README.md"
    wrote_card = False
    if not card.exists():
        config = json.loads((output / "config.json").read_text(encoding="utf-8"))
        card.write_text(model_card(man, config, base_model), encoding="utf-8")
        wrote_card = True
    info = with_retries(
        lambda: api.upload_folder(repo_id=repo_id, folder_path=str(output), revision=revision, create_pr=create_pr,
                                  commit_message=f"Upload NVFP4 checkpoint (kimi-convert {man['tool']['version']})",
                                  ignore_patterns=IGNORE),
        "uploading", repo_id, say)
    pr_url = getattr(info, "pr_url", None)
    target = getattr(info, "pr_revision", None) if create_pr else revision
    remote = check_remote(api, repo_id, target, output, man, say)
    return UploadResult(str(getattr(info, "commit_url", "")), pr_url, remote, wrote_card)


def verify_remote(output: str | Path, repo_id: str, revision: str | None = None, token: str | None = None,
                  say: Callable[[str], None] = print) -> RemoteCheck:
    from huggingface_hub import HfApi

    output = Path(output)
    return check_remote(HfApi(token=token), repo_id, revision, output, load(output), say)
