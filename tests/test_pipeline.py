"""The streaming pipeline's parts: ordered hashing, pieces, buffer reuse, write-order layout, and
whole packs that must not depend on slice size, hold budget or the number of workers."""

from __future__ import annotations

import hashlib
import itertools
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import blake3
import numpy as np
import pytest

from helpers import blake3_hex, child, cli_command, copy_ckpt, entry_matches, one_line_error, run, run_process, tree
from kimi_convert import pipeline
from kimi_convert.hashing import FileHasher, HoldBudget, SerialHasher, chain_reads
from kimi_convert.pack import load_plan, pack
from kimi_convert.plan import Options, OutTensor
from kimi_convert.plan import layout as plan_layout
from kimi_convert.readers import BufferPool
from kimi_convert.tuning import Tuning

# Many small shards: SGLang's fused layout with its own shard size (the source layout keeps the input's files).
SGLANG = {"layout": "sglang", "recipe": "nvfp4-w4a16"}
SGLANG_ARGS = ["--layout", "sglang", "--recipe", "nvfp4-w4a16"]


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(4) as ex:
        yield ex


@pytest.mark.parametrize("digest", ["sha256", "blake3"])
def test_serial_hasher_keeps_feed_order_across_threads(pool, digest):
    blocks = [random.Random(i).randbytes(random.Random(i).randint(0, 5000)) for i in range(200)]
    h = SerialHasher(pool, digest=digest)
    futs = [h.feed(b) for b in blocks]
    want = hashlib.sha256 if digest == "sha256" else blake3.blake3
    assert h.hexdigest().result() == want(b"".join(blocks)).hexdigest()
    assert all(f.done() for f in futs)


def test_tensor_digest_is_blake3_of_any_buffers_bytes(pool):
    """A tensor's digest (``TENSOR_DIGEST``, the default) takes its chunks as the pipeline has them: uint8
    buffers, slices of them, other dtypes (blake3 itself takes only byte buffers), bytes."""
    import numpy as np

    rng = np.random.default_rng(0)
    chunks = [rng.integers(0, 255, 1000, dtype=np.uint8), rng.standard_normal((7, 5)).astype(np.float16),
              memoryview(rng.standard_normal(9).astype(">f4")), b"tail", np.arange(3, dtype=np.int32)[1:]]
    h = SerialHasher(pool)
    for c in chunks:
        h.feed(c)
    assert h.hexdigest().result() == blake3.blake3(b"".join(bytes(memoryview(c)) for c in chunks)).hexdigest()


def _ranges(rng: random.Random, size: int) -> list[tuple[int, int]]:
    """Disjoint ranges over [0, size) with gaps between some of them (like tensors after a header)."""
    cuts = sorted(rng.sample(range(1, size), 40))
    spans = list(zip([0, *cuts], [*cuts, size], strict=True))
    return [s for s in spans if rng.random() < 0.7]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budget", [0, 3000, 1 << 30])
