"""Small helpers the tests share: edit a synthetic checkpoint, run the CLI."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
from pathlib import Path

import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from kimi_convert.cli import cli


def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_json(path: Path, fn) -> None:
    """Load a JSON file, let ``fn`` change it in place, write it back."""
    obj = json.loads(path.read_text())
    fn(obj)
    path.write_text(json.dumps(obj))


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


def run(*args: str):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


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


@contextlib.contextmanager
def child(args: list, **kw):
    """A child process that is killed if the test fails or times out before it ends (a paused
    ``pack`` would otherwise outlive the test run)."""
    p = subprocess.Popen([str(a) for a in args], **kw)
    try:
        yield p
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
