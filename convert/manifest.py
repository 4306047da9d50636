"""The manifest: the plan, made concrete with hashes. It is what verify-manifest checks an output
against, and it says for every output tensor where its bytes came from.

It holds no timestamps and no absolute paths, so the same input and options give the same bytes.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from . import __version__, filenames, schemes
from .atomic import write_atomic, write_json_atomic
from .errors import ConvertError
from .hashing import (
    DIGESTS,
    FILE_DIGEST,
    HUB_DIGEST,
    TENSOR_DIGEST,
    bytes_digest,
    labelled,
    new_digest,
    sha256_checked,
    unlabel,
)
from .jsonfile import loads, read_json
from .plan import Item, Plan, Unit
from .plan.serialize import engine_groups, head_dict, item_dict, side_dict

FORMAT = "kimi-convert-manifest"
#: 2: ``side_files`` became records (file, size, sha256), ``side_folders`` and ``skipped_files`` came.
#: 3: ``modules`` moved out of manifest.json into one JSON Lines file per output shard (``records``).
#: 4: each tensor's digest (``tensors[]``, ``sources[].parts[]``) is BLAKE3 under the key ``blake3``, named by
#: ``tensor_digest`` (version 3: sha256, key ``sha256``, no ``tensor_digest``); files' digests stay sha256.
#: 5: each file's digest is under the key of its algorithm: BLAKE3 (``blake3``), sha256 (``sha256``) where the Hub
#: names the file by it (a Hub input's; an output file's once uploaded, beside its BLAKE3); before 5 every file's
#: is sha256.
#: Version 1 and 2 manifests (every module in manifest.json, before 0.1.0) are refused by verify-manifest;
#: version 3 and 4 ones are read (``tensor_digest``, ``entry_digest``).
FORMAT_VERSION = 5


RECORDS_DIR, records_name = filenames.RECORDS_DIR, filenames.records_name


def module_record(it: Item, shared_scale: str | None, shard: str, tensor_hashes: dict[str, str],
                  source_hashes: dict[str, str], notes: dict[str, dict]) -> dict:
    """One module as the manifest records it: the plan's entry (``plan --json``) with the digest
    (``TENSOR_DIGEST``, under its name) of each stored source part and output tensor, and the
    compute's notes (amax, cast counts...)."""
    mod = item_dict(it, shared_scale, shard)
    for s in mod["sources"]:
        for p in s["parts"]:
            p[TENSOR_DIGEST] = source_hashes[p["name"]]
    for t in mod["tensors"]:
        t[TENSOR_DIGEST] = tensor_hashes[t["name"]]
    note = dict(sorted(notes.get(it.name, {}).items()))  # key order must not depend on a resume
    if note and schemes.quantized(it.kind):
        mod["quantization"].update(note)
    elif note:
        mod["decoded"] = note
    return mod


@dataclass(frozen=True)
class RecordsFile:
    """A shard's records file as written: what manifest.json lists (and the journal keeps)."""

    file: str
    size: int
    digest: str  # ``hashing.labelled``
    modules: int

    def to_dict(self) -> dict:
        return {"file": self.file, "size": self.size, **digest_entry(self.digest), "modules": self.modules}


def digest_entry(digest: str) -> dict[str, str]:
    """A labelled digest (``hashing.labelled``) as a manifest entry writes it: under its algorithm's name."""
    name, hexdigest = unlabel(digest)
    return {name: hexdigest}


def entry_digests(entry: dict) -> list[str]:
    """Every digest a file entry records, ``labelled``, BLAKE3 first: blake3 (format_version 5), sha256 (every file
    before 5; since, a Hub input's, and an output file's once uploaded: ``with_hub_digests``)."""
    return [labelled(k, entry[k]) for k in (FILE_DIGEST, HUB_DIGEST) if isinstance(entry.get(k), str)]


def entry_digest(entry: dict) -> str | None:
    """A file entry's first digest (``entry_digests``); None where it records none."""
    got = entry_digests(entry)
    return got[0] if got else None


def with_hub_digests(man: dict, sha256: dict[str, str]) -> dict:
    """manifest.json with each output file's sha256 (``sha256``: file -> hex) beside its BLAKE3: the name the Hub's
    LFS gives the file, added by the upload that computed it (``pack --upload`` as it sends each shard, ``upload``
    as it verifies the folder), so that ``verify-manifest --remote`` compares the Hub's files with the manifest
    without reading them again, even where the shards were not kept. The same entries, in the same key order,
    whichever of the two wrote it."""
    for section in ("outputs", "records", "files", "side_files"):
        for i, e in enumerate(man.get(section, [])):
            sha = sha256.get(e["file"])
            if sha is not None and FILE_DIGEST in e:
                man[section][i] = _after({k: v for k, v in e.items() if k != HUB_DIGEST}, FILE_DIGEST, HUB_DIGEST, sha)
    return man


