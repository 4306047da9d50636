"""What the engines read besides the shards: the index here, and the output format's config files
(``convert/formats/``: ``config.json``'s ``quantization_config``, ModelOpt's ``hf_quant_config.json``).
Pure functions of the plan (and the input's config): their bytes are decided before any tensor is
converted."""

from __future__ import annotations

from . import formats
from .plan import Plan


def index_json(plan: Plan) -> dict:
    weight_map = {p.tensor.name: s.file for s in plan.shards for p in s.placed}
    total = sum(p.tensor.nbytes for s in plan.shards for p in s.placed)
    return {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}


def config_files(config: dict, plan: Plan) -> dict[str, dict]:
    """The output format's config files (config.json first), by file name."""
    return formats.get(plan.recipe.output_format).config_files(config, plan)
