"""Output formats: how a quantized module is stored on disk and described to the engines.

A recipe decides, module by module, a quantization scheme (``nvfp4``, ``fp8-block`` or ``keep``: the plan's
``Kind``; ``convert/schemes``); the recipe's output **format** decides how that is spelled: the tensors a module
becomes and how a unit's computed codes and scales fill them (each scheme's ``Spelling`` for the format: the
functions below spell any scheme through it), the config files the engines read, and how ``verify`` and the
engine-rule check read them back. Each format is one module here, and a new one is one new module plus an entry
in ``FORMATS`` and a spelling in each scheme it writes (and recipes that name it):

* ``modelopt``: NVIDIA Model Optimizer's layout (``weight`` / ``weight_scale`` / ``weight_scale_2`` /
  ``input_scale``, ``hf_quant_config.json``, ``quant_method: modelopt`` or ``modelopt_mixed``).
* ``compressed-tensors``: llm-compressor's (``weight_packed`` / ``weight_scale`` / ``weight_global_scale``,
  ``quant_method: compressed-tensors``, ``format: nvfp4-pack-quantized``), in compressed-tensors' own arithmetic.

Every format module provides what :class:`OutputFormat` lists. Nothing outside this package spells a
format's tensor names or config keys.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Protocol

from .. import schemes
from ..errors import ConvertError
from . import compressed_tensors, modelopt

if TYPE_CHECKING:
    from pathlib import Path

    from ..plan.model import Item, Plan


class OutputFormat(Protocol):
    """What each format module defines (module-level names)."""

    NAME: str
    #: quant_method -> the quant_algo values a recipe of this format may name
    QUANT_METHODS: dict[str, set[str]]
    #: top-level files the format writes besides config.json and the index (pack removes them on
    #: --overwrite, side-file copying skips an input's own)
    CONFIG_FILES: tuple[str, ...]
    CARD_TAGS: tuple[str, ...]
    #: the plan kinds the format can write: the schemes whose module spells them in it (``schemes.spelled_by``)
    KINDS: frozenset[str]
    #: what the format adds to a quantized module's manifest record (its scheme's ``record``)
    RECORD_KEYS: dict

    def config_files(self, config: dict, plan: Plan) -> dict[str, dict]:
        """Every config file the engines read (file name -> JSON), config.json included."""

    def check_configs(self, output: Path, man: dict, read) -> list[str]:
        """What is wrong with the written configs against the manifest (``read(path, problems)``: JSON)."""

    def manifest_layers(self, plan: Plan) -> dict | None:
        """The per-layer quantization map the manifest keeps (None where the config has none)."""

    def card_line(self, recipe: dict) -> str:
        """The model card's words on the layout and the recipe."""


FORMATS: dict[str, OutputFormat] = {modelopt.NAME: modelopt,  # type: ignore[dict-item]
                                   compressed_tensors.NAME: compressed_tensors}
DEFAULT = modelopt.NAME


def get(name: str) -> OutputFormat:
    """The format module named ``name`` (a recipe's ``output_format``, ``pack --format``)."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ConvertError(f"output format {name!r} is not known (known: {', '.join(sorted(FORMATS))})") from None


def config_files() -> tuple[str, ...]:
    """Every format's own top-level config files (what an output may hold besides config.json and the index)."""
    return tuple(dict.fromkeys(f for fmt in FORMATS.values() for f in fmt.CONFIG_FILES))


@functools.lru_cache(maxsize=4096)
def tensor_specs(fmt: str, kind: str, shape: tuple[int, ...], src_dtype: str, input_scale: bool, experts: int = 0
                 ) -> tuple[schemes.TensorSpec, ...]:
    """(name suffix, dtype, shape) of each output tensor of one linear module of ``kind`` in format ``fmt``: its
    scheme's tensors as the format spells them, or the ``weight`` of a kept module (made once per kind and shape:
    a million output tensors share a few dozen shape tuples in the released K3)."""
    if not schemes.quantized(kind):
        return ((".weight", src_dtype, shape),)
    return schemes.tensor_specs(kind, fmt, shape, input_scale, experts)


def outputs(it: Item, parts: dict[str, list]) -> list[tuple[str, list]]:
    """Output tensor name -> its parts (one per source member), from a quantized unit's result by role (the
    scheme's ``roles``: ``codes``, ``scales``, ``global``)."""
    return schemes.outputs(it.kind, it.output_format, tuple(t.name for t in it.outputs), it.input_scale, parts,
                           it.experts)


def record(it: Item, shared_scale: str | None) -> dict | None:
    """The manifest record's ``quantization`` entry of a module (None where it is not quantized): its scheme's
    record under the format's quant_algo, and what the format adds."""
    if not schemes.quantized(it.kind):
        return None
    algo = schemes.spelling(it.kind, it.output_format).algo(it.input_scale)
    return {**schemes.get(it.kind).record(algo, shared_scale, it.input_scale), **get(it.output_format).RECORD_KEYS}
