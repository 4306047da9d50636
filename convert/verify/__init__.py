"""``verify-manifest``: prove that an output folder is what its manifest says, and, given the input,
that it was derived from it correctly.

Offline, every file is read once, in parallel: one sequential pass per shard computes the file's
digest (its manifest entry's: BLAKE3, or sha256) and every tensor's (the manifest's ``tensor_digest``: BLAKE3,
sha256 in a format_version 3 manifest) from the same bytes. With ``input``, the input files are hashed the
same way, the plan is rebuilt from the input and the recorded options and rules (its hash must equal
the manifest's), pass-through tensors are compared with their sources' bytes, and NVFP4 tensors are
re-quantized from their sources (a deterministic sample, or all with ``full``) and compared byte for
byte.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .. import filenames, journal
from ..devices import Device
from ..errors import ConvertError
from ..manifest import FORMAT, is_v3, load_manifest, tensor_digest
from ..sources import Source, open_source
from .offline import check_offline
from .provenance import check_against_input
from .report import Report

__all__ = ["Report", "load", "verify"]


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
        raise ConvertError(f"{output / filenames.MANIFEST}: not a kimi-convert manifest")
    if not is_v3(man):
        raise ConvertError(f"{output / filenames.MANIFEST}: format_version {man.get('format_version')}, written by a "
                           "kimi-convert before 0.1.0's format 3 (module records in manifest-records/), which this "
                           "version no longer reads: pack the input again")
    tensor_digest(man)  # one this version computes (else: written by a newer one)
    return man


def verify(output: str | Path, input_dir: Source | str | Path | None = None, *, full: bool = False,
           device: str | Device = "cpu", progress: Callable[[int], None] | None = None,
           total: Callable[[int], None] | None = None, hub: bool = False) -> Report:
    """``input_dir``: the input to check OUTPUT against, a ``Source`` or a folder (``sources.open_source``).
    ``hub``: each output file's sha256 as well, from the same read (``Report.sha256``: the remote check's)."""
    output = Path(output)
    man = load(output)
    rep = Report()
    try:
        check_offline(output, man, rep, progress, total, hub)
        if input_dir is not None:
            check_against_input(open_source(input_dir), output, man, rep, full, device, progress, total)
    except (KeyError, TypeError, ValueError) as e:
        rep.check("manifest structure", [f"manifest.json: malformed ({type(e).__name__}: {e})"])
    return rep
