"""The second ``Source``: a Hub repository, ``hf://OWNER/REPO[@REVISION]`` (issue 25, item 1).

Why it looks the way it does:

- the revision (a branch, a tag, or nothing: ``main``) is resolved to a commit ONCE, by ``repo_info``, and every
  later request names that commit, so a push to the branch during a long run cannot mix two checkpoints; the
  commit is in ``name`` (``hf://owner/repo@<40 hex>``), which messages and the journal's command show;
- the listing is the repository tree at that commit (``list_repo_tree``, recursive): each file's size and,
  for LFS files, the sha256 the Hub recorded (``FileEntry.sha256``), so that the journal's stamp and the
  manifest's provenance need no download;
- bytes are read by HTTP range requests on the file's ``resolve`` URL through huggingface_hub's own client
  (``http_backoff``: its retries of 429/5xx, its auth headers, its typed errors), so that ``plan`` and
  ``inspect`` read config.json, the index and the two ranges of each shard header (``read_header``), nothing
  else: no weights;
- every failure goes through ``transport.with_retries``: one line naming the repository and what went
  wrong (not found, gated, revision not found, no network), classified by the library's exception types.

Holds no open connection (it is pickled to workers): the library's shared client is per process.
The token is kept out of ``repr`` and handed to the library only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from ..errors import ConvertError
from ..jsonfile import MAX_JSON_BYTES, parse
from .protocol import EntryKind, FileEntry, ResourceFreeFile, normal_name

SCHEME = "hf://"


def is_hub_spec(spec: object) -> bool:
    return isinstance(spec, str) and spec.startswith(SCHEME)


def parse_spec(spec: str) -> tuple[str, str | None]:
    """``hf://owner/repo[@revision]`` -> (repo id, revision or None). The id's form is checked by the library's
    validator (``transport.check_repo_id``) when the source opens."""
    rest = spec[len(SCHEME):]
    repo, at, revision = rest.partition("@")
    if at and not revision:
        raise ConvertError(f"{spec}: empty revision after '@' (expected hf://OWNER/REPO[@REVISION])")
    return repo.strip("/"), revision or None


def _say(line: str) -> None:
    import sys

    print(line, file=sys.stderr)


@dataclass
class HubFile(ResourceFreeFile):
    """One file of the repository at the resolved commit, read by range requests."""

    source: HubRepo
    rel: str
    size: int
    shown: str

    def read_range(self, offset: int, length: int) -> bytes:
        end = min(offset + length, self.size)
        if end <= offset:
            return b""
        return self.source.get_range(self.rel, offset, end, f"reading {self.rel}")

    def readinto(self, offset: int, buf: memoryview) -> int:
        data = self.read_range(offset, len(buf))
        buf[: len(data)] = data
        return len(data)


@dataclass
class HubRepo:
    """A Hub model repository at one commit (module docstring). ``files``: path -> entry (files only);
    ``folders``: every folder a path passes through."""

    repo_id: str
    commit: str
    files: dict[str, FileEntry]
    folders: frozenset[str]
    token: str | None = field(default=None, repr=False)
    requested: str | None = None  # the revision as the user gave it (None: the default branch)

    @classmethod
    def connect(cls, spec: str, token: str | None = None, say: Callable[[str], None] = _say) -> HubRepo:
        """Resolve the revision to a commit (once), list the tree at that commit. Every failure: one line."""
        from ..transport import bound_library, check_repo_id, metadata_step, resolve_token, with_retries

        repo_id, revision = parse_spec(spec)
        check_repo_id(repo_id)
        token = resolve_token(token, repo_id, required=False)
        bound_library()
        from huggingface_hub import HfApi

        api = HfApi(token=token)
        what = f"resolving revision {revision}" if revision else "looking up the repository"
        with metadata_step(what, repo_id):
            info = with_retries(lambda: api.repo_info(repo_id, revision=revision), what, repo_id, say,
                                contacted=False, hint=None)
        commit = info.sha
        if not commit:
            raise ConvertError(f"{repo_id}: the Hub gave no commit for revision {revision or 'main'}")
        with metadata_step("listing the repository", repo_id):
            tree = with_retries(lambda: list(api.list_repo_tree(repo_id, revision=commit, recursive=True)),
                                "listing the repository", repo_id, say, hint=None)
        files: dict[str, FileEntry] = {}
        folders: set[str] = set()
        for e in tree:
            path = e.path
            if not hasattr(e, "size"):  # a RepoFolder
                folders.add(path)
                continue
            lfs = getattr(e, "lfs", None)
            sha = (lfs.get("sha256") if isinstance(lfs, dict) else getattr(lfs, "sha256", None)) if lfs else None
            files[path] = FileEntry(path, EntryKind.FILE, int(e.size), sha256=sha, revision=commit,
                                    oid=getattr(e, "blob_id", None))
            parent = PurePosixPath(path).parent
            while str(parent) != ".":
                folders.add(str(parent))
                parent = parent.parent
        return cls(repo_id, commit, files, frozenset(folders), token, revision)

    # -- the Source protocol ------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return f"{SCHEME}{self.repo_id}@{self.commit}"

    def describe(self) -> str:
        asked = f" ({self.requested})" if self.requested and self.requested != self.commit else ""
        return f"Hub repository {self.repo_id} at commit {self.commit}{asked}"

    def shown(self, rel: str) -> str:
        return f"{self.name}/{rel}"

    def provenance(self) -> dict:
        """The manifest's and the plan's ``source``: the repository and the commit every read named. Not the
        revision as asked: a resumed pack names the commit itself, and its manifest must be an uninterrupted
        run's. Each input's LFS sha256 is the manifest's ``inputs[].sha256``."""
        return {"hub": self.repo_id, "commit": self.commit}

    def local_path(self, rel: str = "") -> Path | None:
        return None

    def for_worker(self) -> HubRepo:
        return self

    def entry(self, rel: str) -> FileEntry | None:
        if rel in self.files:
            return self.files[rel]
        if rel in self.folders:
            return FileEntry(rel, EntryKind.FOLDER)
        return None

    def check_named(self, rel: str, what: str) -> FileEntry:
        if rel.startswith("/") or any(p == ".." for p in PurePosixPath(rel).parts):
            raise ConvertError(f"{what}: file {rel!r} is not a path inside the repository {self.repo_id}")
        e = self.files.get(rel)
        if e is None:
            raise ConvertError(f"{what}: names missing file {rel!r} (not in {self.name})")
        return e

    def canonical_names(self, files: list[str], what: str) -> dict[str, str]:
        renamed = {}
        for f in files:
            if f.startswith("/"):
                self.check_named(f, what)
            elif normal_name(f) != f:  # ./model-00002-of-00003.safetensors: the tree's own spelling
                renamed[f] = normal_name(f)
        return renamed

    def list_files(self, prune: Callable[[str], bool] | None = None) -> list[FileEntry]:
        """Top-down as ``Source.list_files`` says: in each folder its sub-folders, then its files, sorted; then
        each sub-folder's contents (the same order a local folder's ``os.walk`` gives)."""
        children: dict[str, tuple[list[str], list[str]]] = {"": ([], [])}
        for d in sorted(self.folders):
            children.setdefault(d, ([], []))
            children.setdefault(_parent(d), ([], []))[0].append(d)
        for f in sorted(self.files):
            children.setdefault(_parent(f), ([], []))[1].append(f)
        out: list[FileEntry] = []
        todo = [""]
        while todo:
            here = todo.pop(0)
            subs, names = children.get(here, ([], []))
            descend = []
            for d in sorted(subs):
                out.append(FileEntry(d, EntryKind.FOLDER))
                if prune is None or not prune(d):
                    descend.append(d)
            out += [self.files[f] for f in sorted(names)]
            todo = descend + todo
        return out

    def open(self, rel: str, shown: str | None = None) -> HubFile:
        e = self.check_named(rel, self.name)
        return HubFile(self, rel, e.size, shown or self.shown(rel))

    def read_json(self, rel: str, shown: str | None = None, *, limit: int | None = None,
                  want: type | None = dict) -> Any:
        shown = shown or self.shown(rel)
        e = self.files.get(rel)
        if e is None:
            raise ConvertError(f"{shown}: not found in {self.name}")
        limit = limit or MAX_JSON_BYTES
        if e.size > limit:
            raise ConvertError(f"{shown}: {e.size} bytes, more than the {limit}-byte limit for a JSON file")
        data = self.get_range(rel, 0, e.size, f"reading {rel}") if e.size else b""
        return parse(data, shown, limit=limit, want=want)

    # -- transport ----------------------------------------------------------------------------------

    def url(self, rel: str) -> str:
        from huggingface_hub import hf_hub_url

        return hf_hub_url(self.repo_id, rel, revision=self.commit)

    def get_range(self, rel: str, lo: int, hi: int, what: str) -> bytes:
        """Bytes [lo, hi) of ``rel`` by one range request (the library's client, retries and errors)."""
        from ..transport import metadata_step, with_retries

        def fetch() -> bytes:
            from huggingface_hub.utils import build_hf_headers, hf_raise_for_status, http_backoff

            headers = build_hf_headers(token=self.token)
            headers["Range"] = f"bytes={lo}-{hi - 1}"
            headers["Accept-Encoding"] = "identity"
            r = http_backoff("GET", self.url(rel), headers=headers, follow_redirects=True)
            hf_raise_for_status(r)
            data = r.content
            if r.status_code == 200 and (lo, hi) != (0, len(data)):  # the server ignored the range
                data = data[lo:hi]
            if len(data) != hi - lo:
                raise ConvertError(f"{self.shown(rel)}: the Hub sent {len(data)} bytes for a range of {hi - lo}")
            return data

        with metadata_step(what, self.repo_id):
            return with_retries(fetch, what, self.repo_id, _say, hint=None)


def _parent(rel: str) -> str:
    p = str(PurePosixPath(rel).parent)
    return "" if p == "." else p
