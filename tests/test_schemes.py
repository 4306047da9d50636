"""The quantization schemes' registry (``convert/schemes``): each scheme module's tensors as each output format
spells them (the shapes and names docs/nvfp4.md, docs/compressed-tensors.md and docs/output-format.md give), the
weights it refuses, and the seam itself: a scheme registered here is written by the output formats, recorded in
the manifest and held to its own numeric bound without a change to them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kimi_convert import formats, schemes
from kimi_convert.enginecheck import numerics
from kimi_convert.plan import Kind
from kimi_convert.schemes import Spelling


def test_every_plan_kind_but_keep_and_copy_is_a_registered_scheme():
    assert set(schemes.SCHEMES) | {"keep", "copy"} == {k.value for k in Kind}
    assert all(schemes.quantized(k) for k in ("nvfp4", "fp8-block")) and not schemes.quantized("keep")


def test_nvfp4_in_modelopt_and_in_compressed_tensors():
    """ModelOpt: weight U8 [N, K/2], weight_scale e4m3 [N, K/16], F32 scalars; compressed-tensors: weight_packed,
    weight_global_scale and input_global_scale of shape [1]."""
    assert formats.tensor_specs("modelopt", "nvfp4", (256, 64), "BF16", True) == (
        (".weight", "U8", (256, 32)), (".weight_scale", "F8_E4M3", (256, 4)), (".weight_scale_2", "F32", ()),
        (".input_scale", "F32", ()))
    assert formats.tensor_specs("compressed-tensors", "nvfp4", (4, 256, 64), "BF16", False) == (
        (".weight_packed", "U8", (4, 256, 32)), (".weight_scale", "F8_E4M3", (4, 256, 4)),
        (".weight_global_scale", "F32", (1,)))
    assert formats.tensor_specs("compressed-tensors", "keep", (8, 16), "F16", False) == ((".weight", "F16", (8, 16)),)


def test_block_fp8_in_modelopt_and_refused_by_compressed_tensors():
    """One F32 scale a 128x128 tile, [ceil(N/128), 1, ceil(K/128), 1] (NVIDIA's K3 converter's shape)."""
    assert formats.tensor_specs("modelopt", "fp8-block", (300, 256), "BF16", False) == (
        (".weight", "F8_E4M3", (300, 256)), (".weight_scale", "F32", (3, 1, 2, 1)))
    assert sorted(formats.get("compressed-tensors").KINDS) == ["keep", "nvfp4"]
    assert sorted(formats.get("modelopt").KINDS) == ["fp8-block", "keep", "nvfp4"]
    with pytest.raises(ValueError, match="compressed-tensors format does not spell fp8-block"):
        schemes.tensor_specs("fp8-block", "compressed-tensors", (128, 128), False)


def test_the_activation_scale_is_written_as_each_format_reads_it():
    """ModelOpt's input_scale is the scale; compressed-tensors' input_global_scale its reciprocal."""
    parts = {"codes": ["c"], "scales": ["s"], "global": ["g"]}
    names = ("m.a", "m.b", "m.c", "m.d")
    mo = schemes.outputs("nvfp4", "modelopt", names, 0.5, parts)
    ct = schemes.outputs("nvfp4", "compressed-tensors", names, 0.5, parts)
    assert [n for n, _ in mo] == list(names) and [p for _, p in mo[:3]] == [["c"], ["s"], ["g"]]
    assert float(mo[3][1][0][0]) == 0.5 and float(ct[3][1][0][0]) == 2.0
    assert len(schemes.outputs("nvfp4", "modelopt", names[:3], None, parts)) == 3


@pytest.mark.parametrize(("kind", "shape", "fused", "stacked", "why"), [
    ("nvfp4", (4, 64, 32), False, False, "is not 2-D"),
    ("nvfp4", (4, 64, 32), True, True, None),  # a fused bank of experts
    ("nvfp4", (64, 24), False, False, "K=24 is not a multiple of 16"),
    ("fp8-block", (4, 128, 128), True, True, "is not 2-D"),
    ("fp8-block", (256, 200), False, False, "K=200 is not a multiple of 128"),
    ("fp8-block", (200, 256), False, False, None),  # N need not be whole tiles
])
def test_the_weights_a_scheme_refuses(kind, shape, fused, stacked, why):
    got = schemes.get(kind).shape_error(shape, fused, stacked)
    assert (got is None) if why is None else (why in got)


def test_the_quant_algo_names_each_format_gives_a_module():
    assert schemes.spelling("nvfp4", "modelopt").algo(None) == "W4A16_NVFP4"
    assert schemes.spelling("nvfp4", "modelopt").algo(1.0) == "NVFP4"
    assert schemes.spelling("nvfp4", "compressed-tensors").algo(None) == "NVFP4A16"
    assert schemes.spelling("fp8-block", "modelopt").algo(None) == "FP8_PB_WO"
    assert schemes.by_algo("modelopt", "FP8_PB_WO") is schemes.spelling("fp8-block", "modelopt")
    assert schemes.by_algo("modelopt", "MIXED_PRECISION") is None


def _toy_scheme():
    """A made-up scheme (8-bit codes, one F32 scale a row), spelled in ModelOpt's format only."""
    def roles(shape, scalar):
        return {"codes": ("U8", shape), "scales": ("F32", (shape[0],))}

    def engine_bound(placed, layer, expert, rows):
        return [(torch.full((n,), 0.25), torch.zeros((n, r.values.shape[1]), dtype=torch.bool))
                for r, _, n in placed]

    return SimpleNamespace(
        NAME="toy8", TITLE="toy", CARD="toy", TOTALS="toy8", INPUT_SCALE=False, roles=roles,
        SPELLINGS={"modelopt": Spelling(tensors=(("codes", ".weight"), ("scales", ".weight_scale")),
                                        algos=("TOY8",), layer_keys=(("bits", 8),))},
        shape_error=lambda shape, fused, stacked, experts: None,
        record=lambda algo, shared, scale: {"format": "toy8", "quant_algo": algo},
        engine_bound=engine_bound)


