"""``plan`` at the released K3's scale, and its output unchanged by the work that made it fast.

The golden files under tests/data/plan_golden/ are ``plan --json`` outputs recorded from the code
before the plan was made fast (commit 0aac918): the fast paths (decisions per expert template,
templated JSON) must print the same bytes. After an intended change of the plan's output, rewrite
them with ``python tests/test_plan_scale.py regen`` and review the diff.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from helpers import run

from kimi_convert.synth import write_synth

GOLDEN = Path(__file__).parent / "data" / "plan_golden"

# (case, preset, synth overrides, plan arguments)
SMALL_SPARSE = {"layers": 5, "experts": 32}
CASES = [
    ("tiny-k3", "tiny-k3", {}, []),
    ("tiny-k3-w4a16-vllm", "tiny-k3", {}, ["--recipe", "nvfp4-w4a16", "--layout", "vllm", "--max-shard-size", "1MB"]),
    ("tiny-k3-sglang", "tiny-k3", {}, ["--layout", "sglang"]),
    ("tiny-k3-w4a16", "tiny-k3", {}, ["--recipe", "nvfp4-w4a16"]),
    ("tiny-k3-exclude-bank", "tiny-k3", {}, ["--exclude", "*.layers.1.block_sparse_moe.experts.*"]),
    ("tiny-k3-exclude-expert", "tiny-k3", {}, ["--exclude", "*.experts.0.*", "--keep-partial"]),
    ("tiny-kimi-linear", "tiny-kimi-linear", {}, []),
    ("tiny-kimi-linear-sglang", "tiny-kimi-linear", {}, ["--layout", "sglang"]),
    ("tiny-deepseek-fp8", "tiny-deepseek-fp8", {}, []),
    ("sparse-k3", "k3-full-sparse", SMALL_SPARSE, []),
    ("sparse-k3-w4a16-vllm", "k3-full-sparse", SMALL_SPARSE, ["--recipe", "nvfp4-w4a16", "--layout", "vllm"]),
    ("sparse-k3-exclude-some", "k3-full-sparse", SMALL_SPARSE, ["--exclude", "*.experts.1?.w2", "--keep-partial"]),
]


def _input(root: Path, preset: str, over: dict) -> Path:
    path = root / (preset + "".join(f"-{k}{v}" for k, v in sorted(over.items())))
    if not path.exists():
        write_synth(preset, path, seed=0, **over)
    return path


def _plan_json(ck: Path, args: list[str]) -> str:
    r = run("plan", ck, "--json", *args)
    assert r.exit_code == 0, r.output
    return r.stdout


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("golden-in")


@pytest.mark.parametrize("case,preset,over,args", CASES, ids=[c[0] for c in CASES])
def test_plan_json_is_byte_identical_to_the_recorded_one(case, preset, over, args, inputs):
    got = _plan_json(_input(inputs, preset, over), args)
    want = gzip.decompress((GOLDEN / f"{case}.json.gz").read_bytes()).decode()
    if got != want:  # name the first difference, not 100 kB of JSON
        a, b = got.splitlines(), want.splitlines()
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        pytest.fail(f"{case}: plan --json differs from the recorded output at line {i + 1}:\n"
                    f"  got:  {a[i] if i < len(a) else '<end>'}\n  want: {b[i] if i < len(b) else '<end>'}")
    json.loads(got)


def regen(root: Path) -> None:
    GOLDEN.mkdir(parents=True, exist_ok=True)
    for case, preset, over, args in CASES:
        text = _plan_json(_input(root, preset, over), args)
        (GOLDEN / f"{case}.json.gz").write_bytes(gzip.compress(text.encode(), mtime=0))
        print(f"{case}: {len(text)} bytes")


if __name__ == "__main__" and sys.argv[1:] == ["regen"]:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        regen(Path(d))
