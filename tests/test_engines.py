"""The engines' own loaders on tiny checkpoints: `verify-manifest --engine vllm|sglang`.

Marked ``engine`` and skipped, with the reason, where an engine's environment is absent (create them
with ``scripts/engine-envs.sh``; ``KIMI_CONVERT_VLLM_PYTHON`` / ``KIMI_CONVERT_SGLANG_PYTHON`` point
at others). Each check runs the engine in its own python (20-40 s on the CPU).

* the unconverted synthetic inputs (BF16 + MXFP4 experts for K3, BF16 for Kimi Linear) load;
* the default ``pack`` outputs load: no engine error, no unfilled parameter, no skipped tensor, no
  bad cast (engine-optional parameters excepted, each named in the runner);
* a planted defect (a tensor dropped, one renamed, a bf16 tensor stored as uint8) fails in both;
* the numeric check (``--input``): every layer as the engine's GEMM reads it, against the source, within the
  format's bound; six numeric defects planted after packing are each named, in both engines; a checkpoint
  without a manifest is checked against its source by tensor name.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import Result, one_line_error, run, run_process, spec
from kimi_convert.enginecheck import EngineUnavailable, find_python

ENGINES = ("vllm", "sglang")
MODELS = {"k3": "tiny-k3", "kl": "tiny-kimi-linear", "qw": "tiny-qwen3-moe", "glm": "tiny-glm4-moe",
          "mm": "tiny-minimax-m2", "q35": "tiny-qwen3-5-moe", "ds": "tiny-deepseek-v3", "k2": "tiny-kimi-k2",
          "gpt": "tiny-gpt-oss", "ds4": "tiny-deepseek-v4", "ds32": "tiny-deepseek-v3-2", "g5": "tiny-glm5",
          "g47": "tiny-glm4-moe-lite", "m3": "tiny-minimax-m3", "q4": "tiny-qwen4-exp", "k25": "tiny-kimi-k25",
          "g53": "tiny-glm5-next",
          # Mistral's own layout (params.json, consolidated-*.safetensors): the key is the folder's name, and SGLang
          # reads params.json only where the path holds "mistral-large-3" (mistral_utils.py is_mistral_model)
          "mistral-large-3": "tiny-mistral-large-3",
          # Inkling: its source only (no table ships: docs/families.md, "Inkling"), main model and drafts
          "ink": "tiny-inkling"}
#: The MTP layer each model stores after its decoder layers (num_nextn_predict_layers): the engines' main
#: models drop it by their own rule (reported as mtp_skipped, never as skipped).
MTP_LAYER = {"glm": "3", "ds": "2", "ds32": "2", "g5": "4", "g47": "2"}
MTP_BLOCK = {"q35": "mtp.", "ds4": "mtp.", "m3": "language_model.model.mtp.", "q4": "mtp.",
             "g53": "model.language_model.layers.4.", "ink": "model.mtp."}

# An engine check holds several GB: two at once could exceed a small CI machine's memory. Under pytest-xdist,
# --dist loadgroup keeps this module on one worker (its packs then made once), where the installed pytest and
# pytest-xdist honour the group; tests/conftest.py's lock runs one engine test at a time in any case.
pytestmark = pytest.mark.xdist_group("engine")


def cli(*args, timeout: float = 1800) -> Result:
    """Engine checks: a process of their own (each starts the engine's own python anyway)."""
    return run_process(*args, timeout=timeout)


def _absent(engine: str) -> str | None:
    try:
        find_python(engine)
    except EngineUnavailable as e:
        return str(e)
    return None


def engine_param(engine: str):
    why = _absent(engine)
    marks = [pytest.mark.engine]
    if why:
        marks.append(pytest.mark.skip(reason=f"{engine} environment absent: {why}"))
    return pytest.param(engine, marks=marks, id=engine)


ENGINE_PARAMS = [engine_param(e) for e in ENGINES]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine-inputs")
    out = {}
    for key, preset in MODELS.items():
        r = run("synth", spec(preset), root / key)
        assert r.code == 0, r.stderr
        out[key] = root / key
    return out


# Every recipe and layout of each model: (model, recipe, layout, the engines that read that layout).
OUTPUTS = {
    "k3": ("k3", None, "source", ENGINES),  # the defaults: nvidia-k3, source names
    "k3-w4a16": ("k3", "nvfp4-w4a16", "source", ENGINES),
    "kl": ("kl", None, "source", ENGINES),  # nvfp4-w4a16
    "qw": ("qw", None, "source", ENGINES),  # nvfp4-w4a16
    "glm": ("glm", None, "source", ENGINES),  # nvfp4-w4a16
    "mm": ("mm", None, "source", ENGINES),  # nvfp4-w4a16 from the FP8 block source
    "q35": ("q35", None, "source", ENGINES),  # nvfp4-w4a16; vision tower and mtp.fc kept
    "k3-sglang": ("k3", None, "sglang", ("sglang",)),
    "k3-w4a16-sglang": ("k3", "nvfp4-w4a16", "sglang", ("sglang",)),
    "kl-sglang": ("kl", None, "sglang", ("sglang",)),
    "k3-vllm": ("k3", None, "vllm", ("vllm",)),
    "k3-w4a16-vllm": ("k3", "nvfp4-w4a16", "vllm", ("vllm",)),
    "kl-vllm": ("kl", None, "vllm", ("vllm",)),
    "qw-vllm": ("qw", None, "vllm", ("vllm",)),  # qkv_proj fused on disk
    "glm-vllm": ("glm", None, "vllm", ("vllm",)),  # qkv_proj (with its bias), gate_up_proj fused on disk
    "kl-ct": ("kl", "ct-nvfp4-a16", "source", ENGINES),  # compressed-tensors' format (docs/compressed-tensors.md)
    "qw-ct": ("qw", "ct-nvfp4-a16", "source", ENGINES),  # and its attention layers' KV-cache placeholders
    # DeepSeek V3 / Kimi K2 (FP8 source decoded, nvfp4-w4a16). SGLang's deepseek_weight_loader cats q_a_proj +
    # kv_a_proj_with_mqa into fused_qkv_a_proj_with_mqa (the tracker places each member's rows) and drops kv_a's
    # weight_scale_2 by its rule, checked equal to q_a's (RULE_DROPPED; docs/families.md, "DeepSeek V3")
    "ds": ("ds", None, "source", ENGINES),
    "k2": ("k2", None, "source", ENGINES),
    # SGLang refuses it: its deepseek loader cats q_a/kv_a's [1] weight_global_scale into a [1] parameter
    # (linear.py:376 assert; docs/compressed-tensors.md)
    "ds-ct": ("ds", "ct-nvfp4-a16", "source", ("vllm",)),
    # gpt-oss (MXFP4 banks cast to NVFP4 per expert, byte-identical to ModelOpt's cast): both engines refuse
    # it, and ModelOpt's own export alike, for reasons in the engines (REFUSED; docs/families.md, "gpt-oss")
    "gpt": ("gpt", None, "source", ENGINES),  # nvfp4-w4a16
    # DeepSeek V4 (MXFP4 experts I8 + E8M0, block-FP8 with E8M0 .scale): the default nvidia-dsv4, NVIDIA's recipe
    # byte for byte (experts cast to NVFP4, the rest as stored; docs/families.md, "DeepSeek V4")
    "ds4": ("ds4", None, "source", ENGINES),
    # DeepSeek V3.2: V3 plus the DSA indexer (wk / weights_proj kept BF16 for both engines' fused wk_weights_proj)
    "ds32": ("ds32", None, "source", ENGINES),
    # GLM-5.x and GLM-4.7-Flash: no hand table, packed with the derived one (mappings/derived/); the DSA indexer's
    # wk / weights_proj kept (both engines build wk_weights_proj unquantized; docs/families.md, "GLM-5.x")
    "g5": ("g5", None, "source", ENGINES),  # nvfp4-w4a16
    "g47": ("g47", None, "source", ENGINES),  # nvfp4-w4a16
    # MiniMax M3 and Qwen3.8-Flash-Next: the derived tables (mappings/derived/), M3's with its overlay (the sparse
    # layers' indexer and q/k/v kept for vLLM's five-shard qkv_proj; docs/families.md, "MiniMax M3")
    "m3": ("m3", None, "source", ENGINES),  # nvfp4-w4a16
    "q4": ("q4", None, "source", ENGINES),  # nvfp4-w4a16; QSA q/k/v/indexer, hyper-connections kept
    # GLM-5.3-Flash: KDA + DSA (k-pool indexer) + hyper-connections, packed with the derived table (docs/families.md,
    # "GLM-5.3-Flash")
    "g53": ("g53", None, "source", ENGINES),  # nvfp4-w4a16
    # Kimi K2.5 / K2.6: INT4 pack-quantized routed experts decoded (encodings/int4_pack.py) and made NVFP4, packed with
    # the derived table and its overlay (docs/families.md, "Kimi K2.5 / K2.6")
    "k25": ("k25", None, "source", ENGINES),  # nvfp4-w4a16
    # Mistral Large 3 in Mistral's layout: the output keeps it (params.json as is, the quantization config in
    # hf_quant_config.json, which both engines read when params.json has none; docs/families.md, "Mistral Large 3")
    "mistral-large-3": ("mistral-large-3", None, "source", ENGINES),  # nvfp4-w4a16
}


@pytest.fixture(scope="module")
def outputs(inputs, tmp_path_factory) -> dict[str, Path | str]:
    """The pack of each input with each recipe and layout; a pack that fails is recorded as its error line."""
    root = tmp_path_factory.mktemp("engine-outputs")
    out: dict[str, Path | str] = {}
    for key, (model, recipe, layout, _) in OUTPUTS.items():
        extra = (["--recipe", recipe] if recipe else []) + ["--layout", layout]
        r = run("pack", inputs[model], root / key, "-q", "--device", "cpu", *extra)
        out[key] = root / key if r.code == 0 else (r.stderr.strip().splitlines() or ["pack failed"])[-1]
    return out


def record(engine: str, key: str, folder: Path, rep: dict, producer: tuple[str, str] | None = None) -> None:
    """Append the row of the README's compatibility table (scripts/compat_table.py renders it) when
    KIMI_CONVERT_COMPAT_OUT names a file. ``producer``: (recipe, layout) cells of a checkpoint another tool
    wrote (no manifest)."""
    path = os.environ.get("KIMI_CONVERT_COMPAT_OUT")
    if not path:
        return
    if producer is None:
        man = json.loads((folder / "manifest.json").read_text())
        producer = (man["recipe"]["name"], man["options"]["layout"])
    num = rep.get("numerics") or {}
    summary = num.get("summary", {})
    model = MODELS[OUTPUTS[key][0]]
    if rep.get("role") == "draft":  # the engine's speculative-decoding draft model of the same checkpoint
        model += f" draft ({(rep.get('model_class') or '?').rpartition('.')[2]})"
    row = {"engine": engine, "version": rep.get("version"), "model": model,
           "recipe": producer[0], "layout": producer[1], "loads": rep.get("error") is None,
           "filled": not rep["unfilled"], "skipped": len(rep["skipped"]), "bad_casts": len(rep["bad_casts"]),
           "optional_unset": len(rep.get("allowed_unfilled", [])), "ok": rep["ok"],
           "numerics_ok": num.get("ok"), "numerics_problems": num.get("problems", [])[:3],
           "numerics": {k: {f: v[f] for f in ("layers", "max_rel_err", "max_bound", "exact_layers")}
                        for k, v in summary.items()}}
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def engine_check(folder: Path, engine: str, source: Path | None = None, env: dict | None = None) -> tuple[int, dict]:
    """verify-manifest --engine (its main model only: --no-draft); with ``source``, --input too (the manifest checks
    against it and the numeric check). The suite's checks go through the engines' fork servers (tests/conftest.py)."""
    r = run_process("verify-manifest", folder, "--engine", engine, "--json", "--no-draft",
                    *(["--input", source] if source else []), env=env, timeout=1800)
    assert r.stdout.strip(), f"no report (rc {r.code}): {r.stderr[-2000:]}"
    d = json.loads(r.stdout)
    return r.code, d["engines"][0]


def draft_check(folder: Path, engine: str, source: Path | None = None) -> tuple[int, list[dict]]:
    """verify-manifest --engine with the engine's speculative-decoding draft: every engine report (main, draft)."""
    r = run_process("verify-manifest", folder, "--engine", engine, "--json",
                    *(["--input", source] if source else []), timeout=1800)
    assert r.stdout.strip(), f"no report (rc {r.code}): {r.stderr[-2000:]}"
    return r.code, json.loads(r.stdout)["engines"]


def describe(rep: dict) -> str:
    lines = [rep["verdict"]]
    for key in ("unfilled", "skipped", "bad_casts"):
        for item in rep[key][:10]:
            lines.append(f"  {key}: {item}")
    if rep.get("error"):
        lines += [f"  at {f}" for f in rep["error"].get("frames", [])[-3:]]
    return "\n".join(lines)


# -- doctoring an output: copy it, change one tensor in its shard and the index ----------------------


def doctor(src: Path, dst: Path, name_suffix: str, fn) -> str:
    """Copy ``src`` to ``dst``; ``fn(tensors, name)`` edits the shard holding the first tensor whose name
    ends with ``name_suffix``. Rewrites that shard and the index; returns the tensor's name."""
    shutil.copytree(src, dst)
    index_path = dst / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = next(n for n in sorted(index["weight_map"]) if n.endswith(name_suffix))
    shard = dst / index["weight_map"][name]
    tensors = load_file(str(shard))
    fn(tensors, name)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != shard.name}
    index["weight_map"].update({n: shard.name for n in tensors})
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    index_path.write_text(json.dumps(index, indent=2))
    return name


