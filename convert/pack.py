"""``pack``: read -> plan -> compute -> write, one unit at a time, shards in order.

Peak memory is one unit's decoded sources and quantized outputs (a fused module or an expert's
w1/w3), whatever the checkpoint's size: sources are memory-map views whose pages are dropped once
their unit is written.

Crash safety: each shard is written under a ``.partial`` name, flushed, renamed, hashed and recorded
in the resume journal; configs, index and manifest come last, the manifest very last, and the
journal is removed after it. ``resume=True`` re-checks the recorded shards against their hashes and
writes only the rest, so the result is byte-identical to an uninterrupted run.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

from tqdm import tqdm

from kimi_convert.kernels import Backend, get_backend

from . import faults, journal, write
from . import manifest as manifest_mod
from .compute import compute_unit
from .errors import ConvertError
from .journal import Journal, ShardRecord
from .mapping import find_mapping
from .plan import Options, Plan, Shard, Unit, fp8_block_size, make_plan
from .source import Checkpoint, TensorReader, open_checkpoint


@dataclass(frozen=True)
class PackResult:
    plan: Plan
    output_dir: Path
    bytes_in: int
    bytes_out: int
    resumed_shards: int = 0  # shards a resumed run found finished and verified
    already_complete: bool = False


def load_plan(input_dir: str | os.PathLike, opts: Options, mapping: str | None = None) -> tuple[Checkpoint, Plan]:
    ckpt = open_checkpoint(input_dir)
    m = find_mapping(ckpt.config, mapping)
    return ckpt, make_plan(ckpt, m, opts)


def pack(
    input_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    opts: Options,
    *,
    mapping: str | None = None,
    device: str = "auto",
    overwrite: bool = False,
    resume: bool = False,
    progress: bool = True,
    command: str | None = None,
) -> PackResult:
    input_dir, output_dir = Path(input_dir), Path(output_dir)
    write.check_output_dir(input_dir, output_dir)
    ckpt, plan = load_plan(input_dir, opts, mapping)
    try:
        backend = get_backend(device)
    except ValueError as e:
        raise ConvertError(str(e)) from None
    command = command or f"kimi-convert pack {input_dir} {output_dir} --resume"
    output_dir.mkdir(parents=True, exist_ok=True)
    j = _open_journal(input_dir, output_dir, plan, overwrite, resume, command)
    if j is None:
        return PackResult(plan, output_dir, plan.bytes_in, plan.bytes_out, already_complete=True)
    resumed = _verify_finished(output_dir, plan, j)
    _check_space(output_dir, [s for s in plan.shards if s.file not in j.shards])
    stop = threading.Event()
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kimi-convert-hash")
    try:
        # Input file hashes run beside the conversion (hashlib releases the GIL).
        input_futs = {f: pool.submit(write.sha256_file, input_dir / f, stop) for f, _ in plan.inputs}
        _write_shards(ckpt, plan, output_dir, backend, j, progress)
        input_hashes = {f: fut.result() for f, fut in input_futs.items()}
    except BaseException:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown()
    _finish(ckpt, plan, input_dir, output_dir, j, input_hashes)
    return PackResult(plan, output_dir, plan.bytes_in, plan.bytes_out, resumed_shards=resumed)


def _open_journal(input_dir: Path, output_dir: Path, plan: Plan, overwrite: bool, resume: bool,
                  command: str) -> Journal | None:
    """The journal to continue, or a fresh one; None when a resumed output is already complete."""
    fp = journal.fingerprint(manifest_mod.plan_dict(plan))
    stamps = journal.input_stamps(input_dir, [f for f, _ in plan.inputs])
    existing = Journal.load(output_dir)
    if resume and existing is not None:
        if existing.fingerprint != fp or existing.inputs != stamps:
            what = ("input files changed" if existing.inputs != stamps
                    else "the plan (input headers, mapping or options) differs")
            raise ConvertError(f"{output_dir}: cannot resume: {what} since the interrupted run; "
                               "rerun it with the same options, or start again with --overwrite")
        return existing
    if resume and (output_dir / "manifest.json").exists():
        _check_complete(output_dir)
        return None
    if existing is not None and not overwrite:
        raise ConvertError(f"{output_dir}: holds an unfinished pack ({len(existing.shards)} shards done); "
                           f"resume it with: {existing.command}")
    if not (resume or overwrite) and any(output_dir.iterdir()):
        raise ConvertError(f"{output_dir}: not empty; pass --overwrite to replace a previous output")
    if resume and not write.own_files_only(output_dir, plan.side_files):
        raise ConvertError(f"{output_dir}: nothing to resume (no journal) and the folder holds other files; "
                           "pass --overwrite to start again")
    write.clear_previous(output_dir, plan.side_files)
    for p in output_dir.glob("*" + write.PARTIAL):
        p.unlink()
    j = Journal(fp, command, stamps)
    j.save(output_dir)
    return j


def _check_complete(output_dir: Path) -> None:
    """A resumed run that finds a finished output checks its files against the manifest."""
    man = write.load_manifest(output_dir)
    for f in man.get("outputs", []):
        path = output_dir / f["file"]
        if not path.is_file() or path.stat().st_size != f["size"] or write.sha256_file(path) != f["sha256"]:
            raise ConvertError(f"{path}: does not match manifest.json; start again with --overwrite")


def _verify_finished(output_dir: Path, plan: Plan, j: Journal) -> int:
    """Keep the journaled shards whose file still hashes to the recorded value; forget the rest."""
    planned = {s.file for s in plan.shards}
    kept = 0
    for name, rec in list(j.shards.items()):
        path = output_dir / name
        ok = name in planned and path.is_file() and path.stat().st_size == rec.size
        if ok and write.sha256_file(path) == rec.sha256:
            kept += 1
        else:
            del j.shards[name]
    j.save(output_dir)
    return kept


def _check_space(output_dir: Path, todo: list[Shard]) -> None:
    need = sum(s.size for s in todo)
    free = shutil.disk_usage(output_dir).free
    if need > free:
        raise ConvertError(f"{output_dir}: needs {need / 1e9:.2f} GB for {len(todo)} shard(s), "
                           f"{free / 1e9:.2f} GB free")


def _write_shards(ckpt: Checkpoint, plan: Plan, output_dir: Path, backend: Backend, j: Journal,
                  progress: bool) -> None:
    block = fp8_block_size(ckpt.config)
    reader = TensorReader(ckpt.folder)
    by_shard = {f: list(us) for f, us in groupby(plan.units, key=lambda u: u.shard)}
    done_bytes = sum(u.nbytes_in for f in j.shards for u in by_shard.get(f, []))
    bar = tqdm(total=plan.bytes_in, initial=done_bytes, unit="B", unit_scale=True, unit_divisor=1024,
               desc="pack", disable=not progress, dynamic_ncols=True)
    try:
        for shard in plan.shards:
            if shard.file not in j.shards:
                j.shards[shard.file] = _write_shard(output_dir, shard, by_shard[shard.file], reader, backend,
                                                    block, bar)
                j.save(output_dir)
    finally:
        bar.close()
        reader.close()


#: Units whose outputs may wait for the writer while the next unit computes (bounds memory).
WRITE_DEPTH = 2


def _write_shard(output_dir: Path, shard: Shard, units: list[Unit], reader: TensorReader, backend: Backend,
                 block, bar) -> ShardRecord:
    """Compute on this thread; hash and write on another, so that the two overlap.

    The writer hashes the unit's source tensors and writes its outputs, then drops the source pages;
    at most WRITE_DEPTH computed units wait for it. The next unit's sources are prefetched."""
    rec = ShardRecord(size=shard.size, sha256="", tensors={}, sources={}, notes={})
    writer = write.ShardWriter(output_dir, shard)

    def store(unit: Unit, res) -> None:
        for p in unit.parts:
            rec.sources[p.name] = hashlib.sha256(reader.raw(p)).hexdigest()
        for name, out in res.outputs.items():
            rec.tensors[name] = writer.write(name, out.chunks)
        for p in unit.parts:
            reader.release(p)
        bar.update(unit.nbytes_in)

    pending: deque[Future] = deque()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kimi-convert-write")
    try:
        for i, unit in enumerate(units):
            for p in units[i + 1].parts if i + 1 < len(units) else []:
                reader.prefetch(p)
            res = compute_unit(unit, reader, backend, block)
            rec.notes.update(res.notes)
            pending.append(pool.submit(store, unit, res))
            del res
            while len(pending) > WRITE_DEPTH:
                pending.popleft().result()
        while pending:
            pending.popleft().result()
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        writer.abort()
        raise
    pool.shutdown()
    writer.finish()
    faults.point("shard")
    rec.sha256 = write.sha256_file(output_dir / shard.file)
    return rec


