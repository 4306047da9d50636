"""Run NVIDIA Model Optimizer's own Kimi K3 converter and `kimi-convert pack` (recipe nvidia-k3) on the same
input, and compare every output tensor byte for byte, the file each lands in, the index and the configs.

The converter is not part of this repository: pass the path of a Model Optimizer checkout that has
``examples/kimi/kimi_k3/quantize_to_nvfp4.py`` (and ``examples/_shard_cast_utils.py``), and run this with
a python that has ``nvidia-modelopt`` installed (the test extras install it).

    python benchmarks/compare_nvidia.py --modelopt-repo PATH --input tiny-k3/ [--work /tmp/cmp]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open

RECIPE = "models/moonshotai/Kimi-K3/ptq/nvfp4_experts-fp8_pb_attention"


def load(folder: Path) -> tuple[dict[str, tuple[torch.Tensor, str]], dict]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for f in sorted(set(index.values())):
        with safe_open(str(folder / f), framework="pt") as h:
            out.update({k: (h.get_tensor(k), f) for k in h.keys()})  # noqa: SIM118
    return out, index


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modelopt-repo", required=True, type=Path)
    ap.add_argument("--input", required=True, type=Path)
    ap.add_argument("--work", type=Path, default=Path("/tmp/kimi-convert-vs-nvidia"))
    a = ap.parse_args()
    script = a.modelopt_repo / "examples/kimi/kimi_k3/quantize_to_nvfp4.py"
    nv, ours = a.work / "nvidia", a.work / "kimi-convert"
    env = {**os.environ, "PYTHONPATH": str(a.modelopt_repo)}
    t = time.perf_counter()
    subprocess.run([sys.executable, str(script), "--source_ckpt", str(a.input), "--output_ckpt", str(nv),
                    "--recipe", RECIPE, "--jobs", "1", "--overwrite"], check=True, env=env, stdout=subprocess.DEVNULL)
    t_nv = time.perf_counter() - t
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "kimi_convert.cli", "pack", str(a.input), str(ours), "-q", "--overwrite",
                    "--recipe", "nvidia-k3", "--device", "cpu"], check=True)
    t_ours = time.perf_counter() - t
    (ta, ia), (tb, ib) = load(ours), load(nv)
    differ = [k for k in tb if k in ta and not same(ta[k][0], tb[k][0])]
    moved = [k for k in tb if k in ta and ta[k][1] != tb[k][1]]
    print(f"tensors: kimi-convert {len(ta)}, NVIDIA {len(tb)}; names equal: {set(ta) == set(tb)}")
    print(f"byte-identical: {len(tb) - len(differ)} of {len(tb)}" + (f"; differ: {differ[:5]}" if differ else ""))
    print(f"same shard file for every tensor: {not moved}; index keys equal: {set(ia) == set(ib)}")
    qa = json.loads((ours / "config.json").read_text())["quantization_config"]
    qb = json.loads((nv / "config.json").read_text())["quantization_config"]
    print(f"config: quant_method {qa['quant_method']} / {qb['quant_method']}, quant_algo {qa['quant_algo']} / "
          f"{qb['quant_algo']}, ignore equal: {qa['ignore'] == qb['ignore']}")
    la, lb = qa["quantized_layers"], qb["quantized_layers"]
    print(f"quantized_layers: {len(la)} / {len(lb)} keys; NVIDIA's not here: {sorted(set(lb) - set(la))}; "
          f"here not NVIDIA's: {sorted(set(la) - set(lb))}; entries differing: "
          f"{[k for k in set(la) & set(lb) if la[k] != lb[k]]}")
    print(f"wall: NVIDIA {t_nv:.1f} s, kimi-convert {t_ours:.1f} s (tiny inputs: start-up bound)")
    return 1 if differ or set(ta) != set(tb) or moved else 0


if __name__ == "__main__":
    sys.exit(main())
