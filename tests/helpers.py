"""Small helpers the tests share: edit a synthetic checkpoint, run the CLI.

The command line, two ways, one result type (:class:`Result`: exit code, stdout, stderr apart):

* :func:`run`: in this process (click's runner): fast; for everything that fails or finishes
  without needing a process of its own;
* :func:`run_process` / :func:`child`: ``python -m kimi_convert.cli`` as a real process, for what
  only a real process shows: kills and fault points (``KIMI_CONVERT_FAULT`` is read at import),
  signals, resource limits, environment read at import, and the real entry point's exit codes.

:func:`one_line_error` is the one assertion of the tool's user-error form for both.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from kimi_convert.cli import cli

# the Ray tests' one skip reason (tests/test_ray.py, tests/test_ray_hub.py); Ray itself is imported by the
# cluster only: every test process imports this module, and importing Ray costs 0.7 s
NO_RAY = ("" if importlib.util.find_spec("ray")
          else "needs Ray: pip install 'kimi-convert[ray]' (the test extras have it)")

needs_ray = pytest.mark.skipif(bool(NO_RAY), reason=NO_RAY or "-")


@contextlib.contextmanager
def local_ray_cluster(system_config: dict | None = None):
    """A Ray cluster of this machine's processes: a head that runs no task and two nodes of one CPU."""
    import ray.cluster_utils

    head = {"num_cpus": 0, "include_dashboard": False, **({"_system_config": system_config} if system_config else {})}
    c = ray.cluster_utils.Cluster(initialize_head=True, head_node_args=head)
    try:
        for _ in range(2):
            c.add_node(num_cpus=1)
        c.wait_for_nodes()
        yield c
    finally:
        c.shutdown()


