"""Two commands timed against each other as whole processes, in turn (A B A B ...), so that a machine whose speed
drifts during the call moves both alike: each run's wall seconds, user and system CPU seconds and peak RSS (the
kernel's accounting of the reaped child, ``os.wait4``), their medians, and the ratios A/B taken pair by pair.

    python benchmarks/ab_pack.py -n 5 --warmup 1 --a "kimi-convert pack IN OUT-A -q --overwrite" \\
        --b "BEFORE/.venv/bin/kimi-convert pack IN OUT-B -q --overwrite" [--env-a K=V] [--env-b K=V] [--json FILE]

A command is split as a shell splits words and run without a shell; its output is thrown away. ``--evict DIR``: the
``*.safetensors`` files under DIR are written back and evicted from the page cache before every run (the input then
comes from the disk, as for a checkpoint just downloaded and pushed out, or one larger than the memory); without it,
the input's state in the page cache is the caller's (the figures say which)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time


def run_once(cmd: list[str], env: dict[str, str]) -> dict:
    with tempfile.TemporaryFile() as errf:  # (a pipe read only after the wait would block a chatty child)
        t = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=errf, env={**os.environ, **env})
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t
        p.returncode = os.waitstatus_to_exitcode(status)  # (reaped here: Popen must not wait for it again)
        errf.seek(0)
        err = errf.read().decode(errors="replace")
    code = p.returncode
    if code != 0:
        sys.exit(f"{shlex.join(cmd)}: exit {code}: {(err.strip().splitlines() or [''])[-1]}")
    return {"wall": wall, "user": ru.ru_utime, "sys": ru.ru_stime, "cpu": ru.ru_utime + ru.ru_stime,
            "peak_gb": ru.ru_maxrss * 1024 / 1e9}


def evict(folder: str | None) -> None:
    """The input files under ``folder`` out of the page cache (any user may: ``POSIX_FADV_DONTNEED``)."""
    if folder is None:
        return
    os.sync()
    for root, _, names in os.walk(folder):
        for name in names:
            if name.endswith(".safetensors"):
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def env_of(pairs: list[str]) -> dict[str, str]:
    return dict(p.split("=", 1) for p in pairs)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", required=True)
    ap.add_argument("--b", required=True)
    ap.add_argument("--env-a", action="append", default=[])
    ap.add_argument("--env-b", action="append", default=[])
    ap.add_argument("-n", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json")
    ap.add_argument("--evict", help="evict this folder's *.safetensors from the page cache before every run")
    a = ap.parse_args(argv)
    cmds = {"A": (shlex.split(a.a), env_of(a.env_a)), "B": (shlex.split(a.b), env_of(a.env_b))}
    for _ in range(a.warmup):
        for cmd, env in cmds.values():
            evict(a.evict)
            run_once(cmd, env)
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    load = [os.getloadavg()[0]]
    for _ in range(a.n):
        for k, (cmd, env) in cmds.items():
            evict(a.evict)
            runs[k].append(run_once(cmd, env))
    load.append(os.getloadavg()[0])
    keys = ("wall", "user", "sys", "cpu", "peak_gb")
    med = {k: {f: statistics.median(r[f] for r in rs) for f in keys} for k, rs in runs.items()}
    ratio = {f: statistics.median(x[f] / y[f] for x, y in zip(runs["A"], runs["B"], strict=True) if y[f])
             for f in keys}
    print(f"A: {a.a}\nB: {a.b}\n{a.n} runs each in turn after {a.warmup} warm-up(s); load average {load[0]:.2f} "
          f"before, {load[1]:.2f} after" + (f"; {a.evict}'s input files evicted before each run" if a.evict else "")
          + "\n")
    print("| | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys))
    for k in ("A", "B"):
        print(f"| {k} median | " + " | ".join(f"{med[k][f]:.2f}" for f in keys) + " |")
    print("| A/B (pair by pair, median) | " + " | ".join(f"{ratio[f]:.3f}" for f in keys) + " |")
    result = {"a": a.a, "b": a.b, "env_a": a.env_a, "env_b": a.env_b, "evict": a.evict, "runs": runs,
              "median": med, "ratio": ratio, "load": load}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
