"""Expert banks (convert/plan/banks.py): ``plan`` plans each bank of alike routed experts once and prints
the outline; the plan made that way must be the plan made module by module (the same text, exclude list,
warnings, notes, totals and shard sizes, and once asked for, the same modules: the same ``plan --json``),
and an expert that is not like the others of its layer must be left out of the bank.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_plan_scale import CASES, _input, plan_options

from helpers import rewrite_tensors, run, write_synth

LAYER1 = "language_model.model.layers.1.block_sparse_moe.experts"


def _plans(ck: Path, args: list[str]):
    from kimi_convert.pack import load_plan

    opts = plan_options(ck, args)
    return load_plan(ck, opts, banked=True)[1], load_plan(ck, opts)[1]


def _assert_same(banked, full, where: str) -> None:
    """The banked plan is the module-by-module plan, in all that ``plan`` prints and all that it holds."""
    from kimi_convert.plan.render import render as render_plan
    from kimi_convert.plan.serialize import plan_json, plan_sha256

    assert render_plan(banked, where) == render_plan(full, where)
    if banked.outline.banks:  # the outline alone: no per-module objects made for the text
        assert "_modules" not in banked.__dict__
        _assert_expanded(banked, full)
    ob, of = banked.outline, full.outline
    assert (ob.kinds, ob.bytes_in, ob.bytes_out, ob.shards) == (of.kinds, of.bytes_in, of.bytes_out, of.shards)
    assert (banked.exclude_modules, banked.warnings, banked.notes) == (full.exclude_modules, full.warnings, full.notes)
    # plan --json and the plan's hash go shard by shard: a banked plan's expanded from its outline
    assert "".join(plan_json(banked)) == "".join(plan_json(full))
    assert plan_sha256(banked) == plan_sha256(full)
    assert bool(banked.outline.banks) != ("_modules" in banked.__dict__)
    assert [s.size for s in banked.shards] == [s.size for s in full.shards]  # made now, on first use


def _assert_expanded(banked, full) -> None:
    """Each output shard's part expanded from the outline (issue 43) is that shard's part of the whole plan:
    its units (names, sources and their byte offsets, decisions, shared scales) and its placements; so are the
    engine packed modules, the shards' sizes and the totals; and the whole plan is never made for it."""
    assert banked.expansion is not None
    got, want = list(banked.shard_parts()), list(full.shard_parts())
    assert [p.shard.file for p in got] == [p.shard.file for p in want]
    for g, w in zip(got, want, strict=True):
        assert g.units == w.units, g.shard.file
        assert g.shard == w.shard, g.shard.file
    assert banked.every_engine_group() == full.engine_groups
    assert banked.shard_sizes() == full.shard_sizes() == banked.outline.shard_sizes
    assert (banked.bytes_in, banked.bytes_out) == (full.bytes_in, full.bytes_out)
    assert "_modules" not in banked.__dict__


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("banks-in")


@pytest.mark.parametrize("case,preset,over,args", CASES, ids=[c[0] for c in CASES])
def test_banked_plan_is_the_module_by_module_plan(case, preset, over, args, inputs):
    ck = _input(inputs, preset, over)
    banked, full = _plans(ck, args)
    layout = args[args.index("--layout") + 1] if "--layout" in args else "source"
    # a glob with a number between dots may name expert indices (a layer's number cannot be told from one)
    telling = any(re.search(r"\.[0-9]", a) for a in args)
    assert bool(banked.outline.banks) == (layout == "source" and not telling), case
    _assert_same(banked, full, str(ck))
    r = run("plan", ck, *args)  # the command prints the banked plan
    assert r.code == 0, r.stderr
    from kimi_convert.plan.render import render as render_plan
    assert r.stdout == render_plan(full, str(ck)) + "\n"


def _experts_of(plan, prefix: str = LAYER1) -> dict[str, tuple[int, ...]]:
    return {k: v for k, v in plan.outline.banks.items() if k.startswith(prefix + ".")}


@pytest.fixture(scope="module")
def tiny_k3(tmp_path_factory) -> Path:
    return write_synth("tiny-k3", tmp_path_factory.mktemp("banks") / "tiny-k3", seed=0)


def _edited(src: Path, dst: Path, fn) -> Path:
    shutil.copytree(src, dst)
    rewrite_tensors(dst, fn)
    return dst


