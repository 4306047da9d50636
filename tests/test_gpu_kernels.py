"""The kernels at K3's sizes on the GPU machine (was benchmarks/recipe_gpu_check.py, gpu_equality.py's kernel step,
cpu_kernels_check.py, and a sample of gpu_division_check.py): Triton compiled on the GPU == the C kernels == the
torch code, byte for byte, on tensors too large, and sweeps too long, for CI's interpreter. Marked ``gpu`` and
skipped without CUDA (tests/gpu_compare.py); the comparisons are checked on planted differences in test_gpu.py.
The C kernels' checks need no GPU, but the GPU machine's CPUs are where their widest row (AVX-512) runs."""

from __future__ import annotations

import os

import pytest
import torch

from gpu_compare import GPU, differing_tensors, differing_tiles
from kimi_convert.devices import cpus, get_backend
from kimi_convert.kernels import fp8_block, mxfp4_cast, nvfp4_cpu, recipe_cpu, reference

pytestmark = GPU
THREADS = cpus()


@pytest.fixture(scope="module")
def lib():
    return recipe_cpu.load()


def mx_inputs(n: int, pk: int, seed: int, window: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """An MXFP4 expert: random codes; E8M0 exponents in K3's band (with an out-of-window and an E8M0-0 block
    planted) or anywhere in 0..254 (0xFF is NaN, refused)."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, pk), generator=g, dtype=torch.uint8)
    lo, hi = (116, 125) if window else (0, 254)
    scale = torch.randint(lo, hi + 1, (n, pk // 16), generator=g, dtype=torch.uint8)
    if window:
        scale[5, 7], scale[n // 2, 0], scale[n - 1, 3] = 90, 0, 100
    return packed, scale


def every_code_and_exponent(top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row e holds every byte of codes (16 blocks of 16 bytes) under E8M0 min(e, top) (top <= 254: 0xFF is NaN)."""
    g = torch.Generator().manual_seed(top)
    packed = torch.arange(256, dtype=torch.uint8)[torch.randperm(256, generator=g)].repeat(255, 1)
    return packed, torch.arange(255).clamp(max=top).to(torch.uint8)[:, None].repeat(1, 16)


def tiles_below(amax_bits: list[int], seed: int = 0) -> torch.Tensor:
    """One 128x128 bf16 tile per amax (bf16 bits): random values of magnitude <= amax, both signs."""
    g = torch.Generator().manual_seed(seed)
    a = torch.tensor(amax_bits, dtype=torch.int32).repeat_interleave(128)[None, :]
    mag = torch.randint(0, 1 << 30, (128, 128 * len(amax_bits)), generator=g, dtype=torch.int32) % (a + 1)
    bits = mag | (torch.randint(0, 2, mag.shape, generator=g, dtype=torch.int32) << 15)
    bits[0, ::128] = a[0, ::128]
    return bits.to(torch.int16).view(torch.bfloat16)


def cast_differs(got, want) -> bool:
    return bool(differing_tensors(got[:3], want[:3])) or got[3] != want[3]


# --- MXFP4 -> NVFP4 cast -------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,pk,window", [(3072, 3584, True), (3072, 1792, True), (3072, 1792, False),
                                         (3584, 1536, True)])
def test_cast_triton_equals_torch_and_c_on_k3_experts(lib, n, pk, window):
    from kimi_convert.kernels import recipe_triton

    packed, scale = mx_inputs(n, pk, n + pk, window)
    own = mxfp4_cast.k_max(scale)
    for shared in (own, own + 1):
        want = mxfp4_cast.cast(packed, scale, shared)
        assert not cast_differs(recipe_triton.cast(packed.cuda(), scale.cuda(), shared, own), want), shared
        assert not cast_differs(recipe_cpu.cast(lib, packed, scale, shared, own, THREADS), want), shared


def test_cast_triton_equals_c_on_every_code_under_every_exponent(lib):
    from kimi_convert.kernels import recipe_triton

    bad = []
    for top in range(255):
        packed, scale = every_code_and_exponent(top)
        own = mxfp4_cast.k_max(scale)
        for shared in sorted({own, *(min(128, own + d) for d in (1, 9, 17, 18)), 128}):
            if cast_differs(recipe_triton.cast(packed.cuda(), scale.cuda(), shared, own),
                            recipe_cpu.cast(lib, packed, scale, shared, own)):
                bad.append((top, shared))
    assert bad == []


