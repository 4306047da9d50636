"""The engines' own loaders on tiny checkpoints: `verify-manifest --engine vllm|sglang`.

Marked ``engine`` and skipped, with the reason, where an engine's environment is absent (create them
with ``scripts/engine-envs.sh``; ``KIMI_CONVERT_VLLM_PYTHON`` / ``KIMI_CONVERT_SGLANG_PYTHON`` point
at others). Each check runs the engine in its own python (20-40 s on the CPU).

* the unconverted synthetic inputs (BF16 + MXFP4 experts for K3, BF16 for Kimi Linear) load;
* the default ``pack`` outputs load: no engine error, no unfilled parameter, no skipped tensor, no
  bad cast (engine-optional parameters excepted, each named in the runner);
* a planted defect (a tensor dropped, one renamed, a bf16 tensor stored as uint8) fails in both.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kimi_convert.enginecheck import EngineUnavailable, find_python

ENGINES = ("vllm", "sglang")
MODELS = {"k3": "tiny-k3", "kl": "tiny-kimi-linear"}


def cli(*args, timeout: float = 1800) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kimi_convert.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)


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
        r = cli("synth", preset, root / key)
        assert r.returncode == 0, r.stderr
        out[key] = root / key
    return out


@pytest.fixture(scope="module")
def outputs(inputs, tmp_path_factory) -> dict[str, Path | str]:
    """The default pack of each input; a pack that fails is recorded as its error line."""
    root = tmp_path_factory.mktemp("engine-outputs")
    out: dict[str, Path | str] = {}
    for key, src in inputs.items():
        r = cli("pack", src, root / key, "-q", "--device", "cpu")
        out[key] = root / key if r.returncode == 0 else (r.stderr.strip().splitlines() or ["pack failed"])[-1]
    return out


def engine_check(folder: Path, engine: str) -> tuple[int, dict]:
    r = cli("verify-manifest", folder, "--engine", engine, "--json")
    assert r.stdout.strip(), f"no report (rc {r.returncode}): {r.stderr[-2000:]}"
    d = json.loads(r.stdout)
    return r.returncode, d["engines"][0]


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
    rc, rep = engine_check(inputs[model], engine)
    assert rep["ok"] and rc == 0, describe(rep)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("engine", ENGINE_PARAMS)
def test_default_output_loads(engine, model, outputs):
    """The issue's bar: loads, every parameter filled, no skipped tensor, no bad cast."""
    out = outputs[model]
    assert isinstance(out, Path), f"pack failed: {out}"
    rc, rep = engine_check(out, engine)
    assert rep["ok"], describe(rep)
    assert not rep["unfilled"] and not rep["skipped"] and not rep["bad_casts"] and rep["error"] is None
    assert rc == 0


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
    r = cli("verify-manifest", inputs["k3"], "--engine", "vllm", "--engine-python", tmp_path / "nope" / "python")
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "does not exist" in r.stderr and "Traceback" not in r.stderr


def test_engine_not_installed_is_one_line(inputs):
    r = cli("verify-manifest", inputs["k3"], "--engine", "sglang", "--engine-python", sys.executable)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "no sglang installed" in r.stderr


def test_engine_python_needs_one_engine(inputs):
    r = cli("verify-manifest", inputs["k3"], "--engine", "vllm", "--engine", "sglang", "--engine-python",
            sys.executable)
    assert r.returncode == 2 and "exactly one --engine" in r.stderr


def test_unpinned_version_refused(tmp_path, monkeypatch):
    from kimi_convert.enginecheck import Probe, check_version
    from kimi_convert.errors import ConvertError

    with pytest.raises(ConvertError, match="not the tested version 0.33.0; pass --engine-any-version"):
        check_version("vllm", Probe("py", "0.34.1", []), any_version=False)
    check_version("vllm", Probe("py", "0.34.1", []), any_version=True)
