"""A DeepSeek-style FP8 checkpoint decoded by transformers' own FP8 dequantization, for the peer: run in the peer's
python (``$KIMI_CONVERT_LLMC_PYTHON``), not this tool's, so that the decode compared against is not ours.

    PEER_PY benchmarks/peer_decode_fp8.py SRC DST [--dtype float32|bfloat16]

``model_free_ptq`` cannot read an FP8 block source (it quantizes the stored e4m3 values as they are:
``NotImplementedError: "check_uniform_bounds" not implemented for 'Float8_e4m3fn'``, docs/compressed-tensors.md), so
its users decode it first (transformers' ``FineGrainedFP8Config(dequantize=True)``, DeepSeek's ``fp8_cast_bf16.py``).
Each ``X.weight`` stored as F8_E4M3 with its ``X.weight_scale_inv`` becomes ``Fp8Dequantize._dequantize_one(weight,
scale_inv)`` (``transformers/integrations/finegrained_fp8.py``: one fp32 multiply a value by its tile's scale, then
the output dtype: float32, the scales' own, by default; ``--dtype bfloat16`` as fp8_cast_bf16 writes it), the scale
dropped; every other tensor, the other files and the index are copied; ``config.json`` loses its
``quantization_config``. Prints one JSON line: the tensors decoded.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.integrations.finegrained_fp8 import Fp8Dequantize


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    shutil.rmtree(a.dst, ignore_errors=True)
    a.dst.mkdir(parents=True)
    decoded = 0
    index_path = a.src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    for f in sorted(a.src.iterdir()):
        if f.suffix != ".safetensors":
            if f.is_file() and f.name not in ("config.json", index_path.name):
                shutil.copy2(f, a.dst / f.name)
            continue
        out = {}
        with safe_open(f, "pt") as h:
            names = list(h.keys())
            for n in names:
                if n.endswith(".weight_scale_inv"):  # (read with its weight, below)
                    continue
                t = h.get_tensor(n)
                s = f"{n}_scale_inv"
                if t.dtype == torch.float8_e4m3fn and s in names:
                    # (self is not read on the FP8 path: the unpacking of FP4 is the method's only use of it)
                    t = Fp8Dequantize._dequantize_one(None, t, h.get_tensor(s), output_dtype=dtype)
                    decoded += 1
                out[n] = t.contiguous()
        save_file(out, a.dst / f.name, metadata={"format": "pt"})
    if index is not None:
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.endswith(".weight_scale_inv")}
        (a.dst / index_path.name).write_text(json.dumps(index, indent=2) + "\n")
    config = json.loads((a.src / "config.json").read_text())
    config.pop("quantization_config", None)
    (a.dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(json.dumps({"decoded": decoded, "dtype": a.dtype}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