def drop(tensors, name):
    del tensors[name]


def rename(tensors, name):
    tensors[name.replace("layernorm.weight", "layernorm.weight_renamed")] = tensors.pop(name)


def as_uint8(tensors, name):
    assert tensors[name].dtype == torch.bfloat16, f"{name} is {tensors[name].dtype}, not bf16"
    tensors[name] = tensors[name].to(torch.uint8)  # same shape: only the dtype is wrong


DEFECTS = {
    # (tensor name suffix, edit, what the report must show)
    "dropped": ("layers.1.post_attention_layernorm.weight", drop, "unfilled"),
    "renamed": ("layers.1.input_layernorm.weight", rename, "error-or-skipped"),
    "bf16-as-uint8": ("model.norm.weight", as_uint8, "bad_casts"),
}


# -- tests ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("engine", ENGINE_PARAMS)
def test_synthetic_input_loads(engine, model, inputs):
    """The unconverted synthetic checkpoint is what the engine's model expects, name for name."""
    _, rep = engine_check(inputs[model], engine)
    # the engines narrow a few fp32 tensors of the release (K3's o_norm; SGLang's e_score_correction_bias)
    # into bf16 parameters: their own reading of the input, reported, not a defect of the checkpoint
    bad = [c for c in rep["bad_casts"] if c["class"] != "narrowing"]
    assert rep["error"] is None and not rep["unfilled"] and not rep["skipped"] and not bad, describe(rep)
    assert_mtp_only(model, rep)


