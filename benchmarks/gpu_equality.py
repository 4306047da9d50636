"""On the GPU: the Triton kernel against the C CPU kernel on large random tensors, and whole packs
with --device cuda against --device cpu, byte for byte.  python benchmarks/gpu_equality.py"""

from __future__ import annotations

import filecmp
import shutil
import tempfile
import time
from pathlib import Path

import torch

from kimi_convert.kernels import get_backend
from kimi_convert.pack import pack
from kimi_convert.plan import Options
from kimi_convert.synth import write_synth


def tensors():
    g = torch.Generator().manual_seed(0)
    yield "8192x7168 bf16", torch.randn(8192, 7168, generator=g).to(torch.bfloat16)
    yield "4099x4112 fp32 x1e-30", torch.randn(4099, 4112, generator=g) * 1e-30
    yield "3001x2048 fp16 outliers", (torch.randn(3001, 2048, generator=g) * torch.rand(3001, 1, generator=g) * 100
                                      ).to(torch.float16)
    w = torch.randn(2048, 7168, generator=g)
    w[::7, :64] = 0
    w[1::5, 128:144] *= 1e-8
    yield "2048x7168 bf16 zeros+underflow", w.to(torch.bfloat16)
    yield "6144x7168 bf16 x1e30", (torch.randn(6144, 7168, generator=g) * 1e30).to(torch.bfloat16)


def main() -> None:
    gpu, cpu = get_backend("cuda"), get_backend("cpu")
    assert gpu.name == "triton" and cpu.name == "cpu", (gpu, cpu)
    ok = True
    for name, w in tensors():
        res = []
        for b in (gpu, cpu):
            a = b.amax(w)
            p, s = b.quantize(w, a)
            res.append((a.cpu(), p.cpu(), s.cpu().view(torch.uint8)))
        same = all(torch.equal(x, y) for x, y in zip(res[0], res[1], strict=True))
        ok &= same
        print(f"{name}: triton == C kernel: {same}")
    work = Path(tempfile.mkdtemp())
    # (preset, synth options, pack options): --layout vllm quantizes K3's fused_qkv_a_g_proj as one tensor
    for preset, kw, opts in (("tiny-k3", {}, {}), ("tiny-k3", {}, {"layout": "vllm"}), ("tiny-kimi-linear", {}, {}),
                             ("tiny-deepseek-fp8", {}, {}), ("bench-kimi-linear", {"layers": 1}, {}),
                             ("bench-k3", {"layers": 1, "experts": 8}, {}),
                             ("bench-k3", {"layers": 1, "experts": 8}, {"layout": "vllm"})):
        src = write_synth(preset, work / preset, **kw)
        times = {}
        for dev in ("cuda", "cpu"):
            t = time.perf_counter()
            pack(src, work / f"{preset}-{dev}", Options(max_shard_size=500_000_000, **opts), device=dev,
                 progress=False)
            times[dev] = time.perf_counter() - t
        a, b = work / f"{preset}-cuda", work / f"{preset}-cpu"
        names = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())  # side files in sub-folders too
        same = names == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file()) and all(
            filecmp.cmp(a / n, b / n, shallow=False) for n in names)
        ok &= same
        size = sum(p.stat().st_size for p in src.rglob("*") if p.is_file()) / 1e9
        print(f"pack {preset} {opts or ''} ({size:.2f} GB): --device cuda == --device cpu byte for byte: {same} "
              f"(cuda {times['cuda']:.1f} s, cpu {times['cpu']:.1f} s)")
        for d in (src, a, b):
            shutil.rmtree(d)
    print("ALL EQUAL" if ok else "MISMATCH")


if __name__ == "__main__":
    main()