@pytest.mark.parametrize("blocks,slow", [(None, None), ((64, 4), (1 << 20, 32, 4)), ((256, 4), (8, 16, 4)),
                                         ((512, 8), (512, 64, 8))])
def test_cast_flagged_programs_among_unflagged_ones(lib, monkeypatch, blocks, slow):
    """Out-of-window and E8M0-0 blocks at the first, last and middle blocks of programs and in a ragged last one,
    under the default program size and small ones (1 to 512 flags a long-path program)."""
    from kimi_convert.kernels import recipe_triton

    if blocks:
        monkeypatch.setattr(recipe_triton, "CAST_BLOCKS", blocks)
        monkeypatch.setattr(recipe_triton, "CAST_SLOW", slow)
    g = torch.Generator().manual_seed(5)
    packed = torch.randint(0, 256, (3073, 3584), generator=g, dtype=torch.uint8)
    scale = torch.randint(116, 126, (3073, 224), generator=g, dtype=torch.uint8)
    flat = scale.view(-1)
    for i in (0, 1023, 1024, 4096 + 512, 64 * 1000 + 63, 256 * 700, flat.numel() - 1):
        flat[i] = 90 if i % 2 else 0
    own = mxfp4_cast.k_max(scale)
    for shared in (own, own + 1):
        want = mxfp4_cast.cast(packed, scale, shared)
        assert not cast_differs(recipe_triton.cast(packed.cuda(), scale.cuda(), shared, own), want), shared
    for top in range(0, 255, 5) if blocks else ():
        p, sc = every_code_and_exponent(top)
        o = mxfp4_cast.k_max(sc)
        for shared in sorted({o, min(128, o + 1), min(128, o + 18)}):
            got = recipe_triton.cast(p.cuda(), sc.cuda(), shared, o)
            assert not cast_differs(got, recipe_cpu.cast(lib, p, sc, shared, o)), (top, shared)


# --- block FP8 -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,k", [(7168, 7168), (12288, 7168), (7168, 12288), (576, 7168), (96, 7168), (1000, 1001)])
def test_fp8_triton_equals_torch_and_c_at_k3_shapes(lib, n, k):
    from kimi_convert.kernels import recipe_triton

    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.02).to(torch.bfloat16)
    w[:128, :256] = 0  # two zero tiles
    want = fp8_block.quantize(w)
    assert differing_tensors(recipe_triton.fp8_quantize(w.cuda()), want) == []
    assert differing_tensors(recipe_cpu.fp8_quantize(lib, w, THREADS), want) == []


def test_fp8_triton_equals_c_on_one_tile_per_bf16_amax(lib):
    """Every positive finite bf16 amax (32,639 tiles, 535 M values), both roundings (fp32 splits, and the
    conversion instructions where the GPU has them: the default)."""
    from kimi_convert.kernels import recipe_triton

    bits = list(range(1, 0x7F80))
    bad = {False: 0, True: 0}
    for i in range(0, len(bits), 4096):
        w = tiles_below(bits[i : i + 4096], i)
        cq, cs = recipe_cpu.fp8_quantize(lib, w, THREADS)
        wc = w.cuda()
        for hw in bad:
            q = torch.empty(wc.shape, dtype=torch.uint8, device="cuda")
            s = torch.empty(fp8_block.scale_shape(*wc.shape), device="cuda")
            recipe_triton.launch_fp8(wc, q, s, hw=hw)
            bad[hw] += int(differing_tiles(q, cq, s, cs).sum())
    assert bad == {False: 0, True: 0}


# --- NVFP4 ---------------------------------------------------------------------------------------------------

def nvfp4_cases():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(2048, 7168, generator=g)
    w[::7, :64] = 0
    w[1::5, 128:144] *= 1e-8
    return {
        "8192x7168 bf16": lambda: torch.randn(8192, 7168, generator=g).to(torch.bfloat16),
        "6144x7168 bf16 x1e30": lambda: (torch.randn(6144, 7168, generator=g) * 1e30).to(torch.bfloat16),
        "2048x7168 bf16 x1e-30": lambda: (torch.randn(2048, 7168, generator=g) * 1e-30).to(torch.bfloat16),
        "2048x7168 bf16 zeros+underflow": lambda: w.to(torch.bfloat16),
        "4099x4112 fp32 x1e-30": lambda: torch.randn(4099, 4112, generator=g) * 1e-30,
        "3001x2048 fp16 outliers": lambda: (torch.randn(3001, 2048, generator=g)
                                            * torch.rand(3001, 1, generator=g) * 100).to(torch.float16),
    }


