"""The engine check on stacked 3-D expert banks (docs/stacked-banks.md): a bank ``B`` [E, N, K] that the engine's loader
hands to its expert weight loader one expert at a time (vLLM 0.33 ``step3_text.py`` / ``models/step5/nvidia/model.py``:
``weight_loader(param, loaded_weight[expert_id], ...)``; SGLang 0.5.23 ``iquest_q1.py``: ``loaded_weight[e][:I]`` /
``[I:]``), and ModelOpt's weight-only experts' input scales in vLLM.

Without an engine: the load tracker on loads written here (``runner_common.Tracker``, ``runner_numerics.placements``)
says which expert and row of the stored bank each write came from; the numeric check (``numerics.compare``) holds
expert ``e``'s placed rows to the source bank's ``[e]`` (BF16: exactly; NVFP4: ModelOpt's error under expert ``e``'s
own global scale), through a manifest or by name. The last test runs vLLM's own loader (marked ``engine``).
"""

from __future__ import annotations

import json
import sys
from enum import Enum
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import run_process, write_synth
from kimi_convert import filenames
from kimi_convert.enginecheck import EngineUnavailable, find_python, numerics, runner_common, runner_numerics
from kimi_convert.hashing import bytes_digest
from kimi_convert.kernels import reference
from kimi_convert.manifest import RecordsFile

sys.path.insert(0, str(Path(runner_common.__file__).parent))  # the runners import runner_common by its bare name

import vllm_runner

E, N, K = 4, 32, 64
GATE, UP, DOWN = "model.layers.1.moe.gate_proj.weight", "model.layers.1.moe.up_proj.weight", \
    "model.layers.1.moe.down_proj.weight"
W13 = "model.layers.1.moe.experts.routed_experts.w13_weight"


def _bank(seed: int, scale: float = 1.0, experts: int = E, n: int = N, k: int = K) -> torch.Tensor:
    """A BF16 bank [experts, n, k] whose experts differ in magnitude (expert e times 2^e): an expert read with
    another's global scale, or held to another's bound, shows."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.tensor([2.0 ** e for e in range(experts)]).reshape(-1, 1, 1)
    return (torch.randn(experts, n, k, generator=g) * mag * scale).to(torch.bfloat16)


class Experts(torch.nn.Module):
    """A FusedMoE's w13 as the engines hold it: [experts, 2 * rows, columns]."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16, experts: int = E, n: int = N, k: int = K):
        super().__init__()
        self.w13_weight = torch.nn.Parameter(torch.empty(experts, 2 * n, k, dtype=dtype), requires_grad=False)


def _load(offered: dict[str, torch.Tensor], loader, module: torch.nn.Module | None = None) -> list[dict]:
    """Offer ``offered`` through an armed tracker, run ``loader(experts, tensors)`` and return the placements of
    the w13 writes (``runner_numerics.placements``), keyed by tensor."""
    model = torch.nn.Module()
    model.experts = module or Experts()
    tr = runner_common.Tracker()
    tr.arm(model)
    with tr.mode():
        loader(model.experts, dict(tr.weights(offered.items())))
    assert not tr.observer_errors
    return runner_numerics.placements(tr, dict(model.named_parameters()))


def _step3_loader(experts, t) -> None:
    """vLLM's Step-3 text / Step 5 loader and FusedMoE's w1 / w3 loader: ``loaded_weight[expert_id]`` copied into the
    expert's gate rows (w1) or up rows (w3)."""
    for name, half in ((GATE, 0), (UP, 1)):
        for e in range(t[name].shape[0]):
            w = t[name][e]
            experts.w13_weight.data[e].narrow(0, half * w.shape[0], w.shape[0]).copy_(w)


