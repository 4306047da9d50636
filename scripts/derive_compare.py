"""Derived tables against the hand tables: the same plan, and the same output bytes, for every preset x recipe x layout.

    python scripts/derive_compare.py [PRESET ...] [--work DIR] [--answers-dir tests/derived] [--pack] [--ask]

For each preset (default: every tiny preset with a hand table): synthesize it; take the engines' answers from
``--answers-dir/PRESET.answers.json`` (``--ask``: ask the engines now and write them there, which needs
scripts/engine-envs.sh); build the derived table (with its overlay, as ``plan`` would) and plan it against the
hand table under each recipe and layout the hand table offers. Plans are compared module by module on what decides
the bytes (format, fuse op, shared global scale, input scale, tensors, shards), the exclude list and
``quantized_layers``; rule texts and the mapping's identity are left out (they name their table). With ``--pack``
both plans are packed and every output file but the manifest compared by sha256. Prints one line per case and a
summary; exits 1 when any case differs.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import subprocess
import sys
from pathlib import Path

from kimi_convert.checkpoint import open_checkpoint
from kimi_convert.derive import derive, from_answers
from kimi_convert.derive.lookup import finish
from kimi_convert.mapping import UnknownArchitecture, find_mapping
from kimi_convert.options import Options
from kimi_convert.plan import make_plan
from kimi_convert.plan.serialize import plan_dict

PRESETS = ["tiny-qwen3-moe", "tiny-glm4-moe", "tiny-minimax-m2", "tiny-deepseek-v3", "tiny-kimi-k2",
           "tiny-kimi-linear", "tiny-k3", "tiny-qwen3-5-moe", "tiny-gpt-oss"]
RECIPES = {"tiny-k3": ["nvidia-k3", "nvfp4-w4a16", "ct-nvfp4-a16"]}
DEFAULT_RECIPES = ["nvfp4-w4a16", "ct-nvfp4-a16"]
IGNORED = {"rule", "why"}
LOCK = "/tmp/kimi-engine.lock"


def _strip(x):
    if isinstance(x, dict):
        return {k: _strip(v) for k, v in x.items() if k not in IGNORED}
    if isinstance(x, list):
        return [_strip(v) for v in x]
    return x


def _scale_sets(modules: list[dict]) -> None:
    """A shared global scale as the set of modules that share it, not its label: a derived table may name the
    union of one module's groups otherwise ("in_proj_qkvgfab" where the hand table says "in_proj_qkvgfab +
    qkv_proj") while the modules, hence the scale and the bytes, are the same."""
    sharing: dict[str, list[str]] = {}
    for m in modules:
        label = (m.get("quantization") or {}).get("shared_scale")
        if label:
            sharing.setdefault(label, []).append(m["name"])
    for m in modules:
        q = m.get("quantization") or {}
        if q.get("shared_scale"):
            q["shared_scale"] = sorted(sharing[q["shared_scale"]])


def normalized(plan) -> dict:
    d = plan_dict(plan)
    out = {k: _strip(d[k]) for k in ("exclude_modules", "quantized_layers", "modules", "shards", "totals") if k in d}
    _scale_sets(out.get("modules", []))
    return out


def differences(a: dict, b: dict, limit: int = 6) -> list[str]:
    out = []
    for key in a:
        if a[key] == b.get(key):
            continue
        if key == "modules":
            am = {m["name"]: m for m in a[key]}
            bm = {m["name"]: m for m in b.get(key, [])}
            for name in sorted(set(am) | set(bm)):
                if am.get(name) != bm.get(name):
                    fa = {k: v for k, v in (am.get(name) or {}).items() if (bm.get(name) or {}).get(k) != v}
                    fb = {k: v for k, v in (bm.get(name) or {}).items() if (am.get(name) or {}).get(k) != v}
                    out.append(f"{name}: hand {json.dumps(fa)[:300]} / derived {json.dumps(fb)[:300]}")
        else:
            out.append(f"{key}: hand {json.dumps(a[key])[:300]} / derived {json.dumps(b.get(key))[:300]}")
    return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])


def files_sha(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())
            if p.is_file() and not p.name.startswith("manifest")}


def derived_mapping(preset: str, src: Path, answers_dir: Path, ask: bool):
    path = answers_dir / f"{preset}.answers.json"
    ckpt = open_checkpoint(src)
    if ask or not path.is_file():
        answers_dir.mkdir(parents=True, exist_ok=True)
        with open(LOCK, "w") as lock:  # one engine process at a time on this machine (as the engine tests)
            fcntl.flock(lock, fcntl.LOCK_EX)
            d = derive(ckpt, answers=path)
    else:
        drafts = answers_dir / f"{preset}.draft-answers.json"  # asked apart, else in the answers file itself
        d = from_answers(path, drafts if drafts.is_file() else None)
    return ckpt, finish(d.text, f"derived:{preset}"), d.text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("presets", nargs="*", default=PRESETS)
    ap.add_argument("--work", default="/tmp/derive-compare")
    ap.add_argument("--answers-dir", default="tests/derived")
    ap.add_argument("--ask", action="store_true")
    ap.add_argument("--pack", action="store_true")
    a = ap.parse_args()
    work, bad = Path(a.work), 0
    for preset in a.presets:
        src = work / preset
        if not any((src / f).is_file() for f in ("config.json", "params.json")):
            subprocess.run(["kimi-convert", "synth", preset, str(src), "--overwrite"], check=True,
                           stdout=subprocess.DEVNULL)
        ckpt, derived, _ = derived_mapping(preset, src, Path(a.answers_dir), a.ask)
        (work / f"{preset}.derived.toml").write_text(derived.source)  # with its overlay merged, as plan uses it
        try:
            hand = find_mapping(ckpt.config, by_model_type=False)  # a hand table of its own (not its model_type's)
        except UnknownArchitecture:  # replaced by its shipped derived table (tests/test_derive.py, REPLACED)
            print(f"none {preset:18} no hand table (the shipped derived table replaced it)")
            continue
        layouts = ["source", *(k for k in ("vllm", "sglang") if hand.layouts.get(k, ((), ""))[0])]
        for recipe in RECIPES.get(preset, DEFAULT_RECIPES):
            for layout in layouts:
                opts = Options(recipe=recipe, layout=layout)
                try:
                    ph, pd = make_plan(ckpt, hand, opts), make_plan(ckpt, derived, opts)
                    diff = differences(normalized(ph), normalized(pd))
                except Exception as e:  # a plan one table refuses is a difference too
                    diff = [f"{type(e).__name__}: {e}"]
                line = f"{preset:18} {recipe:13} {layout:7}"
                if diff:
                    bad += 1
                    print(f"DIFF {line}\n  " + "\n  ".join(diff))
                    continue
                if a.pack:
                    outs = []
                    for tag, m in (("hand", None), ("derived", work / f"{preset}.derived.toml")):
                        out = work / f"{preset}-{recipe}-{layout}-{tag}"
                        cmd = ["kimi-convert", "pack", str(src), str(out), "--overwrite", "-q", "--recipe", recipe,
                               "--layout", layout, "--device", "cpu"] + (["--mapping", str(m)] if m else [])
                        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
                        outs.append(files_sha(out))
                    if outs[0] != outs[1]:
                        bad += 1
                        files = sorted(k for k in outs[0] if outs[0][k] != outs[1].get(k))
                        print(f"BYTES {line} differ in {files}")
                        continue
                print(f"same {line}" + (" (plan and bytes)" if a.pack else " (plan)"))
    print(f"{'all the same' if not bad else f'{bad} case(s) differ'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
