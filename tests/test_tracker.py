"""The engine runners' load tracker (``runner_common.Tracker``) on loads written here, no engine needed: a dim-0
``cat`` of checkpoint tensors written into one parameter (SGLang's DeepSeek q_a_proj + kv_a_proj_with_mqa) is
placed member by member, and SGLang's rule for the two 0-d scales it keeps one of is asserted, not skipped."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from kimi_convert.enginecheck import Report, runner_common, runner_numerics

sys.path.insert(0, str(Path(runner_common.__file__).parent))  # the runners import runner_common by its bare name

import sglang_runner
import vllm_runner


class Fused(torch.nn.Module):
    """One fused weight of 5 rows and one global-scale slot, as SGLang's ReplicatedLinear holds them."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(5, 4, dtype=torch.uint8), requires_grad=False)
        self.weight_scale_2 = torch.nn.Parameter(torch.empty(1), requires_grad=False)


def _load(offered: dict[str, torch.Tensor], loader) -> tuple[runner_common.Tracker, torch.nn.Module]:
    """Arm a tracker on a model whose ``attn.fused_qkv_a_proj_with_mqa`` is a ``Fused``, offer ``offered``
    through it and run ``loader(model, tensors)``."""
    model = torch.nn.Module()
    model.attn = torch.nn.Module()
    model.attn.fused_qkv_a_proj_with_mqa = Fused()
    tr = runner_common.Tracker()
    tr.arm(model)
    with tr.mode():
        loader(model, dict(tr.weights(offered.items())))
    return tr, model


def _fused(model) -> Fused:
    return model.attn.fused_qkv_a_proj_with_mqa


def _rows(tr, model) -> dict[str, tuple[int, int, int | None]]:
    """Each offered weight's placement: (first row, rows, source row)."""
    spots = runner_numerics.placements(tr, dict(model.named_parameters()))
    return {n: (s[0]["row"], s[0]["rows"], s[0]["src_row"]) for n, s in spots.items()}


def test_cat_members_keep_their_own_rows():
    """cat([a, b]) written as one tensor: a lands in rows 0-1 from its row 0, b in rows 2-4 from its row 0."""
    a, b = torch.arange(8, dtype=torch.uint8).reshape(2, 4), torch.arange(12, dtype=torch.uint8).reshape(3, 4)

    def load(model, t):
        _fused(model).weight.data.copy_(torch.cat([t["a"], t["b"]], dim=0))

    tr, model = _load({"a": a, "b": b}, load)
    assert _rows(tr, model) == {"a": (0, 2, 0), "b": (2, 3, 0)}
    assert not tr.observer_errors


def test_cat_of_a_view_keeps_its_source_row():
    """A member that is a view of rows 1.. of its offered tensor is placed from that row."""
    a, b = torch.zeros(2, 4, dtype=torch.uint8), torch.ones(4, 4, dtype=torch.uint8)

    def load(model, t):
        _fused(model).weight.data.copy_(torch.cat([t["a"], t["b"][1:]]))

    tr, model = _load({"a": a, "b": b}, load)
    assert _rows(tr, model) == {"a": (0, 2, 0), "b": (2, 3, 1)}


def test_cat_of_derived_members_places_each_whole():
    """Members converted before the cat (new storages) are placed each over its own rows, as all of its tensor."""
    a, b = torch.zeros(2, 4, dtype=torch.int8), torch.ones(3, 4, dtype=torch.int8)

    def load(model, t):
        _fused(model).weight.data.copy_(torch.cat([t["a"].to(torch.uint8), t["b"].to(torch.uint8)]))

    tr, model = _load({"a": a, "b": b}, load)
    assert _rows(tr, model) == {"a": (0, 2, None), "b": (2, 3, None)}


def test_a_non_cat_derived_tensor_still_covers_every_row():
    """Any other op (here an add of both) taints its output as one derived tensor: both over all rows."""
    a, b = torch.zeros(5, 4, dtype=torch.uint8), torch.ones(5, 4, dtype=torch.uint8)

    def load(model, t):
        _fused(model).weight.data.copy_(t["a"] + t["b"])

    tr, model = _load({"a": a, "b": b}, load)
    assert _rows(tr, model) == {"a": (0, 5, None), "b": (0, 5, None)}


