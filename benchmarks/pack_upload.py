"""``pack --upload`` against ``pack`` then ``upload``, with the fake Hub (tests/fakehub.py) throttled to an
upload rate: the wall time of each, and of the overlapped run against the slower of the two steps alone.

    python benchmarks/pack_upload.py [--experts 32] [--rate 4e6] [--work DIR] [--no-keep-output]

Runs on the CPU (``--device cpu``, one worker, one stream). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fakehub import TOKEN, FakeHub, hub_cli
from helpers import run_process

PACK = ["--layout", "sglang", "--recipe", "nvfp4-w4a16", "--max-shard-size", "1MB", "-q", "--device", "cpu",
        "--workers", "1", "--streams", "1"]


def timed(fn) -> float:
    t = time.monotonic()
    r = fn()
    assert r.code == 0, r.stderr
    return round(time.monotonic() - t, 2)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--rate", type=float, default=4e6, help="the fake Hub's upload bytes/s")
    ap.add_argument("--work", type=Path)
    ap.add_argument("--no-keep-output", action="store_true")
    a = ap.parse_args(argv)
    work = a.work or Path(tempfile.mkdtemp(prefix="pack-upload-"))
    src = work / "in"
    if not src.exists():
        assert run_process("synth", "tiny-k3", src, "--experts", str(a.experts)).code == 0
    out = {"rate_bytes_s": a.rate, "experts": a.experts}
    with FakeHub(TOKEN) as hub:
        hub.upload_bps = a.rate
        for d in ("p", "live"):
            shutil.rmtree(work / d, ignore_errors=True)
        out["pack_s"] = timed(lambda: run_process("pack", src, work / "p", *PACK))
        out["upload_s"] = timed(lambda: hub_cli(hub, "upload", work / "p", "user/after", tmp=work))
        hub.lfs.clear()  # the same bytes again: the overlapped run must send them too
        extra = ["--no-keep-output"] if a.no_keep_output else []
        out["pack_upload_s"] = timed(lambda: hub_cli(hub, "pack", src, work / "live", *PACK, "--upload", "user/live",
                                                     *extra, tmp=work))
    out["output_bytes"] = sum(p.stat().st_size for p in (work / "p").rglob("*") if p.is_file())
    out["sequential_s"] = round(out["pack_s"] + out["upload_s"], 2)
    out["vs_slowest_step"] = round(out["pack_upload_s"] / max(out["pack_s"], out["upload_s"]), 3)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
