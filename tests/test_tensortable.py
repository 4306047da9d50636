"""``tensortable.TensorTable``: the input's tensors held as columns read as the dict of ``TensorInfo`` they replace,
including across a process whose string hashes differ (a worker, a Ray task)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest

from kimi_convert import tensortable
from kimi_convert.safetensors_format import TensorInfo
from kimi_convert.tensortable import TensorTable


def _infos(n: int = 300) -> list[TensorInfo]:
    out, pos = [], 8
    for i in range(n):
        shape = (i % 7 + 1, 3) if i % 5 else ()
        size = 2 * (shape[0] * shape[1] if shape else 1)
        name = f"model.layers.{i}.mlp.ü{'x' * (i % 13)}.weight"  # non-ASCII names and lengths vary
        out.append(TensorInfo(name, f"model-{i % 3 + 1:05d}.safetensors", "BF16" if i % 2 else "F8_E4M3", shape,
                              pos, pos + size))
        pos += size
    return out


def test_it_reads_as_the_dict_it_replaces():
    infos = _infos()
    d = {t.name: t for t in infos}
    t = TensorTable(infos[:100])
    t.add(infos[100:])
    assert len(t) == len(d) and list(t) == list(d)  # insertion order, as a dict
    assert list(t.items()) == list(d.items()) and list(t.values()) == list(d.values())
    assert dict(t) == d and t == d
    assert all(t[name] == info and name in t for name, info in d.items())
    assert t.get("model.layers.0.mlp.weight") is None and "model.layers.0.mlp.weight" not in t and 3 not in t
    with pytest.raises(KeyError):
        t["nope"]
    assert t.isdisjoint(["a", "b"]) and not t.isdisjoint(["a", infos[7].name])
    assert TensorTable().isdisjoint([infos[0].name]) and not TensorTable()


def test_a_name_whose_hash_collides_is_told_apart_by_its_bytes(monkeypatch):
    monkeypatch.setattr(tensortable, "hash", lambda name: 7, raising=False)  # one hash: only the bytes tell apart
    infos = _infos(50)
    t = TensorTable(infos)
    assert all(t[i.name] == i for i in infos) and "model.layers.1.mlp.weight" not in t


def test_a_lookup_after_an_add_sees_the_new_rows():
    infos = _infos(20)
    t = TensorTable(infos[:10])
    assert infos[15].name not in t  # the sorted hashes made here ...
    t.add(infos[10:])
    assert t[infos[15].name] == infos[15]  # ... made again after the add


def test_pickled_into_a_process_with_other_string_hashes_it_still_finds_every_name(tmp_path):
    infos = _infos()
    blob = tmp_path / "t.pkl"
    blob.write_bytes(pickle.dumps(TensorTable(infos)))
    code = ("import pickle, sys; t = pickle.loads(open(sys.argv[1], 'rb').read()); "
            "print(sum(t[n].name == n for n in sys.argv[2:]), len(t))")
    names = [i.name for i in infos[::37]]
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code, str(blob), *names], capture_output=True, text=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}, check=True).stdout.split()
        assert out == [str(len(names)), str(len(infos))]
