"""What the engines read besides the shards: the index here, and the output format's config files
(``convert/formats/``: ``config.json``'s ``quantization_config``, ModelOpt's ``hf_quant_config.json``).
Pure functions of the plan (and the input's config): their bytes are decided before any tensor is
converted."""

from __future__ import annotations

import itertools
import json
from operator import itemgetter

from . import formats
from .plan import Plan


def index_json(plan: Plan) -> dict:
    """The index as data (``index_text`` is its text)."""
    total, pairs = _weight_map(plan)
    return {"metadata": {"total_size": total}, "weight_map": dict(pairs)}


def index_text(plan: Plan) -> str:
    """``atomic.dumps(index_json(plan))`` (indented JSON), written one line a tensor without the dict and
    ``json.dumps(indent=2)``'s pure-Python encoder, whose pieces for the released K3's million tensors were the
    largest thing a pack held at its finish (issue 43)."""
    total, pairs = _weight_map(plan)
    enc = json.JSONEncoder().encode
    body = "{\n" + ",\n".join(f"    {enc(n)}: {enc(f)}" for n, f in pairs) + "\n  }" if pairs else "{}"
    meta = json.dumps({"total_size": total}, indent=2).replace("\n", "\n  ")
    return '{\n  "metadata": ' + meta + ',\n  "weight_map": ' + body + "\n}\n"


def _weight_map(plan: Plan) -> tuple[int, list[tuple[str, str]]]:
    """The output tensors' total bytes, and (tensor, shard) sorted by tensor, made one output shard's part of the
    plan at a time (``Plan.shard_parts``); a name written twice keeps its last shard, as a dict would."""
    pairs: list[tuple[str, str]] = []
    total = 0
    for part in plan.shard_parts():
        s = part.shard
        pairs += [(p.tensor.name, s.file) for p in s.placed]
        total += sum(p.tensor.nbytes for p in s.placed)
    pairs.sort(key=itemgetter(0))  # stable: a name written twice keeps its last shard, as a dict does
    if any(a[0] == b[0] for a, b in itertools.pairwise(pairs)):
        pairs = list(dict(pairs).items())
    return total, pairs


def config_files(config: dict, plan: Plan) -> dict[str, dict]:
    """The output format's config files (config.json first), by file name."""
    return formats.get(plan.recipe.output_format).config_files(config, plan)