def hub_sha256(output_dir: Path, man: dict, known: dict[str, str]) -> dict[str, str]:
    """Every output file's sha256 (file -> hex) for ``with_hub_digests``: ``known`` (from a read that checked the
    file already: the uploads', verify's), the manifest's own where it records one, else computed here from one read
    that also checks the file's BLAKE3 against the manifest. A file neither known nor here is one line."""
    out = {}
    for section in ("outputs", "records", "files"):
        for e in man.get(section, []):
            name = e["file"]
            if name in known or HUB_DIGEST in e:
                out[name] = known.get(name) or e[HUB_DIGEST]
                continue
            path = output_dir / name
            if not path.is_file():
                raise ConvertError(f"{path}: missing, and manifest.json records its BLAKE3, not the sha256 the Hub "
                                   "names it by; start again with --overwrite")
            sha = sha256_checked(path, e["size"], entry_digest(e))
            if sha is None:
                raise ConvertError(f"{path}: does not match manifest.json; start again with --overwrite")
            out[name] = sha
    return out


def write_records(output_dir: Path, shard: str, units: list[Unit], tensor_hashes: dict[str, str],
                  source_hashes: dict[str, str], notes: dict[str, dict]) -> RecordsFile:
    """Write ``shard``'s module records (its units, in plan order), one compact JSON object a line,
    atomically. Called by whoever wrote the shard (a stream, in a worker or a Ray task) once the
    shard is complete: the records are a function of the plan and the shard's hashes only, so the
    file is the same bytes whatever wrote it, and on every resume."""
    lines = [json.dumps(module_record(it, u.shared_scale, shard, tensor_hashes, source_hashes, notes),
                        separators=(",", ":")) + "\n" for u in units for it in u.items]
    data = "".join(lines).encode()
    rel = records_name(shard)
    path = output_dir / rel
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConvertError(f"{path.parent}: cannot create: {e.strerror or e}") from None
    write_atomic(path, data, fault="records")
    return RecordsFile(rel, len(data), bytes_digest(data), len(lines))


def build(plan: Plan, plan_sha256: str, input_hashes: dict[str, str], shards: dict[str, tuple[int, str]],
          records: dict[str, RecordsFile], files: list[dict], side_files: list[dict],
          origin: dict | None = None) -> dict:
    """manifest.json (format_version 5): everything but the per-module records, which are in
    ``records`` (one file per output shard, each with its size, digest and number of modules).
    ``input_hashes``: input file -> its digest (``hashing.labelled``); ``shards``: output shard -> (size,
    digest); ``files``: every other file of the output (configs, index, side files) with size and digest;
    ``side_files``: those of them copied from the input. Each digest goes under its algorithm's name
    (``digest_entry``). ``origin``: a Hub input's ``source`` (``HubRepo.provenance``: repository, commit,
    revision), whose ``inputs[].sha256`` are then the LFS sha256 the Hub recorded, each download verified against
    it; absent for a local folder."""
    head = head_dict(plan)
    del head["modules"]
    head["engine_groups"] = engine_groups(plan)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "tool": {"name": "kimi-convert", "version": __version__},
        "tensor_digest": TENSOR_DIGEST,  # the records' digest of each tensor (a file's: under its own key)
        "plan_sha256": plan_sha256,
        "mapping_table": tomllib.loads(plan.mapping.source),
        "mapping_source": plan.mapping.source,
        "recipe_source": plan.recipe.source,
        **({"source": origin} if origin else {}),  # a Hub input: repository, resolved commit, revision asked
        "inputs": [{"file": f, "size": size, **digest_entry(input_hashes[f])} for f, size in plan.inputs],
        **side_dict(plan, side_files),
        "outputs": [{"file": f, "size": size, **digest_entry(h)} for f, (size, h) in sorted(shards.items())],
        "records": [{"shard": f, **records[f].to_dict()} for f in sorted(shards)],
        "files": files,
        **head,
    }


def write_manifest(output_dir: Path, man: dict) -> None:
    """manifest.json written atomically, one engine group a line (the same bytes whoever writes it: the pack, or
    an upload adding the Hub's digests)."""
    write_json_atomic(output_dir / filenames.MANIFEST, man, compact_lists=("engine_groups",))


def load_manifest(output_dir: Path) -> dict:
    path = output_dir / filenames.MANIFEST
    return read_json(path, str(path))