Q, KV = "attn.q_a_proj", "attn.kv_a_proj_with_mqa"


def _sglang_qkv_a(q_scale: float, kv_scale: float) -> dict:
    """SGLang's deepseek_weight_loader on one layer: the weights cat into the fused module, of the two 0-d
    weight_scale_2 only q_a_proj's loaded."""
    offered = {f"{Q}.weight": torch.zeros(2, 4, dtype=torch.uint8), f"{KV}.weight": torch.ones(3, 4, dtype=torch.uint8),
               f"{Q}.weight_scale_2": torch.tensor(q_scale), f"{KV}.weight_scale_2": torch.tensor(kv_scale)}

    def load(model, t):
        _fused(model).weight.data.copy_(torch.cat([t[f"{Q}.weight"], t[f"{KV}.weight"]]))
        _fused(model).weight_scale_2.data.copy_(t[f"{Q}.weight_scale_2"].reshape(1))

    tr, model = _load(offered, load)
    return tr.result(model, [], drop_rule=sglang_runner.qkv_a_scalar_rule(tr))


def test_sglang_dropped_kv_a_scale_equal_is_its_rule():
    res = _sglang_qkv_a(0.5, 0.5)
    assert not res["skipped"] and not res["rule_broken"]
    assert [t["tensor"] for t in res["rule_dropped"]] == [f"{KV}.weight_scale_2"]
    assert "equal to it" in res["rule_dropped"][0]["why"]
    rep = Report("sglang", "0.5.23", "out", "py", loaded=True, rule_dropped=res["rule_dropped"])
    assert rep.loads and "dropped by the engine's own rule" in rep.verdict


def test_sglang_dropped_kv_a_scale_unequal_fails():
    """Unequal scales: SGLang would read kv_a's rows with q_a's global scale; the check fails, saying so."""
    res = _sglang_qkv_a(0.5, 0.25)
    assert not res["rule_dropped"] and not res["skipped"]
    assert [t["tensor"] for t in res["rule_broken"]] == [f"{KV}.weight_scale_2"]
    rep = Report("sglang", "0.5.23", "out", "py", loaded=True, rule_broken=res["rule_broken"])
    assert not rep.loads and not rep.ok
    assert "rule that does not hold" in rep.verdict and "NOT equal" in rep.verdict


class Shapes(torch.nn.Module):
    """Both engines' WNA16 MoE ``w13_weight_shape``: [experts, 2] of the model's float dtype."""

    def __init__(self):
        super().__init__()
        self.w13_weight_shape = torch.nn.Parameter(torch.empty(2, 2, dtype=torch.bfloat16), requires_grad=False)


def _shapes(values: list[int]) -> dict:
    """compressed-tensors' I64 ``weight_shape`` of expert 0 written into row 0, as the engines' loaders do."""
    model = torch.nn.Module()
    model.experts = Shapes()
    tr = runner_common.Tracker()
    tr.arm(model)
    with tr.mode():
        t = dict(tr.weights([("e0.weight_shape", torch.tensor(values))]))
        model.experts.w13_weight_shape.data[0].copy_(t["e0.weight_shape"])
    return {c: [k[0] for k, v in tr.casts.items() if v[0] == c] for c in ("exact", "reinterpret")}


def test_an_integer_made_a_float_that_holds_every_value_is_an_exact_cast():
    """weight_shape [256, 128] into bf16 (8 significant bits: every integer up to 2^8) is exact; [257, 128] is not
    (257 needs 9 bits), and stays a bad cast."""
    assert _shapes([256, 128]) == {"exact": ["e0.weight_shape"], "reinterpret": []}
    assert _shapes([257, 128]) == {"exact": [], "reinterpret": ["e0.weight_shape"]}


