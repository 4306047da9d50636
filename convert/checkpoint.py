"""A checkpoint folder: config.json, the shard index and every shard's header (no tensor data)."""

from __future__ import annotations

import contextlib
import gc
import os
from dataclasses import dataclass, field
from itertools import repeat
from operator import eq
from pathlib import Path

from . import paths
from .errors import ConvertError
from .jsonfile import read_json, regular_file_error, resolve
from .safetensors_format import TensorInfo, parse_header
from .sidefiles import Skipped, scan

INDEX_NAME = "model.safetensors.index.json"


def load_json(path: Path, rel: str) -> dict:
    """A JSON object file of the input (config.json, the index): ``jsonfile.read_json``'s rules (a regular
    file, bounded, depth-safe), every fault one line naming ``rel``."""
    return read_json(path, rel)


def _inside(folder: Path, rel: str, what: str) -> Path:
    """Resolve ``rel`` under ``folder``; refuse ``..`` and paths or symlinks that end outside it, and
    anything but a regular file. An absolute path is taken when it resolves inside the folder (an index
    written with the download's absolute paths), as is any symlink that stays inside."""
    if any(p == ".." for p in Path(rel).parts):
        raise ConvertError(f"{what}: file {rel!r} has a '..' part: outside the input folder, "
                           "where the index must name files")
    path = Path(rel) if os.path.isabs(rel) else folder / rel
    real = resolve(path, f"{what}: file {rel!r}")
    root = resolve(folder, str(folder))
    if not real.is_relative_to(root):
        raise ConvertError(f"{what}: file {rel!r} resolves outside the input folder {root} (to {real})")
    if not os.path.lexists(path):
        raise ConvertError(f"{what}: names missing file {rel!r}")
    why = regular_file_error(path)
    if why is not None:
        raise ConvertError(f"{what}: file {rel!r} {why}, expected a safetensors file")
    return path


def _relative_index(folder: Path, weight_map: dict[str, str], files: list[str]) -> tuple[dict[str, str], list[str]]:
    """An index whose files are named by absolute paths (written where the download lived): each one that
    resolves inside ``folder`` is renamed to its path relative to it, so the plan, the output's index and
    the manifest name files as every other index does; one that does not is refused by ``_inside``."""
    root = resolve(folder, str(folder))
    renamed = {}
    for f in files:
        if os.path.isabs(f):
            _inside(folder, f, INDEX_NAME)
            for base in (root, Path(os.path.abspath(folder))):  # the name as given, else where it resolves
                if Path(os.path.normpath(f)).is_relative_to(base):
                    renamed[f] = Path(os.path.normpath(f)).relative_to(base).as_posix()
                    break
            else:
                renamed[f] = resolve(Path(f), f).relative_to(root).as_posix()
    return ({k: renamed.get(v, v) for k, v in weight_map.items()},
            list(dict.fromkeys(renamed.get(f, f) for f in files)))


@dataclass
class Checkpoint:
    """A checkpoint folder's headers and config: everything the plan needs, no tensor data."""

    folder: Path
    config: dict
    files: list[str]  # shard files in index order
    tensors: dict[str, TensorInfo]  # every stored tensor by name
    file_sizes: dict[str, int] = field(default_factory=dict)
    side_files: list[str] = field(default_factory=list)  # non-weight files to copy (sidefiles.scan)
    has_index: bool = False
    side_folders: list[str] = field(default_factory=list)  # empty folders to recreate
    skipped_files: list[Skipped] = field(default_factory=list)  # input files not copied, with the reason

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


@contextlib.contextmanager
def gc_paused():
    """Pause the cyclic garbage collector while many small objects are made (headers, the plan): its
    collections, triggered by allocation counts, walk every live object again and again (measured on the
    released K3's 500,000 tensors: half the time of reading the headers). The objects made hold no cycles."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@gc_paused()
def open_checkpoint(folder: str | os.PathLike, need_weights: bool = True) -> Checkpoint:
    """Read config.json, the index and every shard header of ``folder`` (no tensor data)."""
    folder = paths.folder(folder)
    config = load_json(folder / "config.json", f"{folder}/config.json")
    index_path = folder / INDEX_NAME
    tensors: dict[str, TensorInfo] = {}
    files: list[str]
    weight_map: dict[str, str] | None = None
    if os.path.lexists(index_path):  # a dangling link or a symlink loop is refused by the reader, not ignored
        index = load_json(index_path, INDEX_NAME)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not (
            all(map(isinstance, weight_map, repeat(str))) and all(map(isinstance, weight_map.values(), repeat(str)))
        ):
            raise ConvertError(f"{INDEX_NAME}: weight_map is not a map of tensor name to file")
        if not weight_map and need_weights:
            raise ConvertError(f"{INDEX_NAME}: weight_map is empty: the index names no tensor (a checkpoint with "
                               "weights lists each one; remove the index if the shards are to be read without it)")
        files = list(dict.fromkeys(weight_map.values()))
        if any(map(os.path.isabs, files)):
            weight_map, files = _relative_index(folder, weight_map, files)
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files and need_weights:
            raise ConvertError(f"{folder}: no *.safetensors files and no {INDEX_NAME}")
    # Every named file must exist inside the folder before any header is read: a missing or
    # escaping file is the more useful error than the tensors it leaves unaccounted for.
    shard_paths = {rel: _inside(folder, rel, INDEX_NAME if weight_map is not None else str(folder)) for rel in files}
    sizes: dict[str, int] = {}
    for rel, path in shard_paths.items():
        sizes[rel] = path.stat().st_size
        found, _meta = parse_header(path, rel)
        # checked in bulk (the released K3 has 500,000 names); a fault is found and named by the loop below.
        # With an index, every name listed for this file is in no other (it was listed for that one).
        if (found.keys().isdisjoint(tensors.keys()) if weight_map is None
                else all(map(eq, map(weight_map.get, found), repeat(rel)))):
            tensors.update(found)
            continue
        for name, info in found.items():
            if name in tensors:
                raise ConvertError(f"{rel}: tensor {name} is also stored in {tensors[name].file}")
            if weight_map is not None and weight_map.get(name) != rel:
                where = weight_map.get(name)
                raise ConvertError(
                    f"{rel}: tensor {name} is not listed in {INDEX_NAME}"
                    if where is None
                    else f"{rel}: tensor {name} is stored here but {INDEX_NAME} says {where}"
                )
            tensors[name] = info
    if weight_map is not None and len(tensors) != len(weight_map):  # every stored tensor is listed: equal sets
        for name, rel in weight_map.items():
            if name not in tensors:
                raise ConvertError(f"{INDEX_NAME}: tensor {name} is not in {rel}")
    side = scan(folder, consumed(files))
    return Checkpoint(folder, config, files, tensors, sizes, list(side.copied), weight_map is not None,
                      list(side.folders), list(side.skipped))


def consumed(files: list[str]) -> list[str]:
    """The input files pack reads and writes anew: the shards, ``config.json`` and the index."""
    return [*files, "config.json", INDEX_NAME]
