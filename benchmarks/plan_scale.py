"""`kimi-convert plan` at the released Kimi K3's scale (issue 14): seconds, peak memory and output size of
`inspect`, `plan` and `plan --json` on `synth k3-full-sparse` (497,220 tensors in 96 shards, data as holes).

    python benchmarks/plan_scale.py [--dir DIR] [--runs N] [--commands inspect plan plan-json]
                                    [--src CHECKOUT] [--compare FILE...]

Writes the sparse checkpoint once (seconds; about 135 MB of real disk for 1.56 TB of files), then runs each
command in a child process, its output to a file, and reports wall and CPU (user + sys) seconds and the
child's peak RSS (wait4), the best of --runs. --src runs the code of another checkout (a `git worktree` of
an older commit) for a before/after table; --compare checks each output against a file (byte for byte).
The load average is printed: on a shared machine, wall seconds follow the other users' load.
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
        (pkg / sub).symlink_to((checkout / sub).resolve())
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/kimi-convert-bench/k3-full-sparse")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--commands", nargs="+", default=list(COMMANDS), choices=list(COMMANDS))
    ap.add_argument("--src", help="run this checkout's code instead of the installed kimi_convert")
    ap.add_argument("--compare", nargs="*", default=[],
                    help="a file per command ('-': none): its output must be the same")
    ap.add_argument("--keep", help="folder for the outputs (default: a temporary one)")
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