class Scaled(torch.nn.Module):
    """A decoder layer as both engines build Gemma4's: a weight, a persistent buffer ``layer_scalar`` the checkpoint
    fills (vLLM gemma4.py / SGLang gemma4_causal.py ``register_buffer``) and a non-persistent one (a rotary table)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(2, 4), requires_grad=False)
        self.register_buffer("layer_scalar", torch.ones(1))
        self.register_buffer("cos_sin", torch.ones(4), persistent=False)


def _buffer_load(loadable) -> dict:
    """Offer a weight, layer_scalar, a tensor written into the non-persistent buffer and one the loader drops; load
    them as an AutoWeightsLoader does (by name, into parameters and buffers), and the tracker's result."""
    model = torch.nn.Module()
    model.layer = Scaled()
    offered = {"layer.weight": torch.zeros(2, 4), "layer.layer_scalar": torch.tensor([0.5]),
               "layer.cos_sin": torch.zeros(4), "layer.unused": torch.zeros(3)}
    tr = runner_common.Tracker()
    tr.arm(model, loadable(model))
    with tr.mode():
        t = dict(tr.weights(offered.items()))
        dests = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        for name, w in t.items():
            if name in dests:
                dests[name].data.copy_(w)
    return tr.result(model, [])


def test_vllm_loadable_buffers_are_its_persistent_ones():
    """vLLM's AutoWeightsLoader fills persistent buffers: layer_scalar is stored, not skipped; the write into the
    non-persistent buffer (which vLLM's loader never makes) and the tensor that reached nothing stay skipped."""
    res = _buffer_load(vllm_runner.loadable_buffers)
    assert [s["tensor"] for s in res["skipped"]] == ["layer.cos_sin", "layer.unused"]
    assert res["stored"]["layer.layer_scalar"] == ["layer.layer_scalar"]
    assert res["loaded_buffers"] == ["layer.layer_scalar"] and not res["unfilled"]


def test_sglang_loadable_buffers_are_all_of_them():
    """SGLang's loaders index every buffer (models/utils.py AutoWeightsLoader: named_buffers): both buffers' tensors
    are stored; the tensor that reached nothing is still skipped."""
    res = _buffer_load(sglang_runner.loadable_buffers)
    assert [s["tensor"] for s in res["skipped"]] == ["layer.unused"]
    assert res["loaded_buffers"] == ["layer.cos_sin", "layer.layer_scalar"]


def test_without_loadable_buffers_a_buffer_write_is_skipped():
    """The tracker alone (no engine's rule) counts parameters only: a tensor written into a buffer is skipped."""
    res = _buffer_load(lambda model: set())
    assert [s["tensor"] for s in res["skipped"]] == ["layer.layer_scalar", "layer.cos_sin", "layer.unused"]
    assert res["loaded_buffers"] == []


def test_a_write_into_one_of_several_parameters_sharing_a_storage_lands_in_that_one():
    """SGLang's afmoe.py ``AfmoeMoE.pack_params`` makes each expert's weight a view of one flat buffer: a write into
    expert 1's parameter is stored there alone, at its own row 0, not also past the end of expert 0's."""
    flat = torch.empty(2 * 3 * 4)
    model = torch.nn.Module()
    model.e0, model.e1 = torch.nn.Module(), torch.nn.Module()
    model.e0.weight = torch.nn.Parameter(flat[:12].view(3, 4), requires_grad=False)
    model.e1.weight = torch.nn.Parameter(flat[12:].view(3, 4), requires_grad=False)
    tr = runner_common.Tracker()
    tr.arm(model)
    with tr.mode():
        t = dict(tr.weights([("x1", torch.ones(3, 4)), ("x0", torch.zeros(3, 4))]))
        model.e1.weight.data.copy_(t["x1"])
        model.e0.weight.data.copy_(t["x0"])
    res = tr.result(model, [])
    assert res["stored"] == {"x1": ["e1.weight"], "x0": ["e0.weight"]}
    assert _rows(tr, model) == {"x1": (0, 3, 0), "x0": (0, 3, 0)}
    assert not res["unfilled"] and not res["skipped"]
