"""verify-manifest's offline checks: every file of the output read once (its digest and every tensor's digest
from the same bytes), the records files streamed, the index, the side files and the strangers."""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from ..checkpoint import INDEX_NAME
from ..errors import ConvertError
from ..hashing import FILE_DIGEST, HUB_DIGEST, hash_file, unlabel
from ..jsonstream import iter_object
from ..manifest import RecordsReader, entry_digest, entry_digests, tensor_digest
from ..mapping import stacked_experts_module
from ..plan import Kind
from ..safetensors_format import DTYPES, parse_header
from ..sidefiles import WEIGHT_SUFFIXES
from ..write import is_inside
from .config_checks import check_configs, check_engine_rules, row_problems
from .report import Report


@dataclass
class Modules:
    """What the module-level checks need from the module records, gathered as the records stream by:
    row-range problems, each module's kind (MoE experts folded per layer: their bank's kinds), and
    the tensors' count and bytes. Bounded by the number of non-expert modules, not of tensors."""

    problems: list[str] = field(default_factory=list)
    kinds: dict[str, str] = field(default_factory=dict)  # module -> kind, MoE experts excepted
    experts: dict[str, set[str]] = field(default_factory=dict)  # MoE layer's experts -> their kinds
    tensors: int = 0
    nbytes: int = 0

    def add(self, where: str, m: dict) -> None:
        self.problems += row_problems(where, m)
        if m.get("experts"):  # a stacked expert bank: one of its layer's experts module's banks (copied: kept)
            kind = Kind.KEEP if m["kind"] == Kind.COPY else m["kind"]
            self.experts.setdefault(stacked_experts_module(m["name"]), set()).add(kind)
        elif m["kind"] != Kind.COPY:
            if ".experts." in m["name"]:
                self.experts.setdefault(m["name"].rsplit(".", 2)[0], set()).add(m["kind"])
            else:
                self.kinds[m["name"]] = m["kind"]
        self.tensors += len(m["tensors"])
        self.nbytes += sum(_nbytes(t) for t in m["tensors"])

    def merge(self, other: Modules) -> None:
        self.problems += other.problems
        self.kinds.update(other.kinds)
        for k, v in other.experts.items():
            self.experts.setdefault(k, set()).update(v)
        self.tensors += other.tensors
        self.nbytes += other.nbytes


@dataclass
class _Listing:
    """(tensor, file) pairs as an order-free digest per file: the sum of a hash of each name, and
    their count. The index and the module records agree file by file when the digests do, which
    needs neither side held whole; only where one differs are the names collected."""

    sums: dict[str, int]
    counts: dict[str, int]

    def add(self, name: str, file: str) -> None:
        # Python's own string hash: salted per process, and both sides are digested in this one
        self.sums[file] = self.sums.get(file, 0) + hash(name)
        self.counts[file] = self.counts.get(file, 0) + 1

    def differs(self, other: _Listing) -> list[str]:
        return sorted(f for f in {*self.counts, *other.counts}
                      if (self.sums.get(f), self.counts.get(f)) != (other.sums.get(f), other.counts.get(f)))


@dataclass
class _ShardCheck:
    file_problems: list[str] = field(default_factory=list)
    tensor_problems: list[str] = field(default_factory=list)
    listed: _Listing = field(default_factory=lambda: _Listing({}, {}))  # its tensors, as the index should list them
    modules: Modules = field(default_factory=Modules)
    unread: bool = False  # its records file is missing or stops at a bad line: its tensors are not all known
    digests: dict[str, str] = field(default_factory=dict)  # the file's digests, where it matched the manifest
    records_digests: dict[str, str] = field(default_factory=dict)  # its records file's, likewise


