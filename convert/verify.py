"""``verify-manifest``: prove that an output folder is what its manifest says, and, given the input,
that it was derived from it correctly.

Offline, every file is read once, in parallel: one sequential pass per shard computes the file's
sha256 and every tensor's sha256 from the same bytes. With ``input``, the input files are hashed the
same way, the plan is rebuilt from the input and the recorded options and rules (its hash must equal
the manifest's), pass-through tensors are compared with their sources' bytes, and NVFP4 tensors are
re-quantized from their sources (a deterministic sample, or all with ``full``) and compared byte for
byte.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from . import engines, filenames, formats, journal
from .checkpoint import INDEX_NAME, consumed, open_checkpoint
from .devices import Device, cpus
from .errors import ConvertError
from .hashing import hash_file
from .jsonfile import read_json
from .jsonstream import iter_object
from .manifest import FORMAT, RecordsReader, is_v3, iter_modules, load_manifest, plan_dict, plan_hash
from .mapping import parse_mapping
from .options import Options
from .plan import QUANTIZED, Encoding, Kind, Op, make_plan
from .recipe import parse_recipe
from .rules import Pattern
from .safetensors_format import DTYPES, parse_header
from .sidefiles import WEIGHT_SUFFIXES, scan
from .sources import EntryKind, Source, open_source
from .write import is_inside

SAMPLE_EVERY = 8  # default: re-quantize one NVFP4 unit in 8 (chosen by name hash), plus the first and last


@dataclass
class Report:
    checks: list[tuple[str, bool, str]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and all(ok for _, ok, _ in self.checks)

    def check(self, name: str, problems: list[str], detail: str = "") -> None:
        self.checks.append((name, not problems, detail))
        self.problems += problems

    def to_dict(self) -> dict:
        return {"ok": self.ok, "checks": [{"check": n, "ok": ok, "detail": d} for n, ok, d in self.checks],
                "problems": self.problems}


def load(output: Path) -> dict:
    if (output / journal.NAME).exists():
        try:
            j = journal.Journal.load(output)
        except ConvertError:
            j = None
        raise ConvertError(f"{output}: an unfinished pack, not a finished checkpoint"
                           + (f"; resume it with: {j.command}" if j else ""))
    if not (output / filenames.MANIFEST).exists():
        raise ConvertError(f"{output}: no manifest.json: not a finished kimi-convert output")
    man = load_manifest(output)
    if man.get("format") != FORMAT:
        raise ConvertError(f"{output / 'manifest.json'}: not a kimi-convert manifest")
    return man


def verify(output: str | Path, input_dir: Source | str | Path | None = None, *, full: bool = False,
           device: str | Device = "cpu", progress: Callable[[int], None] | None = None,
           total: Callable[[int], None] | None = None) -> Report:
    """``input_dir``: the input to check OUTPUT against, a ``Source`` or a folder (``sources.open_source``)."""
    output = Path(output)
    man = load(output)
    rep = Report()
    try:
        _offline(output, man, rep, progress, total)
        if input_dir is not None:
            _against_input(open_source(input_dir), output, man, rep, full, device, progress, total)
    except (KeyError, TypeError, ValueError) as e:
        rep.check("manifest structure", [f"manifest.json: malformed ({type(e).__name__}: {e})"])
    return rep


# ---------------------------------------------------------------------------------------------


@dataclass
class _Modules:
    """What the module-level checks need from the module records, gathered as the records stream by:
    row-range problems, each module's kind (MoE experts folded per layer: their bank's kinds), and
    the tensors' count and bytes. Bounded by the number of non-expert modules, not of tensors."""

    problems: list[str] = field(default_factory=list)
    kinds: dict[str, str] = field(default_factory=dict)  # module -> kind, MoE experts excepted
    experts: dict[str, set[str]] = field(default_factory=dict)  # MoE layer's experts -> their kinds
    tensors: int = 0
    nbytes: int = 0

    def add(self, where: str, m: dict) -> None:
        self.problems += _row_problems(where, m)
        if m["kind"] != Kind.COPY:
            if ".experts." in m["name"]:
                self.experts.setdefault(m["name"].rsplit(".", 2)[0], set()).add(m["kind"])
            else:
                self.kinds[m["name"]] = m["kind"]
        self.tensors += len(m["tensors"])
        self.nbytes += sum(_nbytes(t) for t in m["tensors"])

    def merge(self, other: _Modules) -> None:
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
    modules: _Modules = field(default_factory=_Modules)
    unread: bool = False  # its records file is missing or stops at a bad line: its tensors are not all known


