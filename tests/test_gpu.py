"""Whole packs on the GPU write the CPU's bytes, every file (was benchmarks/gpu_equality.py, gpu_recipes.sh,
gpu_item5.sh's and gpu_pack.sh's equality steps, recipe_gpu_check.py's pack step). The GPU tests are marked
``gpu``: on the GPU machine ``TRITON_INTERPRET= python -m pytest -m gpu``; without CUDA they are skipped. The tests
without the mark run anywhere: they plant a difference for each comparison the GPU tests rely on."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from gpu_compare import differing_files, differing_tensors, differing_tiles, files_under, on_gpu
from helpers import PRESETS_WITHOUT_TABLE, all_presets, run, write_synth
from kimi_convert.errors import ConvertError
from kimi_convert.pack import pack
from kimi_convert.plan import Options

#: The device whose packs must write the CPU's bytes (a dry run on a machine without CUDA sets "reference", the
#: torch code on the CPU, to run these tests' own code: benchmarks/h200_check.sh says how).
DEVICE = "cuda"
#: Every tiny preset (a new family's joins once synth has it) under every recipe and output format, in every
#: layout. Where the CPU refuses a combination (nvidia-k3's block FP8 where a preset's K is not a multiple of 128,
#: or nvidia-k3 written as compressed-tensors) the GPU must refuse it in the same words.
TINY = sorted(p for p in all_presets() if p.startswith("tiny-") and p not in PRESETS_WITHOUT_TABLE)
RECIPES = [("nvfp4-w4a16", None), ("nvfp4-w4a16", "compressed-tensors"), ("ct-nvfp4-a16", None), ("nvidia-k3", None)]
LAYOUTS = ["source", "sglang", "vllm"]
#: Every bench preset at real width (bench-k3-shards is bench-k3's shape) with fewer experts or layers: the
#: kernels at the releases' tile sizes, under the preset's default recipe and compressed-tensors'. Each preset's
#: tests are one xdist group (run with ``--dist loadgroup``): one worker writes its input once, not every worker.
BENCH = sorted(p for p in all_presets() if p.startswith("bench-") and p != "bench-k3-shards")
BENCH_SYNTH = {"bench-kimi-linear": {"layers": 1}, "bench-k3": {"layers": 1, "experts": 8}}
#: (preset, synth options, pack options): what the matrices above leave out: K3 at real width fused on disk and
#: under nvfp4-w4a16 (--layout vllm quantizes K3's fused_qkv_a_g_proj as one tensor, on its joint block-FP8 tiles)
PACKS = [
    ("bench-k3", {"layers": 1, "experts": 8}, {"layout": "vllm"}),
    ("bench-k3", {"layers": 1, "experts": 8}, {"recipe": "nvfp4-w4a16"}),
    ("bench-k3", {"layers": 1, "experts": 8}, {"recipe": "nvfp4-w4a16", "layout": "sglang"}),
]


def _pack(src, out, device, **opts):
    pack(src, out, Options(max_shard_size=500_000_000, **opts), device=device, progress=False)
    return out


@pytest.fixture(scope="session")
def inputs(tmp_path_factory):
    """Each synthetic input written once per test process: ``inputs(preset, **synth)`` is its folder."""
    made = {}

    def get(preset, **synth):
        key = (preset, tuple(sorted(synth.items())))
        if key not in made:
            made[key] = write_synth(preset, tmp_path_factory.mktemp("in") / preset, **synth)
        return made[key]
    return get


def _refusal(src, out, device, **opts) -> str | None:
    """The pack's one-line error, or None where it wrote ``out``."""
    try:
        pack(src, out, Options(**opts), device=device, progress=False)
    except ConvertError as e:
        return str(e)
    return None


def same_on_both(src, tmp_path, **opts) -> str | None:
    """``src`` packed on the CPU and on :data:`DEVICE`: the same files, or the same refusal (returned)."""
    cpu = _refusal(src, tmp_path / "cpu", "cpu", **opts)
    assert _refusal(src, tmp_path / "gpu", DEVICE, **opts) == cpu
    if cpu is None:
        assert files_under(tmp_path / "cpu") and differing_files(tmp_path / "gpu", tmp_path / "cpu") == []
    return cpu


