"""Run NVIDIA Model Optimizer's own MXFP4 -> NVFP4 cast of gpt-oss (``examples/hf_ptq/cast_mxfp4_to_nvfp4.py``,
PR #1372, through ``benchmarks/gptoss_modelopt_peer.py``) and ``kimi-convert pack`` (default recipe) on the same
input, and compare every output tensor byte for byte, and the lossless-block counts.

    python benchmarks/compare_gptoss_cast.py --modelopt-repo M --peer-python P --input SRC [--work DIR] [--json F]

``M`` is a Model Optimizer checkout with ``examples/hf_ptq/``; ``P`` a python with ``nvidia-modelopt`` and
``transformers`` (``scripts/gptoss-peer-env.sh``); this script runs under kimi-convert's python.

The two outputs name the experts differently, both as their engines' loaders read them: ModelOpt writes one
3-D tensor a bank in the BMM layout, ``mlp.experts.gate_up_proj`` U8 [E, H/2, 2I] (rows of gate and up
interleaved, as the source), ``_weight_scale`` [E, H/16, 2I], one ``_weight_scale_2`` a bank, ``_bias``
[E, 2I]; kimi-convert one 2-D tensor an expert and projection, ``mlp.experts.{e}.gate_proj.weight`` [I, H/2]...
So each of our expert tensors is compared with its slice of ModelOpt's: ``gate_up_proj[e].T[0::2]`` for gate,
``[1::2]`` for up, ``down_proj[e].T``, the biases' ``[e, j::2]``, the bank's one ``weight_scale_2``; every
other tensor under its own name. Every byte of every ModelOpt tensor is covered by exactly one of ours
(checked). ``input_scale`` is the one tensor not compared: ModelOpt's is calibrated from activations (here
random tokens), ours is the recipe's pinned 1.0 (weight-only NVFP4); it is listed apart.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

EXPERT = re.compile(r"^(?P<pre>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<leaf>gate_proj|up_proj|down_proj)\.(?P<t>.+)$")
BANK_OF = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", None)}
#: our tensor suffix -> ModelOpt's bank tensor suffix
SUFFIX = {"weight": "", "weight_scale": "_weight_scale", "weight_scale_2": "_weight_scale_2", "bias": "_bias",
          "input_scale": "_input_scale"}
PEER_LOSSLESS = re.compile(r"lossless blocks: (\d+)/(\d+)")


@dataclass
class Result:
    """The comparison, as printed and written with ``--json``."""

    ours_tensors: int = 0
    theirs_tensors: int = 0
    byte_identical: int = 0
    differ: list[str] = field(default_factory=list)
    missing_in_theirs: list[str] = field(default_factory=list)
    not_covered_in_theirs: list[str] = field(default_factory=list)
    input_scales_not_compared: int = 0
    ours_lossless: tuple[int, int] = (0, 0)
    theirs_lossless: tuple[int, int] = (0, 0)

    @property
    def ok(self) -> bool:
        return (not self.differ and not self.missing_in_theirs and not self.not_covered_in_theirs
                and self.ours_lossless == self.theirs_lossless and self.byte_identical > 0)

    def summary(self) -> str:
        n = self.ours_tensors - self.input_scales_not_compared
        return (f"tensors: kimi-convert {self.ours_tensors}, ModelOpt {self.theirs_tensors}; byte-identical: "
                f"{self.byte_identical} of {n} compared ({self.input_scales_not_compared} input_scale not compared: "
                f"calibrated by ModelOpt, pinned 1.0 by the recipe)"
                + (f"; differ: {self.differ[:5]}" if self.differ else "")
                + (f"; no ModelOpt counterpart: {self.missing_in_theirs[:5]}" if self.missing_in_theirs else "")
                + (f"; ModelOpt bytes no tensor of ours covers: {self.not_covered_in_theirs[:5]}"
                   if self.not_covered_in_theirs else "")
                + f"; lossless blocks: kimi-convert {self.ours_lossless[0]}/{self.ours_lossless[1]}, "
                  f"ModelOpt {self.theirs_lossless[0]}/{self.theirs_lossless[1]}")


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update((k, h.get_tensor(k)) for k in h.keys())  # noqa: SIM118 (safe_open is no dict)
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.contiguous().reshape(-1).view(torch.uint8))


def counterpart(name: str, theirs: dict[str, torch.Tensor]) -> tuple[str, torch.Tensor, tuple] | None:
    """ModelOpt's tensor and the part of it (a key for the coverage check) that our tensor ``name`` is."""
    m = EXPERT.match(name)
    if m is None:
        return (name, theirs[name], ()) if name in theirs else None
    bank, half = BANK_OF[m["leaf"]]
    key = f"{m['pre']}.{bank}{SUFFIX.get(m['t'], '?')}"
    t = theirs.get(key)
    if t is None:
        return None
    e = int(m["e"])
    if m["t"] in ("weight_scale_2", "input_scale"):
        return key, t, ()  # one a bank
    part = t[e] if m["t"] == "bias" else t[e].transpose(0, 1)  # BMM [E, in, out] -> [out, in]
    if half is not None:
        part = part[half::2]
    return key, part, (e, half)