@pytest.mark.parametrize("engine", ENGINE_PARAMS)
def test_served_check_is_fresh_checks(engine, outputs, inputs):
    """A check through the fork server (as every other test here runs) reports exactly what the same check
    in a process of its own reports, the numeric check included: only the timings differ."""
    out = outputs["qw"]
    assert isinstance(out, Path), f"pack failed: {out}"

    def report(env=None):
        _, rep = engine_check(out, engine, inputs["qw"], env=env)
        return {k: v for k, v in rep.items() if k not in ("timings", "seconds", "log_tail")}, rep["timings"]

    served, served_t = report()
    fresh, fresh_t = report({"KIMI_CONVERT_ENGINE_SERVERS": ""})
    assert served == fresh
    assert fresh_t["import_s"] > 0 and served_t["import_s"] < fresh_t["import_s"]  # really served, really fresh


def assert_mtp_only(model: str, rep: dict) -> None:
    """What the main model dropped by the engine's MTP rule is the MTP layer, all of it, and nothing else."""
    names = [t["tensor"] for t in rep.get("mtp_skipped", [])]
    if model in MTP_BLOCK:  # Qwen3.5 (mtp.*) and MiniMax M3 (model.mtp.layers.*) store it under their own prefix
        assert names and all(n.startswith(MTP_BLOCK[model]) for n in names), names
        return
    layers = {n.split(".")[2] for n in names}
    assert layers == ({MTP_LAYER[model]} if model in MTP_LAYER else set()), layers