@on_gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("recipe,fmt", RECIPES, ids=str)
@pytest.mark.parametrize("preset", TINY)
def test_every_tiny_preset_recipe_format_and_layout_writes_the_cpus_bytes(inputs, tmp_path, preset, recipe, fmt,
                                                                          layout):
    opts = {"recipe": recipe, "layout": layout, "max_shard_size": 1_000_000, **({"format": fmt} if fmt else {})}
    refused = same_on_both(inputs(preset), tmp_path, **opts)
    assert refused is None or recipe == "nvidia-k3", refused  # (only NVIDIA's recipe has shapes it refuses)


#: The bench presets in BENCH_GROUPS xdist groups, each one input and its packs on disk at a time (written and
#: removed by the test): a worker that kept each bench input it had written, with ten workers at once, filled the
#: GPU machine's 64 GB disk in session 22.
BENCH_GROUPS = 3


@on_gpu
@pytest.mark.parametrize("recipe", [None, "ct-nvfp4-a16"], ids=["default", "ct"])
@pytest.mark.parametrize("preset", [pytest.param(p, marks=pytest.mark.xdist_group(f"bench-{i % BENCH_GROUPS}"))
                                    for i, p in enumerate(BENCH)], ids=str)
def test_every_bench_preset_at_real_width_writes_the_cpus_bytes(tmp_path, preset, recipe):
    try:
        src = write_synth(preset, tmp_path / "in", **BENCH_SYNTH.get(preset, {"experts": 8}))
        assert same_on_both(src, tmp_path, recipe=recipe, max_shard_size=500_000_000) is None
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


@on_gpu
@pytest.mark.xdist_group("bench-k3")
@pytest.mark.parametrize("preset,synth,opts", PACKS, ids=str)
def test_pack_on_the_gpu_writes_the_cpus_bytes(inputs, tmp_path, preset, synth, opts):
    assert same_on_both(inputs(preset, **synth), tmp_path, max_shard_size=500_000_000, **opts) is None


#: The tiny presets whose default recipe is none of the matrix's (DeepSeek V3.2 and V4 joined TINY and BENCH as
#: presets; V4's default ``nvidia-dsv4`` casts its MXFP4 routed experts and keeps the rest as stored), in every layout.
OWN_DEFAULT = ["tiny-deepseek-v4"]


@on_gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("preset", OWN_DEFAULT)
def test_a_tiny_presets_own_default_recipe_writes_the_cpus_bytes(inputs, tmp_path, preset, layout):
    same_on_both(inputs(preset), tmp_path, layout=layout, max_shard_size=1_000_000)  # (the same files, or refusal)


@on_gpu
@pytest.mark.parametrize("recipe", [None, "ct-nvfp4-a16"], ids=["default", "ct"])
def test_llama4s_transposed_banks_decode_on_the_gpu_to_the_cpus_bytes(tmp_path, recipe):
    """Llama 4's release layout (``convert/encodings/expert_bank.py``: each expert's [in, out] slice transposed on
    the parts' device), with its shipped derived table and overlay: no tiny preset has these banks."""
    from test_family_llama4 import write_release

    assert same_on_both(write_release(tmp_path / "in"), tmp_path, recipe=recipe, max_shard_size=1_000_000) is None


@pytest.fixture
def auto_takes_the_gpu(monkeypatch):
    """--device auto measuring every kind of work on both (the streams wait for it: a tiny input has too few units
    to decide otherwise) and taking the GPU for each kind whatever it measured: the GPU's bytes from then on. The
    test's ``pack`` is given that tuning (the calibration in this process and the probe process both)."""
    import functools

    from kimi_convert.tuning import Tuning

    tuning = Tuning(calibration_waits=True, probe_waits=True, gpu_margin=1e-9)
    monkeypatch.setitem(globals(), "pack", functools.partial(pack, tuning=tuning))


@on_gpu
@pytest.mark.parametrize("recipe", [None, "ct-nvfp4-a16"], ids=["default", "ct"])
@pytest.mark.parametrize("preset", TINY)
def test_auto_taking_the_gpu_writes_the_cpus_bytes(inputs, tmp_path, auto_takes_the_gpu, preset, recipe):
    src = inputs(preset)
    cpu = _pack(src, tmp_path / "cpu", "cpu", recipe=recipe)
    res = pack(src, tmp_path / "auto", Options(max_shard_size=500_000_000, recipe=recipe), device="auto",
               progress=False)
    assert "cuda" in {c["chosen"] for c in res.stats.device_choices}, res.stats.device_choices
    assert differing_files(tmp_path / "auto", cpu) == []


