"""How compressed-tensors' NVFP4 arithmetic differs from ModelOpt's on the same modules and the same global-scale
groups: packs one input with ``nvfp4-w4a16`` (ModelOpt) and ``ct-nvfp4-a16`` (compressed-tensors), and counts the
modules whose codes, block scales or (decode-convention) global scale differ.

    python benchmarks/ct_vs_modelopt.py [--preset tiny-kimi-linear] [--work DIR]
"""

from __future__ import annotations

import argparse
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_llmcompressor import read, tensors


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny-kimi-linear")
    ap.add_argument("--work", type=Path)
    a = ap.parse_args()
    work = a.work or Path(tempfile.mkdtemp(prefix="ct-vs-mo-"))
    cli = [sys.executable, "-m", "kimi_convert.cli"]
    src = work / "input"
    subprocess.run([*cli, "synth", a.preset, str(src), "--overwrite"], check=True, stdout=subprocess.DEVNULL)
    for recipe in ("nvfp4-w4a16", "ct-nvfp4-a16"):
        subprocess.run([*cli, "pack", str(src), str(work / recipe), "-q", "--overwrite", "--device", "cpu",
                        "--recipe", recipe], check=True, stdout=subprocess.DEVNULL)
    mo, ct = tensors(work / "nvfp4-w4a16"), tensors(work / "ct-nvfp4-a16")
    mods = sorted(n[: -len(".weight_packed")] for n in ct if n.endswith(".weight_packed"))
    codes = scales = glob = 0
    for m in mods:
        if f"{m}.weight_scale_2" not in mo:
            continue
        codes += read(mo[f"{m}.weight"]) != read(ct[f"{m}.weight_packed"])
        scales += read(mo[f"{m}.weight_scale"]) != read(ct[f"{m}.weight_scale"])
        s2 = struct.unpack("<f", read(mo[f"{m}.weight_scale_2"]))[0]
        g = struct.unpack("<f", read(ct[f"{m}.weight_global_scale"]))[0]
        glob += s2 != 1.0 / g
    n = sum(f"{m}.weight_scale_2" in mo for m in mods)
    print(f"{a.preset}: {n} NVFP4 modules in both; codes differ in {codes}, block scales in {scales}, "
          f"decode global scale (ModelOpt weight_scale_2 vs 1/weight_global_scale) in {glob}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
