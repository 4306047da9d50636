"""--device auto: the decision between the GPU and the CPUs (pipeline/choose.py) from injected timings, the
calibration thread that keeps the GPU off the streams' way, the pool's page-locking hooks, and a whole pack
whose two candidates are the C kernels and the torch code (no GPU here): the same bytes as one device, the
choice in --stats and in pack's summary."""

from __future__ import annotations

import json
import threading

import pytest

from helpers import run, tree
from kimi_convert.pack import load_plan
from kimi_convert.pipeline import choose
from kimi_convert.pipeline.choose import Chooser
from kimi_convert.pipeline.choose import choose as pick
from kimi_convert.plan import Options
from kimi_convert.readers import BufferPool
from kimi_convert.tuning import Tuning

SAMPLES = Tuning().samples


def test_choose_takes_the_lower_median_seconds_per_byte():
    c = pick("k", {"cpu": [(2.0, 1000), (1.0, 1000), (9.0, 1000)], "cuda": [(1.5, 1000), (1.6, 1000), (0.1, 1000)]})
    assert c.chosen == "cuda" and c.s_per_gb == {"cpu": 2e6, "cuda": 1.5e6} and c.samples == 3
    # per byte, not per unit: a unit twice as large may take twice as long
    assert pick("k", {"cpu": [(1.0, 1000)], "cuda": [(1.5, 2000)]}).chosen == "cuda"
    assert pick("k", {"cpu": [(1.0, 1000)], "cuda": [(1.0, 1000)]}).chosen == "cpu"  # a tie leaves the GPU free
    assert pick("k", {"cuda": [(1.0, 1000)], "cpu": [(1.0, 1000)]}).chosen == "cuda"  # ... the first candidate


class FakeClock:
    """Each candidate's compute advances the clock by its injected duration."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_chooser_warms_up_then_times_then_sticks_to_the_faster():
    decided = []
    ch = Chooser({"cpu": "cpu", "cuda": "cuda"}, samples=2, on_decided=decided.append)
    # the GPU's first unit is slow (Triton compiles): a warm-up, not counted
    for cpu_s, gpu_s in [(0.1, 50.0), (1.0, 0.5), (1.0, 0.6)]:
        assert ch.wants("cast", "cuda")
        ch.record("cast", "cpu", cpu_s, 100)
        ch.record("cast", "cuda", gpu_s, 100)
    assert len(decided) == 1 and decided[0].chosen == "cuda" and decided[0].samples == 2
    assert decided[0].s_per_gb == {"cpu": 1e7, "cuda": 5.5e6}
    assert not ch.wants("cast", "cuda") and ch.decided("cast") == "cuda"
    ch.record("cast", "cuda", 9.0, 100)  # decided: no re-measuring
    assert [c.chosen for c in ch.choices()] == ["cuda"] and len(decided) == 1


def test_chooser_decides_each_kind_of_work_on_its_own_and_waits_for_every_candidate():
    ch = Chooser({"cpu": "cpu", "cuda": "cuda"}, samples=2)
    for s in [0.1, 1.0, 1.0, 1.0, 1.0]:  # the CPUs' samples alone decide nothing
        ch.record("cast@16MB", "cpu", s, 100)
        ch.record("fp8-block@256MB", "cpu", s, 100)
    assert ch.choices() == [] and ch.wants("cast@16MB", "cuda") and not ch.wants("cast@16MB", "cpu")
    for s in [0.1, 2.0, 2.0]:
        ch.record("cast@16MB", "cuda", s, 100)
    for s in [0.1, 0.5, 0.5]:
        ch.record("fp8-block@256MB", "cuda", s, 100)
    assert {c.kind: c.chosen for c in ch.choices()} == {"cast@16MB": "cpu", "fp8-block@256MB": "cuda"}
    assert ch.decided("nvfp4@4MB") is None  # never seen: undecided


def calibrator(durations: list[float], same=lambda r: True, start=lambda: None, wait=False):
    """A Calibrator whose side candidate (``cuda``) takes the injected ``durations`` on a fake clock."""
    clock = FakeClock()
    ch = Chooser({"cpu": "cpu", "cuda": "cuda"}, samples=2)
    it = iter(durations)

    def work(b):
        assert b == "cuda"
        clock.now += next(it)
        return "gpu bytes"

    cal = choose.Calibrator(ch, start=start, clock=clock, wait=wait)
    return ch, cal, work, same


def idle(cal) -> None:
    """Wait until the calibration thread has finished its unit (close() would drop one not yet begun)."""
    for _ in range(1000):
        if not cal._busy:
            return
        threading.Event().wait(0.01)
    raise AssertionError("the calibration thread is still busy")


def test_calibrator_times_the_other_candidate_on_its_thread_and_decides():
    ch, cal, work, same = calibrator([50.0, 0.1, 0.1])
    released = []
    for _ in range(3):
        ch.record("cast", "cpu", 1.0, 100)
        assert cal.take("cast")
        cal.give("cast", 100, work, same, release=lambda: released.append(1))
        idle(cal)  # the thread takes the next only once idle
    cal.close()
    cal.check()
    assert ch.decided("cast") == "cuda" and len(released) == 3 and cal.stats["units"] == 3
    assert not cal.take("cast")  # decided: nothing more to calibrate


def test_calibrator_never_makes_a_stream_wait():
    """While the side candidate computes (here: until the test lets it go), a stream's offers are declined at
    once: the stream goes on with the CPUs' result."""
    go, running = threading.Event(), threading.Event()
    ch = Chooser({"cpu": "cpu", "cuda": "cuda"}, samples=2)
    cal = choose.Calibrator(ch)
    assert cal.take("cast")
    cal.give("cast", 100, lambda b: running.set() or (go.wait(10) and "gpu bytes"), lambda r: True)
    assert running.wait(10)
    assert not cal.take("cast") and not cal.take("other")  # busy: declined, not waited for
    assert cal.stats["declined"] == 2
    go.set()
    cal.close()
    assert ch._kinds["cast"].warm == {"cuda"}  # the unit it computed: the GPU's warm-up


