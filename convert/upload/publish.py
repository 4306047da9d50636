"""``upload``: publish a verified output to the Hugging Face Hub, then confirm what arrived.

huggingface_hub does the transfer: ``upload_folder`` (with ``hf_xet`` installed it streams through
Xet in several commits; without it, one commit of LFS uploads; either way re-running the same call
skips what is already there). Around it this module adds what a multi-hundred-GB upload needs:

- checks that cost nothing, before gigabytes are verified: the repo id's form (the library's own
  validator), that a token exists, and one cheap request (``whoami``; ``repo_info`` for the remote
  check) that proves the Hub is reachable and the token valid; with no network that fails in
  milliseconds, once, with one line;
- bounded timeouts and retry budgets for the library's HTTP client and Xet (``bound_library``);
- retries of what retrying can fix (429 honouring ``Retry-After``, 408 and 5xx, a connection
  dropped after the first contact worked), with "resume" said only where re-running resumes;
- one-line errors naming the repo (and the file), classified by the library's exception types;
- a model card, and a check of every remote file's size and sha256 against the manifest (where the manifest
  records a file's BLAKE3, against the sha256 of the local file that matched it, from the verifying read).

The token is handed to the library only: never printed, logged or written.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import HfApi

from .. import filenames
from ..errors import ConvertError
from ..hashing import git_blob_sha1, sha256_file
from ..jsonfile import read_json
from ..manifest import hub_sha256, iter_modules, with_hub_digests, write_manifest
from ..transport import IGNORE, RESUME, connect, with_retries
from ..verify import load, verify
from .card import model_card

__all__ = ["check_remote", "upload", "verify_remote"]

@dataclass
class RemoteCheck:
    checked: int
    problems: list[str]


def check_remote(api, repo_id: str, revision: str | None, output: Path, man: dict,
                 say: Callable[[str], None], hint: str | None = "try again later",
                 local_sha256: dict[str, str] | None = None) -> RemoteCheck:
    """Every file of the manifest is in the repo; LFS files carry the manifest's sha256 (where it records BLAKE3:
    ``local_sha256``, the sha256 of the local files verify found to match it), the rest the local file's git blob
    id. Nothing is downloaded."""
    entries = with_retries(lambda: list(api.list_repo_tree(repo_id, revision=revision, recursive=True)),
                           "listing the repository", repo_id, say, hint=hint)
    remote = {e.path: e for e in entries if hasattr(e, "size")}
    problems: list[str] = []
    expected = {f["file"]: f for f in [*man["outputs"], *man.get("records", []), *man.get("files", [])]}
    expected[filenames.MANIFEST] = None
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
            want = rec.get("sha256") or (local_sha256 or {}).get(name)
            if want is None:
                problems.append(f"{repo_id}: {name}: the manifest records its BLAKE3, and no local copy matched it "
                                "to give the sha256 the Hub names it by")
            elif sha != want:
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
    """Check what can fail cheaply (id, token, reachability), verify, create the repo, upload, check.

    Only the upload step says "resume": the repo exists by then, and re-running ``upload_folder``
    skips what was sent. The remote check after it says how to run it alone."""
    output = Path(output)
    man = load(output)  # a finished output at all: cheap, local
    api = connect(repo_id, token, write=True, say=say)
    rep = verify(output, hub=True)
    if not rep.ok:
        raise ConvertError(f"{output}: verify-manifest found {len(rep.problems)} problem(s), refusing to upload; "
                           f"first: {rep.problems[0] if rep.problems else 'a failed check'}")
    man = with_hub_digests(man, hub_sha256(output, man, rep.sha256))  # the Hub's names, from verify's read
    write_manifest(output, man)
    with_retries(lambda: api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model"),
                 "creating the repository", repo_id, say)
    card = output / "README.md"
    wrote_card = False
    if not card.exists():
        config = read_json(output / "config.json", f"{output}/config.json")
        card.write_text(model_card(man, config, base_model, (m for _, m in iter_modules(output, man))),
                        encoding="utf-8")
        wrote_card = True
    info = with_retries(
        lambda: api.upload_folder(repo_id=repo_id, folder_path=str(output), revision=revision, create_pr=create_pr,
                                  commit_message=f"Upload NVFP4 checkpoint (kimi-convert {man['tool']['version']})",
                                  ignore_patterns=IGNORE),
        "uploading", repo_id, say, hint=RESUME)
    pr_url = getattr(info, "pr_url", None)
    target = getattr(info, "pr_revision", None) if create_pr else revision
    again = f"the upload is committed; check it again with: kimi-convert verify-manifest {output} --remote {repo_id}"
    remote = check_remote(api, repo_id, target, output, man, say, hint=again + (f" --revision {target}" if target
                                                                                 else ""), local_sha256=rep.sha256)
    return UploadResult(str(getattr(info, "commit_url", "")), pr_url, remote, wrote_card)


def verify_remote(output: str | Path, repo_id: str, revision: str | None = None, token: str | None = None,
                  say: Callable[[str], None] = print, api: HfApi | None = None,
                  local_sha256: dict[str, str] | None = None) -> RemoteCheck:
    """The remote half of verify-manifest; ``api`` from ``connect`` (done before the local hashing);
    ``local_sha256``: ``check_remote``'s (``Report.sha256``)."""
    output = Path(output)
    api = api or connect(repo_id, token, write=False, revision=revision, say=say)
    return check_remote(api, repo_id, revision, output, load(output), say, local_sha256=local_sha256)
