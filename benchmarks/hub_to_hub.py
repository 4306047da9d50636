"""Hub to Hub in bounded disk (issue 25): ``pack hf://SRC OUT --upload DST --no-keep-output`` against the same
work done one step after the other (download the repository, pack the folder, upload the output), with the
fake Hub (tests/fakehub.py) throttled to a download and an upload rate (each one link, shared by the
transfers in flight).

    python benchmarks/hub_to_hub.py [--experts 96] [--layers 24] [--shards 48] [--down 6e6] [--up 6e6]
                                    [--max-scratch 40MB] [--shard-size 8MB] [--work DIR] [--table FILE]

Steps alone: ``download_s`` (huggingface_hub's ``snapshot_download`` of the source repository, in a process of
its own), ``pack_s`` (``kimi-convert pack`` of the downloaded folder), ``upload_s`` (``kimi-convert upload``).
``hub_to_hub_s``: the one command. ``vs_slowest_step``: hub_to_hub_s over the slowest of the three (target:
1.15 at most). The local disk (scratch folder plus output folder) is sampled every 20 ms during the one
command: ``peak_scratch_bytes`` against ``--max-scratch``, ``peak_local_bytes`` against what the sequential
route holds at its peak (the whole input and the whole output). CPU only (``--device cpu``). Prints one JSON
object, and with ``--table`` writes a Markdown table of it (with the command line) to that file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fakehub import TOKEN, FakeHub, hub_cli
from helpers import Result, run_process

PACK = ["--layout", "sglang", "--recipe", "nvfp4-w4a16", "-q", "--device", "cpu"]


def timed(fn) -> float:
    t = time.monotonic()
    r = fn()
    assert r.code == 0, r.stderr
    return round(time.monotonic() - t, 2)


def du(*folders: Path) -> int:
    n = 0
    for f in folders:
        if f.is_dir():
            for p in f.rglob("*"):
                with contextlib.suppress(FileNotFoundError):  # deleted while listed
                    n += p.stat().st_size if p.is_file() else 0
    return n


def download(hub: FakeHub, repo: str, dest: Path, work: Path) -> Result:
    """``snapshot_download`` of ``repo`` into ``dest``, in a process with the environment ``hub_cli`` gives."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE_"))}
    env.update(HF_ENDPOINT=hub.url, HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1", HF_TOKEN=TOKEN,
               HF_HOME=str(work / "hf-home"), HF_HUB_DISABLE_PROGRESS_BARS="1")
    code = ("import sys; from huggingface_hub import snapshot_download; "
            "snapshot_download(sys.argv[1], local_dir=sys.argv[2])")
    r = subprocess.run([sys.executable, "-c", code, repo, str(dest)], env=env, capture_output=True, text=True)
    shutil.rmtree(dest / ".cache", ignore_errors=True)  # the library's download metadata
    return Result(r.returncode, r.stdout, r.stderr)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=96)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--shards", type=int, default=48)
    ap.add_argument("--down", type=float, default=6e6, help="the fake Hub's download bytes/s")
    ap.add_argument("--up", type=float, default=6e6, help="the fake Hub's upload bytes/s")
    ap.add_argument("--max-scratch", default="40MB")
    ap.add_argument("--shard-size", default="8MB", help="pack's --max-shard-size (the output in about 24 shards)")
    ap.add_argument("--work", type=Path)
    ap.add_argument("--table", type=Path, help="also write the result as a Markdown table here")
    a = ap.parse_args(argv)
    pack = [*PACK, "--max-shard-size", a.shard_size]
    work = a.work or Path(tempfile.mkdtemp(prefix="hub-to-hub-"))
    src = work / "in"
    if not src.exists():
        assert run_process("synth", "tiny-k3", src, "--experts", str(a.experts), "--layers", str(a.layers),
                           "--shards", str(a.shards)).code == 0
    for d in ("dl", "p", "live", ".live.hub-scratch"):
        shutil.rmtree(work / d, ignore_errors=True)
    out: dict = {"preset": f"tiny-k3 --experts {a.experts} --layers {a.layers} --shards {a.shards}",
                 "input_bytes": du(src), "down_bytes_s": a.down, "up_bytes_s": a.up,
                 "max_scratch": a.max_scratch, "max_shard_size": a.shard_size,
                 "cpus": os.cpu_count()}
    with FakeHub(TOKEN) as hub:
        hub.seed("user/src", src)
        source_objects = set(hub.lfs)
        hub.download_bps, hub.upload_bps = a.down, a.up
        out["download_s"] = timed(lambda: download(hub, "user/src", work / "dl", work))
        out["pack_s"] = timed(lambda: run_process("pack", work / "dl", work / "p", *pack))
        out["upload_s"] = timed(lambda: hub_cli(hub, "upload", work / "p", "user/after", tmp=work))
        for oid in set(hub.lfs) - source_objects:  # the same output again: the one command must send it too
            del hub.lfs[oid]
        seen: list[tuple[int, int]] = []
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                seen.append((du(work / ".live.hub-scratch"), du(work / ".live.hub-scratch", work / "live")))
                time.sleep(0.02)
        t = threading.Thread(target=sample, daemon=True)
        t.start()
        try:
            out["hub_to_hub_s"] = timed(lambda: hub_cli(
                hub, "pack", "hf://user/src", work / "live", *pack, "--upload", "user/live", "--no-keep-output",
                "--max-scratch", a.max_scratch, "--stats", work / "live-stats.json", tmp=work))
        finally:
            done.set()
            t.join()
        same = all(hub.file_bytes("user/live", p) == hub.file_bytes("user/after", p)
                   for p in hub.repos["user/after"].files if p != "manifest.json")
    stats = json.loads((work / "live-stats.json").read_text())
    out["output_bytes"] = du(work / "p")
    out["sequential_s"] = round(out["download_s"] + out["pack_s"] + out["upload_s"], 2)
    out["slowest_step_s"] = max(out["download_s"], out["pack_s"], out["upload_s"])
    out["vs_slowest_step"] = round(out["hub_to_hub_s"] / out["slowest_step_s"], 3)
    out["vs_sequential"] = round(out["hub_to_hub_s"] / out["sequential_s"], 3)
    out["bound_bytes"] = stats["downloads"]["bound"]
    out["peak_scratch_bytes"] = max(s for s, _ in seen)
    out["peak_local_bytes"] = max(n for _, n in seen)
    out["sequential_peak_local_bytes"] = du(work / "dl") + out["output_bytes"]
    out["pipeline_waited_for_downloads_s"] = round(stats["downloads"]["waited_s"], 2)
    out["same_files_on_the_hub"] = same
    print(json.dumps(out))
    if a.table:
        cmd = shlex.join(["python", "benchmarks/hub_to_hub.py", *(argv if argv is not None else sys.argv[1:])])
        rows = "\n".join(f"| {k} | {v} |" for k, v in out.items())
        a.table.write_text(f"`{cmd}`\n\n| field | value |\n|---|---|\n{rows}\n")
    return out


if __name__ == "__main__":
    main()
