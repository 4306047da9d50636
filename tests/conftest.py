"""Shared fixtures: the tiny synthetic checkpoints, written and packed once per session (once per
pytest-xdist worker); engine tests one at a time across workers."""

from __future__ import annotations

import os

# Before anything imports tqdm, which reads TQDM_* once, when imported: no progress bars, in this process
# (with or without pytest-xdist, whose workers inherit it) and in the processes the tests start.
os.environ.setdefault("TQDM_DISABLE", "1")

import fcntl
import gc
import tempfile
from pathlib import Path

import pytest

from helpers import ONE_STREAM, synth_and_pack, write_synth
from kimi_convert.pack import pack
from kimi_convert.plan import Options

#: The engine checks' fork servers (``kimi_convert.enginecheck.server``): one folder for the whole run, made by
#: the first process (pytest-xdist's controller, whose workers inherit the variable), so that each engine is
#: imported once per environment instead of once per check; the controller stops them at the end. An empty
#: KIMI_CONVERT_ENGINE_SERVERS runs every check in a process of its own.
_OWN_SERVERS = None
if "KIMI_CONVERT_ENGINE_SERVERS" not in os.environ:
    _OWN_SERVERS = os.environ["KIMI_CONVERT_ENGINE_SERVERS"] = tempfile.mkdtemp(prefix="kc-engines-")


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
def banked_k3(tmp_path_factory) -> tuple[Path, Path]:
    """tiny-k3 with 32 experts a layer (stored alike: a banked plan, run in several waves) and its pack
    (``ONE_STREAM``, in one wave): issue 43's tests of the waves and of the plan made in a child."""
    return synth_and_pack(tmp_path_factory.mktemp("banked"), ONE_STREAM, "--experts", "32")


@pytest.fixture(scope="session")
def packed_kl(tiny_kl, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("out") / "kl"
    pack(tiny_kl, out, Options(), device="cpu", progress=False)
    return out


@pytest.fixture(autouse=True)
def _one_engine_test_at_a_time(request, tmp_path_factory):
    """A test marked ``engine`` loads vLLM or SGLang (several GB): under pytest-xdist, one such test runs at a
    time across the workers (an flock in the run's temporary folder, which the workers share). The engine
    tests are also marked ``xdist_group("engine")`` for ``--dist loadgroup``, which would keep them on one
    worker, but pytest 9.2's node ids make pytest-xdist 3.8 ignore the group silently (pytest-xdist#1386)."""
    if request.node.get_closest_marker("engine") is None or "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    with open(tmp_path_factory.getbasetemp().parent / "engine-tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def pytest_unconfigure(config):
    """Let this process's last collection free what an in-process ``plan`` froze.

    ``kimi-convert plan`` calls ``gc.freeze()`` (its plan out of the collector's walks for the rest of its
    process: right for the tool, whose process ends with the command). ``helpers.run`` runs it in this process,
    so every object then alive stays frozen; once Triton is imported that includes libtriton's types and their
    reference cycles, which the interpreter's final collection then skips, and nanobind reports them "leaked"
    at exit: about sixty lines from each pytest-xdist worker, after the run's closing line without -n.
    Unfrozen here, at the end, the tests keep the freeze's speed (the collector does not walk them again).

    And the engine checks' fork servers end with the run that started them."""
    gc.unfreeze()
    if _OWN_SERVERS:
        import shutil

        from kimi_convert.enginecheck.server import stop_all

        stop_all(_OWN_SERVERS)
        shutil.rmtree(_OWN_SERVERS, ignore_errors=True)
