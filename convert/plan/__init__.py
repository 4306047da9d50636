"""Plan stage: a pure function of the headers, the config, the mapping table and the rules.

It reads no tensor data. It decides every output tensor, its sources in order, the fuse op, NVFP4
or kept (and the rule why), and the shard and byte offset it lands at, so that ``pack`` can write
each shard's header before any data and the manifest is this plan plus hashes. Every inconsistency
(a fused group with a missing member, members that cannot be fused, a module whose shards are only
partly excluded, a weight whose K is not a multiple of 16) fails here, before any work.

One module per stage: ``model`` (the data), ``discover`` (sources, by the source encodings of
``encodings/``), ``fusion``, ``decide``, ``layout`` (items, units, shards), ``operations`` (each item's
operation, decided once: ``Item.operation``), ``names`` (exclude list, aliases, patterns), ``make`` (make_plan).
"""

from ..options import DEFAULT_MAX_SHARD, LAYOUTS, Options
from ..schemes import GROUP_SIZE
from .discover import check_convertible, discover_sources, fp8_block_size
from .fusion import Fused, resolve_fusions
from .layout import build_items
from .make import make_plan
from .model import (
    COPY,
    FP8,
    KEEP,
    KEPT_FOR_ENGINE,
    MXFP4_GROUP,
    NVFP4,
    QUANTIZED,
    Encoding,
    EngineGroup,
    Item,
    Kind,
    Op,
    Operation,
    OutTensor,
    Placed,
    Plan,
    Shard,
    ShardLoad,
    ShardPart,
    ShardSize,
    SourceTensor,
    Unit,
)
from .names import aliases, collect_patterns, exclude_list

__all__ = [
    "COPY", "DEFAULT_MAX_SHARD", "FP8", "GROUP_SIZE", "KEEP", "KEPT_FOR_ENGINE", "LAYOUTS", "MXFP4_GROUP", "NVFP4",
    "QUANTIZED", "Encoding", "EngineGroup", "Fused", "Item", "Kind", "Op", "Operation", "Options", "OutTensor",
    "Placed", "Plan", "Shard", "ShardLoad", "ShardPart", "ShardSize", "SourceTensor", "Unit", "aliases", "build_items",
    "check_convertible",
    "collect_patterns", "discover_sources", "exclude_list", "fp8_block_size", "make_plan",
    "resolve_fusions",
]
