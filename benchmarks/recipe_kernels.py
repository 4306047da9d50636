"""The recipe kernels against their memory floor: the MXFP4 -> NVFP4 cast, 128x128 block FP8, and NVFP4.

    python benchmarks/recipe_kernels.py --device cuda              # Triton kernels on the GPU
    python benchmarks/recipe_kernels.py --device cuda --variants   # ... and their tiles / rounding variants
    python benchmarks/recipe_kernels.py --device cpu               # C kernels, threads = every core

Memory floor = (bytes the kernel must read + bytes it must write) / copy bandwidth measured in the same run
(GPU: a 1 GiB device-to-device copy; CPU: a 1 GiB torch copy on every core), counted as read + written:
- cast: MXFP4 codes and E8M0 scales in, NVFP4 codes and e4m3 scales out;
- block FP8: the bf16 weight in, e4m3 codes and fp32 tile scales out;
- NVFP4: the bf16 weight read twice (the global amax needs a pass of its own), codes and scales out.
GPU times: medians of ``triton.testing.do_bench_cudagraph`` over a graph that runs the kernel on 8 inputs in turn
(so no input is served from L2), per call, and of ``do_bench`` over the same rotation (with Python's launch
cost). The cast and block-FP8 rows time the kernels (their zeroed counter included); "call" rows time the whole
function the pipeline calls (lossless count / finite check read back to the host). CPU times: medians of repeated
calls, torch code (what the recipe ran before these kernels) beside them; preallocated outputs are touched once
before (their first use would otherwise time page faults), "whole call" rows allocate as the pipeline does.
"""

from __future__ import annotations

import argparse
import json
import os
from functools import partial

import torch
from nvfp4_bench import timeit as median_s  # benchmarks/ is sys.path[0] when run as a script

from kimi_convert.devices import cpus
from kimi_convert.kernels import fp8_block, mxfp4_cast, nvfp4_cpu, recipe_cpu, reference

THREADS = cpus()  # every core (KIMI_CONVERT_THREADS overrides)

#: (label, rows, packed bytes a row): K3's routed experts as the checkpoint stores them (MXFP4)
CAST_SHAPES = [("expert 3072x7168", 3072, 3584), ("expert w1/w3 3072x3584", 3072, 1792),
               ("expert w2 3584x3072", 3584, 1536), ("8 experts 24576x7168", 24576, 3584)]
#: (label, N, K): K3's attention weights quantized to block FP8 by NVIDIA's recipe
FP8_SHAPES = [("attention 7168x7168", 7168, 7168), ("KDA q/k/v/g 12288x7168", 12288, 7168),
              ("o_proj 7168x12288", 7168, 12288), ("q_a 1536x7168", 1536, 7168),
              ("kv_a 576x7168", 576, 7168), ("b_proj 96x7168", 96, 7168)]
NVFP4_SHAPES = [("3072x7168", 3072, 7168), ("7168x3072", 7168, 3072), ("6144x7168", 6144, 7168),
                ("32768x7168", 32768, 7168)]


def cast_bytes(n: int, pk: int) -> int:
    return 2 * n * pk + n * pk // 16 + n * pk // 8


