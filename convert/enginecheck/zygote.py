"""A fork server for the engine runners: the engine imported once, each check a fresh fork of that process.

Run by ``kimi_convert.enginecheck.server`` in the engine's python: ``python zygote.py RUNNER SOCKET``. Must not
import ``kimi_convert``. Why: an engine check on a tiny checkpoint spends most of its 20-30 s importing the engine
(vLLM 0.33's ``import_s`` plus ``config_s`` about 15 s of a 19 s run on 2 cores); a test suite with fifty checks
spends a quarter of an hour importing vLLM and SGLang. The zygote does what every runner does first (the
runner's ``preload``: its patches, then its imports), once, and then forks one child per request. Each child
starts from that same imported state, as a fresh process would after the same imports, and runs the
runner's own ``__main__`` unchanged (``runpy``), so every check is as isolated from the others as separate
processes are: nothing a check builds (its model, its distributed group, its vLLM config) exists in the
zygote or in the next child.

The one difference from a fresh process is which modules are already imported when the runner starts, so
the environment variables an import reads (``TRITON_INTERPRET``, ``LD_LIBRARY_PATH``, ...) are the zygote's:
a request whose values of ``IMPORT_TIME_ENV`` differ from the zygote's is refused (``{"refused": ...}``) and
the client runs that check in a process of its own instead.

Protocol, one request per connection on a Unix socket: the client sends one JSON line ``{"argv", "cwd",
"env", "log"}``; the zygote forks, answers ``{"pid": N}`` (the client kills N on its own timeout), waits for
the child and answers ``{"rc": status}``. One check at a time (the engine checks hold several GB each; the
test suite runs them one at a time anyway): later clients wait in the listen queue. The zygote exits after
``IDLE_S`` seconds without a request, or when told ``{"stop": true}``.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import socket
import sys
import time

#: Environment variables read when a module is imported (so a child's value must be the zygote's).
IMPORT_TIME_ENV = ("TRITON_INTERPRET", "LD_LIBRARY_PATH", "PYTHONPATH", "VLLM_CONFIGURE_LOGGING", "HF_HUB_OFFLINE",
                   "TRANSFORMERS_OFFLINE", "CUDA_VISIBLE_DEVICES")
IDLE_S = 1800.0


def preload(runner_file: str) -> None:
    """Import the runner as a module and call its ``preload()``: the patches and the imports its ``run`` starts
    with, in the same order and context, and the engine's model modules of the families the tool converts."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(runner_file)))
    runner = importlib.import_module(os.path.splitext(os.path.basename(runner_file))[0])
    runner.preload()


def send(conn: socket.socket, obj: dict) -> None:
    conn.sendall((json.dumps(obj) + "\n").encode())


def child(runner_file: str, req: dict, listener: socket.socket, conn: socket.socket) -> None:
    """In the forked child: the runner's ``__main__`` with the request's argv, cwd, environment and log."""
    code = 1
    try:
        listener.close()
        conn.close()
        fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.argv = [runner_file, *req["argv"]]
        try:
            runpy.run_path(runner_file, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(runner_file: str, path: str) -> None:
    t0 = time.perf_counter()
    mine = {k: os.environ.get(k) for k in IMPORT_TIME_ENV}  # before the imports, some of which set variables
    preload(runner_file)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    listener.settimeout(IDLE_S)
    print(json.dumps({"ready": path, "preload_s": round(time.perf_counter() - t0, 2)}), flush=True)
    try:
        while True:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                return
            with conn:
                try:
                    if not handle(runner_file, listener, conn, mine):
                        return
                except (OSError, ValueError):  # a client that went away, or sent no request (a liveness probe)
                    continue
    finally:
        listener.close()
        if os.path.exists(path):
            os.unlink(path)


def handle(runner_file: str, listener: socket.socket, conn: socket.socket, mine: dict) -> bool:
    """One connection: a check run in a forked child; False when told to stop."""
    conn.settimeout(60)
    line = conn.makefile("r").readline()
    if not line.strip():
        return True
    conn.settimeout(None)
    req = json.loads(line)
    if req.get("stop"):
        return False
    theirs = {k: req.get("env", {}).get(k) for k in IMPORT_TIME_ENV}
    if theirs != mine:
        send(conn, {"refused": sorted(k for k in mine if mine[k] != theirs[k])})
        return True
    pid = os.fork()
    if pid == 0:
        child(runner_file, req, listener, conn)
    try:
        send(conn, {"pid": pid})
    except OSError:  # the client is gone: nobody waits for this check
        os.kill(pid, 9)
        raise
    finally:
        _, status = os.waitpid(pid, 0)
    send(conn, {"rc": os.waitstatus_to_exitcode(status)})
    return True


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
