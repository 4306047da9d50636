"""The sha256 of every file `synth` writes, for every preset (and a few `--layers/--experts/--shards/--seed`
overrides): the evidence that the spec-driven generator writes the bytes the per-family `synth_*` modules
wrote (docs/presets.md, "Byte identity").

    python scripts/synth_hashes.py OUT.json [--scratch DIR] [--only NAME ...] [--tiny]
    python scripts/synth_hashes.py --compare OLD.json NEW.json

Run it once with the old code importable as ``kimi_convert`` (its preset names) and once with the new (it
resolves the tests' presets under tests/presets/), then ``--compare``. A sparse file (k3-full-sparse) is
hashed as its data prefix, that prefix's length and the file's size, after checking that everything past
the prefix is a hole (reads as zeros): the same content as hashing 1.56 TB of zeros, in a second.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
from pathlib import Path

#: (case id, preset, write_synth overrides): every preset as it is, then overrides that change the layout
CASES: list[tuple[str, str, dict]] = [
    *((p, p, {}) for p in (
        "tiny-k3", "tiny-kimi-linear", "tiny-deepseek-fp8", "tiny-deepseek-v3", "tiny-kimi-k2", "tiny-qwen3-moe",
        "tiny-glm4-moe", "tiny-qwen3-5-moe", "tiny-gpt-oss", "tiny-minimax-m2")),
    ("tiny-k3 layers=6 experts=5 shards=3 seed=1", "tiny-k3", {"layers": 6, "experts": 5, "shards": 3, "seed": 1}),
    ("tiny-k3 jobs=3", "tiny-k3", {"jobs": 3}),
    ("tiny-kimi-linear layers=9 experts=3", "tiny-kimi-linear", {"layers": 9, "experts": 3}),
    ("tiny-deepseek-fp8 layers=4 shards=3", "tiny-deepseek-fp8", {"layers": 4, "shards": 3}),
    ("tiny-deepseek-fp8 jobs=2", "tiny-deepseek-fp8", {"jobs": 2}),
    ("tiny-deepseek-v3 layers=3 experts=6", "tiny-deepseek-v3", {"layers": 3, "experts": 6}),
    ("tiny-kimi-k2 experts=5 shards=2", "tiny-kimi-k2", {"experts": 5, "shards": 2}),
    ("tiny-qwen3-moe layers=3 experts=5", "tiny-qwen3-moe", {"layers": 3, "experts": 5}),
    ("tiny-glm4-moe layers=2 experts=3", "tiny-glm4-moe", {"layers": 2, "experts": 3}),
    ("tiny-qwen3-5-moe layers=8 experts=3", "tiny-qwen3-5-moe", {"layers": 8, "experts": 3}),
    ("tiny-gpt-oss layers=3 shards=3 experts=3", "tiny-gpt-oss", {"layers": 3, "shards": 3, "experts": 3}),
    ("tiny-minimax-m2 layers=3 experts=4", "tiny-minimax-m2", {"layers": 3, "experts": 4}),
    ("k3-full-sparse layers=5 experts=16", "k3-full-sparse", {"layers": 5, "experts": 16}),
    ("bench-k3-shards experts=8", "bench-k3-shards", {"experts": 8}),
    *((p, p, {}) for p in (
        "k3-full-sparse", "bench-k3", "bench-kimi-linear", "bench-deepseek-v3", "bench-qwen3-moe", "bench-gpt-oss",
        "bench-minimax-m2", "bench-qwen3-5-moe", "bench-glm4-moe", "bench-k3-shards")),
]


def file_hash(path: Path) -> str:
    """sha256 of the file's content; a sparse file as (its data prefix's sha256, that length, its size)."""
    st = path.stat()
    h = hashlib.sha256()
    if st.st_blocks * 512 >= st.st_size or st.st_size < (1 << 20):
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
        return h.hexdigest()
    with open(path, "rb") as f:
        fd = f.fileno()
        end = os.lseek(fd, 0, os.SEEK_HOLE)  # the data prefix (the header) ends at the first hole
        try:
            more = os.lseek(fd, end, os.SEEK_DATA)
        except OSError:  # ENXIO: no data after the prefix
            more = -1
        if more != -1:
            raise SystemExit(f"{path}: data past the first hole at {more}; not a header-only sparse file")
        f.seek(0)
        h.update(f.read(end))
    return f"sparse:{h.hexdigest()}:{end}:{st.st_size}"


def folder_hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): file_hash(p) for p in sorted(root.rglob("*")) if p.is_file()}


def write(preset: str, out: Path, over: dict) -> None:
    """``preset`` written by the code importable as ``kimi_convert``: the old code knows every preset by
    name; the new one is handed the tests' spec file for a preset that is not built in."""
    from kimi_convert import synth

    if not hasattr(synth, "find_preset"):  # the old code
        synth.write_synth(preset, out, **over)
        return
    tests = Path(__file__).resolve().parents[1] / "tests" / "presets"
    synth.write_synth(synth.find_preset(preset, [tests]), out, **over)


def run(out_json: Path, scratch: Path, only: list[str], tiny: bool) -> None:
    done = json.loads(out_json.read_text()) if out_json.exists() else {}
    for case, preset, over in CASES:
        if (only and case not in only) or case in done or (tiny and not preset.startswith("tiny-")):
            continue
        folder = scratch / "case"
        shutil.rmtree(folder, ignore_errors=True)
        write(preset, folder, over)
        done[case] = folder_hashes(folder)
        shutil.rmtree(folder)
        out_json.write_text(json.dumps(done, indent=1) + "\n")
        print(f"{case}: {len(done[case])} files", flush=True)


def compare(old: Path, new: Path) -> int:
    a, b = json.loads(old.read_text()), json.loads(new.read_text())
    same = [c for c in a if b.get(c) == a[c]]
    for c in a:
        if c in b and b[c] != a[c]:
            diff = sorted(k for k in a[c].keys() | b[c].keys() if a[c].get(k) != b[c].get(k))
            print(f"DIFFERENT {c}: {', '.join(diff)}")
        elif c not in b:
            print(f"MISSING {c}")
    files = sum(len(a[c]) for c in same)
    print(f"{len(same)} of {len(a)} cases byte-identical ({files} files)")
    return 0 if len(same) == len(a) else 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", type=Path)
    ap.add_argument("--scratch", type=Path, default=Path("/tmp/synth-hashes"))
    ap.add_argument("--only", nargs="*", default=[])
    ap.add_argument("--tiny", action="store_true", help="only the tiny presets' cases")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("OLD", "NEW"))
    a = ap.parse_args()
    if a.compare:
        raise SystemExit(compare(*a.compare))
    a.scratch.mkdir(parents=True, exist_ok=True)
    run(a.out, a.scratch, a.only, a.tiny)


if __name__ == "__main__":
    main()
