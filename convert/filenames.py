"""The names of the files an output folder (and an input's index) holds, in one leaf module: every stage
that writes, reads, skips or uploads them takes the name from here."""

from __future__ import annotations

INDEX = "model.safetensors.index.json"  # the shard index, of the input and of the output
CONFIG = "config.json"
MANIFEST = "manifest.json"  # kimi-convert's record of the output (convert/manifest.py)
RECORDS_DIR = "manifest-records"  # one JSON Lines records file per output shard
JOURNAL = ".kimi-convert-pack.json"  # the resume journal of an unfinished pack (convert/journal.py)
LOCK = ".kimi-convert-pack.lock"  # held by the pack writing the output
RAY_PROBE = ".kimi-convert-ray-probe"  # pack --ray with a Hub input: do the Ray nodes see this output? (hubstage)


def records_name(shard: str) -> str:
    """Where a shard's records go: ``manifest-records/<shard without .safetensors>.jsonl`` (a sub-folder
    no engine loader reads, uploaded with the rest)."""
    return f"{RECORDS_DIR}/{shard.removesuffix('.safetensors')}.jsonl"
