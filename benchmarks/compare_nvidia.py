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
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

RECIPE = "models/moonshotai/Kimi-K3/ptq/nvfp4_experts-fp8_pb_attention"


def index(folder: Path) -> dict[str, str]:
    return json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


@dataclass
class Comparison:
    """Two outputs, tensor by tensor: names, the shard file each lands in, bytes."""

    ours: set[str]
    theirs: set[str]
    index_equal: bool
    differ: list[str]
    moved: list[str]

    @property
    def ok(self) -> bool:
        return not self.differ and not self.moved and self.ours == self.theirs

    def summary(self) -> str:
        n = len(self.theirs)
        return (f"tensors: kimi-convert {len(self.ours)}, NVIDIA {n}; names equal: {self.ours == self.theirs}; "
                f"byte-identical: {n - len(self.differ)} of {n}" + (f" (differ: {self.differ[:5]})" if self.differ
                                                                   else "")
                + f"; same shard file for every tensor: {not self.moved}; index keys equal: {self.index_equal}")


def compare_folders(ours: Path, theirs: Path) -> Comparison:
    """Every tensor of ``theirs`` against ``ours``, one pair in memory at a time (outputs of many GB)."""
    files_a, files_b = {}, {}
    for folder, files in ((ours, files_a), (theirs, files_b)):
        for f in sorted(set(index(folder).values())):
            with safe_open(str(folder / f), framework="pt") as h:
                files.update(dict.fromkeys(h.keys(), f))
    ia, ib = index(ours), index(theirs)
    common = [k for k in files_b if k in files_a]
    moved = [k for k in common if files_a[k] != files_b[k]]
    differ = []
    by_pair: dict[tuple[str, str], list[str]] = {}
    for k in common:
        by_pair.setdefault((files_a[k], files_b[k]), []).append(k)
    for (fa, fb), keys in by_pair.items():
        with safe_open(str(ours / fa), framework="pt") as ha, safe_open(str(theirs / fb), framework="pt") as hb:
            differ += [k for k in keys if not same(ha.get_tensor(k), hb.get_tensor(k))]
    return Comparison(set(files_a), set(files_b), set(ia) == set(ib), differ, moved)


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
    c = compare_folders(ours, nv)
    print(c.summary())
    qa = json.loads((ours / "config.json").read_text())["quantization_config"]
    qb = json.loads((nv / "config.json").read_text())["quantization_config"]
    print(f"config: quant_method {qa['quant_method']} / {qb['quant_method']}, quant_algo {qa['quant_algo']} / "
          f"{qb['quant_algo']}, ignore equal: {qa['ignore'] == qb['ignore']}")
    la, lb = qa["quantized_layers"], qb["quantized_layers"]
    print(f"quantized_layers: {len(la)} / {len(lb)} keys; NVIDIA's not here: {sorted(set(lb) - set(la))}; "
          f"here not NVIDIA's: {sorted(set(la) - set(lb))}; entries differing: "
          f"{[k for k in set(la) & set(lb) if la[k] != lb[k]]}")
    print(f"wall: NVIDIA {t_nv:.1f} s, kimi-convert {t_ours:.1f} s (tiny inputs: start-up bound)")
    return 0 if c.ok else 1


if __name__ == "__main__":
    sys.exit(main())
