"""The input read past the page cache (``Tuning.direct_read``, ``sources.local.LocalFile.readinto_direct``): the same
bytes as through the cache at any offset, length and buffer phase, down to the file's end; through the cache where the
file system refuses ``O_DIRECT``; a pack's reads of a span past the cache where its streams read at once, none where
they wait for torch (the start-up readahead fills the cache for them); the same output either way.
"""

from __future__ import annotations

import errno
import itertools
import os

import numpy as np
import pytest

from helpers import tree, write_synth
from kimi_convert.pack import pack
from kimi_convert.pipeline.slicing import Read, pieces
from kimi_convert.plan import Options
from kimi_convert.sources.local import ALIGN, LocalFile
from kimi_convert.tuning import Tuning

SGLANG = {"layout": "sglang", "recipe": "nvfp4-w4a16"}  # (test_pipeline's)


def _file(tmp_path, size: int) -> tuple[bytes, LocalFile]:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    f = LocalFile.open(path, str(path))
    if f._direct() < 0:
        pytest.skip(f"{tmp_path}: the file system refuses O_DIRECT")
    return data, f


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> tuple[bytes, LocalFile]:
    data, f = _file(tmp_path_factory.mktemp("direct"), (4 << 20) + 12345)
    yield data, f
    f.close()


def _read(f: LocalFile, offset: int, n: int, phase: int, how) -> bytes:
    """``n`` bytes at ``offset`` read with ``how`` into a buffer whose address is ``phase`` past a page boundary."""
    raw = np.zeros(n + 2 * ALIGN, dtype=np.uint8)
    at = (phase - raw.ctypes.data) % ALIGN
    view = memoryview(raw[at : at + n])
    got = 0
    while got < n:
        k = how(offset + got, view[got:])
        if k == 0:
            break
        got += k
    return bytes(view[:got])


@pytest.mark.parametrize("offset", [0, 1, ALIGN - 1, ALIGN, 3 * ALIGN + 17])
@pytest.mark.parametrize("n", [1, ALIGN - 5, ALIGN, 5 * ALIGN + 3, 3 << 20])
@pytest.mark.parametrize("phase", ["file", 0, 16, 1000])
def test_a_read_past_the_page_cache_is_the_files_bytes(big, offset, n, phase):
    """Any offset, length and buffer address (at the file offset's phase: the disk's bytes land in the buffer; at
    another: through the staging buffer), the file's end within the read or not."""
    data, f = big
    for off in (offset, len(data) - n + 7):  # the read inside the file, then running past its end
        at = off % ALIGN if phase == "file" else phase
        assert _read(f, off, n, at, f.readinto_direct) == data[off : off + n]


def test_a_file_system_that_refuses_o_direct_is_read_through_the_cache(tmp_path, monkeypatch):
    """``O_DIRECT`` refused at the open (tmpfs), or at the first read (a block larger than ``ALIGN``): the same bytes,
    through the page cache, and the file is not asked again."""
    data, f = _file(tmp_path, 3 * ALIGN + 99)
    f.close()
    real_open = os.open

    def refusing_open(path, flags, *a, **k):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", refusing_open)
    g = LocalFile.open(tmp_path / "f.bin", "f.bin")
    assert _read(g, 5, len(data) - 5, 0, g.readinto_direct) == data[5:] and g._direct_fd == -1
    g.close()
    monkeypatch.setattr(os, "open", real_open)

    h = LocalFile.open(tmp_path / "f.bin", "f.bin")
    real_preadv, calls = os.preadv, []

    def refusing_preadv(fd, bufs, offset, *a):
        if fd == h._direct_fd:
            calls.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, bufs, offset, *a)

    monkeypatch.setattr(os, "preadv", refusing_preadv)
    assert _read(h, 0, len(data), 0, h.readinto_direct) == data and h._direct_fd == -1 and len(calls) == 1
    h.close()


