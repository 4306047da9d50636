"""The compute stage without torch (``compute_early``): the global scales, each unit's bytes and notes, and a
whole pack are those of the torch code (``compute.compute_unit`` on the CPU backend), and ``--device cpu`` on a
dense checkpoint never imports torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import rewrite_tensors, tree, write_synth
from kimi_convert import compute_early
from kimi_convert.compute import compute_unit
from kimi_convert.devices import get_backend
from kimi_convert.errors import ConvertError
from kimi_convert.kernels import ct_nvfp4, reference, scales
from kimi_convert.pack import load_plan
from kimi_convert.pipeline import is_pass_through
from kimi_convert.plan import Options, fp8_block_size
from kimi_convert.readers import BufferPool, Loaded, PreadReader


def _bits(x: float) -> int:
    return int(np.array(x, dtype=np.float32).view(np.uint32))


def test_global_scales_are_the_torch_codes():
    """Every positive bf16 value (and 20,000 random fp32 ones) as the amax: each plain global scale has the bits
    of its torch expression, compressed-tensors' in both weight dtypes (rounding where torch rounds) and ModelOpt's."""
    every_bf16 = (np.arange(0, 0x7F80, dtype=np.uint32) << 16).view(np.float32)
    rng = np.random.default_rng(0)
    random_f32 = rng.integers(0, 0x7F800000, 20_000, dtype=np.uint32).view(np.float32)
    for amax in [*every_bf16.tolist(), *random_f32.tolist()]:
        a = torch.tensor(amax, dtype=torch.float32)
        for dtype, name in ((torch.bfloat16, "BF16"), (torch.float32, "F32")):
            assert _bits(scales.compressed_tensors(amax, name)) == _bits(float(ct_nvfp4.global_scale(a, dtype)[0])), \
                (amax, name)
        assert _bits(scales.modelopt(amax)) == _bits(float(reference.global_scale(a))), amax
    with pytest.raises(ValueError, match="F16"):
        scales.compressed_tensors(1.0, "F16")


def _edge_values(tensors: dict[str, torch.Tensor]) -> None:
    """Weights the arithmetic treats apart: all zero, subnormal-small, near bf16's largest, stored in fp32."""
    names = sorted(n for n, t in tensors.items() if t.dim() == 2 and t.dtype == torch.bfloat16 and "proj" in n)
    for i, n in enumerate(names):
        t = tensors[n]
        if i % 5 == 0:
            tensors[n] = torch.zeros_like(t)
        elif i % 5 == 1:
            tensors[n] = t * 1e-37
        elif i % 5 == 2:
            tensors[n] = (t * 1e36).to(torch.bfloat16)
        elif i % 5 == 3:
            tensors[n] = t.float()


def _edited(tmp_path_factory, preset: str, seed: int, edit) -> Path:
    """``synth PRESET`` with ``edit(tensors)`` applied to each shard's tensors."""
    src = write_synth(preset, tmp_path_factory.mktemp("in") / preset, seed=seed)
    rewrite_tensors(src, edit)
    return src


@pytest.fixture(scope="module")
def edge_ckpt(tmp_path_factory):
    return _edited(tmp_path_factory, "tiny-qwen3-moe", 3, _edge_values)


def _fp8_edges(tensors: dict[str, torch.Tensor]) -> None:
    """FP8 weights the decoding treats apart: every e4m3 code (subnormals, +-0, the largest), and scales that make
    the products subnormal or large (where the scale is in the same shard)."""
    names = sorted(n for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn)
    for i, n in enumerate(names):
        t, s = tensors[n], tensors.get(n + "_scale_inv")
        if s is None or i % 4 == 0:
            codes = torch.arange(t.numel(), dtype=torch.int32) % 256
            codes[(codes & 0x7F) == 0x7F] = 0x7E  # (NaN codes: refused, test_nan_refused_in_the_same_words)
            tensors[n] = codes.to(torch.uint8).view(torch.float8_e4m3fn).reshape(t.shape)
        elif i % 4 == 1:
            tensors[n + "_scale_inv"] = s * 1e-38
        elif i % 4 == 2:
            tensors[n + "_scale_inv"] = s * 1e30


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    return _edited(tmp_path_factory, "tiny-deepseek-fp8", 5, _fp8_edges)


