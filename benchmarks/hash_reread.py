"""How many input bytes a pack's file hashes read again from the disk (the pipeline read them first, but too far
ahead of the sha256 chain's cursor to be held), with the chain reading small tensors itself
(``KIMI_CONVERT_HASH_READS_SMALL``, ``--small``: 64 KiB, ``Tuning.hash_reads_small``'s default) and without (0), per
preset, with each pack's peak RSS; the two outputs compared file by file. A count of bytes, not a time: a loaded
machine moves it little (the hold budget's state at each offer depends on the chain's pace), so it can be taken beside
other work.

    python benchmarks/hash_reread.py [--workdir DIR] [--small BYTES] PRESET[@N|@eN] ...

PRESET@N: N layers, PRESET@eN: N routed experts a MoE layer (as benchmarks/families_pack.sh). Each preset's input is
written with ``kimi-convert synth`` and removed after; the pack is ``--device cpu`` with its default recipe."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from ab_pack import run_once
from auto_vs_devices import tree_digest

CLI = [sys.executable, "-m", "kimi_convert.cli"]


def synth(entry: str, dst: Path) -> None:
    preset, _, size = entry.partition("@")
    more = ["--experts", size[1:]] if size.startswith("e") else ["--layers", size] if size else []
    subprocess.run([*CLI, "synth", preset, str(dst), "--overwrite", "--jobs", "2", *more], check=True,
                   stdout=subprocess.DEVNULL)


def pack(src: Path, out: Path, small: str) -> dict:
    """The pack's ``--stats``, with its peak RSS (``peak_gb``)."""
    stats = out.with_suffix(".stats.json")
    run = run_once([*CLI, "pack", str(src), str(out), "--device", "cpu", "-q", "--overwrite", "--stats", str(stats)],
                   {"KIMI_CONVERT_HASH_READS_SMALL": small})
    return {**json.loads(stats.read_text()), "peak_gb": run["peak_gb"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("presets", nargs="+")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/kimi-convert-hash-reread"))
    ap.add_argument("--small", default="65536", help="KIMI_CONVERT_HASH_READS_SMALL of the second pack (bytes)")
    a = ap.parse_args()
    print("| preset | input GB | read again, waiting for every range | read again, small tensors read by the chain "
          "| peak RSS GB, waiting / small | same files |\n|---|---|---|---|---|---|")
    for entry in a.presets:
        src, outs = a.workdir / "in", [a.workdir / "out-wait", a.workdir / "out-small"]
        synth(entry, src)
        size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
        wait, small = pack(src, outs[0], "0"), pack(src, outs[1], a.small)
        same = tree_digest(outs[0]) == tree_digest(outs[1])
        print(f"| `{entry}` | {size / 1e9:.2f} | {wait['hash_reread'] / 1e9:.3f} GB | {small['hash_reread'] / 1e9:.3f}"
              f" GB | {wait['peak_gb']:.2f} / {small['peak_gb']:.2f} | {same} |", flush=True)
        shutil.rmtree(a.workdir)


if __name__ == "__main__":
    main()
