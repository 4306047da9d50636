"""NVIDIA Model Optimizer's Kimi K3 converter against ``kimi-convert pack --recipe nvidia-k3`` on the same
input and device (issue 14 item 4): wall seconds, CPU seconds, peak memory of the whole process tree, and
every output tensor compared byte for byte. Prints a Markdown table.

    python benchmarks/compare_speed.py --modelopt-repo M --input bench-k3-shards/ [--device cpu|cuda]
        [--nvidia-jobs 1 2] [--cold input|warm] [--work DIR] [--json FILE]

M is a Model Optimizer checkout with ``examples/kimi/kimi_k3/quantize_to_nvfp4.py`` (commit 575c27ae1),
run with this python, which must have ``nvidia-modelopt`` (the test extras install 0.47.0).
The input: ``kimi-convert synth bench-k3-shards DIR`` (real-width MXFP4 experts, 24 shards).

Measured, per run (one process tree: the tool and every process it starts):
- wall: from the start of the process to its exit (Python and torch start-up included);
- CPU: user + system seconds of the tree (``wait4``: the process and its reaped children);
- peak tree memory: the largest sum over the tree of each process's PSS (``/proc/PID/smaps_rollup``),
  sampled every ``--sample`` seconds. PSS counts a page shared by n processes as 1/n in each, so the
  sum counts shared pages (torch's libraries in NVIDIA's spawned workers, say) once; file pages a
  process maps (NVIDIA's ``safe_open`` maps each input shard) count as its memory while mapped.
  The anonymous part (Pss_Anon) is shown too, and the largest single process's RSS (``wait4``);
- ``--cold input`` (default): every input file's pages are evicted (``posix_fadvise(DONTNEED)``, after
  ``sync``) before each run, as ``pack_throughput.py --cold input`` does: the input comes from the disk,
  Python and torch stay cached. ``--cold warm``: the input is read once before the first run and left in
  the page cache.
Before the timed runs each tool converts ``tiny-k3`` once, untimed (imports cached, the C kernels built,
Triton's cache warm), and that output is compared too.
NVIDIA's converter runs each ``--nvidia-jobs`` value with ``--threads_per_job max(1, CPUs // jobs)``
(its default, 8 threads per job, oversubscribes small machines); ``--device cuda`` needs ``--jobs 1`` there.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from compare_nvidia import RECIPE, compare_folders

SAMPLE_S = 0.1


@dataclass
class Run:
    """One timed run of one tool."""

    tool: str
    device: str
    jobs: str
    wall_s: float
    cpu_s: float
    peak_pss: int  # bytes, sum over the process tree
    peak_pss_anon: int  # bytes, the anonymous part at the same sample
    max_rss: int  # bytes, the largest single process (wait4)
    procs: int  # most processes seen in the tree at once
    stats: dict | None = None  # pack --stats
    sync_s: float = 0.0  # os.sync() right after the tool exits: its output's pages still to reach the disk


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(d))
    return kids


def _tree(root: int) -> list[int]:
    kids, out, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, []))
    return out


def _pss(pid: int) -> tuple[int, int]:
    """PSS and its anonymous part, bytes (0, 0 for a process that is gone)."""
    pss = anon = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    pss = int(line.split()[1]) * 1024
                elif line.startswith("Pss_Anon:"):
                    anon = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return pss, anon


class TreeSampler(threading.Thread):
    """Samples the sum of PSS over a process tree until stopped; keeps the peak."""

    def __init__(self, root: int, every: float):
        super().__init__(daemon=True)
        self.root, self.every = root, every
        self.peak = self.peak_anon = self.procs = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            pids = _tree(self.root)
            sums = [_pss(p) for p in pids]
            total = sum(s[0] for s in sums)
            if total > self.peak:
                self.peak, self.peak_anon = total, sum(s[1] for s in sums)
            self.procs = max(self.procs, len(pids))
            self.done.wait(self.every)


def evict(folder: Path) -> None:
    """Drop the folder's files from the page cache (written back first), any user."""
    os.sync()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def warm(folder: Path) -> None:
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            with open(p, "rb", buffering=0) as f:
                while f.read(16 << 20):
                    pass


def measure(cmd: list[str], env: dict, tool: str, device: str, jobs: str, every: float) -> Run:
    t = time.perf_counter()
    child = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    sampler = TreeSampler(child.pid, every)
    sampler.start()
    err = []
    reader = threading.Thread(target=lambda: err.append(child.stderr.read()), daemon=True)
    reader.start()
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - t
    t = time.perf_counter()
    os.sync()  # NVIDIA's converter leaves its output in the page cache; pack fsyncs each shard before its rename
    sync_s = time.perf_counter() - t
    sampler.done.set()
    sampler.join()
    reader.join()
    if os.waitstatus_to_exitcode(status):
        sys.exit(f"{tool} failed ({' '.join(cmd)}):\n{err[0].decode(errors='replace')[-3000:]}")
    return Run(tool, device, jobs, wall, usage.ru_utime + usage.ru_stime, sampler.peak, sampler.peak_anon,
               usage.ru_maxrss * 1024, sampler.procs, sync_s=sync_s)


