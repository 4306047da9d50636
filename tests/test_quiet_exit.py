"""A pytest process that ran ``plan`` in-process (``helpers.run``) after importing Triton ends quietly, its closing
line last: no nanobind leak report from libtriton (issue 26, item 8; tests/conftest.py, ``pytest_unconfigure``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import run

ROOT = Path(__file__).parents[1]
# What plan's gc.freeze() does to a process that has imported Triton, unless undone before it exits.
FROZEN = "import gc, triton; gc.freeze()"


def _child_env() -> dict[str, str]:
    """This environment without the pytest-xdist worker's variables (the child is a pytest run of its own)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}


def test_plan_in_process_after_triton(tiny_kl):
    """As in a pytest-xdist worker: the kernel tests import Triton, then a test runs ``plan`` in this process.
    Also the child run of the next test."""
    pytest.importorskip("triton")
    assert run("plan", tiny_kl).code == 0


def test_a_run_that_planned_after_triton_ends_quietly_on_its_closing_line(tmp_path):
    pytest.importorskip("triton")
    control = subprocess.run([sys.executable, "-c", FROZEN], capture_output=True, text=True, timeout=300)
    assert "nanobind: leaked" in control.stderr  # the report, where nothing undoes the freeze
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "t"),
                        f"{Path(__file__).relative_to(ROOT)}::test_plan_in_process_after_triton"],
                       cwd=ROOT, capture_output=True, text=True, env=_child_env(), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "nanobind" not in r.stdout + r.stderr, r.stderr
    assert r.stderr.strip() == "", r.stderr
    assert re.fullmatch(r"1 passed in [\d.]+s( \(.*\))?", r.stdout.strip().splitlines()[-1]), r.stdout