def _extra_tensor(t: dict) -> None:
    if f"{LAYER1}.3.w2.weight_packed" in t:
        t[f"{LAYER1}.3.w2.bias"] = torch.zeros(64, dtype=torch.bfloat16)


def _fewer_rows(t: dict) -> None:
    for suffix in ("weight_packed", "weight_scale"):
        name = f"{LAYER1}.3.w2.{suffix}"
        if name in t:
            t[name] = t[name][: t[name].shape[0] // 2].clone()


@pytest.mark.parametrize("edit", [_extra_tensor, _fewer_rows], ids=["extra-tensor", "other-shape"])
def test_an_expert_unlike_its_layer_is_left_out_of_the_bank(edit, tiny_k3, tmp_path):
    ck = _edited(tiny_k3, tmp_path / "ck", edit)
    banked, full = _plans(ck, [])
    banks = _experts_of(banked)
    assert banks and all(3 not in v for v in banks.values())  # the others still banked
    assert sorted(e for v in banks.values() for e in v) == [0, 1, 2, 4, 5, 6, 7]
    _assert_same(banked, full, str(ck))


def test_an_expert_of_another_dtype_is_left_out_of_the_bank(tmp_path):
    ck = write_synth("tiny-kimi-linear", tmp_path / "kl", seed=0)
    prefix = "model.layers.1.block_sparse_moe.experts"
    name = f"{prefix}.3.w1.weight"

    def to_f32(t: dict) -> None:
        if name in t:
            t[name] = t[name].float()
    rewrite_tensors(ck, to_f32)
    banked, full = _plans(ck, [])
    banks = _experts_of(banked, prefix)
    assert banks and all(3 not in v for v in banks.values())
    _assert_same(banked, full, str(ck))


def test_an_expert_in_another_file_is_its_own_bank(tiny_k3, tmp_path):
    ck = shutil.copytree(tiny_k3, tmp_path / "ck")
    index = json.loads((ck / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    shards = {f: load_file(str(ck / f)) for f in files}
    home = index["weight_map"][f"{LAYER1}.3.w1.weight_packed"]
    other = next(f for f in files if f != home)
    for n in [n for n in shards[home] if n.startswith(f"{LAYER1}.3.") or n.startswith(f"{LAYER1}.5.")]:
        shards[other][n] = shards[home].pop(n)
    for f, t in shards.items():
        save_file(t, str(ck / f), metadata={"format": "pt"})
    index["weight_map"] = {n: f for f, t in shards.items() for n in t}
    (ck / "model.safetensors.index.json").write_text(json.dumps(index))
    banked, full = _plans(ck, [])
    groups = sorted(_experts_of(banked).values())
    assert groups == [(0, 1, 2, 4, 6, 7), (3, 5)]  # a bank per file
    _assert_same(banked, full, str(ck))


def test_experts_stored_in_another_order_per_tensor_are_not_banked(tiny_k3):
    """Expert 3's w2 stored after expert 4's (their w1 the other way round): the layer's units would not
    come in one order, so that family is planned module by module."""
    from kimi_convert.checkpoint import open_checkpoint
    from kimi_convert.mapping import find_mapping
    from kimi_convert.options import Options
    from kimi_convert.plan import make_plan

    ckpt = open_checkpoint(tiny_k3)
    a, b = (ckpt.tensors[f"{LAYER1}.{e}.w2.weight_packed"] for e in (3, 4))
    assert a.nbytes == b.nbytes and a.file == b.file
    swapped = {a.name: a._replace(start=b.start, end=b.end), b.name: b._replace(start=a.start, end=a.end)}
    ckpt = dataclasses.replace(ckpt, tensors={**ckpt.tensors, **swapped})  # (the table as read is not for writing)
    m, opts = find_mapping(ckpt.config), Options()
    banked, full = make_plan(ckpt, m, opts, banked=True), make_plan(ckpt, m, opts)
    assert not _experts_of(banked) and _experts_of(banked, "language_model.model.layers.2.block_sparse_moe.experts")
    _assert_same(banked, full, "x")


def test_a_glob_naming_an_expert_index_banks_nothing(tiny_k3):
    banked, full = _plans(tiny_k3, ["--exclude", "*.experts.3.w2", "--keep-partial"])
    assert not banked.outline.banks
    _assert_same(banked, full, str(tiny_k3))
