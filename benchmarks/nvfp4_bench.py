"""NVFP4 weight quantization: this project's kernels against ModelOpt and compressed-tensors.

    python benchmarks/nvfp4_bench.py --device cuda   # H200: memory floor, Triton kernel, ModelOpt, c-t
    python benchmarks/nvfp4_bench.py --device cpu    # 2 cores: C kernel, torch reference, ModelOpt, c-t

ModelOpt (nvidia-modelopt) and compressed-tensors are optional: install them to compare (on the
GPU machine, carry their wheels). On the GPU every timing is the median of triton.testing.do_bench
over inputs rotated among 8 copies (so no run is served from L2); the floor is (2 reads of the bf16
input + the packed output + the scales) / the device-to-device copy bandwidth measured in the same run.
Each tool's output bytes are also compared with this project's (ModelOpt's math is the reference).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from kimi_convert.devices import cpus
from kimi_convert.kernels import nvfp4_cpu, reference

SHAPES = [(3072, 7168), (7168, 3072), (6144, 7168), (32768, 7168)]


def modelopt_fn():
    try:
        from modelopt.torch.quantization.qtensor import NVFP4QTensor
    except Exception as e:  # optional comparison
        return None, f"{type(e).__name__}: {e}"

    def run(w):
        q, s, s2 = NVFP4QTensor.quantize(w, 16)
        return q._quantized_data, s, s2
    return run, ""


def ct_fn():
    try:
        from compressed_tensors.compressors.nvfp4.helpers import quantize_and_pack_fp4
        from compressed_tensors.quantization import QuantizationArgs
        from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"
    args = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True)

    def run(w):
        amax = w.abs().amax().float().reshape(1)
        gs = generate_gparam(-amax, amax)
        g = w.reshape(w.shape[0], -1, 16)
        scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), args, global_scale=gs)
        return quantize_and_pack_fp4(w, scale, gs), scale, gs
    return run, ""


def ours_gpu(w):
    from kimi_convert.kernels import nvfp4_triton
    a = torch.zeros(1, dtype=torch.float32, device=w.device)
    nvfp4_triton.amax_into(w, a)
    return nvfp4_triton.quantize(w, a)


def same_bytes(a, b) -> bool:
    try:
        return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8).reshape(-1).cpu(),
                                                  b.contiguous().view(torch.uint8).reshape(-1).cpu())
    except Exception:
        return False


def copy_bandwidth() -> float:
    """Device-to-device copy of 1 GiB: bytes read + written per second."""
    import triton.testing as tt

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = tt.do_bench(lambda: dst.copy_(src), warmup=50, rep=500, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


class Rotating:
    """Eight random inputs of one shape, handed out in turn so that no timed run is served from L2."""

    def __init__(self, n: int, k: int):
        g = torch.Generator(device="cuda").manual_seed(n * k)
        self.ws = [torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16) for _ in range(8)]
        self.i = 0

    def next(self) -> torch.Tensor:
        self.i += 1
        return self.ws[self.i % len(self.ws)]


def _fmt(x: float | None, floor: float | None = None) -> str:
    if x is None:
        return "n/a"
    return f"{x / floor:.1f}x" if floor else f"{x:.4f}"


def bench_shape(n: int, k: int, bw: float, mo, ct, lib) -> dict:
    import triton.testing as tt

    rot = Rotating(n, k)
    w0 = rot.ws[0]
    floor_ms = (2 * n * k * 2 + n * k // 2 + n * k // 16) / bw * 1e3
    row = {"shape": f"{n}x{k}", "floor_ms": floor_ms}
    row["ours_ms"] = tt.do_bench(lambda: ours_gpu(rot.next()), warmup=50, rep=500, return_mode="median")
    try:
        row["ours_graph_ms"] = tt.do_bench_cudagraph(lambda: ours_gpu(w0), rep=500, return_mode="median")
    except Exception as e:
        row["ours_graph_ms"] = None
        print("cudagraph:", e)
    p, s = ours_gpu(w0)
    amax = w0.abs().amax().float().cpu()
    cp, cs = nvfp4_cpu.quantize(lib, w0.cpu(), reference.global_scale(amax), cpus())
    row["ours_eq_cpu_kernel"] = same_bytes(p, cp) and same_bytes(s, cs)
    for name, (fn, err) in (("modelopt", mo), ("ct", ct)):
        if fn is None:
            row[f"{name}_ms"] = None
            row[f"{name}_note"] = err
            continue
        row[f"{name}_ms"] = tt.do_bench(lambda fn=fn: fn(rot.next()), warmup=20, rep=300, return_mode="median")
        q, sc, _ = fn(w0)
        row[f"{name}_same_bytes"] = same_bytes(q, p) and same_bytes(sc, s)
    return row


def gpu(shapes) -> list[dict]:

    bw = copy_bandwidth()
    print(f"device copy: {bw / 1e12:.2f} TB/s (read + write)")
    mo, ct = modelopt_fn(), ct_fn()
    lib = nvfp4_cpu.load()
    rows = [bench_shape(n, k, bw, mo, ct, lib) for n, k in shapes]
    print("\n| shape | floor ms | ours ms | ours / floor | ours (CUDA graph) ms | ModelOpt ms | ModelOpt / floor "
          "| compressed-tensors ms | c-t / floor | ours == C kernel | ModelOpt same bytes | c-t same bytes |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        fl = r["floor_ms"]
        print(f"| {r['shape']} | {fl:.4f} | {r['ours_ms']:.4f} | {r['ours_ms'] / fl:.2f}x | "
              f"{_fmt(r['ours_graph_ms'])} | {_fmt(r['modelopt_ms'])} | {_fmt(r['modelopt_ms'], fl)} | "
              f"{_fmt(r['ct_ms'])} | {_fmt(r['ct_ms'], fl)} | {r['ours_eq_cpu_kernel']} | "
              f"{r.get('modelopt_same_bytes', 'n/a')} | {r.get('ct_same_bytes', 'n/a')} |")
    return [{"copy_TBps": bw / 1e12}, *rows]


def timeit(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def cpu(shape) -> list[dict]:
    n, k = shape
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(0))).to(torch.bfloat16)
    gb = w.numel() * 2 / 1e9
    lib = nvfp4_cpu.load()

    def ours():
        a = nvfp4_cpu.amax(lib, w, cpus())
        return nvfp4_cpu.quantize(lib, w, reference.global_scale(a), cpus())

    def ref():
        return reference.quantize(w, reference.global_scale(w.abs().amax().float()))
    rows = [("this project, C kernel", timeit(ours, 7)), ("this project, torch reference", timeit(ref, 3))]
    for name, (fn, err) in (("ModelOpt NVFP4QTensor.quantize", modelopt_fn()), ("compressed-tensors", ct_fn())):
        rows.append((name, timeit(lambda fn=fn: fn(w), 3) if fn else None))
        if fn is None:
            print(f"{name}: not installed ({err})")
    p, s = ours()
    for name, (fn, _) in (("ModelOpt", modelopt_fn()), ("compressed-tensors", ct_fn())):
        if fn:
            q, sc, _ = fn(w)
            print(f"{name} gives the same bytes as this project: {same_bytes(q, p) and same_bytes(sc, s)}")
    mo = next((t for name, t in rows if name.startswith("ModelOpt")), None)
    print(f"\nCPU, {torch.get_num_threads()} threads, {n}x{k} bf16 ({gb * 1e3:.0f} MB)\n")
    print("| quantizer | ms | GB/s of bf16 input | vs ModelOpt |")
    print("|---|---|---|---|")
    for name, t in rows:
        if t is None:
            print(f"| {name} | n/a | n/a | n/a |")
            continue
        print(f"| {name} | {t * 1e3:.1f} | {gb / t:.3f} | {mo / t:.1f}x |" if mo else f"| {name} | {t * 1e3:.1f} | "
              f"{gb / t:.3f} | n/a |")
    return [{"name": nme, "seconds": t} for nme, t in rows]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES))
    a = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    res = gpu(shapes) if a.device == "cuda" else cpu(shapes[0])
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"nvfp4_bench_{a.device}.json"), "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