def _offline(output: Path, man: dict, rep: Report, progress, total) -> None:
    """Each shard is one job: its header, its bytes hashed (the file's and each tensor's sha256), and
    its module records (a version 3 manifest: its records file, streamed) compared with them. So
    what is held at once is a few shards' tensors, never the whole model's."""
    v3 = is_v3(man)
    shards = {f["file"]: f for f in man["outputs"]}
    others = {f["file"]: f for f in man.get("files", [])}
    problems: list[str] = _side_records(man, others)
    index_problems: list[str] = []
    index = _read_index(output / INDEX_NAME, index_problems)
    records, by_file, mods = {}, {}, _Modules()
    if v3:
        records = {e["shard"]: e for e in man["records"]}
        problems += [f"manifest.json: no records file for shard {f}" for f in shards if f not in records]
        problems += [f"manifest.json: records file {e['file']} for {f}, which is not among its outputs"
                     for f, e in records.items() if f not in shards]
    else:  # every module in manifest.json (versions 1 and 2): grouped by the file of each tensor
        for i, m in enumerate(man["modules"]):
            mods.add(f"manifest.json module {i}", m)
            for t in m["tensors"]:
                by_file.setdefault(t["file"], {})[t["name"]] = (f"manifest.json module {i}", t)
        problems += [f"manifest.json: tensors name file {f}, which is not among its outputs"
                     for f in by_file if f not in shards]
    for name in others:
        if not (output / name).is_file():
            problems.append(f"{name}: missing")
    problems += [f"{d}/: missing (an empty folder of the input)" for d in man.get("side_folders", [])
                 if not (output / d).is_dir()]
    problems += _strangers(output, {*shards, *others})
    present = {n for n in [*shards, *others] if (output / n).is_file()}
    if total:
        total(sum((output / n).stat().st_size for n in present))

    def job(name: str) -> tuple[str, _ShardCheck | tuple]:
        if name not in shards:
            return name, hash_file(output / name, {}, progress)
        listed = (lambda: iter(by_file.get(name, {}).values())) if not v3 else None
        return name, _check_shard(output, name, shards[name], records.get(name), listed, progress)

    checked: dict[str, _ShardCheck] = {}
    with ThreadPoolExecutor(max_workers=4) as pool:
        for name, res in pool.map(job, [*shards, *(n for n in others if n in present)]):
            if isinstance(res, _ShardCheck):
                checked[name] = res
            else:
                _compare_file(name, res[0], res[1], others[name], problems)
    for c in checked.values():
        mods.merge(c.modules)
    problems += [p for c in checked.values() for p in c.file_problems]
    rep.check("files: present, sizes and sha256", problems,
              f"{len(shards)} shards, {len(others)} other files" + (f", {len(records)} records files" if v3 else ""))
    rep.check("tensors: names, dtypes, shapes and sha256", [p for c in checked.values() for p in c.tensor_problems],
              f"{mods.tensors} tensors")
    if index is not None:
        listing, total_size = index
        want = _Listing({}, {})
        for c in checked.values():
            for f, n in c.listed.counts.items():
                want.sums[f], want.counts[f] = c.listed.sums[f], n
        unread = {f for f, c in checked.items() if c.unread}
        files = listing.differs(want)
        index_problems += [f"{INDEX_NAME}: not compared for {f}, whose records file is unreadable" for f in files
                           if f in unread]
        if [f for f in files if f not in unread]:
            index_problems += _index_differences(output, man, [f for f in files if f not in unread], records,
                                                 by_file)
        if total_size != mods.nbytes:
            index_problems.append(f"{INDEX_NAME}: total_size {total_size}, tensors hold {mods.nbytes}")
    rep.check("index: weight_map and total_size", index_problems)
    _check_configs(output, man, rep)
    rep.check("fused modules: row ranges tile the fused tensors", mods.problems)
    _check_engine_rules(man, mods, rep)


