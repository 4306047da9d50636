"""A local server speaking the part of the Hugging Face Hub HTTP API that huggingface_hub's
``create_repo``, ``upload_folder`` (Xet off: preupload, LFS batch and basic transfer, NDJSON commit)
and ``list_repo_tree`` use, so that the real client can be tested without the network.

Faults: ``hub.fail(method, path_regex, status, times, headers)`` answers the next ``times`` matching
requests with ``status`` and ``headers`` (``status=0`` drops the connection without an answer; a 429
says ``Retry-After: 0`` unless told otherwise). ``hub.log`` lists every request answered, ``hub.times``
when (monotonic seconds), for tests that check a wait.

Downloads (a Hub input, ``hf://``): ``hub.seed(repo_id, folder)`` commits a folder (``.safetensors`` through
LFS) and returns the commit; ``repo_info`` resolves a revision (``main``, a commit) to its commit, the tree
is listed at a commit, and ``/resolve/REV/PATH`` serves a file with ``Range`` (206). ``hub.served`` counts
the body bytes sent per path; ``hub.download_bps`` throttles them (one link, as ``upload_bps``);
``hub.corrupt[path] = offset`` flips the byte at ``offset`` of what is served for ``path`` (the Hub's
recorded sha256 no longer matches).

``hub_cli`` runs kimi-convert against it in a process with a hermetic environment (huggingface_hub
reads HF_* when it is imported); ``assert_arrived`` compares a repo's files with a local folder.

At a release's scale (benchmarks/whole_release.py: 96 files of 16 GB in, 0.6 TB out), neither side may hold the
bytes in memory: ``seed(..., on_disk=True)`` serves each weight file from its path (``OnDisk``; its sha256
computed once and kept in ``sha_cache``, keyed by path, size and mtime), and ``FakeHub(keep_uploads=False)``
is a sink: each LFS PUT is hashed as it streams in, checked against its oid and the size the LFS batch
announced, and only recorded (``Received``; ``hub.received`` lists each with its arrival time).
``tree_sha256`` gives a repo's files as path -> sha256, whichever way they are held.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

from helpers import Result, run_process

#: The token the fake Hub accepts; tests check it never appears in any output.
TOKEN = "hf_kimiConvertTestSecret0123456789"
#: wait_idle: seconds without a new request before the server counts as idle (a killed client's last request can
#: reach a handler thread after the others ended)
QUIET_S = 0.5
STALL = -1  # a Fault status: accept, never answer
#: Bytes read or sent at a time by the streamed routes (a seeded file served from disk, a PUT into the sink).
CHUNK = 1 << 20


@dataclass(frozen=True)
class OnDisk:
    """An LFS object served from a file (``seed(on_disk=True)``): never read into memory."""

    path: Path
    size: int


@dataclass(frozen=True)
class Received:
    """An LFS object the sink took (``keep_uploads=False``): its sha256 (the key) and size checked, no bytes."""

    size: int
    at: float  # monotonic seconds when its last byte arrived


def _object_bytes(obj: bytes | OnDisk | Received) -> bytes:
    if isinstance(obj, OnDisk):
        return obj.path.read_bytes()
    if isinstance(obj, Received):
        raise AssertionError("the sink keeps no bytes (FakeHub(keep_uploads=False)): compare tree_sha256")
    return obj


def file_sha256(path: Path, cache: Path | None = None) -> str:
    """``path``'s sha256, read in ``CHUNK``s; with ``cache`` (a JSON file) computed once per (path, size, mtime):
    the released K3's 96 files of 16 GB cost about 25 CPU minutes to hash."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    known = json.loads(cache.read_text()) if cache is not None and cache.is_file() else {}
    if key in known:
        return known[key]
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(CHUNK * 8):
            h.update(chunk)
    if cache is not None:
        known = json.loads(cache.read_text()) if cache.is_file() else {}
        known[key] = h.hexdigest()
        tmp = cache.with_name(cache.name + ".tmp")
        tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
        tmp.replace(cache)
    return h.hexdigest()


