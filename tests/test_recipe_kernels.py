"""NVIDIA's K3 recipe kernels give the torch code's bytes: the MXFP4 -> NVFP4 cast (``mxfp4_cast.cast``) and
128x128 block FP8 (``fp8_block.quantize``), in C (``recipe_cpu``) and in Triton (``recipe_triton``, interpreted
on CPU tensors in CI, compiled on the GPU); the backends pick them; a whole nvidia-k3 pack is unchanged."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import tree
from kimi_convert.devices import get_backend
from kimi_convert.kernels import RECIPE_KERNELS_ENV, fp8_block, mxfp4_cast, recipe_cpu
from kimi_convert.pack import pack
from kimi_convert.plan import Options

if not torch.cuda.is_available():  # CI: the Triton kernels run in the interpreter on CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kimi_convert.kernels import recipe_triton

LIB = recipe_cpu.load()
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def as_u8(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)


def casts(packed, scale, shared):
    """(name, result) of every implementation of the cast."""
    yield "c", recipe_cpu.cast(LIB, packed, scale, shared)
    yield "c own given", recipe_cpu.cast(LIB, packed, scale, shared, mxfp4_cast.k_max(scale))
    yield "triton", recipe_triton.cast(packed.to(DEV), scale.to(DEV), shared)


def assert_cast_equal(packed: torch.Tensor, scale: torch.Tensor, shared: int) -> None:
    want = mxfp4_cast.cast(packed, scale, shared)
    for name, got in casts(packed, scale, shared):
        assert torch.equal(as_u8(got[1]), as_u8(want[1])), (name, "scales", shared)
        assert torch.equal(as_u8(got[0]), as_u8(want[0])), (name, "codes", shared)
        assert as_u8(got[2]).tolist() == as_u8(want[2]).tolist(), (name, "weight_scale_2")
        assert got[3] == want[3], (name, "stats")


def mx(n: int, kb: int, lo: int, hi: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, 16 * kb), generator=g, dtype=torch.uint8)
    return packed, torch.randint(lo, hi + 1, (n, kb), generator=g, dtype=torch.uint8)


# --- the cast ------------------------------------------------------------------------------------

@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 12), kb=st.integers(1, 24), lo=st.integers(0, 255), span=st.integers(0, 40),
       extra=st.sampled_from([0, 0, 1, 5, 17, 30]), seed=st.integers(0, 2**20))
def test_cast_property(n, kb, lo, span, extra, seed):
    """Random codes, exponents in [lo, lo + span] (in and out of e4m3's window, E8M0 0 and 254 included; 255,
    NaN, is refused: test_hostile_files.py), the group's k_max at or above the tensor's own."""
    packed, scale = mx(n, kb, min(lo, 254), min(254, lo + span), seed)
    assert_cast_equal(packed, scale, min(128, mxfp4_cast.k_max(scale) + extra))


def every_code_and_exponent(top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row e holds every byte of codes (16 blocks of 16 bytes) under E8M0 min(e, top)."""
    g = torch.Generator().manual_seed(top)
    packed = torch.arange(256, dtype=torch.uint8)[torch.randperm(256, generator=g)].repeat(256, 1)
    scale = torch.arange(256).clamp(max=top).to(torch.uint8)[:, None].repeat(1, 16)
    return packed, scale


@pytest.mark.parametrize("top", [0, 1, 18, 19, 100, 125, 126, 127, 128, 200, 253, 254])  # 255 (NaN): refused
def test_cast_every_code_under_every_exponent(top):
    packed, scale = every_code_and_exponent(top)
    own = mxfp4_cast.k_max(scale)
    for shared in sorted({own, min(128, own + 1), min(128, own + 9), 128}):
        assert_cast_equal(packed, scale, shared)


def test_cast_c_every_top_exponent():
    """The C kernel under every eighth tensor maximum and the window's edges, several group maxima."""
    for top in sorted({*range(0, 255, 8), 1, 17, 18, 19, 125, 126, 127, 128, 254}):  # 255 (NaN): refused
        packed, scale = every_code_and_exponent(top)
        own = mxfp4_cast.k_max(scale)
        for shared in sorted({own, min(128, own + 1), min(128, own + 17), min(128, own + 18), 128}):
            want = mxfp4_cast.cast(packed, scale, shared)
            got = recipe_cpu.cast(LIB, packed, scale, shared)
            assert torch.equal(got[0], want[0]) and torch.equal(as_u8(got[1]), as_u8(want[1])), (top, shared)
            assert got[3] == want[3]


