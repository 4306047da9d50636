"""Write stage: shard files streamed from the plan's headers, the index, configs, side files.

The safetensors library cannot write a file incrementally (``save_file`` needs every tensor in
memory to build the header), so shards are written here: the header computed by the plan first,
then each tensor's bytes at the offset the plan gave it. Every file is written under a temporary
name and renamed into place once complete and flushed, and the manifest is written last, so a
folder without its manifest is never mistaken for a finished checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from . import __version__, faults, journal, paths
from .errors import ConvertError
from .hashing import Stopped
from .plan import FP8, GROUP_SIZE, NVFP4, Placed, Plan, Shard, aliases, expert_regexes
from .source import INDEX_NAME

if TYPE_CHECKING:
    from .compute import Chunk

PARTIAL = ".partial"
CHUNK = 16 << 20

#: Files a previous run of pack may have left, removed by --overwrite (nothing else is touched).
OWN_FILES = ("manifest.json", INDEX_NAME, "config.json", "hf_quant_config.json", journal.NAME)


def check_output_dir(input_dir: Path, output_dir: Path) -> None:
    """Where the output may go (whether it may be non-empty is the journal's business)."""
    src, dst = input_dir.resolve(), output_dir.resolve()
    if dst == src or dst.is_relative_to(src):
        raise ConvertError(f"{output_dir}: the output folder must not be the input folder or inside it")
    if src.is_relative_to(dst):
        raise ConvertError(f"{output_dir}: the output folder must not contain the input folder")
    paths.output_folder(output_dir)


def own_files_only(output_dir: Path, side_files: tuple[str, ...]) -> bool:
    """Whether every file in the folder is one pack writes (so starting afresh loses nothing)."""
    side = set(side_files)
    for p in output_dir.rglob("*"):
        if p.is_dir() and not p.is_symlink():
            continue
        top = p.parent == output_dir and (p.name.endswith(".safetensors") or p.name in OWN_FILES)
        if not (top or p.name.endswith(PARTIAL) or p.relative_to(output_dir).as_posix() in side):
            return False
    return True


def clear_previous(output_dir: Path, side_files: tuple[str, ...]) -> None:
    """Remove what an earlier pack wrote (shards, index, configs, manifest, side files: this plan's
    and those the previous manifest lists, which another input may have had), nothing else."""
    previous = previous_side_files(output_dir)
    for p in output_dir.iterdir():
        if p.is_file() and (p.name.endswith((".safetensors", PARTIAL)) or p.name in OWN_FILES):
            p.unlink()
    for rel in dict.fromkeys([*side_files, *previous]):
        p = output_dir / rel
        if p.is_file() or p.is_symlink():
            p.unlink()


def previous_side_files(output_dir: Path) -> list[str]:
    """The side files an earlier manifest in ``output_dir`` lists (relative paths inside it only:
    the manifest is not trusted to name a file elsewhere); [] without a readable one."""
    try:
        man = load_manifest(output_dir)
    except ConvertError:
        return []
    entries = man.get("side_files")
    names = [e.get("file") if isinstance(e, dict) else e for e in entries] if isinstance(entries, list) else []
    return [n for n in names if isinstance(n, str) and is_inside(n)]


def is_inside(rel: str) -> bool:
    """A relative path that stays inside the folder it is joined to (no absolute path, no ``..``)."""
    return bool(rel) and not PurePosixPath(rel).is_absolute() and ".." not in PurePosixPath(rel).parts


class ShardWriter:
    """Writes one shard: header first, then each tensor's chunks at its planned offset.

    The file's space is reserved up front (posix_fallocate), so a full disk fails at the start of a
    shard rather than in the middle of one; every OS error names the file.
    """

    def __init__(self, output_dir: Path, shard: Shard):
        self.shard = shard
        self.final = output_dir / shard.file
        self.tmp = output_dir / (shard.file + PARTIAL)
        self.fd = -1
        try:
            # 0o666 less the umask, as open(..., "w") gives every other file of the output
            self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
            if hasattr(os, "posix_fallocate") and shard.size:
                os.posix_fallocate(self.fd, 0, shard.size)
            else:
                os.ftruncate(self.fd, shard.size)
        except OSError as e:
            self.abort()
            raise self._error(e) from None
        half = len(shard.header) // 2
        self._pwrite(shard.header[:half], 0)
        faults.point("header")
        self._pwrite(shard.header[half:], half)
        self.placed = {p.tensor.name: p for p in shard.placed}
        self.written: dict[str, int] = {}

    def _error(self, e: OSError) -> ConvertError:
        return ConvertError(f"{self.tmp}: cannot write: {e.strerror or e}; the finished shards are kept, "
                            "rerun with --resume once it is fixed")

    def _pwrite(self, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        try:
            while view:
                n = os.pwrite(self.fd, view, offset)
                view, offset = view[n:], offset + n
        except OSError as e:
            raise self._error(e) from None

    def write(self, name: str, chunks: list[Chunk], offset: int = 0) -> None:
        """Write ``chunks`` back to back into tensor ``name``, from ``offset`` bytes into it."""
        p: Placed = self.placed[name]
        pos = p.start + offset
        for c in chunks:
            view = memoryview(c).cast("B")
            n = view.nbytes
            if pos + n > p.end:
                raise ConvertError(f"{self.shard.file}: tensor {name}: {pos + n - p.start} bytes, "
                                   f"planned {p.end - p.start}")
            self._pwrite(view[: n // 2], pos)
            faults.point("tensor")
            self._pwrite(view[n // 2 :], pos + n // 2)
            pos += n
        self.written[name] = self.written.get(name, 0) + pos - p.start - offset

    def finish(self) -> None:
        """Check every planned byte was written, flush, and move the file to its final name."""
        for name, p in self.placed.items():
            if self.written.get(name, 0) != p.end - p.start:
                self.abort()
                raise ConvertError(f"{self.shard.file}: tensor {name}: wrote {self.written.get(name, 0)} bytes, "
                                   f"planned {p.end - p.start}")
        try:
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1
            os.replace(self.tmp, self.final)
        except OSError as e:
            raise self._error(e) from None

    def abort(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


def dumps(obj: dict, compact_lists: tuple[str, ...] = ()) -> str:
    """Indented JSON, except that the lists named in ``compact_lists`` hold one compact entry a line
    (a real K3 manifest has ~250k modules: indenting each would make it several hundred MB)."""
    if not compact_lists:
        return json.dumps(obj, indent=2) + "\n"
    parts = []
    for k, v in obj.items():
        if k in compact_lists and isinstance(v, list):
            body = ",\n".join("    " + json.dumps(x, separators=(",", ":")) for x in v)
            parts.append(f"  {json.dumps(k)}: [\n{body}\n  ]")
        else:
            parts.append(f"  {json.dumps(k)}: " + json.dumps(v, indent=2).replace("\n", "\n  "))
    return "{\n" + ",\n".join(parts) + "\n}\n"


def write_json_atomic(path: Path, obj: dict, compact_lists: tuple[str, ...] = ()) -> None:
    tmp = path.with_name(path.name + PARTIAL)
    text = dumps(obj, compact_lists)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text[: len(text) // 2])
            faults.point("json")
            f.write(text[len(text) // 2 :])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise ConvertError(f"{tmp}: cannot write: {e.strerror or e}") from None


def index_json(plan: Plan) -> dict:
    weight_map = {p.tensor.name: s.file for s in plan.shards for p in s.placed}
    total = sum(p.tensor.nbytes for s in plan.shards for p in s.placed)
    return {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}


def producer() -> dict:
    return {"name": "kimi-convert", "version": __version__}


def layer_algo(kind: str, input_scale: float | None) -> str:
    """ModelOpt's quant_algo of one module: NVFP4 with a (constant) input_scale is W4A4."""
    if kind == FP8:
        return "FP8_PB_WO"
    return "NVFP4" if input_scale is not None else "W4A16_NVFP4"


def quantized_layers(plan: Plan) -> dict[str, dict]:
    """MIXED_PRECISION's per-layer map: each quantized module (a MoE layer's experts as one bank),
    and each engine packed module whose members share one format, in every spelling the recipe asks for."""
    m, rec = plan.mapping, plan.recipe
    entry: dict[str, dict] = {}
    kind_of: dict[str, tuple[str, float | None]] = {}
    banks = expert_regexes(m)
    for it in plan.items:
        if it.kind not in (NVFP4, FP8):
            continue
        kind_of[it.name] = (it.kind, it.input_scale)
        name = it.name.rsplit(".", 2)[0] if any(rx.fullmatch(m.strip(it.name)) for rx in banks) else it.name
        entry[name] = _algo_entry(it.kind, it.input_scale)
    for g in plan.engine_groups:
        if any(rx.fullmatch(m.strip(mod)) for mod in g.members for rx in banks):
            continue  # a MoE layer's experts are named once, as their bank
        kinds = {kind_of.get(mod) for mod in g.members}
        if len(kinds) == 1 and None not in kinds:
            entry[g.name] = _algo_entry(*kinds.pop())
    return {a: e for name, e in sorted(entry.items()) for a in aliases(name, rec.aliases)}


def _algo_entry(kind: str, input_scale: float | None) -> dict:
    algo = layer_algo(kind, input_scale)
    return {"quant_algo": algo} if kind == FP8 else {"quant_algo": algo, "group_size": GROUP_SIZE}


def hf_quant_config(plan: Plan) -> dict:
    q: dict = {"quant_algo": plan.recipe.quant_algo, "kv_cache_quant_algo": None, "group_size": GROUP_SIZE}
    if plan.recipe.quant_method == "modelopt_mixed":
        q["quantized_layers"] = quantized_layers(plan)
    q["exclude_modules"] = list(plan.exclude_modules)
    return {"producer": producer(), "quantization": q}


def _group_config(algo: str) -> dict:
    """ModelOpt's compressed-tensors-style config group of one quant_algo (its convert_hf_config;
    written here because ModelOpt is not a dependency of this tool)."""
    weights = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": GROUP_SIZE}
    if algo == "NVFP4":
        return {"input_activations": dict(weights), "weights": weights}
    if algo == "W4A16_NVFP4":
        return {"weights": weights}
    return {"quant_algo": algo}


def output_config(config: dict, plan: Plan) -> dict:
    """The input's config.json with its quantization_config (also the one nested in the text config,
    which a loader would otherwise read the NVFP4 experts by, as MXFP4) replaced by the recipe's."""
    out = dict(config)
    key = plan.mapping.text_config
    if key and isinstance(out.get(key), dict):
        out[key] = {k: v for k, v in out[key].items() if k != "quantization_config"}
    hq = hf_quant_config(plan)["quantization"]
    q: dict = {}
    if "quantized_layers" in hq:
        by_algo: dict[str, list[str]] = defaultdict(list)
        for name, e in hq["quantized_layers"].items():
            by_algo[json.dumps(sorted(e.items()))].append(name)
        q["config_groups"] = {f"group_{i}": {**_group_config(dict(json.loads(k))["quant_algo"]), "targets": sorted(v)}
                              for i, (k, v) in enumerate(by_algo.items())}
        q["quantized_layers"] = hq["quantized_layers"]
    else:
        q["config_groups"] = {"group_0": {**_group_config(hq["quant_algo"]), "targets": ["Linear"]}}
        q["group_size"] = GROUP_SIZE
        q["kv_cache_quant_algo"] = None
    q["ignore"] = hq["exclude_modules"]
    q["quant_algo"] = hq["quant_algo"]
    q["producer"] = producer()
    q["quant_method"] = plan.recipe.quant_method
    out["quantization_config"] = q
    return out


@dataclass(frozen=True)
class FileRecord:
    """A file of the output other than a shard, as the manifest lists it."""

    file: str  # relative path, forward slashes
    size: int
    sha256: str

    def to_dict(self) -> dict:
        return {"file": self.file, "size": self.size, "sha256": self.sha256}


def record(output_dir: Path, rel: str) -> FileRecord:
    path = output_dir / rel
    return FileRecord(rel, path.stat().st_size, sha256_file(path))


def copy_side_files(input_dir: Path, output_dir: Path, side_files: tuple[str, ...],
                    folders: tuple[str, ...] = ()) -> list[FileRecord]:
    """Copy each side file byte for byte (a symlink as its target's content) and recreate the empty
    folders; the records hash the bytes written, in the same pass."""
    for rel in folders:
        _mkdir(output_dir / _inside(rel))
    return [copy_file(input_dir / _inside(rel), output_dir / rel, rel) for rel in side_files]


def _inside(rel: str) -> str:
    """Side-file paths come from walking the input, so they are relative; a guard, not a check."""
    if not is_inside(rel):
        raise ConvertError(f"side file {rel!r}: not a relative path inside the folder")
    return rel


def _mkdir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConvertError(f"{path}: cannot create: {e.strerror or e}") from None


def copy_file(src: Path, dst: Path, rel: str) -> FileRecord:
    """Atomic like the shards: written under a temporary name, hashed as written, flushed, renamed."""
    tmp = dst.with_name(dst.name + PARTIAL)
    _mkdir(dst.parent)
    h, size = hashlib.sha256(), 0
    try:
        with open(src, "rb") as fi, open(tmp, "wb") as fo:
            while block := fi.read(CHUNK):
                h.update(block)
                fo.write(block[: len(block) // 2])
                faults.point("side")
                fo.write(block[len(block) // 2 :])
                size += len(block)
            fo.flush()
            os.fsync(fo.fileno())
        os.replace(tmp, dst)
    except OSError as e:
        raise ConvertError(f"{e.filename or dst}: cannot copy {rel}: {e.strerror or e}") from None
    return FileRecord(rel, size, h.hexdigest())


def default_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file: 0o666 less the umask. (For files a library
    writes with another mode: safetensors' ``save_file`` makes them 0o600.) The umask is read from
    /proc where it can be, so that no other thread ever creates a file under a borrowed one."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def load_manifest(output_dir: Path) -> dict:
    path = output_dir / "manifest.json"
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConvertError(f"{path}: unreadable ({e})") from None
    if not isinstance(obj, dict):
        raise ConvertError(f"{path}: not a JSON object")
    return obj


def hash_file(path: Path, ranges: dict[str, tuple[int, int]], progress: Callable[[int], None] | None = None,
              stop: threading.Event | None = None) -> tuple[str, int, dict[str, str]]:
    """sha256 of the file and of each byte range (contiguous, non-overlapping), in one sequential read;
    a stop request ends it within one chunk."""
    fh = hashlib.sha256()
    order = sorted(ranges.items(), key=lambda kv: kv[1])
    th = {name: hashlib.sha256() for name in ranges}
    pos, i = 0, 0
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            if stop is not None and stop.is_set():
                raise Stopped(str(path))
            fh.update(block)
            end = pos + len(block)
            while i < len(order) and order[i][1][0] < end:
                name, (a, b) = order[i]
                lo, hi = max(a, pos), min(b, end)
                if hi > lo:
                    th[name].update(memoryview(block)[lo - pos : hi - pos])
                if b <= end:
                    i += 1
                else:
                    break
            pos = end
            if progress:
                progress(len(block))
    return fh.hexdigest(), pos, {n: h.hexdigest() for n, h in th.items()}


def sha256_file(path: Path, stop: threading.Event | None = None) -> str:
    return hash_file(path, {}, stop=stop)[0]
