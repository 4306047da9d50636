"""Fused modules: quantize member by member under one joint amax (what pack does) against
concatenating the members first and quantizing the fused tensor (what the bytes must equal).

    python benchmarks/fused_layout.py [--device cpu|cuda]

Members shaped like Kimi K3's fused_qkvg_proj: 4 x [P, 7168] bf16 with P = 12288 on the GPU
(704 MB in all), P = 1024 on the CPU. Prints the median time of each way and checks equal bytes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kimi_convert.kernels import get_backend


def median_ms(fn, reps: int, sync) -> float:
    fn()
    sync()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    b = get_backend(a.device)
    p = 12288 if b.device.type == "cuda" else 1024
    g = torch.Generator().manual_seed(0)
    members = [(torch.randn(p, 7168, generator=g) * (i + 1)).to(torch.bfloat16).to(b.device) for i in range(4)]
    sync = torch.cuda.synchronize if b.device.type == "cuda" else (lambda: None)

    def memberwise():
        amax = torch.stack([b.amax(m).reshape(()) for m in members]).max()
        return [b.quantize(m, amax) for m in members]

    def concatenated():
        fused = torch.cat(members)
        return b.quantize(fused, b.amax(fused))

    reps = 20 if b.device.type == "cuda" else 5
    t_member, t_cat = median_ms(memberwise, reps, sync), median_ms(concatenated, reps, sync)
    parts, whole = memberwise(), concatenated()
    same = torch.equal(torch.cat([x[0] for x in parts]).cpu(), whole[0].cpu()) and torch.equal(
        torch.cat([x[1] for x in parts]).view(torch.uint8).cpu(), whole[1].view(torch.uint8).cpu())
    mb = sum(m.numel() * 2 for m in members) / 1e6
    print(f"{b.name} on {b.device}, 4 x [{p}, 7168] bf16 ({mb:.0f} MB): member by member {t_member:.2f} ms, "
          f"concatenate then quantize {t_cat:.2f} ms; same bytes: {same}")


if __name__ == "__main__":
    main()
