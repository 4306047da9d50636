"""The INT4 source encoding (compressed-tensors ``pack-quantized``: Kimi K2.5 / K2.6's routed experts), held to
compressed-tensors' own packing and dequantization (the peer library, not a re-implementation), and its
refusals of malformed input (one line, exit 2)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.lifecycle.forward import dequantize

from helpers import copy_ckpt, edit_config, one_line_error, read_tensors, rewrite_tensors, run, write_synth
from kimi_convert import encodings
from kimi_convert.checkpoint import open_checkpoint
from kimi_convert.errors import ConvertError
from kimi_convert.kernels import recipe_cpu
from kimi_convert.kernels.encodings import DecodeError, decode_int4
from kimi_convert.plan import discover_sources

PRESET = "tiny-kimi-k25"
EXPERT = "language_model.model.layers.1.mlp.experts.0.down_proj"


@pytest.fixture(scope="module")
def tiny_k25(tmp_path_factory) -> Path:
    return write_synth(PRESET, tmp_path_factory.mktemp("k25") / "src")


def _scheme(group: int = 32) -> QuantizationScheme:
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=4, type="int", symmetric=True,
                                                                          strategy="group", group_size=group))


def _random(n: int, k: int, group: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    scale = (torch.rand((n, k // group), generator=g) * 2.0**torch.randint(-20, 4, (n, k // group), generator=g))
    return codes, scale.to(torch.bfloat16)


@pytest.mark.parametrize(("n", "k", "group"), [(4, 64, 32), (16, 256, 32), (3, 96, 16), (2, 128, 128)])
def test_decoding_is_compressed_tensors_own_unpack_times_the_scale_exactly(n, k, group):
    codes, scale = _random(n, k, group)
    packed = pack_to_int32(codes, 4)
    assert packed.dtype == torch.int32 and packed.shape == (n, k // 8)
    got = decode_int4(packed, scale)
    assert torch.equal(unpack_from_int32(packed, 4, torch.Size((n, k))), codes)
    # compressed-tensors' dequantize in fp32 is the exact product; in the scale's dtype (its decompress) it is
    # that product rounded to BF16
    assert torch.equal(got, dequantize(codes, scale.float(), dtype=torch.float32))
    state = {"weight_packed": packed, "weight_scale": scale, "weight_shape": torch.tensor([n, k])}
    assert torch.equal(got.to(torch.bfloat16), PackedQuantizationCompressor.decompress(state, _scheme(group))["weight"])


@pytest.mark.parametrize(("n", "k", "group", "threads"), [(64, 2048, 32, 2), (64, 2048, 32, 1), (5, 96, 16, 2),
                                                       (300, 512, 128, 2)])
def test_the_c_decode_is_compressed_tensors_own_unpack_times_the_scale(n, k, group, threads):
    """recipe_cpu.c's decode (which decode_int4 takes on the CPU) against compressed-tensors' unpack and dequantize
    in fp32, bit for bit, on one thread and split across two (the larger shapes split into tasks)."""
    lib = recipe_cpu.load()
    if lib is None:
        pytest.skip("no C compiler: the torch code decodes")
    codes, scale = _random(n, k, group, seed=n)
    got = recipe_cpu.int4_decode(lib, pack_to_int32(codes, 4), scale.float(), threads)
    assert got is not None
    want = dequantize(codes, scale.float(), dtype=torch.float32)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_the_c_decode_leaves_an_overflow_and_odd_groups_to_the_torch_code():
    lib = recipe_cpu.load()
    if lib is None:
        pytest.skip("no C compiler: the torch code decodes")
    packed = pack_to_int32(torch.full((2, 64), -8, dtype=torch.int8), 4)
    assert recipe_cpu.int4_decode(lib, packed, torch.full((2, 2), 3.0e38), 1) is None
    assert recipe_cpu.int4_decode(lib, packed, torch.ones((2, 64)), 1) is None  # a group of one element


def test_an_int4_times_bf16_product_is_not_always_a_bf16_value():
    """Why decoding is fp32: 7 x (1 + 2^-7) needs 10 significant bits, BF16 holds 8."""
    codes = torch.tensor([[7] + [0] * 31], dtype=torch.int8)
    scale = torch.tensor([[1 + 2.0**-7]], dtype=torch.bfloat16)
    got = decode_int4(pack_to_int32(codes, 4), scale)
    assert got[0, 0].item() == 7 * (1 + 2.0**-7)
    assert got[0, 0].to(torch.bfloat16).item() != got[0, 0].item()


def test_a_scale_that_cannot_be_decoded_is_refused():
    codes, scale = _random(2, 64, 32)
    scale[1, 0] = float("nan")
    with pytest.raises(DecodeError, match="not finite"):
        decode_int4(pack_to_int32(codes, 4), scale)
    scale[1, 0] = 3.0e38
    with pytest.raises(DecodeError, match="overflow"):
        decode_int4(pack_to_int32(torch.full((2, 64), -8, dtype=torch.int8), 4), scale)


def test_the_preset_writes_what_compressed_tensors_decompresses(tiny_k25):
    """The synthetic release is compressed-tensors' format: its own decompress reads it, and the encoding
    decodes every expert to the same values (rounded as BF16)."""
    t = read_tensors(tiny_k25)
    assert t[f"{EXPERT}.weight_packed"].dtype == torch.int32 and t[f"{EXPERT}.weight_shape"].tolist() == [256, 128]
    assert t[f"{EXPERT}.weight_scale"].dtype == torch.bfloat16 and t[f"{EXPERT}.weight_scale"].shape == (256, 4)
    sources = discover_sources(open_checkpoint(tiny_k25))
    experts = {m: s["weight"] for m, s in sources.items() if ".experts." in m}
    assert len(experts) == 8 * 3 and {s.encoding for s in experts.values()} == {"int4_pack"}
    for mod, src in experts.items():
        state = {p: t[f"{mod}.{p}"] for p in ("weight_packed", "weight_scale", "weight_shape")}
        want = PackedQuantizationCompressor.decompress(state, _scheme())["weight"]
        got = encodings.decode(src, [state["weight_packed"], state["weight_scale"], state["weight_shape"]], (128, 128))
        assert got.shape == src.shape and torch.equal(got.to(torch.bfloat16), want), mod
    assert not [m for m, s in sources.items() if ".experts." not in m and s["weight"].encoding != "dense"]


PACKED, SCALE, SHAPE = (f"{EXPERT}.{p}" for p in ("weight_packed", "weight_scale", "weight_shape"))
STRAY = "language_model.model.layers.1.mlp.stray.weight_shape"


def _edit(changes: dict):
    """A ``rewrite_tensors`` function: each name -> its new value from the old (None: removed), in the file
    holding the expert's packed weight."""
    def fn(t: dict) -> None:
        if PACKED not in t:
            return
        for name, change in changes.items():
            new = change(t.get(name))
            if new is None:
                t.pop(name)
            else:
                t[name] = new
    return fn


