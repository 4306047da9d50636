"""Small helpers the tests share: edit a synthetic checkpoint, run the CLI."""

from __future__ import annotations

import json
import shutil
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