OUTPUT_PARAMS = [pytest.param(key, engine.values[0], marks=engine.marks, id=f"{key}-{engine.id}")
                 for key, (*_, readers) in OUTPUTS.items() for engine in ENGINE_PARAMS if engine.id in readers]


#: Outputs an engine is known to read wrong, found by the numeric check (docs/engines.md, "Numerics"): the
#: default K3 bytes are NVIDIA's, whose block-FP8 [q_a | kv_a | g] members vLLM 0.33 fuses with g starting
#: mid-tile; ``--layout vllm`` is the output vLLM reads right.
MISREAD = {("k3", "vllm"): "fused_qkv_a_g_proj"}


def _vllm_refuses_gpt_oss(rep: dict) -> None:
    """vLLM 0.33: ModelOptNvFp4FusedMoE.create_weights (quantization/modelopt.py) builds no expert bias, which
    gpt-oss has, so GptOssModel._load_weights_other's bias branch (models/gpt_oss.py:1233) has no parameter
    to load it into; ModelOpt's own 3-D export fails the same way (w2_bias)."""
    err = rep["error"]
    assert err is not None and err["type"] == "KeyError" and "w2_bias" in err["message"], describe(rep)
    assert any("gpt_oss.py:1233 in _load_weights_other" in f for f in err["frames"]), describe(rep)


def _sglang_refuses_gpt_oss(rep: dict) -> None:
    """SGLang 0.5.23: GptOssForCausalLM._load_normal_weights maps only the 3-D banks
    (make_expert_params_mapping_fused: experts.gate_up_proj / down_proj), so per-expert tensors are skipped
    and the experts stay unfilled; the 3-D banks ModelOpt writes fail FusedMoE._load_w2's check that a
    ModelOpt weight be 2-D (layers/moe/fused_moe_triton/layer.py). Everything else loads."""
    assert rep["error"] is None, describe(rep)
    unfilled = {u["param"] for u in rep["unfilled"]}
    layers = {p.split(".")[2] for p in unfilled}
    assert unfilled == {f"model.layers.{li}.mlp.experts.{w}_{t}" for li in layers for w in ("w13", "w2")
                        for t in ("weight", "weight_scale", "weight_scale_2", "input_scale")}, describe(rep)
    assert all(".mlp.experts." in t["tensor"] and t["tensor"].split(".")[5].isdigit() for t in rep["skipped"])
    assert layers and rep["skipped"], describe(rep)


#: The checkpoint tensors an engine drops by its own rule, its condition checked by the runner (rule_dropped):
#: SGLang keeps q_a_proj's 0-d weight_scale_2 for fused_qkv_a_proj_with_mqa, kv_a_proj_with_mqa's being equal.
RULE_DROPPED = {(m, "sglang"): r"self_attn\.kv_a_proj_with_mqa\.weight_scale_2$"
                for m in ("ds", "k2", "ds32", "g5", "k25")}
RULE_DROPPED[("mistral-large-3", "sglang")] = r"attention\.wkv_a_with_mqa\.weight_scale_2$"  # the same, Mistral's names


def assert_rule_dropped(key: str, engine: str, rep: dict) -> None:
    """What the engine dropped by a rule is what RULE_DROPPED names, one a layer, and nothing else."""
    import re

    names = [t["tensor"] for t in rep.get("rule_dropped", [])]
    rx = RULE_DROPPED.get((OUTPUTS[key][0], engine))
    if rx is None:
        assert not names, names
        return
    assert names and all(re.search(rx, n) for n in names), names
    assert len({re.search(r"layers\.(\d+)\.", n).group(1) for n in names}) == len(names), names  # any naming


#: Outputs an engine refuses for a reason in the engine, and the assertion of exactly that refusal.
REFUSED = {("gpt", "vllm"): _vllm_refuses_gpt_oss, ("gpt", "sglang"): _sglang_refuses_gpt_oss}