def _bf16_scales(tensors: dict[str, torch.Tensor]) -> None:
    for n in [n for n in tensors if n.endswith("weight_scale_inv")]:
        tensors[n] = tensors[n].to(torch.bfloat16)


@pytest.fixture(scope="module")
def bf16_scale_ckpt(tmp_path_factory):
    """MiniMax-M2's layout, its FP8 scales stored BF16."""
    return _edited(tmp_path_factory, "tiny-minimax-m2", 1, _bf16_scales)


def _same_as_compute_unit(ckpt_dir, recipe: str | None) -> list:
    """Every unit ``compute_early`` takes gives compute_unit's bytes, tensor by tensor, and its notes; the units."""
    ckpt, plan = load_plan(ckpt_dir, Options(recipe=recipe))
    cpu, block = get_backend("cpu", 2), fp8_block_size(ckpt.config)
    early = compute_early.EarlyCompute(2, block)
    pool, reader = BufferPool(limit=256 << 20), PreadReader(ckpt_dir)
    taken = [u for u in plan.units if compute_early.takes(u)]
    for unit in taken:
        loaded = Loaded({p.name: reader.read(p) for p in unit.parts})
        res, buf = early.compute(unit, loaded, pool)
        ref = compute_unit(unit, loaded, cpu, block)
        assert res.outputs.keys() == ref.outputs.keys()
        for k in ref.outputs:
            assert b"".join(bytes(np.asarray(c).reshape(-1).view(np.uint8)) for c in res.outputs[k].chunks) == \
                b"".join(bytes(np.asarray(c).reshape(-1).view(np.uint8)) for c in ref.outputs[k].chunks), k
        assert res.notes == ref.notes
        if buf is not None:
            pool.put(buf)
    reader.close()
    return taken


@pytest.mark.parametrize("recipe", ["nvfp4-w4a16", "ct-nvfp4-a16"])
def test_each_unit_matches_compute_unit(edge_ckpt, recipe):
    """Every unit of a dense checkpoint is taken, zero, tiny, huge and fp32 weights among them (and the plan's
    fused groups): each gives compute_unit's bytes and notes."""
    taken = _same_as_compute_unit(edge_ckpt, recipe)
    _, plan = load_plan(edge_ckpt, Options(recipe=recipe))
    assert len(taken) == len(plan.units)
    assert {s.dtype for u in taken for it in u.items if it.kind == "nvfp4" for s in it.sources} == {"BF16", "F32"}


@pytest.mark.parametrize("recipe", ["nvfp4-w4a16", "ct-nvfp4-a16"])
def test_each_fp8_unit_matches_compute_unit(fp8_ckpt, bf16_scale_ckpt, recipe):
    """DeepSeek's FP8 weights (every e4m3 code, products subnormal and large) and MiniMax's with BF16 scales,
    decoded and quantized here: compute_unit's bytes and notes."""
    for ckpt_dir in (fp8_ckpt, bf16_scale_ckpt):
        taken = _same_as_compute_unit(ckpt_dir, recipe)
        assert any(s.encoding == "fp8_block" for u in taken for it in u.items if it.kind == "nvfp4"
                   for s in it.sources), ckpt_dir


@pytest.fixture(scope="module")
def v32_fp8_ckpt(tmp_path_factory):
    """DeepSeek V3.2: its indexer's wk and the MTP layer's projections kept, stored FP8 (decoded to BF16)."""
    return _edited(tmp_path_factory, "tiny-deepseek-v3-2", 2, _fp8_edges)


def test_each_kept_fp8_unit_is_decoded_here_as_compute_unit(v32_fp8_ckpt):
    """A kept layer stored FP8 (every e4m3 code, products subnormal and large) decoded to BF16 by the C backend:
    compute_unit's bytes and note, and every such unit of the plan taken."""
    taken = _same_as_compute_unit(v32_fp8_ckpt, None)
    _, plan = load_plan(v32_fp8_ckpt, Options())
    decoded = [u for u in plan.units if any(it.operation == "decode" for it in u.items)]
    assert decoded and all(u in taken for u in decoded)
    assert {s.encoding for u in decoded for it in u.items for s in it.sources} == {"fp8_block"}


