"""What the engines read besides the shards: the index here, and the output format's config files
(``convert/formats/``: ``config.json``'s ``quantization_config``, ModelOpt's ``hf_quant_config.json``).
Pure functions of the plan (and the input's config): their bytes are decided before any tensor is
converted."""

from __future__ import annotations

from . import formats
from .plan import Plan


def index_json(plan: Plan) -> dict:
    """The index, its weight map made one output shard's part of the plan at a time (``Plan.shard_parts``)."""
    weight_map: dict[str, str] = {}
    total = 0
    for part in plan.shard_parts():
        s = part.shard
        weight_map.update((p.tensor.name, s.file) for p in s.placed)
        total += sum(p.tensor.nbytes for p in s.placed)
    return {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}


def config_files(config: dict, plan: Plan) -> dict[str, dict]:
    """The output format's config files (config.json first), by file name."""
    return formats.get(plan.recipe.output_format).config_files(config, plan)