def _finish(ckpt: Checkpoint, plan: Plan, input_dir: Path, output_dir: Path, j: Journal,
            input_hashes: dict[str, str]) -> None:
    """Configs, side files and index, then the manifest, then the journal goes."""
    write.write_json_atomic(output_dir / "config.json", write.output_config(ckpt.config, plan))
    write.write_json_atomic(output_dir / "hf_quant_config.json", write.hf_quant_config(plan))
    write.copy_side_files(input_dir, output_dir, plan.side_files)
    write.write_json_atomic(output_dir / write.INDEX_NAME, write.index_json(plan))
    others = ["config.json", "hf_quant_config.json", write.INDEX_NAME, *plan.side_files]
    files = [{"file": f, "size": (output_dir / f).stat().st_size, "sha256": write.sha256_file(output_dir / f)}
             for f in others]
    recs = [j.shards[s.file] for s in plan.shards]
    man = manifest_mod.build(
        plan,
        input_hashes,
        {s.file: r.sha256 for s, r in zip(plan.shards, recs, strict=True)},
        {k: v for r in recs for k, v in r.tensors.items()},
        {k: v for r in recs for k, v in r.sources.items()},
        {k: v for r in recs for k, v in r.notes.items()},
        {s.file: s.size for s in plan.shards},
        files,
    )
    write.write_json_atomic(output_dir / "manifest.json", man, compact_lists=("modules",))
    (output_dir / journal.NAME).unlink()