@pytest.mark.parametrize("case", list(nvfp4_cases()))
def test_nvfp4_triton_equals_c_and_its_amax_under_every_decomposition(case):
    from kimi_convert.kernels import nvfp4_triton

    w = nvfp4_cases()[case]()
    gpu, cpu = get_backend("cuda"), get_backend("cpu")
    assert gpu.name == "triton" and cpu.name == "cpu"
    got = [gpu.amax(w), *gpu.quantize(w, gpu.amax(w))]
    want = [cpu.amax(w), *cpu.quantize(w, cpu.amax(w))]
    assert differing_tensors(got, want) == []
    wc = w.cuda()
    for tile in (None, (8192, 1 << 40, 4), (1024, 64, 2)):  # amax programs of one step and of many
        cell = torch.zeros(1, device="cuda")
        nvfp4_triton.amax_into(wc, cell, tile)
        assert float(cell) == float(want[0]), tile


def test_nvfp4_triton_equals_the_torch_reference():
    w = (torch.randn(1024, 7168, generator=torch.Generator().manual_seed(1))).to(torch.bfloat16)
    gpu = get_backend("cuda")
    want = reference.quantize(w, reference.global_scale(w.abs().amax().float()))
    assert differing_tensors(gpu.quantize(w, gpu.amax(w)), want) == []


def test_fast_division_equals_ieee_division_on_a_sample_of_divisors():
    """Every finite bf16 value x 28 k divisors (64 random global scales and the powers of two, times every e4m3
    block scale in the fast path's range): 1.8 G quotients."""
    from gpu_compare import division_check

    m = division_check()
    d = m.divisors(64).cuda()
    assert m.mismatches(d) == 0


@pytest.mark.parametrize("sweep", ["random order", "by magnitude"])
def test_c_nvfp4_equals_the_torch_reference_on_every_bf16(sweep):
    """Every finite bf16 value, in rows of 4096 under 4 global scales, and sorted by magnitude (block scales sweep
    e4m3's range) under 243 global scales across [2^-80, 2^80] (the one-reciprocal-a-block range)."""
    nlib = nvfp4_cpu.load()
    every = torch.arange(0, 65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    finite = every[torch.isfinite(every.float())]
    if sweep == "random order":
        x = finite[torch.randperm(finite.numel(), generator=torch.Generator().manual_seed(0))]
        x = x[: x.numel() // 4096 * 4096].reshape(-1, 4096)
        scales = [reference.global_scale(x.float().abs().amax()), *map(torch.tensor, (1e-30, 3e20, 1.0))]
    else:
        ordered = finite[finite.float().abs().argsort()]
        x = torch.stack([torch.roll(ordered, r)[: ordered.numel() // 2048 * 2048] for r in (0, 5, 11)])
        x = x.reshape(-1, 2048)
        scales = [torch.tensor(2.0**e * f, dtype=torch.float32) for e in range(-80, 81, 2) for f in (1.0, 1.2345, 1.75)]
    bad = [float(s2) for s2 in scales
           if differing_tensors(nvfp4_cpu.quantize(nlib, x, s2, THREADS), reference.quantize(x, s2))]
    assert bad == [], os.environ.get("KIMI_CONVERT_CPU_ISA", "the widest row")


def test_c_fp8_and_cast_equal_the_torch_code_at_k3_sizes(lib):
    for n, k in ((7168, 7168), (1000, 1001)):
        w = (torch.randn(n, k, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)
        w[128:256, 256:384] = 0
        assert differing_tensors(recipe_cpu.fp8_quantize(lib, w, THREADS), fp8_block.quantize(w)) == [], (n, k)
    for window in (True, False):
        packed, scale = mx_inputs(3072, 3584, 2, window)
        own = mxfp4_cast.k_max(scale)
        for shared in (own, own + 1):
            got = recipe_cpu.cast(lib, packed, scale, shared, own, THREADS)
            assert not cast_differs(got, mxfp4_cast.cast(packed, scale, shared)), (window, shared)