def test_a_bank_loaded_expert_by_expert_is_placed_from_that_expert():
    """Each write of ``loaded_weight[e]`` is placed in expert e's rows, from the stored bank's expert e, row 0."""
    spots = _load({GATE: _bank(0), UP: _bank(1)}, _step3_loader)
    for name, row in ((GATE, 0), (UP, N)):
        got = sorted((s["expert"], s["row"], s["rows"], s["src_expert"], s["src_row"]) for s in spots[name])
        assert got == [(e, row, N, e, 0) for e in range(E)]


def test_halves_of_one_bank_keep_their_rows():
    """SGLang's IQuest-Q1 (``load_iquest_q1_weights``): ``experts.fc`` [E, 2I, H] split as ``[e][:I]`` (w1) and
    ``[e][I:]`` (w3): the up half is placed from row I of expert e."""
    fc = torch.cat([_bank(0), _bank(1)], dim=1)

    def load(experts, t):
        for e in range(E):
            experts.w13_weight.data[e][:N].copy_(t["fc"][e][:N])
            experts.w13_weight.data[e][N:].copy_(t["fc"][e][N:])

    got = sorted((s["expert"], s["row"], s["src_expert"], s["src_row"]) for s in _load({"fc": fc}, load)["fc"])
    assert got == sorted([(e, 0, e, 0) for e in range(E)] + [(e, N, e, N) for e in range(E)])


def test_a_whole_bank_in_one_write_is_placed_expert_by_expert():
    """One copy of the stored bank into every expert's gate rows: expert e of the parameter from expert e of the
    bank (not one placement across experts, which the check cannot hold to any rows)."""
    def load(experts, t):
        experts.w13_weight.data[:, :N].copy_(t[GATE])

    got = sorted((s["expert"], s["row"], s["rows"], s["src_expert"], s["src_row"]) for s in _load({GATE: _bank(0)},
                                                                                                    load)[GATE])
    assert got == [(e, 0, N, e, 0) for e in range(E)]


def test_every_other_row_of_a_bank_is_placed_with_its_step():
    """vLLM 0.33's Inkling loader de-interleaves a w13 bank stored [g0, u0, g1, u1, ...]: ``[e][0::2]`` into the gate
    rows, ``[e][1::2]`` into the up rows; each placed from its first row with a step of 2 stored rows. A transposed
    read is placed with step 0 (not rows of the stored tensor)."""
    w13 = torch.stack([_bank(0), _bank(1)], dim=2).reshape(E, 2 * N, K)

    def load(experts, t):
        for e in range(E):
            experts.w13_weight.data[e][:N].copy_(t["w13"][e][0::2])
            experts.w13_weight.data[e][N:].copy_(t["w13"][e][1::2])

    got = sorted((s["expert"], s["row"], s["src_expert"], s["src_row"], s["src_step"])
                 for s in _load({"w13": w13}, load)["w13"])
    assert got == sorted([(e, 0, e, 0, 2) for e in range(E)] + [(e, N, e, 1, 2) for e in range(E)])

    def transposed(experts, t):
        for e in range(E):
            experts.w13_weight.data[e][:N].copy_(t[GATE][e].t())

    spots = _load({GATE: _bank(0, k=N)}, transposed, Experts(k=N))[GATE]
    assert sorted((s["expert"], s["src_expert"], s["src_step"]) for s in spots) == [(e, e, 0) for e in range(E)]


def _compare(tmp_path: Path, read: torch.Tensor, placements: dict, sources, layer: dict | None = None):
    """``numerics.compare`` on one MoE layer ``W13`` read as ``read`` [E, 2N, K]."""
    save_file({"00000:w13": read.contiguous()}, str(tmp_path / "numerics.safetensors"))
    layer = {"module": W13.rpartition(".")[0], "param": W13, "kind": "moe", "rule": "test", "processed": "not run",
             "key": "00000:w13", **(layer or {"scheme": "dense", "dtype": "torch.bfloat16"})}
    return numerics.compare("vllm", {"numerics": {"layers": [layer], "placements": placements}}, tmp_path, sources)


