"""Side files: what of the input tree (a ``Source``'s listing), besides the weights the plan reads, goes
into the output.

One function (``scan``) decides it for pack (which copies), plan (which shows it), the manifest (which
records it) and ``verify-manifest --input`` (which re-derives it from the input and checks that
nothing was dropped silently). Every file or folder of the input tree ends up in exactly one place:

- read by the plan (a weight shard), or rewritten by pack (the top-level ``config.json`` and index);
- copied byte for byte (``copied``; a symlink to a file inside the input is copied as its content),
  or recreated (``folders``: empty folders, which a sentence-transformers model needs on disk);
- skipped, with the reason (``skipped``), listed in the manifest and printed by pack and plan.

Anything else, a symlink that leaves the input folder, dangles or names a folder, is refused: copying
it could publish a file from elsewhere, dropping it would lose part of the model.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from . import filenames, formats, journal
from .errors import ConvertError
from .sources import EntryKind, FileEntry, Source, open_source
from .vocabulary import Skipped

#: Folders never descended into, at any depth (the Hub itself refuses .git/ and .cache/ folders).
SKIP_DIRS = {
    ".git": "version control",
    ".hg": "version control",
    ".svn": "version control",
    ".cache": "download cache (huggingface_hub's metadata)",
    "__pycache__": "Python bytecode cache",
}

#: Top-level files the output writes itself and pack does not read: skipped.
OWN_TOP = {**dict.fromkeys(formats.config_files(), "the output writes its own"),
           filenames.MANIFEST: "the output writes its own",
           filenames.RECORDS_DIR: "the output writes its own (a folder of manifest records)"}
#: Top-level folders the output writes itself (the manifest's per-shard records): skipped whole.
OWN_TOP_DIRS = {filenames.RECORDS_DIR: "the output writes its own (manifest records)"}

#: Weight formats. Such a file that the plan does not read (a safetensors file the index does not
#: list, ``consolidated.safetensors``, ``pytorch_model-*.bin``, ``original/*.pth``, an ONNX export)
#: is skipped, not copied and not refused: copying it would put unconverted (often full-size BF16)
#: weights next to the NVFP4 ones, on disk and on the Hub, and no loader reads them from there;
#: refusing would block the many repos that ship a second format beside the safetensors shards.
#: The skip is listed in the manifest and printed, so a needed one (a sentence-transformers
#: ``2_Dense/model.safetensors`` head) can be copied by hand.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx")


@dataclass(frozen=True)
class SideFiles:
    copied: tuple[str, ...] = ()  # relative paths, forward slashes, sorted
    folders: tuple[str, ...] = ()  # empty folders recreated in the output
    skipped: tuple[Skipped, ...] = field(default_factory=tuple)


def posix(rel: Path | str) -> str:
    """The manifest's spelling of a relative path: forward slashes, no ``./``."""
    return PurePosixPath(Path(rel).as_posix()).as_posix()


def pruned(rel: str) -> bool:
    """Whether a folder's contents are never listed: a skipped folder (``SKIP_DIRS`` at any depth, the output's
    own ``OWN_TOP_DIRS`` at the top), which can hold millions of files."""
    name = PurePosixPath(rel).name
    return name in SKIP_DIRS or ("/" not in rel and name in OWN_TOP_DIRS)


