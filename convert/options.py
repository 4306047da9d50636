"""The options of ``plan`` and ``pack``, defined once.

:class:`Options` is the one definition: each field carries its command-line flag, help, metavar and
value type (as data: choices, a size, a scale, a path check) in its metadata, and everything else is derived
from the fields, in their order:

- ``clioptions.click_options``, the decorator that adds the flags to ``plan`` and ``pack`` and hands the
  command one ``opts: Options`` (``Options.from_cli`` of the flags' values);
- :meth:`Options.to_dict`, the manifest's ``options`` (every field marked ``manifest``, in field
  order: the JSON, and so the manifest's bytes, follow from this class);
- :meth:`Options.from_dict`, what ``verify-manifest --input`` re-plans with (an older manifest's
  missing keys take their defaults).

``mapping`` and ``strict`` are options of the run, not recorded under ``options`` (the manifest
records the mapping table itself; ``--strict`` only turns warnings into errors): they are left out of
the manifest dict and out of equality, so an ``Options`` equals the one read back from its manifest.

A bool field is a flag: default False, ``--name`` sets it; default True, its flag (``--no-...``)
clears it. A tuple field is a repeatable option; it is a list in the manifest.

A leaf: this module imports nothing of the package and not click (``clioptions`` makes the flags), so the
plan, which records an ``Options``, never loads the command line's library.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

DEFAULT_MAX_SHARD = 5 * 1000**3
LAYOUTS = ("source", "sglang", "vllm")


def _opt(default, help: str, *, flag: str | None = None, metavar: str | None = None,
         type: str | tuple[str, ...] | None = None, show_default: str | bool | None = None,
         check: tuple[str, str] | None = None, manifest: bool = True, omit_none: bool = False) -> Any:
    """A field of :class:`Options` and how the command line and the manifest spell it. ``type``: the value's
    choices (a tuple), ``"size"`` (a byte count: 5GB, 2GiB) or ``"scale"`` (a positive F32 scale); ``check``:
    (the name of a ``paths`` check, what the value is), run on the value before any work; ``omit_none``: left
    out of the manifest while unset (None, or a flag's False), so manifests made before the option existed keep
    their bytes. Plain data, read by ``clioptions``."""
    meta = {"help": help, "flag": flag, "metavar": metavar, "type": type, "show_default": show_default,
            "check": check, "manifest": manifest, "omit_none": omit_none}
    return field(default=default, compare=manifest, metadata=meta)


@dataclass(frozen=True)
class Options:
    """What ``plan`` and ``pack`` were asked; field order is the manifest's key order."""

    mapping: str | None = _opt(
        None, "Architecture table (default: chosen from config.json).", metavar="NAME|FILE", manifest=False)
    recipe: str | None = _opt(
        None, "What is quantized how: nvidia-k3 (the default for Kimi K3), nvfp4-w4a16 (the default otherwise), "
              "or a recipe file.", metavar="NAME|FILE")
    format: str | None = _opt(
        None, "Output format, replacing the recipe's output_format: modelopt (the default) or compressed-tensors "
              "(llm-compressor's nvfp4-pack-quantized, in compressed-tensors' own arithmetic).",
        type=("modelopt", "compressed-tensors"), omit_none=True)
    layout: str = _opt(
        "source", "source: the input's tensor names and files (loads in vLLM and SGLang); sglang / vllm: that "
                  "engine's packed modules fused on disk where its loader takes them (that engine only; for K3 in "
                  "vLLM, vllm is the layout it reads right).", type=LAYOUTS, show_default=True)
    input_scale: float | None = _opt(
        None, "Replace the recipe's constant activation input_scale (nvidia-k3: 1.0).", metavar="X",
        type="scale")
    exclude: tuple[str, ...] = _opt(
        (), "Keep source modules matching GLOB in high precision (repeatable).", metavar="GLOB")
    exclude_from: tuple[str, ...] = _opt(
        (), "Patterns from FILE: one per line, a JSON list, or an hf_quant_config.json.", metavar="FILE",
        check=("file", "an exclude file"))
    default_excludes: bool = _opt(
        True, "Do not apply the mapping's default recipe.", flag="--no-default-excludes")
    keep_partial: bool = _opt(
        False, "Keep a fused module (or MoE layer) whole in high precision when only some of its shards are "
               "excluded.")
    quantize_mtp: bool = _opt(
        False, "Quantize the MTP (speculative-decoding draft) layers by the recipe where every engine's draft model "
               "builds them quantized; by default they are kept as the source stores them wherever a draft cannot "
               "take them quantized.", omit_none=True)
    max_shard_size: int = _opt(
        DEFAULT_MAX_SHARD, "Largest output shard, e.g. 5GB, 500MB.", type="size", show_default="5GB")
    fuse: tuple[str, ...] = _opt((), "Enable an opt-in fused group of the mapping.", metavar="GROUP")
    no_fuse: tuple[str, ...] = _opt((), "Do not build this fused group.", metavar="GROUP")
    strict: bool = _opt(
        False, "Warnings are errors: a mapping for another architecture, a mapping entry or an exclusion "
               "pattern that matches no module of the input.", manifest=False)

    @classmethod
    def from_cli(cls, kw: dict[str, Any]) -> Options:
        """From the values of :func:`click_options`' flags (keyed by field name; other keys ignored)."""
        return cls(**{f.name: tuple(kw[f.name]) if isinstance(f.default, tuple) else kw[f.name]
                      for f in fields(cls) if f.name in kw})

    def to_dict(self) -> dict[str, Any]:
        """The manifest's ``options``."""
        out = {}
        for f in fields(self):
            if f.metadata["manifest"]:
                v = getattr(self, f.name)
                if f.metadata["omit_none"] and (v is None or v is False):
                    continue
                out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Options:
        """From a manifest's ``options``: a key an older manifest lacks takes its default."""
        return cls(**{f.name: tuple(d[f.name]) if isinstance(f.default, tuple) else d[f.name]
                      for f in fields(cls) if f.metadata["manifest"] and f.name in d})