@pytest.mark.parametrize(("changes", "pattern"), [
    ({PACKED: lambda v: v[:, :-4].contiguous()},
     rf"tensor {SCALE}: INT4 scale must be BF16 \[256, 3\] for a \[256, 96\] weight in groups of 32, "
     r"is BF16\[256, 4\]"),
    ({SCALE: lambda v: None}, rf"tensor {PACKED}: INT4 packed weight without its {SCALE}"),
    ({SHAPE: lambda v: None}, rf"tensor {PACKED}: INT4 packed weight without its {SHAPE}"),
    ({PACKED: lambda v: v[:, :-2].contiguous(), SCALE: lambda v: v[:, :3].contiguous()},
     rf"tensor {PACKED}: INT4 group size 32 does not divide K = 112"),
    ({SHAPE: lambda v: torch.zeros(3, dtype=torch.int64)}, r"INT4 weight_shape must be I64 or I32 \[2\], is I64\[3\]"),
    ({STRAY: lambda v: torch.zeros(2, dtype=torch.int64)}, rf"tensor {STRAY}: INT4 weight_shape without its weight "),
])
def test_malformed_int4_tensors_are_refused_in_one_line(tiny_k25, tmp_path, changes, pattern):
    src = copy_ckpt(tiny_k25, tmp_path / "bad")
    rewrite_tensors(src, _edit(changes))
    with pytest.raises(ConvertError, match=pattern):
        discover_sources(open_checkpoint(src))
    assert re.search(pattern, one_line_error(run("plan", src)))


@pytest.mark.parametrize(("key", "value", "pattern"), [
    ("symmetric", False, r"weights.symmetric is False: the INT4 pack-quantized weights this tool reads have "
                         r"symmetric True"),
    ("num_bits", 8, r"weights.num_bits is 8"),
    ("group_size", 0, r"weights.group_size is 0: a positive integer"),
    ("actorder", "group", r"weights.actorder is 'group': weight_g_idx reordering is not read"),
])
def test_a_quantization_config_the_decoder_cannot_read_is_refused(tiny_k25, tmp_path, key, value, pattern):
    src = copy_ckpt(tiny_k25, tmp_path / "cfg")
    edit_config(src, lambda c: c["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]
                .update({key: value}))
    err = one_line_error(run("plan", src))
    assert "text_config.quantization_config.config_groups.group_0" in err and re.search(pattern, err)


def test_a_group_size_that_does_not_match_the_scales_is_refused(tiny_k25, tmp_path):
    src = copy_ckpt(tiny_k25, tmp_path / "g")
    edit_config(src, lambda c: c["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]
                .update({"group_size": 64}))
    err = one_line_error(run("plan", src))
    assert "INT4 scale must be BF16" in err and "in groups of 64" in err


def test_a_weight_shape_that_disagrees_with_the_packed_weight_is_refused_when_decoded(tiny_k25, tmp_path):
    src = copy_ckpt(tiny_k25, tmp_path / "ws")
    rewrite_tensors(src, _edit({SHAPE: lambda v: torch.tensor([256, 120])}))
    err = one_line_error(run("pack", src, tmp_path / "out", "--device", "cpu"))
    assert f"{EXPERT}.weight_shape: INT4 weight_shape [256, 120] is not the packed weight's [256, 128]" in err
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_int4_tensors_without_their_quantization_config_are_refused(tiny_k25, tmp_path):
    src = copy_ckpt(tiny_k25, tmp_path / "noq")
    edit_config(src, lambda c: c["text_config"].pop("quantization_config"))
    err = one_line_error(run("plan", src))
    assert "weight_packed: INT4 packed weight, but config.json declares no compressed-tensors pack-quantized" in err