def test_calibrator_fails_the_run_on_different_bytes():
    ch, cal, work, _ = calibrator([1.0] * 3)
    gone = []
    assert cal.take("cast")
    cal.give("cast", 100, work, lambda r: False, discard=gone.append)
    idle(cal)
    cal.close()
    with pytest.raises(RuntimeError, match="--device auto: cpu and cuda computed different bytes for cast"):
        cal.check()
    assert gone == ["gpu bytes"] and ch.choices() == [] and "cuda" not in ch._kinds.get("cast", choose._Kind()).warm


def test_calibrator_without_a_gpu_leaves_everything_on_the_cpus():
    def start():
        raise RuntimeError("no CUDA driver")

    ch, cal, work, same = calibrator([1.0] * 3, start=start, wait=True)
    dropped = []
    assert cal.take("cast")  # the thread starts on first need
    cal.give("cast", 100, work, same, release=lambda: dropped.append(1))  # wait: returns once dropped
    assert not cal.take("cast") and cal.broken == "RuntimeError: no CUDA driver" and dropped == [1]
    cal.close()
    cal.check()
    assert ch.choices() == []


def test_calibrator_wait_mode_calibrates_every_offered_unit():
    ch, cal, work, same = calibrator([0.1, 0.1, 0.1], wait=True)
    for _ in range(3):
        ch.record("cast", "cpu", 1.0, 100)
        assert cal.take("cast")
        cal.give("cast", 100, work, same)  # returns once computed
    assert ch.decided("cast") == "cuda"
    cal.close()