def fp8_bytes(n: int, k: int) -> int:
    return 3 * n * k + 4 * -(-n // 128) * -(-k // 128)


def nvfp4_bytes(n: int, k: int) -> int:
    return 4 * n * k + n * k // 2 + n * k // 16


def mx_inputs(n: int, pk: int, seed: int, window: bool = True, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, pk), generator=g, dtype=torch.uint8)
    lo, hi = (116, 125) if window else (0, 254)  # 0xFF: NaN, refused
    scale = torch.randint(lo, hi + 1, (n, pk // 16), generator=g, dtype=torch.uint8)
    return packed.to(device), scale.to(device)


def bf16_input(n: int, k: int, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(n, k, generator=g, device=device) * 0.02).to(torch.bfloat16)


# --- GPU ---------------------------------------------------------------------------------------------

def copy_bandwidth_gpu() -> float:
    import triton.testing as tt

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = tt.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


def time_gpu(fns: list, graph: bool = True) -> tuple[float | None, float]:
    """(CUDA-graph ms, do_bench ms) a call, over the rotation of closures ``fns`` (no graph for calls that
    synchronise: they cannot be captured)."""
    import triton.testing as tt

    def all_once():
        for f in fns:
            f()
    all_once()
    torch.cuda.synchronize()
    graph_ms = tt.do_bench_cudagraph(all_once, rep=100, return_mode="median") / len(fns) if graph else None
    state = {"i": 0}

    def one():
        state["i"] += 1
        fns[state["i"] % len(fns)]()
    return graph_ms, tt.do_bench(one, warmup=20, rep=100, return_mode="median")


def gpu_rows(variants: bool, kernels: set[str], orders: bool) -> tuple[float, list[dict]]:
    bw = copy_bandwidth_gpu()
    print(f"device copy: {bw / 1e12:.2f} TB/s (read + write)", flush=True)
    rows = []

    def add(kernel, label, nbytes, fns, note="", capture=True):
        try:
            graph, plain = time_gpu(fns, capture)
        except Exception as e:  # one variant that does not compile must not cost the run's other rows
            print(f"{kernel:28s} {label:28s} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
            return
        floor = nbytes / bw * 1e3
        rows.append({"kernel": kernel, "shape": label, "bytes": nbytes, "floor_ms": floor, "graph_ms": graph,
                     "plain_ms": plain, "note": note})
        g = f"{graph:.4f} ms = {graph / floor:.2f}x" if graph else "n/a"
        print(f"{kernel:28s} {label:28s} floor {floor:.4f} ms | graph {g} | do_bench {plain:.4f} ms = "
              f"{plain / floor:.2f}x {note}", flush=True)

    for label, n, pk in CAST_SHAPES if "cast" in kernels else ():
        cast_gpu(add, label, n, pk, variants)
    for label, n, k in FP8_SHAPES if "fp8" in kernels else ():
        fp8_gpu(add, label, n, k, variants)
    for label, n, k in NVFP4_SHAPES if "nvfp4" in kernels else ():
        nvfp4_gpu(add, label, n, k, variants, orders)
    return bw, rows


def cast_gpu(add, label: str, n: int, pk: int, variants: bool) -> None:
    """The cast (two launches: the closed-form stream, the long path of flagged programs) at its default and, with
    ``variants``, other program sizes on the same inputs."""
    from kimi_convert.kernels import recipe_triton

    stats = torch.empty(2 * recipe_triton.cast_programs(n * pk // 16, 256), dtype=torch.int32, device="cuda")
    big = n == 3072 and pk == 3584
    for window in (True, False) if big else (True,):
        ins = [mx_inputs(n, pk, i, window, device="cuda") for i in range(8)]
        own = [mxfp4_cast.k_max(s) for _, s in ins]
        outs = [(torch.empty_like(p), torch.empty((n, pk // 8), dtype=torch.uint8, device="cuda")) for p, _ in ins]

        def launch(i, tile=None, slow=None, ins=ins, outs=outs, own=own):
            recipe_triton.launch_cast(ins[i][0], ins[i][1], *outs[i], stats, own[i], own[i], tile, slow)

        lab = label if window else f"{label}, exponents 0..254"
        note = "" if window else "every program takes the long way (not K3's data)"
        add("cast", lab, cast_bytes(n, pk), [partial(launch, i) for i in range(8)], note)
        tiles = [(512, 4), (1024, 8)] if variants and window else []
        slows = [(2048, 32, 4), (128, 32, 4), (512, 64, 8)] if variants and big and not window else []
        for tile in tiles:
            add(f"cast {tile[0]} blocks, {tile[1]} warps", lab, cast_bytes(n, pk),
                [partial(launch, i, tile) for i in range(8)])
        for slow in slows:
            add(f"cast, long path <= {slow[0]} programs, {slow[1]} blocks a step, {slow[2]} warps", lab,
                cast_bytes(n, pk), [partial(launch, i, None, slow) for i in range(8)], note)
        if big and window:
            add("cast, whole call", lab, cast_bytes(n, pk),
                [partial(recipe_triton.cast, p, s, o, o) for (p, s), o in zip(ins, own, strict=True)],
                "count read back", capture=False)
        del ins, outs


def fp8_gpu(add, label: str, n: int, k: int, variants: bool) -> None:
    """Block FP8 at its default (conversion instructions where the GPU has them) and, with ``variants``, other warps
    and the fp32-split rounding at the large shapes."""
    from kimi_convert.kernels import recipe_triton

    xs = [bf16_input(n, k, i, "cuda") for i in range(8)]
    outs = [(torch.empty((n, k), dtype=torch.uint8, device="cuda"),
             torch.empty(fp8_block.scale_shape(n, k), device="cuda")) for _ in range(8)]
    opts = [(None, None)] + ([(4, True), (16, True), (8, False)] if variants and n * k >= 7168 * 7168 else [])
    for warps, hw in opts:
        name = "fp8-block" if warps is None else f"fp8-block w{warps} {'hw-cvt' if hw else 'fp32 splits'}"
        add(name, label, fp8_bytes(n, k),
            [partial(recipe_triton.launch_fp8, x, q, s, warps, hw) for x, (q, s) in zip(xs, outs, strict=True)])
    if (n, k) == (7168, 7168):
        add("fp8-block, whole call", label, fp8_bytes(n, k), [partial(recipe_triton.fp8_quantize, x) for x in xs],
            "finite check read back", capture=False)


def nvfp4_gpu(add, label: str, n: int, k: int, variants: bool, orders: bool = False) -> None:
    """NVFP4 (a zeroed cell, the amax kernel: one atomic a program, quantize) at its default and, with
    ``variants``, session 5's form (one atomic a chunk of 8192 pairs, quantize tile 16x16x4), other tiles, and each
    pass alone; with ``orders``, the quantize kernel's tile orders (nvfp4_triton._quant_bf16_kernel's ORDER) and
    tiles in the reverse order."""
    from kimi_convert.kernels import nvfp4_triton

    xs = [bf16_input(n, k, i, "cuda") for i in range(8)]
    packed = torch.empty((n, k // 2), dtype=torch.uint8, device="cuda")
    scales = torch.empty((n, k // 16), dtype=torch.uint8, device="cuda")
    cell = torch.zeros(1, device="cuda")

    def run(x, qtile=None, atile=None):
        cell.zero_()
        nvfp4_triton.amax_into(x, cell, atile)
        nvfp4_triton._launch_quant(x, cell, packed, scales, n, k, qtile)

    add("nvfp4 (zero + amax + quantize)", label, nvfp4_bytes(n, k), [partial(run, x) for x in xs])
    for qt in ((4, 16, 1, 0), (4, 16, 1, 1), (4, 16, 1, 2), (8, 16, 1, 2), (4, 32, 1, 2), (2, 32, 1, 2),
               (4, 16, 2, 2), (8, 32, 2, 2)) if orders else ():
        add(f"nvfp4 quantize tile {qt}", label, nvfp4_bytes(n, k), [partial(run, x, qt) for x in xs])
    if not variants:
        return
    add("nvfp4, session 5 (amax: an atomic a chunk; quantize 16x16x4)", label, nvfp4_bytes(n, k),
        [partial(run, x, (16, 16, 4), (8192, 1 << 40, 4)) for x in xs])
    if (n, k) not in ((3072, 7168), (32768, 7168)):
        return
    for qt in ((8, 32, 2), (2, 64, 1), (4, 16, 1), (8, 16, 1)):
        add(f"nvfp4 quantize tile {qt}", label, nvfp4_bytes(n, k), [partial(run, x, qt) for x in xs])
    for at in ((4096, 1024, 4), (8192, 1 << 40, 4)):
        add(f"nvfp4 amax tile {at}", label, nvfp4_bytes(n, k), [partial(run, x, None, at) for x in xs])
    add("nvfp4 zero + amax alone", label, 2 * n * k, [partial(lambda x: (cell.zero_(), nvfp4_triton.amax_into(x, cell)),
                                                              x) for x in xs], "floor: the bf16 read")
    add("nvfp4 quantize alone", label, nvfp4_bytes(n, k) - 2 * n * k,
        [partial(nvfp4_triton._launch_quant, x, cell, packed, scales, n, k) for x in xs],
        "floor: one read + the writes")


# --- CPU ---------------------------------------------------------------------------------------------

def copy_bandwidth_cpu() -> float:
    src = torch.ones(1 << 30, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return 2 * src.numel() / median_s(lambda: dst.copy_(src), 5)


def rotation(make, nbytes: int) -> list:
    """Enough inputs that a rotation through them does not fit in the last-level cache (256 MB)."""
    return [make(i) for i in range(max(2, min(16, -(-(256 << 20) // nbytes))))]


def cpu_rows(torch_reps: int, kernels: set[str]) -> tuple[float, list[dict]]:
    lib, nlib = recipe_cpu.load(), nvfp4_cpu.load()
    torch.set_num_threads(THREADS)
    bw = copy_bandwidth_cpu()
    print(f"CPU copy: {bw / 1e9:.2f} GB/s (read + write), {THREADS} threads; NVFP4 rows on "
          f"{'AVX-512' if nlib.kc_nvfp4_avx512() else 'AVX2 or plain C'} (KIMI_CONVERT_CPU_ISA=avx2 caps it)",
          flush=True)
    rows = []

    def add(kernel, label, nbytes, inputs, fn, ref, reps=9):
        state = {"i": 0}

        def step(f):
            state["i"] += 1
            return f(inputs[state["i"] % len(inputs)])
        t = median_s(lambda: step(fn), reps)
        tr = median_s(lambda: step(ref), torch_reps) if ref else None
        floor = nbytes / bw
        rows.append({"kernel": kernel, "shape": label, "bytes": nbytes, "floor_ms": floor * 1e3, "ms": t * 1e3,
                     "torch_ms": tr * 1e3 if tr else None})
        print(f"{kernel:24s} {label:28s} floor {floor * 1e3:.2f} ms | C {t * 1e3:.2f} ms = {t / floor:.2f}x | "
              f"torch {tr * 1e3 if tr else float('nan'):.1f} ms", flush=True)

    def mx(i, n, pk, window=True):
        p, sc = mx_inputs(n, pk, i, window)
        own = mxfp4_cast.k_max(sc)
        return p, sc, own, torch.zeros_like(p), torch.zeros((n, pk // 8), dtype=torch.uint8)  # touched: no faults

    for label, n, pk in CAST_SHAPES[:3] if "cast" in kernels else ():
        ins = rotation(lambda i, n=n, pk=pk: mx(i, n, pk), cast_bytes(n, pk))
        add("cast", label, cast_bytes(n, pk), ins,
            lambda a: recipe_cpu.cast_into(lib, a[0], a[1], a[2], a[2], *a[3:], threads=THREADS),
            lambda a: mxfp4_cast.cast(a[0], a[1], a[2]))
        if n == 3072 and pk == 3584:
            add("cast, whole call", label, cast_bytes(n, pk), ins,
                lambda a: recipe_cpu.cast(lib, *a[:3], a[2], threads=THREADS), None)
    if "cast" in kernels:
        ins = rotation(lambda i: mx(i, 3072, 3584, False), cast_bytes(3072, 3584))
        add("cast, exponents 0..254", CAST_SHAPES[0][0], cast_bytes(3072, 3584), ins,
            lambda a: recipe_cpu.cast_into(lib, a[0], a[1], a[2], a[2], *a[3:], threads=THREADS), None, reps=3)
    for label, n, k in FP8_SHAPES[:4] if "fp8" in kernels else ():
        xs = rotation(lambda i, n=n, k=k: (bf16_input(n, k, i), torch.zeros((n, k), dtype=torch.uint8),
                                           torch.zeros(fp8_block.scale_shape(n, k))), fp8_bytes(n, k))
        add("fp8-block", label, fp8_bytes(n, k), xs, lambda a: recipe_cpu.fp8_into(lib, *a, threads=THREADS),
            lambda a: fp8_block.quantize(a[0]))
        if (n, k) == (7168, 7168):
            add("fp8-block, whole call", label, fp8_bytes(n, k), xs,
                lambda a: recipe_cpu.fp8_quantize(lib, a[0], THREADS), None)
    for label, n, k in NVFP4_SHAPES if "nvfp4" in kernels else ():
        xs = rotation(lambda i, n=n, k=k: bf16_input(n, k, i), nvfp4_bytes(n, k))

        def nv(x, out=(None, None)):
            return nvfp4_cpu.quantize(nlib, x, reference.global_scale(nvfp4_cpu.amax(nlib, x, THREADS)), THREADS, *out)
        add("nvfp4 (amax + quantize)", label, nvfp4_bytes(n, k), xs, nv, None)
        outs = (torch.ones((n, k // 2), dtype=torch.uint8), torch.ones((n, k // 16), dtype=torch.uint8))  # touched
        add("nvfp4, outputs preallocated", label, nvfp4_bytes(n, k), xs, partial(nv, out=outs), None)
    return bw, rows


def table(device: str, bw: float, rows: list[dict]) -> str:
    if device == "cuda":
        out = [f"Copy bandwidth {bw / 1e12:.2f} TB/s (read + write).", "",
               "| kernel | shape | MB moved | floor ms | CUDA graph ms | / floor | do_bench ms | / floor | note |",
               "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            g = r["graph_ms"]
            out.append(f"| {r['kernel']} | {r['shape']} | {r['bytes'] / 1e6:.1f} | {r['floor_ms']:.4f} | "
                       f"{g:.4f} | **{g / r['floor_ms']:.2f}x** | {r['plain_ms']:.4f} | "
                       f"{r['plain_ms'] / r['floor_ms']:.2f}x | {r['note']} |" if g else
                       f"| {r['kernel']} | {r['shape']} | {r['bytes'] / 1e6:.1f} | {r['floor_ms']:.4f} | n/a | n/a | "
                       f"{r['plain_ms']:.4f} | {r['plain_ms'] / r['floor_ms']:.2f}x | {r['note']} |")
        return "\n".join(out)
    out = [f"Copy bandwidth {bw / 1e9:.2f} GB/s (read + write), {THREADS} threads.", "",
           "| kernel | shape | MB moved | floor ms | C ms | / floor | torch code ms |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        tr = f"{r['torch_ms']:.1f}" if r["torch_ms"] else "n/a"
        out.append(f"| {r['kernel']} | {r['shape']} | {r['bytes'] / 1e6:.1f} | {r['floor_ms']:.2f} | {r['ms']:.2f} | "
                   f"**{r['ms'] / r['floor_ms']:.2f}x** | {tr} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--variants", action="store_true", help="GPU: also time other tiles and rounding variants")
    ap.add_argument("--torch-reps", type=int, default=3, help="CPU: repetitions of the torch code")
    ap.add_argument("--kernels", nargs="+", choices=["cast", "fp8", "nvfp4"], default=["cast", "fp8", "nvfp4"])
    ap.add_argument("--orders", action="store_true", help="GPU: also time NVFP4's quantize tile orders")
    a = ap.parse_args()
    kernels = set(a.kernels)
    bw, rows = gpu_rows(a.variants, kernels, a.orders) if a.device == "cuda" else cpu_rows(a.torch_reps, kernels)
    print()
    print(table(a.device, bw, rows))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"recipe_kernels_{a.device}.json"), "w") as f:
            json.dump({"copy_bandwidth": bw, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