def test_cast_real_shape_in_window_and_planted_blocks():
    """A K3-like expert (exponents in a 10-wide band) with out-of-window and E8M0-0 blocks planted."""
    packed, scale = mx(64, 28, 115, 125, 11)
    scale[3, 5] = 90  # out of the window: data-derived amax
    scale[7, 0] = 0  # all-zero block
    packed[7, :16] = 0
    scale[9, 27] = 101
    assert_cast_equal(packed, scale, mxfp4_cast.k_max(scale))
    assert_cast_equal(packed, scale, mxfp4_cast.k_max(scale) + 2)


@pytest.mark.parametrize("per,most", [(16, 64), (16, 5), (64, 3)])
def test_cast_flagged_programs_among_unflagged(per, most, monkeypatch):
    """Small programs (``per`` blocks; at most ``most`` long-path programs: 1, 4 and 2 flags each): one program
    holding a block off the closed form between programs that hold none, one flagged program as the last (ragged:
    13 x 23 blocks is no multiple of ``per``), flagged and unflagged programs in one long-path program, a ragged
    last long-path program; the count summed over programs."""
    monkeypatch.setattr(recipe_triton, "CAST_BLOCKS", (per, 4))
    monkeypatch.setattr(recipe_triton, "CAST_SLOW", (most, 8, 4))
    packed, scale = mx(13, 23, 116, 125, 21)
    scale.view(-1)[per + 3] = 90  # the second program: out of the window
    scale.view(-1)[-1] = 0  # the last (ragged) program: E8M0 0
    packed.view(-1, 16)[-1] = 0
    assert_cast_equal(packed, scale, mxfp4_cast.k_max(scale))
    assert_cast_equal(packed, scale, mxfp4_cast.k_max(scale) + 1)
    assert recipe_triton.cast_programs(scale.numel()) > 3


def test_cast_all_fast_and_all_slow_small_programs(monkeypatch):
    """Programs of 8 blocks: no program flagged (every block in the window), then every program flagged."""
    monkeypatch.setattr(recipe_triton, "CAST_BLOCKS", (8, 4))
    monkeypatch.setattr(recipe_triton, "CAST_SLOW", (2, 8, 4))
    packed, scale = mx(5, 7, 118, 125, 4)
    assert_cast_equal(packed, scale, mxfp4_cast.k_max(scale))
    packed, scale = mx(5, 7, 0, 255, 5)
    assert_cast_equal(packed, scale, mxfp4_cast.k_max(scale))


def test_cast_falls_back_to_torch_outside_its_contract():
    packed, scale = mx(4, 2, 120, 124, 0)
    want = mxfp4_cast.cast(packed, scale, -130)  # no k_max gives this; the torch code answers
    for _, got in casts(packed, scale, -130):
        assert torch.equal(as_u8(got[0]), as_u8(want[0])) and torch.equal(as_u8(got[1]), as_u8(want[1]))


# --- block FP8 -----------------------------------------------------------------------------------

def fp8s(w: torch.Tensor):
    yield "c", recipe_cpu.fp8_quantize(LIB, w)
    yield "triton", recipe_triton.fp8_quantize(w.to(DEV))


def assert_fp8_equal(w: torch.Tensor) -> None:
    want_q, want_s = fp8_block.quantize(w)
    for name, (q, s) in fp8s(w):
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32, name
        assert s.shape == want_s.shape and q.shape == want_q.shape, name
        assert torch.equal(as_u8(s), as_u8(want_s)), (name, "scales")
        assert torch.equal(as_u8(q), as_u8(want_q)), (name, "codes")


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 300), k=st.integers(1, 300), exp=st.integers(-140, 120), seed=st.integers(0, 2**20),
       zero_rows=st.integers(0, 300))
