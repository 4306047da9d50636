"""Exclusion rules: which source shards stay in high precision, decided per shard, never by substring.

A pattern is a shell glob (``*`` crosses dots, as in fnmatch) matched against a source module's
full name, its tensor name (``.weight``), and both without the text prefix (``language_model.``).
A pattern without a dot (``lm_head``, ``v_conv1d``) is matched against each dot-separated part of
the name as a whole, so ``v_conv1d`` excludes every ``v_conv1d`` shard and never ``qkv_conv1d``.
Fused names are not source names: a fused module is kept only when all of its shards are.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

from . import jsonfile, paths
from .errors import ConvertError


@dataclass(frozen=True)
class Pattern:
    text: str
    origin: str  # "default", "--exclude", "FILE:LINE", "hf_quant_config.json"
    reason: str = ""

    def describe(self) -> str:
        why = f": {self.reason}" if self.reason else ""
        return f"{self.origin} {self.text!r}{why}"


def candidate_names(module: str, text_prefix: str) -> list[str]:
    names = [module, module + ".weight"]
    if text_prefix and module.startswith(text_prefix):
        short = module[len(text_prefix) :]
        names += [short, short + ".weight"]
    return names


def matches(pattern: str, module: str, text_prefix: str) -> bool:
    if "." not in pattern:
        return any(fnmatchcase(part, pattern) for part in module.split("."))
    return any(fnmatchcase(n, pattern) for n in candidate_names(module, text_prefix))


def first_match(patterns: list[Pattern], module: str, text_prefix: str) -> Pattern | None:
    return next((p for p in patterns if matches(p.text, module, text_prefix)), None)


def _check(text: str, where: str) -> str:
    text = text.strip()
    if not text:
        raise ConvertError(f"{where}: empty exclusion pattern")
    if any(c.isspace() for c in text):
        raise ConvertError(f"{where}: pattern {text!r} contains white space")
    if text.count("[") != text.count("]"):
        raise ConvertError(f"{where}: pattern {text!r} has an unbalanced '['")
    return text


def from_cli(values: tuple[str, ...]) -> list[Pattern]:
    return [Pattern(_check(v, "--exclude"), "--exclude") for v in values]


def from_file(path: str | Path) -> list[Pattern]:
    """One pattern per line (``#`` comments), or a JSON list, or an hf_quant_config.json / config.json."""
    p = paths.file(path, "an exclude file")
    try:  # a regular file, bounded (a FIFO would block the read forever)
        text = jsonfile.read_bytes(p, str(p), limit=64 << 20).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConvertError(f"{p}: cannot read exclude file: {e}") from None
    if text.lstrip().startswith(("{", "[")):
        obj = jsonfile.loads(text, str(p))
        return [Pattern(_check(v, f"{p}"), str(p)) for v in exclude_list_of(obj, str(p))]
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(Pattern(_check(line, f"{p}:{n}"), f"{p}:{n}"))
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
