"""The source-encoding seam (issue 22 item 2): an encoding is one module, found by discovery, decoded by
compute and refused by its own rules without a line of plan/ or compute.py naming it."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from fake_encoding import Transposed
from safetensors.torch import save_file

from helpers import copy_ckpt, edit_config, one_line_error, read_tensors, rewrite_tensors, run
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
                                                                   "DeepseekV4FP8", "FP8Block", "GptOssMXFP4",
                                                                   "ExpertBank", "Dense"]
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


#: A Granite 3.x MoE checkpoint at a tiny size (the release's names: transformers' GraniteMoeForCausalLM)
GRANITE = {"architectures": ["GraniteMoeForCausalLM"], "model_type": "granitemoe", "hidden_size": 32,
           "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 1,
           "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 64, "tie_word_embeddings": False,
           "torch_dtype": "bfloat16"}


def _granite(folder: Path, per_expert: bool) -> Path:
    """One layer of Granite MoE: its experts as the release stores them (``input_linear`` [E, 2I, H], gate rows
    then up rows; ``output_linear`` [E, H, I]), or the same weights one tensor per expert and projection."""
    g = torch.Generator().manual_seed(7)
    r = lambda *shape: torch.randn(*shape, generator=g).to(torch.bfloat16)  # noqa: E731
    e, h, i = GRANITE["num_local_experts"], GRANITE["hidden_size"], GRANITE["intermediate_size"]
    layer = "model.layers.0"
    t = {"model.embed_tokens.weight": r(64, h), "lm_head.weight": r(64, h), "model.norm.weight": r(h),
         f"{layer}.input_layernorm.weight": r(h), f"{layer}.post_attention_layernorm.weight": r(h),
         f"{layer}.block_sparse_moe.router.layer.weight": r(e, h)}
    t.update({f"{layer}.self_attn.{p}_proj.weight": r(h, h) for p in "qkvo"})
    w13, w2 = r(e, 2 * i, h), r(e, h, i)
    if per_expert:
        for x in range(e):
            ex = f"{layer}.block_sparse_moe.experts.{x}"
            t.update({f"{ex}.gate_proj.weight": w13[x, :i].clone(), f"{ex}.up_proj.weight": w13[x, i:].clone(),
                      f"{ex}.down_proj.weight": w2[x].clone()})
    else:
        t.update({f"{layer}.block_sparse_moe.input_linear.weight": w13,
                  f"{layer}.block_sparse_moe.output_linear.weight": w2})
    folder.mkdir(parents=True)
    save_file(t, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(t,
                                                                                                 "model.safetensors")}))
    (folder / "config.json").write_text(json.dumps(GRANITE))
    return folder


def test_a_fused_bf16_expert_bank_packs_as_the_same_weights_stored_per_expert(tmp_path):
    """Granite's banks split into per-expert modules (encodings/expert_bank.py), each a byte range of the bank:
    the same output bytes as the same weights stored one tensor per expert, through compute and through pack
    (the C kernels; the written tensors, the shard's order aside), with the shipped derived table
    (mappings/derived/granitemoe.toml)."""
    bank, apart = _granite(tmp_path / "bank", False), _granite(tmp_path / "apart", True)
    modules = discover_sources(open_checkpoint(bank))
    up = modules["model.layers.0.block_sparse_moe.experts.3.up_proj"]["weight"]
    assert (up.encoding, up.shape, up.parts[0].name) == (
        "dense", (32, 32), "model.layers.0.block_sparse_moe.input_linear.weight[3][32:64]")
    assert "model.layers.0.block_sparse_moe.input_linear" not in modules
    got, kinds = _outputs(bank, Options())
    want, _ = _outputs(apart, Options())
    assert got == want
    for x in range(4):
        for leaf in ("gate_proj", "up_proj", "down_proj"):
            assert kinds[f"model.layers.0.block_sparse_moe.experts.{x}.{leaf}"][0] == NVFP4
    for name, folder in (("bank", bank), ("apart", apart)):
        assert run("pack", folder, tmp_path / f"out-{name}", "--device", "cpu", "-q").code == 0
    bank_out, apart_out = (read_tensors(tmp_path / f"out-{n}") for n in ("bank", "apart"))
    assert sorted(bank_out) == sorted(apart_out)  # the shard's order is the source's: compared tensor by tensor
    raw = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731
    assert all(torch.equal(raw(bank_out[k]), raw(apart_out[k])) for k in bank_out)


def test_inspect_counts_a_fused_banks_experts(tmp_path):
    """``inspect`` reads a Granite bank [E, 2I, H] as E experts of gate weight [I, H] (no "no expert weights")."""
    r = run("inspect", _granite(tmp_path / "bank", False))
    assert r.code == 0, r.stderr
    assert "tensors          4 experts per layer, expert gate weight [32, 32]" in r.stdout
    assert "warning" not in r.stdout


@pytest.mark.parametrize(("change", "why"), [
    ("experts", r"expert bank holds 4 experts, config.json num_local_experts says 5"),
    ("odd", r"63 rows do not split into gate_proj and up_proj of equal size"),
    ("dtype", r"expert bank must be BF16, F16, F32, is I8"),
    ("rank", r"expert bank must be 3-D \[experts, rows, columns\], is \[256, 32\]"),
    ("transposed", r"expert bank \[4, 32, 64\] is not \[experts, N, hidden_size\] for config.json hidden_size "
                   r"32 \(a bank in the other orientation is not read as this layout\)"),
])
def test_a_malformed_expert_bank_is_refused_in_one_line_naming_it(tmp_path, change, why):
    src = _granite(tmp_path / "bank", False)
    name = "model.layers.0.block_sparse_moe.input_linear.weight"
    if change == "experts":
        edit_config(src, lambda c: c.update(num_local_experts=5))
    else:
        def fn(t):
            w = t[name]
            t[name] = {"odd": lambda: w[:, :63].contiguous(), "dtype": lambda: w.to(torch.int8),
                       "rank": lambda: w.reshape(-1, 32), "transposed": lambda: w.transpose(1, 2).contiguous()
                       }[change]()
        rewrite_tensors(src, fn)
    err = one_line_error(run("plan", src))
    assert re.search(rf"model.safetensors: tensor {re.escape(name)}: {why}", err), err


@pytest.mark.parametrize("model_type", ["gemma4_text", "alice_ai", "gpt_oss"])
def test_gemma4s_banks_split_per_expert_and_only_for_its_model_types(tmp_path, model_type):
    """Gemma 4's (and AliceAI's) ``experts.gate_up_proj`` [E, 2I, H] / ``experts.down_proj`` [E, H, I]: per-expert
    gate, up and down, each the bytes of its own rows; the same names in another model type (gpt-oss's BF16 release
    stores ``gate_up_proj`` [E, H, 2I] interleaved) are not split."""
    g = torch.Generator().manual_seed(3)
    e, h, i = 4, 32, 16
    w13 = torch.randn(e, 2 * i, h, generator=g).to(torch.bfloat16)
    w2 = torch.randn(e, h, i, generator=g).to(torch.bfloat16)
    layer = "model.language_model.layers.0.experts"
    folder = tmp_path / "g"
    folder.mkdir()
    save_file({f"{layer}.gate_up_proj": w13, f"{layer}.down_proj": w2}, str(folder / "model.safetensors"))
    top = "gemma4" if model_type == "gemma4_text" else model_type
    (folder / "config.json").write_text(json.dumps({"model_type": top, "text_config": {
        "model_type": model_type, "hidden_size": h, "num_experts": e, "moe_intermediate_size": i}}))
    modules = discover_sources(open_checkpoint(folder))
    if model_type == "gpt_oss":
        assert set(modules) == {layer} and modules[layer]["gate_up_proj"].shape == (e, 2 * i, h)
        return
    reader = MappedReader(folder)
    for x in range(e):
        for leaf, want in (("gate_proj", w13[x, :i]), ("up_proj", w13[x, i:]), ("down_proj", w2[x])):
            src = modules[f"{layer}.{x}.{leaf}"]["weight"]
            assert (src.encoding, src.shape) == ("dense", tuple(want.shape))
            assert bytes(reader.raw(src.parts[0])) == want.contiguous().view(torch.uint8).numpy().tobytes()


def test_llama4s_transposed_banks_split_into_each_experts_columns_swapped(tmp_path):
    """Llama 4's ``feed_forward.experts.gate_up_proj`` [E, H, 2I] (gate columns, then up) and ``down_proj``
    [E, I, H]: each expert's gate, up and down are its columns swapped, [I, H] and [H, I], read from its own slice
    of the bank (an ``expert_bank`` source with a column view, transposed by its decode), exactly the same weights
    stored per expert."""
    g = torch.Generator().manual_seed(5)
    e, h, i = 4, 32, 32
    w13 = torch.randn(e, h, 2 * i, generator=g).to(torch.bfloat16)
    w2 = torch.randn(e, i, h, generator=g).to(torch.bfloat16)
    layer = "model.layers.0.feed_forward.experts"
    config = {"model_type": "llama4_text", "hidden_size": h, "num_local_experts": e, "intermediate_size": i}
    stored = {f"{layer}.gate_up_proj": w13, f"{layer}.down_proj": w2}
    apart = {f"{layer}.{x}.{leaf}.weight": w.t().contiguous() for x in range(e)
             for leaf, w in (("gate_proj", w13[x, :, :i]), ("up_proj", w13[x, :, i:]), ("down_proj", w2[x]))}
    folders = []
    for name, tensors in (("bank", stored), ("apart", apart)):
        folder = tmp_path / name
        folder.mkdir()
        save_file(tensors, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps(config))
        folders.append(folder)
    modules = discover_sources(open_checkpoint(folders[0]))
    up = modules[f"{layer}.2.up_proj"]["weight"]
    assert (up.encoding, up.shape, up.parts[0].name, up.view) == (
        "expert_bank", (i, h), f"{layer}.gate_up_proj[2]", (Slice(1, i, 2 * i),))
    reader = MappedReader(folders[0])
    for x in range(e):
        for leaf in ("gate_proj", "up_proj", "down_proj"):
            src = modules[f"{layer}.{x}.{leaf}"]["weight"]
            got = encodings.decode(src, [reader.tensor(p) for p in src.parts], (128, 128))
            assert torch.equal(got, apart[f"{layer}.{x}.{leaf}.weight"])


@pytest.mark.parametrize("model_type", ["step3p5", "step3_text"])
def test_step35s_banks_split_per_expert_and_only_for_its_model_type(tmp_path, model_type):
    """Step-3.5-Flash's one bank per projection, ``moe.gate_proj.weight`` / ``moe.up_proj.weight`` [E, I, H] and
    ``moe.down_proj.weight`` [E, H, I]: expert x's gate, up and down are the bytes of the bank's x-th slice, under
    ``moe.experts.{x}.*`` (vLLM 0.33 step3p5.py's per-expert branch); Step-3 text stores the same names, and its
    vLLM loader reads banks only: not split there."""
    g = torch.Generator().manual_seed(7)
    e, h, i = 4, 32, 16
    banks = {"gate_proj": torch.randn(e, i, h, generator=g).to(torch.bfloat16),
             "up_proj": torch.randn(e, i, h, generator=g).to(torch.bfloat16),
             "down_proj": torch.randn(e, h, i, generator=g).to(torch.bfloat16)}
    layer = "model.layers.3.moe"
    folder = tmp_path / "s"
    folder.mkdir()
    save_file({f"{layer}.{p}.weight": w for p, w in banks.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, "hidden_size": h,
                                                    "moe_num_experts": e, "moe_intermediate_size": i}))
    modules = discover_sources(open_checkpoint(folder))
    if model_type != "step3p5":
        assert {f"{layer}.{p}" for p in banks} <= set(modules) and not any(".experts." in m for m in modules)
        return
    reader = MappedReader(folder)
    for x in range(e):
        for leaf, bank in banks.items():
            src = modules[f"{layer}.experts.{x}.{leaf}"]["weight"]
            assert (src.encoding, src.shape) == ("dense", tuple(bank.shape[1:]))
            assert bytes(reader.raw(src.parts[0])) == bank[x].contiguous().view(torch.uint8).numpy().tobytes()