def check_offline(output: Path, man: dict, rep: Report, progress, total, hub: bool = False) -> None:
    """Each shard is one job: its header, its bytes hashed (the file's digest and each tensor's), and
    its module records (its records file, streamed) compared with them. So what is held at once is a
    few shards' tensors, never the whole model's. ``hub``: each file's sha256 too, from the same read, kept in
    ``rep.sha256`` where the file matched the manifest (the Hub names an LFS file by it: ``--remote``, ``upload``)."""
    shards = {f["file"]: f for f in man["outputs"]}
    others = {f["file"]: f for f in man.get("files", [])}
    index_problems: list[str] = []
    index = _read_index(output / INDEX_NAME, index_problems)
    mods = Modules()
    records = {e["shard"]: e for e in man["records"]}
    digest = tensor_digest(man)
    problems = _listing_problems(output, man, shards, others, records)
    present = {n for n in [*shards, *others] if (output / n).is_file()}
    if total:
        total(sum((output / n).stat().st_size for n in present))

    also = (HUB_DIGEST,) if hub else ()

    def job(name: str) -> tuple[str, _ShardCheck | tuple]:
        if name not in shards:
            return name, hash_file(output / name, {}, progress, file_digests={*_algorithms(others[name]), *also})
        return name, _check_shard(output, name, shards[name], records.get(name), progress, digest, also)

    checked: dict[str, _ShardCheck] = {}
    with ThreadPoolExecutor(max_workers=4) as pool:
        for name, res in pool.map(job, [*shards, *(n for n in others if n in present)]):
            got: dict[str, dict[str, str]] = {}  # file -> its digests, where it matched the manifest
            if isinstance(res, _ShardCheck):
                checked[name] = res
                got = {name: res.digests, **({records[name]["file"]: res.records_digests} if name in records else {})}
            elif _compare_file(name, res[0], res[1], others[name], problems):
                got = {name: res[0]}
            rep.sha256 |= {f: unlabel(d[HUB_DIGEST])[1] for f, d in got.items() if HUB_DIGEST in d}
    for c in checked.values():
        mods.merge(c.modules)
    problems += [p for c in checked.values() for p in c.file_problems]
    rep.check("files: present, sizes and digests", problems,
              f"{len(shards)} shards, {len(others)} other files, {len(records)} records files")
    rep.check(f"tensors: names, dtypes, shapes and {digest}", [p for c in checked.values() for p in c.tensor_problems],
              f"{mods.tensors} tensors")
    if index is not None:
        index_problems += _index_problems(output, man, index, checked, records, mods.nbytes)
    rep.check("index: weight_map and total_size", index_problems)
    check_configs(output, man, rep)
    rep.check("fused modules: row ranges tile the fused tensors", mods.problems)
    check_engine_rules(man, mods, rep)


def _listing_problems(output: Path, man: dict, shards: dict, others: dict, records: dict) -> list[str]:
    """What is wrong with the output's files as a listing, before any is read: a side file's record, a shard
    without a records file or a records file without its shard, a file the manifest names and the folder lacks
    (an empty input folder too), a file the folder holds and the manifest does not name."""
    problems: list[str] = _side_records(man, others)
    problems += [f"manifest.json: no records file for shard {f}" for f in shards if f not in records]
    problems += [f"manifest.json: records file {e['file']} for {f}, which is not among its outputs"
                 for f, e in records.items() if f not in shards]
    for name in others:
        if not (output / name).is_file():
            problems.append(f"{name}: missing")
    problems += [f"{d}/: missing (an empty folder of the input)" for d in man.get("side_folders", [])
                 if not (output / d).is_dir()]
    problems += _strangers(output, {*shards, *others})
    return problems


def _index_problems(output: Path, man: dict, index: tuple, checked: dict, records: dict, nbytes: int) -> list[str]:
    """The index's weight_map against the tensors the shards hold (counted per file while they were read; a file
    that differs is then listed in full, ``_index_differences``, so a million-tensor index is compared without
    holding it twice) and its total_size against their bytes."""
    listing, total_size = index
    want = _Listing({}, {})
    for c in checked.values():
        for f, n in c.listed.counts.items():
            want.sums[f], want.counts[f] = c.listed.sums[f], n
    unread = {f for f, c in checked.items() if c.unread}
    files = listing.differs(want)
    out = [f"{INDEX_NAME}: not compared for {f}, whose records file is unreadable" for f in files if f in unread]
    if [f for f in files if f not in unread]:
        out += _index_differences(output, man, [f for f in files if f not in unread], records)
    if total_size != nbytes:
        out.append(f"{INDEX_NAME}: total_size {total_size}, tensors hold {nbytes}")
    return out


def _algorithms(rec: dict) -> list[str]:
    """The algorithms of the digests a file entry records (``FILE_DIGEST`` where none: ``_compare_file`` says so)."""
    return [unlabel(w)[0] for w in entry_digests(rec)] or [FILE_DIGEST]