def _bank_spots(experts: list[int] | None = None) -> dict[str, list[dict]]:
    """The runner's placements of the Step-3 load: expert e's gate and up rows from the banks' ``experts[e]``."""
    src = experts or list(range(E))
    return {name: [{"param": W13, "expert": e, "row": row, "rows": N, "src_row": 0, "src_expert": src[e], "seq": i}
                   for e in range(E)] for i, (name, row) in enumerate(((GATE, 0), (UP, N)))}


class ByName:
    """Source weights by checkpoint tensor name, as ``numerics.Sources`` gives them without a manifest."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        self.w, self.config = weights, {}

    def ref(self, name: str) -> numerics.Ref | None:
        w = self.w.get(name)
        return None if w is None else numerics.Ref(w.float(), w, None, None, [name])


def test_a_bf16_bank_read_as_stored_is_exact(tmp_path):
    """The source fixture's check: a BF16 bank read by the engine as is, every expert's rows exactly its own."""
    gate, up = _bank(0), _bank(1)
    read = torch.cat([gate, up], dim=1).float()
    rep = _compare(tmp_path, read, _bank_spots(), ByName({GATE: gate, UP: up}))
    assert rep.ok, rep.failures()
    c = rep.layers[0]
    assert c.rows == 2 * N * E and c.max_rel_err == 0 and c.exact and c.members == [GATE, UP]


def test_an_expert_placed_from_another_expert_of_the_bank_fails(tmp_path):
    """The engine's expert 0 holds what the bank's expert 1 holds, and the placement says it came from expert 1: read
    right. Placed as from expert 0 (what an engine that put bank[1] into expert 0 by mistake does to the values), the
    check names the expert's rows and the stored tensor's expert."""
    gate, up = _bank(0), _bank(1)
    swapped = [1, 0, 2, 3]
    read = torch.cat([gate[swapped], up[swapped]], dim=1).float()
    assert _compare(tmp_path, read, _bank_spots(swapped), ByName({GATE: gate, UP: up})).ok
    rep = _compare(tmp_path, read, _bank_spots(), ByName({GATE: gate, UP: up}))
    bad = rep.failures()
    assert len(bad) == 4 and all(f"{W13} expert 0 rows" in p or f"{W13} expert 1 rows" in p for p in bad), bad
    assert any(f"{W13} expert 0 rows 0..{N - 1} ({N} of {N}, from {GATE}[0])" in p for p in bad), bad


def test_every_other_row_of_an_interleaved_bank_is_read_right(tmp_path):
    """An interleaved bank de-interleaved by the engine's loader (placed with a step of 2): expert e's gate rows held
    to the bank's rows 0, 2, 4... of expert e, its up rows to rows 1, 3, 5...; exact for BF16. Placed as if read
    row after row, the same read fails; a transposed read is one line."""
    gate, up = _bank(0), _bank(1)
    w13 = torch.stack([gate, up], dim=2).reshape(E, 2 * N, K)
    read = torch.cat([gate, up], dim=1).float()
    spots = {"w13": [{"param": W13, "expert": e, "row": half * N, "rows": N, "src_row": half, "src_expert": e,
                      "src_step": 2, "seq": 0} for e in range(E) for half in (0, 1)]}
    rep = _compare(tmp_path, read, spots, ByName({"w13": w13}))
    assert rep.ok and rep.layers[0].rows == 2 * N * E and rep.layers[0].exact, rep.failures()
    for s in spots["w13"]:
        s["src_row"], s["src_step"] = s["src_row"] * N, 1
    assert len(_compare(tmp_path, read, spots, ByName({"w13": w13})).failures()) == 2 * E
    for s in spots["w13"]:
        s["src_step"] = 0
    bad = _compare(tmp_path, read, spots, ByName({"w13": w13})).failures()
    assert bad[0] == f"vllm: {W13} expert 0 rows 0..{N - 1} hold w13[0] read across its rows (a transposed view: " \
                     "not rows of it)", bad


def test_an_expert_past_the_source_bank_is_one_line(tmp_path):
    """A placement from a bank expert the source does not have: one problem naming it, no traceback."""
    gate, up = _bank(0), _bank(1)
    spots = _bank_spots([0, 1, 2, E])
    rep = _compare(tmp_path, torch.cat([gate, up], dim=1).float(), spots, ByName({GATE: gate, UP: up}))
    assert rep.failures() == [f"vllm: {W13} expert 3 rows 0..{N - 1} hold expert {E} of {GATE}, whose source "
                              f"[{E}, {N}, {K}] has no such expert",
                              f"vllm: {W13} expert 3 rows {N}..{2 * N - 1} hold expert {E} of {UP}, whose source "
                              f"[{E}, {N}, {K}] has no such expert"]


def _nvfp4_banks(gate: torch.Tensor, up: torch.Tensor, per_expert: bool = True):
    """A stacked NVFP4 w13 as ModelOpt's arithmetic writes it (docs/stacked-banks.md): expert e's gate and up
    quantized under one global scale, the amax of both slices e; ``per_expert`` False: one global scale for the
    whole bank. Returns the engine's read [E, 2N, K] (runner_numerics.nvfp4, the gate's slot for both halves) and
    the global-scale slots [E, 2]."""
    amax = torch.maximum(gate.float().abs().amax(dim=(1, 2)), up.float().abs().amax(dim=(1, 2)))
    if not per_expert:
        amax = amax.max().expand(E)
    s2 = torch.stack([reference.global_scale(a) for a in amax])
    codes, scales = [], []
    for e in range(E):
        qs = [reference.quantize(b[e].float(), s2[e]) for b in (gate, up)]
        codes.append(torch.cat([q[0] for q in qs]))
        scales.append(torch.cat([q[1] for q in qs]))
    read = runner_numerics.nvfp4(torch.stack(codes), torch.stack(scales), s2)
    return read, torch.stack([s2, s2], dim=1).tolist()


def test_an_nvfp4_bank_is_held_to_each_experts_own_global_scale(tmp_path):
    """The output check: a stacked NVFP4 bank, one global scale per expert, is read within ModelOpt's error of
    expert e's slices under expert e's own global scale (ModelOpt's own bytes: exactly that error)."""
    gate, up = _bank(0), _bank(1)
    read, slots = _nvfp4_banks(gate, up)
    rep = _compare(tmp_path, read, _bank_spots(), ByName({GATE: gate, UP: up}),
                   {"scheme": "nvfp4", "global_slots": slots})
    assert rep.ok, rep.failures()
    c = rep.layers[0]
    assert c.rows == 2 * N * E and 0 < c.max_rel_err == c.max_bound
    read[0] *= 2  # expert 0 read with expert 1's global scale (twice its own: the experts differ by 2^e)
    rep = _compare(tmp_path, read, _bank_spots(), ByName({GATE: gate, UP: up}),
                   {"scheme": "nvfp4", "global_slots": slots})
    assert [p.split(" (")[0] for p in rep.failures()] == [f"vllm: {W13} expert 0 rows 0..{N - 1}",
                                                          f"vllm: {W13} expert 0 rows {N}..{2 * N - 1}"]


def test_an_nvfp4_bank_under_one_global_scale_fails_where_an_expert_is_small(tmp_path):
    """The same bank quantized under one global scale for every expert (read with it, as stored): an expert whose
    values are 2^-20 of the largest one's loses them (block scales below e4m3's range), against its own bound."""
    gate, up = _bank(0), _bank(1)
    gate[0], up[0] = gate[0] * 2.0 ** -20, up[0] * 2.0 ** -20
    read, slots = _nvfp4_banks(gate, up, per_expert=False)
    rep = _compare(tmp_path, read, _bank_spots(), ByName({GATE: gate, UP: up}),
                   {"scheme": "nvfp4", "global_slots": slots})
    bad = rep.failures()
    assert bad and all(f"{W13} expert 0 rows" in p and "bound" in p for p in bad), bad


def _with_manifest(tmp_path: Path, gate: torch.Tensor, up: torch.Tensor) -> numerics.Sources:
    """``numerics.Sources`` of a source folder holding the two BF16 banks and an output whose manifest records each
    as a stacked NVFP4 bank: ``experts``, ``sources`` the one 3-D bank, ``quantization.amax`` one per expert."""
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    save_file({GATE: gate, UP: up}, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({"architectures": ["Step3TextForCausalLM"],
                                                 "model_type": "step3_text"}))
    amax = torch.maximum(gate.float().abs().amax(dim=(1, 2)), up.float().abs().amax(dim=(1, 2))).tolist()
    lines = ""
    for name in (GATE, UP):
        base = name.removesuffix(".weight")
        lines += json.dumps({
            "name": base, "kind": "nvfp4", "rule": "test", "op": "stacked", "experts": E,
            "quantization": {"method": "nvfp4-stacked", "amax": amax},
            "sources": [{"name": name, "module": base, "file": "model.safetensors", "encoding": "dense",
                         "dtype": "BF16", "shape": [E, N, K], "rows": [0, N], "parts": []}],
            "tensors": [{"name": f"{base}.weight", "dtype": "U8", "shape": [E, N, K // 2]},
                        {"name": f"{base}.weight_scale", "dtype": "F8_E4M3", "shape": [E, N, K // 16]},
                        {"name": f"{base}.weight_scale_2", "dtype": "F32", "shape": [E]}]}) + "\n"
    rel = filenames.records_name("model.safetensors")
    (out / rel).parent.mkdir(parents=True)
    (out / rel).write_text(lines)
    entry = RecordsFile(rel, len(lines.encode()), bytes_digest(lines.encode()), 2).to_dict()
    man = {"records": [entry]}
    (out / filenames.MANIFEST).write_text(json.dumps(man))
    return numerics.Sources(src, out, man)


def test_an_nvfp4_bank_is_held_to_its_manifest_source(tmp_path):
    """With a manifest: the output bank's record names the one 3-D source bank; expert e's rows are held to its
    slice e, under expert e's own global scale."""
    gate, up = _bank(0), _bank(1)
    sources = _with_manifest(tmp_path, gate, up)
    assert sources.records[GATE]["experts"] == E
    read, slots = _nvfp4_banks(gate, up)
    rep = _compare(tmp_path, read, _bank_spots(), sources, {"scheme": "nvfp4", "global_slots": slots})
    assert rep.ok, rep.failures()
    assert rep.layers[0].members == [GATE, UP] and 0 < rep.layers[0].max_rel_err == rep.layers[0].max_bound
    rep = _compare(tmp_path, read, _bank_spots([1, 0, 2, 3]), sources, {"scheme": "nvfp4", "global_slots": slots})
    assert not rep.ok and any(f"from {GATE}[1]" in p for p in rep.failures()), rep.failures()


class NvFp4MoeBackend(Enum):
    """vLLM's enum's members as the runner reads them (``.name``)."""

    MARLIN = "marlin"
    HUMMING = "humming"
    FLASHINFER_CUTLASS = "flashinfer_cutlass"


class ModelOptNvFp4FusedMoE:
    """vLLM's quant method as ``optional_for`` reads it: its class name, ``use_a16``, ``nvfp4_backend``."""

    def __init__(self, use_a16: bool, backend: NvFp4MoeBackend):
        self.use_a16, self.nvfp4_backend = use_a16, backend


def _optional(use_a16: bool, backend: NvFp4MoeBackend) -> list[str]:
    model = torch.nn.Module()
    model.experts = torch.nn.Module()
    for p in ("w13_weight", "w13_input_scale", "w2_input_scale"):
        model.experts.register_parameter(p, torch.nn.Parameter(torch.empty(2), requires_grad=False))
    model.experts.quant_method = ModelOptNvFp4FusedMoE(use_a16, backend)
    return [rx for rx, *_ in vllm_runner.optional_for(model)]


def test_weight_only_modelopt_experts_input_scales_are_engine_optional():
    """W4A16_NVFP4 experts on a weight-only backend (vLLM's convert_to_nvfp4_moe_kernel_format drops their input
    scales): both input scales engine-optional; W4A4, or a backend that reads them, leaves them required."""
    want = [r"^experts\.w13_input_scale$", r"^experts\.w2_input_scale$"]
    assert _optional(True, NvFp4MoeBackend.MARLIN) == want
    assert _optional(True, NvFp4MoeBackend.HUMMING) == want
    assert _optional(False, NvFp4MoeBackend.MARLIN) == []
    assert _optional(True, NvFp4MoeBackend.FLASHINFER_CUTLASS) == []


# -- vLLM's own loader ----------------------------------------------------------------------------------------------


def _stacked_output(src: Path, out: Path) -> None:
    """tiny-step3-text's routed expert banks as stacked NVFP4 W4A16 banks, no input scale (what Step-3 text's loader
    takes), everything else BF16 as stored: ModelOpt's arithmetic, one global scale per expert shared by the gate
    and up banks (docs/stacked-banks.md)."""
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    out.mkdir()
    written = {}
    for name, w in tensors.items():
        if ".moe." not in name or not name.endswith(("gate_proj.weight", "up_proj.weight", "down_proj.weight")) \
                or w.dim() != 3:
            written[name] = w
            continue
        partner = {"gate_proj": "up_proj", "up_proj": "gate_proj"}.get(name.split(".")[-2])
        amax = w.float().abs().amax(dim=(1, 2))
        if partner:
            amax = torch.maximum(amax, tensors[name.replace(name.split(".")[-2], partner)].float().abs().amax((1, 2)))
        s2 = torch.stack([reference.global_scale(a) for a in amax])
        qs = [reference.quantize(w[e].float(), s2[e]) for e in range(w.shape[0])]
        base = name.removesuffix(".weight")
        written |= {f"{base}.weight": torch.stack([q[0] for q in qs]),
                    f"{base}.weight_scale": torch.stack([q[1] for q in qs]), f"{base}.weight_scale_2": s2}
    save_file(written, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "modelopt", "quant_algo": "W4A16_NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
        "ignore": ["lm_head", "*self_attn*", "*.mlp.*", "*share_expert*", "*moe.gate"],
        "config_groups": {"group_0": {"weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
                                      "input_activations": None, "targets": ["Linear"]}}}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


@pytest.mark.engine
@pytest.mark.xdist_group("engine")
def test_vllm_reads_step3_text_stacked_banks_right(tmp_path):
    """vLLM 0.33's Step-3 text loader on the BF16 fixture and on its stacked NVFP4 W4A16 banks (no input scale):
    every parameter filled but the experts' two input scales (engine-optional: the weight-only backend), and every
    layer read right, the expert banks expert by expert."""
    try:
        find_python("vllm")
    except EngineUnavailable as e:
        pytest.skip(f"vllm environment absent: {e}")
    src = write_synth("tiny-step3-text", tmp_path / "src")
    _stacked_output(src, tmp_path / "out")
    for folder, optional in ((src, set()), (tmp_path / "out", {"w13_input_scale", "w2_input_scale"})):
        r = run_process("verify-manifest", folder, "--engine", "vllm", "--input", src, "--json", timeout=600)
        d = json.loads(r.stdout)
        eng = d["engines"][0]
        assert r.code == 0 and d["ok"], (d["problems"], r.stderr[-2000:])
        assert {a["param"].rpartition(".")[2] for a in eng["allowed_unfilled"]} == optional
        assert all("MARLIN" in a["why"] or "HUMMING" in a["why"] for a in eng["allowed_unfilled"])
        moe = [c for c in eng["numerics"]["layers"] if ".routed_experts." in c["engine_param"]]
        assert len(moe) == 2 and all(c["ok"] and c["rows"] for c in moe), moe
        assert {c["format"] for c in moe} == ({"nvfp4"} if optional else {"dense"})
