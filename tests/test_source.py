"""Reading headers and indexes: every malformed input is one ConvertError naming the file and tensor."""

from __future__ import annotations

import contextlib
import json
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kimi_convert.checkpoint import open_checkpoint
from kimi_convert.errors import ConvertError
from kimi_convert.safetensors_format import _parse_header_bytes, parse_header


def st_file(path, header: dict | bytes, data: bytes = b"", length: int | None = None):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


CASES = [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, None, "truncated"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, None, "needs 8 bytes"),
    ({"a": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 1]}}, b"\0", None, "unknown dtype 'Q7'"),
    ({"a": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}}, b"\0", None, "shape"),
    ({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
      "b": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}}, b"\0" * 3, None, "overlaps"),
    ({"a": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}}, b"\0" * 4, None, "hole"),
    ({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}, b"\0" * 5, None, "trailing bytes"),
    ({"a": {"dtype": "U8", "shape": [1], "data_offsets": [1]}}, b"\0", None, "data_offsets"),
    (b"[1, 2]", b"", None, "not a JSON object"),
    (b"{not json", b"", None, "not valid JSON"),
    (b"{}", b"", 50_000, "larger than the file"),
    (b"{}", b"", 200 * 1024 * 1024, "exceeds"),
]


@pytest.mark.parametrize(("header", "data", "length", "msg"), CASES)
def test_bad_headers(tmp_path, header, data, length, msg):
    p = st_file(tmp_path / "x.safetensors", header, data, length)
    with pytest.raises(ConvertError, match=msg) as e:
        parse_header(p, "x.safetensors")
    assert str(e.value).startswith("x.safetensors: ")


def test_tiny_file(tmp_path):
    (tmp_path / "x.safetensors").write_bytes(b"\1\2")
    with pytest.raises(ConvertError, match="truncated"):
        parse_header(tmp_path / "x.safetensors", "x.safetensors")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.integers(0, 400))
def test_fuzz_header_parser_raises_only_convert_error(raw, size):
    with contextlib.suppress(ConvertError):
        _parse_header_bytes(raw, "f", size)


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers(-5, 50) | st.text(max_size=5),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
                    max_leaves=12),
       st.integers(0, 300))
def test_fuzz_structured_headers(obj, size):
    raw = json.dumps({"t": obj}).encode()
    with contextlib.suppress(ConvertError):
        _parse_header_bytes(raw, "f", size)


def test_duplicate_tensor_across_shards(tmp_path):
    h = {"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}
    st_file(tmp_path / "1.safetensors", h, b"\0")
    st_file(tmp_path / "2.safetensors", h, b"\0")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConvertError, match="2.safetensors: tensor a is also stored in 1.safetensors"):
        open_checkpoint(tmp_path)


def test_index_names_tensor_not_in_file(tiny_kl, tmp_path):
    import shutil
    ck = tmp_path / "c"
    shutil.copytree(tiny_kl, ck)
    idx = json.loads((ck / "model.safetensors.index.json").read_text())
    idx["weight_map"]["model.ghost.weight"] = next(iter(idx["weight_map"].values()))
    (ck / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(ConvertError, match="tensor model.ghost.weight is not in model-00001"):
        open_checkpoint(ck)


def test_symlink_escaping_input(tiny_kl, tmp_path):
    import shutil
    ck = tmp_path / "c"
    shutil.copytree(tiny_kl, ck)
    outside = tmp_path / "outside.safetensors"
    shutil.move(ck / "model-00001-of-00004.safetensors", outside)
    (ck / "model-00001-of-00004.safetensors").symlink_to(outside)
    with pytest.raises(ConvertError, match="resolves outside the input folder"):
        open_checkpoint(ck)


def test_config_errors(tmp_path):
    with pytest.raises(ConvertError, match="config.json: missing"):
        open_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(ConvertError, match="config.json: not valid JSON"):
        open_checkpoint(tmp_path)