def running_tasks(cluster) -> list[int]:
    """The cluster's worker processes running a pack task now (Ray titles them ``ray::TASK NAME``; a pack's tasks
    are named ``kimi-convert SHARDS``, raycluster.run)."""
    raylets = {p.process.pid for node in cluster.list_all_nodes() for p in node.all_processes.get("raylet", [])}
    found = []
    for proc in Path("/proc").iterdir():
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid in raylets and (proc / "cmdline").read_bytes().startswith(b"ray::kimi-convert "):
                found.append(int(proc.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def wait_ray_tasks_end(cluster, timeout: float = 60.0) -> None:
    """Until no worker of ``cluster`` runs a pack task: a killed driver's tasks go on until Ray notices and ends
    them, and one that is mid-upload stores its object after a resumed driver was told the object is missing (so
    it sends it again). A test that counts uploads across a driver's kill waits here, then for the Hub's quiet."""
    deadline = time.monotonic() + timeout
    while running_tasks(cluster):
        assert time.monotonic() < deadline, f"a pack task still runs {timeout:.0f} s after its driver died"
        time.sleep(0.2)


def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_json(path: Path, fn) -> None:
    """Load a JSON file, let ``fn`` change it in place, write it back."""
    obj = json.loads(path.read_text())
    fn(obj)
    path.write_text(json.dumps(obj))


def manifest_with_modules(folder: Path) -> dict:
    """manifest.json with its ``modules`` list as a version 2 manifest has it: from a version 3
    output, every records file's lines (each file's digest checked against manifest.json's listing),
    in the listing's order. Read here with json alone, not with the reader under test."""
    man = json.loads((folder / "manifest.json").read_text())
    if "modules" not in man:
        man["modules"] = []
        for e in man["records"]:
            data = (folder / e["file"]).read_bytes()
            assert entry_matches(e, data), e["file"]
            man["modules"] += [json.loads(line) for line in data.decode().splitlines()]
    return man


def entry_matches(entry: dict, data: bytes) -> bool:
    """Whether a manifest file entry (``inputs``, ``outputs``, ``records``, ``files``, ``side_files``) gives
    ``data``'s size and every digest it records (``blake3``, ``sha256``, at least one), computed here by the blake3
    package and hashlib themselves."""
    want = {"blake3": blake3_hex(data), "sha256": hashlib.sha256(data).hexdigest()}
    keys = [k for k in want if k in entry]
    return bool(keys) and all(entry[k] == want[k] for k in keys) and entry["size"] == len(data)


def file_entries(man: dict) -> list[dict]:
    """Every file entry of a manifest: its inputs, outputs, records files, other files and side files."""
    return [*man["inputs"], *man["outputs"], *man["records"], *man["files"], *man.get("side_files", [])]


def without_hub_digests(folder: Path) -> dict:
    """manifest.json of an uploaded output (``pack --upload``, or ``upload``) with the sha256 its uploads added beside
    each output file's BLAKE3 taken out, each one checked first against the file's bytes (hashlib's): what the
    manifest was before its upload."""
    man = json.loads((folder / "manifest.json").read_text())
    for section in ("outputs", "records", "files", "side_files"):
        for e in man.get(section, []):
            path = folder / e["file"]
            if path.is_file():
                assert e.pop("sha256") == hashlib.sha256(path.read_bytes()).hexdigest(), e["file"]
            else:  # a shard --no-keep-output removed: its sha256 is the Hub's to check
                e.pop("sha256")
    return man


def blake3_hex(data) -> str:
    """BLAKE3 (32 bytes, hex) of ``data``, from the blake3 package itself (what a record's ``blake3`` must be)."""
    import blake3

    return blake3.blake3(bytes(data)).hexdigest()


class TensorBytes(dict):
    """Every tensor's bytes in the ``.safetensors`` files under a folder (``tensor_bytes``), by name; a source
    part's name too: ``NAME[i]`` or ``NAME[i:j]`` is that index or those rows of NAME along its first dimension
    (how the plan names a part of a stored bank)."""

    def __init__(self):
        super().__init__()
        self.rows: dict[str, int] = {}  # each tensor's first dimension

    def __missing__(self, name: str) -> bytes:
        bank, _, index = name.rstrip("]").rpartition("[")
        if not bank or bank not in self:
            raise KeyError(name)
        lo, _, hi = index.partition(":")
        row = len(self[bank]) // self.rows[bank]
        return self[bank][int(lo) * row : (int(hi) if hi else int(lo) + 1) * row]


def tensor_bytes(folder: Path) -> TensorBytes:
    """Every tensor's bytes in the ``.safetensors`` files under ``folder``, cut from each file by its own header
    (the format: 8-byte length, JSON, data), not by the code under test; small checkpoints only."""
    out = TensorBytes()
    for p in sorted(folder.rglob("*.safetensors")):
        data = p.read_bytes()
        n = int.from_bytes(data[:8], "little")
        for name, info in json.loads(data[8 : 8 + n]).items():
            if name != "__metadata__":
                a, b = info["data_offsets"]
                out[name] = data[8 + n + a : 8 + n + b]
                out.rows[name] = (info["shape"] or [1])[0]
    return out


def as_format_4(out: Path, inp: Path) -> dict:
    """Rewrite a format_version 5 output (each file's BLAKE3) in place as format_version 4 wrote it: every file
    entry's ``blake3`` checked against the file's bytes (the output's, the input's for ``inputs``) and replaced by
    its sha256, ``format_version`` 4. Returns the manifest written. An earlier version's output, made without the
    code under test."""
    man = json.loads((out / "manifest.json").read_text())
    assert man["format_version"] == 5
    for e in file_entries(man):
        data = ((inp if e in man["inputs"] else out) / e["file"]).read_bytes()
        assert "blake3" in e and entry_matches(e, data), e["file"]
        del e["blake3"]
        e["sha256"] = hashlib.sha256(data).hexdigest()
    man["format_version"] = 4
    (out / "manifest.json").write_text(json.dumps(man, indent=1))
    return man


def as_format_3(out: Path, inp: Path) -> None:
    """Rewrite a format_version 5 output (BLAKE3 per tensor) in place as format_version 3 wrote it (``as_format_4``
    first: every file's sha256), then each record's
    ``blake3`` (output tensors, source parts) checked against the BLAKE3 of the tensor's bytes (``tensor_bytes``
    of ``out``, of the input ``inp``) and replaced, at the same place, by ``sha256`` of those bytes; the records
    files' listing in manifest.json redone for the new bytes; no ``tensor_digest``, ``format_version`` 3. An
    earlier version's output, made without the code under test (manifest.json's own layout aside)."""
    man = as_format_4(out, inp)
    assert man.pop("format_version") == 4 and man.pop("tensor_digest") == "blake3"
    got, src = tensor_bytes(out), tensor_bytes(inp)

    def sha(d: dict, data: dict[str, bytes]) -> dict:
        raw = data[d["name"]]
        assert d["blake3"] == blake3_hex(raw), d["name"]
        return {k: v for k, v in d.items() if k != "blake3"} | {"sha256": hashlib.sha256(raw).hexdigest()}

    for e in man["records"]:
        recs = [json.loads(line) for line in (out / e["file"]).read_text().splitlines()]
        for r in recs:
            r["tensors"] = [sha(t, got) for t in r["tensors"]]
            for s in r["sources"]:
                s["parts"] = [sha(p, src) for p in s["parts"]]
        data = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in recs).encode()
        (out / e["file"]).write_bytes(data)
        e.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    man = {"format": man.pop("format"), "format_version": 3, **man}
    (out / "manifest.json").write_text(json.dumps(man, indent=1))


def edit_config(folder: Path, fn) -> None:
    edit_json(folder / "config.json", fn)


def rewrite_tensors(folder: Path, fn) -> None:
    """Apply fn(dict name->tensor) to every shard's tensors and rewrite shards and index."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    new_map = {}
    for f in files:
        tensors = load_file(str(folder / f))
        fn(tensors)
        save_file(tensors, str(folder / f), metadata={"format": "pt"})
        new_map.update({k: f for k in tensors})
    index["weight_map"] = new_map
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def replace_tensor(folder: Path, name: str, value: torch.Tensor) -> None:
    """Store ``value`` as tensor ``name`` in whichever shard holds it."""
    def fn(tensors):
        if name in tensors:
            tensors[name] = value
    rewrite_tensors(folder, fn)


@dataclass(frozen=True)
class Result:
    """A finished command: ``code`` is the exit status (a real process killed by a signal: minus
    the signal's number), ``stdout`` and ``stderr`` apart."""

    code: int
    stdout: str
    stderr: str


def run(*args, env: dict[str, str] | None = None, tuning=None) -> Result:
    """``kimi-convert ARGS`` in this process. ``env`` is added to the environment for the call (only
    what the tool reads at call time: a fault point or a thread count needs :func:`run_process`); ``tuning``: a
    ``Tuning`` that ``pack`` uses instead of its defaults (the context's obj).
    An exception the CLI does not turn into its one-line error propagates (a bug, not an exit)."""
    r = CliRunner().invoke(cli, [str(a) for a in args], prog_name="kimi-convert", env=env, catch_exceptions=False,
                           obj=tuning)
    return Result(r.exit_code, r.stdout, r.stderr)


def cli_command(*args) -> list[str]:
    """The command line of the real entry point (for :func:`child`)."""
    return [sys.executable, "-m", "kimi_convert.cli", *map(str, args)]


def run_process(*args, env: dict[str, str] | None = None, replace_env: bool = False, timeout: float = 300,
                **kw) -> Result:
    """``python -m kimi_convert.cli ARGS`` as a real process. ``env`` is added to this environment,
    or replaces it with ``replace_env``; other keywords go to ``subprocess.run``."""
    full = dict(env or {}) if replace_env else {**os.environ, **(env or {})}
    r = subprocess.run(cli_command(*args), capture_output=True, text=True, env=full, timeout=timeout, **kw)
    return Result(r.returncode, r.stdout, r.stderr)


def one_line_error(r: Result) -> str:
    """The tool's user error: exit 2, stderr exactly one line ``kimi-convert: error: ...`` (no
    traceback, no click usage text, no progress bar); returns that line."""
    assert r.code == 2, (r.code, r.stderr)
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("kimi-convert: error: "), err
    assert "Traceback" not in err and "Usage:" not in err and "%|" not in err, err
    return err


#: The versions the Triton interpreter's byte-equality tests were checked with (the interpreter is numpy
#: code inside triton: a new triton or numpy may round differently on the CPU without any kernel change;
#: pyproject's test extras pin triton to this version).
INTERPRETER_HELD_FOR = {"torch": "2.13.0", "triton": "3.9.0", "numpy": "2.4.6"}


def interpreter_note(backend: str = "triton") -> str:
    """Assertion text for a Triton-interpreter byte comparison: the versions it held for, and these."""
    if backend != "triton":
        return backend
    import numpy
    import torch
    import triton
    now = {"torch": torch.__version__.split("+")[0], "triton": triton.__version__, "numpy": numpy.__version__}
    held = ", ".join(f"{k} {v}" for k, v in INTERPRETER_HELD_FOR.items())
    return f"triton (interpreter bytes held for {held}; installed: {', '.join(f'{k} {v}' for k, v in now.items())})"


def _default_signals() -> None:
    """In the child before it runs: SIGINT and SIGTERM at their default dispositions. A test run started where
    SIGINT is ignored (``nohup``, a script's background job) would otherwise hand that on, and Python then
    installs no KeyboardInterrupt handler: a test that sends SIGINT would wait on a child that never hears it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def readline_within(stream, seconds: float) -> str:
    """One line of a child's pipe, or an assertion after ``seconds`` (never a wait without a bound)."""
    ready, _, _ = select.select([stream], [], [], seconds)
    assert ready, f"no line within {seconds} s"
    return stream.readline()


@contextlib.contextmanager
def child(args: list, **kw):
    """A child process that is killed if the test fails or times out before it ends (a paused
    ``pack`` would otherwise outlive the test run); its SIGINT and SIGTERM at their defaults, whatever this
    process's are (:func:`_default_signals`)."""
    p = subprocess.Popen([str(a) for a in args], preexec_fn=_default_signals, **kw)
    try:
        yield p
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def weight_map(folder: Path) -> dict[str, str]:
    """A checkpoint's index: tensor name -> shard file."""
    return json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path -> bytes): two outputs compared whole, manifest included."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, by name (small test checkpoints only)."""
    from safetensors import safe_open

    out = {}
    for shard in sorted(set(weight_map(folder).values())):
        with safe_open(str(folder / shard), "pt") as f:
            names = list(f.keys())  # safe_open is not a dict
            out.update({k: f.get_tensor(k) for k in names})
    return out


#: the presets only the tests use (docs/presets.md): spec files on the package's families or their own
TEST_PRESETS = Path(__file__).resolve().parent / "presets"


def spec(name: str) -> str:
    """The synth preset ``name`` as ``synth`` takes it: a built-in name or ``tests/presets/F.toml:name``."""
    from kimi_convert.synth import find_preset

    return find_preset(name, [TEST_PRESETS])


def synth_preset(name: str, **over):
    """The resolved preset ``name`` (built in or the tests'), with ``layers/experts/shards`` overrides."""
    from kimi_convert.synth import load_preset

    return load_preset(spec(name), **over)


def write_synth(name: str, out, **kw) -> Path:
    """``kimi-convert synth`` of a built-in or a tests' preset, in process."""
    from kimi_convert import synth

    return synth.write_synth(spec(name), out, **kw)


def all_presets() -> list[str]:
    """Every preset: the built-in ones, then the tests' (tests/presets/*.toml)."""
    import tomllib

    from kimi_convert.synth import builtin_presets

    tests = [n for f in sorted(TEST_PRESETS.glob("*.toml")) for n in tomllib.loads(f.read_text())["presets"]]
    return [*builtin_presets(), *tests]


def plan_kinds(src: Path, options=None) -> dict[str, str]:
    """Each planned item's kind (NVFP4, kept, ...) by its module name, under ``options`` (default: the defaults)."""
    from kimi_convert.options import Options
    from kimi_convert.pack import load_plan

    _, plan = load_plan(src, options or Options())
    return {it.name: it.kind for u in plan.units for it in u.items}


#: ``pack`` on the CPUs with one worker and one stream: which shards a kill leaves finished depends on the streams
ONE_STREAM = ["-q", "--device", "cpu", "--workers", "1", "--streams", "1"]


def synth_and_pack(work: Path, pack_args: list, *synth_args) -> tuple[Path, Path]:
    """``tiny-k3`` (with ``synth_args``) written to ``work/in`` and packed to ``work/ref`` with ``pack_args``: a
    module's input and its reference pack."""
    assert run("synth", "tiny-k3", work / "in", *synth_args).code == 0
    r = run("pack", work / "in", work / "ref", *pack_args)
    assert r.code == 0, r.stderr
    return work / "in", work / "ref"


def engine_file(engine: str, rel: str) -> Path | None:
    """The pinned engine's installed source ``rel`` (under its package: vLLM's ``model_executor/models/x.py``,
    SGLang's ``srt/models/x.py``), the newest installed; None where the engine is not (the test then skips)."""
    root = Path.home() / ".cache" / "kimi-convert" / "engines"
    found = sorted(root.glob(f"{engine}-*/lib/python3*/site-packages/{engine}/{rel}"))
    return found[-1] if found else None


#: where each engine keeps its model files, under its package (``engine_file``'s ``rel``)
MODEL_DIRS = {"vllm": "model_executor/models", "sglang": "srt/models"}


def engine_file_or_skip(engine: str, rel: str) -> Path:
    """``engine_file``, the test skipped where the engine is not installed (``scripts/engine-envs.sh``)."""
    import pytest

    path = engine_file(engine, rel)
    if path is None:
        pytest.skip(f"no {engine} environment under ~/.cache/kimi-convert/engines")
    return path


def config_keys_read(text: str, names: str = "config") -> set[str]:
    """Each ``config.X`` a model file's text reads (not assigns), less those it guards with ``hasattr(config, "X")``:
    the keys the engine takes from config.json with no default (a family test holds its preset's config.json to
    them). ``names``: the names the file gives its config, a regex alternation (Grok's ``cfg|config|model_config``)."""
    read = set(re.findall(rf"\b(?:{names})\.([a-z_][a-z0-9_]*)\b(?!\s*=[^=])", text))
    return read - set(re.findall(r"hasattr\(\s*(?:self\.)?config,\s*\"(\w+)\"", text))  # guarded: optional keys


#: Presets whose family has neither a hand table nor a shipped derived one yet (plan derives theirs from the engines
#: where they are present; without them, one line). Tests that pack every preset leave them out. (Step-3 text ships
#: since session 41: its experts as stacked 3-D NVFP4 banks, docs/families.md, "Step-3 text"; so does Step 5, its DSA
#: projections kept BF16, "Step 5"; and IQuest-Q1, its expert banks kept BF16 as SGLang 0.5.23 reads them,
#: "IQuest-Q1".)
PRESETS_WITHOUT_TABLE = frozenset({# Inkling: its 3-D expert banks (interleaved gate / up rows) are read only as banks
                                   # by vLLM; SGLang takes only Thinking Machines' own quantization config; its MTP
                                   # depth is a rule the engine check does not know yet (docs/families.md, "Inkling")
                                   "tiny-inkling"})
