"""`kimi-convert plan` at the released Kimi K3's scale (issue 14): seconds, peak memory and output size of
`inspect`, `plan` and `plan --json` on `synth k3-full-sparse` (497,220 tensors in 96 shards, data as holes).

    python benchmarks/plan_scale.py [--dir DIR] [--runs N] [--commands inspect plan plan-json]
                                    [--src CHECKOUT] [--compare FILE...] [--stages]

Writes the sparse checkpoint once (seconds; about 135 MB of real disk for 1.56 TB of files), then runs each
command in a child process, its output to a file, and reports wall and CPU (user + sys) seconds and the
child's peak RSS (wait4), the best of --runs. --src runs the code of another checkout (a `git worktree` of
an older commit) for a before/after table; --compare checks each output against a file (byte for byte).
The load average is printed: on a shared machine, wall seconds follow the other users' load. --stages
prints where the CPU time goes instead (in this process). --finish measures what a pack's finish adds to its
peak (the index and manifest.json written, in a child process: --src's code or this one's) over the plan's.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMANDS = {"inspect": ["inspect"], "plan": ["plan"], "plan-json": ["plan", "--json"]}


def package_from(checkout: Path, into: Path) -> Path:
    """A folder holding ``kimi_convert`` as that checkout's files (the layout pyproject.toml installs)."""
    pkg = into / "kimi_convert"
    pkg.mkdir(parents=True)
    for f in (checkout / "convert").iterdir():
        (pkg / f.name).symlink_to(f.resolve())
    for sub in ("kernels", "mappings", "recipes"):
        src = checkout / sub / "src"  # kernels/src/ since issue 26 (kernels/ itself is no package), kernels/ before
        (pkg / sub).symlink_to((src if (src / "__init__.py").is_file() else checkout / sub).resolve())
    return into


def run(args: list[str], out: Path, env: dict) -> tuple[float, float, int, int]:
    """Wall seconds, CPU seconds, peak RSS bytes and output bytes of one child."""
    with open(out, "wb") as f:
        t0 = time.perf_counter()
        child = subprocess.Popen([sys.executable, "-m", "kimi_convert.cli", *args], stdout=f, env=env)
        _, status, ru = os.wait4(child.pid, 0)
        wall = time.perf_counter() - t0
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise SystemExit(f"{' '.join(args)}: exit {child.returncode}")
    return wall, ru.ru_utime + ru.ru_stime, ru.ru_maxrss * 1024, out.stat().st_size


def stages(src: Path) -> None:
    """CPU seconds of each stage, in this process: reading the headers, the banked plan's steps (what
    ``plan`` runs: each function make_plan calls, timed where it is called), the text rendering, then the
    module-by-module plan made on first use (what ``plan --json`` and ``pack`` run) and the JSON."""
    import functools
    import gc
    from collections import defaultdict

    import kimi_convert.plan as P
    import kimi_convert.plan.make as M
    from kimi_convert.checkpoint import open_checkpoint
    from kimi_convert.mapping import find_mapping
    from kimi_convert.plan.render import render as render_plan
    from kimi_convert.plan.serialize import plan_json

    spent: dict[str, float] = defaultdict(float)

    def timed(name, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kw):
            t0 = time.process_time()
            try:
                return fn(*args, **kw)
            finally:
                spent[name] += time.process_time() - t0
        return wrapper

    for name in ("check_convertible", "find_banks", "bank_outline", "exclude_list"):
        setattr(M, name, timed(name, getattr(M, name)))
    gc.disable()  # as the command runs (gc paused, then frozen)
    rows = []
    t0 = time.process_time()
    ckpt = open_checkpoint(src)
    rows.append(("open_checkpoint (index, 96 headers)", time.process_time() - t0))
    t0 = time.process_time()
    plan = P.make_plan(ckpt, find_mapping(ckpt.config), P.Options(), banked=True)
    total = time.process_time() - t0
    rows += [(f"make_plan (banked): {k}", v) for k, v in spent.items()]
    rows.append(("make_plan (banked): the stages on the banks' first experts, the rest", total - sum(spent.values())))
    t0 = time.process_time()
    render_plan(plan, str(src))
    rows.append(("text rendering (render_plan, the outline)", time.process_time() - t0))
    t0 = time.process_time()
    n_units = len(plan.units)
    rows.append((f"module-by-module plan, made on first use ({n_units} units; plan --json, pack)",
                 time.process_time() - t0))
    t0 = time.process_time()
    n = sum(len(x) for x in plan_json(plan))
    rows.append((f"JSON ({n / 1e6:.0f} MB, plan_json)", time.process_time() - t0))
    print("| stage | CPU s |\n|---|---|")
    for name, sec in rows:
        print(f"| {name} | {sec:.2f} |")


