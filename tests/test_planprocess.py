"""A large input's table and plan made in a child process (issue 43, ``convert/planprocess.py``): the same bytes as
the plan made in the pack's own process, a bad input refused there as here (one line, exit 2, nothing that looks
finished), and only an input whose index is large enough planned apart.
"""

from __future__ import annotations

import json
import shutil

from helpers import ONE_STREAM, one_line_error, run_process, tree


def test_a_plan_made_apart_writes_the_same_bytes(banked_k3, tmp_path, monkeypatch):
    from kimi_convert import planprocess
    from kimi_convert.options import Options
    from kimi_convert.pack import pack
    from kimi_convert.tuning import Tuning

    src, ref = banked_k3
    apart, made = planprocess.load_plan_apart, []

    def spy(source, opts, load):
        ckpt, plan = apart(source, opts, load)
        made.append((source, ckpt, plan))
        return ckpt, plan

    monkeypatch.setattr(planprocess, "load_plan_apart", spy)
    r = pack(src, tmp_path / "out", Options(), device="cpu", workers=1, streams=1, progress=False,
             tuning=Tuning(plan_apart=0, wave_units=1))
    assert tree(tmp_path / "out") == tree(ref)
    [(source, ckpt, plan)] = made
    assert ckpt.source is source and r.plan is plan  # this process's source, the child's plan
    assert plan.expansion is not None and not ckpt.tensors.loaded  # the pack never read the table it left there
    assert len(ckpt.tensors) == len(json.loads((src / "model.safetensors.index.json").read_text())["weight_map"])


def test_the_table_left_in_the_child_is_read_again_when_asked_for(banked_k3):
    """The module-by-module plan of a banked plan made apart (``plan.units``: made only when asked for) reads the
    table again from this process's source: the same units as the plan made here."""
    from kimi_convert import planprocess
    from kimi_convert.options import Options
    from kimi_convert.pack import load_plan
    from kimi_convert.sources import open_source

    src, _ = banked_k3
    ckpt, apart = planprocess.load_plan_apart(open_source(src), Options(), load_plan)
    assert not ckpt.tensors.loaded
    _, here = load_plan(src, Options(), banked=True)
    assert apart.units == here.units and ckpt.tensors.loaded
    assert dict(ckpt.tensors) == dict(load_plan(src, Options())[0].tensors)


def test_a_bad_input_is_refused_by_the_child_as_here(banked_k3, tmp_path):
    src, _ = banked_k3
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    gone = sorted(index["weight_map"])[5]
    del index["weight_map"][gone]
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    errors = []
    for apart in ("0", str(1 << 40)):
        out = tmp_path / f"out{apart}"
        r = run_process("pack", bad, out, *ONE_STREAM, env={"KIMI_CONVERT_PLAN_APART": apart})
        errors.append(one_line_error(r))
        assert not (out / "manifest.json").exists()
    assert errors[0] == errors[1] and gone in errors[0], errors


def test_only_a_large_index_is_planned_apart(banked_k3, tmp_path):
    from kimi_convert import planprocess
    from kimi_convert.sources import open_source
    from kimi_convert.tuning import Tuning

    src, _ = banked_k3
    size = (src / "model.safetensors.index.json").stat().st_size
    source = open_source(src)
    assert planprocess.worth_it(source, size) and not planprocess.worth_it(source, size + 1)
    assert not planprocess.worth_it(source, Tuning().plan_apart)  # a tiny input: planned here
    one = tmp_path / "one"
    one.mkdir()
    (one / "config.json").write_bytes((src / "config.json").read_bytes())
    (one / "model.safetensors").write_bytes(b"")
    assert not planprocess.worth_it(open_source(one), 0)  # no index: never
