"""The engine checks' fork server (``enginecheck.server`` and ``zygote.py``) with a stand-in runner, no engine:
a check through it runs in a fresh child of the one process that did the runner's ``preload``; its exit
status, output, working folder and environment are the check's own; a request with another import-time
environment, a zygote that cannot start, and a check past its timeout are each handled as the docstrings say.
The engine reports through a zygote equal a fresh process's: tests/test_engines.py::test_served_check_is_fresh_checks.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

import pytest

from kimi_convert.enginecheck import server

RUNNER = '''
import json, os, sys, time
import stand_in_runner as me

PRELOADED = None


def preload():
    global PRELOADED
    PRELOADED = os.getpid()


if __name__ == "__main__":
    out, mode = sys.argv[1], sys.argv[2]
    print("runner says hello")
    with open(out, "w") as f:
        json.dump({"pid": os.getpid(), "preloaded_by": me.PRELOADED, "cwd": os.getcwd(),
                   "x": os.environ.get("KC_TEST_X")}, f)
    if mode == "sleep":
        time.sleep(60)
    if mode == "exit3":
        sys.exit(3)
'''


@pytest.fixture
def runner(tmp_path) -> Path:
    p = tmp_path / "runners" / "stand_in_runner.py"
    p.parent.mkdir()
    p.write_text(RUNNER)
    return p


@pytest.fixture
def servers(monkeypatch):
    import tempfile

    folder = tempfile.mkdtemp(prefix="kc-srv-")  # short: a Unix socket's path has a limit of ~100 bytes
    monkeypatch.setenv(server.SERVERS_ENV, folder)
    yield Path(folder)
    server.stop_all(folder)


def check(runner: Path, tmp: Path, mode: str = "ok", env: dict | None = None, timeout: float = 120):
    out, cwd = tmp / f"out-{time.monotonic_ns()}.json", tmp / "cwd"
    cwd.mkdir(exist_ok=True)
    log = tmp / "log.txt"
    env = {**os.environ, "KC_TEST_X": "seen", **(env or {})}
    rc = server.run_runner(Path(sys.executable), runner, [str(out), mode], env, str(cwd), log, timeout)
    return rc, (json.loads(out.read_text()) if out.is_file() else None), log.read_text()


def test_checks_are_forks_of_one_preloaded_process(runner, servers, tmp_path):
    rc1, a, log = check(runner, tmp_path)
    rc2, b, _ = check(runner, tmp_path)
    assert rc1 == rc2 == 0
    assert a["preloaded_by"] is not None and a["preloaded_by"] == b["preloaded_by"]  # one zygote, preloaded once
    assert len({a["pid"], b["pid"], a["preloaded_by"]}) == 3  # each check a process of its own
    assert a["cwd"] == str(tmp_path / "cwd") and a["x"] == "seen"  # the request's folder and environment
    assert "runner says hello" in log
    assert len(list(servers.glob("*.pid"))) == 1


def test_exit_status_is_the_checks(runner, servers, tmp_path):
    assert check(runner, tmp_path, "exit3")[0] == 3


def test_other_import_time_environment_runs_in_its_own_process(runner, servers, tmp_path):
    check(runner, tmp_path)  # the zygote of this environment
    # a zygote of its own for the other environment: still a preloaded fork, never the first zygote's
    rc, a, _ = check(runner, tmp_path, env={"TRITON_INTERPRET": "1" if os.environ.get("TRITON_INTERPRET") != "1"
                                            else "0"})
    assert rc == 0 and a["preloaded_by"] not in (None, a["pid"])
    assert len(list(servers.glob("*.pid"))) == 2


def test_refused_request_falls_back_to_a_process_of_its_own(runner, servers, tmp_path, monkeypatch):
    check(runner, tmp_path)
    monkeypatch.setattr(server, "_key", lambda *a: next(servers.glob("*.sock")).stem)  # the zygote of another env
    rc, a, _ = check(runner, tmp_path, env={"TRITON_INTERPRET": "1" if os.environ.get("TRITON_INTERPRET") != "1"
                                            else "0"})
    assert rc == 0 and a["preloaded_by"] is None  # ran fresh, as without a server


def test_timeout_kills_the_check_and_the_zygote_serves_on(runner, servers, tmp_path):
    t0 = time.monotonic()
    rc, a, _ = check(runner, tmp_path, "sleep", timeout=2)
    assert rc is None and a is not None and time.monotonic() - t0 < 30
    rc, b, _ = check(runner, tmp_path)
    assert rc == 0 and b["preloaded_by"] == a["preloaded_by"]


def test_zygote_that_cannot_start_leaves_the_check_to_its_own_process(tmp_path, servers):
    bad = tmp_path / "r" / "stand_in_runner.py"
    bad.parent.mkdir()
    bad.write_text(RUNNER.replace("def preload():", "def preload_missing():"))
    rc, a, log = check(bad, tmp_path)
    assert rc == 0 and a["preloaded_by"] is None
    assert "engine zygote did not start" in log


def test_without_the_variable_every_check_is_fresh(runner, tmp_path, monkeypatch):
    monkeypatch.setenv(server.SERVERS_ENV, "")
    rc, a, _ = check(runner, tmp_path)
    assert rc == 0 and a["preloaded_by"] is None


def test_stop_all_ends_the_zygotes(runner, servers, tmp_path):
    check(runner, tmp_path)
    pid = int(next(servers.glob("*.pid")).read_text())
    server.stop_all(servers)
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # our child: reap it
        time.sleep(0.05)
    else:
        pytest.fail("the zygote is still running")
