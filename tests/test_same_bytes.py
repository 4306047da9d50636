"""Structural changes keep the output bytes: a pack of each synth preset with the code of
``BEFORE`` (the last commit before the one-home-per-concept restructuring, issue 13) and with
the code here give the same files, byte for byte, except the manifest: its format changed by
design (issue 14: format_version 3, the module records moved from manifest.json to one JSON Lines
file per shard under ``manifest-records/``), so it is compared by content: the same entries, the
same module records (in another order: grouped by shard).

The "before" is not a stored expected output: it is the earlier code itself, taken from git and run
from a temporary folder laid out as the installed package is (convert/ -> kimi_convert, ...). Skipped
where the checkout has no git history to take it from.

``BEFORE_22`` is the commit before issue 22's restructuring (one home for the output format, the source
encodings and the input source): every preset under each recipe and layout, every file compared, the
manifest and its records included (scripts/same_bytes.sh does the same with two installed versions).

Since format_version 4 the records give each tensor its BLAKE3 where the earlier code wrote its sha256
(docs/output-format.md): the output here is first rewritten as format_version 3 (``helpers.as_format_3``:
each BLAKE3 checked against the tensor's bytes, then replaced by their sha256), so every shard is still
compared byte for byte, every records file too, and manifest.json by content."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from io import BytesIO
from pathlib import Path

import pytest

from helpers import as_format_3, manifest_with_modules, spec

ROOT = Path(__file__).parents[1]
BEFORE = "6e2401f"  # main after issue 12, before issue 13's moves
BEFORE_22 = "5052871"  # main before issue 22 (formats/, encodings/, the Source protocol)
CASES = {
    "tiny-k3": [],
    "tiny-kimi-linear": [],
    "tiny-deepseek-fp8": [],
    "tiny-k3-sglang": ["--layout", "sglang", "--recipe", "nvfp4-w4a16", "--max-shard-size", "1MB"],
}


def _old_package(dest: Path, commit: str = BEFORE) -> Path | None:
    """The package as of ``commit``, laid out as installed by that commit's own pyproject ``package-dir`` (the
    kernels moved to ``kernels/src`` and the presets joined since ``BEFORE``), in ``dest``; None without that
    history."""
    import tomllib
    if shutil.which("git") is None:
        return None
    show = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:pyproject.toml"], capture_output=True)
    if show.returncode:
        return None
    dirs = tomllib.loads(show.stdout.decode())["tool"]["setuptools"]["package-dir"]
    dirs = sorted(((src, name.replace(".", "/")) for name, src in dirs.items()), key=lambda d: -len(d[0]))
    r = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", commit, *(src for src, _ in dirs)],
                       capture_output=True)
    if r.returncode:
        return None
    with tarfile.open(fileobj=BytesIO(r.stdout)) as tar:
        for m in (m for m in tar.getmembers() if m.isfile()):
            src, pkg = next(d for d in dirs if m.name.startswith(d[0] + "/"))
            out = dest / pkg / m.name[len(src) + 1:]
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(tar.extractfile(m).read())
    return dest


def _outcome(pythonpath: Path | None, *args) -> tuple[int, str]:
    """``kimi-convert ARGS`` with the code at ``pythonpath`` (None: this checkout's): its exit status and its
    output, or its stderr where it failed."""
    env = {**os.environ, "TQDM_DISABLE": "1", **({"PYTHONPATH": str(pythonpath)} if pythonpath else {})}
    r = subprocess.run([sys.executable, "-m", "kimi_convert.cli", *map(str, args)], capture_output=True, text=True,
                       env=env, cwd=pythonpath or ROOT, timeout=600)
    return r.returncode, r.stdout if not r.returncode else r.stderr


def _run(pythonpath: Path | None, *args) -> None:
    code, text = _outcome(pythonpath, *args)
    assert code == 0, text


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_every_preset_packs_to_the_same_bytes_as_before_the_restructuring(tmp_path):
    old = _old_package(tmp_path / "old")
    if old is None:
        pytest.skip(f"no git history with commit {BEFORE} to take the earlier code from")
    for case, opts in CASES.items():
        preset = case.removesuffix("-sglang")
        src = tmp_path / "in" / preset
        if not src.exists():
            _run(None, "synth", spec(preset), src)
        _run(old, "pack", src, tmp_path / "before" / case, "--device", "cpu", "-q", *opts)
        _run(None, "pack", src, tmp_path / "after" / case, "--device", "cpu", "-q", *opts)
        as_format_3(tmp_path / "after" / case, src)
        before, after = _files(tmp_path / "before" / case), _files(tmp_path / "after" / case)
        records = sorted(f for f in after if f.startswith("manifest-records/"))
        assert records and sorted(before) == sorted(f for f in after if f not in records), case
        changed = [f for f in before if f != "manifest.json" and before[f] != after[f]]
        assert changed == [], f"{case}: {changed}"
        assert _mapping_text_out(_as_v2(tmp_path / "after" / case)) == _mapping_text_out(
            _sorted_modules(json.loads(before["manifest.json"]))), case


def _mapping_text_out(d: dict) -> dict:
    """Without the mapping table's and the recipe's own text and hashes (and the plan hash over them): the
    tables gained fields since BEFORE on purpose (issue 26: the rules for members an engine fuses) and a recipe
    comment was corrected (issue 22), which the manifest quotes; everything the tables decide is compared."""
    d = {k: v for k, v in d.items() if k not in ("mapping_source", "mapping_table", "recipe_source", "plan_sha256")}
    for key in ("mapping", "recipe"):
        if isinstance(d.get(key), dict):
            d[key] = {k: v for k, v in d[key].items() if k != "sha256"}
    return d


def _sorted_modules(man: dict) -> dict:
    man["modules"] = sorted(man["modules"], key=lambda m: m["name"])
    return man


def _as_v2(folder: Path) -> dict:
    """A format_version 3 manifest as version 2 held it: the records files' lines as ``modules``."""
    man = manifest_with_modules(folder)
    assert man.pop("format_version") == 3 and man.pop("records")
    return _sorted_modules({**man, "format_version": 2})


@pytest.mark.slow
def test_plan_json_is_the_same_as_before_the_restructuring(tmp_path):
    """The plan's fast paths (decisions per expert template, templated JSON) print what the earlier
    code printed, on every case of test_plan_scale (expert banks, exclusions, layouts, a sparse K3)."""
    from test_plan_scale import CASES, _input
    old = _old_package(tmp_path / "old")
    if old is None:
        pytest.skip(f"no git history with commit {BEFORE} to take the earlier code from")
    for case, preset, over, args in CASES:
        (tmp_path / "in").mkdir(exist_ok=True)
        ck = _input(tmp_path / "in", preset, over)
        outs = []
        for pythonpath in (old, None):
            env = {**os.environ, **({"PYTHONPATH": str(pythonpath)} if pythonpath else {})}
            r = subprocess.run([sys.executable, "-m", "kimi_convert.cli", "plan", str(ck), "--json", *args],
                               capture_output=True, text=True, env=env, cwd=pythonpath or ROOT, timeout=600)
            assert r.returncode == 0, (case, r.stderr)
            outs.append(_mapping_text_out(json.loads(r.stdout)))
        assert outs[0] == outs[1], case  # (the JSON's text itself: test_every_..._before_issue_22)


#: Presets whose mapping table's text changed since BEFORE_22 (the manifest quotes it as mapping_source, with
#: its sha256): deepseek_v3.toml gained the MTP layer's keep entries (optional, matching nothing in
#: tiny-deepseek-fp8) and the engines' fusion notes (issue 23), and every table gained the [moe] / [lm_head] data
#: plan's config-against-tensors check reads (issue 41), so these presets' manifests are compared without the
#: table's text and hashes; every shard, the index, config and every decision are still byte-compared.
MAPPING_EDITED = {"tiny-k3", "tiny-kimi-linear", "tiny-deepseek-fp8"}

#: (preset, options) packed by BEFORE_22's code and by this one (scripts/same_bytes.sh packs the same cases).
CASES_22 = [(preset, opts) for preset in ("tiny-k3", "tiny-kimi-linear", "tiny-deepseek-fp8")
            for opts in ([], ["--recipe", "nvfp4-w4a16"], ["--layout", "sglang"], ["--layout", "vllm"])]
CASES_22.append(("tiny-k3", ["--recipe", "nvfp4-w4a16", "--layout", "sglang", "--max-shard-size", "1MB"]))


@pytest.mark.slow
def test_every_preset_recipe_and_layout_packs_to_the_same_bytes_as_before_issue_22(tmp_path):
    old = _old_package(tmp_path / "old", BEFORE_22)
    if old is None:
        pytest.skip(f"no git history with commit {BEFORE_22} to take the earlier code from")
    for i, (preset, opts) in enumerate(CASES_22):
        src = tmp_path / "in" / preset
        if not src.exists():
            _run(None, "synth", spec(preset), src)
        case = f"{i}-{preset}"
        _run(old, "pack", src, tmp_path / "before" / case, "--device", "cpu", "-q", *opts)
        _run(None, "pack", src, tmp_path / "after" / case, "--device", "cpu", "-q", *opts)
        as_format_3(tmp_path / "after" / case, src)
        before, after = _files(tmp_path / "before" / case), _files(tmp_path / "after" / case)
        assert sorted(before) == sorted(after), (preset, opts)
        changed = [f for f in before if before[f] != after[f] and f != "manifest.json"]
        same = _mapping_text_out if preset in MAPPING_EDITED else dict  # its quoted table text only, see below
        assert same(json.loads(before["manifest.json"])) == same(json.loads(after["manifest.json"])), (preset, opts)
        assert changed == [], (preset, opts, changed)


#: main before this session's part of issue 40 (the plan's operation and one dispatcher, the scheme names): every
#: tiny preset it had, under each recipe, output format and layout, gives the same files (manifest included) and the
#: same ``plan --json``, or the same refusal.
BEFORE_40 = "49317c5"
OPTIONS_40 = ([], ["--recipe", "nvfp4-w4a16"], ["--format", "compressed-tensors"], ["--layout", "sglang"],
              ["--layout", "vllm"])


#: Presets whose table changed since BEFORE_40 on purpose: their plan, manifest and records are compared without the
#: table's identity, text and rule texts (``_table_neutral``); shards, index and configs byte for byte.
TABLE_CHANGED_40 = {
    "tiny-mistral-large-3": "the hand table mappings/mistral_large_3.toml gave way to the derived one (session 37: "
                            "the head, exclude list and engine_names read off the engines)",
    "tiny-deepseek-v4": "the derived table names the output head `head` (session 37: [[exclude]], [lm_head], "
                        "engine_names head = lm_head); its overlay keeps wq_a / wkv for SGLang (session 38)",
}
#: (preset, OPTIONS_40 index) -> the modules whose decision changed on purpose (compared: exactly these differ)
DECIDED_AGAIN_40 = {
    # the hand table fused gate_up_proj on disk under Mistral's names, which neither engine loads (vLLM "There is
    # no module or parameter named 'layers'"); the derived table writes nothing fused (docs/derive.md)
    ("tiny-mistral-large-3", 3): {"layers.0.feed_forward.gate_up_proj", "layers.1.shared_experts.gate_up_proj",
                                  "layers.0.feed_forward.w1", "layers.0.feed_forward.w3",
                                  "layers.1.shared_experts.w1", "layers.1.shared_experts.w3"},
    # the head kept (before: NVFP4, which vLLM refused: "The size of tensor a (256) must match ... head.weight"), and
    # each attention's wq_a and wkv (before: NVFP4, whose scales SGLang's fused wqkv_a drops: "8 unfilled parameter(s)
    # (first: model.layers.0.self_attn.wqkv_a.weight_scale_2)", mappings/overlays/deepseek_v4.toml)
    ("tiny-deepseek-v4", 1): {"head"} | {f"{p}.attn.{m}" for p in ("layers.0", "layers.1", "layers.2", "layers.3",
                                                                   "mtp.0") for m in ("wq_a", "wkv")},
}
DECIDED_AGAIN_40[("tiny-mistral-large-3", 4)] = DECIDED_AGAIN_40[("tiny-mistral-large-3", 3)]


def _table_neutral(d):
    """A plan, manifest or record without what names or quotes the mapping table (TABLE_CHANGED_40)."""
    if isinstance(d, list):
        return [_table_neutral(x) for x in d]
    if not isinstance(d, dict):
        return d
    drop = {"mapping_source", "mapping_table", "plan_sha256", "mapping", "rules", "rule", "why"}
    return {k: _table_neutral(v) for k, v in d.items() if k not in drop}


def _decisions(plan: dict) -> dict[str, dict]:
    return {m["name"]: _table_neutral(m) for m in plan["modules"]}


def _same_files_table_neutral(b: dict[str, bytes], a: dict[str, bytes], case) -> None:
    assert sorted(b) == sorted(a), case
    for f in b:
        if f == "manifest.json":  # the records files' sizes and hashes hold the rule texts (compared below)
            mb, ma = (_table_neutral(json.loads(x)) for x in (b[f], a[f]))
            for d in (mb, ma):
                d["records"] = [{k: v for k, v in r.items() if k not in ("size", "sha256")} for r in d["records"]]
            assert mb == ma, (case, f)
        elif f.startswith("manifest-records/"):
            rb, ra = ([_table_neutral(json.loads(x)) for x in t.splitlines()] for t in (b[f], a[f]))
            assert rb == ra, (case, f)
        else:
            assert b[f] == a[f], (case, f)


@pytest.mark.slow
def test_every_preset_recipe_format_and_layout_is_the_same_as_before_the_dispatcher(tmp_path):
    old = _old_package(tmp_path / "old", BEFORE_40)
    if old is None:
        pytest.skip(f"no git history with commit {BEFORE_40} to take the earlier code from")
    shown = subprocess.run(["git", "-C", str(ROOT), "grep", "-h", "^\\[presets\\.tiny-", BEFORE_40, "--", "presets"],
                           capture_output=True, text=True, check=True).stdout
    presets = sorted({n for line in shown.split() if "." not in (n := line.strip("[]").removeprefix("presets."))})
    assert len(presets) >= 16, presets
    for preset in presets:
        src = tmp_path / "in" / preset
        _run(None, "synth", spec(preset), src)
        neutral = _table_neutral if preset in TABLE_CHANGED_40 else (lambda x: x)
        pb, pa = _outcome(old, "plan", src, "--json"), _outcome(None, "plan", src, "--json")
        assert pb[0] == pa[0] == 0 and neutral(json.loads(pb[1])) == neutral(json.loads(pa[1])), preset
        for i, opts in enumerate(OPTIONS_40):
            case = f"{preset}-{i}"
            if (preset, i) in DECIDED_AGAIN_40:
                db, da = (_decisions(json.loads(_outcome(at, "plan", src, "--json", *opts)[1])) for at in (old, None))
                assert {n for n in {*db, *da} if db.get(n) != da.get(n)} == DECIDED_AGAIN_40[preset, i], case
                continue
            before = _outcome(old, "pack", src, tmp_path / "before" / case, "--device", "cpu", "-q", *opts)
            after = _outcome(None, "pack", src, tmp_path / "after" / case, "--device", "cpu", "-q", *opts)
            assert before[0] == after[0], (case, before, after)
            assert before[0] == 0 or before[1].splitlines()[-1] == after[1].splitlines()[-1], (case, before, after)
            if not before[0] and preset in TABLE_CHANGED_40:
                as_format_3(tmp_path / "after" / case, src)
                _same_files_table_neutral(_files(tmp_path / "before" / case), _files(tmp_path / "after" / case), case)
            elif not before[0]:
                as_format_3(tmp_path / "after" / case, src)
                b, a = _files(tmp_path / "before" / case), _files(tmp_path / "after" / case)
                assert sorted(b) == sorted(a) and [f for f in b if b[f] != a[f] and f != "manifest.json"] == [], \
                    (case, opts)
                assert json.loads(b["manifest.json"]) == json.loads(a["manifest.json"]), (case, opts)
            shutil.rmtree(tmp_path / "before" / case, ignore_errors=True)
            shutil.rmtree(tmp_path / "after" / case, ignore_errors=True)