def test_fp8_property(n, k, exp, seed, zero_rows):
    """Any shape (odd, not multiples of 128), magnitudes down to bf16 subnormals, zero tiles."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 2.0**exp).to(torch.bfloat16)
    w[:zero_rows] = 0
    w.view(-1)[torch.randint(0, w.numel(), (3,), generator=g)] *= 64
    assert_fp8_equal(w)


def tiles_below(amax_bits: list[int], seed: int = 0) -> torch.Tensor:
    """One 128x128 tile per amax (bf16 bits): random values of magnitude <= amax, both signs, amax at [0, 0]."""
    g = torch.Generator().manual_seed(seed)
    t = len(amax_bits)
    a = torch.tensor(amax_bits, dtype=torch.int32).repeat_interleave(128)[None, :]
    mag = torch.randint(0, 1 << 30, (128, 128 * t), generator=g, dtype=torch.int32) % (a + 1)
    bits = mag | (torch.randint(0, 2, mag.shape, generator=g, dtype=torch.int32) << 15)
    bits[0, ::128] = a[0, ::128]
    return bits.to(torch.int16).view(torch.bfloat16)


def test_fp8_tiny_tiles_subnormal_scales():
    """Tiles whose amax / 448 is a bf16 subnormal or rounds to 0 (codes 0), where bf16(x / scale) reaches past
    448 (saturating), every subnormal amax and the normal ones around the boundary."""
    bits = list(range(1, 0x80)) + list(range(0x80, 0x400, 7)) + [0x1000, 0x0FFF, 0x43E0, 0x7F7F]
    assert_fp8_equal(tiles_below(bits[: len(bits) // 2], 1))
    assert_fp8_equal(tiles_below(bits[len(bits) // 2:], 2))


def test_fp8_c_every_amax():
    """The C kernel: one tile per positive finite bf16 amax (every third one above the subnormals), random values
    below it."""
    bits = list(range(1, 0x80)) + list(range(0x80, 0x7F80, 3))
    for i in range(0, len(bits), 2048):
        w = tiles_below(bits[i : i + 2048], i)
        q, s = fp8_block.quantize(w)
        cq, cs = recipe_cpu.fp8_quantize(LIB, w)
        assert torch.equal(as_u8(cq), as_u8(q)) and torch.equal(cs, s), i


def test_fp8_signed_zeros_and_exact_values():
    w = torch.zeros(130, 260, dtype=torch.bfloat16)
    w[0, :8] = torch.tensor([-0.0, 0.0, 448.0, -448.0, 1.0, -1e-30, 1e-30, 3.0])
    w[129, 259] = -0.0  # a tile of zeros and -0: scale 0, codes 0
    w[5, 140] = 2.0**-120
    assert_fp8_equal(w)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_fp8_non_finite_is_the_torch_code(bad):
    w = torch.randn(130, 200).to(torch.bfloat16)
    w[3, 150] = bad
    assert_fp8_equal(w)


def test_fp8_other_dtypes_are_the_torch_code():
    w = torch.randn(40, 200)
    for dt in (torch.float32, torch.float16):
        assert_fp8_equal(w.to(dt))


def test_c_kernels_are_thread_count_independent():
    """Any thread count (the pool's tasks: rows of the cast, runs of a band's tiles in block FP8) gives the same
    bytes, with the codes stored plainly or non-temporally (an odd row length: streamed rows and plain ones)."""
    torch.manual_seed(5)
    w = torch.randn(300, 1000).to(torch.bfloat16)
    p, e = torch.randint(0, 256, (301, 512), dtype=torch.uint8), torch.randint(100, 128, (301, 32), dtype=torch.uint8)
    p2, e2 = torch.randint(0, 256, (77, 48), dtype=torch.uint8), torch.randint(110, 125, (77, 3), dtype=torch.uint8)
    want = [fp8_block.quantize(w), mxfp4_cast.cast(p, e, 0), mxfp4_cast.cast(p2, e2, 0)]
    for threads in (1, 2, 7):
        for stream in (False, True):
            recipe_cpu.STREAM_MIN_BYTES = 0 if stream else 1 << 62
            try:
                got = [recipe_cpu.fp8_quantize(LIB, w, threads), recipe_cpu.cast(LIB, p, e, 0, threads=threads),
                       recipe_cpu.cast(LIB, p2, e2, 0, threads=threads)]
            finally:
                recipe_cpu.STREAM_MIN_BYTES = 8 << 20
            for g, x in zip(got, want, strict=True):
                assert all(torch.equal(as_u8(a), as_u8(b)) for a, b in zip(g[:3], x[:3], strict=False)), threads
            assert got[1][3] == want[1][3] and got[2][3] == want[2][3]


def test_c_pool_serves_concurrent_callers():
    """Pipeline streams call the kernels at once, each with its share of threads: every call gets its own bytes
    (jobs queued together, workers polling and sleeping between them), none waits forever."""
    from concurrent.futures import ThreadPoolExecutor

    from kimi_convert.kernels import nvfp4_cpu, reference
    torch.manual_seed(9)
    ws = [(torch.randn(384, 512) * 10 ** i).to(torch.bfloat16) for i in range(-2, 2)]
    want = [fp8_block.quantize(w) for w in ws]
    nlib = nvfp4_cpu.load()
    s2 = [reference.global_scale(w.float().abs().amax()) for w in ws]
    want_nv = [reference.quantize(w, s) for w, s in zip(ws, s2, strict=True)]

    def work(i: int) -> bool:
        ok = True
        for rep in range(15):
            q, sc = recipe_cpu.fp8_quantize(LIB, ws[i], 1 + (i + rep) % 4)
            p, s = nvfp4_cpu.quantize(nlib, ws[i], s2[i], 1 + (i * rep) % 5)
            ok &= torch.equal(as_u8(q), as_u8(want[i][0])) and torch.equal(as_u8(sc), as_u8(want[i][1]))
            ok &= torch.equal(p, want_nv[i][0]) and torch.equal(as_u8(s), as_u8(want_nv[i][1]))
        return ok
    with ThreadPoolExecutor(4) as ex:
        assert all(ex.map(work, range(4)))


def _python(code: str) -> str:
    """``code`` run by a fresh interpreter (a pool of its own, no worker of this process's): its stdout."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_c_pool_callers_share_its_workers():
    """Streams told the worker's CPUs each, calling at once, share one set of workers: a fresh process's pool never
    grows past the largest call's threads - 1 (4 callers of 4 threads grew it to 12 before, on 4 CPUs' worth)."""
    code = ("import threading,torch; from kimi_convert.kernels import recipe_cpu as R; L=R.load(); "
            "w=torch.randn(1024,1024).to(torch.bfloat16); b=threading.Barrier(4)\n"
            "def go():\n b.wait()\n for _ in range(40): R.fp8_quantize(L,w,4)\n"
            "ts=[threading.Thread(target=go) for _ in range(4)]; [t.start() for t in ts]; [t.join() for t in ts]; "
            "print(L.kc_pool_workers())")
    assert int(_python(code)) == 3


def test_c_pool_workers_take_the_nice_value_set_and_the_caller_keeps_its_own():
    """``clib.KERNEL_NICE`` (set before the library loads): each worker thread runs at it from its start; the
    thread that calls the kernel (which works on the job too) keeps the process's (Linux's per-thread nice)."""
    code = ("import os,torch; from kimi_convert.kernels import clib; clib.KERNEL_NICE=7\n"
            "from kimi_convert.kernels import recipe_cpu as R; L=R.load(); "
            "w=torch.randn(1024,1024).to(torch.bfloat16)\n"
            "for _ in range(20): R.fp8_quantize(L,w,4)\n"
            "nice={t: int(open(f'/proc/self/task/{t}/stat').read().rsplit(')',1)[1].split()[16]) "
            "for t in os.listdir('/proc/self/task')}\n"
            "print(L.kc_pool_workers(), sorted(nice.values()).count(7), nice[str(os.getpid())])")
    out = _python(code)
    workers, at_seven, main = map(int, out.split())
    assert workers == 3 and at_seven == 3 and main == 0, out


def test_c_pool_workers_poll_as_long_as_set_then_sleep():
    """``clib.KERNEL_SPIN_NS``: after a kernel, the pool's workers poll (runnable) that long, then sleep; 0 sleeps at
    once. Workers' states from /proc over the 0.2 s after a call with 1.5 s of polling (a thread counts as polling if
    any of 20 looks finds it runnable: on a loaded machine one look can catch a poller waiting a moment on the pool's
    lock), then 0.3 s after one with none."""
    code = ("import os,time,torch; from kimi_convert.kernels import clib; clib.KERNEL_SPIN_NS=1_500_000_000\n"
            "from kimi_convert.kernels import recipe_cpu as R; L=R.load(); "
            "w=torch.randn(1024,1024).to(torch.bfloat16); me=str(os.getpid())\n"
            "def states(): return {t: open(f'/proc/self/task/{t}/stat').read().rsplit(')',1)[1].split()[0] "
            "for t in os.listdir('/proc/self/task') if t!=me}\n"
            "R.fp8_quantize(L,w,4); seen={}\n"
            "for _ in range(20):\n"
            "    for t,s in states().items(): seen[t]=seen.get(t,'S') if s!='R' else 'R'\n"
            "    time.sleep(0.01)\n"
            "L.kc_pool_set_spin(0); time.sleep(1.8)\n"
            "R.fp8_quantize(L,w,4); time.sleep(0.3); print(''.join(sorted(seen.values())), "
            "''.join(sorted(states().values())))")
    polling, after = _python(code).split()
    assert polling.count("R") >= 3, polling  # the 3 workers (the other threads, torch's, asleep)
    assert "R" not in after, after


def test_c_pool_survives_fork_and_exit():
    """A child forked after the pool's workers started runs the kernels on a pool of its own (it never waits for
    the parent's threads, which it does not have), and the interpreter exits with workers asleep (no hang)."""
    # the child compares with numpy: torch's own OpenMP pool hangs in a forked child (not this pool's doing)
    code = ("import os,torch; from kimi_convert.kernels import recipe_cpu as R, nvfp4_cpu as N; L=R.load(); "
            "w=torch.randn(512,1024).to(torch.bfloat16); a=R.fp8_quantize(L,w,4)[0].view(torch.uint8).numpy(); "
            "x=float(N.amax(N.load(),w,4)); assert L.kc_pool_workers()==3; pid=os.fork()\n"
            "if pid==0:\n os._exit(0 if L.kc_pool_workers()==0 and (R.fp8_quantize(L,w,4)[0].view(torch.uint8)"
            ".numpy()==a).all() and L.kc_pool_workers()==3 and float(N.amax(N.load(),w,3))==x else 1)\n"
            "_, st=os.waitpid(pid,0); assert os.waitstatus_to_exitcode(st)==0, st; print('ok')")
    assert _python(code).strip() == "ok"


# --- backends and the pipeline ---------------------------------------------------------------------

def test_backends_pick_the_kernels(monkeypatch):
    assert get_backend("cpu")._recipe_kernels() == "cpu"
    assert get_backend("triton")._recipe_kernels() == "triton"
    assert get_backend("reference")._recipe_kernels() == "torch"
    monkeypatch.setenv(RECIPE_KERNELS_ENV, "torch")
    assert get_backend("cpu")._recipe_kernels() == "torch"
    assert get_backend("triton")._recipe_kernels() == "torch"


def test_backend_methods_give_the_torch_bytes():
    packed, scale = mx(16, 8, 110, 126, 3)
    w = (torch.randn(200, 300) * 0.02).to(torch.bfloat16)
    want_c, want_f = mxfp4_cast.cast(packed, scale, 0), fp8_block.quantize(w)
    for b in (get_backend("reference"), get_backend("cpu"), get_backend("triton")):
        got_c, got_f = b.cast_mxfp4(packed, scale, 0), b.fp8_block(w)
        assert all(torch.equal(as_u8(x), as_u8(y)) for x, y in zip(got_c[:3], want_c[:3], strict=True)), b.name
        assert got_c[3] == want_c[3]
        assert all(torch.equal(as_u8(x), as_u8(y)) for x, y in zip(got_f, want_f, strict=True)), b.name


def test_nvidia_k3_pack_unchanged_by_the_kernels(tiny_k3, tmp_path, monkeypatch):
    """pack --recipe nvidia-k3 of tiny-k3: the torch code (the output before the kernels), the C kernels and the
    Triton kernels write the same files, byte for byte (manifest included)."""
    opts = Options(recipe="nvidia-k3")
    outs = {}
    with monkeypatch.context() as m:
        m.setenv(RECIPE_KERNELS_ENV, "torch")
        pack(tiny_k3, tmp_path / "torch", opts, device="cpu", progress=False)
        outs["torch"] = tree(tmp_path / "torch")
    for device in ("cpu", "triton"):
        pack(tiny_k3, tmp_path / device, opts, device=device, progress=False)
        outs[device] = tree(tmp_path / device)
    assert outs["torch"].keys() == outs["cpu"].keys() == outs["triton"].keys()
    assert any(name.endswith(".safetensors") for name in outs["torch"])
    for name in outs["torch"]:
        assert outs["cpu"][name] == outs["torch"][name], name
        assert outs["triton"][name] == outs["torch"][name], name
