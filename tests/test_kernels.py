"""Every quantizer gives the reference's bytes: Triton (interpreted on CPU in CI, compiled on the GPU),
the C CPU kernel and the torch reference; exact MXFP4 transcoding; backend selection."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import oracle
from helpers import interpreter_note, run_process
from kimi_convert.devices import get_backend
from kimi_convert.kernels import Backend, mxfp4_cast, nvfp4_cpu, reference

if not torch.cuda.is_available():  # CI: the Triton kernels run in the interpreter on CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")
BACKENDS = [get_backend("reference"), get_backend("cpu"), get_backend("triton")]


def run(backend: Backend, w: torch.Tensor):
    a = backend.amax(w)
    p, s = backend.quantize(w, a)
    return a.cpu(), p.cpu(), s.cpu().view(torch.uint8), reference.global_scale(a.cpu())


def assert_all_equal(w: torch.Tensor):
    ra, rp, rs, rs2 = run(BACKENDS[0], w)
    for b in BACKENDS[1:]:
        a, p, s, _s2 = run(b, w)
        assert a.item() == ra.item() or (np.isnan(a.item()) and np.isnan(ra.item())), interpreter_note(b.name)
        assert torch.equal(p, rp), interpreter_note(b.name)
        assert torch.equal(s, rs), interpreter_note(b.name)
    op, os_, os2 = oracle.quantize(oracle.to_f32(w))
    assert rs2.numpy().tobytes() == os2.tobytes()
    np.testing.assert_array_equal(rp.reshape(op.shape).numpy(), op)
    np.testing.assert_array_equal(rs.reshape(os_.shape).numpy(), os_)


def test_backends_present():
    assert [b.name for b in BACKENDS] == ["reference", "cpu", "triton"]


def edge_tensors():
    g = torch.Generator().manual_seed(7)
    ties = torch.tensor([0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -2.5, -3.5, -5.0, 4.0])
    t = torch.stack([ties, torch.full((16,), 6.0)])
    t[1, 0] = 2688.0  # s2 = 1, block scale 1: x == W, every tie hit exactly
    zero_block = torch.randn(3, 48, generator=g)
    zero_block[1, 16:32] = 0
    underflow = torch.randn(2, 32, generator=g)
    underflow[0, :16] *= 1e-7  # block scale below 2^-9: clamped
    neg_zero = torch.tensor([[-1e-8, -0.0, 0.0, 1.0] * 4])
    tiny_quotients = torch.tensor([[1.0, -1e-37, -1e-39, 3e-39] * 4, [0.5, -2e-36, 1e-30, -1.0] * 4])
    return {
        "K=16,N=1": torch.randn(1, 16, generator=g),
        "odd N": torch.randn(7, 32, generator=g),
        "N=33 K=272": torch.randn(33, 272, generator=g),
        "huge": torch.randn(5, 64, generator=g) * 1e37,
        "tiny": torch.randn(5, 64, generator=g) * 1e-36,
        "ties": t,
        "zero block": zero_block,
        "all zero": torch.zeros(4, 32),
        "underflow": underflow,
        "negatives to zero": neg_zero,
        "tiny quotients (full-division fallback)": tiny_quotients,
        "wide rows": torch.randn(3, 1024, generator=g) * torch.tensor([[1e-3], [1.0], [1e3]]),
    }


@pytest.mark.parametrize("name", list(edge_tensors()))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_edge_cases_every_backend(name, dtype):
    w = edge_tensors()[name]
    if dtype == torch.float16 and name in ("huge", "tiny"):
        pytest.skip("outside fp16's range")
    assert_all_equal(w.to(dtype))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 40), kb=st.integers(1, 20), exp=st.integers(-60, 60), seed=st.integers(0, 2**20),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]))
def test_property_all_backends_equal(n, kb, exp, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, kb * 16, generator=g) * 2.0**exp
    w.view(-1)[torch.randint(0, w.numel(), (2,), generator=g)] *= 30
    assert_all_equal(w.to(dtype))


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_amax_is_flagged(backend, bad):
    w = torch.randn(5, 64)
    w[2, 17] = bad
    for dt in (torch.bfloat16, torch.float32):
        assert not torch.isfinite(backend.amax(w.to(dt))).item()


def test_fused_members_match_quantizing_the_concatenation():
    g = torch.Generator().manual_seed(1)
    members = [torch.randn(n, 64, generator=g) * s for n, s in ((5, 1.0), (9, 30.0), (3, 0.01))]
    for b in BACKENDS:
        amax = torch.stack([b.amax(m).cpu() for m in members]).max()
        parts = [b.quantize(m, amax) for m in members]
        whole = reference.quantize(torch.cat(members), reference.global_scale(torch.cat(members).abs().amax()))
        assert torch.equal(torch.cat([p[0].cpu() for p in parts]), whole[0])
        assert torch.equal(torch.cat([p[1].cpu().view(torch.uint8) for p in parts]), whole[1].view(torch.uint8))


def test_cpu_kernel_is_threads_independent():
    """The thread count is an argument (the caller's share of ``devices.cpus()``), never read from the
    environment; any count gives the same bytes."""
    torch.manual_seed(5)
    w = torch.randn(257, 512).to(torch.bfloat16)
    s2 = reference.global_scale(w.abs().amax().float())
    lib = nvfp4_cpu.load()
    outs = []
    for n in (1, 2, 7):
        p, s = nvfp4_cpu.quantize(lib, w, s2, n)
        assert nvfp4_cpu.amax(lib, w, n) == w.abs().amax().float()
        outs.append(p.numpy().tobytes() + s.view(torch.uint8).numpy().tobytes())
    assert len(outs[0]) == 257 * (256 + 32) and outs[0] == outs[1] == outs[2]


def test_backend_threads_are_an_argument(monkeypatch):
    monkeypatch.setenv("KIMI_CONVERT_THREADS", "3")
    assert get_backend("cpu").threads == 3  # the default: devices.cpus()
    assert get_backend("cpu", threads=5).threads == 5
    seen = []
    monkeypatch.setattr(nvfp4_cpu, "quantize", lambda lib, w, s2, threads: seen.append(threads))
    b = get_backend("cpu", threads=2)
    if b.name == "cpu":
        b.quantize(torch.ones(16, 32), torch.tensor(1.0))
        assert seen == [2]


def test_cpu_kernel_without_compiler_falls_back(tmp_path, tiny_kl, packed_kl):
    """No C compiler and no cached build: pack still runs (the torch reference), says so in one line,
    and writes the same bytes as the C kernel."""
    import json

    # a process of its own: the kernel is loaded (or found missing) once per process
    env = {"KIMI_CONVERT_CACHE": str(tmp_path / "empty-cache"), "KIMI_CONVERT_CC": str(tmp_path / "no-such-cc"),
           "TQDM_DISABLE": "1"}
    out = tmp_path / "out"
    r = run_process("pack", tiny_kl, out, "--device", "cpu", "-q", env=env, timeout=600)
    assert r.code == 0, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kimi-convert: warning: fast CPU kernel unavailable"), r.stderr
    assert "no-such-cc" in lines[0] and "UserWarning" not in r.stderr
    assert not any((tmp_path / "empty-cache").rglob("*.so")), "nothing was built"
    assert json.loads((out / "manifest.json").read_text())["totals"]["nvfp4"] >= 10  # the fallback quantized
    # packed_kl was quantized in this process, by the C kernel where it builds: the fallback's bytes are the kernel's
    if nvfp4_cpu.load() is None:
        pytest.skip("no C compiler here: packed_kl was made by the fallback too, nothing to compare it with")
    for f in sorted(p.name for p in packed_kl.glob("*.safetensors")):
        assert (out / f).read_bytes() == (packed_kl / f).read_bytes(), f


def test_cpu_kernel_build_error_is_an_oserror(tmp_path, monkeypatch):
    monkeypatch.setenv("KIMI_CONVERT_CACHE", str(tmp_path))
    with pytest.raises(OSError):
        nvfp4_cpu.build(b"this is not C", "cc")


def test_get_backend_rejects_bad_devices():
    from kimi_convert.devices import Device
    from kimi_convert.errors import ConvertError

    with pytest.raises(ConvertError, match="expected one of auto, cpu"):
        get_backend("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConvertError, match="no CUDA device"):
            get_backend("cuda:0")
        assert get_backend("auto").device.type == "cpu"
    assert get_backend(Device("reference")).name == "reference"  # a resolved device is taken as it is


# --- MXFP4 -> NVFP4, NVIDIA's closed-form cast ---------------------------------------------

def mxfp4_tensor(n: int, k: int, exps: torch.Tensor, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    return packed, exps.to(torch.uint8).reshape(n, k // 32)


def test_cast_in_window_keeps_every_value_under_a_shared_k_max():
    g = torch.Generator().manual_seed(3)
    a = mxfp4_tensor(8, 128, torch.randint(110, 128, (8, 4), generator=g))  # span 17: fits
    b = mxfp4_tensor(8, 128, torch.randint(112, 126, (8, 4), generator=g), seed=1)
    shared = max(mxfp4_cast.k_max(a[1]), mxfp4_cast.k_max(b[1]))
    for packed, scale in (a, b):
        p, s, s2, stats = mxfp4_cast.cast(packed, scale, shared)
        assert float(s2) == 2.0 ** (shared - 8)
        assert stats.lossless == stats.blocks == scale.numel()
        negzero = lambda x: torch.where(x == 8, torch.zeros_like(x), x)  # noqa: E731
        assert torch.equal(reference.unpack_codes(p), negzero(reference.unpack_codes(packed)))
        got = oracle.dequantize(p.numpy(), s.view(torch.uint8).numpy(), float(s2))
        np.testing.assert_array_equal(got, oracle.decode_mxfp4(packed.numpy(), scale.numpy()))


def test_cast_out_of_window_block_costs_that_block_only():
    exps = torch.full((2, 4), 120)
    exps[0, 1] = 100  # 20 below k_max: outside e4m3's window
    packed, scale = mxfp4_tensor(2, 128, exps)
    p, s, s2, stats = mxfp4_cast.cast(packed, scale, mxfp4_cast.k_max(scale))
    assert (stats.blocks, stats.lossless) == (8, 7)
    want = oracle.decode_mxfp4(packed.numpy(), scale.numpy())
    got = oracle.dequantize(p.numpy(), s.view(torch.uint8).numpy(), float(s2))
    bad = np.zeros_like(want, dtype=bool)
    bad[0, 32:64] = True
    np.testing.assert_array_equal(got[~bad], want[~bad])
    assert not np.array_equal(got[bad], want[bad])  # 2^-20 relative to the largest block: lost




@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_amax_programs_of_several_steps(dtype):
    """The amax kernel with programs of several steps (a ragged last one), one atomic each, accumulating into a
    cell that holds an earlier member's amax (a fused module); NaN and Inf give +inf."""
    from kimi_convert.kernels import nvfp4_triton

    g = torch.Generator().manual_seed(3)
    w = (torch.randn(37, 144, generator=g) * 3).to(dtype)
    w[29, 100] = -50.0  # the amax sits in a late program
    for start, want in ((0.0, 50.0), (60.0, 60.0)):
        cell = torch.tensor([start])
        nvfp4_triton.amax_into(w, cell, (64, 5, 1))
        assert float(cell) == want
    for bad in (float("nan"), float("inf")):
        v = w.clone()
        v[36, 143] = bad
        cell = torch.zeros(1)
        nvfp4_triton.amax_into(v, cell, (64, 5, 1))
        assert float(cell) == float("inf")


@pytest.mark.parametrize("order", [0, 1, 2])
def test_triton_quantize_tile_orders(order):
    """Every order in which the quantize kernel's programs walk the tiles (a 2-D grid; memory order; its reverse,
    for the L2) writes the reference's bytes, ragged tiles in both directions included."""
    from kimi_convert.kernels import nvfp4_triton

    g = torch.Generator().manual_seed(5)
    w = (torch.randn(11, 80, generator=g) * torch.rand(11, 1, generator=g) * 4).to(torch.bfloat16)
    a = w.float().abs().amax().reshape(1)
    want_p, want_s = reference.quantize(w, reference.global_scale(a))
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the compiled kernel on a GPU, else the interpreter
    packed = torch.empty((11, 40), dtype=torch.uint8, device=dev)
    scales = torch.empty((11, 5), dtype=torch.uint8, device=dev)
    with nvfp4_triton.INTERPRETER:
        nvfp4_triton._launch_quant(w.to(dev), a.to(dev), packed, scales, 11, 80, (4, 2, 1, order))
    assert torch.equal(packed.cpu(), want_p), interpreter_note("triton")
    assert torch.equal(scales.cpu(), want_s.view(torch.uint8)), interpreter_note("triton")


AVX512 = os.path.exists("/proc/cpuinfo") and "avx512f" in Path("/proc/cpuinfo").read_text()


@pytest.mark.skipif(not AVX512, reason="the CPU has no AVX-512: the AVX2 row is the one tested")
def test_cpu_kernel_avx512_row_equals_avx2_row(tmp_path):
    """Where the CPU has AVX-512, the C kernel's rows run there; capped at AVX2 (KIMI_CONVERT_CPU_ISA) the other
    row runs: both give the reference's bytes on every bf16 value and across the one-reciprocal scale range, and on
    fp32 rows (the division row: decoded INT4 and FP8 weights) from 1e-30 to 1e30."""
    script = tmp_path / "rows.py"
    script.write_text(
        "import sys, torch\n"
        "from kimi_convert.kernels import nvfp4_cpu, reference\n"
        "lib = nvfp4_cpu.load()\n"
        "vals = torch.arange(0, 0x10000, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)\n"
        "vals = vals[torch.isfinite(vals.float())]\n"
        "x = vals[torch.randperm(vals.numel(), generator=torch.Generator().manual_seed(0))][: 65280 // 272 * 272]\n"
        "x = x.reshape(-1, 272)\n"
        "g = torch.Generator().manual_seed(1)\n"
        "xf = torch.randn(240, 272, generator=g) * torch.logspace(-30, 30, 240).unsqueeze(1)\n"
        "xf.view(-1)[:: 7] = 0.0\n"
        "ok = True\n"
        "for w in (x, x.float(), xf):\n"
        "    for s in (1.0, 1e-20, 3e20, float(reference.global_scale(w.float().abs().amax()))):\n"
        "        p, sc = nvfp4_cpu.quantize(lib, w, torch.tensor(s), 2)\n"
        "        rp, rs = reference.quantize(w, torch.tensor(s))\n"
        "        ok &= torch.equal(p, rp) and torch.equal(sc.view(torch.uint8), rs.view(torch.uint8))\n"
        "print(lib.kc_nvfp4_avx512(), ok)\n")
    for cap, want in (("", "1"), ("avx2", "0")):
        r = subprocess.run([sys.executable, str(script)], env={**os.environ, "KIMI_CONVERT_CPU_ISA": cap},
                           capture_output=True, text=True, timeout=300)
        assert r.stdout.split() == [want, "True"], r.stdout + r.stderr
