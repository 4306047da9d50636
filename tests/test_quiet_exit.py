"""A process that ran the CLI in-process (``helpers.run``) after importing Triton exits quietly: no nanobind
leak report from libtriton, which would otherwise end every pytest-xdist worker's output (issue 26, item 8)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import run

TESTS = Path(__file__).parent

# Triton imported first (as the kernel tests do in a pytest worker), then the CLI's plan in this process.
AFTER_PLAN = """
import sys, triton
from helpers import run
r = run("plan", sys.argv[1])
assert r.code == 0, r.stderr
"""
# The control: what plan's gc.freeze() did to the process before helpers.run undid it.
FROZEN = "import gc, triton; gc.freeze()"


def _stderr_at_exit(code: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stderr


def test_in_process_plan_leaves_nothing_frozen(tiny_kl):
    assert gc.get_freeze_count() == 0
    assert run("plan", tiny_kl).code == 0
    assert gc.get_freeze_count() == 0


def test_process_that_ran_plan_after_triton_exits_without_a_leak_report(tiny_kl):
    pytest.importorskip("triton")
    assert "nanobind: leaked" in _stderr_at_exit(FROZEN)  # the report this test would see
    err = _stderr_at_exit(AFTER_PLAN, str(tiny_kl))
    assert "nanobind" not in err, err