def test_a_new_scheme_is_written_by_the_formats_without_changing_them(monkeypatch):
    """The seam: register a scheme, and the formats size, fill and record its modules from its module alone."""
    monkeypatch.setitem(schemes.SCHEMES, "toy8", _toy_scheme())
    assert formats.tensor_specs("modelopt", "toy8", (32, 64), "BF16", False) == (
        (".weight", "U8", (32, 64)), (".weight_scale", "F32", (32,)))
    it = SimpleNamespace(kind="toy8", output_format="modelopt", input_scale=None, experts=0,
                         outputs=(SimpleNamespace(name="m.weight"), SimpleNamespace(name="m.weight_scale")))
    assert formats.outputs(it, {"codes": ["q"], "scales": ["s"]}) == [("m.weight", ["q"]), ("m.weight_scale", ["s"])]
    assert formats.record(it, None) == {"format": "toy8", "quant_algo": "TOY8"}
    assert "toy8" in schemes.spelled_by("modelopt") and "toy8" not in schemes.spelled_by("compressed-tensors")
    with pytest.raises(ValueError, match="does not spell toy8"):
        formats.tensor_specs("compressed-tensors", "toy8", (32, 64), "BF16", False)


def test_the_numeric_check_holds_a_new_scheme_to_its_own_bound(monkeypatch, tmp_path):
    """``numerics.compare`` asks the layer's scheme for its bound: rows within it pass, rows past it fail."""
    from safetensors.torch import save_file

    monkeypatch.setitem(schemes.SCHEMES, "toy8", _toy_scheme())
    src = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    noise = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    sources = SimpleNamespace(ref=lambda name: numerics.Ref(src, src, None, None, [name]), config={})
    for rel, ok in ((0.1, True), (0.9, False)):
        read = src + noise * (rel * src.norm(dim=-1, keepdim=True) / noise.norm(dim=-1, keepdim=True))
        save_file({"00000:w": read.contiguous()}, str(tmp_path / "numerics.safetensors"))
        layer = {"module": "m", "param": "m.weight", "kind": "linear", "scheme": "toy8", "rule": "t",
                 "processed": "", "key": "00000:w"}
        result = {"numerics": {"layers": [layer],
                               "placements": {"a.weight": [{"param": "m.weight", "row": 0, "rows": 8, "src_row": 0}]}}}
        rep = numerics.compare("vllm", result, tmp_path, sources)
        assert rep.ok is ok, rep.failures()
        assert rep.layers[0].max_bound == 0.25
