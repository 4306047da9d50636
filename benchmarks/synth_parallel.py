"""``kimi-convert synth PRESET`` written by one process per shard (synth itself writes its shards one after
the other, ~25 MB/s a core for bench-k3: 10 minutes for a 14.7 GB K3 on one core).

    python benchmarks/synth_parallel.py bench-k3 OUT --layers 12 --shards 16 [--jobs N]

Every tensor's values depend only on the seed and its name (``synth._gen``), so the files hold what
``synth`` writes for the same preset with ``shards`` set to ``--shards``. Presets with FP8 sources (whose
scales synth moves between shards) are refused.
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path


def _shard(args) -> tuple[str, dict[str, str], int]:
    preset, layers, shards, seed, out, s = args
    import torch
    from safetensors.torch import save_file

    from kimi_convert import synth

    torch.set_num_threads(1)
    p = replace(synth.PRESETS[preset], layers=layers, shards=shards)
    specs = list(synth.tensor_specs(p))
    cuts = synth._cuts(specs, p.shards)
    n = len(cuts) - 1
    fname = f"model-{s + 1:05d}-of-{n:05d}.safetensors"
    tensors = {}
    for name, shape, dtype in specs[cuts[s] : cuts[s + 1]]:
        if dtype == torch.uint8:
            wide = name.endswith("layers.1.block_sparse_moe.experts.0.w2.weight")
            base = name[: -len(".weight")]
            tensors[f"{base}.weight_packed"], tensors[f"{base}.weight_scale"] = synth.mxfp4(name, shape, seed, wide)
        else:
            tensors[name] = synth.weight(name, shape, seed, dtype)
            if name.endswith(".A_log") and len(shape) == 1:
                tensors[name][p.kda_heads:] = 0
    save_file(tensors, str(Path(out) / fname), metadata={"format": "pt"})
    os.chmod(Path(out) / fname, synth.default_mode())
    return fname, {k: fname for k in tensors}, sum(v.numel() * v.element_size() for v in tensors.values())


def main() -> None:
    import torch

    from kimi_convert import synth

    ap = argparse.ArgumentParser()
    ap.add_argument("preset")
    ap.add_argument("out")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)))
    a = ap.parse_args()
    p = replace(synth.PRESETS[a.preset], shards=a.shards, **({"layers": a.layers} if a.layers else {}))
    specs = list(synth.tensor_specs(p))
    if p.sparse or any(d == torch.float8_e4m3fn for _, _, d in specs):
        raise SystemExit(f"{a.preset}: sparse or FP8 sources: use kimi-convert synth")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=False)
    n = len(synth._cuts(specs, p.shards)) - 1
    t = time.perf_counter()
    weight_map, total = {}, 0
    with ProcessPoolExecutor(a.jobs) as ex:
        for _, wm, nbytes in ex.map(_shard, [(a.preset, p.layers, a.shards, a.seed, str(out), s) for s in range(n)]):
            weight_map.update(wm)
            total += nbytes
    synth._write_rest(p, out, weight_map, total)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"wrote {out}/: {a.preset}, {p.layers} layers, {n} shards, {size / 1e9:.2f} GB in "
          f"{time.perf_counter() - t:.1f} s ({a.jobs} processes)")


if __name__ == "__main__":
    main()
