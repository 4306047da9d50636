"""The records the stages share, in a leaf: the keep rules, the recipe and its rules, a skipped input file.

The plan's data (``plan/model.py``), the mapping, the keep decisions, the recipe loader and the output formats
all name these; defined here, below every one of them, they tie no module to another (``tests/test_imports.py``
holds the package free of import circles, ``TYPE_CHECKING`` imports counted). So this module imports nothing of
the package but the scheme names (``schemes``, itself a leaf); what reads, checks or applies a record stays
with its stage: ``keep.kept`` (every reason a module is kept, in order), ``recipe.parse_recipe`` and
``recipe.rule_for``, ``sidefiles.scan``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from .schemes import SchemeName

#: A reason of ``keep.kept``'s source 5 starts with it: the plan keeps the engine's packed module whole.
KEPT_FOR_ENGINE = "kept for the engines: "


@dataclass(frozen=True)
class KeepRule:
    """One glob that keeps the source modules it matches in high precision, and where it comes from.

    ``origin`` is what the plan's reason names: ``mapping NAME: keep``, ``mapping NAME: restrict``,
    ``default (NAME)`` (the mapping's exclude), ``--exclude``, ``FILE:LINE``, ``FILE`` (a JSON list or an
    hf_quant_config.json). ``schemes`` (a restrict only; the file's ``formats`` key): the quantization schemes
    the engine loads the module in; the module is kept only when the recipe asks for another one. ``optional``:
    a module only some inputs of the family have (DeepSeek's MTP layer: ``num_nextn_predict_layers`` 1 in
    DeepSeek V3, 0 in Kimi K2), so the unmatched-entry warning (``Mapping.unmatched``) does not name it."""

    text: str
    origin: str
    reason: str = ""
    schemes: tuple[str, ...] | None = None
    optional: bool = False

    def describe(self) -> str:
        why = f": {self.reason}" if self.reason else ""
        return f"{self.origin} {self.text!r}{why}"


@dataclass(frozen=True)
class RecipeRule:
    modules: tuple[str, ...]  # module globs (globs.match: the one semantics of every pattern)
    experts: bool  # also (or only) every routed expert module of the mapping's expert sets
    scheme: SchemeName  # the file's ``format`` key: the module's quantization scheme, or ``keep``
    input_scale: float | None  # nvfp4: a constant activation scale written per module
    reason: str

    def describe(self) -> str:
        what = ", ".join(self.modules) if self.modules else "routed experts"
        return f"{self.scheme} ({what})"


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    default_for: tuple[str, ...]  # mapping names this recipe is the default of ("*": any)
    quant_method: str  # "modelopt" (one quant_algo) or "modelopt_mixed" (quantized_layers)
    quant_algo: str  # "W4A16_NVFP4", "NVFP4" or "MIXED_PRECISION"
    aliases: bool  # write every runtime spelling of a module name (NVIDIA's converter does)
    exclude_modules: tuple[str, ...] | None  # the exclude list to write as is (else: computed)
    rules: tuple[RecipeRule, ...]
    source: str = ""
    path: str = ""
    output_format: str = "modelopt"  # how the quantized modules are stored (convert/formats/)
    # a kept module whose source is encoded (FP8 with its scales, MXFP4) is copied as stored, its weight and scale
    # tensors under their own names (NVIDIA's DeepSeek V4 recipe: "left in the source format"), not decoded to BF16
    keep_stored: bool = False

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()


@dataclass(frozen=True)
class Skipped:
    """An input file (or folder) neither read nor copied, and why (``sidefiles.skip_reason``): listed in the
    plan and the manifest."""

    file: str  # relative path, forward slashes; a skipped folder ends with "/"
    reason: str

    def to_dict(self) -> dict:
        return {"file": self.file, "reason": self.reason}