@pytest.mark.parametrize(("key", "engine"), OUTPUT_PARAMS)
def test_output_loads(key, engine, outputs, inputs):
    """The issue's bar, for every recipe and layout: loads, every parameter filled, no skipped tensor, no
    bad cast (engine-optional parameters excepted, each named by the runner), and every layer read right:
    the numeric check against the input, within the format's own error, exact where the recipe is exact."""
    out = outputs[key]
    assert isinstance(out, Path), f"pack failed: {out}"
    rc, rep = engine_check(out, engine, inputs[OUTPUTS[key][0]])
    record(engine, key, out, rep)
    refused = REFUSED.get((key, engine))
    if refused:  # the engine's known refusal, and nothing else
        refused(rep)
        assert rc == 1 and not rep["ok"]
        return
    assert not rep["unfilled"] and not rep["skipped"] and not rep["bad_casts"] and rep["error"] is None, \
        describe(rep)
    assert_mtp_only(OUTPUTS[key][0], rep)
    assert_rule_dropped(key, engine, rep)
    num = rep["numerics"]
    assert num is not None and num["layers"], describe(rep)
    quantized = {k for k, v in num["summary"].items() if v["layers"]} - {"dense"}
    assert quantized, f"no quantized layer was read: {num['summary']}"
    misread = MISREAD.get((key, engine))
    if misread:  # the known misread, and nothing else
        assert not num["ok"] and num["problems"], describe(rep)
        assert all(misread in p and "g_proj.weight" in p for p in num["problems"]), num["problems"]
        assert rc == 1
        return
    assert num["ok"], "\n".join(num["problems"][:10])
    assert rep["ok"] and rc == 0, describe(rep)