def test_a_pieces_reads_come_in_spans_that_lie_one_after_the_other(tiny_k3):
    """``Piece.spans``: the reads cut where the next does not start where the last ended in the same file."""
    from kimi_convert.pack import load_plan

    _, plan = load_plan(tiny_k3, Options(**SGLANG))
    order = {f: i for i, f in enumerate(sorted({p.file for u in plan.units for p in u.parts}))}
    cuts = 0
    for pc in pieces(list(plan.units), order, 1 << 20):
        assert [r for span in pc.spans for r in span] == list(pc.reads)
        for span in pc.spans:
            assert all(a.part.file == b.part.file and a.file_range[1] == b.file_range[0]
                       for a, b in itertools.pairwise(span))
        for a, b in itertools.pairwise(pc.spans):
            cuts += 1
            assert (a[-1].part.file, a[-1].file_range[1]) != (b[0].part.file, b[0].file_range[0])
    assert cuts and isinstance(pc.spans[0][0], Read)


def _count_direct(monkeypatch) -> list[int]:
    seen: list[int] = []
    real = LocalFile.readinto_direct

    def counting(self, offset, buf):
        n = real(self, offset, buf)
        seen.append(n)
        return n

    monkeypatch.setattr(LocalFile, "readinto_direct", counting)
    return seen


def test_a_pack_read_past_the_page_cache_writes_the_same_bytes(tiny_k3, tmp_path, monkeypatch):
    """``--device cpu`` where the C kernels take every unit: the spans of at least ``direct_read`` bytes read past
    the page cache, small pieces (odd phases in the buffers) included; the output the same as through the cache."""
    probe = LocalFile.open(next(tiny_k3.glob("*.safetensors")), "probe")
    if probe._direct() < 0:
        pytest.skip(f"{tiny_k3}: the file system refuses O_DIRECT")
    probe.close()
    opts = Options(**SGLANG, max_shard_size=400_000)
    seen = _count_direct(monkeypatch)
    r = pack(tiny_k3, tmp_path / "cached", opts, device="cpu", progress=False, tuning=Tuning(direct_read=0))
    assert seen == []
    past: dict[int, int] = {}
    calls: dict[int, int] = {}
    for threshold in (1, 64 << 10):
        pack(tiny_k3, tmp_path / f"direct-{threshold}", opts, device="cpu", progress=False,
             tuning=Tuning(slice_bytes=12_345, direct_read=threshold))
        assert tree(tmp_path / f"direct-{threshold}") == tree(tmp_path / "cached")
        past[threshold], calls[threshold] = sum(seen), len(seen)
        seen.clear()
    # every byte the streams read, past the cache, in whole blocks: at most a block more each side of a span
    assert r.bytes_in <= past[1] <= r.bytes_in + 2 * ALIGN * calls[1]
    assert 0 < past[64 << 10] < r.bytes_in  # the spans of 64 KiB and more only


def test_what_a_file_hash_reads_again_the_stream_reads_through_the_cache(tmp_path, monkeypatch):
    """DeepSeek V4's layout (an expert's scales among the layer's scales, its weights after the attention) with no hold
    budget: its file hashes read ranges again (``hashing.chain_reads``' ``twice``), and the stream reads every span
    holding one through the page cache, where the hash's read finds it, whatever its size; the other spans of
    ``direct_read`` bytes past it (``LocalFile.readinto_direct``, whole blocks). The output the same as through the
    cache."""
    from kimi_convert import readers
    from kimi_convert.pipeline import stream

    src = write_synth("tiny-deepseek-v4", tmp_path / "in", seed=0)
    probe = LocalFile.open(next(src.glob("*.safetensors")), "probe")
    if probe._direct() < 0:
        pytest.skip(f"{src}: the file system refuses O_DIRECT")
    probe.close()
    twice: set[tuple[str, int]] = set()
    spans: list[tuple[str, int, int, bool]] = []  # file, first and end byte, past the cache
    real_reader, real_read_spans = stream.PreadReader, readers.PreadReader.read_spans

    def reader(*a, **k):
        twice.update(k.get("twice", ()))
        return real_reader(*a, **k)

    def read_spans(self, base, spans_, places):
        for sp in spans_:
            a, b = sp[0].file_range[0], sp[-1].file_range[1]
            spans.append((sp[0].part.file, a, b, self.past_cache(sp)))
        return real_read_spans(self, base, spans_, places)

    monkeypatch.setattr(stream, "PreadReader", reader)
    monkeypatch.setattr(readers.PreadReader, "read_spans", read_spans)
    direct = _count_direct(monkeypatch)
    opts = Options(recipe="nvidia-dsv4")
    pack(src, tmp_path / "cached", opts, device="cpu", progress=False, tuning=Tuning(direct_read=0))
    assert not twice and not direct and not any(past for *_, past in spans)
    spans.clear()
    pack(src, tmp_path / "direct", opts, device="cpu", progress=False, tuning=Tuning(direct_read=1, hold_bytes=0))
    assert tree(tmp_path / "direct") == tree(tmp_path / "cached")
    assert twice and direct and any(past for *_, past in spans)
    for f, at in twice:  # read once by the stream, through the cache
        assert [past for g, a, b, past in spans if g == f and a <= at < b] == [False], (f, at)
    for f, a, b, past in spans:  # and nothing else kept from going past it
        assert past == (not any(g == f and a <= at < b for g, at in twice)), (f, a, b)


