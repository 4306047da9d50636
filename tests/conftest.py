"""Shared fixtures: the two tiny synthetic checkpoints, written and packed once per session."""

from __future__ import annotations

import os

# Before anything imports tqdm, which reads TQDM_* once, when imported: no progress bars, in this process
# (with or without pytest-xdist, whose workers inherit it) and in the processes the tests start.
os.environ.setdefault("TQDM_DISABLE", "1")

from pathlib import Path

import pytest

from kimi_convert.pack import pack
from kimi_convert.plan import Options
from kimi_convert.synth import write_synth


@pytest.fixture(scope="session")
def tiny_k3(tmp_path_factory) -> Path:
    return write_synth("tiny-k3", tmp_path_factory.mktemp("in") / "tiny-k3", seed=0)


@pytest.fixture(scope="session")
def tiny_kl(tmp_path_factory) -> Path:
    return write_synth("tiny-kimi-linear", tmp_path_factory.mktemp("in") / "tiny-kl", seed=0)


@pytest.fixture(scope="session")
def tiny_ds(tmp_path_factory) -> Path:
    return write_synth("tiny-deepseek-fp8", tmp_path_factory.mktemp("in") / "tiny-ds", seed=0)


@pytest.fixture(scope="session")
def packed_ds(tiny_ds, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("out") / "ds"
    pack(tiny_ds, out, Options(), device="cpu", progress=False)
    return out


@pytest.fixture(scope="session")
def packed_k3(tiny_k3, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("out") / "k3"
    # weight-only NVFP4 in vLLM's fused layout (NVFP4 fused on disk: gate_up_proj): every quantized byte is
    # checked against tests/oracle.py (NVIDIA's recipe, the K3 default, against Model Optimizer in test_recipes.py)
    pack(tiny_k3, out, Options(max_shard_size=1_000_000, recipe="nvfp4-w4a16", layout="vllm"), device="cpu",
         progress=False)
    return out


@pytest.fixture(scope="session")
def packed_kl(tiny_kl, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("out") / "kl"
    pack(tiny_kl, out, Options(), device="cpu", progress=False)
    return out
