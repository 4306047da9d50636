"""jsonstream: a JSON object read an entry at a time gives what json.loads gives, whatever the
piece size (strings, escapes, non-ASCII, numbers cut at a piece boundary), and refuses what json.loads
refuses."""

from __future__ import annotations

import json

import pytest

from kimi_convert import jsonstream

INDEX = {"metadata": {"total_size": 1234567890123, "note": "sp\u00e9cial \"q\" \\ \u2603"},
         "weight_map": {f"model.layers.{i}.mlp.experts.{i * 7}.w1.weight\u00e9": f"model-{i % 3:05d}.safetensors"
                        for i in range(300)},
         "after": [1, 2.5, None, True, {"x": "y"}]}


def read(path, streamed="weight_map", piece: int = jsonstream.PIECE) -> dict:
    out: dict = {}
    for k, v in jsonstream.iter_object(path, streamed, piece):
        if k == streamed:
            out.setdefault(k, {})[v[0]] = v[1]
        else:
            out[k] = v
    return out


@pytest.mark.parametrize("piece", [1, 3, 7, 64, 1 << 20])
@pytest.mark.parametrize("indent", [None, 2])
def test_same_as_json_loads(tmp_path, piece, indent):
    p = tmp_path / "index.json"
    p.write_text(json.dumps(INDEX, indent=indent, ensure_ascii=indent is None), encoding="utf-8")
    assert read(p, piece=piece) == json.loads(p.read_text(encoding="utf-8")) == INDEX
    p.write_text('{"metadata": {"total_size": 12345}, "weight_map": {}}')
    assert read(p, piece=piece) == {"metadata": {"total_size": 12345}}  # an empty streamed object: no entries


@pytest.mark.parametrize("text", ['{"a": 1', '{"a": 1} x', '{"a" 1}', '{"weight_map": {"a": "b",}}', '',
                                  '{"weight_map": {"a": "b" "c": "d"}}', '{"a": 12', '{"weight_map": {"a": "b'])
def test_refuses_what_json_refuses(tmp_path, text):
    p = tmp_path / "bad.json"
    p.write_text(text)
    with pytest.raises(ValueError):
        json.loads(text)
    with pytest.raises(ValueError):
        read(p, piece=4)


def test_refuses_json_that_is_not_an_object(tmp_path):
    p = tmp_path / "list.json"
    p.write_text("[1]")
    with pytest.raises(ValueError):
        read(p)