def _compare_file(name: str, got: dict[str, str], size: int, rec: dict, problems: list[str]) -> bool:
    """Whether the file's size and every digest its entry records (``got``: the file's by algorithm,
    ``hashing.labelled``) are the entry's."""
    wants = entry_digests(rec)
    if not wants:
        problems.append(f"manifest.json: {name} is listed without a digest")
        return False
    ok = size == rec["size"]
    if not ok:
        problems.append(f"{name}: size {size}, manifest says {rec['size']}")
    for want in wants:
        alg, hexdigest = unlabel(want)
        if got[alg] != want:
            problems.append(f"{name}: {alg} {unlabel(got[alg])[1][:16]}..., manifest says {hexdigest[:16]}...")
            ok = False
    return ok


def _check_shard(output: Path, name: str, rec: dict, records: dict | None, progress, digest: str,
                 also: tuple[str, ...] = ()) -> _ShardCheck:
    """One shard: its bytes against ``rec`` (size, digest), its tensors against its module records
    (``records``: its records file's listing; None where manifest.json lists no records file for it;
    ``digest``: the records' tensor digest, also their key); and the digest of the index entries they call for.
    ``also``: more digests of the file, kept (``_ShardCheck.digests``) where it matched the manifest."""
    c = _ShardCheck()
    path = output / name
    if not path.is_file():
        c.file_problems.append(f"{name}: missing")
        header = None
    else:
        try:
            header, _ = parse_header(path, name)
        except ConvertError as e:
            c.file_problems.append(str(e))
            header = None
    hashes: dict[str, str] = {}
    if header is not None:
        got, size, hashes = hash_file(path, {t: (i.start, i.end) for t, i in header.items()}, progress,
                                      digest=digest, file_digests={*_algorithms(rec), *also})
        if _compare_file(name, got, size, rec, c.file_problems):
            c.digests = got
    seen: set[str] = set()
    for where, t in (_record_tensors(output, name, records, c, also) if records is not None else ()):
        seen.add(t["name"])
        _check_tensor(name, where, t, header, hashes, digest, c.tensor_problems)
        c.listed.add(t["name"], name)
    unseen = [t for t in header or {} if t not in seen]
    if c.unread and unseen:  # one line, not one per tensor: the records file's own problem says why
        c.tensor_problems.append(f"{name}: {len(unseen)} tensor(s) without a record, {records['file']} being "
                                 "unreadable past the problem above")
        return c
    for tname in unseen:
        c.tensor_problems.append(f"{name}: tensor {tname} is not in the manifest"
                                 + (f" ({records['file']} has no record of it)" if records else ""))
    return c


def _record_tensors(output: Path, shard: str, entry: dict, c: _ShardCheck, also: tuple[str, ...] = ()):
    """The tensors of a shard's records file, each with the line it is on; the file's own problems
    (missing, truncated, edited, a malformed record) go to ``c``; its modules to ``c.modules``; its digests
    (``also`` too) to ``c.records_digests`` where it matched its entry."""
    reader = RecordsReader(output, entry, also)
    for where, m in reader:
        try:
            c.modules.add(where, m)
            for t in m["tensors"]:
                if t["file"] != shard:
                    c.tensor_problems.append(f"{where}: tensor {t['name']} names file {t['file']}, "
                                             f"but the records are {shard}'s")
                    continue
                yield where, t
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            c.file_problems.append(f"{where}: malformed record ({type(e).__name__}: {e})")
            c.unread = True
            return
    c.file_problems += reader.problems
    c.unread = reader.stopped
    c.records_digests = reader.digests


def _check_tensor(fname: str, where: str, t: dict, header: dict | None, hashes: dict[str, str], digest: str,
                  problems: list[str]) -> None:
    if header is None:
        return
    info = header.get(t["name"])
    if info is None:
        problems.append(f"{fname}: tensor {t['name']} (in the manifest) is missing ({where})")
        return
    if info.dtype != t["dtype"] or list(info.shape) != t["shape"]:
        problems.append(f"{fname}: tensor {t['name']} is {info.dtype}{list(info.shape)}, "
                        f"manifest says {t['dtype']}{t['shape']} ({where})")
    if digest not in t:
        problems.append(f"{fname}: tensor {t['name']}: the manifest records no {digest} ({where})")
    elif hashes[t["name"]] != t[digest]:
        problems.append(f"{fname}: tensor {t['name']}: bytes do not match the manifest's {digest} ({where})")


