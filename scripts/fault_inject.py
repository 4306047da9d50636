"""Kill `kimi-convert pack` at many points and check that `--resume` finishes it byte-identically.

    python scripts/fault_inject.py [--trials 40] [--seed 0] [--work DIR]

Each trial kills one pack with SIGKILL, either at a named fault point (mid-header, mid-tensor, a
shard renamed but not journaled, mid-write of its manifest records, mid-journal, mid config/index/manifest write; see
convert/faults.py) or after a random delay, then runs the resume command the tool prints and
compares every output file with an uninterrupted run's. Exits 1 on the first difference.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path


def point_counts(src: Path, pack_args: list[str]) -> dict[str, int]:
    """How often each fault point is reached in a full run, from the plan."""
    plan_args = pack_args[: pack_args.index("-q")]
    plan = json.loads(cli("plan", str(src), *plan_args, "--json").stdout)
    shards = len(plan["shards"])
    tensors = sum(s["tensors"] for s in plan["shards"])
    # journal: created, re-saved after verifying, once per shard; json: configs, index, manifest;
    # side: once per 16 MiB of each side file (at least once each but an empty one)
    return {"header": shards, "shard": shards, "records": shards, "tensor": tensors, "journal": shards + 2, "json": 4,
            "side": max(1, len(plan.get("side_files", [])))}


def cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kimi_convert.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)


def same_tree(a: Path, b: Path) -> list[str]:
    """Files and folders (empty ones too) by name, files by content and mode."""
    names_a = sorted(str(p.relative_to(a)) + "/" * p.is_dir() for p in a.rglob("*"))
    names_b = sorted(str(p.relative_to(b)) + "/" * p.is_dir() for p in b.rglob("*"))
    if names_a != names_b:
        return [f"files differ: {sorted(set(names_a) ^ set(names_b))}"]
    files = [n for n in names_a if not n.endswith("/")]
    return ([n for n in files if not filecmp.cmp(a / n, b / n, shallow=False)]
            + [f"{n}: mode" for n in files if (a / n).stat().st_mode != (b / n).stat().st_mode])


def resume(src: Path, out: Path, pack_args: list[str]) -> subprocess.CompletedProcess:
    """Run what the tool says; a kill before the journal existed leaves nothing to resume."""
    again = cli("pack", str(src), str(out), *pack_args)
    m = re.search(r"resume it with: (.+)$", again.stderr.strip())
    if again.returncode == 2 and m:
        return cli(*shlex.split(m.group(1))[1:])
    return cli("pack", str(src), str(out), *pack_args, "--resume")


def trial(src: Path, ref: Path, out: Path, pack_args: list[str], rng: random.Random, full_s: float,
          points: dict[str, int]) -> str:
    shutil.rmtree(out, ignore_errors=True)
    if rng.random() < 0.6:
        name = rng.choice(sorted(points))
        at = rng.randint(1, points[name])
        how = f"point {name}:{at}"
        r = cli("pack", str(src), str(out), *pack_args, env={"KIMI_CONVERT_FAULT": f"{name}:{at}"})
        if r.returncode == 0:
            return f"{how}: not reached (run finished)"
        worker_died = r.returncode == 2 and "worker" in r.stderr  # the point was in a worker process
        if r.returncode != -signal.SIGKILL and not worker_died:
            return f"{how}: FAILED: exit {r.returncode}: {r.stderr.strip()[-300:]}"
    else:
        delay = rng.uniform(0.2, full_s)
        how = f"SIGKILL after {delay:.2f} s"
        p = subprocess.Popen([sys.executable, "-m", "kimi_convert.cli", "pack", str(src), str(out), *pack_args],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        p.kill()
        if p.wait() == 0:
            return f"{how}: not reached (run finished)"
    r = resume(src, out, pack_args)
    if r.returncode != 0:
        return f"{how}: FAILED: resume exit {r.returncode}: {r.stderr.strip()[-300:]}"
    diff = same_tree(ref, out)
    return f"{how}: FAILED: differs: {diff[:5]}" if diff else f"{how}: resumed, identical"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default=None)
    ap.add_argument("--preset", default="tiny-k3")
    ap.add_argument("--experts", default="32")
    ap.add_argument("--workers", default="1", help="pack --workers (a fault point in a worker stops it: exit 2)")
    ap.add_argument("--streams", default="1", help="pack --streams")
    a = ap.parse_args(argv)
    work = Path(a.work) if a.work else Path(os.environ.get("TMPDIR", "/tmp")) / "kimi-convert-faults"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    src, ref, out = work / "in", work / "ref", work / "out"
    r = cli("synth", a.preset, str(src), "--experts", a.experts)
    assert r.returncode == 0, r.stderr
    pack_args = ["--layout", "sglang", "--recipe", "nvfp4-w4a16",  # many shards: the fused layout's own size
                 "--max-shard-size", "1MB", "-q", "--device", "cpu", "--workers", a.workers, "--streams", a.streams]
    t = time.perf_counter()
    r = cli("pack", str(src), str(ref), *pack_args)
    full_s = time.perf_counter() - t
    assert r.returncode == 0, r.stderr
    rng = random.Random(a.seed)
    points = point_counts(src, pack_args)
    failed = 0
    for i in range(a.trials):
        line = trial(src, ref, out, pack_args, rng, full_s, points)
        failed += "FAILED" in line
        print(f"trial {i + 1}/{a.trials}: {line}", flush=True)
    print(f"{a.trials - failed} of {a.trials} trials passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
