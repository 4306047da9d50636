"""On the GPU: the recipe kernels (Triton, compiled) give the torch code's bytes at K3's shapes, and whole nvidia-k3
packs are unchanged by them.

    python benchmarks/recipe_gpu_check.py [--bench-k3]

- the MXFP4 -> NVFP4 cast: Triton on the GPU == torch code (``mxfp4_cast.cast``, CPU) == C kernel on K3-sized
  experts (in-window exponents with out-of-window and E8M0-0 blocks planted; exponents anywhere in 0..255), and
  Triton == C on every code under every E8M0 value, for every tensor maximum and several group maxima; flagged
  programs among unflagged ones (blocks planted at program edges) under several program sizes;
- block FP8: Triton == torch code on the CPU (the reference: torch 2.13's rounding) == C kernel at K3's attention
  shapes; Triton == C on one tile per positive finite bf16 amax (random values below it), both rounding variants
  (bits, conversion instructions); torch's own CUDA result is compared too, and where it differs, which tiles;
- NVFP4: the Triton kernel == the C kernel on large tensors, its amax under several program decompositions too;
- pack --recipe nvidia-k3 of tiny-k3 (and bench-k3, 1 layer, 8 experts, with --bench-k3): the torch code
  (KIMI_CONVERT_RECIPE_KERNELS=torch, the output before these kernels), --device cpu (C) and --device cuda
  (Triton) write the same files.
"""

from __future__ import annotations

import filecmp
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from kimi_convert.kernels import (
    RECIPE_KERNELS_ENV,
    fp8_block,
    get_backend,
    mxfp4_cast,
    nvfp4_triton,
    recipe_cpu,
    recipe_triton,
    reference,
)
from kimi_convert.pack import pack
from kimi_convert.plan import Options
from kimi_convert.synth import write_synth

LIB = recipe_cpu.load()
OK = True


def every_code_and_exponent(top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row e holds every byte of codes (16 blocks of 16 bytes) under E8M0 min(e, top) (as tests/)."""
    g = torch.Generator().manual_seed(top)
    packed = torch.arange(256, dtype=torch.uint8)[torch.randperm(256, generator=g)].repeat(256, 1)
    return packed, torch.arange(256).clamp(max=top).to(torch.uint8)[:, None].repeat(1, 16)


def tiles_below(amax_bits: list[int], seed: int = 0) -> torch.Tensor:
    """One 128x128 tile per amax (bf16 bits): random values of magnitude <= amax, both signs (as tests/)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.tensor(amax_bits, dtype=torch.int32).repeat_interleave(128)[None, :]
    mag = torch.randint(0, 1 << 30, (128, 128 * len(amax_bits)), generator=g, dtype=torch.int32) % (a + 1)
    bits = mag | (torch.randint(0, 2, mag.shape, generator=g, dtype=torch.int32) << 15)
    bits[0, ::128] = a[0, ::128]
    return bits.to(torch.int16).view(torch.bfloat16)


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)


def same(a, b) -> bool:
    return all(torch.equal(u8(x), u8(y)) for x, y in zip(a, b, strict=True))


def report(name: str, ok: bool, extra: str = "") -> None:
    global OK
    OK &= ok
    print(f"{'ok  ' if ok else 'FAIL'} {name} {extra}", flush=True)