def _compare_file(name: str, sha: str, size: int, rec: dict, problems: list[str]) -> None:
    if size != rec["size"]:
        problems.append(f"{name}: size {size}, manifest says {rec['size']}")
    if sha != rec["sha256"]:
        problems.append(f"{name}: sha256 {sha[:16]}..., manifest says {rec['sha256'][:16]}...")


def _check_shard(output: Path, name: str, rec: dict, records: dict | None, listed, progress) -> _ShardCheck:
    """One shard: its bytes against ``rec`` (size, sha256), its tensors against its module records:
    ``records`` (its records file's listing, version 3) or ``listed()`` ((where, tensor) pairs from
    manifest.json, versions 1 and 2); and the digest of the index entries they call for."""
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
        sha, size, hashes = hash_file(path, {t: (i.start, i.end) for t, i in header.items()}, progress)
        _compare_file(name, sha, size, rec, c.file_problems)
    seen: set[str] = set()
    for where, t in (_record_tensors(output, name, records, c) if records is not None else listed()):
        seen.add(t["name"])
        _check_tensor(name, where, t, header, hashes, c.tensor_problems)
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


def _record_tensors(output: Path, shard: str, entry: dict, c: _ShardCheck):
    """The tensors of a shard's records file, each with the line it is on; the file's own problems
    (missing, truncated, edited, a malformed record) go to ``c``; its modules to ``c.modules``."""
    reader = RecordsReader(output, entry)
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