@pytest.mark.parametrize("small", [0, 500])
def test_file_hash_from_offers_in_any_order_is_the_files_digest(tmp_path, pool, seed, budget, small):
    """A file's digest (BLAKE3; sha256, the Hub's, for seeds 1 and 4) from offers in order or not, held or dropped."""
    rng = random.Random(seed)
    digest = "sha256" if seed % 3 == 1 else "blake3"
    data = rng.randbytes(20_000 + seed)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    expected = _ranges(rng, len(data))
    order = expected[:]
    if seed % 2:
        rng.shuffle(order)  # out of order: held within the budget, else read again
    fh = FileHasher(path, len(data), expected, pool, HoldBudget(budget), small=small, digest=digest)
    for a, b in order:
        fut, held = fh.offer(a, [data[a : (a + b) // 2], data[(a + b) // 2 : b]])
        assert not (fut is not None and held)
    assert fh.finish().result() == (hashlib.sha256(data).hexdigest() if digest == "sha256" else blake3_hex(data))
    assert fh.from_pipeline + fh.reread == len(data)
    gaps = len(data) - sum(b - a for a, b in expected)
    if seed % 2 == 0:  # in order: only the gaps are read from the file
        assert fh.reread == gaps
    elif budget == 0:
        assert fh.from_pipeline <= sum(b - a for a, b in expected)


@pytest.mark.parametrize("small", [0, 64])
def test_file_hash_reads_small_ranges_itself_once_an_offer_is_dropped(tmp_path, pool, small):
    """A file stored by dtype width (eight 16-byte ``weight_shape`` ranges first, then the eight 1000-byte codes
    they go with) read unit by unit, each unit's small range then its large one, with no hold budget: waiting for
    every small range (``small`` 0) dropped each large offer but the last and read it again; reading the small
    ones itself once an offer is dropped (``small`` 64), the chain reads again only the first dropped offer and the
    small ranges after it, and the pipeline's later offers of those are ignored (neither hashed nor held)."""
    data = random.Random(9).randbytes(100 + 8 * 16 + 8 * 1000)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    shapes = [(100 + 16 * k, 116 + 16 * k) for k in range(8)]
    codes = [(228 + 1000 * k, 1228 + 1000 * k) for k in range(8)]
    fh = FileHasher(path, len(data), shapes + codes, pool, HoldBudget(0), small=small)
    offers = []
    for (a, b), (c, d) in zip(shapes, codes, strict=True):
        offers += [fh.offer(a, [data[a:b]]), fh.offer(c, [data[c:d]])]
    assert fh.finish().result() == blake3_hex(data)
    assert fh.from_pipeline + fh.reread == len(data)
    assert not any(held for _, held in offers)
    if small:  # the header, the first unit's codes (the dropped offer) and the shapes after it
        assert fh.reread == 100 + 1000 + 7 * 16
        assert [fut is not None for fut, _ in offers] == [True, False] + [False, True] * 7
    else:
        assert fh.reread == 100 + 7 * 1000  # the header and every unit's codes but the last
        assert fh.from_pipeline == 8 * 16 + 1000


def test_file_hash_holds_count_the_whole_buffer_a_range_keeps_alive(tmp_path, pool):
    """Two ranges cut from one 4000-byte buffer (as the pipeline reads a piece's tensors into one pooled buffer),
    offered ahead of the cursor: the hold budget counts the buffer's 4000 bytes once while either is held in place,
    not the ranges' 200. With a budget of 5000 both are held in place (the buffer must not be reused); with 3000 the
    buffer does not fit, so each range is held as a copy of its own 100 bytes (the buffer free to reuse, nothing read
    again); with 150 the first is copied and the second, past the budget, dropped and read again. The budget is free
    again once they are hashed."""
    data = random.Random(3).randbytes(6000)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    piece = np.frombuffer(data, np.uint8)[1000:5000].copy()  # one buffer, bytes 1000-5000 of the file
    for limit, in_place, counted, hashed in ((5000, True, 4000, 200), (3000, False, 200, 200), (150, False, 100, 100)):
        budget = HoldBudget(limit)
        fh = FileHasher(path, len(data), [(0, 1000), (1000, 1100), (4900, 5000)], pool, budget)
        got = [fh.offer(1000, [piece[0:100]]), fh.offer(4900, [piece[3900:4000]])]
        assert [kept for _, kept in got] == [in_place, in_place]
        assert budget.held == counted
        fh.offer(0, [data[:1000]])
        assert fh.finish().result() == blake3_hex(data)
        assert budget.held == 0
        assert fh.reread == 6000 - 1000 - hashed  # the gaps, and any range dropped


def test_file_chain_reads_what_blocks_its_cursor_where_waiting_would_drop_more(tmp_path, pool):
    """A unit's bytes in two runs of the file, as DeepSeek V4 stores an expert (its scales among the layer's scales,
    its weights far after, the attention's weights between them, offered after every expert). Waiting for each
    range, the cursor stops at the first scale not yet offered and later at the attention: the weights offered
    meanwhile go past the 500-byte hold budget from the third on, and six of them (1200 bytes) are read again.
    ``chain_reads`` has the chain read the five scales offered late and the attention itself (350 bytes, fewer than
    waiting for them drops), and no offer is dropped. The digest is the file's either way."""
    data = random.Random(5).randbytes(2080)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    scales = [(100 + 10 * i, 110 + 10 * i) for i in range(8)]
    attention = (180, 480)
    weights = [(480 + 200 * i, 680 + 200 * i) for i in range(8)]
    order = [r for i in range(8) for r in (scales[i], weights[i])] + [attention]
    reads = chain_reads(order, 500)
    assert reads.own == {130, 140, 150, 160, 170, 180} and reads.dropped == frozenset()
    for chosen, reread in ((frozenset(), 100 + 1200), (reads.own, 100 + 50 + 300)):
        fh = FileHasher(path, len(data), order, pool, HoldBudget(500), own=chosen)
        for a, b in order:
            fh.offer(a, [data[a:b]])
        assert fh.finish().result() == blake3_hex(data)
        assert fh.reread == reread  # the header, and what the chain reads itself or again


@pytest.mark.parametrize("attention", [300, 1300])
@pytest.mark.parametrize("budget", [0, 150, 300, 500, 800])
def test_chain_reads_names_every_range_the_file_hash_reads_again(tmp_path, pool, attention, budget):
    """``chain_reads``' ``twice`` (its own reads and the offers it expects past the hold budget) is exactly what the
    file hash then reads from the file besides the header, at any budget: the pipeline reads those ranges through
    the page cache (``readers.PreadReader``), where the hash's read of them finds them. DeepSeek V4's layout again
    (eight 100-byte weights after the attention, offered before it): a 300-byte attention blocking the cursor is read
    by the chain rather than drop weights; a 1300-byte one costs more than the weights past the budget."""
    scales = [(100 + 10 * i, 110 + 10 * i) for i in range(8)]
    weights = [(180 + attention + 100 * i, 280 + attention + 100 * i) for i in range(8)]
    order = [r for i in range(8) for r in (scales[i], weights[i])] + [(180, 180 + attention)]
    data = random.Random(6).randbytes(weights[-1][1] + 20)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    reads = chain_reads(order, budget)
    assert not reads.own & reads.dropped
    assert bool(reads.dropped) == (budget < 800 and (attention > 300 or budget == 500))
    assert bool(reads.own) == (attention == 300 and budget < 500)
    fh = FileHasher(path, len(data), order, pool, HoldBudget(budget), own=reads.own)
    for a, b in order:
        fh.offer(a, [data[a:b]])
    assert fh.finish().result() == blake3_hex(data)
    ends = dict(order)
    assert fh.reread == 100 + 20 + sum(ends[a] - a for a in reads.twice)  # the header and the tail besides


def test_file_hash_reads_ahead_of_the_pipeline_only_where_may_take_allows(tmp_path, pool):
    """A hash whose queue runs dry at a range not offered reads it itself (a stalled pipeline does not stall
    the chain), but never a range ``may_take`` refuses: that one waits for its offer."""
    data = random.Random(7).randbytes(50_000)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    expected = [(100 + 1000 * i, 1100 + 1000 * i) for i in range(40)]  # header 0-100, gaps none, tail 40100-
    asked: list[int] = []

    def may_take(start: int) -> bool:
        asked.append(start)
        return start < 20_100

    fh = FileHasher(path, len(data), expected, pool, HoldBudget(0), may_take=may_take)
    deadline = time.monotonic() + 10
    while 20_100 not in asked and time.monotonic() < deadline:  # nothing offered: it runs up to the refusal
        time.sleep(0.01)
    assert fh.reread == 20_100 and fh.from_pipeline == 0
    assert fh.offer(5100, [data[5100:6100]]) == (None, False)  # taken already: not held, not hashed again
    fut, held = fh.offer(20_100, [data[20_100:21_100]])  # the refused range: from the pipeline
    assert fut is not None and not held
    fut.result()
    assert fh.from_pipeline == 1000
    assert fh.finish().result() == blake3_hex(data)
    assert fh.from_pipeline + fh.reread == len(data)


def test_an_idle_file_hash_woken_asks_may_take_again(tmp_path, pool):
    """A chain that ran dry where ``may_take`` refused stays idle (nothing more is offered) until woken: then it
    asks again, and reads ahead where the answer changed (a stream that starts waiting for torch)."""
    data = random.Random(8).randbytes(30_000)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    expected = [(100 + 1000 * i, 1100 + 1000 * i) for i in range(29)]
    allowed = threading.Event()
    asked: list[int] = []

    def may_take(start: int) -> bool:
        asked.append(start)
        return allowed.is_set()

    fh = FileHasher(path, len(data), expected, pool, HoldBudget(0), may_take=may_take)
    deadline = time.monotonic() + 10
    while not asked and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert asked == [100] and fh.reread == 100  # the header, then one refusal, and idle since
    allowed.set()
    fh.wake()
    while fh.reread < len(data) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fh.reread == len(data) and fh.from_pipeline == 0
    assert fh.finish().result() == blake3_hex(data)


def test_file_hashes_read_ahead_only_while_the_stream_waits_for_torch(tiny_k3, tmp_path, monkeypatch):
    """The input files' chains read ahead of the stream themselves while it waits for the runner (torch and the
    device: here made to take 1 s), not while it runs (then they hash what it reads: reading the same bytes beside
    it made them wait on the disk)."""
    from kimi_convert.pipeline import dispatch

    # many pieces (the stream reads them one by one), a tiny budget, no start-up readahead
    # (and no small tensors read by the chains: every tensor here is small, so those would be read whenever an offer
    # is dropped, which is not what this test counts)
    tuning = Tuning(eager_hash=1 << 40, startup_readahead=0, read_ahead=1, min_in_flight=1, slice_bytes=4096,
                    hash_reads_small=0)
    size = sum(p.stat().st_size for p in tiny_k3.glob("*.safetensors"))

    def packed(name: str, stall: float) -> tuple[int, dict]:
        made = dispatch.RunnerOnce.get

        def slow(self, device, block):
            time.sleep(stall)
            return made(self, device, block)

        monkeypatch.setattr(dispatch.RunnerOnce, "get", slow)
        monkeypatch.setattr(dispatch.Dispatch, "early_takes", lambda self, unit, device: False)  # via torch
        out = tmp_path / name
        r = pack(tiny_k3, out, Options(**SGLANG, max_shard_size=400_000), device="cpu", progress=False,
                 tuning=tuning, streams=1)  # (one stream hashes every file from its own reads: 4 CPUs a stream)
        monkeypatch.setattr(dispatch.RunnerOnce, "get", made)
        return r.stats.hash_reread, tree(out)

    packed("warm", 0)  # torch imported and its first runner made: the next pack's runner comes at once, loaded or not
    running, ref = packed("running", 0)
    stalled, out = packed("stalled", 1.0)
    assert out == ref
    import json

    inputs = {f["file"]: f for f in json.loads(ref["manifest.json"])["inputs"]}
    assert inputs and all(entry_matches(e, (tiny_k3 / f).read_bytes()) for f, e in inputs.items())
    assert running < size // 10  # headers and gaps only
    assert stalled > size // 2, (running, stalled, size)


def test_read_hints_come_from_a_thread_of_their_own(tiny_k3, tmp_path, monkeypatch):
    """Every read hint is given on the hint thread, never the reader's (a hint blocks while the disk's queue is
    full): the next piece at each read."""
    from kimi_convert import readers

    threads: set[str] = set()
    batches: list[int] = []
    need, hint = readers.PreadReader.will_need_span, pipeline.Stream._hint_quietly

    def watch_need(self, span):
        threads.add(threading.current_thread().name)
        return need(self, span)

    def watch_hint(self, js):
        batches.append(len(js))
        return hint(self, js)

    monkeypatch.setattr(readers.PreadReader, "will_need_span", watch_need)
    monkeypatch.setattr(pipeline.Stream, "_hint_quietly", watch_hint)
    opts = Options(**SGLANG, max_shard_size=400_000)
    pack(tiny_k3, tmp_path / "plain", opts, device="cpu", progress=False, tuning=Tuning(slice_bytes=4096))
    assert threads and all(t.startswith("kimi-convert-hints") for t in threads), threads
    assert len(batches) > 100 and set(batches) == {1}  # the next piece, read by read


def test_the_startup_readahead_runs_only_where_a_stream_will_wait_for_torch(tiny_k3, tmp_path, monkeypatch):
    """``--device cpu`` where the C kernels take every unit: no start-up readahead (the streams read at once, and its
    requests would only queue ahead of theirs); where a unit needs torch, the readahead of the first units' parts."""
    import kimi_convert.pack as pack_mod
    from kimi_convert import compute_early

    calls: list[int] = []
    done = threading.Event()

    def record(source, parts, budget):
        calls.append(len(parts))
        done.set()

    monkeypatch.setattr(pack_mod, "readahead", record)
    opts = Options(**SGLANG, max_shard_size=400_000)
    _, plan = load_plan(tiny_k3, opts)
    assert all(compute_early.takes(u) for u in plan.units)  # (the premise: every unit without torch)
    pack(tiny_k3, tmp_path / "early", opts, device="cpu", progress=False)
    for t in threading.enumerate():  # (the thread decides after the plan: once it has ended, it has decided)
        if t.name == "kimi-convert-readahead":
            t.join(30)
    assert calls == []
    monkeypatch.setattr(compute_early, "takes", lambda unit: False)
    pack(tiny_k3, tmp_path / "torch", opts, device="cpu", progress=False)
    assert done.wait(10) and calls and calls[0] == sum(len(u.parts) for u in plan.units)
    assert tree(tmp_path / "torch") == tree(tmp_path / "early")


def test_a_stream_reads_ahead_of_its_compute_up_to_its_bytes_not_three_pieces(tiny_k3, tmp_path, monkeypatch):
    """While the compute of the first piece is held up, the reader goes on: past its ``read_ahead`` pieces, while the
    bytes ahead are below ``read_ahead_bytes`` (the input file's chain then has bytes to hash while the compute or the
    writer waits); ``read_ahead_bytes=0``, or a worker of fewer than ``read_ahead_bytes_cpus`` CPUs: the three pieces
    only, as before. The same bytes either way."""
    opts = Options(**SGLANG, max_shard_size=400_000)
    compute = pipeline.Stream.compute
    default = Tuning()

    def packed(name: str, ahead: int, cpus: int = default.read_ahead_bytes_cpus) -> tuple[int, list[int], dict]:
        seen: list[tuple[int, list[int]]] = []

        def held_up(self, pc, loaded):
            if not seen:  # the first piece: wait until the reader has stopped (1 s without a read; a loaded CI)
                last, still = -1, 0
                for _ in range(2000):
                    time.sleep(0.01)
                    still = still + 1 if self.read_pos == last else 0
                    last = self.read_pos
                    if still >= 100:
                        break
                seen.append((self.read_pos, self.piece_at))
            return compute(self, pc, loaded)

        monkeypatch.setattr(pipeline.Stream, "compute", held_up)
        monkeypatch.setenv("KIMI_CONVERT_THREADS", str(cpus))
        out = tmp_path / name  # many small pieces, no start-up readahead
        pack(tiny_k3, out, opts, device="cpu", progress=False, streams=1,
             tuning=Tuning(slice_bytes=4096, startup_readahead=0, read_ahead_bytes=ahead))
        return seen[0][0], seen[0][1], tree(out)

    ahead = 100_000
    read, at, out = packed("ahead", ahead)
    queued = next(j for j in range(len(at)) if j > default.read_ahead and at[j] - at[0] >= ahead)
    assert len(at) > queued + 10 and read == at[queued]  # (not the whole input: the bound holds it)
    read, at, ref = packed("pieces", 0)
    assert read == at[default.read_ahead + 1]
    read, at, few = packed("few-cpus", ahead, default.read_ahead_bytes_cpus - 1)
    assert read == at[default.read_ahead + 1]
    assert out == ref == few

def test_a_timeline_keeps_at_most_its_limit_of_evenly_spaced_rows():
    """Past ``limit`` rows a timeline drops every other one and samples half as often: a long pack's record stays
    bounded and evenly spaced; ``stop`` adds a last row (the counters at the end)."""
    from kimi_convert.pipeline.timeline import Timeline

    n = itertools.count()
    tl = Timeline(lambda: (next(n), 0, 0, 0), every_s=0.005, limit=8)
    tl.start()
    time.sleep(0.5)
    out = tl.stop()
    rows = out["rows"]
    assert out["every_s"] > 0.005 and 2 <= len(rows) <= 9 + 1
    times = [r[0] for r in rows]
    assert times == sorted(times) and times[-1] >= 0.5
    assert [r[1] for r in rows] == sorted(r[1] for r in rows)  # the probe's count, in order
    gaps = [b - a for a, b in itertools.pairwise(times[:-1])]
    assert max(gaps) < 8 * min(gaps) + 0.25  # about even (the last row is stop's own; loose: a loaded machine)


def test_file_hash_ignores_unexpected_offers_and_stops(tmp_path, pool):
    data = bytes(range(256)) * 100
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    fh = FileHasher(path, len(data), [(100, 200)], pool, HoldBudget(0))
    assert fh.offer(150, [data[150:200]]) == (None, False)  # not a planned range: read from the file
    assert fh.finish().result() == blake3_hex(data)
    stop = threading.Event()
    stop.set()
    with pytest.raises(Exception, match="f.bin"):
        FileHasher(path, len(data), [], pool, HoldBudget(0), stop).finish().result()


def test_buffer_pool_reuses_and_bounds_what_it_holds():
    bp = BufferPool(limit=1000)
    a = bp.get(600)
    bp.put(a)
    assert bp.get(500).ctypes.data == a.ctypes.data  # the smallest free buffer that fits
    b = bp.get(300)  # 600 + 300 in use
    bp.put(a)
    bp.put(b)
    assert sorted(x.nbytes for x in bp._free) == [300, 600]
    c = bp.get(700)  # none fits: a new one, and free buffers go while the total exceeds the limit
    assert [x.nbytes for x in bp._free] == [300] and bp._in_use == 700
    bp.put(c, reuse=False)  # still referenced elsewhere: counted out, not kept
    assert [x.nbytes for x in bp._free] == [300] and bp._in_use == 0


def test_in_flight_budget_blocks_until_given_back_and_lets_a_huge_piece_pass_alone():
    stop = threading.Event()
    b = pipeline.ByteBudget(100, stop)
    b.take(500)  # larger than the budget: granted because nothing else is held
    got = threading.Event()
    t = threading.Thread(target=lambda: (b.take(10), got.set()))
    t.start()
    assert not got.wait(0.3)
    b.give(500)
    assert got.wait(5)
    t.join()
    b.take(90)
    stop.set()
    with pytest.raises(Exception, match="pack"):
        b.take(50)


def test_pieces_slice_pass_through_tensors_and_cover_every_byte(tiny_k3):
    ckpt, p = load_plan(tiny_k3, Options())
    order = {f: i for i, f in enumerate(ckpt.files)}
    ps = pipeline.pieces(list(p.units), order, slice_bytes=1000)
    assert all(pc.nbytes <= 1000 for pc in ps if pc.kind is pipeline.PieceKind.COPY)
    assert any(pc.kind is pipeline.PieceKind.COPY and not pc.last for pc in ps)  # some tensor did need slices
    seen: dict[str, list[tuple[int, int]]] = {}
    for pc in ps:
        for r in pc.reads:
            seen.setdefault(r.part.name, []).append((r.lo, r.hi))
    for u in p.units:
        for t in u.parts:
            spans = seen[t.name]
            assert spans[0][0] == 0 and spans[-1][1] == t.nbytes
            assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert sum(pc.last for pc in ps) == len(p.units)
    copies = [pc for pc in ps if pc.kind is pipeline.PieceKind.COPY]
    for a, b in itertools.pairwise(copies):  # a sliced tensor's output offsets run on
        if a.unit is b.unit:
            assert b.copy_at == a.copy_at + a.nbytes


def test_write_order_layout_and_its_alignment_fallback():
    t = [OutTensor("a.w", "U8", (3, 8)), OutTensor("a.s", "F8_E4M3", (3,)), OutTensor("a.g", "F32", ())]
    u = [OutTensor("b.w", "BF16", (4,)), OutTensor("b.g", "F32", ())]
    assert [x.name for x in plan_layout._in_write_order([t[:1] + t[2:], u])] == ["a.g", "a.w", "b.g", "b.w"]
    assert plan_layout._in_write_order([t, u]) is None  # 3 bytes of scales would misalign b.g
    shard = plan_layout._shard("s", [t, u])
    starts = {p.tensor.name: p.start - len(shard.header) for p in shard.placed}
    assert all(starts[p.tensor.name] % max(1, {"F32": 4, "BF16": 2}.get(p.tensor.dtype, 1)) == 0
               for p in shard.placed)


class InFlight:
    """Watches a pack's streams from outside the budget: a piece's bytes are held from the end of its
    read (the buffers ``load`` returns) to the end of its ``store``, plus what ``compute`` returns for a
    computed piece; ``peak`` is the most held at once, ``sizes`` each piece's bytes, both as observed."""

    def __init__(self, monkeypatch):
        self.lock = threading.Lock()
        self.held: dict[int, int] = {}
        self.sizes: list[int] = []
        self.peak = 0
        load, compute, store = pipeline.Stream.load, pipeline.Stream.compute, pipeline.Stream.store

        def nbytes(chunks) -> int:
            return sum(memoryview(c).nbytes for c in chunks)

        def watch_load(stream, i):
            res = load(stream, i)
            self._add(id(stream.pieces[i]), sum(nbytes([b]) for b in res[0].buffers.values()))
            return res

        def watch_compute(stream, pc, loaded):
            outputs, notes, release = compute(stream, pc, loaded)
            if pc.copy_at is None:  # a computed piece: its outputs are new bytes (a slice is written from its read)
                self._add(id(pc), sum(nbytes(cs) for cs in outputs.values()))
            return outputs, notes, release

        def watch_store(stream, pc, *args):
            try:
                return store(stream, pc, *args)
            finally:
                with self.lock:
                    self.sizes.append(self.held.pop(id(pc)))

        monkeypatch.setattr(pipeline.Stream, "load", watch_load)
        monkeypatch.setattr(pipeline.Stream, "compute", watch_compute)
        monkeypatch.setattr(pipeline.Stream, "store", watch_store)

    def _add(self, key: int, n: int) -> None:
        with self.lock:
            self.held[key] = self.held.get(key, 0) + n
            self.peak = max(self.peak, sum(self.held.values()))


def test_pack_does_not_depend_on_slice_size_hold_budget_or_layout(tiny_k3, tmp_path, monkeypatch):
    ref = tmp_path / "ref"
    pack(tiny_k3, ref, Options(**SGLANG, max_shard_size=400_000), device="cpu", progress=False)
    # a tiny budget (little held, more read again); the file hashes a head start, then the pipeline's bytes; pack's
    # eager share of the start-up readahead: none
    tuning = Tuning(slice_bytes=4096, read_ahead=1, min_in_flight=1, eager_hash=50_000, startup_readahead=0)
    watch = InFlight(monkeypatch)
    out = tmp_path / "sliced"
    r = pack(tiny_k3, out, Options(**SGLANG, max_shard_size=400_000), device="cpu", progress=False, streams=2,
             tuning=tuning)
    assert tree(out) == tree(ref)
    assert r.stats.hashed_from_pipeline > 0 and r.stats.streams == 2
    # memory, as observed: with the smallest budget, never more bytes held at once than the two largest
    # pieces (a read waits for the budget, not only for its turn), and never more than the budget it reports
    assert not watch.held and len(watch.sizes) > 100  # every piece seen through; small slices, many pieces
    two_largest = sum(sorted(watch.sizes)[-2:])
    assert max(watch.sizes) <= watch.peak <= two_largest, (watch.peak, sorted(watch.sizes)[-2:])
    assert watch.peak <= r.stats.in_flight_peak <= r.stats.in_flight_limit
    # the safetensors-style layout (wider dtypes first) is written out of order: the shard hashes
    # then read parts of the file back, and must still be the files' digests
    monkeypatch.setattr(plan_layout, "_in_write_order", lambda units: None)
    other = tmp_path / "sorted"
    pack(tiny_k3, other, Options(**SGLANG, max_shard_size=400_000), device="cpu", progress=False)
    import json

    man = json.loads((other / "manifest.json").read_text())
    for f in man["outputs"]:
        assert entry_matches(f, (other / f["file"]).read_bytes())


@pytest.mark.slow
@pytest.mark.parametrize(("workers", "streams"), [(1, 3), (2, 1), (3, 2)])
def test_workers_and_streams_give_the_same_bytes_as_one(tiny_k3, tmp_path, workers, streams):
    ref = tmp_path / "one"
    pack(tiny_k3, ref, Options(**SGLANG, max_shard_size=300_000), device="cpu", progress=False, workers=1, streams=1)
    out = tmp_path / f"w{workers}"
    r = pack(tiny_k3, out, Options(**SGLANG, max_shard_size=300_000), device="cpu", progress=False, workers=workers,
             streams=streams)
    assert (r.stats.workers, r.stats.streams) == (workers, workers * streams)
    assert tree(out) == tree(ref)
    # the records files included: each stream writes its shards' own, the same bytes
    assert sum(k.startswith("manifest-records/") for k in tree(ref)) == len(list(ref.glob("*.safetensors")))


def test_split_jobs_is_consecutive_balanced_and_hashes_each_input_once(tmp_path):
    from helpers import write_synth
    from kimi_convert.pack import split_jobs

    src = write_synth("tiny-k3", tmp_path / "in", seed=1, experts=16)
    ckpt, p = load_plan(src, Options(**SGLANG, max_shard_size=200_000))
    jobs = split_jobs(ckpt, p, list(p.shards), 3, tmp_path / "out")
    assert [s.file for j in jobs for s in j.shards] == [s.file for s in p.shards]
    assert sorted(f for j in jobs for f in j.hash_files) == sorted(f for f, _ in p.inputs)
    loads = [sum(u.nbytes_in for u in j.units) for j in jobs]
    assert max(loads) < 2 * min(loads)


@pytest.mark.slow
def test_a_worker_killed_midway_fails_cleanly_and_resumes_identically(tiny_k3, tmp_path):
    src = copy_ckpt(tiny_k3, tmp_path / "in")
    args = [*SGLANG_ARGS, "--max-shard-size", "300KB", "-q", "--device", "cpu", "--workers", "2"]
    ref = tmp_path / "ref"
    assert run("pack", src, ref, *args).code == 0
    out = tmp_path / "out"
    # a process of its own: the fault point is read at import (the workers inherit it and one kills itself)
    err = one_line_error(run_process("pack", src, out, *args, env={"KIMI_CONVERT_FAULT": "tensor:5"}))
    assert "worker" in err and "--resume" in err
    assert not (out / "manifest.json").exists()
    r = run("pack", src, out, *args, "--resume")
    assert r.code == 0, r.stderr
    assert tree(out) == tree(ref)


@pytest.mark.slow
def test_interrupting_workers_exits_130_without_traceback(tiny_k3, tmp_path):
    import os
    import signal
    import subprocess
    import time

    out = tmp_path / "out"
    env = {**os.environ, "KIMI_CONVERT_FAULT": "header:1:pause"}
    with child(cli_command("pack", tiny_k3, out, "-q", "--device", "cpu", "--workers", "2", *SGLANG_ARGS,
                           "--max-shard-size", "300KB"), stderr=subprocess.PIPE, text=True, env=env) as p:
        deadline = time.time() + 60
        while len(list(out.glob("*.partial"))) < 2 and time.time() < deadline:
            time.sleep(0.05)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=30)
    assert p.returncode == 130, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and "resume with:" in err, err
    assert not (out / "manifest.json").exists()


def test_cli_stats_and_streams(tiny_k3, tmp_path):
    import json

    out, stats = tmp_path / "out", tmp_path / "stats.json"
    r = run("pack", tiny_k3, out, "-q", "--device", "cpu", "--streams", "2", *SGLANG_ARGS, "--max-shard-size", "300KB",
            "--stats", stats)
    assert r.code == 0, r.stderr
    st = json.loads(stats.read_text())
    assert st["workers"] == 1 and st["streams"] == 2
    assert st["hashed_from_pipeline"] + st["hash_reread"] >= sum(
        p.stat().st_size for p in tiny_k3.glob("*.safetensors"))
    assert st["stages_s"]["compute: C kernels without torch"] > 0 and st["early_units"] > 0  # (compute_early)
    # each stream's input file chains run one at a time on one thread: busy, within the streams' walls
    busy = st["stages_s"]["hash: input file digest chains (busy)"]
    assert 0 < busy <= sum(st["stream_wall_s"])
    # of which the files' headers at least, read by the chains themselves (the pipeline never reads them; on a
    # small input within a millisecond, so possibly 0 once rounded)
    assert 0 <= st["stages_s"]["hash: input file digest chains (own reads)"] <= busy and st["hash_reread"] > 0
    # each stream's counters in time: non-decreasing, ending with every byte read, hashed and stored
    tls = st["stream_timelines"]
    assert len(tls) == 2 and all(tl["columns"] == ["s", "read", "hashed", "stored", "in_flight", "pooled", "held"]
                                 for tl in tls)
    for tl in tls:
        cols = list(zip(*tl["rows"], strict=True))
        assert all(list(c) == sorted(c) for c in cols[:4])
        assert tl["rows"][-1][3] == tl["rows"][-1][1] > 0  # stored what it read (each piece once)
        assert tl["rows"][-1][4] >= 0
        assert max(r[5] for r in tl["rows"]) > 0 and min(r[6] for r in tl["rows"]) >= 0  # the pool's, the holds' bytes
    size = sum(p.stat().st_size for p in tiny_k3.glob("*.safetensors"))
    assert sum(tl["rows"][-1][2] for tl in tls) == size  # the input files hashed whole, by one stream each
    v = run("verify-manifest", out, "--input", tiny_k3)
    assert v.code == 0, v.stdout + v.stderr


def test_a_gpu_device_without_a_gpu_is_a_one_line_error_before_any_output(tiny_k3, tmp_path, monkeypatch):
    from kimi_convert import devices

    if devices.gpu_count():
        pytest.skip("this machine has a GPU")
    out = tmp_path / "out"
    for dev in ("cuda", "cuda:1", "tpu"):
        err = one_line_error(run("pack", tiny_k3, out, "--device", dev))
        assert dev in err
        assert not out.exists()


def test_auto_device_needs_a_gpu_and_a_cuda_torch(tmp_path, monkeypatch):
    import importlib.machinery

    from kimi_convert import devices
    from kimi_convert.devices import Device, resolve_device
    from kimi_convert.errors import ConvertError

    pkg = tmp_path / "torch"
    (pkg / "lib").mkdir(parents=True)
    spec = importlib.machinery.ModuleSpec("torch", None, is_package=True)
    spec.submodule_search_locations = [str(pkg)]
    monkeypatch.setattr(devices.importlib.util, "find_spec", lambda name: spec)
    monkeypatch.setattr(devices, "gpu_count", lambda: 2)
    monkeypatch.setattr(devices, "gpus_at_most", lambda: None)  # the kernel driver's list unread: ask CUDA's
    devices.torch_has_cuda.cache_clear()
    try:
        assert resolve_device("auto") == Device("cpu")  # a CPU build of torch: the GPUs cannot be used
        with pytest.raises(ConvertError, match="--device cuda: the installed torch is not a CUDA build"):
            resolve_device("cuda")
        (pkg / "lib" / "libtorch_cuda.so").write_bytes(b"")
        devices.torch_has_cuda.cache_clear()
        assert resolve_device("auto") == Device("auto")  # a GPU and the CPUs: the pipeline measures both
        assert resolve_device("cuda:1") == Device("cuda", 1)
        with pytest.raises(ConvertError, match="--device cuda:2: only 2 CUDA device"):
            resolve_device("cuda:2")
        assert devices.worker_devices("cuda", None) == [Device("cuda", 0), Device("cuda", 1)]
        assert devices.worker_devices("cuda:1", 3) == [Device("cuda", 1)] * 3
        assert devices.worker_devices("cuda", 3) == [Device("cuda", 0), Device("cuda", 1), Device("cuda", 0)]
        assert devices.worker_devices("auto", None) == [Device("auto", 0), Device("auto", 1)]
    finally:
        devices.torch_has_cuda.cache_clear()


def test_gpus_at_most_reads_the_kernel_drivers_list_and_cuda_visible_devices(tmp_path, monkeypatch):
    from kimi_convert import devices

    gpus = tmp_path / "gpus"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert devices.gpus_at_most(gpus) == 0  # no driver
    for bus in ("0000:17:00.0", "0000:2a:00.0"):
        (gpus / bus).mkdir(parents=True)
    assert devices.gpus_at_most(gpus) == 2
    for visible, n in (("1", 1), ("", 0), ("0,1,2,3", 2), ("GPU-aa74, GPU-bb12", 2)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert devices.gpus_at_most(gpus) == n, visible


def test_one_auto_worker_needs_no_driver_start(monkeypatch):
    """``auto`` with at most one GPU listed is decided without ``cuInit`` (0.5-1 s): none listed or a CPU build of
    torch is the CPUs; one is auto on GPU 0, confirmed where the backends are made; more asks the driver."""
    from kimi_convert import devices
    from kimi_convert.devices import Device

    def driver():
        raise AssertionError("the driver was started")

    monkeypatch.setattr(devices, "gpu_count", driver)
    for cuda_torch, bound, want in ((False, 1, Device("cpu")), (True, 0, Device("cpu")), (True, 1, Device("auto", 0))):
        monkeypatch.setattr(devices, "torch_has_cuda", lambda c=cuda_torch: c)
        monkeypatch.setattr(devices, "gpus_at_most", lambda b=bound: b)
        assert devices.worker_devices("auto", None) == devices.worker_devices("auto", 1) == [want]
    monkeypatch.setattr(devices, "gpus_at_most", lambda: 2)
    monkeypatch.setattr(devices, "gpu_count", lambda: 2)
    assert devices.worker_devices("auto", None) == [Device("auto", 0), Device("auto", 1)]
    monkeypatch.setattr(devices, "gpus_at_most", lambda: 1)
    assert devices.worker_devices("auto", 2) == [Device("auto", 0), Device("auto", 1)]  # two workers: asked
    from kimi_convert.pipeline import runner

    monkeypatch.setattr(devices, "gpu_count", lambda: 0)  # the one listed GPU the driver then does not see
    assert list(runner.candidates(Device("auto", 0), 2)) == ["cpu"]


def test_resolve_device_reads_every_accepted_value_and_refuses_the_rest(monkeypatch):
    from kimi_convert import devices
    from kimi_convert.devices import Device, resolve_device, valid
    from kimi_convert.errors import ConvertError

    monkeypatch.setattr(devices, "gpu_count", lambda: 0)
    for text in ("cpu", "reference", "triton"):
        assert resolve_device(text) == Device(text) and str(resolve_device(text)) == text
        assert devices.worker_devices(text, 2) == [Device(text)] * 2
    assert resolve_device("auto") == Device("cpu")  # no GPU: the C kernel
    assert resolve_device(Device("cuda", 3)) == Device("cuda", 3)  # already resolved: as it is
    assert str(Device("cuda", 3)) == "cuda:3"
    for text in ("cuda", "cuda:0"):
        assert valid(text) == text
        with pytest.raises(ConvertError, match=f"--device {text}: no CUDA device visible"):
            resolve_device(text)
    for bad in ("tpu", "", "CPU", "cuda:", "cuda:x", "cuda:-1", "cpu:0", "auto:1", "triton:0", " cpu", "cuda 0"):
        with pytest.raises(ConvertError) as e:
            resolve_device(bad)
        assert str(e.value) == f"--device {bad!r}: expected one of auto, cpu, cuda, cuda:N, reference (the torch " \
            "code), triton (the Triton kernel; on the CPU under TRITON_INTERPRET=1)"
        with pytest.raises(ConvertError, match="expected one of auto, cpu, cuda, cuda:N, reference"):
            valid(bad)
    monkeypatch.setattr(devices, "gpu_count", lambda: 1)
    monkeypatch.setattr(devices, "torch_has_cuda", lambda: True)
    assert resolve_device("cuda:0") == Device("cuda", 0) and resolve_device("cuda") == Device("cuda")
    assert resolve_device("auto") == Device("auto")
    with pytest.raises(ConvertError, match="--device cuda:1: only 1 CUDA device"):
        resolve_device("cuda:1")


def test_cpus_honours_kimi_convert_threads(monkeypatch):
    import os

    from kimi_convert.devices import cpus
    from kimi_convert.errors import ConvertError

    monkeypatch.delenv("KIMI_CONVERT_THREADS", raising=False)
    assert cpus() == len(os.sched_getaffinity(0))
    monkeypatch.setenv("KIMI_CONVERT_THREADS", "7")
    assert cpus() == 7
    assert pipeline.default_streams(cpus()) == 1 and pipeline.default_streams(64, 2) == 4
    assert pipeline.cpu_share(cpus(), 2) == 3 and pipeline.cpu_share(1, 4) == 1
    monkeypatch.setenv("KIMI_CONVERT_THREADS", "0")
    assert cpus() == 1
    monkeypatch.setenv("KIMI_CONVERT_THREADS", "many")
    with pytest.raises(ConvertError, match="KIMI_CONVERT_THREADS='many'"):
        cpus()


class _Stop(Exception):
    pass


def test_pack_passes_cpus_to_its_one_worker(tiny_k3, tmp_path, monkeypatch):
    """pack reads ``cpus()`` once and hands it on as an argument: the stream threads, the warm-up."""
    seen = {}

    def run_jobs(jobs, device, on_shard, on_progress, *, threads, stop=None, tuning=None):
        seen["threads"], seen["device"] = threads, device
        raise _Stop

    monkeypatch.setenv("KIMI_CONVERT_THREADS", "5")
    monkeypatch.setattr(pipeline, "run_jobs", run_jobs)
    monkeypatch.setattr(pipeline, "warm_up", lambda device, threads, need: seen.setdefault("warm_up", threads))
    with pytest.raises(_Stop):
        pack(tiny_k3, tmp_path / "out", Options(), device="cpu", progress=False, workers=1)
    from kimi_convert.devices import Device
    assert seen == {"threads": 5, "device": Device("cpu"), "warm_up": 5}


def test_workers_receive_their_share_of_cpus_as_an_argument(tiny_k3, tmp_path, monkeypatch):
    """pack hands ``cpus()`` to workers.run, which gives each worker process an equal share as an
    argument of its main function (os.environ is left alone). The processes run as threads here."""
    import os
    import queue

    from kimi_convert import workers

    class Thread(threading.Thread):
        exitcode = None

        def __init__(self, target, args, name):
            super().__init__(target=target, args=args, name=name)

    class Context:
        Queue = queue.Queue
        Process = Thread

    got, real = [], workers.run_jobs

    def run_jobs(jobs, device, on_shard, on_progress, *, threads, stop=None, tuning=None):
        got.append((str(device), threads))
        return real(jobs, device, on_shard, on_progress, threads=threads, stop=stop, tuning=tuning)

    monkeypatch.setenv("KIMI_CONVERT_THREADS", "6")
    monkeypatch.setattr(workers.mp, "get_context", lambda method: Context())
    monkeypatch.setattr(workers, "die_with", lambda parent: None)
    monkeypatch.setattr(workers, "run_jobs", run_jobs)
    env = dict(os.environ)
    r = pack(tiny_k3, tmp_path / "out", Options(**SGLANG, max_shard_size=300_000), device="cpu", progress=False,
             workers=2, streams=1)
    assert r.stats.workers == 2 and sorted(got) == [("cpu", 3), ("cpu", 3)]  # 6 CPUs, 2 workers: 3 each
    assert dict(os.environ) == env
    assert (tmp_path / "out" / "manifest.json").is_file()


@pytest.mark.slow
def test_workers_die_with_a_killed_parent(tiny_k3, tmp_path):
    """A SIGKILLed pack must not leave workers writing into files a resumed pack will write."""
    import os
    import subprocess
    import time

    out = tmp_path / "out"
    env = {**os.environ, "KIMI_CONVERT_FAULT": "header:1:pause"}
    with child(cli_command("pack", tiny_k3, out, "-q", "--device", "cpu", "--workers", "2", *SGLANG_ARGS,
                           "--max-shard-size", "300KB"), stderr=subprocess.DEVNULL, env=env) as p:
        deadline = time.time() + 60
        while len(list(out.glob("*.partial"))) < 2 and time.time() < deadline:
            time.sleep(0.05)
        children = [int(c) for c in Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()]
        assert len(children) >= 2
        p.kill()
        p.wait()

    def alive(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
        except (FileNotFoundError, ProcessLookupError):
            return False

    deadline = time.time() + 10
    while any(alive(c) for c in children) and time.time() < deadline:
        time.sleep(0.05)
    assert not any(alive(c) for c in children)


_MALLOC_PROBE = """
import ctypes, sys
from kimi_convert.pipeline import budgets
from kimi_convert.tuning import Tuning
libc = ctypes.CDLL(None)
if not hasattr(libc, "mallinfo2"):
    print("no-mallinfo2"); sys.exit()
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc.mallinfo2.restype = Info
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
if sys.argv[1] == "set":
    assert budgets.return_freed_memory(Tuning().mmap_threshold)
p = libc.malloc(8 << 20); libc.free(p)  # left alone, glibc raises its mmap threshold to 8 MB here
before = libc.mallinfo2().hblks
p = libc.malloc(8 << 20); print(libc.mallinfo2().hblks - before); libc.free(p)
"""


_TRIM_PROBE = """
import ctypes, sys
from kimi_convert.pipeline import budgets
from kimi_convert.tuning import Tuning
libc = ctypes.CDLL(None)
if not hasattr(libc, "malloc_trim"):
    print("no-malloc_trim"); sys.exit()
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
def anon_mb():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon")) >> 10
budgets.return_freed_memory(Tuning().mmap_threshold)  # as a converting process: 256 KB blocks from the heap
blocks = [libc.malloc(256 << 10) for _ in range(400)]
for b in blocks:
    ctypes.memset(b, 1, 256 << 10)
for b in blocks[:-1]:  # the last one stays: the heap cannot shrink from its top
    libc.free(b)
before = anon_mb()
if sys.argv[1] == "trim":
    budgets.trim_freed_memory()
print(before - anon_mb())
"""


@pytest.mark.parametrize("mode", ["trim", "left"])
def test_a_finished_shard_gives_the_heaps_freed_memory_back(mode):
    """Freed blocks under the mmap threshold stay resident in glibc's heap until ``trim_freed_memory`` (called at
    each shard's finish) gives their pages back: about the 100 MB freed here; left alone, none (the probe tells the
    two apart)."""
    r = subprocess.run([sys.executable, "-c", _TRIM_PROBE, mode], capture_output=True, text=True, check=True)
    if r.stdout.strip() == "no-malloc_trim":
        pytest.skip("not glibc")
    given_back = int(r.stdout)
    assert given_back >= 80 if mode == "trim" else given_back < 10, given_back


@pytest.mark.parametrize("mode, mapped", [("set", "1"), ("left", "0")])
def test_freed_tensor_memory_goes_back_to_the_system(mode, mapped):
    """An 8 MB block allocated after one was freed is mapped on its own (given back when freed) once a
    converting process has set the threshold; glibc's default would serve it from its heap (the 'left' case
    shows the probe tells the two apart)."""
    r = subprocess.run([sys.executable, "-c", _MALLOC_PROBE, mode], capture_output=True, text=True, check=True)
    if r.stdout.strip() == "no-mallinfo2":
        pytest.skip("not glibc >= 2.33")
    assert r.stdout.strip() == mapped


def test_the_tuning_reads_its_variables_once_and_refuses_a_bad_value(tiny_k3, tmp_path):
    """The ``KIMI_CONVERT_*`` variables that set a field are read into the tuning pack builds (the other fields are
    its defaults); a value that is not a whole number is one line, exit 2, before anything is written."""
    assert Tuning.from_env({}) == Tuning()
    assert Tuning.from_env({"KIMI_CONVERT_STARTUP_READAHEAD": "4096"}) == Tuning(startup_readahead=4096)
    env = {"KIMI_CONVERT_UPLOAD_QUEUE": "0", "KIMI_CONVERT_DOWNLOAD_THREADS": "1", "KIMI_CONVERT_MAX_COMMIT_FILES": "9",
           "KIMI_CONVERT_DIRECT_WRITE": "0"}
    assert Tuning.from_env(env) == Tuning(upload_queue=0, download_threads=1, max_commit_files=9, direct_write=0)
    assert Tuning(startup_readahead=0).startup_bytes() == 0
    assert 0 < Tuning().startup_bytes() <= 4 << 30
    out = tmp_path / "out"
    err = one_line_error(run("pack", tiny_k3, out, "-q", env={"KIMI_CONVERT_STARTUP_READAHEAD": "lots"}))
    assert "KIMI_CONVERT_STARTUP_READAHEAD='lots': expected a number of bytes" in err
    assert not out.exists()


_ARENA_PROBE = """
import ctypes, os, sys, tempfile, threading
from kimi_convert.pipeline import budgets
libc = ctypes.CDLL(None)
if not hasattr(libc, "malloc_info"):
    print("no-malloc_info"); sys.exit()
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
libc.fdopen.restype, libc.fdopen.argtypes = ctypes.c_void_p, [ctypes.c_int, ctypes.c_char_p]
libc.fclose.argtypes, libc.malloc_info.argtypes = [ctypes.c_void_p], [ctypes.c_int, ctypes.c_void_p]
budgets.limit_heaps(int(sys.argv[1]))
go = threading.Barrier(8)
def work():  # eight threads allocating at once, as a pack's pipeline does
    go.wait()
    blocks = [libc.malloc(4096) for _ in range(1000)]
    for b in blocks:
        libc.free(b)
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
with tempfile.TemporaryFile() as f:
    fp = libc.fdopen(os.dup(f.fileno()), b"w")
    libc.malloc_info(0, fp)
    libc.fclose(fp)
    f.seek(0)
    print(f.read().count(b"<heap nr="))
"""


@pytest.mark.parametrize("arenas", [2, 0])
def test_the_pipelines_threads_share_a_bounded_number_of_heaps(arenas):
    """With ``Tuning.heap_arenas`` set (``limit_heaps``, called as the streams start), eight threads allocating at once
    use at most that many glibc heaps; left to glibc's default (0), more (the probe tells the two apart)."""
    r = subprocess.run([sys.executable, "-c", _ARENA_PROBE, str(arenas)], capture_output=True, text=True, check=True)
    if r.stdout.strip() == "no-malloc_info":
        pytest.skip("not glibc")
    heaps = int(r.stdout)
    assert heaps <= arenas if arenas else heaps > 2, heaps