@pytest.mark.parametrize("engine", ENGINE_PARAMS)
def test_sglang_layout_is_sglangs_fused_names(engine, outputs):
    """--layout sglang writes SGLang's fused modules where its loader takes them (BF16, block FP8) and
    leaves NVFP4 packed modules unfused (SGLang would fill one weight_scale_2 slot of several)."""
    if engine != "sglang":
        pytest.skip("the sglang layout is for SGLang")
    names = json.loads((outputs["k3-sglang"] / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(n.endswith("self_attn.fused_qkvg_proj.weight") for n in names)
    assert any(n.endswith("self_attn.qkv_conv1d.weight") for n in names)
    kl = json.loads((outputs["kl-sglang"] / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(n.endswith("self_attn.qkv_conv1d.weight") for n in kl)
    assert not any(n.endswith(("qkv_proj.weight", "gate_up_proj.weight")) for n in kl)  # NVFP4: unfused


@pytest.mark.parametrize("engine", ENGINE_PARAMS)
def test_vllm_layout_is_vllms_fused_names(engine, outputs):
    """--layout vllm writes vLLM's packed modules fused where its loader takes them: Kimi Linear's
    in_proj_qkvgfab and gate_up_proj (NVFP4, one scale into every slot); not K3's padded in_proj_qkvgfab."""
    if engine != "vllm":
        pytest.skip("the vllm layout is for vLLM")
    kl = json.loads((outputs["kl-vllm"] / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(n.endswith("self_attn.in_proj_qkvgfab.weight_scale_2") for n in kl)
    assert any(n.endswith("mlp.gate_up_proj.weight") for n in kl)
    k3 = json.loads((outputs["k3-vllm"] / "model.safetensors.index.json").read_text())["weight_map"]
    assert not any("in_proj_qkvgfab" in n for n in k3) and not any(n.endswith("conv1d.weight") and ".conv1d" in n
                                                                    for n in k3)


@pytest.mark.parametrize("defect", list(DEFECTS))
@pytest.mark.parametrize("engine", ENGINE_PARAMS)
def test_planted_defect_fails(engine, defect, outputs, tmp_path):
    """A tensor dropped, one renamed, a bf16 stored as uint8 in the default K3 output: each fails, in both
    engines, and the report names the planted tensor (an unrelated failure does not count)."""
    base = outputs["k3"]
    assert isinstance(base, Path), f"pack failed: {base}"
    suffix, edit, expect = DEFECTS[defect]
    bad = tmp_path / f"k3-{defect}"
    name = doctor(base, bad, suffix, edit)
    rc, rep = engine_check(bad, engine)
    assert rc != 0 and not rep["ok"], f"{defect} ({name}) was not caught: {rep['verdict']}"
    err = rep["error"] or {}
    said = f"{err.get('message', '')} {err.get('tensor', '')}"
    if expect == "unfilled":
        param = name.removeprefix("language_model.")
        assert any(u["param"].endswith(param) for u in rep["unfilled"]) or param in said, describe(rep)
    elif expect == "bad_casts":
        assert any(c["tensor"] == name and c["from"] == "uint8" for c in rep["bad_casts"]) or name in said, \
            describe(rep)
    else:
        renamed = name.replace("layernorm.weight", "layernorm.weight_renamed")
        assert any(s["tensor"] == renamed for s in rep["skipped"]) or "weight_renamed" in said, describe(rep)


# -- user errors (no engine needed) --------------------------------------------------------------------


def test_engine_python_missing_is_one_line(inputs, tmp_path):
    r = run("verify-manifest", inputs["k3"], "--engine", "vllm", "--engine-python", tmp_path / "nope" / "python")
    assert "does not exist" in one_line_error(r)


def test_engine_not_installed_is_one_line(inputs):
    r = run("verify-manifest", inputs["k3"], "--engine", "sglang", "--engine-python", sys.executable)
    assert "no sglang installed" in one_line_error(r)


def test_engine_python_needs_one_engine(inputs):
    r = run("verify-manifest", inputs["k3"], "--engine", "vllm", "--engine", "sglang", "--engine-python",
            sys.executable)
    assert "exactly one --engine" in one_line_error(r)


def test_unpinned_version_refused(tmp_path, monkeypatch):
    from kimi_convert.enginecheck import Probe, check_version
    from kimi_convert.errors import ConvertError

    with pytest.raises(ConvertError, match="not the tested version 0.33.0; pass --engine-any-version"):
        check_version("vllm", Probe("py", "0.34.1", []), any_version=False)
    check_version("vllm", Probe("py", "0.34.1", []), any_version=True)


# -- the numeric check: defects planted after packing, and a checkpoint without a manifest --------------


def _edit_output(src: Path, dst: Path, edits: dict[str, object]) -> None:
    """Copy ``src`` to ``dst`` and apply ``edits`` ({tensor name: fn(tensors) -> None}) in the shards holding
    them; names and the index stay as they are (the bytes change, not the layout)."""
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    by_shard: dict[str, list] = {}
    for name, fn in edits.items():
        by_shard.setdefault(index[name], []).append(fn)
    for shard, fns in by_shard.items():
        tensors = load_file(str(dst / shard))
        for fn in fns:
            fn(tensors)
        save_file(tensors, str(dst / shard), metadata={"format": "pt"})


def _k3_numeric_defects(source: Path) -> dict[str, tuple[str, object]]:
    """The issue's six numeric defects in the default K3 output, each in its own module."""
    from kimi_convert.kernels import reference
    from kimi_convert.kernels.encodings import decode_mxfp4

    L = "language_model.model.layers"

    def swap(tensors, e=f"{L}.1.block_sparse_moe.experts.2"):
        for suffix in ("weight", "weight_scale", "weight_scale_2", "input_scale"):
            a, b = f"{e}.w1.{suffix}", f"{e}.w3.{suffix}"
            tensors[a], tensors[b] = tensors[b], tensors[a]

    def shift(tensors, n=f"{L}.0.self_attn.k_proj.weight"):
        tensors[n] = torch.roll(tensors[n], 64, dims=0)

    def reciprocal(tensors, n=f"{L}.2.block_sparse_moe.experts.3.w2.weight_scale_2"):
        tensors[n] = 1.0 / tensors[n]

    def tile(tensors, n=f"{L}.0.self_attn.o_proj.weight_scale"):
        tensors[n] = torch.roll(tensors[n], 1, dims=0)

    def own_scale(tensors, e=f"{L}.3.block_sparse_moe.experts.4.w3"):
        src = load_file(str(source / _shard_of(source, f"{e}.weight_packed")))
        w = decode_mxfp4(src[f"{e}.weight_packed"], src[f"{e}.weight_scale"])
        s2 = reference.global_scale(w.abs().amax())  # its own amax, not the w13 group's
        tensors[f"{e}.weight"], tensors[f"{e}.weight_scale"] = reference.quantize(w, s2)
        tensors[f"{e}.weight_scale_2"] = s2.reshape(tensors[f"{e}.weight_scale_2"].shape)

    def cast_block(tensors, n=f"{L}.1.block_sparse_moe.experts.5.w1.weight_scale"):
        s = tensors[n].float()
        s[3, 2] = s[3, 2] * 2  # one 16-block's scale doubled, its codes kept
        tensors[n] = s.to(torch.float8_e4m3fn)

    # {defect: (the checkpoint tensor a report must name, a tensor of the shard the edit changes, the edit)}
    return {
        "w1-w3-swapped": (f"{L}.1.block_sparse_moe.experts.2.w1.weight", f"{L}.1.block_sparse_moe.experts.2.w1.weight",
                          swap),
        "member-rows-shifted-64": (f"{L}.0.self_attn.k_proj.weight", f"{L}.0.self_attn.k_proj.weight", shift),
        "global-scale-reciprocal": (f"{L}.2.block_sparse_moe.experts.3.w2.weight",
                                    f"{L}.2.block_sparse_moe.experts.3.w2.weight_scale_2", reciprocal),
        "block-scale-row-moved-one-tile": (f"{L}.0.self_attn.o_proj.weight", f"{L}.0.self_attn.o_proj.weight_scale",
                                           tile),
        "member-own-global-scale": (f"{L}.3.block_sparse_moe.experts.4.w3.weight",
                                    f"{L}.3.block_sparse_moe.experts.4.w3.weight", own_scale),
        "cast-block-scale-changed": (f"{L}.1.block_sparse_moe.experts.5.w1.weight",
                                     f"{L}.1.block_sparse_moe.experts.5.w1.weight_scale", cast_block),
    }


def _shard_of(folder: Path, name: str) -> str:
    return json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][name]


def _numerics(folder: Path, engine: str, source: Path) -> dict:
    """The engine check with the numeric check, by the library (no manifest checks: an edited output's
    hashes no longer match, which is not what is tested here)."""
    from kimi_convert.enginecheck import check

    rep = check(folder, engine, source=source)
    assert rep.loads, rep.verdict
    return rep.numerics


@pytest.mark.parametrize("engine", ENGINE_PARAMS)
def test_planted_numeric_defects_are_each_named(engine, outputs, inputs, tmp_path):
    """One K3 output with six numeric defects planted in six modules, loaded once: each defect fails with a
    line naming its module's tensor, the rows and the error against the bound; nothing else fails but the
    misread the engine already has on the unedited output."""
    base = outputs["k3"]
    assert isinstance(base, Path), f"pack failed: {base}"
    defects = _k3_numeric_defects(inputs["k3"])
    bad = tmp_path / "k3-numeric-defects"
    _edit_output(base, bad, {where: fn for _, where, fn in defects.values()})
    num = _numerics(bad, engine, inputs["k3"])
    probs = num["problems"]
    for defect, (tensor, _, _) in defects.items():
        hits = [p for p in probs if f"from {tensor}" in p and "rows" in p]
        assert hits, f"{defect}: no line names {tensor}:\n" + "\n".join(probs)
        assert all(("bound" in p or "exactly" in p) for p in hits), hits
    known = MISREAD.get(("k3", engine))
    named = (*(t for t, _, _ in defects.values()), defects["w1-w3-swapped"][0].replace(".w1.", ".w3."))
    others = [p for p in probs if not any(f"from {t}" in p for t in named) and not (known and known in p)]
    assert not others, others


@pytest.mark.parametrize("engine", ENGINE_PARAMS)
def test_sglang_unequal_qkv_a_scales_fail(engine, outputs, inputs, tmp_path):
    """kv_a_proj_with_mqa's weight_scale_2 made unequal to q_a_proj's: SGLang would drop it and read kv_a's rows
    with q_a's scale, so the rule it drops it by does not hold, and the check fails naming it."""
    if engine != "sglang":
        pytest.skip("SGLang's rule (deepseek_weight_loader.py do_load_weights)")
    base = outputs["ds"]
    assert isinstance(base, Path), f"pack failed: {base}"
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_2"

    def double(tensors):
        tensors[name] = tensors[name] * 2

    bad = tmp_path / "ds-unequal-qkv-a"
    _edit_output(base, bad, {name: double})
    from kimi_convert.enginecheck import check

    rep = check(bad, engine, source=inputs["ds"])
    assert not rep.loads and not rep.ok, rep.verdict
    assert [t["tensor"] for t in rep.rule_broken] == [name], rep.verdict
    assert "does not hold" in rep.verdict and "NOT equal" in rep.verdict


@pytest.mark.parametrize("engine", ENGINE_PARAMS)
def test_checkpoint_without_manifest_checked_by_name(engine, outputs, inputs, tmp_path):
    """Anyone's checkpoint: the K3 output with its manifest removed (NVIDIA's layout, byte for byte) is
    matched to the source by tensor name, and the numeric check finds what it finds with the manifest."""
    base = outputs["k3"]
    assert isinstance(base, Path), f"pack failed: {base}"
    bare = tmp_path / "k3-bare"
    shutil.copytree(base, bare)
    (bare / "manifest.json").unlink()
    shutil.rmtree(bare / "manifest-records")
    r = cli("verify-manifest", bare, "--engine", engine, "--input", inputs["k3"], "--json")
    d = json.loads(r.stdout)
    num = d["engines"][0]["numerics"]
    assert num is not None and num["layers"], r.stderr[-2000:]
    assert sum(v["layers"] for k, v in num["summary"].items() if k != "dense") > 0
    known = MISREAD.get(("k3", engine))
    if known:
        assert r.code == 1 and num["problems"] and all(known in p for p in num["problems"]), num["problems"]
    else:
        assert r.code == 0 and num["ok"], num["problems"]


PEER_PY = os.environ.get("KIMI_CONVERT_LLMC_PYTHON", "/work/peers/llmc/bin/python")
PEER = "llm-compressor model_free_ptq NVFP4A16"


@pytest.fixture(scope="module")
def peer_output(outputs, inputs, tmp_path_factory) -> Path:
    """llm-compressor's own output of tiny-kimi-linear (benchmarks/peer_model_free.py, its one patch for
    Kimi Linear's partnerless MLA q_proj), keeping what ``kl-ct`` keeps."""
    ours = outputs["kl-ct"]
    assert isinstance(ours, Path), f"pack failed: {ours}"
    root = tmp_path_factory.mktemp("peer")
    ignore = root / "ignore.json"
    ignore.write_text(json.dumps(json.loads((ours / "config.json").read_text())["quantization_config"]["ignore"]))
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "peer_model_free.py"
    import subprocess

    p = subprocess.run([PEER_PY, str(script), str(inputs["kl"]), str(root / "out"), "--ignore-json", str(ignore),
                        "--partners-present"], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    return root / "out"


@pytest.mark.skipif(not Path(PEER_PY).exists(), reason=f"llm-compressor's python {PEER_PY} absent")
@pytest.mark.parametrize("engine", ENGINE_PARAMS)
def test_peer_output_needs_the_shared_scales(engine, peer_output, inputs):
    """model_free_ptq shares global scales only over q/k/v, gate/up under ``mlp`` and w1/w3: the engines' wider
    packed modules (vLLM's in_proj_qkvgfab with f_a and b, the shared experts' gate_up_proj) then hold members
    with different global scales. vLLM keeps the largest and misreads the others (the numeric check names
    them); SGLang refuses the layer in its own process_weights_after_loading. This tool's ``kl-ct`` output,
    byte-identical elsewhere (benchmarks/compare_llmcompressor.py), passes both (test_output_loads)."""
    rc, rep = engine_check(peer_output, engine, inputs["kl"])
    record(engine, "kl-ct", peer_output, rep, (PEER, "source"))
    num = rep["numerics"]
    assert rc == 1 and num is not None and not num["ok"], describe(rep)
    widened = ("f_a_proj", "b_proj", "shared_experts", "in_proj_qkvgfab", "gate_up_proj", "qkv_proj")
    assert all(any(w in p for w in widened) for p in num["problems"]), num["problems"]
    if engine == "sglang":
        assert any("share one weight_global_scale" in p for p in num["problems"]), num["problems"]


# -- the MTP layers as each engine's speculative-decoding draft reads them ----------------------------------------

#: Checkpoints with MTP layers: the source itself and the default output (MTP layers kept where a draft cannot take
#: them quantized, named in the exclude list as each draft asks for them: docs/families.md, "MTP layers"); the 2026
#: families' default output only (one draft check per family: --quantize-mtp writes the same under ModelOpt NVFP4,
#: SGLang's drafts building the whole MTP layer unquantized).
DRAFTS = [(m, kind) for m in ("glm", "ds", "q35") for kind in ("source", "output")] + [
    (m, "output") for m in ("ds32", "g5", "g47", "g53", "q4", "ds4", "m3", "ds-ct")] + [
    ("ink", "source")]  # a banded MTP head: SGLang's draft as multi-layer EAGLE (sglang_runner.banded_mtp)
#: A draft row under another recipe than the family's default: the output's key in OUTPUTS -> its input's model (every
#: main row of a family with MTP layers under a recipe has its draft row: DeepSeek V3 under ct-nvfp4-a16, vLLM only)
DRAFT_INPUT = {"ds-ct": "ds"}
#: The engines with a draft model for the family, where not both: SGLang 0.5.23 has no MiniMax M3 draft (its registry's
#: M3 classes are the main ones and the external DSpark draft; configs/model_config.py ModelConfig._config_draft_model
#: renames no MiniMax architecture: docs/families.md, "MiniMax M3's drafts").
DRAFT_ENGINES = {"m3": ("vllm",), "ds-ct": ("vllm",)}  # (ds-ct: SGLang refuses the main model, OUTPUTS above)
#: Drafts an engine cannot load from the default output, for a reason in the engine (none now: DeepSeek V3's SGLang
#: NextN loads since the exclude list spells the kept MTP MLA projections so that SGLang's fused-pattern rule does
#: not widen them to every layer, convert/engine_rules.py SGLANG_FUSED_TAILS; MiniMax M3's vLLM MiniMaxM3MTP loads since
#: the exclude list names its lm_head and model.layers.{i}.self_attn.qkv_proj, main layer i's q/k/v kept with it).
DRAFT_REFUSED: dict[tuple[str, str, str], str] = {}
DRAFT_PARAMS = [pytest.param(m, kind, e.values[0], marks=e.marks, id=f"{m}-{kind}-{e.id}")
                for m, kind in DRAFTS for e in ENGINE_PARAMS if e.values[0] in DRAFT_ENGINES.get(m, ENGINES)] + [
    pytest.param(m, kind, e.values[0], marks=e.marks, id=f"{m}-{kind}-{e.id}")
    for m, kind, engine in DRAFT_REFUSED for e in ENGINE_PARAMS if e.values[0] == engine]


@pytest.mark.parametrize(("model", "kind", "engine"), DRAFT_PARAMS)
def test_draft_loads(model, kind, engine, outputs, inputs):
    """Each engine's draft model (vLLM's speculative config method mtp, SGLang's NEXTN draft), built for the
    checkpoint as a deployment builds it: loads, every parameter filled but what the engine takes from the target
    model (embed_tokens, lm_head, shared heads: named as such), nothing skipped but the main model's tensors (and
    SGLang's own skip of the MTP layer's embedding / head copies), no bad cast, and, on the output, every MTP layer
    read right against the source. The main model's report comes first and is the same check as test_output_loads."""
    src = inputs[DRAFT_INPUT.get(model, model)]
    folder = src if kind == "source" else outputs[model]
    assert isinstance(folder, Path), f"pack failed: {folder}"
    rc, reps = draft_check(folder, engine, src if kind == "output" else None)
    assert [r["role"] for r in reps] == ["main", "draft"], [r["verdict"] for r in reps]
    main, draft = reps
    if kind == "output":
        record(engine, model, folder, draft)
    if (model, kind, engine) in DRAFT_REFUSED:  # the known refusal, and the main model unharmed
        assert main["ok"] and not draft["ok"] and rc == 1, describe(draft)
        err = f"{(draft['error'] or {}).get('tensor', '')} {' '.join(t['tensor'] for t in draft['skipped'])}"
        assert re.search(DRAFT_REFUSED[(model, kind, engine)], err), describe(draft)
        return
    bad = [c for c in draft["bad_casts"] if c["class"] != "narrowing" or kind == "output"]
    assert draft["error"] is None and not draft["unfilled"] and not draft["skipped"] and not bad, describe(draft)
    # the main model's tensors: dropped by the draft's own rule, or never offered to it (vLLM's weight_utils skips the
    # shards holding no weight the draft loads: "Skipped N/M safetensors shard(s)", as for DeepSeek V4)
    assert draft["main_skipped"] or draft["offered"] < main["offered"], describe(draft)
    assert not draft["mtp_skipped"], describe(draft)
    stored = {t for t, params in draft["stored"].items() if params}
    assert {t["tensor"] for t in main["mtp_skipped"]} - stored <= {
        t["tensor"] for t in draft["main_skipped"]}, "an MTP tensor the draft neither loaded nor dropped by its rule"
    if kind == "output":
        num = draft["numerics"]
        assert num is not None and num["ok"] and num["layers"], describe(draft) + "\n" + "\n".join(
            (num or {}).get("problems", [])[:5])
        assert rc == 0 and draft["ok"] and main["ok"], describe(draft)