FINISH = r"""
import gc, hashlib, sys, tempfile, time
from pathlib import Path
import kimi_convert.plan as P
from kimi_convert import atomic, configs, manifest as M
from kimi_convert.checkpoint import open_checkpoint
from kimi_convert.mapping import find_mapping

def rss():
    d = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(d["VmRSS"].split()[0]) * 1e3, int(d["VmHWM"].split()[0]) * 1e3

def reset():
    with open("/proc/self/clear_refs", "w") as f:  # the peak (VmHWM) from here
        f.write("5")

gc.disable()  # as the pack runs
ckpt = open_checkpoint(Path(sys.argv[1]))
plan = P.make_plan(ckpt, find_mapping(ckpt.config), P.Options(), banked=True)
base = rss()[1]
print(f"| plan (banked) | | {base / 1e9:.2f} GB | |")
with tempfile.TemporaryDirectory(dir=sys.argv[2]) as tmp:
    reset()
    t0 = time.process_time()
    out = Path(tmp) / "model.safetensors.index.json"
    if hasattr(configs, "index_chunks"):
        atomic.write_atomic_chunks(out, configs.index_chunks(plan, spill=Path(tmp)))
    else:
        atomic.write_atomic(out, configs.index_text(plan).encode())
    peak = rss()[1]
    with open(out, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()[:16]
    print(f"| the index written | {out.stat().st_size / 1e6:.1f} MB (sha256 {digest}) | {peak / 1e9:.2f} GB "
          f"(+{(peak - base) / 1e9:.2f}) | {time.process_time() - t0:.1f} |")
    reset()
    t0 = time.process_time()
    sh = {s.file: (s.size, "0" * 64) for s in plan.shard_sizes()}
    rec = {f: M.RecordsFile(M.records_name(f), 1, "0" * 64, 1) for f in sh}
    man = M.build(plan, "0" * 64, {f: "0" * 64 for f, _ in plan.inputs}, sh, rec, [], [])
    atomic.write_json_atomic(Path(tmp) / "manifest.json", man, compact_lists=("engine_groups",))
    size = (Path(tmp) / "manifest.json").stat().st_size
    print(f"| manifest.json built and written (placeholder hashes) | {size / 1e6:.1f} MB | {rss()[1] / 1e9:.2f} GB "
          f"(+{(rss()[1] - base) / 1e9:.2f}) | {time.process_time() - t0:.1f} |")
"""


def finish(src: Path, env: dict, work: Path) -> None:
    """What writing the index and the manifest adds to the peak over the banked plan's (VmHWM reset before each)."""
    print("| step | output | peak RSS | CPU s |\n|---|---|---|---|", flush=True)
    subprocess.run([sys.executable, "-c", FINISH, str(src), str(work)], env=env, check=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/kimi-convert-bench/k3-full-sparse")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--commands", nargs="+", default=list(COMMANDS), choices=list(COMMANDS))
    ap.add_argument("--src", help="run this checkout's code instead of the installed kimi_convert")
    ap.add_argument("--compare", nargs="*", default=[],
                    help="a file per command ('-': none): its output must be the same")
    ap.add_argument("--keep", help="folder for the outputs (default: a temporary one)")
    ap.add_argument("--stages", action="store_true", help="CPU seconds per stage, in this process (this checkout)")
    ap.add_argument("--finish", action="store_true", help="the peak the index and manifest.json add (--src's code)")
    a = ap.parse_args()
    src = Path(a.dir)
    if not (src / "config.json").exists():
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "kimi_convert.cli", "synth", "k3-full-sparse", str(src), "--overwrite"],
                       check=True)
        print(f"synth k3-full-sparse: {time.perf_counter() - t0:.1f} s")
    stats = [p.stat() for p in src.iterdir() if p.is_file()]
    print(f"{src}: {sum(s.st_size for s in stats) / 1e12:.2f} TB apparent, "
          f"{sum(s.st_blocks * 512 for s in stats) / 1e6:.0f} MB on disk, {len(os.sched_getaffinity(0))} CPUs")
    if a.stages:
        stages(src)
        return
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ)
        if a.src:
            env["PYTHONPATH"] = str(package_from(Path(a.src), Path(tmp) / "src"))
        outdir = Path(a.keep or tmp)
        outdir.mkdir(parents=True, exist_ok=True)
        code = subprocess.run([sys.executable, "-c", "import os, kimi_convert.plan as p; "
                               "print(os.path.dirname(os.path.realpath(p.__file__)))"],
                              env=env, capture_output=True, text=True).stdout.strip()
        print(f"code: {code}; load average {os.getloadavg()[0]:.2f}\n")
        if a.finish:
            finish(src, env, src.parent)
            return
        print("| command | output | wall s | CPU s (user + sys) | peak RSS | same output |")
        print("|---|---|---|---|---|---|")
        for i, name in enumerate(a.commands):
            out = outdir / f"{name}.out"
            best = min(run([*COMMANDS[name], str(src)], out, env) for _ in range(a.runs))
            wall, cpu, rss, size = best
            same = ""
            if i < len(a.compare) and a.compare[i] != "-":
                same = "yes" if filecmp.cmp(out, a.compare[i], shallow=False) else "**no**"
            print(f"| `kimi-convert {' '.join(COMMANDS[name])}` | {size / 1e6:.1f} MB | {wall:.1f} | {cpu:.1f} | "
                  f"{rss / 1e9:.2f} GB | {same} |", flush=True)
        print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
