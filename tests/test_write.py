"""The shard writer: its bytes past the page cache (``write.DirectStage``) while they come in file order, through it
otherwise, the same file either way; a file system that refuses direct writes at the open or at a write loses no
byte; and whole packs with and without direct writes give the same files."""

from __future__ import annotations

import errno
import fcntl
import os
import random

import pytest
from safetensors import safe_open

from kimi_convert import write
from kimi_convert.options import Options
from kimi_convert.pack import pack
from kimi_convert.plan.model import OutTensor, Placed, Shard
from kimi_convert.safetensors_format import encode_header
from kimi_convert.tuning import Tuning

#: Tensors whose sizes cross the staging buffer's blocks and ends: the file's length is no multiple of a block.
SIZES = [13, 4096, 8191, 1, 20_000, 4095, 12_289, 7]


def _shard(sizes: list[int]) -> tuple[Shard, dict[str, bytes]]:
    """A shard of U8 tensors of ``sizes``, and random bytes for each."""
    tensors = [OutTensor(f"t{i}", "U8", (n,)) for i, n in enumerate(sizes)]
    ends = list(_accumulate(sizes))
    starts = [0, *ends[:-1]]
    base = len(encode_header(tensors, starts, ends))
    placed = tuple(Placed(t, base + a, base + b) for t, a, b in zip(tensors, starts, ends, strict=True))
    rng = random.Random(7)
    return Shard("s.safetensors", placed, base), {t.name: rng.randbytes(n) for t, n in zip(tensors, sizes,
                                                                                          strict=True)}


def _accumulate(sizes):
    total = 0
    for n in sizes:
        total += n
        yield total


def _expected(shard: Shard, data: dict[str, bytes]) -> bytes:
    return shard.header + b"".join(data[p.tensor.name] for p in shard.placed)


def _write(tmp_path, order: list[str], data: dict[str, bytes], shard: Shard, direct: int, pieces: int = 3):
    """Each tensor of ``order`` written in ``pieces`` chunks (a chunk at its offset into the tensor)."""
    w = write.ShardWriter(tmp_path, shard, writeback_every=1 << 30, direct_bytes=direct)
    for name in order:
        b = data[name]
        cut = max(1, len(b) // pieces)
        for at in range(0, len(b), cut):
            w.write(name, [b[at : at + cut]], at)
    return w


def _is_direct(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


@pytest.fixture
def direct_ok(tmp_path):
    """Skip where this file system refuses O_DIRECT altogether (tmpfs): the fallback tests below still run."""
    try:
        fd = os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
    except OSError as e:
        pytest.skip(f"{tmp_path}: no O_DIRECT here ({e.strerror})")
    os.close(fd)


def test_in_file_order_every_byte_goes_past_the_page_cache_and_the_file_is_the_planned_one(tmp_path, direct_ok,
                                                                                            monkeypatch):
    shard, data = _shard(SIZES)
    sent: dict[bool, int] = {True: 0, False: 0}
    real = os.pwrite

    def pwrite(fd, buf, offset):
        n = real(fd, buf, offset)
        sent[_is_direct(fd)] += n
        return n

    monkeypatch.setattr(write.os, "pwrite", pwrite)
    w = _write(tmp_path, [p.tensor.name for p in shard.placed], data, shard, direct=8192)
    assert w.direct
    w.finish()
    assert (tmp_path / shard.file).read_bytes() == _expected(shard, data)
    size = shard.size
    assert sent[True] == size // 4096 * 4096 and sent[False] == size % 4096  # only the last partial block cached


def test_a_write_out_of_file_order_sends_the_rest_through_the_page_cache(tmp_path, direct_ok):
    shard, data = _shard(SIZES)
    names = [p.tensor.name for p in shard.placed]
    order = [*names[:3], names[5], names[3], names[4], *names[6:]]
    w = _write(tmp_path, order[:4], data, shard, direct=8192)
    assert not w.direct  # the fourth tensor skipped ahead
    for name in order[4:]:
        w.write(name, [data[name]])
    w.finish()
    assert (tmp_path / shard.file).read_bytes() == _expected(shard, data)


def test_a_file_system_refusing_direct_writes_at_the_open_or_at_a_write_loses_no_byte(tmp_path, monkeypatch):
    shard, data = _shard(SIZES)
    names = [p.tensor.name for p in shard.placed]
    real_open, real_pwrite = os.open, os.pwrite

    def no_direct_open(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(write.os, "open", no_direct_open)
    (tmp_path / "a").mkdir()
    w = _write(tmp_path / "a", names, data, shard, direct=8192)
    assert not w.direct
    w.finish()
    assert (tmp_path / "a" / shard.file).read_bytes() == _expected(shard, data)
    monkeypatch.setattr(write.os, "open", real_open)

    def refusing_pwrite(fd, buf, offset):
        if _is_direct(fd):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, buf, offset)

    monkeypatch.setattr(write.os, "pwrite", refusing_pwrite)
    (tmp_path / "b").mkdir()
    w = _write(tmp_path / "b", names, data, shard, direct=8192)
    assert not w.direct  # the first full buffer was refused: its bytes and the rest through the page cache
    w.finish()
    assert (tmp_path / "b" / shard.file).read_bytes() == _expected(shard, data)


def test_another_error_of_a_direct_write_names_the_file(tmp_path, direct_ok, monkeypatch):
    shard, data = _shard(SIZES)
    real = os.pwrite

    def full(fd, buf, offset):
        if _is_direct(fd):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, buf, offset)

    monkeypatch.setattr(write.os, "pwrite", full)
    with pytest.raises(Exception) as e:
        _write(tmp_path, [p.tensor.name for p in shard.placed], data, shard, direct=8192)
    assert f"{shard.file}.partial: cannot write: No space left on device" in str(e.value)


@pytest.mark.parametrize("layout", ["source", "sglang"])
def test_packs_with_and_without_direct_writes_write_the_same_files(tiny_k3, tmp_path, layout):
    opts = Options(layout=layout, max_shard_size=300_000)
    pack(tiny_k3, tmp_path / "cached", opts, device="cpu", progress=False, tuning=Tuning(direct_write=0))
    pack(tiny_k3, tmp_path / "direct", opts, device="cpu", progress=False, tuning=Tuning(direct_write=4096))
    files = sorted(p.relative_to(tmp_path / "cached") for p in (tmp_path / "cached").rglob("*") if p.is_file())
    assert len([f for f in files if f.suffix == ".safetensors"]) > 1
    for f in files:
        assert (tmp_path / "direct" / f).read_bytes() == (tmp_path / "cached" / f).read_bytes(), f
    for f in (f for f in files if f.suffix == ".safetensors"):
        with safe_open(tmp_path / "direct" / f, "pt") as g:
            assert list(g.keys())