def _check_tensor(fname: str, where: str, t: dict, header: dict | None, hashes: dict[str, str],
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
    if hashes[t["name"]] != t["sha256"]:
        problems.append(f"{fname}: tensor {t['name']}: bytes do not match the manifest's sha256 ({where})")


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


def _index_differences(output: Path, man: dict, files: list[str], records: dict[str, dict],
                       by_file: dict[str, dict]) -> list[str]:
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
        recorded.update({t: f for t in by_file.get(f, {})})
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
        if known is None and "sha256" in rec:
            others[name] = rec
        elif known is None:
            problems.append(f"{name}: a side file the manifest lists without size and sha256")
        elif "sha256" in rec and (known["size"], known["sha256"]) != (rec["size"], rec["sha256"]):
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


def _read_json(path: Path, problems: list[str]) -> dict | None:
    try:
        return read_json(path, path.name, want=None)
    except ConvertError as e:
        problems.append(f"{path.name}: unreadable ({e})")
        return None


def _nbytes(t: dict) -> int:
    return DTYPES[t["dtype"]].itemsize * math.prod(t["shape"])


def _check_configs(output: Path, man: dict, rep: Report) -> None:
    """The configs the output format wrote, against the manifest (the format knows its files and keys)."""
    fmt = formats.get((man.get("recipe") or {}).get("output_format", formats.DEFAULT))
    rep.check("configs agree with the manifest", fmt.check_configs(output, man, _read_json))


def _row_problems(where: str, m: dict) -> list[str]:
    """A fused module's source rows tile its tensor: each follows the previous, all rows covered."""
    if m["op"] == Op.NONE:
        return []
    problems, pos = [], 0
    for s in m["sources"]:
        a, b = s["rows"]
        n = 1 if m["op"] == Op.STACK else s["shape"][0]
        if a != pos or b - a != n:
            problems.append(f"module {m['name']}: source {s['name']} rows {a}:{b} do not follow at {pos} "
                            f"with its {n} rows ({where})")
        pos = b
    rows = m["tensors"][0]["shape"][0]
    if pos != rows:
        problems.append(f"module {m['name']}: sources cover {pos} rows of {rows} ({where})")
    return problems


def _layer_kinds(man: dict, mods: _Modules
                 ) -> tuple[dict[str, tuple[str, tuple[str, ...]]], dict[str, dict[str, list[str]]]]:
    """Every layer an engine builds from the output -> (the format written: 'nvfp4', 'fp8-block' or 'keep';
    the engines that build it): each linear module, each MoE layer's experts as one layer, each engine
    packed module (by its own engines only); and per engine its packed modules {leaf name: member leaves}."""
    both = ("vllm", "sglang")
    kinds, experts = mods.kinds, mods.experts
    layers = {k: (v, both) for k, v in kinds.items() if k.rsplit(".", 2)[0] not in experts}
    layers.update({k: (next(iter(v)), both) for k, v in experts.items() if len(v) == 1})
    packed: dict[str, dict[str, list[str]]] = {e: {} for e in both}
    for g in man.get("engine_groups", []):
        ks = {kinds.get(mod) for mod in g["members"]}
        if len(ks) == 1 and None not in ks and ".experts." not in g["name"]:
            layers[g["name"]] = (ks.pop(), tuple(g["engines"]))
        for e in g["engines"]:
            packed[e][g["name"].rsplit(".", 1)[1]] = [mod.rsplit(".", 1)[1] for mod in g["members"]]
    return layers, packed


def _check_engine_rules(man: dict, mods: _Modules, rep: Report) -> None:
    """Each engine layer resolves, under vLLM's and SGLang's own matching rules, to the format written:
    the exclude list (quant_method modelopt), or quantized_layers and the exclude list (modelopt_mixed)."""
    prefix = man["mapping_table"].get("text_prefix", "")
    ignore = man["exclude_modules"]
    method = (man.get("recipe") or {}).get("quant_method", "modelopt")
    layers, packed = _layer_kinds(man, mods)
    problems: list[str] = []
    quantized_layers = man.get("quantized_layers") or {}
    for name, (kind, built_by) in sorted(layers.items()):
        if method == "modelopt_mixed":
            try:
                got = engines.mixed_algo(name, quantized_layers, packed["vllm"])
            except engines.MixedShards as e:
                problems.append(f"vLLM: {e}")
                continue
            want = {Kind.KEEP: None, Kind.FP8_BLOCK: "FP8_PB_WO"}.get(kind, "NVFP4")
            if kind == Kind.NVFP4 and got == "W4A16_NVFP4":
                want = got
            if got != want and not (kind == Kind.KEEP and engines.vllm_is_skipped(name, ignore, {})):
                problems.append(f"quantized_layers resolve {name} to {got}, but it is written {kind}")
            continue
        kept = kind == Kind.KEEP
        for engine in built_by:
            try:  # both engines first ask is_layer_skipped (a packed layer through its shards)
                got = engines.vllm_is_skipped(name, ignore, packed[engine])
                if engine == "sglang":
                    got = got or engines.sglang_is_excluded(name, ignore, prefix)
            except engines.MixedShards as e:
                problems.append(f"{engine}: {e}")
                continue
            if got != kept:
                problems.append(f"{engine} would {'skip' if got else 'quantize'} {name}, which is written {kind}")
    rep.check("exclude list / quantized_layers under vLLM's and SGLang's matching rules", problems,
              f"{len(layers)} layers")


# ---------------------------------------------------------------------------------------------


def _against_input(source: Source, output: Path, man: dict, rep: Report, full: bool, device: str | Device,
                   progress, total) -> None:
    problems: list[str] = []
    recorded = {f["file"]: f for f in man["inputs"]}
    entries = {f: source.entry(f) for f in recorded}
    missing = [f for f, e in entries.items() if e is None or e.kind is not EntryKind.FILE]
    problems += [f"{source.shown(f)}: missing" for f in missing]
    present = [f for f in recorded if f not in missing]
    if total:
        total(sum(entries[f].size for f in present))
    with ThreadPoolExecutor(max_workers=4) as pool:
        hashes = dict(pool.map(lambda f: (f, hash_file(f, {}, progress, source=source)), present))
    for f, (sha, size, _) in hashes.items():
        if size != recorded[f]["size"] or sha != recorded[f]["sha256"]:
            problems.append(f"{source.shown(f)}: differs from the input recorded in the manifest")
    rep.check("input files: sizes and sha256", problems, f"{len(recorded)} files")
    _check_input_side_files(source, man, rep)
    if problems:
        return
    ckpt = open_checkpoint(source)
    m = parse_mapping(man["mapping_source"], man["mapping"]["file"])
    opts = Options.from_dict(man["options"])
    patterns = [Pattern(r["pattern"], r["origin"], r["reason"]) for r in man["rules"]]
    recipe = parse_recipe(man["recipe_source"], man["recipe"]["file"]) if man.get("recipe_source") else None
    plan = make_plan(ckpt, m, opts, patterns, recipe)
    same = plan_hash(plan_dict(plan)) == man["plan_sha256"]
    rep.check("re-plan from the input and the recorded options", [] if same else
              ["manifest.json: the plan rebuilt from the input and the recorded options differs"])
    if not same:
        return
    _recompute(plan, source, output, ckpt.config, man, rep, full, device)


def _check_input_side_files(source: Source, man: dict, rep: Report) -> None:
    """The input's side files hash to the recorded values, and every input file is accounted for:
    read (a shard, config.json, the index), copied, recreated (an empty folder) or skipped with a
    reason; a file the manifest does not account for was dropped silently."""
    name = "input side files: copied as recorded, none dropped"
    if "skipped_files" not in man:
        rep.check(name, [], "not recorded (a manifest of kimi-convert before format_version 2)")
        return
    try:
        now = scan(source, consumed([f["file"] for f in man["inputs"]]))
    except ConvertError as e:
        rep.check(name, [str(e)])
        return
    side = {e["file"]: e for e in man["side_files"]}
    problems = [f"{source.shown(f)}: neither copied nor skipped in the manifest (dropped)" for f in now.copied
                if f not in side]
    problems += [f"{source.shown(f)}: copied by the manifest, not a side file of the input" for f in side
                 if f not in now.copied]
    skipped = {e["file"] for e in man["skipped_files"]}
    problems += [f"{source.shown(s.file)}: skipped now ({s.reason}), not in the manifest's skipped_files"
                 for s in now.skipped if s.file not in skipped]
    problems += [f"{source.shown(f)}: in the manifest's skipped_files, not skipped in the input"
                 for f in sorted(skipped) if f not in {s.file for s in now.skipped}]
    if set(now.folders) != set(man.get("side_folders", [])):
        problems.append(f"{source.name}: empty folders {sorted(now.folders)}, the manifest records "
                        f"{sorted(man.get('side_folders', []))}")
    for f in sorted(set(now.copied) & set(side)):
        sha, size, _ = hash_file(f, {}, source=source)
        if (size, sha) != (side[f]["size"], side[f]["sha256"]):
            problems.append(f"{source.shown(f)}: differs from the copy the manifest records")
    rep.check(name, problems, f"{len(side)} copied, {len(skipped)} skipped")


def _recompute(plan, source: Source, output: Path, config: dict, man: dict, rep: Report, full: bool,
               device: str | Device) -> None:
    from kimi_convert.kernels import get_backend

    from .compute import compute_unit
    from .plan import fp8_block_size
    from .readers import MappedReader

    quant_units = [u for u in plan.units if any(it.kind in QUANTIZED for it in u.items)]
    keep = {id(u) for u in quant_units[:1] + quant_units[-1:]}
    chosen = [u for u in plan.units if not any(it.kind in QUANTIZED for it in u.items) or full or id(u) in keep
              or int(hashlib.sha256(u.items[0].name.encode()).hexdigest(), 16) % SAMPLE_EVERY == 0]
    wanted = {t.name for u in chosen for it in u.items for t in it.outputs}  # only their hashes are held
    hashes = {t["name"]: t["sha256"] for _, mod in iter_modules(output, man) for t in mod["tensors"]
              if t["name"] in wanted}
    backend = get_backend(device, cpus())
    reader = MappedReader(source)
    block = fp8_block_size(config)
    passthrough, quantized, problems = 0, 0, []
    try:
        for u in chosen:
            if all(it.kind not in QUANTIZED and all(s.encoding == Encoding.DENSE for s in it.sources)
                   for it in u.items):
                for it in u.items:  # pass-through: the output's bytes are the sources' bytes
                    h = hashlib.sha256()
                    for s in it.sources:
                        h.update(reader.raw(s.parts[0]))
                    passthrough += 1
                    if h.hexdigest() != hashes[it.outputs[0].name]:
                        problems.append(f"tensor {it.outputs[0].name}: not byte-identical to its sources")
            else:
                res = compute_unit(u, reader, backend, block)
                quantized += 1
                for name, out in res.outputs.items():
                    h = hashlib.sha256()
                    for c in out.chunks:
                        h.update(c)
                    if h.hexdigest() != hashes[name]:
                        problems.append(f"tensor {name}: re-quantized from its sources, the bytes differ")
            for p in u.parts:
                reader.release(p)
    finally:
        reader.close()
    n_quant = len(quant_units)
    rep.check("outputs re-derived from the input", problems,
              f"{passthrough} pass-through tensors compared; {quantized} quantized/decoded units recomputed "
              f"({'all' if full else 'sample'} of {n_quant} quantized units)")
