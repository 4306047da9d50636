"""What the engines read besides the shards: the index here, and the output format's config files
(``convert/formats/``: ``config.json``'s ``quantization_config``, ModelOpt's ``hf_quant_config.json``).
Pure functions of the plan (and the input's config): their bytes are decided before any tensor is
converted."""

from __future__ import annotations

import heapq
import itertools
import json
import pickle
import tempfile
from collections.abc import Iterator
from operator import itemgetter
from pathlib import Path
from typing import IO

from . import formats
from .plan import Plan

RUN_PAIRS = 65_536  # (tensor, shard) pairs sorted in memory before they go to a temporary file as one sorted run
BLOCK = 4_096  # pairs a pickled block of a run holds, and index lines a written piece holds


def index_json(plan: Plan) -> dict:
    """The index as data (``index_text`` is its text)."""
    total, pairs = _weight_map(plan)
    return {"metadata": {"total_size": total}, "weight_map": dict(pairs)}


def index_text(plan: Plan) -> str:
    """``atomic.dumps(index_json(plan))`` (indented JSON): ``index_chunks`` joined."""
    return b"".join(index_chunks(plan)).decode()


def index_chunks(plan: Plan, spill: Path | None = None) -> Iterator[bytes]:
    """The index's text in pieces, written one line a tensor without the dict and ``json.dumps(indent=2)``'s
    pure-Python encoder: the released K3's million tensors' index, held whole, added 0.44 GB to a pack's peak at
    its finish (issue 43). ``spill``: the folder of the sorted runs' temporary files (the output's own disk)."""
    total, pairs = _weight_map(plan, spill)
    enc = json.JSONEncoder().encode
    meta = json.dumps({"total_size": total}, indent=2).replace("\n", "\n  ")
    head = '{\n  "metadata": ' + meta + ',\n  "weight_map": '
    lines = [f"    {enc(n)}: {enc(f)}" for n, f in itertools.islice(pairs, BLOCK)]
    if not lines:
        yield (head + "{}\n}\n").encode()
        return
    yield (head + "{\n" + ",\n".join(lines)).encode()
    while lines := [f"    {enc(n)}: {enc(f)}" for n, f in itertools.islice(pairs, BLOCK)]:
        yield (",\n" + ",\n".join(lines)).encode()
    yield b"\n  }\n}\n"


def _weight_map(plan: Plan, spill: Path | None = None) -> tuple[int, Iterator[tuple[str, str]]]:
    """The output tensors' total bytes, and (tensor, shard) sorted by tensor, made one output shard's part of
    the plan at a time (``Plan.shard_parts``) and merged from sorted runs of ``RUN_PAIRS`` kept in temporary
    files, so that neither the plan nor the pairs are held whole; a name written twice keeps its last shard,
    as a dict would (each run's sort and the merge are stable, in the order the pairs came)."""
    runs: list[IO[bytes]] = []
    pairs: list[tuple[str, str]] = []
    total = 0
    for part in plan.shard_parts():
        s = part.shard
        pairs += [(p.tensor.name, s.file) for p in s.placed]
        total += sum(p.tensor.nbytes for p in s.placed)
        if len(pairs) >= RUN_PAIRS:
            runs.append(_spill(pairs, spill))
            pairs = []
    pairs.sort(key=itemgetter(0))
    merged = heapq.merge(*map(_read_run, runs), pairs, key=itemgetter(0)) if runs else iter(pairs)
    return total, _last_of_each(merged)


def _spill(pairs: list[tuple[str, str]], folder: Path | None) -> IO[bytes]:
    """The pairs sorted, pickled in blocks into an unnamed temporary file (gone with the process, even killed)."""
    pairs.sort(key=itemgetter(0))
    f = tempfile.TemporaryFile(dir=folder)  # noqa: SIM115 (closed by _read_run once merged)
    for i in range(0, len(pairs), BLOCK):
        pickle.dump(pairs[i : i + BLOCK], f, protocol=pickle.HIGHEST_PROTOCOL)
    f.seek(0)
    return f


def _read_run(f: IO[bytes]) -> Iterator[tuple[str, str]]:
    with f:
        while True:
            try:
                yield from pickle.load(f)
            except EOFError:
                return


def _last_of_each(pairs: Iterator[tuple[str, str]]) -> Iterator[tuple[str, str]]:
    """Of consecutive pairs with one name, the last."""
    prev = next(pairs, None)
    for cur in pairs:
        if cur[0] != prev[0]:
            yield prev
        prev = cur
    if prev is not None:
        yield prev


def config_files(config: dict, plan: Plan) -> dict[str, dict]:
    """The output format's config files (config.json first), by file name."""
    return formats.get(plan.recipe.output_format).config_files(config, plan)
