"""Where the input's bytes come from: ``protocol`` (the ``Source`` protocol, ``SourceFile``, ``FileEntry``) and
its implementations, one module each: ``local`` (``LocalFolder``, a checkpoint folder) is the first; a Hub
repository (issue 25) is a second module here plus its case in ``open_source``. Nothing above this package
reads the input through a path (``protocol``'s docstring says what a source offers, and the one exception:
``local_path``, for memory maps and for telling the output folder from the input)."""

from __future__ import annotations

import os

from .hub import HubRepo, is_hub_spec, parse_spec
from .local import LocalFile, LocalFolder
from .protocol import EntryKind, FileEntry, ResourceFreeFile, Source, SourceFile

__all__ = ["EntryKind", "FileEntry", "LocalFile", "LocalFolder", "ResourceFreeFile", "Source", "SourceFile",
           "check_spec", "open_source", "provenance", "read_range"]


def read_range(source: Source, rel: str, offset: int, length: int) -> bytes:
    """Bytes [offset, offset + length) of ``rel`` (one open, one read)."""
    with source.open(rel) as f:
        return f.read_range(offset, length)


def check_spec(spec: str | os.PathLike) -> None:
    """The CLI's check of an input argument before any work: a Hub spec's form only (opening it resolves the
    revision, which ``open_source`` does once, in the command), a folder as ``LocalFolder.at`` checks it."""
    if is_hub_spec(spec):
        parse_spec(spec)
        return
    LocalFolder.at(spec)


def open_source(spec: str | os.PathLike | Source) -> Source:
    """The source a user named: a ``Source`` as it is, a folder path as a ``LocalFolder`` (checked: it must be an
    existing folder, ``paths.folder``'s messages). A Hub repository (``hf://OWNER/REPO[@REVISION]``) comes here."""
    if isinstance(spec, Source):
        return spec
    if is_hub_spec(spec):  # (huggingface_hub is imported only when it connects)
        return HubRepo.connect(spec)
    return LocalFolder.at(spec)


def provenance(source: Source) -> dict | None:
    """Where a source's bytes came from, for the plan's output and the manifest: a Hub repository's id, the
    commit its revision resolved to and the revision as asked (``HubRepo.provenance``); None for a local folder,
    whose manifest stays as it was (its inputs' sha256 are its identity)."""
    origin = getattr(source, "provenance", None)
    return origin() if callable(origin) else None
