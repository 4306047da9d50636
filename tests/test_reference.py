"""The reference quantizer against the independent oracle of nvfp4.md, and against the spec's table."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import oracle
from kimi_convert.devices import get_backend
from kimi_convert.kernels import reference


def quantize_ref(w: torch.Tensor):
    s2 = reference.global_scale(w.abs().amax().float())
    p, s = reference.quantize(w, s2)
    return p.numpy(), s.view(torch.uint8).numpy(), np.float32(s2.item())


def assert_same(w: torch.Tensor):
    p, s, s2 = quantize_ref(w)
    op, os_, os2 = oracle.quantize(oracle.to_f32(w))
    assert s2.tobytes() == os2.tobytes()
    np.testing.assert_array_equal(s, os_)
    np.testing.assert_array_equal(p, op)


def test_spec_rounding_table_and_ties():
    # s2 = 2688/2688 = 1 and every block amax 6 (sb = 1): x == W, so codes follow nvfp4.md's table.
    vals = [0.0, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 6.0, 0.74, 1.26, 2.49, 3.49, 4.99]
    want = [0, 0, 1, 2, 2, 4, 4, 6, 6, 7, 7, 1, 3, 4, 5, 6]
    row = torch.tensor(vals, dtype=torch.float32)
    w = torch.stack([row, -row, torch.full((16,), 6.0)])
    w[2, 0] = 2688.0  # the global amax
    p, _, s2 = quantize_ref(w)
    assert s2 == 1.0
    codes = np.stack([p & 0xF, p >> 4], -1).reshape(3, 16)
    assert codes[0].tolist() == want
    # negatives: sign bit set, also when the magnitude rounds to zero; -0.0 stays 0x0
    assert codes[1].tolist() == [0] + [c | 8 for c in want[1:]]
    assert_same(w)


def test_negative_zero_and_small_negative():
    w = torch.zeros(1, 32)
    w[0, 0] = -0.0
    w[0, 1] = -1e-6
    w[0, 2] = 1.0
    p, _, _ = quantize_ref(w)
    assert p[0, 0] & 0xF == 0x0 and p[0, 0] >> 4 == 0x8
    assert_same(w)


def test_all_zero_tensor_defined():
    p, s, s2 = quantize_ref(torch.zeros(3, 32, dtype=torch.bfloat16))
    assert s2 == 0.0
    assert (p == 0).all()
    assert (torch.from_numpy(s).view(torch.float8_e4m3fn).float() == 1.0).all()
    assert_same(torch.zeros(3, 32, dtype=torch.bfloat16))


def test_zero_block_scale_is_one_and_underflow_clamps():
    w = torch.zeros(2, 48)
    w[0, :16] = torch.linspace(-1, 1, 16)
    w[1, 16:32] = 1e-7  # block scale underflows: clamped to 2^-9
    _p, s, _s2 = quantize_ref(w)
    sc = torch.from_numpy(s).view(torch.float8_e4m3fn).float()
    assert sc[0, 1] == 1.0 and sc[0, 2] == 1.0
    assert sc[1, 1] == 2.0**-9
    assert_same(w)


@pytest.mark.parametrize("shape", [(1, 16), (3, 16), (7, 48), (33, 160), (1, 2048)])
@pytest.mark.parametrize("scale", [1e-30, 1e-3, 1.0, 1e4, 1e30])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_shapes_and_magnitudes(shape, scale, dtype):
    if dtype == torch.float16 and not 1e-4 < scale < 1e4:
        pytest.skip("outside fp16's range")
    g = torch.Generator().manual_seed(hash((shape, scale)) & 0xFFFF)
    w = (torch.randn(shape, generator=g) * scale).to(dtype)
    assert_same(w)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 24),
    kb=st.integers(1, 6),
    exp=st.integers(-40, 40),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    seed=st.integers(0, 2**16),
    outliers=st.integers(0, 4),
)
def test_property_reference_equals_oracle(n, kb, exp, dtype, seed, outliers):
    if dtype == torch.float16:
        exp = max(-10, min(exp, 10))
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, kb * 16, generator=g) * 2.0**exp
    for _ in range(outliers):
        i = torch.randint(0, w.numel(), (1,), generator=g)
        w.view(-1)[i] *= 50
    big = torch.finfo(dtype).max
    assert_same(w.clamp(-big, big).to(dtype))  # inputs with inf are rejected before quantization


def test_backend_chunks_rows_identically(monkeypatch):
    import kimi_convert.kernels as k

    monkeypatch.setattr(k, "CHUNK_ELEMENTS", 64)
    w = torch.randn(37, 64).to(torch.bfloat16)
    amax = w.abs().amax().float()
    s2 = reference.global_scale(amax)
    p, s = get_backend("reference").quantize(w, amax)
    rp, rs = reference.quantize(w, s2)
    assert torch.equal(p, rp) and torch.equal(s.view(torch.uint8), rs.view(torch.uint8))


def test_dequantize_error_is_nvfp4_sized():
    w = torch.randn(64, 256)
    s2 = reference.global_scale(w.abs().amax())
    p, s = reference.quantize(w, s2)
    d = reference.dequantize(p, s, s2)
    rel = (d - w).norm() / w.norm()
    assert 0.02 < rel < 0.15
