"""Run an engine runner: in a process of its own, or, where ``KIMI_CONVERT_ENGINE_SERVERS`` names a folder, as
a fork of a zygote that has imported the engine once (``zygote.py``'s docstring says why and how each check
stays isolated).

The zygotes live in that folder, one per engine python, runner and import-time environment (a Unix socket and
a pid file each), started on first use and shared by every process that names the same folder: the test
suite names one for its session, so that fifty checks import vLLM and SGLang twice each instead of fifty
times. ``stop_all`` ends them; each also ends itself after ``zygote.IDLE_S`` idle seconds. A zygote that
cannot start or that refuses a request (another import-time environment) leaves the check to a process of
its own: the result is the same, only slower.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from . import zygote

SERVERS_ENV = "KIMI_CONVERT_ENGINE_SERVERS"
START_TIMEOUT = 600.0  # importing an engine on a busy 2-core machine


def run_runner(python: Path, runner: Path, argv: list[str], env: dict, cwd: str, log: Path,
               timeout: float) -> int | None:
    """The runner's exit status, None when it ran past ``timeout``; its output appended to ``log``."""
    folder = os.environ.get(SERVERS_ENV)
    if folder:
        sock = _server(Path(folder), python, runner, env, log)
        if sock is not None:
            rc = _submit(sock, argv, env, cwd, log, timeout)
            if rc != "refused":
                return rc
    with open(log, "a") as lf:
        try:
            return subprocess.run([str(python), str(runner), *argv], stdout=lf, stderr=subprocess.STDOUT, env=env,
                                  timeout=timeout, cwd=cwd).returncode
        except subprocess.TimeoutExpired:
            return None


def _key(python: Path, runner: Path, env: dict) -> str:
    text = json.dumps([str(python), str(runner), [env.get(k) for k in zygote.IMPORT_TIME_ENV]])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _alive(sock: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(sock))
        except OSError:
            return False
    return True


def _server(folder: Path, python: Path, runner: Path, env: dict, log: Path) -> Path | None:
    """The zygote's socket for this python, runner and environment, started under the folder's lock if it is
    not running; None if it cannot start (its output is appended to ``log``)."""
    folder.mkdir(parents=True, exist_ok=True)
    sock = folder / f"{_key(python, runner, env)}.sock"
    with open(folder / "lock", "w") as lk:
        fcntl.flock(lk, fcntl.LOCK_EX)
        if sock.exists() and _alive(sock):
            return sock
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()
        errlog = sock.with_suffix(".log")
        with open(errlog, "a") as ef:
            proc = subprocess.Popen([str(python), str(Path(zygote.__file__)), str(runner), str(sock)], env=env,
                                    stdout=subprocess.PIPE, stderr=ef, text=True, cwd=str(folder),
                                    start_new_session=True)
        sock.with_suffix(".pid").write_text(str(proc.pid))
        line = _ready_line(proc)
        if not line.startswith("{") or not sock.exists():
            with open(log, "a") as lf:
                lf.write(f"engine zygote did not start ({line.strip() or 'no answer'}); "
                         f"see {errlog}; running the check in its own process\n")
            with contextlib.suppress(OSError):
                proc.kill()
            return None
        return sock


def _ready_line(proc: subprocess.Popen) -> str:
    """The zygote's first line (``{"ready": ...}``), or "" if it exits or stays silent too long."""
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(START_TIMEOUT):
            return ""
    return proc.stdout.readline()


def _submit(sock: Path, argv: list[str], env: dict, cwd: str, log: Path, timeout: float) -> int | str | None:
    """One check through the zygote: its exit status, None past ``timeout`` (the child killed), "refused"."""
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(sock))
            s.sendall((json.dumps({"argv": argv, "cwd": cwd, "env": env, "log": str(log)}) + "\n").encode())
            f = s.makefile("r")
            s.settimeout(max(1.0, deadline - time.monotonic()))
            first = json.loads(f.readline() or "{}")
        except (OSError, ValueError):
            return "refused"
        if "pid" not in first:
            return "refused"
        try:
            s.settimeout(max(1.0, deadline - time.monotonic()))
            last = json.loads(f.readline() or "{}")
        except TimeoutError:
            with contextlib.suppress(OSError):
                os.kill(first["pid"], signal.SIGKILL)
            return None
        except (OSError, ValueError):
            return 1
        return last.get("rc", 1)


def stop_all(folder: str | os.PathLike) -> None:
    """End every zygote of ``folder`` (a test session's teardown)."""
    for pid_file in Path(folder).glob("*.pid"):
        with contextlib.suppress(ValueError, OSError):
            os.killpg(int(pid_file.read_text()), signal.SIGTERM)
        with contextlib.suppress(OSError):
            pid_file.unlink()