def _read_index(path: Path, problems: list[str]) -> tuple[_Listing, int | None] | None:
    """The index's weight_map as a digest per file, and its total_size, read an entry at a time."""
    listing, total = _Listing({}, {}), None
    try:
        for key, value in iter_object(path, "weight_map"):
            if key == "weight_map":
                name, file = value
                if not isinstance(file, str):
                    raise ValueError(f"weight_map[{name!r}] is not a file name")
                listing.add(name, file)
            elif key == "metadata" and isinstance(value, dict):
                total = value.get("total_size")
    except (OSError, ValueError) as e:
        problems.append(f"{path.name}: unreadable ({e.__class__.__name__}: {e})")
        return None
    return listing, total


def _index_differences(output: Path, man: dict, files: list[str], records: dict[str, dict]) -> list[str]:
    """Name the tensors behind a digest that differs: the index's entries for ``files`` and the
    module records of those files, collected (a second pass over just those)."""
    wanted = set(files)
    listed = {v[0]: v[1] for key, v in iter_object(output / INDEX_NAME, "weight_map")
              if key == "weight_map" and v[1] in wanted}
    recorded: dict[str, str] = {}
    for f in files:
        if f in records:
            recorded.update({t["name"]: f for _, m in RecordsReader(output, records[f]) for t in m["tensors"]
                             if t["file"] == f})
    problems = []
    for t in sorted({*listed, *recorded}):
        got, want = listed.get(t), recorded.get(t)
        if got == want:
            continue
        if want is None:
            problems.append(f"{INDEX_NAME}: lists {t}, which the manifest does not")
        elif got is None:
            problems.append(f"{INDEX_NAME}: does not list {t}")
        else:
            problems.append(f"{INDEX_NAME}: {t} in {got}, manifest says {want}")
    return problems


def _side_records(man: dict, others: dict[str, dict]) -> list[str]:
    """Side files as ``side_files`` records them, added to ``others`` (the ``files`` records) so that
    each is checked once; a side file recorded differently in the two lists is a problem. A version 1
    manifest lists side files by name: those must be among ``files``."""
    problems = []
    for e in man.get("side_files", []):
        rec = e if isinstance(e, dict) else {"file": e}
        name = rec["file"]
        if not is_inside(name):
            problems.append(f"manifest.json: side file {name!r} is not a relative path inside the output")
            continue
        known = others.get(name)
        want = entry_digest(rec)
        if known is None and want is not None:
            others[name] = rec
        elif known is None:
            problems.append(f"{name}: a side file the manifest lists without size and digest")
        elif want is not None and (known["size"], entry_digest(known)) != (rec["size"], want):
            problems.append(f"manifest.json: side file {name} is recorded with two different hashes")
    for name in [n for n in others if not is_inside(n)]:  # never read a file outside the output
        problems.append(f"manifest.json: file {name!r} is not a relative path inside the output")
        del others[name]
    return problems


def _strangers(output: Path, listed: set[str]) -> list[str]:
    """Every weight-like file in the output tree (``sidefiles.WEIGHT_SUFFIXES``: ``*.safetensors``, ``*.bin``,
    ``*.pt``, ``*.gguf``...) that the manifest does not name: an engine globbing ``*.safetensors`` would load it,
    and ``upload`` would publish it, where pack itself never copies unlisted weights from an input."""
    out = []
    for dirpath, dirnames, files in os.walk(output):
        dirnames.sort()
        rel_dir = Path(dirpath).relative_to(output)
        for f in sorted(files):
            rel = (rel_dir / f).as_posix()
            if PurePosixPath(f).suffix.lower() in WEIGHT_SUFFIXES and rel not in listed:
                out.append(f"{rel}: a weight file that manifest.json does not list (not written by this pack: "
                           "an engine or an upload would take it as part of the checkpoint); remove it")
    return out




def _nbytes(t: dict) -> int:
    return DTYPES[t["dtype"]].itemsize * math.prod(t["shape"])
