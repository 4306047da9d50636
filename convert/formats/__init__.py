"""Output formats: how a quantized module is stored on disk and described to the engines.

A recipe decides, module by module, a quantization (``nvfp4``, ``fp8-block`` or ``keep``: the plan's
``Kind``); the recipe's output **format** decides how that is spelled: the tensors a module becomes,
how a unit's computed codes and scales fill them, the config files the engines read, and how ``verify``
and the engine-rule check read them back. Each format is one module here, and a new one is one new module
plus an entry in ``FORMATS`` (and recipes that name it):

* ``modelopt``: NVIDIA Model Optimizer's layout (``weight`` / ``weight_scale`` / ``weight_scale_2`` /
  ``input_scale``, ``hf_quant_config.json``, ``quant_method: modelopt`` or ``modelopt_mixed``).
* ``compressed-tensors``: llm-compressor's (``weight_packed`` / ``weight_scale`` / ``weight_global_scale``,
  ``quant_method: compressed-tensors``, ``format: nvfp4-pack-quantized``), in compressed-tensors' own arithmetic.

Every format module provides what :class:`OutputFormat` lists. Nothing outside this package spells a
format's tensor names or config keys.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from ..errors import ConvertError
from . import compressed_tensors, modelopt

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from ..plan.model import Item, Kind, Plan


class OutputFormat(Protocol):
    """What each format module defines (module-level names)."""

    NAME: str
    #: quant_method -> the quant_algo values a recipe of this format may name
    QUANT_METHODS: dict[str, set[str]]
    #: top-level files the format writes besides config.json and the index (pack removes them on
    #: --overwrite, side-file copying skips an input's own)
    CONFIG_FILES: tuple[str, ...]
    CARD_TAGS: tuple[str, ...]
    #: the quantization schemes (the plan's Kind values) the format can spell
    KINDS: frozenset[str]
    #: whose NVFP4 arithmetic makes its bytes: "modelopt" (kernels' reference) or "compressed-tensors"
    #: (kernels' ct_nvfp4); the compute stage picks the quantizer by it
    NVFP4_MATH: str

    def tensor_specs(self, kind: Kind, shape: tuple[int, ...], src_dtype: str, input_scale: bool
                     ) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
        """(name suffix, dtype, shape) of each output tensor of one quantized module of ``kind``."""

    def nvfp4_outputs(self, it: Item, packed: list[torch.Tensor], scales: list[torch.Tensor],
                      s2: torch.Tensor) -> list[tuple[str, list[torch.Tensor]]]:
        """Output tensor name -> its parts (one per source member), from an NVFP4 unit's results."""

    def fp8_outputs(self, it: Item, codes: list[torch.Tensor], scales: list[torch.Tensor]
                    ) -> list[tuple[str, list[torch.Tensor]]]:
        """The same for a block-FP8 module."""

    def layer_algo(self, kind: str, input_scale: float | None) -> str:
        """The format's name for one module's quantization (recorded in the manifest)."""

    def record(self, it: Item, shared_scale: str | None) -> dict | None:
        """The manifest record's ``quantization`` entry of a quantized module."""

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
    """The format module named ``name`` (a recipe's ``format``)."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ConvertError(f"output format {name!r} is not known (known: {', '.join(sorted(FORMATS))})") from None


def config_files() -> tuple[str, ...]:
    """Every format's own top-level config files (what an output may hold besides config.json and the index)."""
    return tuple(dict.fromkeys(f for fmt in FORMATS.values() for f in fmt.CONFIG_FILES))
