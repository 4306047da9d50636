"""``kimi-convert pack --recipe ct-nvfp4-a16`` against llm-compressor's ``model_free_ptq`` (the peer) on the same
input and machine: wall seconds, CPU seconds, peak memory of each process tree; prints a Markdown table.

    python benchmarks/ct_speed.py [--input DIR | --preset bench-kimi-linear] [--device cpu|cuda|auto ...]
        [--ours-extra "--max-shard-size 1GB"] [--stats-dir DIR]
        [--peer-device cpu|cuda] [--peer-workers 1 2 | --peer-workers] [--cold input|warm] [--work DIR] [--json FILE]

``--ours-extra`` adds pack options to each of this tool's runs (a row each: once without, once with them);
``--stats-dir`` keeps each of its runs' ``pack --stats`` JSON (start-up, streams, hashing seconds); an empty
``--peer-workers`` runs no peer (a machine without its python).

The peer runs in its own python (``$KIMI_CONVERT_LLMC_PYTHON``, default /work/peers/llmc/bin/python) through
``benchmarks/peer_model_free.py`` with ``--partners-present`` (Kimi Linear's MLA ``q_proj`` has no k/v partner,
on which it stops otherwise: docs/compressed-tensors.md), ``scheme="NVFP4A16"``, ``ignore=`` our output's
``ignore`` list, each ``--peer-workers`` value as ``max_workers``, and ``device`` = ``cpu`` for ``--device cpu``
and ``cuda`` otherwise (ours: ``--device`` as given). Measurement as ``compare_speed.py`` (PSS summed over the
process tree, sampled every 0.1 s; ``--cold input``: the input's pages evicted before each run).

On a GPU machine without network the peer's python needs, from wheels: llmcompressor 0.14 and its
dependencies (compressed-tensors 0.19, transformers, accelerate, loguru, pydantic, ...) and a CUDA build of
torch; ``KIMI_CONVERT_LLMC_PYTHON`` names it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from compare_speed import Run, evict, gb, measure, warm  # noqa: E402

PEER_PY = os.environ.get("KIMI_CONVERT_LLMC_PYTHON", "/work/peers/llmc/bin/python")


def table(runs: list[Run]) -> list[str]:
    peer = [r for r in runs if r.tool == "llm-compressor"]
    best = min(peer, key=lambda r: r.wall_s) if peer else None
    lines = [f"| tool | device | max_workers | wall s | CPU s | peak tree PSS GB (anon) | largest process RSS GB "
             f"| peer best ({best.jobs if best else '-'}) wall / this | this PSS / peer best's |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        ratio = f"{best.wall_s / r.wall_s:.2f}x | {r.peak_pss / best.peak_pss:.2f}" if best else "- | -"
        lines.append(f"| {r.tool} | {r.device} | {r.jobs} | {r.wall_s:.1f} | {r.cpu_s:.1f} | {gb(r.peak_pss)} "
                     f"({gb(r.peak_pss_anon)}) | {gb(r.max_rss)} | {ratio} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--input", type=Path)
    ap.add_argument("--preset", default="bench-kimi-linear")
    ap.add_argument("--device", nargs="+", default=["cpu"], help="ours, one run each (cpu, cuda, auto)")
    ap.add_argument("--peer-device", help="the peer's device (default: cpu when --device is only cpu, else cuda)")
    ap.add_argument("--peer-workers", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--ours-extra", default="", help="pack options for a second run of ours per --device")
    ap.add_argument("--stats-dir", type=Path, help="write each run of ours' pack --stats JSON here")
    ap.add_argument("--cold", choices=("input", "warm"), default="input")
    ap.add_argument("--work", type=Path, default=Path("/tmp/ct-speed"))
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    env = dict(os.environ)
    src = a.input or a.work / a.preset
    if not (src / "config.json").exists():
        subprocess.run([sys.executable, "-m", "kimi_convert.cli", "synth", a.preset, str(src), "--overwrite"],
                       check=True, stdout=subprocess.DEVNULL)
    ours = a.work / "ours"
    prep = lambda: evict(src) if a.cold == "input" else warm(src)  # noqa: E731
    runs = []
    variants = [[]] + ([shlex.split(a.ours_extra)] if a.ours_extra else [])
    for device in a.device:
        for extra in variants:
            label = " ".join([device, *extra])
            stats = []
            if a.stats_dir:
                a.stats_dir.mkdir(parents=True, exist_ok=True)
                stats = ["--stats", str(a.stats_dir / (label.replace(" ", "_").replace("-", "") + ".json"))]
            # each tool's output folder removed outside the timing (pack --overwrite would remove the previous
            # run's 2.8 GB inside it: 1.1-1.6 s of setup on the H200 machine, session 13's ct-profile.json)
            subprocess.run(["rm", "-rf", str(ours)], check=True)
            prep()
            runs.append(measure([sys.executable, "-m", "kimi_convert.cli", "pack", str(src), str(ours), "-q",
                                 "--overwrite", "--recipe", "ct-nvfp4-a16", "--device", device, *extra, *stats],
                                env, "kimi-convert", label, "-", 0.1))
    ignore = a.work / "ignore.json"
    ignore.write_text(json.dumps(json.loads((ours / "config.json").read_text())["quantization_config"]["ignore"]))
    peer_device = a.peer_device or ("cpu" if a.device == ["cpu"] else "cuda")
    for w in a.peer_workers:
        out = a.work / f"peer-{w}"
        subprocess.run(["rm", "-rf", str(out)], check=True)
        prep()
        runs.append(measure([PEER_PY, str(HERE / "peer_model_free.py"), str(src), str(out), "--ignore-json",
                             str(ignore), "--device", peer_device, "--max-workers", str(w), "--partners-present"],
                            env, "llm-compressor", peer_device, str(w), 0.1))
    lines = table(runs)
    print("\n".join(lines))
    if a.json:
        a.json.write_text(json.dumps({"input": str(src), "cold": a.cold, "runs": [asdict(r) for r in runs],
                                      "table": lines}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
