"""Run llm-compressor's ``model_free_ptq`` (the peer) on a checkpoint: executed in the peer's own python.

    /work/peers/llmc/bin/python benchmarks/peer_model_free.py INPUT OUTPUT --ignore-json FILE \
        [--scheme NVFP4A16] [--max-workers N] [--device cpu|cuda] [--partners-present]

Imports nothing of kimi_convert. ``--partners-present``: the one patch, off by default. llm-compressor 0.14
asks every ``q_proj`` under ``self_attn`` for a ``k_proj`` and a ``v_proj`` partner
(``llmcompressor/entrypoints/model_free/microscale.py: DEFAULT_FUSED_MAPPINGS``, resolved by
``compressed_tensors/entrypoints/convert/converters/base.py: build_inverse_weight_maps``), and stops with
``Dependency weight ...k_proj.weight not found in weight map`` on a model whose MLA layers have a plain
``q_proj`` (Kimi Linear); the patch drops a partner the checkpoint does not hold, so the q_proj is quantized
on its own (as it is where its partners are absent from one job). Nothing else is changed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("input")
    ap.add_argument("output")
    ap.add_argument("--ignore-json", required=True, help="a JSON list: model_free_ptq's ignore=")
    ap.add_argument("--scheme", default="NVFP4A16")
    ap.add_argument("--max-workers", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--partners-present", action="store_true")
    a = ap.parse_args()
    with open(a.ignore_json) as f:
        ignore = json.load(f)
    if a.partners_present:
        from llmcompressor.entrypoints.model_free.converter import ModelFreePtqConverter

        with open(os.path.join(a.input, "model.safetensors.index.json")) as f:
            present = set(json.load(f)["weight_map"])
        inner = ModelFreePtqConverter.get_dependencies
        ModelFreePtqConverter.get_dependencies = lambda self, name: {d for d in inner(self, name) if d in present}
    from llmcompressor import model_free_ptq

    t = time.perf_counter()
    try:
        model_free_ptq(a.input, a.output, scheme=a.scheme, ignore=ignore, max_workers=a.max_workers,
                       device=a.device)
    except Exception as e:  # the peer's refusal: its message, one line
        print(f"PEER-ERROR {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(3)
    print(json.dumps({"wall_s": round(time.perf_counter() - t, 3)}))


if __name__ == "__main__":
    main()