def is_v3(man: dict) -> bool:
    """Whether the module records are in records files (format_version 3 and later) rather than manifest.json."""
    return "records" in man and "modules" not in man


def tensor_digest(man: dict) -> str:
    """The digest the manifest's records give each tensor, which is also their key: ``tensor_digest``
    (format_version 4: blake3), sha256 where it is absent before format_version 4."""
    version = man.get("format_version")
    name = man.get("tensor_digest", "sha256" if isinstance(version, int) and version < 4 else None)
    if name is None:
        raise ConvertError(f"manifest.json: format_version {man.get('format_version')} without tensor_digest")
    if name not in DIGESTS:
        raise ConvertError(f"manifest.json: tensor_digest {name!r} is not one this version knows "
                           f"({', '.join(sorted(DIGESTS))}): written by a newer kimi-convert?")
    return name


def iter_modules(output_dir: Path, man: dict, problems: list[str] | None = None) -> Iterator[tuple[str, dict]]:
    """Every module record with where it was read (``manifest-records/X.jsonl line N``), streamed: the
    records files are read one line at a time, never whole. ``problems`` collects what is wrong with a
    records file (missing, a line that is not a record, size or digest not the listed ones)."""
    for entry in man["records"]:
        reader = RecordsReader(output_dir, entry)
        yield from reader
        if problems is not None:
            problems += reader.problems


class RecordsReader:
    """One records file, read a line at a time and hashed from the same bytes; after iterating,
    ``problems`` says what was wrong (missing, truncated, a line that is not a record, edited: its
    size, digest or number of records differ from manifest.json's listing)."""

    def __init__(self, output_dir: Path, entry: dict, also: tuple[str, ...] = ()):
        """``also``: more digests of the file to compute from the same bytes (``digests``, once it matched)."""
        self.output_dir, self.entry, self.also = output_dir, entry, also
        self.name: str = entry["file"]
        self.problems: list[str] = []
        self.stopped = False  # missing, or a line that is not a record: the records after it are unknown
        self.digests: dict[str, str] = {}  # by algorithm, ``labelled``: the file read whole and matching its entry

    def __iter__(self) -> Iterator[tuple[str, dict]]:
        name = self.name
        rel = PurePosixPath(name)
        if not name or rel.is_absolute() or ".." in rel.parts:  # never read a file outside the output
            self.problems.append(f"manifest.json: records file {name!r} is not a relative path inside the output")
            self.stopped = True
            return
        wants = entry_digests(self.entry)
        if not wants:
            self.problems.append(f"manifest.json: the records file {name} is listed without a digest")
            self.stopped = True
            return
        hs, size, n = {a: new_digest(a) for a in {*(unlabel(w)[0] for w in wants), *self.also}}, 0, 0
        try:
            f = open(self.output_dir / name, "rb")  # noqa: SIM115 - closed by the with below (a generator)
        except OSError as e:
            self.problems.append(f"{name}: {'missing' if isinstance(e, FileNotFoundError) else e.strerror}"
                                 f" (the records of shard {self.entry.get('shard')})")
            self.stopped = True
            return
        with f:
            for n, line in enumerate(f, 1):
                for h in hs.values():
                    h.update(line)
                size += len(line)
                rec = _parse_line(line)
                if rec is None:
                    why = "truncated (no end of line)" if not line.endswith(b"\n") else "not a JSON record"
                    self.problems.append(f"{name} line {n}: {why}")
                    self.stopped = True
                    return
                yield f"{name} line {n}", rec
        got = {a: labelled(a, h.hexdigest()) for a, h in hs.items()}
        wrong = [w for w in wants if got[unlabel(w)[0]] != w]
        if size != self.entry["size"] or wrong:
            alg, want = unlabel((wrong or wants)[0])
            self.problems.append(f"{name}: {size} bytes, {alg} {unlabel(got[alg])[1][:16]}...; manifest.json says "
                                 f"{self.entry['size']} bytes, {want[:16]}... (edited or truncated)")
        elif n != self.entry["modules"]:
            self.problems.append(f"{name}: {n} records, manifest.json says {self.entry['modules']}")
        else:
            self.digests = got


def _after(d: dict, key: str, new: str, value: object) -> dict:
    """``d`` with ``new: value`` right after ``key``."""
    out = {}
    for k, v in d.items():
        out[k] = v
        if k == key:
            out[new] = value
    return out


def _parse_line(line: bytes) -> dict | None:
    if not line.endswith(b"\n"):
        return None
    try:
        rec = loads(line, "a records line")
    except ConvertError:
        return None
    return rec if isinstance(rec, dict) else None
