"""Llama 4's release class (``Llama4ForConditionalGeneration``: Scout, Maverick) planned with the shipped derived
table and its overlay, no hand table: the transposed expert banks leave NVFP4 expert by expert, the language model's
attention q/k/v stay BF16 (``mappings/overlays/llama4.toml``: SGLang 0.5.23's permute cannot take an NVFP4 q/k), and
the router, the vision tower and the projector stay BF16 (both engines build them unquantized)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from helpers import plan_kinds
from kimi_convert.derive import load_answers
from kimi_convert.plan import KEEP, NVFP4

ROOT = Path(__file__).resolve().parent.parent
ANSWERS = ROOT / "tests" / "derived" / "breadth" / "Llama4ForConditionalGeneration.answers.json"


def _release_layout(shapes: dict[str, list[int]], experts: int) -> dict[str, list[int]]:
    """The release's tensors for the derivation's logical ones: each layer's per-expert gate / up / down as the two
    transposed banks ``experts.gate_up_proj`` [E, H, 2I] and ``experts.down_proj`` [E, I, H] (no ``.weight``)."""
    out = {n: s for n, s in shapes.items() if ".experts." not in n}
    for n, (h, i) in ((n, s) for n, s in shapes.items() if n.endswith(".experts.0.down_proj.weight")):
        bank = n.removesuffix(".0.down_proj.weight")
        out[f"{bank}.gate_up_proj"] = [experts, h, 2 * i]
        out[f"{bank}.down_proj"] = [experts, i, h]
    return out


def write_release(folder: Path) -> Path:
    """The derivation's Llama 4 laid out as the release (transposed banks), seeded BF16, in one file."""
    _, config, shapes = load_answers(ANSWERS)
    folder.mkdir(parents=True, exist_ok=True)
    layout = _release_layout(shapes, config["text_config"]["num_local_experts"])
    g = torch.Generator().manual_seed(0)
    save_file({n: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for n, s in sorted(layout.items())},
              str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    return write_release(tmp_path_factory.mktemp("llama4"))


def test_the_release_plans_its_banks_nvfp4_and_keeps_what_the_engines_read_unquantized(release):
    kinds = plan_kinds(release)
    experts = {n: k for n, k in kinds.items() if ".feed_forward.experts." in n}
    assert len(experts) == 4 * 8 * 3 and set(experts.values()) == {NVFP4}, sorted(experts)[:4]
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert kinds[f"language_model.model.layers.2.self_attn.{proj}"] == KEEP
    assert kinds["language_model.model.layers.2.self_attn.o_proj"] == NVFP4
    assert kinds["language_model.model.layers.0.feed_forward.shared_expert.gate_proj"] == NVFP4
    assert kinds["language_model.model.layers.0.feed_forward.router"] == KEEP
    vision = {n: k for n, k in kinds.items() if n.startswith(("vision_model.", "multi_modal_projector."))}
    assert vision and NVFP4 not in vision.values()