@on_gpu
def test_recipe_kernels_write_the_torch_codes_bytes(tmp_path, monkeypatch):
    """NVIDIA's recipe by its torch code (the bytes before the C and Triton kernels) == the C kernels == Triton."""
    from kimi_convert.kernels import RECIPE_KERNELS_ENV

    src = write_synth("tiny-k3", tmp_path / "in")
    monkeypatch.setenv(RECIPE_KERNELS_ENV, "torch")
    ref = _pack(src, tmp_path / "torch", "cpu", recipe="nvidia-k3")
    monkeypatch.delenv(RECIPE_KERNELS_ENV)
    for device in ("cpu", "cuda"):
        assert differing_files(_pack(src, tmp_path / device, device, recipe="nvidia-k3"), ref) == [], device


@on_gpu
def test_auto_on_a_gpu_machine_writes_the_cpus_bytes_and_verifies(tmp_path):
    src = write_synth("tiny-k3", tmp_path / "in")
    assert run("pack", src, tmp_path / "cpu", "--device", "cpu", "-q").code == 0
    r = run("pack", src, tmp_path / "auto", "--device", "auto", "-q", "--stats", tmp_path / "stats.json")
    assert r.code == 0, r.stderr
    assert json.loads((tmp_path / "stats.json").read_text())["device"] == "auto"
    assert differing_files(tmp_path / "auto", tmp_path / "cpu") == []
    v = run("verify-manifest", tmp_path / "auto", "--input", src, "--device", "cuda", "--full")
    assert v.code == 0, v.stdout + v.stderr


@on_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (one worker a GPU)")
def test_workers_on_several_gpus_write_one_workers_bytes(tmp_path):
    src = write_synth("bench-kimi-linear", tmp_path / "in", layers=1)
    n = torch.cuda.device_count()
    pack(src, tmp_path / "cuda", Options(max_shard_size=500_000_000), device="cuda", workers=n, progress=False)
    cpu = _pack(src, tmp_path / "cpu", "cpu")
    assert differing_files(tmp_path / "cuda", cpu) == []


# --- the comparisons, on a planted difference (no GPU needed) ---------------------------------------------------

def test_differing_files_finds_a_changed_byte_and_a_missing_file(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        (d / "docs").mkdir(parents=True)
        (d / "x.safetensors").write_bytes(bytes(range(256)) * 64)
        (d / "docs" / "README.md").write_text("same")
    assert differing_files(a, b) == []
    data = bytearray((b / "x.safetensors").read_bytes())
    data[9000] ^= 1  # one bit, past filecmp's first buffer
    (b / "x.safetensors").write_bytes(bytes(data))
    (a / "docs" / "only-here.json").write_text("{}")
    assert differing_files(a, b) == ["docs/only-here.json", "x.safetensors"]


def test_differing_tensors_compares_bytes_not_values():
    x = torch.tensor([0.0, 1.0, float("nan")])
    assert differing_tensors([x, x.to(torch.bfloat16)], [x.clone(), x.to(torch.bfloat16)]) == []  # NaN == NaN
    assert differing_tensors([x], [torch.tensor([-0.0, 1.0, float("nan")])]) == [0]  # -0.0 == 0.0 by value
    assert differing_tensors([x, x], [x, x.reshape(3, 1)]) == [1]
    assert differing_tensors([x], [x, x]) == [1]


def test_differing_tiles_names_the_tile_whose_code_or_scale_differs():
    q = torch.zeros(128, 3 * 128, dtype=torch.uint8)
    s = torch.ones(3)
    assert not differing_tiles(q, q.clone(), s, s.clone()).any()
    q2, s2 = q.clone(), s.clone()
    q2[127, 2 * 128] = 1
    s2[0] = 1.0000001
    assert differing_tiles(q2, q, s2, s).tolist() == [True, False, True]


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:overflow:RuntimeWarning")
def test_the_division_check_counts_nothing_in_range_and_a_divisor_out_of_it(monkeypatch):
    """The division check's kernel (benchmarks/gpu_division_check.py) in the interpreter on the CPU: no code differs
    for divisors in the fast path's range; a subnormal divisor (its reciprocal overflows: outside the range the
    kernel gives the fast path) is counted, so that the check's 0 on the GPU means what it says."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # read when the file's kernel is made, below
    from gpu_compare import division_check

    m = division_check()
    d = m.divisors(1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sample = torch.cat([d[:2], d[d.numel() // 2 : d.numel() // 2 + 1], d[-2:]]).to(device)
    assert m.mismatches(sample) == 0
    assert m.mismatches(torch.tensor([1e-40], device=device)) > 0
