"""How many input bytes a pack's file hashes read again from the disk (the pipeline read them first, but too far
ahead of the sha256 chain's cursor to be held), with the chain reading small tensors itself
(``KIMI_CONVERT_HASH_READS_SMALL``, ``--small``: 64 KiB) and without (0, ``Tuning.hash_reads_small``'s default), per
preset; the two outputs compared file by file. A count of bytes, not a time: a loaded machine moves it little (the
hold budget's state at each offer depends on the chain's pace), so it can be taken beside other work.

    python benchmarks/hash_reread.py [--workdir DIR] [--small BYTES] PRESET[@N|@eN] ...

PRESET@N: N layers, PRESET@eN: N routed experts a MoE layer (as benchmarks/families_pack.sh). Each preset's input is
written with ``kimi-convert synth`` and removed after; the pack is ``--device cpu`` with its default recipe."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from auto_vs_devices import tree_digest

CLI = [sys.executable, "-m", "kimi_convert.cli"]


def synth(entry: str, dst: Path) -> None:
    preset, _, size = entry.partition("@")
    more = ["--experts", size[1:]] if size.startswith("e") else ["--layers", size] if size else []
    subprocess.run([*CLI, "synth", preset, str(dst), "--overwrite", "--jobs", "2", *more], check=True,
                   stdout=subprocess.DEVNULL)


def pack(src: Path, out: Path, small: str | None) -> dict:
    env = {**os.environ, **({"KIMI_CONVERT_HASH_READS_SMALL": small} if small is not None else {})}
    stats = out.with_suffix(".stats.json")
    subprocess.run([*CLI, "pack", str(src), str(out), "--device", "cpu", "-q", "--overwrite", "--stats", str(stats)],
                   check=True, env=env, stdout=subprocess.DEVNULL)
    return json.loads(stats.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("presets", nargs="+")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/kimi-convert-hash-reread"))
    ap.add_argument("--small", default="65536", help="KIMI_CONVERT_HASH_READS_SMALL of the second pack (bytes)")
    a = ap.parse_args()
    print("| preset | input GB | read again, waiting for every range | read again, small tensors read by the chain "
          "| same files |\n|---|---|---|---|---|")
    for entry in a.presets:
        src, outs = a.workdir / "in", [a.workdir / "out-wait", a.workdir / "out-small"]
        synth(entry, src)
        size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
        wait, small = pack(src, outs[0], "0"), pack(src, outs[1], a.small)
        print(f"| `{entry}` | {size / 1e9:.2f} | {wait['hash_reread'] / 1e9:.3f} GB | {small['hash_reread'] / 1e9:.3f}"
              f" GB | {tree_digest(outs[0]) == tree_digest(outs[1])} |", flush=True)
        shutil.rmtree(a.workdir)


if __name__ == "__main__":
    main()
