"""The C kernels give the torch code's bytes on this machine (its compiler, its CPU), at every core.

    python benchmarks/cpu_kernels_check.py [--fp8-every-amax]

- NVFP4: every finite bf16 value, shuffled into rows of 4096, under four global scales (the tensor's own, 1e-30,
  3e20, 1), and sorted by magnitude (so that block scales sweep e4m3's range), rolled by 0, 5 and 11, under 243
  global scales across [2^-80, 2^80] (the kernel's one-reciprocal-a-block range), against ``reference.quantize``;
- block FP8: 7168x7168 and 1000x1001 bf16 (an all-zero tile planted) against ``fp8_block.quantize``;
- the MXFP4 cast: an expert 3072x7168 with exponents in K3's band (every row the closed form, codes streamed) and
  anywhere in 0..255, against ``mxfp4_cast.cast``.
- ``--fp8-every-amax``: block FP8 of one 128x128 tile per positive finite bf16 amax (32,512 tiles, 532 M values:
  the amax planted, the rest uniform below it), in 4 tensors of 8,128 tiles.
Prints one line a case and ``all equal: True/False``; exits 1 when something differs.
"""

from __future__ import annotations

import argparse

import torch
from recipe_kernels import bf16_input, mx_inputs  # benchmarks/ is sys.path[0] when run as a script

from kimi_convert.devices import cpus
from kimi_convert.kernels import fp8_block, mxfp4_cast, nvfp4_cpu, recipe_cpu, reference


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def every_amax(lib, threads: int, say) -> None:
    positive = torch.arange(1, 0x7F80, dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    for part in range(4):
        am = positive[part::4]
        am = am[: am.numel() // 64 * 64]
        amax = am.to(torch.int16).view(torch.bfloat16).float()
        bands = am.numel() // 64
        vals = (torch.rand(bands, 128, 64, 128, generator=g) * 2 - 1) * amax.reshape(bands, 1, 64, 1)
        vals[:, 0, :, 0] = amax.reshape(bands, 64)
        w = vals.reshape(bands * 128, 64 * 128).to(torch.bfloat16)
        del vals
        q, sc = recipe_cpu.fp8_quantize(lib, w, threads)
        rq, rsc = fp8_block.quantize(w)
        same = torch.equal(u8(q), u8(rq)) and torch.equal(sc, rsc)
        say(f"fp8-block every amax, part {part}: {am.numel()} tiles", same)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fp8-every-amax", action="store_true")
    a = ap.parse_args()
    threads, lib, nlib = cpus(), recipe_cpu.load(), nvfp4_cpu.load()
    ok = True

    def say(name: str, same: bool) -> None:
        nonlocal ok
        ok &= same
        print(f"{name:60s} {'equal' if same else 'DIFFERS'}", flush=True)

    print(f"NVFP4 rows on {'AVX-512' if nlib.kc_nvfp4_avx512() else 'AVX2 or plain C'} (KIMI_CONVERT_CPU_ISA=avx2 "
          "caps them)", flush=True)

    every = torch.arange(0, 65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    finite = every[torch.isfinite(every.float())]
    g = torch.Generator().manual_seed(0)
    x = finite[torch.randperm(finite.numel(), generator=g)]
    x = x[: x.numel() // 4096 * 4096].reshape(-1, 4096)
    for s2 in (reference.global_scale(x.float().abs().amax()), torch.tensor(1e-30), torch.tensor(3e20),
               torch.tensor(1.0)):
        p, s = nvfp4_cpu.quantize(nlib, x, s2, threads)
        rp, rs = reference.quantize(x, s2)
        say(f"nvfp4 every finite bf16, s2 {float(s2):.3g}", torch.equal(p, rp) and torch.equal(u8(s), u8(rs)))
    ordered = finite[finite.float().abs().argsort()]
    x = torch.stack([torch.roll(ordered, r)[: ordered.numel() // 2048 * 2048] for r in (0, 5, 11)]).reshape(-1, 2048)
    same = True
    for e in range(-80, 81, 2):
        for frac in (1.0, 1.2345, 1.75):
            s2 = torch.tensor(2.0 ** e * frac, dtype=torch.float32)
            p, s = nvfp4_cpu.quantize(nlib, x, s2, threads)
            rp, rs = reference.quantize(x, s2)
            same &= torch.equal(p, rp) and torch.equal(u8(s), u8(rs))
    say("nvfp4 every finite bf16 by magnitude, 243 global scales in [2^-80, 2^80]", same)
    for n, k in ((7168, 7168), (1000, 1001)):
        w = bf16_input(n, k, 1)
        w[128:256, 256:384] = 0
        q, sc = recipe_cpu.fp8_quantize(lib, w, threads)
        rq, rsc = fp8_block.quantize(w)
        say(f"fp8-block {n}x{k}", torch.equal(u8(q), u8(rq)) and torch.equal(u8(sc), u8(rsc)))
    for window in (True, False):
        packed, scale = mx_inputs(3072, 3584, 2, window)
        own = mxfp4_cast.k_max(scale)
        for shared in (own, own + 1):
            got = recipe_cpu.cast(lib, packed, scale, shared, own, threads)
            want = mxfp4_cast.cast(packed, scale, shared)
            same = all(torch.equal(u8(a), u8(b)) for a, b in zip(got[:3], want[:3], strict=True)) and got[3] == want[3]
            say(f"cast 3072x7168 exponents {'in K3 band' if window else '0..255'}, shared k_max own+{shared - own}",
                same)
    if a.fp8_every_amax:
        every_amax(lib, threads, say)
    print(f"all equal: {ok} ({threads} threads)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
