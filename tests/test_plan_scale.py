"""``plan`` at the released K3's scale, and its output unchanged by the work that made it fast.

The golden files under tests/data/plan_golden/ are ``plan --json`` outputs recorded from the code
before the plan was made fast (commit 0aac918): the fast paths (decisions per expert template,
templated JSON) must print the same bytes. After an intended change of the plan's output, rewrite
them with ``python tests/test_plan_scale.py regen`` and review the diff.
"""

from __future__ import annotations

import gzip
import json
import os
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
        i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        pytest.fail(f"{case}: plan --json differs from the recorded output at line {i + 1}:\n"
                    f"  got:  {a[i] if i < len(a) else '<end>'}\n  want: {b[i] if i < len(b) else '<end>'}")
    json.loads(got)


def test_shard_header_is_json_dumps_of_the_header():
    """The header written directly equals json.dumps of the header dict, names needing escapes included;
    a repeated name falls back to the dict (which keeps one entry)."""
    import kimi_convert.plan as P

    ts = [P.OutTensor('a"q\\b.weight', "U8", (3, 8)), P.OutTensor("caf\u00e9.w", "F32", ()),
          P.OutTensor("x.\n.y", "BF16", (2, 0, 5)), P.OutTensor("z", "F8_E4M3", (7,))]
    for names in ([t.name for t in ts], ["a", "b", "a", "c"]):
        units = [[t._replace(name=n) for t, n in zip(ts, names, strict=True)]]
        shard = P._shard("s", units)
        header = {"__metadata__": {"format": "pt"}}
        for pl in shard.placed:
            a, b = pl.start - len(shard.header), pl.end - len(shard.header)
            header[pl.tensor.name] = {"dtype": pl.tensor.dtype, "shape": list(pl.tensor.shape), "data_offsets": [a, b]}
        text = json.dumps(header, separators=(",", ":")).encode()
        assert shard.header[8:].rstrip(b" ") == text
    assert P._shard("empty", []).header[8:].rstrip(b" ") == b'{"__metadata__":{"format":"pt"}}'


def test_index_blind_globs():
    from kimi_convert.plan import _index_blind

    blind = ["*_conv1d", "w13", "*.experts.*.w1", "model.layers.*.self_attn.[fb]_*_proj", "x[!0-9]", "12y", "x[ab"]
    telling = ["*.experts.0.*", "*.experts.1?.w2", "*1*", "layers.0.mlp", "x.[0-9].y", "x.12", "12.x", "?"]
    assert all(map(_index_blind, blind)) and not any(map(_index_blind, telling))


@pytest.fixture(scope="module")
def k3_full(tmp_path_factory) -> Path:
    return write_synth("k3-full-sparse", tmp_path_factory.mktemp("sparse") / "k3")


def test_full_sparse_k3_is_the_release_inventory_on_little_disk(k3_full):
    weight_map = json.loads((k3_full / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(weight_map) == 497_220  # 92 MoE layers x 896 experts x 3 projections x 2 tensors + 2,628
    assert sum(".experts." in n for n in weight_map) == 92 * 896 * 3 * 2
    files = sorted(k3_full.glob("*.safetensors"))
    assert len(files) == 96 == len(set(weight_map.values())) and files[-1].name == "model-00096-of-00096.safetensors"
    stats = [p.stat() for p in k3_full.iterdir()]
    apparent, used = sum(s.st_size for s in stats), sum(s.st_blocks * 512 for s in stats)
    assert 1.5e12 < apparent < 1.6e12  # the release: 1.56 TB
    assert used < 300e6, f"{used / 1e6:.0f} MB of real disk: data regions should be holes"
    with open(files[0], "rb") as f:  # a data region reads as zeros
        f.seek(-4096, 2)
        assert f.read() == bytes(4096)


def test_inspect_reports_the_release_moe_parameters(k3_full):
    r = run("inspect", "--json", k3_full)
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert (d["num_experts"], d["top_k"], d["moe_intermediate_size"], d["hidden_size"]) == (896, 16, 3072, 7168)
    assert d["expert_input_size"] == 3584 and d["tensor_experts"] == 896 and d["tensor_expert_shape"] == [3072, 3584]
    assert len(d["moe_layers"]) == 92 and len(d["layer_kinds"]["kda"]) == 69 and len(d["layer_kinds"]["mla"]) == 24


@pytest.mark.skipif(not os.environ.get("KIMI_CONVERT_SCALE"), reason="a minute of CPU: KIMI_CONVERT_SCALE=1")
def test_plan_of_the_full_sparse_k3(k3_full):
    r = run("plan", k3_full)
    assert r.exit_code == 0, r.output
    assert "totals: 247296 NVFP4 modules" in r.stdout and "in 96 shard(s)" in r.stdout
    assert len(r.stdout.splitlines()) < 20_000  # routed experts shown as banks


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