def test_work_kind_names_the_operations_and_the_size_class(tiny_k3):
    _, plan = load_plan(tiny_k3, Options())
    kinds = {choose.work_kind(u) for u in plan.units}
    assert None in kinds  # kept and copied tensors need no kernel
    assert any(k.startswith("mxfp4-cast@") for k in kinds if k)  # the experts (nvidia-k3's cast)
    assert any(k.startswith("fp8-block@") for k in kinds if k)  # the attention
    for u in plan.units:
        k = choose.work_kind(u)
        if k:
            size = int(k.split("@")[1].removesuffix("MB"))
            assert size << 20 >= u.nbytes_in and (size == 1 or (size << 20) // 4 < u.nbytes_in)


def test_pool_page_locks_its_own_buffers_and_unlocks_each_before_letting_it_go():
    locked: dict[int, int] = {}
    pool = BufferPool(limit=10 << 20)
    early = pool.get(1 << 20)  # before page-locking began
    pool.put(early)
    pool.pin_with(lambda b: locked.setdefault(b.ctypes.data, b.nbytes) is not None,
                  lambda b: locked.pop(b.ctypes.data))
    a = pool.get(1 << 20)
    assert a is not early and a.ctypes.data % 4096 == 0  # replaced by whole pages of its own, then locked
    assert locked == {a.ctypes.data: 1 << 20} and pool.pinned_bytes == 1 << 20
    pool.put(a)
    assert pool.get(1 << 20) is a and len(locked) == 1  # reused: locked once
    pool.put(a, reuse=False)  # referenced elsewhere: unlocked before the pool forgets it
    assert locked == {}
    b = pool.get(12 << 20)  # locked buffers may take twice the limit (20 MB) before free ones are dropped
    pool.put(b)
    c = pool.get(11 << 20)  # takes b again
    assert c is b
    d = pool.get(9 << 20)  # a new buffer (b is in use), of a size class (10 MB: 4 sizes an octave)
    assert d.nbytes == 10 << 20
    pool.put(c)  # 12 free + 10 in use > 20: b is dropped, and unlocked first
    assert b.ctypes.data not in locked and d.ctypes.data in locked
    pool.unpin_all()
    assert locked == {}


def test_a_closed_runs_memory_lets_its_free_buffers_go_at_once():
    """The end of a wave: the pool's free buffers are dropped (each unlocked first) at ``Memory.close``, not kept
    until something collects the pool: two waves' pools at once were the whole release's memory peaks (issue 43)."""
    import gc
    import threading
    import weakref

    from kimi_convert.pipeline.budgets import Memory
    from kimi_convert.tuning import Tuning

    locked: dict[int, int] = {}
    mem = Memory([], 2, threading.Event(), Tuning())
    mem.buffers.pin_with(lambda b: locked.setdefault(b.ctypes.data, b.nbytes) is not None,
                         lambda b: locked.pop(b.ctypes.data))
    bufs = [mem.buffers.get(1 << 20) for _ in range(3)]
    for b in bufs:
        mem.buffers.put(b)
    alive = [weakref.ref(b.base) for b in bufs]  # (the mappings under the arrays)
    assert len(locked) == 3
    gc.disable()  # no collection may be what frees them
    try:
        del b, bufs
        mem.close()
        assert locked == {} and mem.buffers.get(1 << 20) is not None and all(r() is None for r in alive)
    finally:
        gc.enable()


def test_the_pool_counts_the_file_hashes_holds_against_its_limit():
    """A worker's memory: the pool's buffers, free and in use, and the bytes its file hashes hold apart (views of
    buffers given back unused, hashed later in file order) together within the in-flight budget: free buffers are let
    go while the hashes hold more (issue 43: a full pool beside full holds was the whole release's peaks)."""
    import threading

    from kimi_convert.pipeline.budgets import Memory
    from kimi_convert.tuning import Tuning

    mb = 1 << 20
    mem = Memory([], 2, threading.Event(), Tuning(min_in_flight=8 * mb, in_flight_per_cpu=4 * mb, hold_bytes=2 * mb))
    assert mem.in_flight.limit == 8 * mb and mem.hold.limit == 2 * mb
    pool = mem.buffers
    bufs = [pool.get(mb) for _ in range(8)]
    for b in bufs[:7]:
        pool.put(b)
    assert pool.pooled == 8 * mb  # nothing held apart: the whole budget may be pooled
    assert mem.hold.take({1: 2 * mb})  # a file hash keeps a 2 MB buffer alive (views of it)
    pool.put(bufs[7])  # any give-back trims the pool to what the budget leaves
    assert pool.pooled == 6 * mb
    mem.hold.give({1: 2 * mb})
    pool.put(pool.get(mb))
    assert pool.pooled == 6 * mb  # nothing is made to fill the room back: the next reads get new buffers


@pytest.fixture
def auto_without_gpu(monkeypatch) -> Tuning:
    """--device auto as on a GPU machine, with the C kernels and the torch code as the two candidates; the tuning
    to pack with (the streams wait for the calibration thread and the probe: a tiny input has too few units to
    decide otherwise)."""
    from kimi_convert import devices
    from kimi_convert.devices import get_backend
    from kimi_convert.pipeline import runner

    monkeypatch.setattr(devices, "gpu_count", lambda: 1)
    monkeypatch.setattr(devices, "gpus_at_most", lambda: 1)
    monkeypatch.setattr(devices, "torch_has_cuda", lambda: True)
    from kimi_convert.pipeline import probe

    monkeypatch.setattr(runner, "candidates", lambda device, threads: {"cuda": get_backend("reference", threads)}
                        if device.kind == "cuda" else {  # (with a probe: the GPU's runner, for the kinds it won)
                            "cpu": get_backend("cpu", threads), "reference": get_backend("reference", threads)})
    # where the C kernels take every unit, the "GPU" is the torch code in the probe process (pipeline.probe)
    monkeypatch.setattr(probe, "child_device", lambda gpu: "reference")
    return Tuning(calibration_waits=True, probe_waits=True)


@pytest.mark.parametrize("where", ["probe", "in-process"])
def test_auto_pack_writes_the_same_bytes_and_says_what_it_chose(tiny_k3, tmp_path, auto_without_gpu, where,
                                                               monkeypatch):
    """Both ways of measuring: a K3 under its default recipe is all C kernels, the GPU measured in a probe process;
    with the recipe's torch code (KIMI_CONVERT_RECIPE_KERNELS=torch) the GPU is measured in this process."""
    ref, out, stats = tmp_path / "ref", tmp_path / "auto", tmp_path / "stats.json"
    other = "cuda" if where == "probe" else "reference"
    if where == "in-process":
        monkeypatch.setenv("KIMI_CONVERT_RECIPE_KERNELS", "torch")
    assert run("pack", tiny_k3, ref, "--device", "cpu", "-q").code == 0
    r = run("pack", tiny_k3, out, "--device", "auto", "-q", "--streams", "2", "--stats", stats, tuning=auto_without_gpu)
    assert r.code == 0, r.stderr
    assert tree(out) == tree(ref)
    s = json.loads(stats.read_text())
    assert s["device"] == "auto" and s["device_choices"]
    assert bool(s["calibration"][0].get("probe")) == (where == "probe") and not s["calibration"][0].get("broken")
    kinds = [c["kind"] for c in s["device_choices"]]
    assert any(k.startswith("mxfp4-cast@") for k in kinds)
    for c in s["device_choices"]:
        assert c["chosen"] in ("cpu", other) and set(c["s_per_gb"]) == {"cpu", other}
        assert c["samples"] >= SAMPLES
    line = next(x for x in r.stdout.splitlines() if x.startswith("device auto"))
    assert all(k in line for k in kinds)


def test_pool_stops_locking_without_unlocking_a_buffer_in_use():
    locked: dict[int, int] = {}
    pool = BufferPool(limit=64 << 20)
    pool.pin_with(lambda b: locked.setdefault(b.ctypes.data, b.nbytes) is not None,
                  lambda b: locked.pop(b.ctypes.data))
    free, busy = pool.get(1 << 20), pool.get(2 << 20)
    pool.put(free)
    pool.pin_with(None, None)
    assert list(locked) == [busy.ctypes.data]  # a copy may still read it: unlocked once given back
    pool.put(busy)
    assert locked == {} and pool.get(2 << 20) is busy  # kept, pageable
    assert locked == {}  # and not locked again


def test_auto_page_locks_only_once_a_kind_went_to_the_gpu(tiny_k3, monkeypatch):
    """Page-locking costs the reader time that the CPUs never gain back: auto starts it with the first kind of
    work decided for the GPU, not before (issue 26 item 9)."""
    import torch

    from kimi_convert.devices import get_backend
    from kimi_convert.kernels import Backend
    from kimi_convert.pipeline import runner as runner_mod

    locked = set()
    monkeypatch.setattr(runner_mod, "_pinning", lambda device: (lambda b: locked.add(id(b)) is None,
                                                                lambda b: locked.discard(id(b))))
    _, plan = load_plan(tiny_k3, Options())
    pool = BufferPool(limit=64 << 20)
    r = runner_mod.Runner({"cpu": get_backend("cpu"), "cuda": Backend("triton", torch.device("cuda"))}, pool,
                          (128, 128), plan.units)  # a stand-in GPU: never run here
    kinds = sorted(r._decisive)
    assert len(kinds) >= 2 and not pool.pinning and pool.get(1 << 20) is not None and not locked
    for name, s in [("cpu", 0.1), ("cuda", 1.0)] * (SAMPLES + 1):  # the CPUs win the first kind
        r.chooser.record(kinds[0], name, s, 1 << 20)
    assert [c.chosen for c in r.choices()] == ["cpu"] and not pool.pinning
    for name, s in [("cpu", 1.0), ("cuda", 0.01)] * (SAMPLES + 1):  # the GPU, by far, the second
        r.chooser.record(kinds[1], name, s, 1 << 20)
    assert pool.pinning and pool.get(2 << 20) is not None and locked


def test_auto_computes_undecided_units_on_the_cpus_in_the_stream(tiny_k3, monkeypatch):
    """An undecided kind's unit is the CPUs' (timed), whatever the GPU does: here it cannot even start (a CPU
    build of torch), and the stream neither waits for it nor fails; the bytes are --device cpu's."""
    import torch

    from kimi_convert.devices import get_backend
    from kimi_convert.kernels import Backend
    from kimi_convert.pipeline import runner as runner_mod
    from kimi_convert.plan import fp8_block_size
    from kimi_convert.readers import Loaded, PreadReader

    ckpt, plan = load_plan(tiny_k3, Options())
    cpu = get_backend("cpu")
    pool = BufferPool(limit=64 << 20)
    block = fp8_block_size(ckpt.config)
    r = runner_mod.Runner({"cpu": cpu, "cuda": Backend("triton", torch.device("cuda"))}, pool, block, plan.units,
                          Tuning(calibration_waits=True))  # the stream waits: the thread's start has failed
    alone = runner_mod.Runner({"cpu": cpu}, BufferPool(limit=64 << 20), block, plan.units)
    reader = PreadReader(tiny_k3)
    for unit in [u for u in plan.units if choose.work_kind(u) in r._decisive][:4]:
        loaded = Loaded({p.name: reader.read(p) for p in unit.parts})
        res, buf = r.compute(unit, loaded)
        ref, rbuf = alone.compute(unit, loaded)
        assert {k: b"".join(bytes(c) for c in o.chunks) for k, o in res.outputs.items()} == \
               {k: b"".join(bytes(c) for c in o.chunks) for k, o in ref.outputs.items()}
        r.release((res, buf))
        alone.release((ref, rbuf))
    reader.close()
    r.close()
    cal = r.calibration()
    assert cal["broken"] and cal["units"] == 0 and r.choices() == []
    assert set(r.chooser._kinds) and all(k.warm == {"cpu"} for k in r.chooser._kinds.values())


def test_cpu_kernels_write_into_a_lent_pool_buffer(tiny_k3):
    """Each unit's quantized weights are slices of one pool buffer lent for the unit (no fresh pages to fault in),
    which goes back to the pool on release; the bytes are those of the unit computed without a lent buffer."""
    import numpy as np

    from kimi_convert.compute import compute_unit
    from kimi_convert.devices import get_backend
    from kimi_convert.pipeline import runner as runner_mod
    from kimi_convert.plan import FP8, NVFP4, fp8_block_size
    from kimi_convert.readers import Loaded, PreadReader

    ckpt, plan = load_plan(tiny_k3, Options())
    pool = BufferPool(limit=64 << 20)
    cpu, block = get_backend("cpu"), fp8_block_size(ckpt.config)
    r = runner_mod.Runner({"cpu": cpu}, pool, block, plan.units)
    reader = PreadReader(tiny_k3)
    units = [u for u in plan.units if any(it.kind in (NVFP4, FP8) for it in u.items)]
    assert {it.kind for u in units for it in u.items} >= {NVFP4, FP8}
    for unit in units:
        loaded = Loaded({p.name: reader.read(p) for p in unit.parts})
        res, buf = r.compute(unit, loaded)
        lo, hi = buf.ctypes.data, buf.ctypes.data + buf.nbytes
        weights = [c for it in unit.items if it.kind in (NVFP4, FP8) for c in res.outputs[it.outputs[0].name].chunks]
        assert weights and all(lo <= np.asarray(c).ctypes.data and np.asarray(c).ctypes.data + c.nbytes <= hi
                               for c in weights)
        fresh = compute_unit(unit, loaded, cpu, block)  # fresh tensors: no arena lent to this thread
        assert all(
            b"".join(bytes(c) for c in res.outputs[k].chunks) == b"".join(bytes(c) for c in fresh.outputs[k].chunks)
            for k in res.outputs)
        r.release((res, buf))
        assert pool.get(buf.nbytes) is buf  # back in the pool, reused
        pool.put(buf)
    reader.close()


def test_the_gpu_must_win_by_the_margin():
    """A GPU timed a little faster than the CPUs on its first units is not chosen (its steady-state costs are
    not in the samples: issue 26 item 9); one faster by more than the margin is."""
    from kimi_convert.pipeline.choose import choose

    margin = Tuning().gpu_margin
    assert margin > 1
    near = {"cpu": [(0.67, 1000)], "cuda": [(0.52, 1000)]}  # the H200 machine's cast: 1.29x
    assert choose("cast", near).chosen == "cuda" and choose("cast", near, margin).chosen == "cpu"
    far = {"cpu": [(1.0, 1000)], "cuda": [(0.1, 1000)]}
    assert choose("nvfp4", far, margin).chosen == "cuda"
    assert choose("nvfp4", far, margin).s_per_gb == {"cpu": 1e6, "cuda": 1e5}  # the rates as measured


def _auto_stats(src, out, stats, tuning: Tuning) -> dict:
    r = run("pack", src, out, "--device", "auto", "-q", "--stats", stats, tuning=tuning)
    assert r.code == 0, r.stderr
    return json.loads(stats.read_text())


def test_auto_with_a_probe_uses_the_gpu_for_the_kinds_it_won(tiny_k3, tmp_path, auto_without_gpu):
    """A kind decided for the GPU by the probe is computed from then on by a runner of this process with the GPU
    alone (here the torch code): the same bytes as --device cpu, some units no longer the C kernels'."""
    import dataclasses

    wins = dataclasses.replace(auto_without_gpu, gpu_margin=1e-9)  # the "GPU" wins whatever it measures
    assert run("pack", tiny_k3, tmp_path / "ref", "--device", "cpu", "-q", "--stats", tmp_path / "c.json").code == 0
    s = _auto_stats(tiny_k3, tmp_path / "out", tmp_path / "s.json", wins)
    assert tree(tmp_path / "out") == tree(tmp_path / "ref")
    assert s["device"] == "auto" and s["device_choices"] and {c["chosen"] for c in s["device_choices"]} == {"cuda"}
    on_cpus = json.loads((tmp_path / "c.json").read_text())["early_units"]
    assert 0 < s["early_units"] < on_cpus  # the runner took the rest of the kinds the GPU won


PACK_AUTO = """
import json, sys
from kimi_convert import devices
from kimi_convert.pack import pack
from kimi_convert.pipeline import probe
from kimi_convert.plan import Options
from kimi_convert.tuning import Tuning
devices.gpu_count = devices.gpus_at_most = lambda *a: 1
devices.torch_has_cuda = lambda: True
probe.child_device = lambda gpu: "reference"
tuning = Tuning(probe_waits=True, gpu_margin=1e9)  # every kind measured, and the CPUs' by far
r = pack(sys.argv[1], sys.argv[2], Options(), device="auto", progress=False, tuning=tuning)
print(json.dumps({"torch": "torch" in sys.modules, "choices": [c["chosen"] for c in r.stats.device_choices]}))
"""


def test_auto_with_a_probe_never_imports_torch_where_the_cpus_win(tiny_k3, tmp_path):
    """auto on a K3 (every unit the C kernels'): the GPU measured in the probe, this process never imports torch."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", PACK_AUTO, str(tiny_k3), str(tmp_path / "out")], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["torch"] is False and got["choices"] and set(got["choices"]) == {"cpu"}


def test_auto_with_a_probe_that_cannot_start_computes_everything_on_the_cpus(tiny_k3, tmp_path, auto_without_gpu,
                                                                            monkeypatch):
    """A probe whose GPU is not there: the run goes on with the CPUs, says why in --stats, same bytes."""
    from kimi_convert.pipeline import probe

    monkeypatch.setattr(probe, "child_device", lambda gpu: "cuda:7")
    assert run("pack", tiny_k3, tmp_path / "ref", "--device", "cpu", "-q").code == 0
    s = _auto_stats(tiny_k3, tmp_path / "out", tmp_path / "s.json", auto_without_gpu)
    assert tree(tmp_path / "out") == tree(tmp_path / "ref")
    assert s["device_choices"] == [] and "could not start cuda:7" in s["calibration"][0]["broken"]


def test_auto_starts_its_probe_only_in_a_pack_still_running_after_its_delay(tiny_k3, tmp_path, auto_without_gpu,
                                                                           monkeypatch):
    """The probe process starts ``Tuning.probe_after_s`` into the pack (it needs seconds to import torch and start the
    GPU before it measures anything): a pack over by then never starts it, says so in --stats, and writes the same
    bytes; a pack still running then starts it."""
    import time

    from kimi_convert import pipeline
    from kimi_convert.pipeline import probe

    started: list[str] = []
    made = probe.Probe.__init__

    def record(self, device, *args):
        started.append(device)
        made(self, device, *args)

    monkeypatch.setattr(probe.Probe, "__init__", record)
    # (the probe and the streams not waiting for a calibration: as in a real pack)
    assert run("pack", tiny_k3, tmp_path / "ref", "--device", "cpu", "-q").code == 0
    t = time.monotonic()
    r = run("pack", tiny_k3, tmp_path / "short", "--device", "auto", "-q", "--stats", tmp_path / "s.json",
            tuning=Tuning(probe_after_s=60.0))
    assert r.code == 0, r.stderr
    assert time.monotonic() - t < 30  # (the pack never waits for the delay)
    assert "the pack was over before the GPU was to be measured; every unit ran on the CPUs" in r.stdout
    s = json.loads((tmp_path / "s.json").read_text())
    assert started == [] and s["device_choices"] == [] and s["device"] == "auto"
    assert s["calibration"][0]["probe"] is False and "ended within 60.0 s" in s["calibration"][0]["skipped"]
    assert tree(tmp_path / "short") == tree(tmp_path / "ref")
    compute = pipeline.Stream.compute

    def slow(self, pc, loaded):  # a pack that lasts past the delay (up to 20 s while no probe has started)
        deadline = time.monotonic() + 20
        while not started and time.monotonic() < deadline:
            time.sleep(0.01)
        return compute(self, pc, loaded)

    monkeypatch.setattr(pipeline.Stream, "compute", slow)
    s = _auto_stats(tiny_k3, tmp_path / "long", tmp_path / "l.json", Tuning(probe_after_s=0.2))
    assert started == ["reference"] and s["calibration"][0]["probe"] is True
    assert tree(tmp_path / "long") == tree(tmp_path / "ref")


def test_auto_with_a_probe_fails_the_run_on_different_bytes(tiny_k3, tmp_path, auto_without_gpu, monkeypatch):
    """The probe's outputs are checked against the CPUs' (their sha256): a mismatch is a kernel bug, loudly."""
    from kimi_convert.pipeline import probe

    monkeypatch.setattr(probe, "output_digests", lambda outputs: {k: "0" * 64 for k in outputs})
    with pytest.raises(RuntimeError, match="--device auto: cpu and cuda computed different bytes for "):
        run("pack", tiny_k3, tmp_path / "out", "--device", "auto", "-q", tuning=auto_without_gpu)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_probe_that_ends_is_a_lost_candidate_and_a_kernel_error_is_the_runs(tiny_k3):
    """The probe process answers a unit's seconds, sha256 and notes; once it has ended, a unit given to it raises
    CandidateLost (the calibration stops, the run goes on); a unit it cannot compute is a RuntimeError."""
    import pickle

    from kimi_convert.pipeline.choose import CandidateLost
    from kimi_convert.pipeline.probe import Probe, chunks_of, output_digests
    from kimi_convert.plan import fp8_block_size
    from kimi_convert.readers import Loaded, PreadReader

    ckpt, plan = load_plan(tiny_k3, Options())
    block = fp8_block_size(ckpt.config)
    unit = next(u for u in plan.units if choose.work_kind(u) is not None)
    reader = PreadReader(tiny_k3)
    buffers = {p.name: reader.read(p) for p in unit.parts}
    reader.close()
    from kimi_convert.compute import compute_unit
    from kimi_convert.devices import get_backend

    want = compute_unit(unit, Loaded(buffers), get_backend("cpu"), block)
    p = Probe("reference", 1, block, Tuning().probe_exit_s)
    try:
        p.ready()
        a = p.compute(pickle.dumps((unit, buffers)))
        assert a.digests == output_digests(chunks_of(want)) and a.notes == want.notes and a.seconds > 0
        broken = {k: v[: max(0, v.size - 2)] for k, v in buffers.items()}  # too short for their tensors
        with pytest.raises(RuntimeError, match="--device auto: reference failed on a unit: "):
            p.compute(pickle.dumps((unit, broken)))
        p._proc.kill()
        p._proc.wait()
        with pytest.raises(CandidateLost, match=r"the probe on reference ended \(exit -9\)"):
            p.compute(pickle.dumps((unit, buffers)))
    finally:
        p.close()


def test_calibrator_stops_calibrating_on_a_lost_candidate():
    """CandidateLost from a unit's work: the job's copies go, later offers are declined, nothing is raised."""
    from kimi_convert.pipeline.choose import Calibrator, CandidateLost

    chooser = Chooser({"cpu": "cpu", "cuda": "cuda"}, SAMPLES)
    cal = Calibrator(chooser, wait=True)
    released = []

    def lost(_):
        raise CandidateLost("gone")

    assert cal.take("k")
    cal.give("k", 10, lost, lambda r: True, release=lambda: released.append(1))
    assert released == [1] and cal.broken == "CandidateLost: gone" and not cal.take("k")
    cal.close()
    cal.check()
