"""The numeric check's comparison without an engine: layers read by the runner's own rules
(``runner_numerics``) from tensors laid out as vLLM's loader lays them out, against their sources.

The engines' real loaders are in tests/test_engines.py; here each case builds the fused parameter an engine
would hold (block-FP8 member scales placed at ``ceil(offset / 128)``, an expert's w13 with one global scale
slot per half) and checks what ``numerics.compare`` says of it.
"""

from __future__ import annotations

import torch
from safetensors.torch import save_file

import oracle
from kimi_convert.enginecheck import numerics, runner_numerics
from kimi_convert.kernels import fp8_block, reference


class FakeSources:
    """Source weights by checkpoint tensor name, as ``numerics.Sources`` gives them."""

    def __init__(self, weights: dict[str, torch.Tensor], config: dict | None = None):
        self.w, self.config = weights, config or {}

    def ref(self, name: str) -> numerics.Ref | None:
        w = self.w.get(name)
        return None if w is None else numerics.Ref(w.float(), w, None, None, [name])


def _weights(rows: int, k: int, seed: int) -> torch.Tensor:
    """bf16 rows whose scale differs tile to tile (so that a tile's scale read for another shows)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.2, 3.0, rows).unsqueeze(1)
    return (torch.randn(rows, k, generator=g) * scale).to(torch.bfloat16)


def _compare(tmp_path, layer: dict, weight: torch.Tensor, placements: dict, sources: FakeSources,
             engine: str = "vllm"):
    save_file({"00000:w": weight.contiguous()}, str(tmp_path / "numerics.safetensors"))
    layer = {"module": "m", "rule": "test", "processed": "not run", "key": "00000:w", **layer}
    result = {"numerics": {"layers": [layer], "placements": placements}}
    return numerics.compare(engine, result, tmp_path, sources)


def _fused_fp8(members: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Members quantized apart, loaded as vLLM's merged-column loader does: weights row after row, each
    member's scales at tile ceil(row_offset / 128) (layers/linear.py adjust_block_scale_shard)."""
    qs, rows = [], 0
    n_tiles = -(-sum(m.shape[0] for m in members) // 128)
    fused_scale = torch.zeros(n_tiles, 1, members[0].shape[1] // 128, 1)
    for m in members:
        q, s = fp8_block.quantize(m)
        at = -(-rows // 128)
        fused_scale[at: at + s.shape[0]] = s
        qs.append(q)
        rows += m.shape[0]
    return torch.cat(qs), fused_scale


def test_mid_tile_member_of_a_fused_block_fp8_layer_is_read_wrong(tmp_path):
    """K3's [q_a | kv_a | g] in vLLM: a member starting mid-tile has its rows read with a neighbour's scale;
    the members before it are read right."""
    a, g = _weights(192, 256, 0), _weights(256, 256, 1)
    q, s = _fused_fp8([a, g])
    w = runner_numerics.fp8_block(q, s)
    rep = _compare(tmp_path, {"param": "m.weight", "kind": "linear", "scheme": "fp8-block"}, w,
                   {"a.weight": [{"param": "m.weight", "row": 0, "rows": 192, "src_row": 0}],
                    "g.weight": [{"param": "m.weight", "row": 192, "rows": 256, "src_row": 0}]},
                   FakeSources({"a.weight": a, "g.weight": g}))
    assert not rep.ok
    assert rep.failures() and all("from g.weight" in p and "bound" in p for p in rep.failures()), rep.failures()


def test_fused_block_fp8_on_its_own_tiles_is_read_right(tmp_path):
    """The same layer quantized as one tensor (what --layout vllm writes): every row within ModelOpt's error."""
    a, g = _weights(192, 256, 0), _weights(256, 256, 1)
    fused = torch.cat([a, g])
    q, s = fp8_block.quantize(fused)
    w = runner_numerics.fp8_block(q, s)
    rep = _compare(tmp_path, {"param": "m.weight", "kind": "linear", "scheme": "fp8-block"}, w,
                   {"fused.weight": [{"param": "m.weight", "row": 0, "rows": 448, "src_row": 0}]},
                   FakeSources({"fused.weight": fused}))
    assert rep.ok, rep.failures()
    layer = rep.to_dict()["layers"][0]  # verify-manifest --json: the layer's scheme under the report's key "format"
    assert list(layer)[:4] == ["engine_param", "module", "format", "rule"] and layer["format"] == "fp8-block"
    assert list(rep.to_dict()["summary"]) == ["fp8-block"]
    c = rep.layers[0]
    assert c.rows == 448 and 0 < c.max_rel_err <= c.max_bound


def _w13(w1: torch.Tensor, w3: torch.Tensor, s1: torch.Tensor, s3: torch.Tensor):
    """One expert's w13 as the engine holds it, and its global-scale slots [gate, up]."""
    c1, b1 = reference.quantize(w1.float(), s1)
    c3, b3 = reference.quantize(w3.float(), s3)
    slots = torch.tensor([[float(s1), float(s3)]])
    read = runner_numerics.nvfp4(torch.cat([c1, c3]).unsqueeze(0), torch.cat([b1, b3]).unsqueeze(0), slots[:, 0])
    return read, slots.tolist()


def _moe(tmp_path, w1, w3, s1, s3):
    read, slots = _w13(w1, w3, s1, s3)
    n = w1.shape[0]
    return _compare(tmp_path, {"param": "e.w13_weight", "kind": "moe", "scheme": "nvfp4", "global_slots": slots}, read,
                    {"w1.weight": [{"param": "e.w13_weight", "expert": 0, "row": 0, "rows": n, "src_row": 0}],
                     "w3.weight": [{"param": "e.w13_weight", "expert": 0, "row": n, "rows": n, "src_row": 0}]},
                    FakeSources({"w1.weight": w1, "w3.weight": w3}))


def test_w13_with_one_global_scale_is_read_right(tmp_path):
    w1, w3 = _weights(128, 64, 2), _weights(128, 64, 3) * 4
    s2 = reference.global_scale(torch.maximum(w1.float().abs().max(), w3.float().abs().max()))
    rep = _moe(tmp_path, w1, w3, s2, s2)
    assert rep.ok, rep.failures()
    assert rep.layers[0].max_rel_err == rep.layers[0].max_bound  # ModelOpt's own bytes: its own error


def test_w3_with_its_own_global_scale_is_read_wrong(tmp_path):
    """The engine keeps the gate's global scale for both halves: an up half quantized under its own scale
    is read with the wrong one, and only its rows fail."""
    w1, w3 = _weights(128, 64, 2), _weights(128, 64, 3) * 4
    rep = _moe(tmp_path, w1, w3, reference.global_scale(w1.float().abs().max()),
               reference.global_scale(w3.float().abs().max()))
    assert not rep.ok
    assert all("from w3.weight" in p and "gate's global scale" in p for p in rep.failures()), rep.failures()


def test_dense_layer_must_be_exact(tmp_path):
    w = _weights(64, 32, 4)
    placed = {"w.weight": [{"param": "m.weight", "row": 0, "rows": 64, "src_row": 0}]}
    layer = {"param": "m.weight", "kind": "linear", "scheme": "dense", "dtype": "torch.bfloat16"}
    assert _compare(tmp_path, layer, w.float(), placed, FakeSources({"w.weight": w})).ok
    bad = w.float().clone()
    bad[5, 7] += 2.0**-6 * bad[5, 7].abs().clamp_min(1)
    rep = _compare(tmp_path, layer, bad, placed, FakeSources({"w.weight": w}))
    assert not rep.ok and "rows 5..5" in rep.failures()[0], rep.failures()


def test_rows_the_engines_loader_writes_again_hold_the_last_tensor_and_name_the_ones_written_over(tmp_path):
    """SGLang 0.5.23's MiMo-V2 draft loads each stored MTP layer's weights into its one layer (the last written
    stays): the earlier tensors are written over by the engine's own loader, not read, so not held to the layer; the
    last one is. Rows written again only in part, or a tensor offered after it not rewriting it, still fail."""
    layer = {"param": "m.weight", "kind": "linear", "scheme": "dense", "dtype": "torch.bfloat16"}
    a, b, c = (_weights(64, 32, s) for s in (7, 8, 9))
    src = FakeSources({"a.weight": a, "b.weight": b, "c.weight": c})

    def spot(seq, row=0, rows=64):
        return [{"param": "m.weight", "row": row, "rows": rows, "src_row": 0, "seq": seq}]

    three = {"a.weight": spot(0), "b.weight": spot(1), "c.weight": spot(2)}
    rep = _compare(tmp_path, layer, c.float(), three, src)
    assert rep.ok, rep.failures()
    assert rep.overwritten == ["a.weight by c.weight in m.weight", "b.weight by c.weight in m.weight"]
    assert rep.layers[0].members == ["c.weight"] and not rep.unplaced
    # the engine holding the first one instead: the last offered is what it must hold, so it is read wrong
    assert not _compare(tmp_path, layer, a.float(), three, src).ok
    # a later tensor over only half the rows: no full rewrite, both held to their rows
    half = {"a.weight": spot(0), "b.weight": [{"param": "m.weight", "row": 0, "rows": 32, "src_row": 0, "seq": 1}]}
    rep = _compare(tmp_path, layer, a.float(), half, src)
    assert not rep.overwritten and not rep.ok


def test_a_weight_the_engine_scales_as_it_loads_is_held_to_the_scaled_source(tmp_path):
    """SGLang's Grok folds output_multiplier_scale into lm_head as it loads it (grok.py load_weight_wrapper:
    fp32 weight times the constant, then its bf16 parameter): read right in SGLang for that architecture only, and
    only with the config's own constant."""
    w = _weights(64, 32, 9)
    config = {"architectures": ["Grok1ForCausalLM"], "output_multiplier_scale": 0.5773502691896257}
    loaded = (w.float() * torch.tensor(0.5773502691896257)).to(torch.bfloat16).float()  # as SGLang's loader does
    placed = {"lm_head.weight": [{"param": "m.weight", "row": 0, "rows": 64, "src_row": 0}]}
    layer = {"param": "m.weight", "kind": "linear", "scheme": "dense", "dtype": "torch.bfloat16"}
    assert _compare(tmp_path, layer, loaded, placed, FakeSources({"lm_head.weight": w}, config), "sglang").ok
    assert not _compare(tmp_path, layer, loaded, placed, FakeSources({"lm_head.weight": w}, config), "vllm").ok
    other = {**config, "output_multiplier_scale": 0.5}
    assert not _compare(tmp_path, layer, loaded, placed, FakeSources({"lm_head.weight": w}, other), "sglang").ok
    unscaled = {"architectures": ["Grok1ForCausalLM"]}  # no constant in the config: nothing to scale by
    assert not _compare(tmp_path, layer, loaded, placed, FakeSources({"lm_head.weight": w}, unscaled), "sglang").ok


def test_a_head_the_engine_normalizes_as_it_loads_is_held_to_the_normalized_source(tmp_path):
    """Ling 1.x under norm_head: both engines divide lm_head's columns by their L2 norm in BF16 as they load it
    (F.normalize(loaded_weight, dim=0)): read right for that architecture when the config asks for it, held to the
    exact quotient within two BF16 roundings; without norm_head, or normalized along the other dimension, read
    wrong."""
    import torch.nn.functional as F

    w = _weights(64, 32, 10)
    loaded = F.normalize(w, dim=0, p=2, eps=1e-7).float()  # as the engines do it: on the stored BF16 tensor
    placed = {"lm_head.weight": [{"param": "m.weight", "row": 0, "rows": 64, "src_row": 0}]}
    layer = {"param": "m.weight", "kind": "linear", "scheme": "dense", "dtype": "torch.bfloat16"}
    config = {"architectures": ["BailingMoeForCausalLM"], "norm_head": True}
    for engine in ("vllm", "sglang"):
        assert _compare(tmp_path, layer, loaded, placed, FakeSources({"lm_head.weight": w}, config), engine).ok
    off = {**config, "norm_head": False}
    assert not _compare(tmp_path, layer, loaded, placed, FakeSources({"lm_head.weight": w}, off)).ok
    rows = F.normalize(w, dim=1, p=2, eps=1e-7).float()
    assert not _compare(tmp_path, layer, rows, placed, FakeSources({"lm_head.weight": w}, config)).ok


def test_rows_an_engine_split_from_one_stored_tensor(tmp_path):
    """One stored tensor written in three slices (vLLM's vision wqkv): each slice is compared with its own
    source rows, and a slice put in another's place fails."""
    w = _weights(96, 32, 5)
    layer = {"param": "m.weight", "kind": "linear", "scheme": "dense", "dtype": "torch.bfloat16"}
    spots = [{"param": "m.weight", "row": 32 * i, "rows": 32, "src_row": 32 * i} for i in range(3)]
    assert _compare(tmp_path, layer, w.float(), {"qkv.weight": spots}, FakeSources({"qkv.weight": w})).ok
    swapped = torch.cat([w[32:64], w[:32], w[64:]]).float()
    rep = _compare(tmp_path, layer, swapped, {"qkv.weight": spots}, FakeSources({"qkv.weight": w}))
    assert not rep.ok and len(rep.failures()) == 2


def test_the_runner_reads_our_formats_as_the_writers_define_them():
    """The runner's read rules equal the formats' own dequantization (kernels.reference, kernels.fp8_block)."""
    w = _weights(256, 256, 6).float()
    s2 = reference.global_scale(w.abs().max())
    codes, scales = reference.quantize(w, s2)
    assert torch.equal(runner_numerics.nvfp4(codes, scales, s2), reference.dequantize(codes, scales, s2))
    q, s = fp8_block.quantize(w.to(torch.bfloat16))
    assert torch.equal(runner_numerics.fp8_block(q, s), fp8_block.dequantize(q, s))
    assert torch.equal(runner_numerics.fp8_block(q, s.reshape(s.shape[0], s.shape[2])), fp8_block.dequantize(q, s))


def test_rows_placed_past_the_read_parameter_are_one_line_not_a_traceback(tmp_path):
    """The breadth run's Afmoe fixture: the numeric check raised from ``_row_err`` where the rows a write placed were
    not rows of the engine's read (fewer rows; a 3-D read with no expert index). Each is now a problem line."""
    src = _weights(128, 64, 0)
    for w, row, shown in ((src[:64].clone(), 0, "[64, 64]"), (torch.stack([src, src]), 0, "[2, 128, 64]"),
                          (src.clone(), -128, "[128, 64]")):  # a row before the start: w[-128:0] reads no row
        rep = _compare(tmp_path, {"param": "m.weight", "kind": "linear", "scheme": "dense", "dtype": "bfloat16"}, w,
                       {"a.weight": [{"param": "m.weight", "row": row, "rows": 128, "src_row": 0}]},
                       FakeSources({"a.weight": src}))
        assert not rep.ok
        assert rep.failures() == [f"vllm: m.weight rows {row}..{row + 127} hold a.weight [128, 64], but the engine's "
                                  f"read of the parameter is {shown}: the rows placed are not rows of it"]


class Mxfp4MoEMethod:
    """Stands for the engine's quant method: the runner names it in its report, never calls it."""


def _mx_experts(seed: int, experts: int = 2, n: int = 64, k: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 experts as DeepSeek V4 stores them: E2M1 codes [E, N, K/2] and E8M0 bytes [E, N, K/32]."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (experts, n, k // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(118, 132, (experts, n, k // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    return codes, scales


def _mx_module(engine: str, codes: torch.Tensor, scales: torch.Tensor) -> torch.nn.Module:
    """The parameters each engine's MXFP4 MoE method makes (create_weights): vLLM's Mxfp4MoEMethod uint8 codes and
    uint8 E8M0 ``w13_weight_scale``; SGLang's Mxfp4FlashinferTrtllmMoEMethod int8 codes and fp32
    ``w13_weight_scale_inv`` holding the scales' values."""
    m = torch.nn.Module()
    m.quant_method = Mxfp4MoEMethod()
    if engine == "vllm":
        m.w13_weight = torch.nn.Parameter(codes.clone(), requires_grad=False)
        m.w13_weight_scale = torch.nn.Parameter(scales.clone(), requires_grad=False)
    else:
        m.w13_weight = torch.nn.Parameter(codes.view(torch.int8).clone(), requires_grad=False)
        m.w13_weight_scale_inv = torch.nn.Parameter(torch.exp2(scales.float() - 127), requires_grad=False)
    return m


def test_the_runner_reads_mxfp4_experts_as_the_oracle_decodes_them():
    """Both engines' MXFP4 expert parameters read as tests/oracle.py's numpy MXFP4 decode, expert by expert."""
    codes, scales = _mx_experts(7)
    for engine in ("vllm", "sglang"):
        (entry,) = runner_numerics.read_moe(engine, "e", _mx_module(engine, codes, scales))
        assert entry["scheme"] == "mxfp4" and not entry.get("unread") and entry["method"] == "Mxfp4MoEMethod"
        for e in range(codes.shape[0]):
            want = torch.from_numpy(oracle.decode_mxfp4(codes[e].numpy(), scales[e].numpy()))
            assert torch.equal(entry["weight"][e], want), (engine, e)


def test_mxfp4_experts_kept_as_stored_must_be_exact(tmp_path):
    """An MXFP4 expert kept as its source stores it is read back bit-exact; one scale byte off by one (a planted
    defect) fails that row of that expert only."""
    codes, scales = _mx_experts(8)
    src = {f"x.{e}.w1.weight": torch.from_numpy(oracle.decode_mxfp4(codes[e].numpy(), scales[e].numpy()))
           for e in range(2)}
    placed = {f"x.{e}.w1.weight": [{"param": "e.w13_weight", "expert": e, "row": 0, "rows": 64, "src_row": 0}]
              for e in range(2)}
    bad = scales.clone()
    bad[1, 9, 1] += 1
    for s, ok in ((scales, True), (bad, False)):
        (entry,) = runner_numerics.read_moe("vllm", "e", _mx_module("vllm", codes, s))
        layer = {k: v for k, v in entry.items() if k != "weight"}
        rep = _compare(tmp_path, layer, entry["weight"], placed, FakeSources(src))
        assert rep.ok == ok, rep.failures()
        assert rep.layers[0].exact and rep.layers[0].rows == 128
        if not ok:
            assert len(rep.failures()) == 1 and "expert 1 rows 9..9" in rep.failures()[0], rep.failures()


def _llama4_qk_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """vLLM 0.33.0 ``llama4.py`` ``Llama4ForCausalLM.permute_qk_weight_for_rotary`` (and SGLang 0.5.23 ``mllama4.py``'s
    ``permute``): each head's rows ``2i + j`` moved to ``j * head_dim / 2 + i`` (the interleaved rotary pairs of
    the release, de-interleaved for the engines' NeoX rotary)."""
    f_out, f_in = w.shape
    return w.view(n_heads, f_out // n_heads // 2, 2, f_in).transpose(1, 2).reshape(f_out, f_in)


class _Llama4Like(torch.nn.Module):
    """A model whose loader reorders q/k rows the way vLLM's Llama 4 does (the method under the engine's name)."""

    def __init__(self, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads

    def permute_qk_weight_for_rotary(self, name: str, w: torch.Tensor) -> tuple[str, torch.Tensor]:
        modules = name.split(".")
        if modules[-1] in ("weight", "weight_packed") and ("q_proj" in modules or "k_proj" in modules):
            w = _llama4_qk_permute(w, self.kv_heads if "k_proj" in modules else self.heads)
        return name, w


class _Offered:
    def __init__(self, shapes: dict[str, list[int]]):
        self.offered = {n: {"dtype": "bfloat16", "shape": s} for n, s in shapes.items()}


def test_the_runner_takes_the_engines_own_qk_row_order():
    """``row_orders`` runs the model's own reordering step on an index tensor: q and k get their head-wise
    de-interleaving (by their own head counts), v, o and vision weights none."""
    model = _Llama4Like(heads=4, kv_heads=2)
    offered = _Offered({"model.layers.0.self_attn.q_proj.weight": [32, 16], "model.layers.0.self_attn.k_proj.weight":
                        [16, 16], "model.layers.0.self_attn.v_proj.weight": [16, 16],
                        "vision_model.model.layers.0.self_attn.q_proj.weight": [32, 16]})
    got = runner_numerics.row_orders(model, offered)
    assert sorted(got) == ["model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.q_proj.weight"]
    assert got["model.layers.0.self_attn.q_proj.weight"]["order"][:8] == [0, 2, 4, 6, 1, 3, 5, 7]
    assert got["model.layers.0.self_attn.k_proj.weight"]["order"][8:16] == [8, 10, 12, 14, 9, 11, 13, 15]
    assert got["model.layers.0.self_attn.q_proj.weight"]["by"].endswith("_Llama4Like.permute_qk_weight_for_rotary")
    assert runner_numerics.row_orders(torch.nn.Linear(2, 2), offered) == {}


def _qk_case(tmp_path, read: torch.Tensor, order: list[int] | None, q: torch.Tensor, scheme: str = "dense"):
    spot = {"param": "m.weight", "row": 0, "rows": q.shape[0], "src_row": None}
    if order is not None:
        spot |= {"row_order": order, "row_order_by": "llama4.py: Llama4ForCausalLM.permute_qk_weight_for_rotary"}
    layer = {"param": "m.weight", "kind": "linear", "scheme": scheme, "dtype": "torch.bfloat16"}
    return _compare(tmp_path, layer, read, {"q.weight": [spot]}, FakeSources({"q.weight": q}))


def test_qk_rows_the_engine_permutes_on_purpose_are_read_right(tmp_path):
    """vLLM's Llama 4 q_proj: the engine holds the rows permuted. Without the engine's order the check calls every
    row misread (the breadth run's 8 problems); with it the layer is exact."""
    q = _weights(32, 16, 7)
    held = _llama4_qk_permute(q.float(), 4)
    order = runner_numerics.row_orders(_Llama4Like(4, 2), _Offered({"a.q_proj.weight": [32, 16]}))
    order = order["a.q_proj.weight"]["order"]
    assert not _qk_case(tmp_path, held, None, q).ok
    rep = _qk_case(tmp_path, held, order, q)
    assert rep.ok, rep.failures()
    assert rep.layers[0].reordered == {"q.weight": "llama4.py: Llama4ForCausalLM.permute_qk_weight_for_rotary"}


def test_qk_rows_permuted_otherwise_than_the_engine_does_still_fail(tmp_path):
    """A truly misread q_proj is still caught: rows held as stored (not permuted), permuted with the kv head count,
    or permuted twice, against the engine's order; and an order that is not a permutation is one problem line."""
    q = _weights(32, 16, 8)
    order = runner_numerics.row_orders(_Llama4Like(4, 2), _Offered({"a.q_proj.weight": [32, 16]}))
    order = order["a.q_proj.weight"]["order"]
    for wrong in (q.float(), _llama4_qk_permute(q.float(), 2), _llama4_qk_permute(_llama4_qk_permute(q.float(), 4), 4)):
        rep = _qk_case(tmp_path, wrong, order, q)
        assert not rep.ok and all("from q.weight" in p for p in rep.failures()), rep.failures()
    rep = _qk_case(tmp_path, _llama4_qk_permute(q.float(), 4), [0] * 32, q)
    assert rep.failures() == ["vllm: m.weight rows 0..31: llama4.py: Llama4ForCausalLM.permute_qk_weight_for_rotary "
                              "gives q.weight a row order that is not a permutation of its rows"]


def test_nvfp4_qk_rows_permuted_with_their_scales_are_read_right(tmp_path):
    """An NVFP4 q_proj whose codes and block scales vLLM permuted together (its step permutes ``weight_scale`` rows
    too): held to the NVFP4 bound of the permuted source rows; the codes permuted without their scales fail."""
    q = _weights(32, 32, 9).float()
    s2 = reference.global_scale(q.abs().max())
    codes, scales = reference.quantize(q, s2)
    order = runner_numerics.row_orders(_Llama4Like(4, 2), _Offered({"a.q_proj.weight": [32, 16]}))
    order = order["a.q_proj.weight"]["order"]
    held = runner_numerics.nvfp4(_llama4_qk_permute(codes, 4), _llama4_qk_permute(scales.view(torch.uint8), 4)
                                 .view(scales.dtype), s2)
    assert _qk_case(tmp_path, held, order, q.to(torch.bfloat16), "nvfp4").ok
    codes_only = runner_numerics.nvfp4(_llama4_qk_permute(codes, 4), scales, s2)
    assert not _qk_case(tmp_path, codes_only, order, q.to(torch.bfloat16), "nvfp4").ok