@dataclass
class Repo:
    private: bool
    files: dict[str, dict] = field(default_factory=dict)  # path -> {"size", "blob", "lfs": sha256 | None}
    commits: list[dict] = field(default_factory=list)
    prs: list[dict] = field(default_factory=list)
    snapshots: dict[str, dict] = field(default_factory=dict)  # commit sha -> files at that commit

    @property
    def head(self) -> str:
        return self.commits[-1]["sha"] if self.commits else "0" * 40


@dataclass
class Fault:
    method: str
    path: re.Pattern[str]
    status: int
    times: int
    headers: dict[str, str] = field(default_factory=dict)


class FakeHub:
    #: Upload throttle (bytes/s) of the LFS object PUT route, one link shared by concurrent PUTs; None: as
    #: fast as it goes. An option of the
    #: upload routes only (pack --upload's tests); a download throttle, if any, is the download routes' own.
    upload_bps: float | None = None
    #: Download throttle (bytes/s) of the ``resolve`` route's bodies, one link shared by concurrent GETs.
    download_bps: float | None = None

    def __init__(self, token: str, read_only_token: str = "read-only", keep_uploads: bool = True):
        """``keep_uploads`` False: the upload routes are a sink (module docstring)."""
        self.token = token
        self.read_only_token = read_only_token
        self.keep_uploads = keep_uploads
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes | OnDisk | Received] = {}
        self.announced: dict[str, int] = {}  # oid -> size, as the LFS batch requests named them
        self.received: list[tuple[str, Received]] = []  # (oid, record) in arrival order (the sink)
        self.faults: list[Fault] = []
        self.log: list[tuple[str, str, int]] = []
        self.times: list[float] = []
        self.headers_seen: list[str] = []
        self.served: dict[str, int] = {}  # path in the repo -> body bytes the resolve route sent
        self.corrupt: dict[str, int] = {}  # path -> offset of the byte flipped in what is served
        self._down_free = 0.0
        self.lock = threading.Lock()
        self.in_flight = 0  # requests being answered
        self.started = 0  # requests ever begun (wait_idle's quiet period)
        self._idle = threading.Condition(self.lock)
        self.closing = threading.Event()  # set on exit: a stalled answer (stall()) ends
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()

    def fail(self, method: str, path: str, status: int, times: int = 1, headers: dict | None = None) -> None:
        self.faults.append(Fault(method, re.compile(path), status, times, headers or {}))

    def stall(self, method: str, path: str, times: int = 1_000_000) -> None:
        """Requests matching ``method`` and ``path`` are accepted, read, and never answered (until the hub
        closes): a server that takes the connection and sends nothing."""
        self.faults.append(Fault(method, re.compile(path), STALL, times))

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Until no request is being answered: after a client is killed, the server may still be finishing
        what it sent (a throttled PUT stores its object once its link time has passed), and a resumed client
        that asks before then is rightly told the object is missing and sends it again. A test that counts
        uploads across a kill waits here first, as a real resume comes after the dead transfers end."""
        deadline = time.monotonic() + timeout
        while True:  # idle, then quiet for QUIET_S: a dead client's last request may not be parsed yet
            with self._idle:
                assert self._idle.wait_for(lambda: self.in_flight == 0, max(0.0, deadline - time.monotonic())), \
                    "the fake Hub stayed busy"
                seen = self.started
            time.sleep(QUIET_S)
            with self._idle:
                if self.in_flight == 0 and self.started == seen:
                    return

    def record(self, method: str, path: str, status: int) -> None:
        with self.lock:
            self.log.append((method, path, status))
            self.times.append(time.monotonic())

    def file_bytes(self, repo_id: str, path: str) -> bytes:
        f = self.repos[repo_id].files[path]
        return _object_bytes(self.lfs[f["lfs"]]) if f["lfs"] else f["content"]

    def tree_sha256(self, repo_id: str) -> dict[str, str]:
        """Every file of the repo's head as path -> sha256 (an LFS file's oid, a regular file's content hashed)."""
        return {p: f["lfs"] or hashlib.sha256(f["content"]).hexdigest()
                for p, f in sorted(self.repos[repo_id].files.items())}

    def seed(self, repo_id: str, folder: Path, private: bool = False, on_disk: bool = False,
             sha_cache: Path | None = None) -> str:
        """Commit every file of ``folder`` to ``repo_id`` (created if new): ``.safetensors`` files through
        LFS (the tree lists their sha256), the rest as regular files. Returns the commit's sha. ``on_disk``:
        the LFS files are served from their paths (``OnDisk``), hashed through ``sha_cache`` (``file_sha256``)."""
        repo = self.repos.setdefault(repo_id, Repo(private=private))
        files = dict(repo.files)
        for p in sorted(Path(folder).rglob("*")):
            if not p.is_file():
                continue
            rel = p.relative_to(folder).as_posix()
            if rel.endswith(".safetensors"):
                if on_disk:
                    oid, size = file_sha256(p, sha_cache), p.stat().st_size
                    self.lfs[oid] = OnDisk(p, size)
                else:
                    data = p.read_bytes()
                    oid, size = hashlib.sha256(data).hexdigest(), len(data)
                    self.lfs[oid] = data
                pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n".encode()
                files[rel] = {"size": size, "blob": _blob(pointer), "lfs": oid}
            else:
                data = p.read_bytes()
                files[rel] = {"size": len(data), "blob": _blob(data), "lfs": None, "content": data}
        sha = hashlib.sha1(json.dumps(sorted((k, v["blob"]) for k, v in files.items())).encode()
                           + str(len(repo.commits)).encode()).hexdigest()
        repo.files = files
        repo.snapshots[sha] = files
        repo.commits.append({"sha": sha, "summary": f"seed {folder}"})
        return sha

    def weight_bytes_served(self, repo_id: str) -> int:
        """Body bytes the resolve route sent for ``repo_id``'s ``.safetensors`` files."""
        return sum(n for p, n in self.served.items() if p.startswith(repo_id + "/") and p.endswith(".safetensors"))

    def _throttle(self, n: int) -> None:
        if self.download_bps:
            with self.lock:
                start = max(time.monotonic(), self._down_free)
                self._down_free = end = start + n / self.download_bps
            time.sleep(max(0.0, end - time.monotonic()))

    # --------------------------------------------------------------------------------------

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _body(self) -> bytes:
                return b"".join(self._body_chunks())

            def _body_chunks(self) -> Iterator[bytes]:
                """The request's body, ``CHUNK`` bytes at most at a time (Content-Length or chunked)."""
                n = int(self.headers.get("Content-Length") or 0)
                while n > 0:
                    part = self.rfile.read(min(n, CHUNK))
                    if not part:
                        return  # the client went away: the caller sees a short body
                    n -= len(part)
                    yield part
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    while True:
                        size = int(self.rfile.readline().strip() or b"0", 16)
                        if size == 0:
                            self.rfile.readline()
                            return
                        while size > 0:
                            part = self.rfile.read(min(size, CHUNK))
                            if not part:
                                return
                            size -= len(part)
                            yield part
                        self.rfile.readline()

            def _send(self, status: int, obj=None, headers: dict | None = None) -> None:
                data = b"" if obj is None else json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def _fault(self, method: str, path: str) -> bool:
                with hub.lock:
                    for f in hub.faults:
                        if f.times > 0 and f.method == method and f.path.search(path):
                            f.times -= 1
                            status, headers = f.status, f.headers
                            break
                    else:
                        return False
                self._body()
                hub.record(method, path, status)
                if status == STALL:  # keep the connection open, send nothing
                    hub.closing.wait()
                    self.close_connection = True
                    return True
                if status == 0:  # drop the connection, no answer
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return True
                if status == 429 and "Retry-After" not in headers:
                    headers = {**headers, "Retry-After": "0"}
                self._send(status, {"error": f"injected {status}"}, headers)
                return True

            def _auth(self, write: bool) -> bool:
                auth = self.headers.get("Authorization", "")
                hub.headers_seen.append(auth)
                if auth == f"Bearer {hub.token}":
                    return True
                if auth == f"Bearer {hub.read_only_token}":
                    if not write:
                        return True
                    self._send(403, {"error": "You don't have the rights to create or write this repo"})
                    return False
                self._send(401, {"error": "Invalid credentials in Authorization header"})
                return False

            def do_GET(self):
                self._route("GET")

            def do_POST(self):
                self._route("POST")

            def do_PUT(self):
                self._route("PUT")

            def do_HEAD(self):
                self._route("HEAD")

            def _route(self, method: str) -> None:
                url = urlparse(self.path)
                path = url.path
                with hub.lock:
                    hub.in_flight += 1
                    hub.started += 1
                try:
                    if self._fault(method, path):
                        return
                    # unanswered until the handler returns: a client killed mid-request (its truncated body,
                    # the broken pipe of the reply) is never logged as 200, unless the hub took its object
                    status, self.accepted = 0, None
                    try:
                        status = self._dispatch(method, path, parse_qs(url.query))
                    finally:
                        hub.record(method, path, status if self.accepted is None else self.accepted)
                finally:
                    with hub._idle:
                        hub.in_flight -= 1
                        hub._idle.notify_all()

            def _repo(self, ns: str, name: str) -> Repo | None:
                repo = hub.repos.get(f"{ns}/{name}")
                if repo is None:
                    self._send(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
                return repo

            def _dispatch(self, method: str, path: str, query: dict) -> int:
                m = re.fullmatch(r"/api/repos/create", path)
                if m and method == "POST":
                    body = json.loads(self._body() or b"{}")
                    if not self._auth(write=True):
                        return 401
                    repo_id = f"{body.get('organization') or 'user'}/{body['name']}"
                    if repo_id in hub.repos:
                        self._send(409, {"error": "You already created this model repo", "url": f"{hub.url}/{repo_id}"})
                        return 409
                    private = bool(body.get("private")) or body.get("visibility") in ("private", "protected")
                    hub.repos[repo_id] = Repo(private=private)
                    self._send(200, {"url": f"{hub.url}/{repo_id}", "name": repo_id})
                    return 200
                if path == "/api/validate-yaml" and method == "POST":
                    self._body()
                    self._send(200, {"errors": [], "warnings": []})
                    return 200
                m = re.fullmatch(r"/api/whoami-v2", path)
                if m:
                    if not self._auth(write=False):
                        return 401
                    role = "read" if self.headers.get("Authorization") == f"Bearer {hub.read_only_token}" else "write"
                    self._send(200, {"name": "user", "type": "user", "orgs": [],
                                     "auth": {"type": "access_token", "accessToken": {"role": role}}})
                    return 200
                m = re.fullmatch(r"/api/models/([^/]+)/([^/]+)/preupload/(.+)", path)
                if m and method == "POST":
                    body = json.loads(self._body())
                    if not self._auth(write=True) or (repo := self._repo(m[1], m[2])) is None:
                        return 401
                    files = [{"path": f["path"], "uploadMode": "lfs" if f["path"].endswith(".safetensors")
                              or f["size"] > 100_000 else "regular", "shouldIgnore": False,
                              "oid": repo.files.get(f["path"], {}).get("blob")} for f in body["files"]]
                    self._send(200, {"files": files, "commitOid": "0" * 40})
                    return 200
                m = re.fullmatch(r"/([^/]+)/([^/]+)\.git/info/lfs/objects/batch", path)
                if m and method == "POST":
                    body = json.loads(self._body())
                    if not self._auth(write=True) or self._repo(m[1], m[2]) is None:
                        return 401
                    objs = []
                    for o in body["objects"]:
                        entry = {"oid": o["oid"], "size": o["size"]}
                        hub.announced[o["oid"]] = o["size"]
                        if o["oid"] not in hub.lfs:
                            entry["actions"] = {"upload": {"href": f"{hub.url}/lfs-upload/{o['oid']}",
                                                           "header": {}}}
                        objs.append(entry)
                    self._send(200, {"transfer": "basic", "objects": objs, "hash_algo": "sha256"})
                    return 200
                m = re.fullmatch(r"/lfs-upload/([0-9a-f]{64})", path)
                if m and method == "PUT":
                    return self._put(m[1])
                m = re.fullmatch(r"/api/models/([^/]+)/([^/]+)/commit/(.+)", path)
                if m and method == "POST":
                    return self._commit(m[1], m[2], m[3], query)
                m = re.fullmatch(r"/([^/]+)/([^/]+)/resolve/([^/]+)/(.+)", path)
                if m and method in ("GET", "HEAD"):
                    return self._resolve(method, m[1], m[2], unquote(m[3]), unquote(m[4]))
                m = re.fullmatch(r"/api/models/([^/]+)/([^/]+)/tree/([^/]+)(/.*)?", path)
                if m and method == "GET":
                    if not self._auth(write=False) or (repo := self._repo(m[1], m[2])) is None:
                        return 401
                    files = self._at_revision(repo, m[3])
                    if files is None:
                        return self._no_revision(m[3])
                    out = [{"type": "file", "oid": f["blob"], "size": f["size"], "path": p,
                            **({"lfs": {"oid": f["lfs"], "size": f["size"], "pointerSize": 134}} if f["lfs"] else {})}
                           for p, f in sorted(files.items())]
                    self._send(200, out)
                    return 200
                m = re.fullmatch(r"/api/models/([^/]+)/([^/]+)(/revision/(.+))?", path)
                if m and method == "GET":
                    if not self._auth(write=False) or (repo := self._repo(m[1], m[2])) is None:
                        return 401
                    sha = self._commit_of(repo, unquote(m[4] or "main"))
                    if sha is None:
                        return self._no_revision(m[4])
                    self._send(200, {"id": f"{m[1]}/{m[2]}", "private": repo.private, "sha": sha,
                                     "siblings": [{"rfilename": p} for p in repo.files]})
                    return 200
                self._send(404, {"error": f"no route {method} {path}"})
                return 404

            def _put(self, oid: str) -> int:
                """An LFS object's bytes: hashed as they stream in; kept, or with ``keep_uploads`` False only
                recorded once its sha256 and its size (the one the LFS batch announced) are checked."""
                t0 = time.monotonic()
                h, n, kept = hashlib.sha256(), 0, []
                for part in self._body_chunks():
                    h.update(part)
                    n += len(part)
                    if hub.keep_uploads:
                        kept.append(part)
                if hub.upload_bps:  # one link at that rate, shared by concurrent uploads
                    with hub.lock:
                        start = max(t0, getattr(hub, "_link_free", 0.0))
                        hub._link_free = end = start + n / hub.upload_bps
                    time.sleep(max(0.0, end - time.monotonic()))
                if h.hexdigest() != oid:
                    self._send(400, {"error": "sha256 mismatch"})
                    return 400
                if oid in hub.announced and hub.announced[oid] != n:
                    self._send(400, {"error": f"size {n} is not the {hub.announced[oid]} the LFS batch announced"})
                    return 400
                if hub.keep_uploads:
                    hub.lfs[oid] = b"".join(kept)
                else:
                    rec = Received(n, time.monotonic())
                    with hub.lock:
                        hub.lfs[oid] = rec
                        hub.received.append((oid, rec))
                self.accepted = 200  # stored: accepted, whether or not the client lives to read the reply
                self._send(200, {})
                return 200

            def _at_revision(self, repo: Repo, revision: str) -> dict | None:
                m = re.fullmatch(r"refs%2Fpr%2F(\d+)|refs/pr/(\d+)", revision)
                if m:
                    return repo.prs[int(m[1] or m[2]) - 1]["files"]
                revision = unquote(revision)
                if revision in repo.snapshots:
                    return repo.snapshots[revision]
                return repo.files if revision == "main" or not re.fullmatch(r"[0-9a-f]{40}", revision) else None

            def _commit_of(self, repo: Repo, revision: str) -> str | None:
                """A revision's commit: a commit sha the repo has; any other name (main, a branch, refs/pr/N)
                the last commit; None: a commit sha the repo does not have (no such revision)."""
                if revision in repo.snapshots:
                    return revision
                return None if re.fullmatch(r"[0-9a-f]{40}", revision) else repo.head

            def _no_revision(self, revision: str) -> int:
                self._send(404, {"error": f"Invalid rev id: {revision}"}, {"X-Error-Code": "RevisionNotFound"})
                return 404

            def _resolve(self, method: str, ns: str, name: str, revision: str, rel: str) -> int:
                """A file at a revision, whole (200) or one ``Range: bytes=a-b`` (206), throttled and counted."""
                if not self._auth(write=False) or (repo := self._repo(ns, name)) is None:
                    return 401
                files = self._at_revision(repo, revision)
                if files is None:
                    return self._no_revision(revision)
                f = files.get(rel)
                if f is None:
                    self._send(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})
                    return 404
                obj = hub.lfs[f["lfs"]] if f["lfs"] else f["content"]
                if isinstance(obj, Received):
                    raise AssertionError("the sink keeps no bytes (FakeHub(keep_uploads=False)): nothing to serve")
                size = obj.size if isinstance(obj, OnDisk) else len(obj)
                lo, hi, status = 0, size, 200
                rng = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
                if rng:
                    lo, hi, status = int(rng[1]), min(size, int(rng[2]) + 1 if rng[2] else size), 206
                    if lo >= size:
                        self._send(416, {"error": "Requested Range Not Satisfiable"})
                        return 416
                self.send_response(status)
                self.send_header("Content-Length", str(hi - lo))
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("ETag", f'"{f["lfs"] or f["blob"]}"')
                self.send_header("X-Repo-Commit", self._commit_of(repo, revision) or revision)
                if f["lfs"]:
                    self.send_header("X-Linked-Etag", f'"{f["lfs"]}"')
                    self.send_header("X-Linked-Size", str(f["size"]))
                if status == 206:
                    self.send_header("Content-Range", f"bytes {lo}-{hi - 1}/{size}")
                self.end_headers()
                if method == "HEAD":
                    return status
                key = f"{ns}/{name}/{rel}"
                for k, part in _ranges(obj, lo, hi, 1 << 16 if isinstance(obj, bytes) else CHUNK):
                    if rel in hub.corrupt and k <= hub.corrupt[rel] < k + len(part):
                        j = hub.corrupt[rel] - k
                        part = part[:j] + bytes([part[j] ^ 0xFF]) + part[j + 1:]
                    hub._throttle(len(part))
                    try:
                        self.wfile.write(part)
                    except (BrokenPipeError, ConnectionResetError):
                        return status
                    with hub.lock:
                        hub.served[key] = hub.served.get(key, 0) + len(part)
                return status

            def _commit(self, ns: str, name: str, revision: str, query: dict) -> int:
                body = self._body()
                if not self._auth(write=True) or (repo := self._repo(ns, name)) is None:
                    return 401
                lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
                create_pr = query.get("create_pr", ["0"])[0] in ("1", "true")
                files = dict(repo.files)
                for entry in lines:
                    key, value = entry["key"], entry["value"]
                    if key == "file":
                        content = base64.b64decode(value["content"])
                        blob = hashlib.sha1(f"blob {len(content)}\0".encode() + content).hexdigest()
                        files[value["path"]] = {"size": len(content), "blob": blob, "lfs": None, "content": content}
                    elif key == "lfsFile":
                        if value["oid"] not in hub.lfs:
                            self._send(422, {"error": f"LFS object {value['oid']} was never uploaded"})
                            return 422
                        pointer = (f"version https://git-lfs.github.com/spec/v1\noid sha256:{value['oid']}\n"
                                   f"size {value['size']}\n").encode()
                        blob = hashlib.sha1(f"blob {len(pointer)}\0".encode() + pointer).hexdigest()
                        files[value["path"]] = {"size": value["size"], "blob": blob, "lfs": value["oid"]}
                    elif key == "deletedFile":
                        files.pop(value["path"], None)
                sha = hashlib.sha1(body).hexdigest()
                result = {"commitUrl": f"{hub.url}/{ns}/{name}/commit/{sha}", "commitOid": sha,
                          "commitMessage": lines[0]["value"].get("summary", "")}
                if create_pr:
                    repo.prs.append({"files": files})
                    result["pullRequestUrl"] = f"{hub.url}/{ns}/{name}/discussions/{len(repo.prs)}"
                else:
                    repo.files = files
                    repo.snapshots[sha] = files
                repo.commits.append({"sha": sha, "summary": result["commitMessage"]})
                self._send(200, result)
                return 200

        return Handler