def test_fp8_decoded_to_bf16_rounds_as_torch_on_the_cpu():
    """``kc_fp8_decode_bf16_mt`` (a kept FP8 layer written BF16) rounds as torch's CPU ``to(torch.bfloat16)``:
    every class of fp32 value (ties to even both ways, subnormals, the largest finite, infinities, NaNs of either
    sign and payload), each made by the e4m3 code of 1.0 times a 1 x 1 tile's scale (one exact multiply)."""
    from kimi_convert.kernels import clib

    rng = np.random.default_rng(0)
    bits = np.concatenate([rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32),
                           np.array([0x3F808000, 0x3F818000, 0x3F807FFF, 0x00008000, 0x80018000, 0x7F7FFFFF,
                                     0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001,
                                     0, 0x80000000], dtype=np.uint32)])
    x = bits.view(np.float32).reshape(2, -1)
    codes = np.full(x.shape, 0x38, dtype=np.uint8)  # e4m3 1.0
    out = np.empty(x.shape, dtype=np.uint16)
    clib.fp8_decode_bf16(clib.load(), codes.ctypes.data, x.ctypes.data, *x.shape, (1, 1), out.ctypes.data, 2)
    want = torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(out, want)


def _int4_edges(tensors: dict[str, torch.Tensor]) -> None:
    """INT4 experts the decoding treats apart: scales that make the products subnormal or near fp32's largest,
    zero scales, scales stored F32 and F16 (the torch code widens each exactly), every code in every group."""
    names = sorted(n for n in tensors if n.endswith(".weight_scale") and n[:-5] + "packed" in tensors)
    for i, n in enumerate(names):
        s = tensors[n]
        if i % 6 == 0:
            tensors[n] = (s.float() * 1e-37).to(torch.bfloat16)
        elif i % 6 == 1:
            tensors[n] = s.float() * 1e36
        elif i % 6 == 2:
            tensors[n] = s.half()
        elif i % 6 == 3:
            tensors[n] = torch.where(torch.arange(s.shape[0]).unsqueeze(1) % 3 == 0, 0, s)
        elif i % 6 == 4:
            p = tensors[n[:-5] + "packed"]
            every = torch.arange(16, dtype=torch.int32).repeat(p.numel() * 8 // 16 + 1)[:p.numel() * 8]
            tensors[n[:-5] + "packed"] = (every.view(-1, 8) << (4 * torch.arange(8, dtype=torch.int32))).sum(
                1, dtype=torch.int32).view(p.shape)


@pytest.fixture(scope="module")
def int4_ckpt(tmp_path_factory):
    """Kimi K2.5's layout (INT4 pack-quantized routed experts) with ``_int4_edges``."""
    return _edited(tmp_path_factory, "tiny-kimi-k25", 2, _int4_edges)


@pytest.mark.parametrize("recipe", ["nvfp4-w4a16", "ct-nvfp4-a16"])
def test_each_int4_unit_matches_compute_unit(int4_ckpt, recipe):
    """Kimi K2.5's INT4 experts, decoded (``kc_int4_decode_mt``) and quantized here: every unit of the checkpoint
    taken, each with compute_unit's bytes and notes, the scales' three dtypes among them."""
    taken = _same_as_compute_unit(int4_ckpt, recipe)
    _, plan = load_plan(int4_ckpt, Options(recipe=recipe))
    assert len(taken) == len(plan.units)
    int4 = [s for u in taken for it in u.items if it.kind == "nvfp4" for s in it.sources if s.encoding == "int4_pack"]
    assert {s.parts[1].dtype for s in int4} == {"BF16", "F32", "F16"}


@pytest.mark.parametrize(("n", "k", "group"), [(3, 32, 2), (6, 48, 16), (5, 96, 32), (9, 160, 32), (70, 256, 32),
                                                (257, 512, 128), (40, 4096, 4096)])  # row tails: 48 and 80 bytes
@pytest.mark.parametrize("threads", [1, 3])
def test_the_int4_kernels_are_the_decoded_weights_amax_and_quantization(n, k, group, threads):
    """``kc_int4_amax_mt`` / ``kc_int4_quant_mt`` (rows decoded one at a time, never whole) give the amax and both
    formats' bytes of ``kc_amax_f32`` / ``kc_quant_f32`` / ``kc_ct_quant`` on the weight the torch code decodes
    (``kernels.encodings.decode_int4``), every code in the mix, subnormal and large scales among the groups."""
    from kimi_convert.kernels import clib
    from kimi_convert.kernels.encodings import decode_int4

    g = torch.Generator().manual_seed(n + k)
    packed = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, generator=g)
    scale = torch.randn(n, k // group, generator=g) * torch.tensor([1e-40, 1e-3, 1.0, 1e30]).repeat(k)[:k // group]
    lib, values = clib.load(), decode_int4(packed, scale).numpy()
    codes, sc = packed.numpy().view(np.uint8), scale.numpy()
    bits = clib.int4_amax_bits(lib, codes.ctypes.data, sc.ctypes.data, n, k, k // group, threads)
    assert bits == clib.amax_bits(lib, values.ctypes.data, n * k, True, threads)
    amax = float(np.array(bits, dtype=np.uint32).view(np.float32))
    for ct, s2 in ((False, scales.modelopt(amax)), (True, scales.compressed_tensors(amax, "F32"))):
        got, want = [(np.zeros(n * k // 2, np.uint8), np.zeros(n * k // 16, np.uint8)) for _ in range(2)]
        clib.int4_quant(lib, codes.ctypes.data, sc.ctypes.data, n, k, k // group, ct, s2, got[0].ctypes.data,
                        got[1].ctypes.data, threads)
        (clib.ct_quant if ct else clib.quant)(lib, values.ctypes.data, n, k, True, s2, want[0].ctypes.data,
                                              want[1].ctypes.data, threads)
        assert got[0].tobytes() == want[0].tobytes() and got[1].tobytes() == want[1].tobytes(), ct


@pytest.mark.parametrize(("n", "k", "block"), [(3, 32, (128, 128)), (130, 256, (128, 128)), (257, 400, (128, 128)),
                                               (40, 96, (16, 48)), (9, 4096, (2, 4096))])
@pytest.mark.parametrize("threads", [1, 3])
def test_the_fp8_kernels_are_the_decoded_weights_amax_and_quantization(n, k, block, threads):
    """``kc_fp8_amax_mt`` / ``kc_fp8_quant_mt`` (rows decoded one at a time, never whole) give the amax and both
    formats' bytes of ``kc_amax_f32`` / ``kc_quant_f32`` / ``kc_ct_quant`` on the weight the torch code decodes
    (``kernels.encodings.decode_fp8_block``): every e4m3 code but NaN's, tiles cut at the edges (rows and columns not
    whole tiles), subnormal, small and large scales among the tiles."""
    from kimi_convert.kernels import clib
    from kimi_convert.kernels.encodings import decode_fp8_block

    g = torch.Generator().manual_seed(n + k)
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)
    codes[(codes & 0x7F) == 0x7F] = 0x42
    codes.view(-1)[:254] = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)[: n * k]
    tiles = (-(-n // block[0]), -(-k // block[1]))
    scale = torch.randn(tiles, generator=g) * torch.tensor([1e-40, 1e-3, 1.0, 1e30]).repeat(tiles[1] * tiles[0])[
        : tiles[0] * tiles[1]].reshape(tiles)
    lib = clib.load()
    values = decode_fp8_block(codes.view(torch.float8_e4m3fn), scale, block).numpy()
    q, sc = codes.numpy(), scale.numpy()
    bits = clib.fp8_amax_bits(lib, q.ctypes.data, sc.ctypes.data, n, k, block, threads)
    assert bits == clib.amax_bits(lib, values.ctypes.data, n * k, True, threads)
    amax = float(np.array(bits, dtype=np.uint32).view(np.float32))
    for ct, s2 in ((False, scales.modelopt(amax)), (True, scales.compressed_tensors(amax, "F32"))):
        got, want = [(np.zeros(n * k // 2, np.uint8), np.zeros(n * k // 16, np.uint8)) for _ in range(2)]
        clib.fp8_quant(lib, q.ctypes.data, sc.ctypes.data, n, k, block, ct, s2, got[0].ctypes.data,
                       got[1].ctypes.data, threads)
        (clib.ct_quant if ct else clib.quant)(lib, values.ctypes.data, n, k, True, s2, want[0].ctypes.data,
                                              want[1].ctypes.data, threads)
        assert got[0].tobytes() == want[0].tobytes() and got[1].tobytes() == want[1].tobytes(), ct
    codes.view(-1)[n * k // 2] = 0xFF  # a NaN code: the amax says so
    assert clib.fp8_amax_bits(lib, q.ctypes.data, sc.ctypes.data, n, k, block, threads) == 0x7F800000


def _refusals(src: Path, name: str) -> tuple[str, str]:
    """The errors of ``compute_early`` and of the torch code on the unit that reads the tensor or part ``name``
    (which ``compute_early`` takes)."""
    ckpt, plan = load_plan(src, Options())
    unit = next(u for u in plan.units if any(name in (s.name, *(p.name for p in s.parts))
                                             for it in u.items for s in it.sources))
    assert compute_early.takes(unit)
    reader = PreadReader(src)
    loaded = Loaded({p.name: reader.read(p) for p in unit.parts})
    block = fp8_block_size(ckpt.config)
    with pytest.raises(ConvertError) as early:
        compute_early.EarlyCompute(2, block).compute(unit, loaded, BufferPool(limit=64 << 20))
    with pytest.raises(ConvertError) as torch_code:
        compute_unit(unit, loaded, get_backend("cpu", 2), block)
    reader.close()
    return str(early.value), str(torch_code.value)


#: an INT4 expert's scale edits, each refused when the expert is decoded: the words of both codes
INT4_REFUSED = {"nan": ("weight_scale", lambda t: t.float().index_put_((torch.tensor(1), torch.tensor(0)),
                                                                       torch.tensor(float("nan")))),
                "overflow": ("weight_scale", lambda t: torch.full_like(t, 3.0e38, dtype=torch.float32)),
                "shape": ("weight_shape", lambda t: torch.tensor([int(t[0]), int(t[1]) - 8], dtype=t.dtype))}


@pytest.mark.parametrize("fault", sorted(INT4_REFUSED))
def test_int4_faults_refused_in_the_same_words(tmp_path, fault):
    """A NaN scale, scales whose products overflow fp32, a ``weight_shape`` not the weight's: the torch code's
    one-line error, word for word."""
    src = write_synth("tiny-kimi-k25", tmp_path / "src", seed=0)
    expert = "language_model.model.layers.1.mlp.experts.1.down_proj"
    part, edit = INT4_REFUSED[fault]

    def plant(tensors):
        if f"{expert}.{part}" in tensors:
            tensors[f"{expert}.{part}"] = edit(tensors[f"{expert}.{part}"])
    rewrite_tensors(src, plant)
    early, torch_code = _refusals(src, f"{expert}.{part}")
    assert early == torch_code and f"{expert}.{part}" in early


#: per preset, the weight given a NaN (an FP8 weight: e4m3's NaN code 0x7F; an E8M0 scale: its NaN byte 0xFF)
NAN_AT = {"tiny-qwen3-moe": "model.layers.0.mlp.experts.1.up_proj.weight",
          "tiny-deepseek-fp8": "model.layers.1.mlp.experts.1.up_proj.weight",
          "tiny-k3": "language_model.model.layers.1.block_sparse_moe.experts.2.w3.weight_scale"}


@pytest.mark.parametrize("preset", sorted(NAN_AT))
def test_nan_refused_in_the_same_words(tmp_path, preset):
    """A NaN in a BF16 weight, or an FP8 weight's NaN code: the torch code's one-line error, word for word."""
    src = write_synth(preset, tmp_path / "src", seed=0)

    def plant(tensors):
        t = tensors.get(NAN_AT[preset])  # (in one of the shards)
        if t is None:
            return
        if t.dtype == torch.float8_e4m3fn:
            t.view(torch.uint8)[0, 3] = 0x7F
        elif t.dtype == torch.uint8:
            t[1, 0] = t[2, 1] = 0xFF
        else:
            t[0, 3] = float("nan")
    rewrite_tensors(src, plant)
    early, torch_code = _refusals(src, NAN_AT[preset])
    assert early == torch_code and "NaN" in early


@pytest.mark.parametrize("recipe", [None, "nvfp4-w4a16"])
def test_each_k3_unit_matches_compute_unit(tiny_k3, recipe, monkeypatch):
    """Kimi K3 under NVIDIA's recipe (its MXFP4 experts cast, its attention block FP8) and under nvfp4-w4a16: every
    unit taken, compute_unit's bytes and notes; with KIMI_CONVERT_RECIPE_KERNELS=torch (the tests' switch to the
    recipe's torch code) the cast and block-FP8 units are left to it."""
    taken = _same_as_compute_unit(tiny_k3, recipe)
    _, plan = load_plan(tiny_k3, Options(recipe=recipe))
    assert len(taken) == len(plan.units)
    recipe_units = [u for u in plan.units if any(it.kind == "fp8-block" or any(s.encoding == "mxfp4"
                                                                                for s in it.sources)
                                                 for it in u.items if it.kind != "keep")]
    assert recipe_units
    monkeypatch.setenv("KIMI_CONVERT_RECIPE_KERNELS", "torch")
    assert not any(compute_early.takes(u) for u in recipe_units)


def test_gpt_oss_banks_wait_for_torch(tmp_path):
    """gpt-oss's MXFP4 banks (rows de-interleaved by a view) are torch's."""
    src = write_synth("tiny-gpt-oss", tmp_path / "g", seed=0)
    _, plan = load_plan(src, Options())
    banked = [u for u in plan.units if any(s.view for it in u.items for s in it.sources)]
    assert banked and not any(compute_early.takes(u) for u in banked)


PACK = """
import json, sys
import kimi_convert.compute_early as ce
if sys.argv[1] == "torch":
    ce.takes = lambda unit: False
from kimi_convert.pack import pack
from kimi_convert.plan import Options
r = pack(sys.argv[2], sys.argv[3], Options(recipe=sys.argv[4] or None), device="cpu", progress=False)
print(json.dumps({"torch": "torch" in sys.modules, "early_units": r.stats.early_units}))
"""


def _pack(how: str, src, out, recipe: str) -> dict:
    r = subprocess.run([sys.executable, "-c", PACK, how, str(src), str(out), recipe], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


@pytest.mark.parametrize("recipe", ["nvfp4-w4a16", "ct-nvfp4-a16"])
def test_dense_pack_on_the_cpus_never_imports_torch(edge_ckpt, tmp_path, recipe):
    """``--device cpu`` on a dense checkpoint: every unit without torch, torch never imported, and every file of
    the output (manifest included) that of the same pack with every unit computed by the torch code."""
    early = _pack("early", edge_ckpt, tmp_path / "early", recipe)
    torch_code = _pack("torch", edge_ckpt, tmp_path / "torch", recipe)
    _, plan = load_plan(edge_ckpt, Options(recipe=recipe))
    computed = [u for u in plan.units if not is_pass_through(u)]  # (the others are copied, never computed)
    assert early == {"torch": False, "early_units": len(computed)}
    assert torch_code == {"torch": True, "early_units": 0}
    assert tree(tmp_path / "early") == tree(tmp_path / "torch")


@pytest.mark.parametrize(("preset", "recipe", "needs_torch"), [("tiny-k3", "", False), ("tiny-deepseek-fp8", "", False),
                                                                ("tiny-kimi-k25", "", False),
                                                                ("tiny-deepseek-v3-2", "", False),
                                                                ("tiny-gpt-oss", "", True)])
def test_pack_takes_what_it_can_and_torch_the_rest(preset, recipe, needs_torch, tmp_path):
    """Kimi K3 under NVIDIA's recipe, DeepSeek V3 (FP8 weights, decoded here), Kimi K2.5 (INT4 experts, decoded
    here) and DeepSeek V3.2 (its kept FP8 layers decoded to BF16 here) pack wholly without torch, never importing
    it; gpt-oss (its banks: torch's) with torch: each the same files as the torch code alone."""
    src = write_synth(preset, tmp_path / "src", seed=0)
    early = _pack("early", src, tmp_path / "early", recipe)
    torch_code = _pack("torch", src, tmp_path / "torch", recipe)
    assert early["torch"] is needs_torch and torch_code["early_units"] == 0
    assert needs_torch or early["early_units"] > 0
    assert tree(tmp_path / "early") == tree(tmp_path / "torch")
