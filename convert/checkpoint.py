"""A checkpoint: config.json, the shard index and every shard's header (no tensor data), read through its
``Source`` (a local folder today)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import repeat
from operator import eq
from pathlib import Path

from . import filenames, mistral_checkpoint
from .errors import ConvertError
from .gcpause import gc_paused
from .jsonfile import read_json
from .safetensors_format import TensorInfo, read_header
from .sidefiles import pruned, scan
from .sources import Source, open_source
from .tensortable import TensorTable
from .vocabulary import Skipped

INDEX_NAME = filenames.INDEX  # the name other modules have used


def load_json(path: Path, rel: str) -> dict:
    """A JSON object file named by a path (``inspect`` given a config.json): ``jsonfile.read_json``'s rules (a
    regular file, bounded, depth-safe), every fault one line naming ``rel``. The input checkpoint's own files
    are read through its source (``Source.read_json``, the same reader)."""
    return read_json(path, rel)


@dataclass
class Checkpoint:
    """A checkpoint's headers and config: everything the plan needs, no tensor data. ``source``: where its
    bytes come from (``sources``); everything that reads the input later (pipeline, verify, side files,
    journal) reads it through that, never through a path."""

    source: Source
    config: dict
    files: list[str]  # shard files in index order
    tensors: Mapping[str, TensorInfo]  # every stored tensor by name (a TensorTable as read; the plan's own: a dict)
    file_sizes: dict[str, int] = field(default_factory=dict)
    side_files: list[str] = field(default_factory=list)  # non-weight files to copy (sidefiles.scan)
    has_index: bool = False
    side_folders: list[str] = field(default_factory=list)  # empty folders to recreate
    skipped_files: list[Skipped] = field(default_factory=list)  # input files not copied, with the reason

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def drop_table(self) -> None:
        """Let the table go, to be read again from ``source`` if anything asks for it (``TableReadAgain``): a
        banked plan makes each wave's jobs from its outline, so a pack holds no table for its hours (issue 43:
        benchmarks/RESULTS.md, "Session 28"). Its entries, read again, are the same headers'."""
        self.tensors = TableReadAgain(self)


class TableReadAgain(Mapping):
    """A checkpoint's table read again from its source on first use (``Checkpoint.drop_table``): the
    module-by-module plan of a banked one, made only when asked for, needs it; the pack itself does not."""

    def __init__(self, ckpt: Checkpoint):
        self._ckpt = ckpt
        self._table: Mapping[str, TensorInfo] | None = None

    @property
    def loaded(self) -> bool:
        return self._table is not None

    def _tensors(self) -> Mapping[str, TensorInfo]:
        if self._table is None:
            self._table = open_checkpoint(self._ckpt.source).tensors
        return self._table

    def __getitem__(self, name: str) -> TensorInfo:
        return self._tensors()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors())

    def __len__(self) -> int:
        return len(self._tensors())

    def __getstate__(self) -> dict:
        return {"_ckpt": self._ckpt, "_table": None}  # sent to a worker as it was dropped


@gc_paused()
def _check_named(source: Source, rel: str, what: str, weight_map: dict[str, str] | None):
    """``source.check_named``; a file the index names that is missing or not a file is refused with what the index
    lists in it (an MTP layer's own shard, say: ``model.layers.92.*``)."""
    try:
        return source.check_named(rel, what)
    except ConvertError as e:
        if weight_map is None:
            raise
        listed = sorted(n for n, f in weight_map.items() if f == rel)
        more = " ..." if len(listed) > 3 else ""
        raise ConvertError(f"{e} (the index lists {len(listed)} tensor(s) in it: {', '.join(listed[:3])}{more})"
                           ) from None


def _layout(source: Source) -> tuple[dict, str, Callable[[str], bool]]:
    """The config, the index's name and which top-level files are shards: config.json, the HF index and every
    ``*.safetensors``; or, with ``params.json`` and no config.json, Mistral's own layout (``mistral_checkpoint``)."""
    if mistral_checkpoint.in_layout(source):
        params = source.read_json(mistral_checkpoint.PARAMS, f"{source.name}/{mistral_checkpoint.PARAMS}")
        return (mistral_checkpoint.config_view(params, f"{source.name}/{mistral_checkpoint.PARAMS}"),
                mistral_checkpoint.INDEX, mistral_checkpoint.is_shard)
    config = source.read_json("config.json", f"{source.name}/config.json")
    return config, INDEX_NAME, lambda rel: "/" not in rel and rel.endswith(".safetensors")


def open_checkpoint(where: str | os.PathLike | Source, need_weights: bool = True) -> Checkpoint:
    """Read config.json (or Mistral's params.json: ``_layout``), the index and every shard header of ``where`` (a
    source, or a folder: ``open_source``; no tensor data)."""
    source = open_source(where)
    config, index_name, is_shard = _layout(source)
    listing = None
    if source.entry(index_name) is not None:  # a dangling link or a symlink loop is refused by the reader, not ignored
        files, weight_map = _indexed_files(source, index_name, need_weights)
    else:
        weight_map = None
        listing = source.list_files(prune=pruned)
        files = sorted(e.rel for e in listing if is_shard(e.rel))
        if not files and need_weights:
            shards = "consolidated*.safetensors" if index_name == mistral_checkpoint.INDEX else "*.safetensors"
            raise ConvertError(f"{source.name}: no {shards} files and no {index_name}")
    # Every named file must exist inside the source before any header is read: a missing or
    # escaping file is the more useful error than the tensors it leaves unaccounted for.
    what = index_name if weight_map is not None else source.name
    named = {rel: _check_named(source, rel, what, weight_map) for rel in files}
    tensors, sizes = _stored_tensors(source, named, weight_map, index_name)
    side = scan(source, consumed(files), listing)
    return Checkpoint(source, config, files, tensors, sizes, list(side.copied), weight_map is not None,
                      list(side.folders), list(side.skipped))