def scan(source: Source | str | os.PathLike, consumed: Iterable[str], entries: list[FileEntry] | None = None
         ) -> SideFiles:
    """Classify every entry of ``source`` (sub-folders included, symlinks not followed); ``consumed``:
    the files pack reads and writes anew (the shards the plan reads, the top-level ``config.json`` and
    index; ``checkpoint.consumed``), relative to the source. Reads names and link targets, no data: a
    sub-folder's ``config.json`` (``1_Pooling/config.json``) is not the model's, and is copied. ``entries``:
    the source's listing (``list_files(prune=pruned)``) when the caller has it already. An entry the source
    refuses to serve (``FileEntry.refusal``: a symlink out of the folder, dangling, or to a folder) is refused
    here unless it is skipped anyway, in the listing's order (the first such entry is the one named). A folder
    path is read as a ``LocalFolder``."""
    consumed = {posix(w) for w in consumed}
    source = open_source(source)
    entries = source.list_files(prune=pruned) if entries is None else entries
    parents = {PurePosixPath(e.rel).parent.as_posix() for e in entries}
    copied: list[str] = []
    folders: list[str] = []
    skipped: list[Skipped] = []
    for e in entries:
        rel = e.rel
        if e.kind is EntryKind.FOLDER:
            name = PurePosixPath(rel).name
            if name in SKIP_DIRS:
                skipped.append(Skipped(rel + "/", SKIP_DIRS[name]))
            elif "/" not in rel and name in OWN_TOP_DIRS:
                skipped.append(Skipped(rel + "/", OWN_TOP_DIRS[name]))
            elif e.refusal is not None:
                raise ConvertError(e.refusal)
            elif rel not in parents:
                folders.append(rel)
            continue
        if rel in consumed:
            continue
        reason = skip_reason(rel, e)
        if reason:
            skipped.append(Skipped(rel, reason))
        else:
            if e.refusal is not None:
                raise ConvertError(e.refusal)
            copied.append(rel)
    return SideFiles(tuple(sorted(copied)), tuple(sorted(folders)), tuple(sorted(skipped, key=lambda s: s.file)))


def skip_reason(rel: str, entry: FileEntry) -> str | None:
    """Why an input file (not a weight the plan reads) is not copied; None: it is copied."""
    name = PurePosixPath(rel).name
    top = "/" not in rel
    if name.endswith(".partial"):
        return "an unfinished write (.partial)"
    if name == journal.NAME:
        return "a resume journal of kimi-convert"
    if name == journal.LOCK:
        return "the lock of a running (or killed) kimi-convert pack"
    if top and name in OWN_TOP:
        return OWN_TOP[name]
    if name == ".git":  # a submodule's or worktree's pointer file
        return "version control"
    suffix = PurePosixPath(name).suffix.lower()
    if suffix in WEIGHT_SUFFIXES:
        return "unconverted weights: not among the shards pack reads"
    if entry.kind is EntryKind.BROKEN:
        return None  # a dangling symlink or a symlink loop: its refusal is raised
    # the rule every input file is read by (jsonfile.open_regular): the source says what else it is
    return None if entry.kind is EntryKind.FILE else f"not a regular file (it {(entry.why or '').removeprefix('is ')})"


def summary(skipped: Iterable[Skipped], most: int = 3) -> str:
    """One line: ``skipped N input files: a, b (reason); c/ (reason)``; at most ``most`` names a reason."""
    skipped = list(skipped)
    by_reason: dict[str, list[str]] = {}
    for s in skipped:
        by_reason.setdefault(s.reason, []).append(s.file)
    parts = []
    for reason, names in by_reason.items():
        more = f" and {len(names) - most} more" if len(names) > most else ""
        parts.append(f"{', '.join(names[:most])}{more} ({reason})")
    noun = "file" if len(skipped) == 1 else "files"
    return f"skipped {len(skipped)} input {noun}: " + "; ".join(parts)


def render(copied: Iterable[str], folders: Iterable[str], skipped: Iterable[Skipped]) -> list[str]:
    """``plan``'s lines: each side file copied, each empty folder recreated, the skipped files."""
    copied, folders, skipped = list(copied), list(folders), list(skipped)
    lines = ["", f"side files copied as they are: {len(copied)}"
             + (f"; empty folders recreated: {', '.join(f + '/' for f in folders)}" if folders else "")]
    lines += [f"  {f}" for f in copied]
    if skipped:
        lines.append(summary(skipped, most=len(skipped)))
    return lines