def cast_checks() -> None:
    g = torch.Generator().manual_seed(0)
    for n, pk, kinds in ((3072, 3584, ("K3-like",)), (3072, 1792, ("K3-like", "0..255")), (3584, 1536, ("K3-like",))):
        for kind in kinds:
            packed = torch.randint(0, 256, (n, pk), generator=g, dtype=torch.uint8)
            lo, hi = (116, 125) if kind == "K3-like" else (0, 255)
            scale = torch.randint(lo, hi + 1, (n, pk // 16), generator=g, dtype=torch.uint8)
            if kind == "K3-like":
                scale[5, 7], scale[n // 2, 0], scale[n - 1, 3] = 90, 0, 100
            own = mxfp4_cast.k_max(scale)
            for shared in (own, own + 1):
                t = time.perf_counter()
                want = mxfp4_cast.cast(packed, scale, shared)
                t_torch = time.perf_counter() - t
                got = recipe_triton.cast(packed.cuda(), scale.cuda(), shared, own)
                c = recipe_cpu.cast(LIB, packed, scale, shared, own)
                ok = same(got[:3], want[:3]) and same(c[:3], want[:3]) and got[3] == want[3] == c[3]
                report(f"cast [{n}, {pk}] {kind} shared={shared}: triton == torch == C", ok,
                       f"(lossless {got[3].lossless}/{got[3].blocks}; torch code {t_torch:.2f} s)")
    bad = 0
    for top in range(256):
        packed, scale = every_code_and_exponent(top)
        own = mxfp4_cast.k_max(scale)
        for shared in sorted({own, min(128, own + 1), min(128, own + 9), min(128, own + 17), min(128, own + 18), 128}):
            got = recipe_triton.cast(packed.cuda(), scale.cuda(), shared, own)
            c = recipe_cpu.cast(LIB, packed, scale, shared, own)
            bad += not (same(got[:3], c[:3]) and got[3] == c[3])
    report("cast: every code under every E8M0, every tensor maximum, 4-6 group maxima: triton == C", bad == 0,
           f"({bad} differ)")
    cast_program_checks()


def cast_program_checks() -> None:
    """The two-kernel cast where flagged programs sit among unflagged ones: an expert [3072, 3584] with out-of-window
    and E8M0-0 blocks planted at the first, last and a middle block of programs (and one in a ragged last program),
    under the default program size and small ones (programs of 64, 256 and 512 blocks, 1 to 512 flags a long-path
    program),
    and the every-code sweep under the small ones."""
    g = torch.Generator().manual_seed(5)
    n, pk = 3072, 3584
    packed = torch.randint(0, 256, (n + 1, pk), generator=g, dtype=torch.uint8)
    scale = torch.randint(116, 126, (n + 1, pk // 16), generator=g, dtype=torch.uint8)
    flat = scale.view(-1)
    for i in (0, 1023, 1024, 4096 + 512, 64 * 1000 + 63, 256 * 700, flat.numel() - 1):
        flat[i] = 90 if i % 2 else 0
    own = mxfp4_cast.k_max(scale)
    default = recipe_triton.CAST_BLOCKS, recipe_triton.CAST_SLOW
    bad = 0
    for blocks, slow in (default, ((64, 4), (1 << 20, 32, 4)), ((256, 4), (8, 16, 4)), ((512, 8), (512, 64, 8))):
        recipe_triton.CAST_BLOCKS, recipe_triton.CAST_SLOW = blocks, slow
        for shared in (own, own + 1):
            want = mxfp4_cast.cast(packed, scale, shared)
            got = recipe_triton.cast(packed.cuda(), scale.cuda(), shared, own)
            ok = same(got[:3], want[:3]) and got[3] == want[3]
            report(f"cast [{n + 1}, {pk}] planted at program edges, programs {blocks}, long path {slow}, "
                   f"shared={shared}: triton == torch", ok)
        for top in range(0, 256, 5) if blocks != default[0] else ():
            p, sc = every_code_and_exponent(top)
            o = mxfp4_cast.k_max(sc)
            for shared in sorted({o, min(128, o + 1), min(128, o + 18)}):
                got = recipe_triton.cast(p.cuda(), sc.cuda(), shared, o)
                c = recipe_cpu.cast(LIB, p, sc, shared, o)
                bad += not (same(got[:3], c[:3]) and got[3] == c[3])
    recipe_triton.CAST_BLOCKS, recipe_triton.CAST_SLOW = default
    report("cast: every code under every fifth E8M0 maximum, small programs: triton == C", bad == 0, f"({bad} differ)")


def fp8_checks() -> None:
    for n, k in ((7168, 7168), (12288, 7168), (7168, 12288), (576, 7168), (96, 7168), (1000, 1001)):
        w = (torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.02).to(torch.bfloat16)
        w[:128, :256] = 0  # two zero tiles
        t = time.perf_counter()
        want = fp8_block.quantize(w)
        t_torch = time.perf_counter() - t
        got = recipe_triton.fp8_quantize(w.cuda())
        cuda_torch = fp8_block.quantize(w.cuda())
        c = recipe_cpu.fp8_quantize(LIB, w)
        report(f"fp8 [{n}, {k}]: triton == torch (CPU) == C", same(got, want) and same(c, want),
               f"(torch CUDA same: {same(cuda_torch, want)}; torch code {t_torch:.2f} s)")
    bits = list(range(1, 0x7F80))
    tiles_bad = {"bits": 0, "hw-cvt": 0, "torch CUDA": 0}
    sub_scale = 0
    for i in range(0, len(bits), 4096):
        w = tiles_below(bits[i : i + 4096], i)
        c = recipe_cpu.fp8_quantize(LIB, w)
        wc = w.cuda()
        cq = c[0].view(torch.uint8).reshape(128, -1, 128)
        for name, res in (("bits", launch(wc, False)), ("hw-cvt", launch(wc, True)),
                          ("torch CUDA", fp8_block.quantize(wc))):
            q = res[0].view(torch.uint8).cpu().reshape(128, -1, 128)
            diff = (q != cq).any(dim=2).any(dim=0) | (res[1].cpu().reshape(-1) != c[1].reshape(-1))
            tiles_bad[name] += int(diff.sum())
            if name == "torch CUDA":
                sub_scale += int((diff & (c[1].reshape(-1) < 2.0**-126)).sum())
    report("fp8: one tile per positive finite bf16 amax (32639 tiles): triton (bits) == C", tiles_bad["bits"] == 0,
           f"({tiles_bad['bits']} tiles differ)")
    print(f"info fp8 sweep: triton with conversion instructions: {tiles_bad['hw-cvt']} tiles differ from C; torch's "
          f"own CUDA code: {tiles_bad['torch CUDA']} tiles differ from the CPU reference, {sub_scale} of them with a "
          f"subnormal scale", flush=True)


def launch(w, hw):
    n, k = w.shape
    q = torch.empty((n, k), dtype=torch.uint8, device=w.device)
    s = torch.empty(fp8_block.scale_shape(n, k), device=w.device)
    recipe_triton.launch_fp8(w, q, s, hw=hw)
    return q, s


def nvfp4_checks() -> None:
    gpu, cpu = get_backend("cuda"), get_backend("cpu")
    g = torch.Generator().manual_seed(1)
    cases = {"8192x7168 bf16": torch.randn(8192, 7168, generator=g).to(torch.bfloat16),
             "2048x7168 bf16 x1e30": (torch.randn(2048, 7168, generator=g) * 1e30).to(torch.bfloat16),
             "2048x7168 bf16 x1e-30": (torch.randn(2048, 7168, generator=g) * 1e-30).to(torch.bfloat16),
             "1024x4096 fp32": torch.randn(1024, 4096, generator=g)}
    for name, w in cases.items():
        res = []
        for b in (gpu, cpu):
            a = b.amax(w)
            p, s = b.quantize(w, a)
            res.append((a, p, s))
        report(f"nvfp4 {name}: triton == C", same(res[0], res[1]))
    w = cases["8192x7168 bf16"][:1024]
    ref = reference.quantize(w, reference.global_scale(w.abs().amax().float()))
    report("nvfp4 1024x7168: triton == torch reference", same(gpu.quantize(w, gpu.amax(w)), ref))
    for name, w in cases.items():  # amax programs of one step (session 5's decomposition) and of many
        wc = w.cuda()
        cells = [torch.zeros(1, device="cuda") for _ in range(3)]
        for cell, tile in zip(cells, (None, (8192, 1 << 40, 4), (1024, 64, 2)), strict=True):
            nvfp4_triton.amax_into(wc, cell, tile)
        report(f"nvfp4 {name}: amax of every tile == C's", all(float(c) == float(cpu.amax(w)) for c in cells))


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def pack_checks() -> None:
    import sys

    work = Path(tempfile.mkdtemp())
    opts = Options(recipe="nvidia-k3", max_shard_size=500_000_000)
    presets = [("tiny-k3", {})] + ([("bench-k3", {"layers": 1, "experts": 8})] if "--bench-k3" in sys.argv else [])
    for preset, kw in presets:
        src = write_synth(preset, work / preset, **kw)
        times = {}
        for label, dev in (("torch", "cpu"), ("cpu", "cpu"), ("cuda", "cuda")):
            if label == "torch":
                os.environ[RECIPE_KERNELS_ENV] = "torch"
            t = time.perf_counter()
            pack(src, work / f"{preset}-{label}", opts, device=dev, progress=False)
            times[label] = time.perf_counter() - t
            os.environ.pop(RECIPE_KERNELS_ENV, None)
        ref = work / f"{preset}-torch"
        names = files_under(ref)  # every file, those in folders (docs/, manifest-records/) too
        for label in ("cpu", "cuda"):
            d = work / f"{preset}-{label}"
            ok = names == files_under(d) and all(filecmp.cmp(ref / n, d / n, shallow=False) for n in names)
            report(f"pack {preset} --recipe nvidia-k3: --device {label} == torch code, every file", ok)
        print("info pack seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()), flush=True)
    shutil.rmtree(work)


def main() -> None:
    for step in (cast_checks, fp8_checks, nvfp4_checks, pack_checks):
        t = time.perf_counter()
        step()
        print(f"info {step.__name__}: {time.perf_counter() - t:.1f} s", flush=True)
    print("ALL EQUAL" if OK else "MISMATCH")


if __name__ == "__main__":
    main()
