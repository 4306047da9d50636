"""``pack``: read -> plan -> compute -> write, one unit at a time, shards in order.

Peak memory is one unit's decoded sources and quantized outputs (a fused module or an expert's
w1/w3), whatever the checkpoint's size: sources are memory-map views whose pages are dropped once
their unit is written.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

from tqdm import tqdm

from kimi_convert.kernels import get_backend

from . import manifest as manifest_mod
from . import write
from .compute import compute_unit
from .errors import ConvertError
from .mapping import find_mapping
from .plan import Options, Plan, fp8_block_size, make_plan
from .source import Checkpoint, TensorReader, open_checkpoint


@dataclass(frozen=True)
class PackResult:
    plan: Plan
    output_dir: Path
    bytes_in: int
    bytes_out: int


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
    progress: bool = True,
) -> PackResult:
    input_dir, output_dir = Path(input_dir), Path(output_dir)
    write.check_output_dir(input_dir, output_dir, overwrite)
    ckpt, plan = load_plan(input_dir, opts, mapping)
    output_dir.mkdir(parents=True, exist_ok=True)
    write.clear_previous(output_dir, plan.side_files)
    try:
        backend = get_backend(device)
    except ValueError as e:
        raise ConvertError(str(e)) from None
    block = fp8_block_size(ckpt.config)
    reader = TensorReader(input_dir)
    tensor_hashes: dict[str, str] = {}
    source_hashes: dict[str, str] = {}
    notes: dict[str, dict] = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        # Input file hashes run beside the conversion (hashlib releases the GIL).
        input_futs = {f: pool.submit(write.sha256_file, input_dir / f) for f, _ in plan.inputs}
        bar = tqdm(total=plan.bytes_in, unit="B", unit_scale=True, unit_divisor=1024, desc="pack",
                   disable=not progress, dynamic_ncols=True)
        try:
            by_shard = {f: list(us) for f, us in groupby(plan.units, key=lambda u: u.shard)}
            for shard in plan.shards:
                writer = write.ShardWriter(output_dir, shard)
                try:
                    for unit in by_shard[shard.file]:
                        res = compute_unit(unit, reader, backend, block)
                        for name, out in res.outputs.items():
                            tensor_hashes[name] = writer.write(name, out.chunks)
                        source_hashes.update(res.source_hashes)
                        notes.update(res.notes)
                        del res
                        for it in unit.items:
                            for s in it.sources:
                                for p in s.parts:
                                    reader.release(p)
                        bar.update(unit.nbytes_in)
                except BaseException:
                    writer.abort()
                    raise
                writer.finish()
        finally:
            bar.close()
            reader.close()
        output_futs = {s.file: pool.submit(write.sha256_file, output_dir / s.file) for s in plan.shards}
        input_hashes = {f: fut.result() for f, fut in input_futs.items()}
        output_hashes = {f: fut.result() for f, fut in output_futs.items()}
    write.write_json_atomic(output_dir / "config.json", write.output_config(ckpt.config, plan))
    write.write_json_atomic(output_dir / "hf_quant_config.json", write.hf_quant_config(plan))
    write.copy_side_files(input_dir, output_dir, plan.side_files)
    write.write_json_atomic(output_dir / write.INDEX_NAME, write.index_json(plan))
    sizes = {s.file: s.size for s in plan.shards}
    man = manifest_mod.build(plan, input_hashes, output_hashes, tensor_hashes, source_hashes, notes, sizes)
    write.write_json_atomic(output_dir / "manifest.json", man, compact_lists=("modules",))
    return PackResult(plan, output_dir, plan.bytes_in, plan.bytes_out)
