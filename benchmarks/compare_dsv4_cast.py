"""Run NVIDIA Model Optimizer's own DeepSeek V4 converter (``examples/deepseek/deepseek_v4/quantize_to_nvfp4.py
--cast_mxfp4_to_nvfp4``) and ``kimi-convert pack`` (recipe ``nvidia-dsv4``) on the same DeepSeek V4 checkpoint, and
compare every output tensor byte for byte, the index's tensor names, the lossless-block counts and the configs.

    python benchmarks/compare_dsv4_cast.py --modelopt-repo M --peer-python P --input SRC [--work DIR] [--json F]
        [--mapping FILE]

``M`` is a Model Optimizer checkout with ``examples/deepseek/deepseek_v4/``; ``P`` a python with
``nvidia-modelopt`` (``scripts/gptoss-peer-env.sh``); this script runs under kimi-convert's python.

NVIDIA's script needs a calibration amax dump (``--amax_path``): its expert weights do not depend on it under
``--cast_mxfp4_to_nvfp4`` (the cast's scales come from the source's E8M0 exponents), only the experts'
``input_scale`` does (``amax / (6 * 448)``). The dump given here holds one input amax a routed expert of the main
layers, 2688 (= 6 * 448), so NVIDIA writes ``input_scale`` 1.0, the value the recipe pins: then every tensor of
both outputs is compared, ``input_scale`` included. Both outputs keep DeepSeek's names, so tensors are compared
name for name.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from safetensors import safe_open

SCRIPT = "examples/deepseek/deepseek_v4/quantize_to_nvfp4.py"
EXPERT = re.compile(r"^(layers\.\d+\.ffn\.experts\.\d+\.w[123])\.weight$")
PEER_LOSSLESS = re.compile(r"lossless MXFP4->NVFP4 blocks: (\d+)/(\d+)")
OURS_LOSSLESS = re.compile(r"MXFP4 cast: (\d+)/(\d+) blocks lossless")
AMAX = 2688.0  # 6 * 448: NVIDIA's input_scale = amax / (6 * 448) = 1.0, the recipe's pinned value


@dataclass
class Result:
    """The comparison, as printed and written with ``--json``."""

    ours_tensors: int = 0
    theirs_tensors: int = 0
    byte_identical: int = 0
    expert_tensors_identical: int = 0  # of the routed experts' NVFP4 tensors (weight, scales, input_scale)
    differ: list[str] = field(default_factory=list)
    only_ours: list[str] = field(default_factory=list)
    only_theirs: list[str] = field(default_factory=list)
    config_differs: dict[str, list] = field(default_factory=dict)
    ours_lossless: tuple[int, int] = (0, 0)
    theirs_lossless: tuple[int, int] = (0, 0)

    @property
    def ok(self) -> bool:
        return (not self.differ and not self.only_ours and not self.only_theirs and self.expert_tensors_identical > 0
                and self.ours_lossless == self.theirs_lossless)


def write_amax(src: Path, out: Path) -> int:
    """NVIDIA's amax dump for ``src`` (one rank, MP 1): an input amax a routed expert of the main layers."""
    import torch

    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    amax = {f"{m.group(1)}_input_quantizer._amax": torch.tensor(AMAX) for k in index if (m := EXPERT.match(k))}
    out.mkdir(parents=True, exist_ok=True)
    torch.save(amax, out / "amax_dict_rank0-mp1.pt")
    return len(amax)


def run_peer(peer_python: str, repo: Path, src: Path, amax: Path, out: Path) -> tuple[int, int]:
    """NVIDIA's converter, as its docstring runs it, with the cast; its lossless-block count."""
    cmd = [peer_python, str(repo / SCRIPT), "--amax_path", str(amax), "--source_ckpt", str(src),
           "--output_ckpt", str(out), "--cast_mxfp4_to_nvfp4", "--overwrite"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"NVIDIA's converter failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    m = PEER_LOSSLESS.search(p.stdout)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def run_ours(src: Path, out: Path, mapping: str | None) -> tuple[int, int]:
    cmd = [sys.executable, "-m", "kimi_convert.cli", "pack", str(src), str(out), "--recipe", "nvidia-dsv4",
           "--device", "cpu", "--overwrite"] + (["--mapping", mapping] if mapping else [])
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"kimi-convert pack failed ({p.returncode}):\n{p.stderr[-2000:]}")
    m = OURS_LOSSLESS.search(p.stdout + p.stderr)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _bytes(folder: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    import torch

    out = {}
    for f in sorted(folder.glob("model-*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():  # noqa: SIM118 (a safe_open handle has no __iter__)
                t = h.get_tensor(k).contiguous()
                out[k] = (str(t.dtype), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return out


def compare(ours: Path, theirs: Path, res: Result) -> None:
    a, b = _bytes(ours), _bytes(theirs)
    res.ours_tensors, res.theirs_tensors = len(a), len(b)
    res.only_ours, res.only_theirs = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    experts = re.compile(r"^layers\.\d+\.ffn\.experts\.\d+\.w[123]\.(weight|weight_scale|weight_scale_2|input_scale)$")
    for k in sorted(set(a) & set(b)):
        if a[k] == b[k]:
            res.byte_identical += 1
            res.expert_tensors_identical += bool(experts.match(k))
        else:
            res.differ.append(k)
    ca = json.loads((ours / "config.json").read_text()).get("quantization_config", {})
    cb = json.loads((theirs / "config.json").read_text()).get("quantization_config", {})
    res.config_differs = {k: [ca.get(k), cb.get(k)] for k in sorted(set(ca) | set(cb)) if ca.get(k) != cb.get(k)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modelopt-repo", type=Path, required=True)
    ap.add_argument("--peer-python", required=True)
    ap.add_argument("--input", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/compare-dsv4"))
    ap.add_argument("--mapping", default=None, help="a mapping table for the input (until the derived one ships)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    res = Result()
    n = write_amax(args.input, args.work / "amax")
    res.theirs_lossless = run_peer(args.peer_python, args.modelopt_repo, args.input, args.work / "amax",
                                   args.work / "modelopt")
    res.ours_lossless = run_ours(args.input, args.work / "ours", args.mapping)
    compare(args.work / "ours", args.work / "modelopt", res)
    print(f"amax dump: {n} experts' input amax {AMAX} (input_scale 1.0)")
    print(f"tensors: kimi-convert {res.ours_tensors}, ModelOpt {res.theirs_tensors}; byte-identical: "
          f"{res.byte_identical} (routed experts' NVFP4 tensors: {res.expert_tensors_identical}); differ: "
          f"{len(res.differ)} {res.differ[:5]}; only ours: {res.only_ours[:5]}; only ModelOpt's: {res.only_theirs[:5]}")
    print(f"lossless blocks: kimi-convert {res.ours_lossless[0]}/{res.ours_lossless[1]}, "
          f"ModelOpt {res.theirs_lossless[0]}/{res.theirs_lossless[1]}")
    print(f"config.json quantization_config keys that differ: {res.config_differs}")
    print("identical" if res.ok else "DIFFERENT")
    if args.json:
        args.json.write_text(json.dumps({**asdict(res), "ok": res.ok}, indent=2) + "\n")
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
