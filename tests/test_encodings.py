"""The source-encoding seam (issue 22 item 2): an encoding is one module, found by discovery, decoded by
compute and refused by its own rules without a line of plan/ or compute.py naming it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from fake_encoding import Transposed

from helpers import copy_ckpt, rewrite_tensors
from kimi_convert import encodings
from kimi_convert.checkpoint import open_checkpoint
from kimi_convert.compute import compute_unit
from kimi_convert.devices import get_backend
from kimi_convert.encodings import Slice, SourceTensor, narrow
from kimi_convert.errors import ConvertError
from kimi_convert.kernels.encodings import decode_mxfp4
from kimi_convert.pack import load_plan
from kimi_convert.plan import KEEP, NVFP4, Options, discover_sources, fp8_block_size
from kimi_convert.readers import MappedReader
from kimi_convert.safetensors_format import TensorInfo

ROOT = Path(__file__).parents[1]
TRANSPOSED = (".mlp.down_proj.weight", ".self_attn.o_proj.weight")


@pytest.fixture
def transposed(monkeypatch):
    """The fake encoding registered as a new one is: one entry in the registry, before the fallback."""
    monkeypatch.setattr(encodings, "REGISTRY", [*encodings.REGISTRY[:-1], Transposed(), encodings.REGISTRY[-1]])


def _transpose(folder: Path) -> list[str]:
    moved = []

    def fn(tensors):
        for name in [n for n in tensors if n.endswith(TRANSPOSED)]:
            tensors[name + "_t"] = tensors.pop(name).t().contiguous()
            moved.append(name)
    rewrite_tensors(folder, fn)
    return moved


def _outputs(folder: Path, opts: Options) -> tuple[dict[str, bytes], dict]:
    ckpt, plan = load_plan(folder, opts)
    reader, backend, block = MappedReader(folder), get_backend("cpu"), fp8_block_size(ckpt.config)
    out, kinds = {}, {}
    for u in plan.units:
        res = compute_unit(u, reader, backend, block)
        for it in u.items:
            kinds[it.name] = (it.kind, [s.encoding for s in it.sources])
        out.update({k: b"".join(bytes(memoryview(c)) for c in v.chunks) for k, v in res.outputs.items()})
    return out, kinds


def test_a_new_encoding_in_one_module_is_discovered_decoded_and_packed_to_the_same_bytes(tiny_kl, tmp_path,
                                                                                           transposed):
    src = copy_ckpt(tiny_kl, tmp_path / "t")
    moved = _transpose(src)
    assert moved
    modules = discover_sources(open_checkpoint(src))
    for name in moved:
        s = modules[name.removesuffix(".weight")]["weight"]
        assert (s.encoding, s.name, s.parts[0].name) == ("transposed", name, name + "_t")
    kept = moved[0].removesuffix(".weight")  # kept in high precision: decoded to BF16, the same bytes
    opts = Options(exclude=(kept,))
    want, _ = _outputs(tiny_kl, opts)
    got, kinds = _outputs(src, opts)
    assert got == want
    assert kinds[kept] == (KEEP, ["transposed"])
    assert any(k == NVFP4 and "transposed" in e for k, e in kinds.values())


def test_a_new_encoding_refuses_by_its_own_rules(tiny_kl, tmp_path, transposed):
    src = copy_ckpt(tiny_kl, tmp_path / "t")
    name = _transpose(src)[0] + "_t"
    rewrite_tensors(src, lambda t: name in t and t.update({name: t[name].reshape(1, *t[name].shape)}))
    with pytest.raises(ConvertError, match=rf"tensor {name}: a transposed weight must be BF16 \[K, N\], is BF16\["):
        discover_sources(open_checkpoint(src))


def test_the_refusal_of_a_converted_checkpoint_names_the_registered_encodings(transposed):
    assert encodings.labels() == "BF16, INT4, MXFP4, block-FP8 or transposed BF16"


def test_no_encoding_is_named_outside_its_module():
    """Discovery and decoding know no encoding by name: that is what makes a new one one module."""
    for path, words in (("convert/plan/discover.py", ("weight_packed", "weight_scale_inv", "F8_E4M3", "MXFP4")),
                        ("convert/compute.py", ("decode_mxfp4", "decode_fp8_block", "Encoding.MXFP4",
                                                "Encoding.FP8_BLOCK", "k_max("))):
        text = (ROOT / path).read_text()
        assert [w for w in words if w in text] == [], path


def _info(name: str, dtype: str, shape: tuple[int, ...], start: int = 0) -> TensorInfo:
    size = math.prod(shape) * {"U8": 1, "BF16": 2}[dtype]
    return TensorInfo(name, "x.safetensors", dtype, shape, start, start + size)


def test_one_stored_tensor_as_several_logical_weights():
    """What gpt-oss needs, expressed with the interface: one expert of a 3-D bank is a byte range of the
    stored tensor (narrow); its interleaved gate and up rows are views of every part, codes and scales alike."""
    g = torch.Generator().manual_seed(0)
    e, rows, k = 3, 8, 64
    packed = torch.randint(0, 256, (e, rows, k // 2), dtype=torch.uint8, generator=g)
    scale = torch.randint(120, 130, (e, rows, k // 32), dtype=torch.uint8, generator=g)
    p_info, s_info = _info("blocks", "U8", tuple(packed.shape)), _info("scales", "U8", tuple(scale.shape), 1 << 20)
    one = narrow(p_info, 1)
    assert (one.shape, one.start, one.end) == ((rows, k // 2), rows * k // 2, 2 * rows * k // 2)
    assert narrow(p_info, 1, 3).shape == (2, rows, k // 2)
    # parts of one stored tensor are told apart by name (the pipeline keys parts by name); the stored name is kept
    assert (one.name, narrow(p_info, 1, 3).name) == ("blocks[1]", "blocks[1:3]")
    assert encodings.stored_name(one) == encodings.stored_name(p_info) == "blocks"
    for j in (0, 1):
        src = SourceTensor("experts.1.gate_up", f"half{j}", encodings.Encoding.MXFP4, "MXFP4", (rows // 2, k),
                           (narrow(p_info, 1), narrow(s_info, 1)), (Slice(0, j, None, 2),))
        got = encodings.decode(src, [packed[1], scale[1]], (128, 128))
        assert torch.equal(got, decode_mxfp4(packed[1], scale[1])[j::2])
        codes = encodings.mxfp4_codes(src, [packed[1], scale[1]])
        assert torch.equal(codes.packed, packed[1][j::2]) and torch.equal(codes.scale, scale[1][j::2])


def test_source_formats_and_decoding_come_from_the_encodings():
    assert encodings.source_formats() == {"compressed-tensors": {"mxfp4-pack-quantized", "pack-quantized"},
                                          "fp8": {"e4m3", "float8_e4m3fn"},  # DeepSeek V3's and MiniMax-M2's fmt
                                          "mxfp4": {"mxfp4"}}  # gpt-oss (no format key: its method's one)
    # DeepSeek V4's two (weight + .scale) before fp8_block, which refuses an F8_E4M3 weight without weight_scale_inv;
    # INT4 (I32 weight_packed) before MXFP4, which refuses a weight_packed that is not U8
    assert [type(enc).__name__ for enc in encodings.REGISTRY] == ["Int4Pack", "MXFP4", "DeepseekV4MXFP4",
                                                                   "DeepseekV4FP8", "FP8Block", "GptOssMXFP4", "Dense"]
    scale = torch.full((2, 1), 255, dtype=torch.uint8)
    src = SourceTensor("m", "m.weight", encodings.Encoding.MXFP4, "MXFP4", (2, 32),
                       (_info("m.weight_packed", "U8", (2, 16)), _info("m.weight_scale", "U8", (2, 1), 32)))
    with pytest.raises(ConvertError, match=r"^x.safetensors: tensor m.weight_scale: E8M0 scale 255 \(NaN\)"):
        encodings.decode(src, [torch.zeros(2, 16, dtype=torch.uint8), scale], (128, 128))
    with pytest.raises(ConvertError, match=r"^x.safetensors: tensor m.weight_scale: E8M0 scale byte 0xFF"):
        encodings.mxfp4_codes(src, [torch.zeros(2, 16, dtype=torch.uint8), scale])


def test_a_plain_tensor_named_scale_is_no_stray_scale():
    """Gemma 4's router stores a BF16 vector ``router.scale`` beside ``router.proj.weight`` (transformers'
    Gemma4TextRouter): no weight of that module, yet no scale either. DeepSeek V4's encodings, whose weights' scales
    are named ``scale``, refuse a stray one only in a scale dtype (F8_E8M0, F32), so the BF16 vector is left to the
    dense fallback while an E8M0 scale without its weight is still refused."""
    plain = {"m.router.scale": TensorInfo("m.router.scale", "x.safetensors", "BF16", (256,), 0, 512)}
    stray = {"m.ffn.w1.scale": TensorInfo("m.ffn.w1.scale", "x.safetensors", "F8_E8M0", (256, 8), 0, 2048)}
    encs = encodings.strays()["scale"]
    assert encs
    for enc in encs:
        enc.refuse_leftover("m.router.scale", plain)
        with pytest.raises(ConvertError, match="scale without its weight m.ffn.w1.weight"):
            enc.refuse_leftover("m.ffn.w1.scale", stray)
