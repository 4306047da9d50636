"""The C MXFP4 -> NVFP4 cast by kind of block (issue 43): blocks in the closed form's window (a release's
experts), all-zero blocks (E8M0 0: the sparse whole-release input, whose data regions are holes) and blocks out
of the window (a lossy exponent), on one thread; optionally the same with ``recipe_cpu.c`` as it was at a git
revision, built beside today's, to compare.

    python benchmarks/cast_blocks.py [--rows 3072] [--kb 112] [--reps 5] [--before REV]

Prints the median seconds per GB of codes for each kind, and each output's bytes equal between the two builds.
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import torch

from kimi_convert.kernels import clib, recipe_cpu

ROOT = Path(__file__).resolve().parents[1]


def library(rev: str | None) -> ctypes.CDLL:
    """Today's recipe kernels, or ``kernels/src/recipe_cpu.c`` at ``rev`` (with today's pool) built the same way
    (``rev`` one with today's entry points, ``clib.set_recipe_types``: from session 21's INT4 decode on)."""
    if rev is None:
        return clib.load_recipe()
    show = ["git", "-C", str(ROOT), "show"]
    src = b"".join(b'#line 1 "%s.c"\n' % n.encode() + subprocess.run(
        [*show, f"{r}:kernels/src/{n}.c"], check=True, capture_output=True).stdout
        for n, r in (("kc_pool", "HEAD"), ("recipe_cpu", rev)))
    lib = ctypes.CDLL(str(clib.build(src, shutil.which("cc") or "gcc", "recipe_cpu")))
    clib.set_recipe_types(lib)
    return lib


def inputs(kind: str, rows: int, kb: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Codes, E8M0 scales and the tensor's k_max for one kind of block."""
    g = torch.Generator().manual_seed(0)
    if kind == "zero":
        return torch.zeros(rows, 16 * kb, dtype=torch.uint8), torch.zeros(rows, kb, dtype=torch.uint8), -127
    packed = torch.randint(0, 256, (rows, 16 * kb), generator=g, dtype=torch.uint8)
    lo = 118 if kind == "window" else 60  # a 10-wide band under the max (K3's), or 50 below the window
    scale = torch.randint(lo, lo + 10, (rows, kb), generator=g, dtype=torch.uint8)
    scale[0, 0] = 127  # the tensor's k_max: 0
    return packed, scale, 0


def timed(lib: ctypes.CDLL, packed, scale, own: int, reps: int) -> tuple[float, torch.Tensor, torch.Tensor]:
    out, sb = torch.empty_like(packed), torch.empty(scale.shape[0], 2 * scale.shape[1], dtype=torch.uint8)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        recipe_cpu.cast_into(lib, packed, scale, own, own, out, sb, 1)
        times.append(time.perf_counter() - t)
    return statistics.median(times), out, sb


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=3072)
    ap.add_argument("--kb", type=int, default=112)  # a K3 expert's 3584 columns
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--before", help="a git revision whose recipe_cpu.c to compare with")
    a = ap.parse_args()
    now, before = library(None), library(a.before) if a.before else None
    print(f"{a.rows} x {32 * a.kb} MXFP4 codes, one thread; seconds per GB of codes (median of {a.reps})")
    print("| blocks | today | " + (f"at {a.before} | same bytes |" if before else "") + "\n|---|---|" +
          ("---|---|" if before else ""))
    for kind in ("window", "zero", "out-of-window"):
        packed, scale, own = inputs(kind, a.rows, a.kb)
        gb = packed.numel() / 1e9
        s, out, sb = timed(now, packed, scale, own, a.reps)
        row = f"| {kind} | {s / gb:.3f} |"
        if before:
            s0, out0, sb0 = timed(before, packed, scale, own, a.reps)
            row += f" {s0 / gb:.3f} | {bool(torch.equal(out, out0) and torch.equal(sb, sb0))} |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
