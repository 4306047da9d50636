"""pack against the disk floor per --device on one checkpoint (issue 14 item 5), input evicted before each run.

    python benchmarks/gpu_pack_devices.py CHECKPOINT --label now --device cuda cpu auto [--repeat 2] [--floor]

Prints one Markdown row per device (the median of --repeat runs, every run listed): wall time of the whole
process, the conversion, torch + device start, the compute stage summed over streams, the file hashes' own
reads, peak RSS, bytes read from storage, and for ``auto`` what it chose per kind of work. ``--floor``
measures the disk floor first (read the input once + write and fsync the output's size; pack_throughput.py's).
Rows of several calls (another checkout's code installed in between: ``--label``) compare in one table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import pack_throughput as pt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--label", default="")
    ap.add_argument("--device", nargs="+", default=["cuda"])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--floor", action="store_true")
    ap.add_argument("--workdir", default="/tmp/kc")
    a = ap.parse_args()
    src, work = Path(a.checkpoint), Path(a.workdir)
    pt.COLD, pt.SRC = "input", src
    out = work / "out-devices"
    size_in = sum(p.stat().st_size for p in pt.files(src))
    if a.floor:
        from kimi_convert.pack import load_plan
        from kimi_convert.plan import Options

        size_out = sum(s.size for s in load_plan(src, Options())[1].shards)  # the shards' bytes, headers included
        read_s, write_s = pt.disk_floor(src, size_out, work / "floor.bin", True)
        print(f"{src.name}: {size_in / 1e9:.2f} GB in, {size_out / 1e9:.2f} GB out; disk floor: read {read_s:.2f} s "
              f"({size_in / read_s / 1e9:.2f} GB/s) + write {write_s:.2f} s = **{read_s + write_s:.2f} s**", flush=True)
    print("\n| code | device | pack s, median (all) | converting s | torch + device s | compute stage s (summed) "
          "| hash re-read GB | peak RSS GB | read from storage GB | page-locked GB (s) | auto chose |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for dev in a.device:
        runs = sorted((pt.run_pack(src, out, dev, 1, True, "5GB", None, []) for _ in range(a.repeat)),
                      key=lambda r: r[0])
        wall, rss, read, st = runs[len(runs) // 2][:4]
        chose = "; ".join(f"{c['kind']}: {c['chosen']} ({', '.join(f'{b} {v:.3f}' for b, v in c['s_per_gb'].items())}"
                          " s/GB)" for c in st.get("device_choices", []))
        compute = sum(v for k, v in st["stages_s"].items() if k.startswith("compute: kernels"))
        print(f"| {a.label} | {dev} | {wall:.2f} ({', '.join(f'{r[0]:.2f}' for r in runs)}) | {st['convert_s']:.2f} "
              f"| {st['backend_s']:.2f} | {compute:.2f} | {st['hash_reread'] / 1e9:.2f} | {rss / 1e9:.2f} "
              f"| {read / 1e9:.2f} | {st.get('pinned_bytes', 0) / 1e9:.2f} ({st.get('pin_s', 0):.2f}) | {chose} |",
              flush=True)
        print("stages: " + json.dumps(st["stages_s"]), flush=True)
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
