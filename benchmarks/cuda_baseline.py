"""What a process holds before it converts anything: PSS after each start-up step, on and off the GPU.

    python benchmarks/cuda_baseline.py [--modelopt-repo mo] [--json out.json]

Issue 14 asks for pack on the GPU at <= 1/3 of the peak memory (PSS, whole process tree) of NVIDIA's converter
on the GPU. This measures the floor any torch-based GPU tool starts from: a child process takes the steps below
one after another (each on top of the previous) and the parent reads the child's ``/proc/PID/smaps_rollup``
after each: PSS, its anonymous and file-backed parts, RSS.

1. Python alone; 2. ``import torch``; 3. a CUDA context (one tensor on the GPU); 4. one Triton kernel launched
(pack's cast, from Triton's cache if warm); 5. ``import modelopt.torch.quantization`` (what NVIDIA's converter
imports; with ``--modelopt-repo``) -- and, in a second child, pack's CPU path: torch, then the C kernels loaded
and run once.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

STEPS_GPU = [
    ("python", "pass"),
    ("import torch", "import torch"),
    ("CUDA context (one tensor on the GPU)", "x = torch.zeros(1, device='cuda'); torch.cuda.synchronize()"),
    ("one Triton kernel (pack's MXFP4 -> NVFP4 cast)",
     "from kimi_convert.kernels import recipe_triton\n"
     "p = torch.randint(0, 256, (256, 512), dtype=torch.uint8, device='cuda')\n"
     "s = torch.full((256, 32), 120, dtype=torch.uint8, device='cuda')\n"
     "recipe_triton.cast(p, s, 0); torch.cuda.synchronize()"),
]
STEP_MODELOPT = ("import modelopt.torch.quantization (NVIDIA's converter)", "import modelopt.torch.quantization")
STEPS_CPU = [
    ("python", "pass"),
    ("import torch", "import torch"),
    ("the C kernels loaded and run (pack --device cpu)",
     "from kimi_convert.kernels import recipe_cpu, mxfp4_cast\n"
     "p = torch.randint(0, 256, (256, 512), dtype=torch.uint8)\n"
     "s = torch.full((256, 32), 120, dtype=torch.uint8)\n"
     "lib = recipe_cpu.load(); recipe_cpu.cast(lib, p, s, 0)"),
]

CHILD = """
import sys
for line in sys.stdin:
    exec(compile(line.encode().decode('unicode_escape'), 'step', 'exec'))
    print('ready', flush=True)
"""


def rollup(pid: int) -> dict[str, int]:
    """smaps_rollup's sizes, bytes."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB":
                out[key] = int(parts[0]) * 1024
    return out


def run_steps(steps: list[tuple[str, str]], env_path: str | None) -> list[dict]:
    """Each step's code in one child process, in turn; the child's memory after each."""
    env = None
    if env_path:
        import os
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [env_path, os.environ.get("PYTHONPATH")]))}
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=env)
    rows = []
    try:
        for name, code in steps:
            t = time.perf_counter()
            child.stdin.write(code.encode("unicode_escape").decode() + "\n")
            child.stdin.flush()
            if child.stdout.readline().strip() != "ready":
                raise SystemExit(f"step failed: {name}")
            r = rollup(child.pid)
            rows.append({"step": name, "seconds": round(time.perf_counter() - t, 2), "pss": r.get("Pss", 0),
                         "pss_anon": r.get("Pss_Anon", 0), "pss_file": r.get("Pss_File", 0),
                         "pss_shmem": r.get("Pss_Shmem", 0), "rss": r.get("Rss", 0)})
    finally:
        child.stdin.close()
        child.wait()
    return rows


def table(title: str, rows: list[dict]) -> list[str]:
    g = 1e9
    lines = [f"### {title}", "", "| step (cumulative) | s | PSS GB | anon | file | shmem | RSS GB |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['step']} | {r['seconds']} | {r['pss'] / g:.3f} | {r['pss_anon'] / g:.3f} | "
              f"{r['pss_file'] / g:.3f} | {r['pss_shmem'] / g:.3f} | {r['rss'] / g:.3f} |" for r in rows]
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modelopt-repo", help="Model Optimizer examples on PYTHONPATH (NVIDIA's converter's imports)")
    ap.add_argument("--no-gpu", action="store_true")
    ap.add_argument("--json", help="write the rows here too")
    a = ap.parse_args()
    result = {"cpu": run_steps(STEPS_CPU, None)}
    if not a.no_gpu:
        result["gpu"] = run_steps(STEPS_GPU + ([STEP_MODELOPT] if a.modelopt_repo else []), a.modelopt_repo)
    print("\n".join(table("pack's CPU path", result["cpu"])))
    if "gpu" in result:
        print()
        print("\n".join(table("a GPU process (torch, CUDA, Triton)", result["gpu"])))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
