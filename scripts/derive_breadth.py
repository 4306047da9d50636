"""The derivation over every MoE text architecture of both pinned engines' registries (issue 38, item 4).

    python scripts/derive_breadth.py [ARCH ...] [--work DIR] [--redo] [--ship] [--table-only] [--list]

For each architecture (default: all, from ``architectures()``), resumably (an architecture with a line in
``docs/derived-architectures.jsonl`` is skipped unless ``--redo``):

1. **fixture**: ``scripts/make_fixture.py ARCH`` in the vLLM environment's python: the architecture's transformers
   class at a tiny size, random BF16 weights, saved by its own ``save_pretrained`` (no per-family code);
2. **fixture loads**: ``kimi-convert verify-manifest FIXTURE --no-numerics --engine E...`` for each engine that
   registers it (every parameter filled, none skipped);
3. **derived**: ``kimi-convert mapping derive FIXTURE -o derived.toml --answers answers.json``;
4. **pack**: ``kimi-convert pack FIXTURE OUT --mapping derived.toml`` (default recipe, modelopt, source layout;
   merged with its hand overlay, ``mappings/overlays/MODEL_TYPE.toml``, where one exists, as ``plan`` merges it);
5. **output read right**: ``kimi-convert verify-manifest OUT --input FIXTURE --engine E...`` (loads with every
   parameter filled, numeric check).

Each step runs only when the one before held. The engine steps of one architecture run under one hold of
``/tmp/kimi-engine.lock`` (the machine's engine lock), with ``KIMI_CONVERT_ENGINE_SERVERS`` naming one folder for
the whole batch (each engine imported once) and ``TRITON_INTERPRET=1`` for all of them (one fork server per engine).
After each architecture the JSONL and ``docs/derived-architectures.md`` (generated from it: ``--table-only``
rewrites it alone) are rewritten; ``--ship`` copies the table of every architecture whose output both registering
engines read right (an engine named in ``NOT_SERVED``, whose own code cannot serve the release, left out where it
fails the fixture check; one named in ``NOT_SERVED_QUANTIZED``, whose code loads the release but no quantized
checkpoint of it, left out after the fixture check) to ``mappings/derived/MODEL_TYPE.toml`` and its answers to
``tests/derived/breadth/ARCH.answers.json`` (``tests/test_derive_breadth.py`` rebuilds each shipped table from them).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "derived-architectures.jsonl"
TABLE = REPO / "docs" / "derived-architectures.md"
LOCK = "/tmp/kimi-engine.lock"
ENGINES = ("vllm", "sglang")
STEP_TIMEOUT = 2400
MOE_CODE = re.compile(r"FusedMoE|fused_moe|get_moe_impl_class")
NOT_TEXT = re.compile(r"NextN|MTP|DSpark|DFlash|^Transformers|VL|OCR|Vision")


@dataclass(frozen=True)
class Arch:
    name: str
    vllm: str | None  # the vLLM model file registering it (relative to site-packages), None if not registered
    sglang: str | None
    same_as: str | None  # an earlier registry name for the same engine classes (an alias)

    @property
    def engines(self) -> tuple[str, ...]:
        return tuple(e for e in ENGINES if getattr(self, e))


def site_packages(engine: str) -> Path:
    from kimi_convert.enginecheck import resolve

    for p in resolve(engine).site_packages:
        if (Path(p) / engine).is_dir():
            return Path(p)
    raise SystemExit(f"{engine}: no site-packages holding it")


def _vllm_registry(site: Path, table: str = "_TEXT_GENERATION_MODELS") -> dict[str, tuple[str, str]]:
    tree = ast.parse((site / "vllm/model_executor/models/registry.py").read_text())
    for node in tree.body:
        tgt = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if getattr(tgt, "id", None) == table:
            return {k.value: (v.elts[0].value, v.elts[1].value)
                    for k, v in zip(node.value.keys, node.value.values, strict=True) if k is not None}
    raise SystemExit(f"vLLM registry: no {table}")


def _vllm_files(site: Path, mod: str) -> list[Path]:
    if mod.startswith("vllm."):
        p = site / Path(*mod.split("."))
        return sorted(p.rglob("*.py")) if p.is_dir() else [p.with_suffix(".py")]
    return [site / "vllm/model_executor/models" / f"{mod}.py"]


def _uses_moe(site: Path, files: list[Path], depth: int = 0) -> bool:
    """The model file (or a sibling model file it imports from) builds routed experts."""
    for f in files:
        if not f.is_file():
            continue
        text = f.read_text(errors="ignore")
        if MOE_CODE.search(text):
            return True
        if depth == 0:
            subs = [site / "vllm/model_executor/models" / f"{a or b}.py" for a, b in
                    re.findall(r"from\s+\.(\w+)\s+import|from\s+vllm\.model_executor\.models\.(\w+)\s+import", text)]
            if _uses_moe(site, [s for s in subs if s.name not in ("utils.py", "interfaces.py")], 1):
                return True
    return False


def _sglang_entries(site: Path) -> dict[str, tuple[str, bool]]:
    """SGLang entry class -> (its model file, whether that file has MoE code)."""
    out = {}
    for f in sorted((site / "sglang/srt/models").glob("*.py")):
        text = f.read_text(errors="ignore")
        m = re.search(r"EntryClass\s*=\s*(\[[^\]]*\]|\w+)", text, re.S)
        if m:
            for n in re.findall(r"\w+", m.group(1)):
                out.setdefault(n, (f"sglang/srt/models/{f.name}", bool(MOE_CODE.search(text))))
    return out


def hand_tables() -> set[str]:
    """The architectures a hand table (mappings/*.toml) names: the lookup gives them that table first."""
    return {a for f in sorted((REPO / "mappings").glob("*.toml"))
            for a in tomllib.loads(f.read_text()).get("architectures", [])}


#: Releases whose checkpoint is a multimodal class (vLLM's ``_MULTIMODAL_MODELS``) around a MoE text class of the
#: registry: the text class alone is not what ships. Llama 4 Scout / Maverick are ``Llama4ForConditionalGeneration``
#: (``language_model.model.layers...``, ``vision_model...``, ``multi_modal_projector``), served by vLLM's and SGLang's
#: ``mllama4.py``; SGLang's text class ``Llama4ForCausalLM`` maps no expert (docs/families.md).
RELEASES_WITH_VISION = ("Llama4ForConditionalGeneration",)


def architectures() -> list[Arch]:
    """Every MoE text architecture: vLLM's text-generation registry entries whose model code builds routed experts,
    the multimodal releases of :data:`RELEASES_WITH_VISION`, then SGLang's MoE entry classes that vLLM does not
    register (drafts, MTP heads and vision models left out)."""
    vsite, ssite = site_packages("vllm"), site_packages("sglang")
    sg = _sglang_entries(ssite)
    out, first = [], {}
    for name, (mod, cls) in _vllm_registry(vsite).items():
        files = _vllm_files(vsite, mod)
        if not _uses_moe(vsite, files):
            continue
        rel = str(files[0].relative_to(vsite)) if files and files[0].exists() else mod
        out.append(Arch(name, rel, sg.get(name, (None,))[0], first.get((mod, cls))))
        first.setdefault((mod, cls), name)
    mm = _vllm_registry(vsite, "_MULTIMODAL_MODELS")
    for name in RELEASES_WITH_VISION:
        mod, _ = mm[name]
        out.append(Arch(name, str(_vllm_files(vsite, mod)[0].relative_to(vsite)), sg.get(name, (None,))[0], None))
    known = {a.name for a in out}
    for name, (f, moe) in sg.items():
        if moe and name not in known and name.endswith("ForCausalLM") and not NOT_TEXT.search(name):
            out.append(Arch(name, None, f, None))
    return out


def engine_env(servers: str) -> dict:
    env = dict(os.environ)
    env.update({"KIMI_CONVERT_ENGINE_SERVERS": servers, "TRITON_INTERPRET": "1"})
    return env


def run(cmd: list[str], env: dict, timeout: float = STEP_TIMEOUT, log: Path | None = None
        ) -> tuple[int | None, str, str]:
    """The command's exit status (None past ``timeout``), stdout and stderr; both also appended to ``log``."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)
        rc, out, err = r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired:
        rc, out, err = None, "", f"timed out after {timeout:.0f} s"
    if log is not None:
        with open(log, "a") as f:
            f.write(f"$ {' '.join(cmd)}\n[exit {rc}]\n{out}\n{err}\n")
    return rc, out, err


def one_line(text: str, limit: int = 300) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith(("Writing", "WARNING"))]
    line = lines[-1] if lines else ""
    return line if len(line) <= limit else line[:limit] + "..."


def vllm_python() -> str:
    from kimi_convert.enginecheck import resolve

    return resolve("vllm").python


#: architectures transformers has no class for, whose fixture is a source preset laid out as the release
#: (``kimi-convert synth FILE.toml:NAME``: its config.json, tensor names, dtypes and storage; docs/families.md)
PRESET_FIXTURES = {"BailingMoeV2ForCausalLM": "tests/presets/bailing_moe_v2.toml:tiny-bailing-moe-v2",
                   "SarvamMoEForCausalLM": "tests/presets/sarvam_moe.toml:tiny-sarvam-moe",
                   "SarvamMLAForCausalLM": "tests/presets/sarvam_mla.toml:tiny-sarvam-mla",
                   # transformers builds these at sizes or names the engines refuse (a sparse MLA head that no
                   # attention backend takes, V4's hyper-connection names, Kimi Linear's RoPE): the presets keep
                   # the release's (docs/families.md)
                   "DeepseekV32ForCausalLM": "tiny-deepseek-v3-2", "DeepseekV4ForCausalLM": "tiny-deepseek-v4",
                   "GlmMoeDsaForCausalLM": "tiny-glm5", "KimiLinearForCausalLM": "tiny-kimi-linear",
                   "MistralLarge3ForCausalLM": "tiny-mistral-large-3",  # (no transformers class: params.json)
                   "Step3p5ForCausalLM": "tests/presets/step3p5.toml:tiny-step3p5",
                   "Grok1ForCausalLM": "tests/presets/grok1.toml:tiny-grok1",
                   "Step3TextForCausalLM": "tests/presets/step3_text.toml:tiny-step3-text",
                   "DeepseekForCausalLM": "tests/presets/deepseek_moe.toml:tiny-deepseek-moe",
                   "XverseMoeForCausalLM": "tests/presets/xverse_moe.toml:tiny-xverse-moe",
                   "BailingMoeV2_5ForCausalLM": "tests/presets/bailing_moe_v2_5.toml:tiny-bailing-moe-v2-5",
                   "BailingMoeV3ForCausalLM": "tests/presets/bailing_moe_v3.toml:tiny-bailing-moe-v3",
                   "PanguUltraMoEForCausalLM": "tests/presets/openpangu_ultra_moe.toml:tiny-openpangu-ultra-moe",
                   "PanguProMoEV2ForCausalLM": "tests/presets/openpangu_pro_moe_v2.toml:tiny-openpangu-pro-moe-v2",
                   "MiniCPMForCausalLM": "tests/presets/minicpm_moe.toml:tiny-minicpm-moe",
                   "LongcatFlashForCausalLM": "tests/presets/longcat_flash.toml:tiny-longcat-flash",
                   "MiMoV2FlashForCausalLM": "tests/presets/mimo_v2_flash.toml:tiny-mimo-v2-flash",
                   "BailingMoeForCausalLM": "tests/presets/bailing_moe.toml:tiny-bailing-moe",
                   "LagunaForCausalLM": "tests/presets/laguna.toml:tiny-laguna",
                   "AXK1ForCausalLM": "tests/presets/axk1.toml:tiny-axk1",
                   "K2HorizonForCausalLM": "tests/presets/k2_horizon.toml:tiny-k2-horizon",
                   "Step5ForCausalLM": "tests/presets/step5.toml:tiny-step5",
                   "IQuestQ1ForCausalLM": "tests/presets/iquest_q1.toml:tiny-iquest-q1",
                   "SDARMoeForCausalLM": "tests/presets/sdar_moe.toml:tiny-sdar-moe",
                   "Param2MoEForCausalLM": "tests/presets/param2moe.toml:tiny-param2moe",
                   "AliceAIForCausalLM": "tests/presets/alice_ai.toml:tiny-alice-ai",
                   "GraniteMoeHybridForCausalLM": "tests/presets/granitemoehybrid.toml:tiny-granitemoehybrid",
                   "InklingForConditionalGeneration": "tests/presets/inkling.toml:tiny-inkling",
                   "ZayaForCausalLM": "tests/presets/zaya.toml:tiny-zaya",
                   "LongcatFlashNgramForCausalLM": "tests/presets/longcat_flash_ngram.toml:tiny-longcat-flash-ngram"}
#: architectures whose release's config class is its own code (auto_map; neither engine nor transformers has one):
#: the engine steps pass ``--trust-remote-code``, as a deployment of the release does
TRUST_REMOTE_CODE = {"BailingMoeV2ForCausalLM", "SarvamMoEForCausalLM", "SarvamMLAForCausalLM", "DeepseekForCausalLM",
                     "XverseMoeForCausalLM", "BailingMoeV2_5ForCausalLM", "PanguUltraMoEForCausalLM",
                     "PanguProMoEV2ForCausalLM", "MiniCPMForCausalLM", "BailingMoeV3ForCausalLM",
                     "BailingMoeForCausalLM", "LongcatFlashForCausalLM", "MiMoV2FlashForCausalLM",
                     "K2HorizonForCausalLM", "SDARMoeForCausalLM", "Param2MoEForCausalLM",
                     "AliceAIForCausalLM", "LongcatFlashNgramForCausalLM"}

#: engines that do not serve an architecture's release itself: the engine's own loader or config code fails on the
#: release's layout (the preset is the release's: docs/families.md gives the evidence and the engine's message). The
#: breadth run carries on without such an engine when its fixture check fails (``carried``), the row keeps its
#: message, and the table derived from the other engine ships (``shippable``).
NOT_SERVED = {"Step3p5ForCausalLM": {"sglang": "SGLang 0.5.23 get_config stops in transformers' Step3p7TextConfig "
                                               "(per-layer num_attention_heads): docs/families.md, Step-3.5-Flash"},
              "MiniCPMForCausalLM": {"sglang": "SGLang 0.5.23 minicpm.py load_weights builds no experts for the "
                                               "release's per-expert w1/w2/w3 (KeyError 'model.layers.0.mlp.ws'): "
                                               "docs/families.md, MiniCPM-MoE"},
              "LongcatFlashForCausalLM": {"sglang": "SGLang 0.5.23 longcat_flash.py reads rope_parameters, which its "
                                                    "LongcatFlashConfig leaves None for the release's config.json (no "
                                                    "rope_scaling): TypeError at longcat_flash.py:377; "
                                                    "docs/families.md, LongCat-Flash"},
              "K2HorizonForCausalLM": {"sglang": "SGLang 0.5.23 xllm.py _normalize_k2_horizon_config refuses the "
                                                 "release's config.json (no xllm_source_router_gemm_partitions: the "
                                                 "model card passes it as a server flag), and builds no quantized "
                                                 "MoVA model (_validate_mova_config, _XllmMoVAAttentionBase): "
                                                 "docs/families.md, K2 Horizon"},
              "LagunaForCausalLM": {"vllm": "vLLM 0.33 laguna.py leaves the router's e_score_correction_bias unset "
                                            "whatever the checkpoint names it (registered on RoutedExperts only, "
                                            "whose load_weights matches expert weights only): docs/families.md, "
                                            "Laguna"}}


#: engines whose main model loads the release but whose speculative-decoding draft does not, for a reason of its own
#: (the release's MTP layers as stored): the fixture check holds the main model alone there (the draft's verdict kept
#: beside it); the output check holds the draft as usual.
DRAFT_NOT_SERVED = {
    "MiMoV2FlashForCausalLM": {"sglang": "SGLang 0.5.23 mimo_v2_nextn.py MiMoV2MTP builds the MTP layer under its own "
                                         "prefix (model.decoder.*), which the release's FP8 quantization_config's "
                                         "ignored_layers (model.mtp.layers.{i}.self_attn.o_proj) does not name, so "
                                         "it builds o_proj FP8 against the release's BF16 weight: \"1 unfilled "
                                         "parameter(s) (first: model.mtp_block.self_attn.o_proj.weight_scale_inv); "
                                         "3 bad cast(s)\": docs/families.md, MiMo-V2-Flash"}}

#: engines that load the release itself (its fixture check passes) but whose own loader loads no quantized checkpoint
#: of the architecture (every output format fails in the engine's code, before any of the output's bytes are its
#: question): left out of the steps after the fixture check whatever it says; the row says so with the reason.
NOT_SERVED_QUANTIZED = {
    "GraniteMoeHybridForCausalLM": {"sglang": "SGLang 0.5.23 granitemoehybrid.py load_weights: under a ModelOpt "
                                              "config 'ModelOptFp4Config' object has no attribute 'get_cache_scale' "
                                              "(granitemoehybrid.py:656), under compressed-tensors its per-expert "
                                              "path passes FusedMoE.weight_loader a return_success it does not take "
                                              "(TypeError, granitemoehybrid.py:638): docs/families.md, Granite 4.0 "
                                              "hybrid"},
    "BeamForCausalLM": {"sglang": "SGLang 0.5.23 beam.py BeamForCausalLM.__init__ builds Beam only in BF16, "
                                  "compressed-tensors FP8 per channel or ModelOpt W4A4 NVFP4 "
                                  "(get_beam_quantization): the default recipe's W4A16 and compressed-tensors' "
                                  "NVFP4 raise 'NotImplementedError: Beam supports BF16, compressed-tensors FP8 "
                                  "..., or ModelOpt serialized W4A4 NVFP4'; docs/families.md, Beam"}}


def work_for(root: Path, arch: Arch) -> Path:
    """An architecture's work folder; one whose fixture is a preset holds the preset's name too (SGLang reads a
    folder in Mistral's layout as such only when its path names the model: ``mistral_utils.py``
    ``is_mistral_model``, "mistral-large-3")."""
    preset = PRESET_FIXTURES.get(arch.name, "").rpartition(":")[2]
    return root / (f"{arch.name}-{preset}" if preset else arch.name)


def synth_fixture(arch: Arch, work: Path) -> dict:
    """Step 1 from a preset: the release's layout written by the one generator, then read back as the fixture
    record ``make_fixture.py`` gives (model type, layers, tensors, bytes)."""
    fx, spec = work / "fixture", PRESET_FIXTURES[arch.name]
    rc, _, err = run(["kimi-convert", "synth", spec, str(fx)], dict(os.environ), timeout=900,
                       log=work / "steps.log")
    if rc != 0:
        return {"ok": False, "why": one_line(err) or f"exit {rc}"}
    if (fx / "config.json").is_file():
        config = json.loads((fx / "config.json").read_text())
        names = json.loads((fx / "model.safetensors.index.json").read_text())["weight_map"]
    else:  # Mistral's own layout: params.json read as both engines read it (DeepSeek V3's config)
        from kimi_convert import mistral_checkpoint

        config = mistral_checkpoint.config_view(json.loads((fx / mistral_checkpoint.PARAMS).read_text()))
        names = json.loads((fx / mistral_checkpoint.INDEX).read_text())["weight_map"]
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config  # (multimodal)
    return {"ok": True, "preset": spec.rpartition(":")[2], "architecture": arch.name,
            "model_type": config.get("model_type"), "layers_full": None,  # (LongCat-Flash-Lite's has none)
            "layers": text.get("num_hidden_layers", text.get("num_layers")),  # LongCat-Flash: num_layers
            "tensors": len(names), "bytes": sum(f.stat().st_size for f in fx.glob("*.safetensors")),
            "routed_expert_tensors": sum(".experts." in n for n in names)}


def make_fixture(arch: Arch, work: Path) -> dict:
    """Step 1 (no engine lock: it builds a transformers model only, or writes the architecture's preset)."""
    fx = work / "fixture"
    if (work / "fixture.json").is_file() and (fx / "config.json").is_file():
        return json.loads((work / "fixture.json").read_text())
    shutil.rmtree(fx, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    if arch.name in PRESET_FIXTURES:
        res = synth_fixture(arch, work)
        (work / "fixture.json").write_text(json.dumps(res))
        return res
    rc, out, err = run([vllm_python(), str(REPO / "scripts/make_fixture.py"), arch.name, str(fx)], dict(os.environ),
                       timeout=900, log=work / "steps.log")
    if rc != 0:
        res = {"ok": False, "why": one_line(err) or f"exit {rc}"}
    else:
        res = {"ok": True, **json.loads(out.strip().splitlines()[-1])}
        if not res["routed_expert_tensors"]:
            res = {**res, "ok": False, "why": f"{res['model_type']}'s default config builds no routed experts "
                   "(dense at its defaults)"}
    (work / "fixture.json").write_text(json.dumps(res))
    return res


def _loads(er: dict, fixture: bool) -> bool:
    """Every parameter filled, none skipped, no bad cast. A fixture's float narrowed on load (DeepSeek V3.2's fp32
    ``indexer.wk`` scale into vLLM's BF16 ``wk_weights_proj``) is the engine's reading of the release itself, not a
    defect of the checkpoint (as ``tests/test_engines.py::test_synthetic_input_loads`` counts it)."""
    casts = [c for c in er.get("bad_casts") or [] if not (fixture and c.get("class") == "narrowing")]
    return bool(er.get("loaded")) and not casts and not any(er.get(k) for k in ("unfilled", "skipped",
                                                                                "observer_errors", "rule_broken"))


def engine_check(folder: Path, source: Path | None, engines: tuple[str, ...], env: dict, trust: bool = False,
                 drafts_left: Container[str] = ()) -> dict:
    """verify-manifest FOLDER [--input SOURCE] --engine E...: per engine, loads / read right / its verdict; the draft
    of an engine in ``drafts_left`` (``DRAFT_NOT_SERVED``: its draft cannot load the release itself) is kept beside
    the cell (``draft``), not held to it."""
    cmd = ["kimi-convert", "verify-manifest", str(folder), "--json", "-q"]
    cmd += ["--input", str(source)] if source is not None else ["--no-numerics"]
    cmd += ["--trust-remote-code"] if trust else []
    for e in engines:
        cmd += ["--engine", e]
    rc, out, err = run(cmd, env, log=folder.parent / "steps.log")
    try:
        reports = json.loads(out)["engines"]
    except (ValueError, KeyError):
        return {e: {"loads": False, "read_right": False, "verdict": one_line(err or out) or f"exit {rc}"}
                for e in engines}
    res: dict[str, dict] = {}
    for er in reports:  # an engine's main model, then its draft model where the checkpoint holds MTP layers
        num = er.get("numerics") or {}
        loads, draft = _loads(er, fixture=source is None), er["engine"] in res
        # None: no numeric check asked; a draft checked without one (its weights the main model's): its load
        read = None if source is None else loads and (bool(num.get("ok")) if num or not draft else True)
        got = {"loads": loads, "read_right": read, "verdict": er.get("verdict", ""), "params": er.get("params"),
               "numerics": (num.get("summary") if num else None)}
        if draft and er["engine"] in drafts_left:
            res[er["engine"]]["draft"] = got
        else:
            res[er["engine"]] = _with_draft(res[er["engine"]], got) if draft else got
    return res


def _held(cell: dict) -> bool:
    return cell["loads"] and cell["read_right"] is not False


def _with_draft(main: dict, draft: dict) -> dict:
    """An engine's cell from its main model's and its draft's: both must hold; the verdict is the main model's
    unless only the draft failed."""
    return {**main, "loads": main["loads"] and draft["loads"],
            "read_right": None if draft["read_right"] is None else _held(main) and draft["read_right"],
            "verdict": draft["verdict"] if _held(main) and not _held(draft) else main["verdict"]}


def derive_step(work: Path, engines: tuple[str, ...], env: dict, trust: bool = False) -> dict:
    table, answers = work / "derived.toml", work / "answers.json"
    cmd = ["kimi-convert", "mapping", "derive", str(work / "fixture"), "-o", str(table), "--answers", str(answers)]
    cmd += ["--trust-remote-code"] if trust else []
    if engines != ENGINES:
        for e in engines:
            cmd += ["--engine", e]
    rc, out, err = run(cmd, env, log=work / "steps.log")
    if rc != 0 or not table.is_file():
        return {"ok": False, "why": one_line(err or out) or f"exit {rc}"}
    t = tomllib.loads(table.read_text())
    return {"ok": True, "name": t.get("name"), "groups": [f"{g['name']}={'+'.join(g['members'])}"
                                                          + (f" ({','.join(g['engines'])})" if g.get("engines")
                                                             else "") for g in t.get("group", [])],
            "scale_groups": [f"{g['name']}={'+'.join(g['members'])}" for g in t.get("scale_group", [])],
            **({"stacked": t["stacked"]["modules"]} if t.get("stacked") else {}),
            **({"stacked_keep": True} if (t.get("stacked") or {}).get("keep") else {}),
            "keep": [k["pattern"] for k in t.get("keep", [])], "not_linear": t.get("not_linear", []),
            "linear": t.get("linear", []),
            "absent_keeps": [k["pattern"] for k in t.get("keep", []) if " with None under " in k["reason"]],
            "header": [ln for ln in table.read_text().splitlines()
                                                      if ln.startswith("#")]}


def with_overlay(work: Path) -> tuple[Path, str | None]:
    """The table pack is given: the derived one, or, where a hand overlay exists for it
    (``mappings/overlays/MODEL_TYPE.toml``: engine-check findings the derivation cannot see), the two merged as
    ``plan`` merges them over the shipped table (``derive.lookup.finish``), so the output checked is the one a user
    gets."""
    import tomli_w

    from kimi_convert.derive import merge
    from kimi_convert.derive.lookup import overlay_for

    table = work / "derived.toml"
    t = tomllib.loads(table.read_text())
    ov = overlay_for(t.get("name", ""))
    if ov is None:
        return table, None
    merged = work / "derived+overlay.toml"
    merged.write_text(tomli_w.dumps(merge(t, ov[1])))
    return merged, ov[0]


def pack_step(work: Path, env: dict) -> dict:
    out = work / "out"
    shutil.rmtree(out, ignore_errors=True)
    table, overlay = with_overlay(work)
    rc, so, err = run(["kimi-convert", "pack", str(work / "fixture"), str(out), "--mapping",
                       str(table), "--device", "cpu", "-q"], env, log=work / "steps.log")
    res = {"ok": rc == 0, **({} if rc == 0 else {"why": one_line(err or so) or f"exit {rc}"})}
    return {**res, "overlay": overlay} if overlay else res


def not_served(arch: str, fixture_check: dict[str, dict]) -> dict[str, str]:
    """The engines left out of the steps after the fixture check, with the reason: those ``NOT_SERVED`` names for the
    architecture whose fixture check failed, and those ``NOT_SERVED_QUANTIZED`` names (the one rule ``carried``, the
    table's cells and ``shippable`` read)."""
    left = {e: why for e, why in NOT_SERVED.get(arch, {}).items()
            if not (fixture_check.get(e) or {}).get("loads", True)}
    return left | NOT_SERVED_QUANTIZED.get(arch, {})


def carried(arch: Arch, fixture_check: dict[str, dict]) -> tuple[str, ...]:
    """The engines the steps after the fixture check run in: every registering engine but those :func:`not_served`
    leaves out (none if another engine failed to load the fixture)."""
    failed = {e for e, r in fixture_check.items() if not r["loads"]}
    left = not_served(arch.name, fixture_check)
    if failed - set(left):
        return ()
    return tuple(e for e in arch.engines if e not in failed and e not in left)


def engine_steps(arch: Arch, work: Path, env: dict) -> dict:
    """Steps 2-5 (the caller holds the engine lock)."""
    fx, trust = work / "fixture", arch.name in TRUST_REMOTE_CODE
    res: dict = {"fixture_check": engine_check(fx, None, arch.engines, env, trust,
                                               DRAFT_NOT_SERVED.get(arch.name, {}))}
    engines = carried(arch, res["fixture_check"])
    if not engines:
        return res
    res["derive"] = derive_step(work, engines, env, trust)
    if not res["derive"]["ok"]:
        return res
    res["pack"] = pack_step(work, env)
    if res["pack"]["ok"]:
        res["output_check"] = engine_check(work / "out", fx, engines, env, trust)
    return res


@contextlib.contextmanager
def engine_lock():
    with open(LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def load_results() -> dict[str, dict]:
    if not RESULTS.is_file():
        return {}
    return {d["arch"]: d for d in map(json.loads, RESULTS.read_text().splitlines()) if d.get("arch")}


def save_results(results: dict[str, dict], order: list[str]) -> None:
    names = order + sorted(set(results) - set(order))
    RESULTS.write_text("".join(json.dumps(results[n], sort_keys=True) + "\n" for n in names if n in results))
    TABLE.write_text(render(results, names))


#: architectures whose shipped derived table comes from a tiny preset's recorded answers (tests/derived/), not from
#: a breadth fixture: its output is proven by the engine tests on that preset (tests/test_engines.py)
#: (the breadth run never overwrites one: ``shippable``)
PRESET_TABLES = {"MiniMaxM2ForCausalLM": {"table": "mappings/derived/minimax_m2.toml", "preset": "tiny-minimax-m2"},
                 "Glm4MoeLiteForCausalLM": {"table": "mappings/derived/glm4_moe_lite.toml",
                                            "preset": "tiny-glm4-moe-lite"},
                 "DeepseekV32ForCausalLM": {"table": "mappings/derived/deepseek_v32.toml",
                                            "preset": "tiny-deepseek-v3-2"},
                 "DeepseekV4ForCausalLM": {"table": "mappings/derived/deepseek_v4.toml", "preset": "tiny-deepseek-v4"},
                 "GlmMoeDsaForCausalLM": {"table": "mappings/derived/glm_moe_dsa.toml", "preset": "tiny-glm5"},
                 "MistralLarge3ForCausalLM": {"table": "mappings/derived/mistral_large_3.toml",
                                              "preset": "tiny-mistral-large-3"}}


def base_record(a: Arch) -> dict:
    rec = {"arch": a.name, "vllm": a.vllm, "sglang": a.sglang, "same_as": a.same_as,
           "hand_table": a.name in hand_tables()}
    if a.name in PRESET_TABLES:
        rec["preset_table"] = PRESET_TABLES[a.name]
    return rec


def finished(rec: dict) -> bool:
    """A record whose last step ran (or one that stopped at a step's failure)."""
    return "fixture" in rec or rec.get("why_not_run", "").startswith("alias")


def process(a: Arch, work: Path, env: dict, hold: dict) -> dict:
    """One architecture's record: the fixture (outside the lock), then the engine steps (under it)."""
    rec = base_record(a)
    if a.same_as:
        return {**rec, "why_not_run": f"alias of {a.same_as}: the same engine classes"}
    t0 = time.monotonic()
    rec["fixture"] = make_fixture(a, work)
    if rec["fixture"]["ok"]:
        rec.update(under_lock(a, work, env, hold))
    rec["seconds"] = round(time.monotonic() - t0)
    return rec


def under_lock(a: Arch, work: Path, env: dict, hold: dict) -> dict:
    """The engine steps, the lock taken if the batch does not hold it, given back once held ``hold['max_s']``."""
    if hold.get("since") is None:
        hold["cm"] = engine_lock()
        hold["cm"].__enter__()
        hold["since"] = time.monotonic()
    try:
        return engine_steps(a, work, env)
    finally:
        if time.monotonic() - hold["since"] > hold["max_s"]:
            release(hold)


def release(hold: dict) -> None:
    if hold.get("since") is not None:
        hold["cm"].__exit__(None, None, None)
        hold["since"] = None


class Notes:
    """The engines' and steps' own messages, numbered, below the table (cells keep a short verdict)."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def ref(self, arch: str, text: str) -> str:
        self.items.append(f"{arch}: {' '.join(str(text).split()).replace('|', '/')}")
        return f"[{len(self.items)}](#n{len(self.items)})"


def _engine_cell(rec: dict, step: str, engine: str, key: str, notes: Notes) -> str:
    if not rec.get(engine):
        return "not registered"
    r = (rec.get(step) or {}).get(engine)
    why = not_served(rec["arch"], rec.get("fixture_check") or {}).get(engine)
    if r is None and why:
        what = "quantized not served " if engine in NOT_SERVED_QUANTIZED.get(rec["arch"], {}) else "release not served "
        return what + notes.ref(rec["arch"], why)
    if r is None:
        return "not run"
    if r.get(key):
        return "yes"
    return "no " + notes.ref(rec["arch"], r.get("verdict") or "")


def _fixture_check_cell(rec: dict, engine: str, notes: Notes) -> str:
    """Loads with every parameter filled; where the BF16 weights are not read back as stored, the note says so."""
    cell = _engine_cell(rec, "fixture_check", engine, "loads", notes)
    r = (rec.get("fixture_check") or {}).get(engine) or {}
    if r.get("loads") and r.get("read_right") is False:
        cell += " (numeric check: " + notes.ref(rec["arch"], r.get("verdict") or "") + ")"
    why = DRAFT_NOT_SERVED.get(rec["arch"], {}).get(engine)
    if why and r.get("draft") and not r["draft"].get("loads"):
        cell += " (its draft: release not served " + notes.ref(rec["arch"], why) + ")"
    return cell


def _fixture_cell(rec: dict, notes: Notes) -> str:
    f = rec.get("fixture")
    if f is None:
        return "not run " + notes.ref(rec["arch"], rec.get("why_not_run", "not reached"))
    if not f["ok"]:
        return "no " + notes.ref(rec["arch"], f["why"])
    if f.get("preset"):  # a source preset laid out as the release (transformers has no class for it)
        return f"`{f['model_type']}`, {f['layers']} layers, from preset `{f['preset']}`"
    return f"`{f['model_type']}`, {f['layers']} of {f['layers_full']} layers"


def _derive_cell(rec: dict, notes: Notes) -> str:
    d = rec.get("derive")
    if d is None:
        return ""
    if not d["ok"]:
        return "no " + notes.ref(rec["arch"], d["why"])
    cell = (f"yes: {len(d['groups'])} group(s), {len(d['scale_groups'])} scale group(s), {len(d['keep'])} keep "
            + notes.ref(rec["arch"], "; ".join(d["groups"] + d["scale_groups"]) + "; keep " + ", ".join(d["keep"])
                        + ("; stacked banks " + ", ".join(d["stacked"]) if d.get("stacked") else "")))
    if d.get("stacked"):
        cell += f", {len(d['stacked'])} stacked bank(s)" + (" kept BF16" if d.get("stacked_keep") else "")
    if (rec.get("pack") or {}).get("overlay"):
        cell += f"; packed with its overlay `{rec['pack']['overlay']}`"
    if d.get("absent_keeps"):
        cell += (f"; **{len(d['absent_keeps'])} keep(s) of a module absent from a quantized build** "
                 + notes.ref(rec["arch"], "kept because an engine's build under an output format's config has no "
                             "module where the plain build put the weight (the rule reads 'no quant method' as "
                             "unquantized): " + ", ".join(d["absent_keeps"])))
    return cell


def _shipped_cell(rec: dict, notes: Notes) -> str:
    if rec.get("hand_table"):
        cell = "hand table"
    elif pt := rec.get("preset_table") or PRESET_TABLES.get(rec["arch"]):  # from a tiny preset's answers, its
        cell = f"`{pt['table']}` (from `{pt['preset']}`)"  # output proven by the engine tests on that preset
    else:
        cell = f"`{rec['shipped']}`" if rec.get("shipped") else ""
    if rec["arch"] in FINDINGS:
        cell = (cell + " " if cell else "not shipped: ") + notes.ref(rec["arch"], FINDINGS[rec["arch"]])
    return cell


def _release_is(family: str, release: str, preset: str) -> str:
    """The finding of a text-only class whose family's release is a multimodal one (proven as such)."""
    return (f"the text-only class of {family}, whose release is `{release}` (its config.json's architectures): "
            f"that architecture is the one proven, from preset `{preset}` laid out as the release, in both engines "
            f"and the numeric check, its derived table shipped (docs/families.md, \"{family}\"). A checkpoint of "
            "this class (the release's language model under the text model's names) is not written here")


#: why a row stops where it does, where the cells' own messages do not say it (a reading of the engines' code, the
#: commands that show it): kept here, not in the JSONL, so a re-run keeps it
FINDINGS = {
    "GraniteMoeHybridForCausalLM": (
        "the fixture is tests/presets/granitemoehybrid.toml (granite-4.0-h-tiny's config.json and names: Mamba-2 and "
        "attention layers by layer_types, the experts as the release's two 3-D BF16 banks "
        "block_sparse_moe.input_linear / output_linear, router.layer, shared_mlp, tied embeddings); both engines load "
        "it (the banks take each loader's bank branch). SGLang 0.5.23 loads no quantized checkpoint of it, whatever "
        "its names: its granitemoehybrid.py GraniteMoeHybridForCausalLM.load_weights calls "
        "quant_config.get_cache_scale, which ModelOptFp4Config does not have (\"AttributeError: 'ModelOptFp4Config' "
        "object has no attribute 'get_cache_scale' (at granitemoehybrid.py:656 in load_weights)\", on the first "
        "tensor), and its _load_quant_expert passes return_success=True to FusedMoE.weight_loader, which does not take "
        "it (the derivation's TypeError, on any per-expert name: also the compressed-tensors output's); the bank "
        "branch has no name for a weight_scale_2 / input_scale (NOT_SERVED_QUANTIZED: the derivation, pack and "
        "output check run in vLLM, whose reading decides): docs/families.md, \"Granite 4.0 hybrid\""),
    "Glm5NextForCausalLM": _release_is("GLM-5.3-Flash", "Glm5NextForConditionalGeneration", "tiny-glm5-next"),
    "Llama4ForCausalLM": (
        "the text-only class of Llama 4, whose releases (Llama-4-Scout / -Maverick) name "
        "`Llama4ForConditionalGeneration` in config.json: that row is the one proven in both engines, its derived "
        "table and overlay shipped (mappings/derived/llama4.toml, mappings/overlays/llama4.toml). This row's fixture "
        "is transformers' text model saved alone, whose fused expert banks (feed_forward.experts.gate_up_proj / "
        "down_proj) SGLang's Llama4ForCausalLM leaves unread (the fixture cell)"),
    "KimiK3LinearForCausalLM": (
        "the text-only class of Kimi K3 (SGLang 0.5.23 kimi_k3.py: \"Text-only K3 causal LM\"), whose release "
        "names `KimiK3ForConditionalGeneration`: that architecture has the hand table mappings/kimi_k3.toml, byte "
        "for byte as NVIDIA's converter and proven in both engines (README). vLLM 0.33 does not register this class"),
    "BailingMoEForCausalLM": (
        "SGLang 0.5.23's other spelling of BailingMoeForCausalLM (bailing_moe.py: BailingMoeForCausalLM subclasses "
        "BailingMoEForCausalLM with no change, both in EntryClass): the same engine class as the "
        "BailingMoeForCausalLM row, whose derived table (model_type bailing_moe) ships"),
    "Grok1ModelForCausalLM": (
        "SGLang 0.5.23 grok.py: \"An alias for backward-compatbility\" of Grok1ForCausalLM (a subclass with no "
        "change): the same engine class as the Grok1ForCausalLM row, whose derived table ships"),
    "Ernie4_5_ForCausalLM": (
        "the dense ERNIE 4.5 class SGLang 0.5.23 lists in its MoE model file's EntryClass (ernie4.py: "
        "[Ernie4_5_MoeForCausalLM, Ernie4_5_ForCausalLM]): no routed experts, so no MoE table; the MoE class's row "
        "is Ernie4_5_MoeForCausalLM"),
    "HunYuanDenseV1ForCausalLM": (
        "the dense Hunyuan class SGLang 0.5.23 lists in its MoE model file's EntryClass (hunyuan.py: "
        "[HunYuanMoEV1ForCausalLM, HunYuanDenseV1ForCausalLM]): no routed experts, so no MoE table; the MoE class's "
        "row is HunYuanMoEV1ForCausalLM"),
    "MiniMaxM3SparseForCausalLM": _release_is("MiniMax M3", "MiniMaxM3SparseForConditionalGeneration",
                                              "tiny-minimax-m3"),
    "Qwen4ExpForCausalLM": _release_is("Qwen3.8-Flash-Next", "Qwen4ExpForConditionalGeneration", "tiny-qwen4-exp"),
    "MistralLarge3ForCausalLM": (
        "Mistral's own layout (params.json, no transformers class): the derivation reads params.json as both "
        "engines read it (mistral_checkpoint.config_view, build_keys) and the engines give every rule the hand "
        "table mappings/mistral_large_3.toml had (removed in session 37): the groups, the router kept, the head "
        "`output` (loaded into lm_head by both: [[exclude]], [lm_head]) and [engine_names] from vLLM's "
        "MistralLarge3ForCausalLM.hf_to_vllm_mapper, whose regexes rename each weight but not the module name an "
        "exclude entry holds (vllm_runner.unmapped_renames). The same plan and bytes as the hand table under "
        "--layout source; under --layout vllm / sglang the hand table fused gate_up_proj on disk in Mistral's "
        "names, which neither engine loads, the derived table does not (docs/derive.md)"),
    "DbrxForCausalLM": (
        "not served by vLLM 0.33: DbrxMoE builds its experts with FusedMoEFactory, whose runner holds the expert "
        "parameters under experts.routed_experts (model_executor/layers/fused_moe/layer.py FusedMoEFactory), while "
        "DbrxModel.load_weights (models/dbrx.py) looks up experts.w13_weight: \"KeyError: "
        "'blocks.0.ffn.experts.w13_weight' (at dbrx.py:406 in load_weights)\" for any checkpoint. SGLang 0.5.23 "
        "loads one (all 17 parameters of a 2-layer fixture, once its attn_config / ffn_config hold the release's "
        "keys, not the ones transformers 5.20's save adds, which SGLang's DbrxFFNConfig refuses: \"Found unknown "
        "kwargs={'_name_or_path': '', 'output_attentions': False}\"). The release stores each layer's experts as "
        "three 2-D banks (ffn.experts.mlp.w1 / v1 / w2, experts x intermediate rows by hidden columns, w2 "
        "transposed), which no source encoding of this tool reads yet (make_fixture finds no routed experts in "
        "them: the fixture cell); and SGLang's DbrxExperts (models/dbrx.py) holds them as plain parameters (ws, w2s) "
        "whose weight_loader reshapes BF16 rows, with no quantized method: there they could only be kept"),
    "ExaoneMoeForCausalLM": (
        "vLLM 0.33 exaone_moe.py ExaoneMoeForCausalLM builds its ParallelLMHead with no prefix=, so ModelOpt's "
        "quant method is asked for the head with an empty prefix, which no exclude entry reaches (modelopt.py "
        "is_layer_excluded matches every entry as a substring of the prefix: an entry \"\" would exclude every "
        "layer), and it builds the head NVFP4: a BF16 lm_head.weight did not fit it (\"The size of tensor a (128) "
        "must match the size of tensor b (256) ... while loading lm_head.weight\"). The derived table says so "
        "([lm_head.unnamed] modelopt = [\"vllm\"], convert/derive/table.py _unnamed_heads) and the plan writes the "
        "head NVFP4 as vLLM builds it under ModelOpt in the source and vllm layouts (plan/decide.py head_rule); "
        "SGLang's exaone_moe.py names its head lm_head and, not excluded, builds it NVFP4 too: both read that "
        "output right. --layout sglang and --format compressed-tensors keep the head BF16; vLLM's "
        "compressed-tensors config does not quantize a ParallelLMHead its targets do not name, and both engines "
        "read the compressed-tensors output (BF16 head) right: the way to a BF16 head in both"),
    "HunYuanMoEV1ForCausalLM": (
        "SGLang 0.5.23 hunyuan.py HunYuanMoEV1ForCausalLM builds its ParallelLMHead with no prefix=: ModelOpt's "
        "quant method is asked with an empty prefix, no exclude entry names it, and it builds the head NVFP4, "
        "which a BF16 lm_head.weight did not fit (vocab_parallel_embedding.py:446). As ExaoneMoE in vLLM: "
        "[lm_head.unnamed] modelopt = [\"sglang\"], the head written NVFP4 in the source and sglang layouts"),
    "NemotronHForCausalLM": (
        "non-gated routed experts (relu2: up_proj, down_proj) form no w13 scale group; the expert_sets are now the "
        "banks the engines loaded per-expert modules into (table.py _banks), so the recipe's expert rule (NVFP4 with "
        "input_scale 1.0) reaches them and both engines' ModelOpt MoE fills w13_input_scale / w2_input_scale; [moe] "
        "reads the MoE layers off hybrid_override_pattern's 'E' (pattern / pattern_moe, the config string whose "
        "letter marks exactly the layers holding the bank). The overlay mappings/overlays/nemotron_h.toml keeps the "
        "mamba mixer's packed in_proj BF16: SGLang 0.5.23 left its weight_scale_2 (one per output) unfilled, as "
        "Qwen3-Next's in_proj_qkvz"),
    "LagunaForCausalLM": (
        "an engine fault: vLLM 0.33 laguna.py says the release stores the routing bias at "
        "mlp.experts.e_score_correction_bias (as the fixture does), but FusedMoEFactory registers it on RoutedExperts "
        "(mlp.experts.routed_experts.e_score_correction_bias), and MoERunner.load_weights hands every mlp.experts.* "
        "name to RoutedExperts.load_weights, which matches expert weights only: the parameter is left at its zeros "
        "whatever the checkpoint names it (vLLM serves the release so too: NOT_SERVED); SGLang loads it and reads the "
        "output right"),
    "Gemma4ForCausalLM": (
        "the fixture loads in both engines: the engine check counts the buffers each engine's loader fills by name "
        "(enginecheck/vllm_runner.py and sglang_runner.py loadable_buffers: vLLM's AutoWeightsLoader "
        "_add_loadable_non_param_tensors takes persistent buffers, SGLang's loaders every buffer), so the "
        "checkpoint's layer_scalar (a persistent buffer in vLLM gemma4.py and SGLang gemma4_causal.py) is stored, "
        "not skipped; the router's BF16 `scale` vector is no longer read as a DeepSeek V4 scale without its weight "
        "(encodings/deepseek_v4.py refuses a stray `scale` only in a scale dtype). The routed experts, fused 3-D banks "
        "(experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]), are split per expert by the expert_bank "
        "encoding (branch i38-banks, merged): both engines read the output right"),
    "LongcatFlashForCausalLM": (
        "SGLang: an engine fault. SGLang 0.5.23 longcat_flash.py LongcatFlashDecoderLayer reads "
        "`\"rope_theta\" in getattr(config, \"rope_parameters\", {})`, and its own config class "
        "(sglang/srt/configs/longcat_flash.py LongcatFlashConfig, under transformers 5.19) leaves rope_parameters None "
        "whatever config.json holds (checked: built from the fixture's config with and without a rope_parameters "
        "key, both None): TypeError before any weight. vLLM: the fixture's fault, fixed: transformers' "
        "LongcatFlashExperts allocates gate_up_proj for the zero (identity) experts too and its save wrote their "
        "gate_proj / up_proj, which the release does not store (vLLM longcat_flash.py get_expert_mapping maps "
        "n_routed_experts experts: KeyError on expert 8); scripts/make_fixture.py RELEASE_DROPS drops them. "
        "The fixture now is tests/presets/longcat_flash.toml (the "
        "release's config.json: num_layers, no num_hidden_layers, its MTP layer under model.mtp.*). config.json "
        "holds no MTP count: the [mtp] table counts the layers stored under model.mtp. (count_stored) and numbers "
        "vLLM's draft layer 2 * num_layers (first; longcat_flash_mtp.py mtp_start_layer_idx). The overlay "
        "mappings/overlays/longcat_flash.toml keeps the MTP layer as stored: LongCatFlashMTP.load_weights renames "
        "only .weight / .weight_scale_inv names (\"KeyError: 'model.mtp.layers.0.eh_proj.weight_scale'\" with it "
        "NVFP4); then vLLM's main model and its draft read the output right (docs/families.md, \"LongCat-Flash\")"),
    "LongcatFlashNgramForCausalLM": (
        "the fixture is tests/presets/longcat_flash_ngram.toml (LongCat-Flash-Lite's config.json: no model_type, so "
        "the table is named by kimi_convert.derive.TABLE_NAMES, longcat_flash_ngram; LongCat-Flash's layers plus 12 "
        "n-gram tables model.ngram_embeddings.embedders.N and their projections post_projs.N; the MTP layer under "
        "model.mtp.). The overlay mappings/overlays/longcat_flash_ngram.toml marks post_projs not linear (vLLM's "
        "NgramEmbedding.load_weight copies each, transposed, into one plain BF16 parameter: quantized, \"RuntimeError: "
        "The size of tensor a (32) must match the size of tensor b (16) ... longcat_flash_ngram.py:145 in "
        "load_weight\") and keeps the MTP layer as stored (LongCatFlashMTP.load_weights: \"KeyError: "
        "'model.mtp.layers.0.eh_proj.weight_scale'\"). SGLang 0.5.23 registers no entry class of the name but "
        "serves it as LongcatFlashForCausalLM (utils/hf_transformers/config.py renames the architecture); its main "
        "model fills every parameter from the BF16 release (checked with longcat_flash.py's should_async_load "
        "answering False, as the check does for DeepSeek) and loads no NVFP4 checkpoint of it "
        "(longcat_flash.py load_weights torch.cat of the q_a / kv_a weight_scale_2: \"RuntimeError: "
        "zero-dimensional tensor (at position 0) cannot be concatenated\", longcat_flash.py:1032): "
        "docs/families.md, \"LongCat-Flash-Lite\""),
    "MiMoV2FlashForCausalLM": (
        "the fixture is tests/presets/mimo_v2_flash.toml (the release's config.json, read through its own config class "
        "with --trust-remote-code: transformers 5.19's MiMoV2FlashConfig gave SGLang per-layer-type rope settings, a "
        "TypeError in get_rope; block FP8 weights, o_proj BF16 in ignored_layers, 3 MTP layers under "
        "model.mtp.layers.*). Both main models load it (the engine check knows their 'mtp' skip: "
        "enginecheck/*_runner.py mtp_rule); vLLM's draft builds the first MTP layer only (mimo_v2_mtp.py "
        "_MIMO_V2_FLASH_NUM_MTP_LAYERS = 1). SGLang 0.5.23's draft (mimo_v2_nextn.py MiMoV2MTP) does not read the "
        "release's MTP layer: it builds it under model.mtp_block.*, which the release's ignored_layers cannot name, so "
        "its BF16 o_proj meets an FP8 parameter (DRAFT_NOT_SERVED: the fixture check holds SGLang's main model "
        "alone). config.json holds no MTP count (both engines hard-code theirs): the [mtp] table counts the 3 stored "
        "layers (count_stored). The output's exclude list names each kept MTP module under each draft's own prefix, "
        "and both engines' main models and drafts read it right; SGLang's draft loads every stored MTP layer into "
        "its one layer, the last written staying (the numeric check names the weights it wrote over, not read) "
        "(docs/families.md, \"MiMo-V2-Flash\")"),
    "ZayaForCausalLM": (
        "the fixture is tests/presets/zaya.toml, laid out as the release (Zyphra/ZAYA1-8B-legacy's config.json, CCA "
        "attention and MoE half-layers, `self_attn.qkv.*`, per-expert `zaya_block.experts.local_experts.<i>."
        "linear_fc1` (gate and up rows in one tensor) / `linear_fc2`, all BF16). SGLang 0.5.23 zaya.py ZayaRouter "
        "builds router_states_scale on every MoE layer (zaya_use_eda) and its forward reads it only with a previous "
        "MoE layer's router state, which ZayaModel.forward never gives the first MoE layer; the release stores none "
        "there, and the engine check takes that parameter as engine-optional (enginecheck/sglang_runner.py "
        "optional_for). The overlay mappings/overlays/zaya.toml keeps the routed experts BF16 (zaya.py load_weights "
        "loads an expert's .weight only: every NVFP4 expert scale would be skipped) and names each bank for ModelOpt's "
        "and compressed-tensors' exclusion matching; the derivation gives no group (the derived table's own rules "
        "name experts .experts.N, not ZAYA's .experts.local_experts.N: nothing depends on it while they are kept). "
        "docs/families.md, \"ZAYA1\""),
    "InklingForConditionalGeneration": (
        "the fixture is tests/presets/inkling.toml (thinkingmachines/Inkling-Small's config.json: inkling_mm_model, "
        "text_config, the towers' configs, mtp_config; the release's own names model.llm.*, attn.wq_du / wk_dv / "
        "wv_dv / wr_du, mlp.w13_dn / w2_md, the routed and shared experts as 3-D BF16 banks with gate / up rows "
        "interleaved, the vision / audio towers, one MTP depth model.mtp.layers.0.*). Both engines read the layout as "
        "stored; the fixture check fails on two gaps of the engine check, not of the release: the 20 MTP tensors count "
        "as skipped (vLLM 0.33 nvidia/model.py _load_inkling_weights drops model.mtp.* on purpose, SGLang 0.5.23's "
        "main model has no parameter for them; enginecheck/*_runner.py mtp_rule does not know the model.mtp. block), "
        "and SGLang's InklingCausalLLM.__init__ compiles CUDA JIT kernels under the CPU stand-in "
        "(compile_inkling_attn_prologue: 'cannot find -lcudart'). With SGLANG_OPT_USE_INKLING_FUSED_ATTN_PROLOGUE=0 "
        "SGLANG_OPT_USE_INKLING_CUSTOM_AR=0 and no MTP layer both load it (78 of 78 parameters, none skipped). Past "
        "that, mapping derive stops: vLLM, the expert banks (no source encoding splits Inkling's interleaved w13 bank, "
        "and vLLM's InklingMoE.load_expert_weight reads experts only as banks); SGLang, KeyError "
        "'modelopt_quant_config' (models/inkling_common/quantization/config.py is_nvfp4 reads only Thinking Machines' "
        "own hf_quant_config.json layout). docs/families.md, Inkling"),
    "InklingForCausalLM": (
        "vLLM's text-only entry (models/inkling/nvidia/model.py: 'inkling_model checkpoints'); no public release names "
        "it (thinkingmachines/Inkling and Inkling-Small are InklingForConditionalGeneration, inkling_mm_model, whose "
        "row holds the release's preset, tests/presets/inkling.toml). This row's fixture is transformers 5's class, "
        "whose names are not the release's (vLLM reads model.llm.*, attn.wq_du / wk_dv / wv_dv / wr_du, "
        "mlp.w13_dn / w2_md): the fixture's fault, not the engine's"),
    "AXK1ForCausalLM": (
        "the fixture is tests/presets/axk1.toml: post_mlp_layernorm stored on every layer, dense layer 0 included "
        "(vLLM 0.33 AXK1.py AXK1DecoderLayer builds it on every layer; transformers' modeling_axk1.py holds it in "
        "AXK1MoE only, so its save left layer 0 without one). vLLM has no MTP draft for axk1 (config/speculative.py "
        "SpeculativeConfig.__post_init__: NotImplementedError 'Unsupported speculative method'), which verify-manifest "
        "reads as no draft (cli._draft_refused); the [mtp] table keeps the layer as stored"),
    "Step5ForCausalLM": (
        "the fixture is tests/presets/step5.toml (vLLM's own Step5Config: no remote code). The engine check's CPU "
        "stand-in answers torch.accelerator's device queries and drops pin_memory=True (runner_common.py), so vLLM "
        "loads the fixture. vLLM refuses to build the DSA layers' fused qkv_indexer_proj quantized ('cannot be "
        "quantized, but ... resolved to ModelOptLinearMethod'): the derivation's build runs again with it ignored "
        "(derive.build_ignoring_refused) and keeps its members, in every layer (no config key a table reads tells "
        "the full-attention layers apart: the sliding layers' q/k/v/g stay BF16 too); the routed experts, which the "
        "loader reads only as 3-D banks, are stacked NVFP4 banks ([stacked]; docs/families.md, Step 5)"),
    "IQuestQ1ForCausalLM": (
        "the fixture is tests/presets/iquest_q1.toml (IQuestQ1Config's keys with the release's values: SGLang's own "
        "config class, no remote code). SGLang 0.5.23 iquest_q1.py load_iquest_q1_weights reads the routed experts "
        "only as the BF16 banks mlp.experts.fc / mlp.experts.proj, stored without .weight, expert by expert (fc in "
        "two row parts, w1 and w3); any scale name raises 'Unexpected IQuest Q1 weight' (iquest_q1.py:732): the "
        "derived [stacked] keeps both banks BF16 as stored (keep = true), each MoE layer's mlp.experts in the "
        "exclude list, everything else the engine quantizes NVFP4 (the overlay mappings/overlays/iquest_q1.toml "
        "says why no quantized bank serves, and names the experts' .0.gate_proj / .0.up_proj / .0.down_proj that "
        "compressed-tensors' get_moe_scheme probes). An NVFP4 bank would need a later SGLang (docs/families.md, "
        "IQuest-Q1)"),
    "K2HorizonForCausalLM": (
        "the fixture is tests/presets/k2_horizon.toml (the MoVA release's config.json, its own config class through "
        "auto_map). SGLang 0.5.23 is release not served (NOT_SERVED): its config check wants a server flag, and "
        "past it, it builds no quantized MoVA model. vLLM: the overlay mappings/overlays/k2_horizon.toml keeps the "
        "value experts BF16 (K2HorizonModel.load_weights chunks their scales; compute_mova_v_sparse feeds their "
        ".weight to an unquantized kernel)"),
    "BailingMoeV2ForCausalLM": (
        "the fixture is tests/presets/bailing_moe_v2.toml (transformers 5.20 has no class): the release's config.json "
        "(model_type bailing_moe_v2, auto_map to its own configuration_bailing_moe_v2.py, which the preset writes). "
        "Neither engine nor transformers registers a config class for bailing_moe_v2 (vLLM 0.33 "
        "transformers_utils/config.py _CONFIG_REGISTRY has bailing_moe_v3_vl only; SGLang 0.5.23 "
        "configs/bailing_moe_v2.py BailingMoeV2Config is the text part of its Ming BailingMM2Config, not registered): "
        "both read the config only through the release's code, so every engine step here runs with "
        "--trust-remote-code (TRUST_REMOTE_CODE), as a deployment of the release does; without it both refuse (\"The "
        "repository ... contains custom code which must be executed\"). The overlay "
        "mappings/overlays/bailing_moe_v2.toml keeps the fused-on-disk attention.query_key_value BF16: SGLang 0.5.23 "
        "filled 1 of the 3 slots of its NVFP4 weight_scale_2. With the release's MTP layer stored "
        "(tiny-bailing-moe-v2-mtp, model.layers.2.*), vLLM 0.33 refuses the checkpoint: bailing_moe.py BailingMoeModel "
        "builds num_hidden_layers layers and its AutoWeightsLoader has no rule skipping the MTP layer (\"There is no "
        "module or parameter named 'layers.2' in BailingMoeModel\"); SGLang's main model drops it by its own rule"),
    "BailingMoeV2_5ForCausalLM": (
        "the fixture is tests/presets/bailing_moe_v2_5.toml (transformers 5.20 has no class): the release's "
        "config.json (model_type bailing_hybrid, auto_map to its own configuration_bailing_moe_v2_5.py, which the "
        "preset writes), layer_group_size 8 as released (layers 0-6 Lightning linear attention, layer 7 MLA with a "
        "query LoRA). vLLM 0.33 registers no config class for bailing_hybrid (nor does transformers 5.20), so its "
        "steps run with --trust-remote-code (TRUST_REMOTE_CODE); SGLang 0.5.23 reads it through its own "
        "configs/bailing_hybrid.py BailingHybridConfig. The overlay mappings/overlays/bailing_hybrid.toml keeps the "
        "linear layers' fused-on-disk attention.query_key_value BF16 (SGLang filled 1 of the 3 slots of its NVFP4 "
        "weight_scale_2: 7 unfilled) and the MLA's q_a_proj / kv_a_proj_with_mqa (SGLang's load_weights torch.cat's "
        "the pair with their scales: \"zero-dimensional tensor (at position 0) cannot be concatenated\"), and adds "
        "vLLM's names (self_attn.query_key_value, self_attn.fused_qkv_a_proj) to the exclude list as [engine_names]. "
        "The table is named for the model_type (derived-bailing_hybrid), which Ling 3.0 (BailingMoeV3ForCausalLM) "
        "shares. With the release's MTP layer stored (tiny-bailing-moe-v2-5-mtp, model.layers.8.*) both main models "
        "drop it and vLLM's draft BailingMoeV25MTPModel loads it whole; SGLang's draft BailingMoeForCausalLMNextN "
        "leaves model.word_embeddings.weight unfilled, as for Ling 2.0"),
    "AfmoeForCausalLM": (
        "vLLM 0.33 afmoe.py builds its ParallelLMHead with no prefix= (as exaone_moe.py): the derived table says so "
        "([lm_head.unnamed] modelopt = [\"vllm\"]) and the head is written NVFP4, as vLLM builds it (SGLang's "
        "afmoe.py names it lm_head and builds it NVFP4 too). SGLang: its afmoe.py AfmoeMoE.pack_params makes every "
        "expert's gate_up_proj / down_proj a view of one flat buffer; the engine check attributed each write to "
        "every parameter of that storage (expert 1's gate_proj seen 'past' expert 0's gate_up_proj: 168 rows); it "
        "now places a write in the parameters whose bytes it overlaps (runner_common.py Tracker._landed): SGLang "
        "reads the experts right"),
}


def _file(path: str | None) -> str:
    """A model file as the table shows it: its name, or its package's (``vllm/models/deepseek_v4/``)."""
    if not path:
        return "-"
    head, _, name = path.rpartition("/")
    return f"`{head.rpartition('/')[2]}/`" if name == "__init__.py" else f"`{name}`"


def render(results: dict[str, dict], names: list[str]) -> str:
    notes = Notes()
    rows = []
    for n in names:
        rec = results[n]
        pack = rec.get("pack")
        out_cells = [_engine_cell(rec, "output_check", e, "read_right", notes) for e in ENGINES]
        if pack is not None and not pack["ok"]:
            out_cells = ["pack failed " + notes.ref(n, pack["why"])] * 2
        rows.append([f"`{n}`", f"{_file(rec.get('vllm'))} / {_file(rec.get('sglang'))}",
                     _fixture_cell(rec, notes),
                     " / ".join(_fixture_check_cell(rec, e, notes) for e in ENGINES),
                     _derive_cell(rec, notes), " / ".join(out_cells), _shipped_cell(rec, notes)])
    head = ["Architecture", "vLLM / SGLang model file", "Fixture (transformers model type, layers)",
            "Fixture loads: vLLM / SGLang", "Derived table",
            "Output loads and read right: vLLM / SGLang", "Table shipped"]
    lines = [HEADER, "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", "## Notes (each step's or engine's own message)", ""]
    lines += [f"<a id=\"n{i}\"></a>{i}. {t}" for i, t in enumerate(notes.items, 1)]
    return "\n".join(lines) + "\n"


HEADER = """# MoE text architectures of vLLM 0.33.0 and SGLang 0.5.23: derived tables

Generated by `python scripts/derive_breadth.py` (issue 38, item 4) from `docs/derived-architectures.jsonl`; do not
edit by hand (`--table-only` rewrites it from the JSONL). The architectures: every entry of vLLM's
`_TEXT_GENERATION_MODELS` (`vllm/model_executor/models/registry.py`) whose model code builds routed experts
(`FusedMoE`), then every SGLang `EntryClass` (`sglang/srt/models/*.py`) with MoE code that vLLM does not register
(drafts, MTP heads and vision models left out). Per architecture:

- **Fixture**: `scripts/make_fixture.py` in the vLLM environment's python builds transformers' own class for the
  architecture from its config class's defaults shrunk by key name (widths, heads, experts, vocab; the layer count
  the shortest prefix that holds every distinct layer), random BF16 weights, `save_pretrained`: the checkpoint
  naming transformers writes (per-expert tensors, as the releases). Where transformers has no class for the
  architecture, a source preset laid out as the release (`PRESET_FIXTURES`: `kimi-convert synth FILE.toml:NAME`,
  docs/presets.md; the cell names the preset).
- **Fixture loads**: `kimi-convert verify-manifest FIXTURE --no-numerics --engine vllm --engine sglang`: the
  engine's own loader fills every parameter from the fixture, none skipped. (Rows run before that step dropped
  its numeric check were checked with `--input FIXTURE`: where the engine's read of the BF16 fixture was not its
  weights, the cell's note gives the check's finding.)
- **Derived**: `kimi-convert mapping derive FIXTURE` (docs/derive.md); the note lists its groups, scale groups and
  keeps.
- **Output**: `kimi-convert pack FIXTURE OUT --mapping DERIVED` (default recipe `nvfp4-w4a16`, ModelOpt, source
  layout; the derived table merged with its hand overlay `mappings/overlays/MODEL_TYPE.toml` where one exists, as
  `plan` merges it), then `verify-manifest OUT --input FIXTURE --engine vllm --engine sglang`: every parameter
  filled and every layer read within its format's bound (the numeric check).
- **Table shipped**: the derived table in `mappings/derived/` (what `plan` / `pack` use with no engine environment:
  `convert/derive/lookup.py`) where both engines that register the architecture read the output right; "hand
  table" where a table in `mappings/` already names it (it wins over a derived one). An engine whose own loader or
  config code fails on the release's layout (`NOT_SERVED` in the script, each with its evidence in
  `docs/families.md`) is "release not served", one whose loader takes the release but no quantized checkpoint of it
  in any output format (`NOT_SERVED_QUANTIZED`) "quantized not served": the steps after the fixture check run in the
  other engine, whose reading decides.
"""


def shippable(rec: dict) -> bool:
    """Every registering engine read the output right, but one :func:`not_served` leaves out (at least one engine
    read it right)."""
    out, left = rec.get("output_check") or {}, not_served(rec["arch"], rec.get("fixture_check") or {})
    regs = [e for e in ENGINES if rec.get(e) and e not in left]
    return (not rec.get("hand_table") and rec["arch"] not in PRESET_TABLES and bool(regs)
            and all(out.get(e, {}).get("read_right") for e in regs)
            and not rec.get("derive", {}).get("absent_keeps"))


def ship(rec: dict, work: Path) -> str | None:
    """The verified derived table into mappings/derived/NAME.toml (NAME: the table's name less ``derived-``, the
    model_type unless ``kimi_convert.derive.TABLE_NAMES`` names it), its answers into tests/derived/breadth/. A table
    shipped there for another architecture is not overwritten (two architectures of one model_type: name one in
    ``TABLE_NAMES``)."""
    if not shippable(rec):
        return None
    name = tomllib.loads((work / "derived.toml").read_text())["name"].removeprefix("derived-")
    dest = REPO / "mappings" / "derived" / f"{name}.toml"
    if dest.is_file() and tomllib.loads(dest.read_text()).get("architectures") != [rec["arch"]]:
        print(f"  not shipped: {dest.relative_to(REPO)} is another architecture's table (name {rec['arch']}'s "
              "apart in kimi_convert.derive.TABLE_NAMES)", file=sys.stderr, flush=True)
        return None
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(work / "derived.toml", dest)
    answers = REPO / "tests" / "derived" / "breadth" / f"{rec['arch']}.answers.json"
    answers.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(work / "answers.json", answers)
    return str(dest.relative_to(REPO))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("archs", nargs="*")
    ap.add_argument("--work", default="/tmp/i38b/breadth")
    ap.add_argument("--servers", default=os.environ.get("KIMI_CONVERT_ENGINE_SERVERS", "/tmp/i38b-servers"))
    ap.add_argument("--redo", action="store_true", help="run the named architectures again")
    ap.add_argument("--ship", action="store_true")
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--fixtures-only", action="store_true", help="step 1 only (no engine): the fixtures, cached")
    ap.add_argument("--hold-s", type=float, default=600.0, help="give the engine lock back after this long")
    a = ap.parse_args(argv)
    results = load_results()
    if a.table_only:
        save_results(results, list(results))
        return 0
    archs = architectures()
    if a.list:
        for x in archs:
            print(x.name, x.vllm, x.sglang, x.same_as or "")
        return 0
    order = [x.name for x in archs]
    for x in archs:
        results.setdefault(x.name, {**base_record(x), "why_not_run": "not reached by the batch yet"})
    todo = [x for x in archs if (not a.archs or x.name in a.archs)
            and (a.redo or not finished(results[x.name]))]
    if a.fixtures_only:
        for x in todo:
            if not x.same_as:
                f = make_fixture(x, work_for(Path(a.work), x))
                print(x.name, json.dumps({k: f.get(k) for k in ("ok", "why", "model_type", "layers", "layers_full",
                                                                "tensors", "bytes", "expert_3d_count")}), flush=True)
        return 0
    env, hold = engine_env(a.servers), {"max_s": a.hold_s}
    try:
        for x in todo:
            print(f"{time.strftime('%H:%M:%S')} {x.name}", flush=True)
            work = work_for(Path(a.work), x)
            rec = process(x, work, env, hold)
            if a.ship and "output_check" in rec:
                rec["shipped"] = ship(rec, work)
            # another run of this script may have written rows meanwhile (one per architecture): theirs are kept
            results = {**load_results(), x.name: rec}
            save_results(results, order)
            print(f"  {summary(rec)}", flush=True)
    finally:
        release(hold)
    return 0


def summary(rec: dict) -> str:
    steps = [k for k in ("fixture", "fixture_check", "derive", "pack", "output_check", "shipped") if rec.get(k)]
    return f"{rec['arch']}: reached {steps[-1] if steps else 'nothing'} ({rec.get('seconds', 0)} s)"


if __name__ == "__main__":
    sys.exit(main())