def test_a_pack_whose_streams_wait_for_torch_reads_through_the_cache(tiny_k3, tmp_path, monkeypatch):
    """Where a unit needs torch the start-up readahead fills the page cache while torch loads: the streams then read
    through it, not past it (which would read those bytes twice)."""
    from kimi_convert import compute_early

    seen = _count_direct(monkeypatch)
    monkeypatch.setattr(compute_early, "takes", lambda unit: False)
    opts = Options(**SGLANG, max_shard_size=400_000)
    pack(tiny_k3, tmp_path / "torch", opts, device="cpu", progress=False, tuning=Tuning(direct_read=1))
    assert seen == []


@pytest.mark.parametrize("twice", [False, True])
def test_a_span_past_the_page_cache_is_one_read_of_whole_blocks(big, monkeypatch, twice):
    """``PreadReader.read_spans``: each span of ``direct`` bytes or more is one read past the page cache, from the
    block its first byte is in to the end of its last block (the end of the file for the last one), placed
    (``place``) so that the blocks' other bytes land in room of its own: every span's bytes are the file's whatever
    its offset and length, and no span's read overwrites another's. Before, a span's unaligned head and tail were
    reads of their own (a disk's round trip each); small spans go through the page cache, one read each too, and so
    do large ones that a file's digest chain reads again (``twice``: the first and the last here)."""
    from dataclasses import dataclass

    from kimi_convert.readers import PreadReader

    data, f = big

    @dataclass(frozen=True)
    class Part:
        file: str
        start: int
        nbytes: int
        name: str = "t"

    @dataclass(frozen=True)
    class Range:
        part: Part
        lo: int
        hi: int

    name = os.path.basename(f._path)
    cuts = [(5, 3 * ALIGN + 7), (3 * ALIGN + 7, 3 * ALIGN + 9), (3 * ALIGN + 9, (2 << 20) + 1), (100, 200),
            ((2 << 20) + 1, (2 << 20) + 1 + 5 * ALIGN), (len(data) - 3 * ALIGN - 11, len(data))]
    spans = [[Range(Part(name, a, b - a), 0, b - a)] for a, b in cuts]
    direct, cached = _count_direct(monkeypatch), []
    real = LocalFile.readinto
    monkeypatch.setattr(LocalFile, "readinto", lambda self, off, buf: cached.append(off) or real(self, off, buf))
    again = {(name, 5), (name, len(data) - 3 * ALIGN - 11)} if twice else set()
    reader = PreadReader(os.path.dirname(f._path), direct=ALIGN, twice=again)
    base = np.full(sum(b - a for a, b in cuts) + reader.room(spans), 0xAB, dtype=np.uint8)
    places = reader.place(spans, base.ctypes.data)
    reader.read_spans(base, spans, places)
    for (a, b), at in zip(cuts, places, strict=True):
        assert bytes(base[at : at + b - a]) == data[a:b]
    # (3 * ALIGN + 7, + 9) and (100, 200) are under ALIGN bytes
    assert (len(direct), sorted(cached)) == ((2, [5, 100, 3 * ALIGN + 7, len(data) - 3 * ALIGN - 11]) if twice
                                             else (4, [100, 3 * ALIGN + 7]))
    reader.close()
