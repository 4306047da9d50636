"""verify-manifest --input: the output derived from its input: the input's files and side files as recorded,
the plan rebuilt from the input and the recorded options (its hash the manifest's), pass-through tensors
byte for byte, quantized units recomputed (a deterministic sample, or all with --full)."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .. import encodings
from ..checkpoint import consumed, open_checkpoint
from ..devices import Device, cpus
from ..errors import ConvertError
from ..hashing import FILE_DIGEST, HUB_DIGEST, file_digest, git_blob_sha1, hash_file, labelled, new_digest, unlabel
from ..manifest import entry_digest, iter_modules, tensor_digest
from ..mapping import parse_mapping
from ..options import Options
from ..plan import QUANTIZED, make_plan
from ..plan.serialize import plan_sha256
from ..recipe import parse_recipe
from ..sidefiles import scan
from ..sources import EntryKind, Source, provenance
from ..vocabulary import KeepRule
from .report import Report

SAMPLE_EVERY = 8  # default: re-quantize one NVFP4 unit in 8 (chosen by name hash), plus the first and last


def check_against_input(source: Source, output: Path, man: dict, rep: Report, full: bool, device: str | Device,
                   progress, total) -> None:
    problems: list[str] = []
    recorded = {f["file"]: f for f in man["inputs"]}
    entries = {f: source.entry(f) for f in recorded}
    missing = [f for f, e in entries.items() if e is None or e.kind is not EntryKind.FILE]
    problems += [f"{source.shown(f)}: missing" for f in missing]
    present = [f for f in recorded if f not in missing]
    origin = provenance(source)
    want = {f: entry_digest(recorded[f]) for f in present}
    problems += [f"manifest.json: input {f} is listed without one digest" for f in present if want[f] is None]
    # a Hub repository: the sha256 its LFS recorded, nothing downloaded, where the manifest records sha256 (a Hub
    # input's pack); a file it records by BLAKE3 (packed from a local copy) is read through the source and hashed
    lfs = {f for f in present if origin is not None and want[f] is not None and unlabel(want[f])[0] == HUB_DIGEST}
    problems += [f"{source.shown(f)}: not stored through LFS: the Hub records no sha256 to compare"
                 for f in sorted(lfs) if not entries[f].sha256]
    hashes = {f: (labelled(HUB_DIGEST, entries[f].sha256), entries[f].size) for f in lfs if entries[f].sha256}
    read = [f for f in present if f not in lfs and want[f] is not None]
    detail = f"{len(recorded)} files"
    if origin is not None:
        detail += f", against the sha256 the Hub records at {origin['commit']}" + _commit_note(man, origin)
        detail += f"; {len(read)} read from the Hub (the manifest records their BLAKE3)" if read else ""
    if total:
        total(sum(entries[f].size for f in read))
    with ThreadPoolExecutor(max_workers=4) as pool:
        hashes |= {f: (got[unlabel(want[f])[0]], size) for f, (got, size, _) in pool.map(
            lambda f: (f, hash_file(f, {}, progress, source=source, file_digests=(unlabel(want[f])[0],))), read)}
    for f, (digest, size) in hashes.items():
        if size != recorded[f]["size"] or digest != want[f]:
            problems.append(f"{source.shown(f)}: differs from the input recorded in the manifest")
    rep.check("input files: sizes and digests", problems, detail)
    _check_input_side_files(source, man, rep, output)
    if problems:
        return
    ckpt = open_checkpoint(source)
    m = parse_mapping(man["mapping_source"], man["mapping"]["file"])
    opts = Options.from_dict(man["options"])
    patterns = [KeepRule(r["pattern"], r["origin"], r["reason"]) for r in man["rules"]]
    recipe = parse_recipe(man["recipe_source"], man["recipe"]["file"]) if man.get("recipe_source") else None
    plan = make_plan(ckpt, m, opts, patterns, recipe)
    same = plan_sha256(plan) == man["plan_sha256"]
    rep.check("re-plan from the input and the recorded options", [] if same else
              ["manifest.json: the plan rebuilt from the input and the recorded options differs"])
    if not same:
        return
    if origin is not None:  # re-deriving reads the weights: a Hub input's are not downloaded by verify
        rep.check("outputs re-derived from the input", [],
                  "skipped: the input is on the Hub and verify downloads no weights; to re-derive the outputs, "
                  "download it (hf download) and pass the folder to --input")
        return
    _recompute(plan, source, output, ckpt.config, man, rep, full, device)


def _commit_note(man: dict, origin: dict) -> str:
    """Where the manifest records another commit (or none) than the one checked: said, not a problem (the
    files' hashes decide)."""
    was = (man.get("source") or {}).get("commit")
    if was is None:
        return " (the manifest records no Hub source)"
    return "" if was == origin["commit"] else f" (the manifest records commit {was})"


def _side_identity(source: Source, f: str, output: Path, digest: str) -> tuple[int, str] | None:
    """A Hub input's side file checked without a download: its LFS sha256 if it has one and the manifest records
    sha256 (``digest``); else, where the output's copy has the Hub's git blob id, the copy's ``digest`` (the offline
    check holds the copy to the manifest); None: neither, the file is read."""
    e = source.entry(f)
    if e is None:
        return None
    if e.sha256 and digest == HUB_DIGEST:
        return e.size, labelled(HUB_DIGEST, e.sha256)
    copy = output / f
    if e.oid and copy.is_file() and git_blob_sha1(copy) == e.oid:
        return e.size, file_digest(copy, digest)
    return None


def _check_input_side_files(source: Source, man: dict, rep: Report, output: Path | None = None) -> None:
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
    hub = provenance(source) is not None and output is not None
    for f in sorted(set(now.copied) & set(side)):
        want = entry_digest(side[f])
        alg = FILE_DIGEST if want is None else unlabel(want)[0]
        known = _side_identity(source, f, output, alg) if hub else None
        if known is None:
            got, size, _ = hash_file(f, {}, source=source, file_digests=(alg,))
            known = size, got[alg]
        if known != (side[f]["size"], want):
            problems.append(f"{source.shown(f)}: differs from the copy the manifest records")
    rep.check(name, problems, f"{len(side)} copied, {len(skipped)} skipped")


def _as_packed(u) -> list:
    """``u`` computed as pack computes it: whole, or a stacked bank a run of experts at a time (the same bytes, in
    order; a release's bank, 4.4 GB, is never held whole: ``pipeline.slicing.expert_runs``)."""
    from ..pipeline.slicing import expert_runs, narrowed
    from ..tuning import Tuning

    runs = expert_runs(u, Tuning().slice_bytes)
    return [narrowed(u, r) for r in runs] if runs else [u]


def _recompute(plan, source: Source, output: Path, config: dict, man: dict, rep: Report, full: bool,
               device: str | Device) -> None:
    from kimi_convert.devices import get_backend

    from ..compute import compute_unit
    from ..plan import fp8_block_size
    from ..readers import MappedReader

    quant_units = [u for u in plan.units if any(it.kind in QUANTIZED for it in u.items)]
    keep = {id(u) for u in quant_units[:1] + quant_units[-1:]}
    chosen = [u for u in plan.units if not any(it.kind in QUANTIZED for it in u.items) or full or id(u) in keep
              or int(hashlib.sha256(u.items[0].name.encode()).hexdigest(), 16) % SAMPLE_EVERY == 0]
    wanted = {t.name for u in chosen for it in u.items for t in it.outputs}  # only their hashes are held
    digest = tensor_digest(man)
    hashes = {t["name"]: t.get(digest) for _, mod in iter_modules(output, man) for t in mod["tensors"]
              if t["name"] in wanted}
    backend = get_backend(device, cpus())
    reader = MappedReader(source)
    block = fp8_block_size(config)
    passthrough, quantized, problems = 0, 0, []
    try:
        for u in chosen:
            if all(it.kind not in QUANTIZED and all(encodings.as_stored(s) for s in it.sources)
                   for it in u.items):
                for it in u.items:  # pass-through: the output's bytes are the sources' bytes
                    h = new_digest(digest)
                    for s in it.sources:
                        h.update(reader.raw(s.parts[0]))
                    passthrough += 1
                    if h.hexdigest() != hashes[it.outputs[0].name]:
                        problems.append(f"tensor {it.outputs[0].name}: not byte-identical to its sources")
            else:
                hs: dict = {}
                for run in _as_packed(u):
                    for name, out in compute_unit(run, reader, backend, block).outputs.items():
                        h = hs.setdefault(name, new_digest(digest))
                        for c in out.chunks:
                            h.update(c)
                quantized += 1
                problems += [f"tensor {name}: re-quantized from its sources, the bytes differ"
                             for name, h in hs.items() if h.hexdigest() != hashes[name]]
            for p in u.parts:
                reader.release(p)
    finally:
        reader.close()
    n_quant = len(quant_units)
    rep.check("outputs re-derived from the input", problems,
              f"{passthrough} pass-through tensors compared; {quantized} quantized/decoded units recomputed "
              f"({'all' if full else 'sample'} of {n_quant} quantized units)")