def compare(ours_dir: Path, theirs_dir: Path) -> Result:
    ours, theirs = _tensors(ours_dir), _tensors(theirs_dir)
    r = Result(ours_tensors=len(ours), theirs_tensors=len(theirs))
    covered: dict[str, set] = {k: set() for k in theirs}
    for name in sorted(ours):
        hit = counterpart(name, theirs)
        if hit is None:
            r.missing_in_theirs.append(name)
            continue
        key, part, where = hit
        covered[key].add(where)
        if name.endswith(".input_scale"):
            r.input_scales_not_compared += 1
            continue
        if _same(ours[name], part):
            r.byte_identical += 1
        else:
            r.differ.append(name)
    for key, t in theirs.items():
        want = {()} if t.dim() < 2 or not any(key.endswith(b + s) for b in ("gate_up_proj", "down_proj")
                                             for s in ("", "_weight_scale", "_bias")) else None
        if want is None:
            halves = (0, 1) if ".gate_up_proj" in key else (None,)
            want = {(e, h) for e in range(t.shape[0]) for h in halves}
        if covered[key] != want:
            r.not_covered_in_theirs.append(key)
    r.ours_lossless = ours_lossless(ours_dir)
    return r


def ours_lossless(out: Path) -> tuple[int, int]:
    """(lossless, total) MXFP4 blocks of our cast, summed over the manifest's records (``pack`` prints the same)."""
    lossless = total = 0
    for f in sorted((out / "manifest-records").glob("*")):
        for line in f.read_text().splitlines():
            q = json.loads(line).get("quantization") or {}
            lossless, total = lossless + q.get("lossless_blocks", 0), total + q.get("blocks", 0)
    return lossless, total


def run_peer(peer_python: str, modelopt_repo: Path, src: Path, out: Path) -> tuple[int, int]:
    """ModelOpt's cast into ``out``; its own printed lossless-block count."""
    script = Path(__file__).with_name("gptoss_modelopt_peer.py")
    p = subprocess.run([peer_python, str(script), "--modelopt-repo", str(modelopt_repo), "--input", str(src),
                        "--output", str(out)], capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"ModelOpt's cast failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    m = PEER_LOSSLESS.search(p.stdout)
    if m is None:
        raise RuntimeError(f"ModelOpt's cast printed no lossless-block count:\n{p.stdout[-3000:]}")
    return int(m[1]), int(m[2])


def run_ours(src: Path, out: Path, extra: list[str] | None = None) -> None:
    cli = Path(sys.executable).with_name("kimi-convert")
    subprocess.run([str(cli), "pack", str(src), str(out), *(extra or [])], check=True, capture_output=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modelopt-repo", required=True, type=Path)
    ap.add_argument("--peer-python", required=True)
    ap.add_argument("--input", required=True, type=Path)
    ap.add_argument("--work", type=Path, default=Path("/tmp/compare-gptoss"))
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if not (a.modelopt_repo / "examples/hf_ptq/cast_mxfp4_to_nvfp4.py").is_file():
        print(f"error: {a.modelopt_repo}: no examples/hf_ptq/cast_mxfp4_to_nvfp4.py", file=sys.stderr)
        return 2
    ours, theirs = a.work / "kimi-convert", a.work / "modelopt"
    for d in (ours, theirs):
        subprocess.run(["rm", "-rf", str(d)], check=True)
    run_ours(a.input, ours)
    peer = run_peer(a.peer_python, a.modelopt_repo, a.input, theirs)
    r = compare(ours, theirs)
    r.theirs_lossless = peer
    print(r.summary())
    print("identical" if r.ok else "DIFFERENT")
    if a.json:
        a.json.write_text(json.dumps({**asdict(r), "ok": r.ok}, indent=1) + "\n")
    return 0 if r.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