def nvidia_cmd(repo: Path, src: Path, out: Path, device: str, jobs: int, cpus: int) -> list[str]:
    return [sys.executable, str(repo / "examples/kimi/kimi_k3/quantize_to_nvfp4.py"), "--source_ckpt", str(src),
            "--output_ckpt", str(out), "--recipe", RECIPE, "--device", device, "--jobs", str(jobs),
            "--threads_per_job", str(max(1, cpus // jobs)), "--overwrite"]


def pack_cmd(src: Path, out: Path, device: str, stats: Path | None, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "kimi_convert.cli", "pack", str(src), str(out), "-q", "--overwrite",
            "--recipe", "nvidia-k3", "--device", device, *(["--stats", str(stats)] if stats else []), *extra]


def check_same(ours: Path, nv: Path, what: str) -> bool:
    c = compare_folders(ours, nv)
    print(f"{what}: {c.summary()}", flush=True)
    return c.ok


def gb(n: int) -> str:
    return f"{n / 1e9:.2f}"


def table(runs: list[Run]) -> list[str]:
    nv = [r for r in runs if r.tool == "NVIDIA"]
    best = min(nv, key=lambda r: r.wall_s) if nv else None
    lines = [f"| tool | device | jobs | wall s | CPU s | peak tree PSS GB (anon) | largest process RSS GB "
             f"| processes | NVIDIA best ({best.jobs if best else 'not run'}) wall / this "
             f"| this PSS / NVIDIA best's | then sync s | NVIDIA best's wall + sync / this wall + sync |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        ratios = f"{best.wall_s / r.wall_s:.2f}x | {r.peak_pss / best.peak_pss:.2f}" if best else "- | -"
        synced = f"{(best.wall_s + best.sync_s) / (r.wall_s + r.sync_s):.2f}x" if best else "-"
        lines.append(f"| {r.tool} | {r.device} | {r.jobs} | {r.wall_s:.1f} | {r.cpu_s:.1f} | {gb(r.peak_pss)} "
                     f"({gb(r.peak_pss_anon)}) | {gb(r.max_rss)} | {r.procs} | {ratios} | {r.sync_s:.2f} | {synced} |")
    return lines


def warm_up(a: argparse.Namespace, env: dict, cpus: int) -> bool:
    """Each tool converts tiny-k3 once, untimed: imports cached, C kernels built, Triton's cache warm."""
    tiny, nv_out, ours = a.tiny or a.work / "tiny-k3", a.work / "nvidia", a.work / "kimi-convert"
    if not (tiny / "config.json").exists():
        subprocess.run([sys.executable, "-m", "kimi_convert.cli", "synth", "tiny-k3", str(tiny), "--overwrite"],
                       check=True, stdout=subprocess.DEVNULL)
    measure(nvidia_cmd(a.modelopt_repo, tiny, nv_out, a.device, 1, cpus), env, "NVIDIA", a.device, "1", 1.0)
    measure(pack_cmd(tiny, ours, a.device, None, a.pack_args.split()), env, "pack", a.device, "-", 1.0)
    return check_same(ours, nv_out, "warm-up tiny-k3")


def disk_floor(a: argparse.Namespace, ours: Path, runs: list[Run]) -> dict:
    """The disk's bound on this input, against the wall 5x NVIDIA's best run asks (its output is pack's size)."""
    import pack_throughput as pt  # benchmarks/ is sys.path[0] when run as a script

    size_out = sum(p.stat().st_size for p in ours.rglob("*") if p.is_file())
    pt.COLD, pt.SRC = ("input" if a.cold == "input" else "warm"), a.input
    read_s, write_s = pt.disk_floor(a.input, size_out, a.work / "floor.bin", a.cold == "input")
    nv = [r.wall_s for r in runs if r.tool == "NVIDIA"]
    print(f"disk floor ({a.cold}): read {read_s:.2f} s + write and fsync {size_out / 1e9:.2f} GB {write_s:.2f} s = "
          f"{read_s + write_s:.2f} s" + (f"; 5x NVIDIA's best asks {min(nv) / 5:.2f} s" if nv else ""), flush=True)
    over = pt.disk_floor_overlapped(a.input, size_out, a.work / "floor.bin", a.cold == "input")
    print(f"disk floor, overlapped ({over['readers']} reader threads, {over['writers']} files written and fsync'd "
          f"at once): read alone {over['read_s']:.2f} s, write alone {over['write_s']:.2f} s, both at once "
          f"{over['both_s']:.2f} s", flush=True)
    return {"read_s": read_s, "write_s": write_s, "bytes_out": size_out, "five_x_s": min(nv) / 5 if nv else None,
            "overlapped": over}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modelopt-repo", required=True, type=Path)
    ap.add_argument("--input", required=True, type=Path)
    ap.add_argument("--device", default="cpu", help="both tools' --device (cpu or cuda)")
    ap.add_argument("--nvidia-jobs", type=int, nargs="*", default=[1, 2],
                    help="NVIDIA --jobs values to run (none: pack only, compared with WORK/nvidia of an earlier run)")
    ap.add_argument("--pack-repeat", type=int, default=1, help="timed pack runs")
    ap.add_argument("--pack-devices", nargs="+", help="pack's --device for each set of pack runs (cpu, cuda, "
                    "auto; default: --device), all compared with the same NVIDIA run")
    ap.add_argument("--pack-args", default="", help="more pack options, one string")
    ap.add_argument("--cold", choices=["input", "warm"], default="input")
    ap.add_argument("--sample", type=float, default=SAMPLE_S, help="seconds between memory samples")
    ap.add_argument("--work", type=Path, default=Path("/tmp/kimi-convert-speed"))
    ap.add_argument("--tiny", type=Path, help="tiny-k3 checkpoint for the warm-up (written there if missing)")
    ap.add_argument("--json", type=Path, help="write the runs as JSON here too")
    ap.add_argument("--no-warmup", action="store_true", help="skip the untimed tiny-k3 runs (caches already warm)")
    ap.add_argument("--floor", action="store_true", help="after the runs: the disk floor (read the input evicted, "
                    "write and fsync the output's bytes; pack_throughput.py's) and the wall 5x NVIDIA's best asks")
    a = ap.parse_args()
    cpus = len(os.sched_getaffinity(0))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(a.modelopt_repo),
                                                                       os.environ.get("PYTHONPATH")]))}
    a.work.mkdir(parents=True, exist_ok=True)
    nv_out, ours = a.work / "nvidia", a.work / "kimi-convert"
    size_in = sum(p.stat().st_size for p in a.input.rglob("*.safetensors"))
    shards = len(list(a.input.glob("*.safetensors")))
    load = os.getloadavg()
    print(f"input {a.input}: {size_in / 1e9:.2f} GB in {shards} shards; device {a.device}; {cpus} CPUs; "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; page cache: "
          + ("input files evicted before each run" if a.cold == "input" else "input warm (read once before)"),
          flush=True)

    ok = a.no_warmup or warm_up(a, env, cpus)

    if a.cold == "warm":
        warm(a.input)
    runs: list[Run] = []
    for jobs in a.nvidia_jobs:
        if a.cold == "input":
            evict(a.input)
        r = measure(nvidia_cmd(a.modelopt_repo, a.input, nv_out, a.device, jobs, cpus), env, "NVIDIA",
                    a.device, f"{jobs} x {max(1, cpus // jobs)} threads", a.sample)
        runs.append(r)
        print(f"NVIDIA --jobs {jobs}: {r.wall_s:.1f} s, CPU {r.cpu_s:.1f} s, peak tree PSS {gb(r.peak_pss)} GB",
              flush=True)
    for i, device in itertools.product(range(a.pack_repeat), a.pack_devices or [a.device]):
        if a.cold == "input":
            evict(a.input)
        stats = a.work / f"pack-stats-{i}.json"
        r = measure(pack_cmd(a.input, ours, device, stats, a.pack_args.split()), env, "pack", device,
                    "-", a.sample)
        r.stats = json.loads(stats.read_text())
        st = r.stats
        r.jobs = f"{st['workers']} worker(s) x {st['streams'] // st['workers']} stream(s)"
        runs.append(r)
        print(f"pack: {r.wall_s:.1f} s, CPU {r.cpu_s:.1f} s, peak tree PSS {gb(r.peak_pss)} GB; stages (s, summed "
              "over streams): " + ", ".join(f"{k} {v:.1f}" for k, v in st["stages_s"].items()), flush=True)
        if st.get("device_choices"):
            print(f"pack --device {device} chose: {st['device_choices']}", flush=True)
        # with no NVIDIA run: an earlier run's NVIDIA output
        ok = check_same(ours, nv_out, f"{a.input.name} (pack --device {device})") and ok
    floor = disk_floor(a, ours, runs) if a.floor else None
    print()
    print("\n".join(table(runs)))
    if a.json:
        a.json.write_text(json.dumps({"input": str(a.input), "bytes_in": size_in, "shards": shards, "cpus": cpus,
                                      "cold": a.cold, "load_before": load, "identical": ok, "floor": floor,
                                      "runs": [asdict(r) for r in runs]}, indent=2))
    shutil.rmtree(ours, ignore_errors=True)
    if a.nvidia_jobs:
        shutil.rmtree(nv_out, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