def _indexed_files(source: Source, index_name: str, need_weights: bool) -> tuple[list[str], dict[str, str]]:
    """The shard files the index names, in first-listed order, and its weight_map (under the source's own names
    for the files: ``Source.canonical_names``); an index that is not a map of tensor name to file, or (where
    weights are needed) names no tensor, is refused here, before any header is read."""
    index = source.read_json(index_name, index_name)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not (
        all(map(isinstance, weight_map, repeat(str))) and all(map(isinstance, weight_map.values(), repeat(str)))
    ):
        raise ConvertError(f"{index_name}: weight_map is not a map of tensor name to file")
    if not weight_map and need_weights:
        raise ConvertError(f"{index_name}: weight_map is empty: the index names no tensor (a checkpoint with "
                           "weights lists each one; remove the index if the shards are to be read without it)")
    # each file's name copied out of the parse: a string of the index's kept alive pins the allocator's block it
    # sits in among half a million freed names (the released K3's 96 files: 90 MB held for the run, issue 43)
    files = [f.encode().decode() for f in dict.fromkeys(weight_map.values())]
    renamed = source.canonical_names(files, index_name)
    if renamed:
        weight_map = {k: renamed.get(v, v) for k, v in weight_map.items()}
        files = list(dict.fromkeys(renamed.get(f, f) for f in files))
    return files, weight_map


def _stored_tensors(source: Source, named: dict, weight_map: dict[str, str] | None, index_name: str
                    ) -> tuple[TensorTable, dict[str, int]]:
    """Every tensor the shards' headers store, and each shard's size: a tensor stored twice, or stored where the
    index does not list it, or listed and stored nowhere, is refused, naming the file and the tensor."""
    tensors = TensorTable()
    sizes: dict[str, int] = {}
    headers = _headers(source, list(named))
    for rel, entry in named.items():
        sizes[rel] = entry.size
        found, _meta = next(headers)
        # checked in bulk (the released K3 has 500,000 names); a fault is found and named by the loop below.
        # With an index, every name listed for this file is in no other (it was listed for that one).
        if not (all(map(eq, map(weight_map.get, found), repeat(rel))) if weight_map is not None
                else tensors.isdisjoint(found)):
            _refuse_stored(found, rel, tensors, weight_map, index_name)
        tensors.add(found.values())
    if weight_map is not None and len(tensors) != len(weight_map):  # every stored tensor is listed: equal sets
        for name, rel in weight_map.items():
            if name not in tensors:
                raise ConvertError(f"{index_name}: tensor {name} is not in {rel}")
    return tensors, sizes


def _refuse_stored(found: dict[str, TensorInfo], rel: str, tensors: TensorTable, weight_map: dict[str, str] | None,
                   index_name: str) -> None:
    """The first tensor of ``rel`` that is stored in an earlier file too, or is not where the index lists it."""
    for name in found:
        if name in tensors:
            raise ConvertError(f"{rel}: tensor {name} is also stored in {tensors[name].file}")
        if weight_map is not None and weight_map.get(name) != rel:
            where = weight_map.get(name)
            raise ConvertError(
                f"{rel}: tensor {name} is not listed in {index_name}"
                if where is None
                else f"{rel}: tensor {name} is stored here but {index_name} says {where}"
            )


#: Header reads in flight at once for a source with no local files (a Hub repository: two range requests a file,
#: each a round trip; one after the other, the released K3's 96 shards cost 192 round trips before any work).
REMOTE_HEADER_READS = 8


def _headers(source: Source, files: list[str]) -> Iterator[tuple[dict[str, TensorInfo], dict[str, str]]]:
    """``read_header`` of each file, in order: one after the other for a local folder (the page cache answers
    at once), ``REMOTE_HEADER_READS`` at a time for a remote source. Either way the first file that fails, in
    file order, is the one named."""
    if source.local_path() is not None or len(files) < 2:
        return (read_header(source, rel) for rel in files)
    from concurrent.futures import ThreadPoolExecutor

    def ordered() -> Iterator[tuple[dict[str, TensorInfo], dict[str, str]]]:
        with ThreadPoolExecutor(REMOTE_HEADER_READS, thread_name_prefix="kimi-convert-header") as pool:
            futs = [pool.submit(read_header, source, rel) for rel in files]
            try:
                for f in futs:
                    yield f.result()
            finally:
                for f in futs:
                    f.cancel()
    return ordered()


def consumed(files: list[str]) -> list[str]:
    """The input files pack reads and writes anew: the shards, ``config.json`` and the index (Mistral's own
    index too, for a Mistral-layout input: its ``params.json`` is copied, as the engines read it)."""
    mistral = bool(files) and all(map(mistral_checkpoint.is_shard, files))
    return [*files, "config.json", INDEX_NAME, *([mistral_checkpoint.INDEX] if mistral else [])]