def _ranges(obj: bytes | OnDisk, lo: int, hi: int, step: int) -> Iterator[tuple[int, bytes]]:
    """``obj``'s bytes ``lo:hi`` as (offset, part) of ``step`` bytes at most; a file's read as they are sent."""
    if isinstance(obj, bytes):
        yield from ((k, obj[k:min(hi, k + step)]) for k in range(lo, hi, step))
        return
    fd = os.open(obj.path, os.O_RDONLY)
    try:
        for k in range(lo, hi, step):
            yield k, os.pread(fd, min(step, hi - k), k)
    finally:
        os.close(fd)


def _blob(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


def hub_cli(hub: FakeHub | None, *args, tmp: Path, token: str | None = TOKEN, env_token: str | None = None,
            endpoint: str | None = None, **env_extra: str) -> Result:
    """kimi-convert ARGS in a process of its own, in a clean environment: no HF_* variable of the
    caller's, HF_HOME (the stored login) ``tmp/hf-home``, the Hub at ``endpoint`` or ``hub``, Xet off."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE_"))}
    env.update(HF_ENDPOINT=endpoint or hub.url, HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1",
               HF_HOME=str(tmp / "hf-home"), KIMI_CONVERT_RETRY_BASE="0.01", TQDM_DISABLE="1")
    env.update(env_extra)
    if env_token:
        env["HF_TOKEN"] = env_token
    r = run_process(*args, *(["--token", token] if token else []), env=env, replace_env=True)
    if r.code is not None and r.code < 0 and hub is not None:  # killed: what it had sent finishes first
        hub.wait_idle()
    assert TOKEN not in r.stdout and TOKEN not in r.stderr, "the token leaked into the output"
    return r


def assert_arrived(hub: FakeHub, repo_id: str, out: Path, files: dict | None = None) -> None:
    """Every file of ``out`` is in the repo (or ``files``) with the same bytes, and nothing else is."""
    repo_files = files if files is not None else hub.repos[repo_id].files
    local = {str(p.relative_to(out)): p for p in out.rglob("*") if p.is_file()}
    assert set(repo_files) == set(local), set(repo_files) ^ set(local)
    for name, p in local.items():
        f = repo_files[name]
        data = _object_bytes(hub.lfs[f["lfs"]]) if f["lfs"] else f["content"]
        assert data == p.read_bytes(), name
