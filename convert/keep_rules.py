"""The user's exclusion rules: ``--exclude`` values and ``--exclude-from`` files, read into ``KeepRule``s.

Each is a glob read by ``globs.match`` (one semantics for every pattern) and decided per source shard
by ``keep.kept``: a fused module is kept only when all of its shards are (fused names are not source names).
"""

from __future__ import annotations

from pathlib import Path

from . import jsonfile, paths
from .errors import ConvertError
from .globs import check
from .vocabulary import KeepRule


def from_cli(values: tuple[str, ...]) -> list[KeepRule]:
    return [KeepRule(check(v, "--exclude"), "--exclude") for v in values]


def from_file(path: str | Path) -> list[KeepRule]:
    """One pattern per line (``#`` comments), or a JSON list, or an hf_quant_config.json / config.json."""
    p = paths.file(path, "an exclude file")
    try:  # a regular file, bounded (a FIFO would block the read forever)
        text = jsonfile.read_bytes(p, str(p), limit=64 << 20).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConvertError(f"{p}: cannot read exclude file: {e}") from None
    if text.lstrip().startswith(("{", "[")):
        obj = jsonfile.loads(text, str(p))
        return [KeepRule(check(v, f"{p}"), str(p)) for v in exclude_list_of(obj, str(p))]
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(KeepRule(check(line, f"{p}:{n}"), f"{p}:{n}"))
    return out


def exclude_list_of(obj: object, where: str) -> list[str]:
    """The exclude list of a JSON list, an hf_quant_config.json or a config.json quantization_config."""
    if isinstance(obj, list):
        values = obj
    elif isinstance(obj, dict):
        q = obj.get("quantization", obj.get("quantization_config", obj))
        values = q.get("exclude_modules", q.get("ignore", [])) if isinstance(q, dict) else None
    else:
        values = None
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise ConvertError(f"{where}: no list of module patterns (exclude_modules or ignore) found")
    return values
