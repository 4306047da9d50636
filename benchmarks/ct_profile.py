"""Where `pack --recipe ct-nvfp4-a16` spends a large one-file input's time: the machine's floors (one thread's
sha256, a cold sequential read of the input) and packs under variants (device, streams, hashing threads), each
from a cold page cache, with their `--stats`; everything in one JSON.

    python benchmarks/ct_profile.py --input DIR --json FILE [--variant "cpu streams=1" ...]

A variant is a device and ``key=value`` settings: ``streams=N`` (pack --streams), ``hash=N`` (the worker's hashing
threads, patched in: ``pipeline.stream.default_hash_threads``), ``readahead=BYTES``
(``$KIMI_CONVERT_STARTUP_READAHEAD``: also each stream's file-hash lead), ``lead=BYTES`` (the least lead of a
stream's file hashes ahead of its reads: ``Tuning.eager_hash``), ``early=0`` (no unit computed
without torch: ``compute_early.takes`` patched to refuse every unit, as before session 14), ``kthreads=N`` (the
threads of the C kernels run without torch, patched in: ``compute_early.EarlyCompute``), ``knice=N`` (the C kernels'
pool workers' nice value: ``kernels.clib.KERNEL_NICE``), ``kspin=NS`` (how long an idle C pool worker polls before
it sleeps: ``kernels.clib.KERNEL_SPIN_NS``), ``switch=S`` (the interpreter's thread switch interval,
``sys.setswitchinterval``; 0.005 by default), ``sra=1`` (the start-up readahead whatever the device, as before
session 17: ``pack._startup_readahead`` patched), ``rab=BYTES`` (the bytes a stream reads ahead of its compute
beyond its three pieces: ``Tuning.read_ahead_bytes``; 0 as before session 18), ``fakegpu=1`` (``auto`` as
on a machine with one GPU, the probe computing with the torch code on the CPUs: ``devices`` and
``probe.child_device`` patched; for what ``auto`` costs beside ``cpu`` where there is no GPU), ``probe_after=S``
(``Tuning.probe_after_s``; 0: the probe at once, as before session 18). The ``Tuning`` fields are passed to pack
as the CLI's context object, the rest patched in.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from compare_speed import evict, measure  # noqa: E402

#: pack with the hashing threads and the least hash lead patched (measurement switches, kept out of the package;
#: -1: as the package has it)
PATCHED = ("import sys, kimi_convert.pipeline.stream as s, kimi_convert.compute_early as e\n"
           "import kimi_convert.kernels.clib as c, kimi_convert.pipeline.probe as p\n"
           "n, lead, early, kt, knice, kspin = (int(sys.argv.pop(1)) for _ in range(6))\n"
           "switch = float(sys.argv.pop(1))\n"
           "if int(sys.argv.pop(1)):\n"
           "    import kimi_convert.pack as pk\n"
           "    pk._startup_readahead = lambda source, parts, budget, devs, need: pk.readahead(source, parts, budget)\n"
           "import dataclasses\n"
           "from kimi_convert.tuning import Tuning\n"
           "t = Tuning.from_env()\n"
           "rab = int(sys.argv.pop(1))\n"
           "if rab >= 0: t = dataclasses.replace(t, read_ahead_bytes=rab)\n"
           "fake, after = int(sys.argv.pop(1)), float(sys.argv.pop(1))\n"
           "if fake:\n"
           "    import kimi_convert.devices as d\n"
           "    d.gpu_count = d.gpus_at_most = lambda *a: 1\n"
           "    d.torch_has_cuda = lambda: True\n"
           "    p.child_device = lambda gpu: 'reference'\n"
           "if after >= 0: t = dataclasses.replace(t, probe_after_s=after)\n"
           "if switch > 0: sys.setswitchinterval(switch)\n"
           "if knice > 0: c.KERNEL_NICE = knice\n"
           "if kspin >= 0: c.KERNEL_SPIN_NS = kspin\n"
           "if n >= 0: s.default_hash_threads = lambda streams, share: n\n"
           "if lead >= 0: t = dataclasses.replace(t, eager_hash=lead)\n"
           "if early == 0: e.takes = lambda unit: False\n"
           "init = e.EarlyCompute.__init__\n"
           "if kt > 0: e.EarlyCompute.__init__ = lambda self, threads, block: init(self, kt, block)\n"
           "from kimi_convert.cli import cli; cli(prog_name='kimi-convert', obj=t)")


def sha256_rate(threads: int, nbytes: int = 512 << 20) -> float:
    """GB/s of sha256 over in-memory bytes, ``threads`` chains at once (hashlib releases the GIL)."""
    data = os.urandom(nbytes)
    t = time.perf_counter()
    ts = [threading.Thread(target=lambda: hashlib.sha256(data).digest()) for _ in range(threads)]
    for x in ts:
        x.start()
    for x in ts:
        x.join()
    return round(threads * nbytes / 1e9 / (time.perf_counter() - t), 3)


def cold_read(folder: Path) -> float:
    """GB/s of one sequential pass over the folder's files with 16 MB reads, from a cold page cache."""
    evict(folder)
    n, t = 0, time.perf_counter()
    for p in sorted(folder.glob("*.safetensors")):
        with open(p, "rb", buffering=0) as f:
            while b := f.read(16 << 20):
                n += len(b)
    return round(n / 1e9 / (time.perf_counter() - t), 3)


def run_variant(src: Path, spec: str, work: Path, recipe: str = "ct-nvfp4-a16") -> dict:
    device, *sets = spec.split()
    kv = dict(s.split("=", 1) for s in sets)
    out, stats = work / "out", work / "stats.json"
    env = dict(os.environ)
    if "readahead" in kv:
        env["KIMI_CONVERT_STARTUP_READAHEAD"] = kv["readahead"]
    args = ["pack", str(src), str(out), "-q", "--overwrite", "--recipe", recipe, "--device", device,
            "--stats", str(stats), *(["--streams", kv["streams"]] if "streams" in kv else [])]
    removed = {"window", "pnice", "takes"} & kv.keys()  # knobs that were off by default, removed (issue 40)
    if removed:
        raise SystemExit(f"{spec}: {', '.join(sorted(removed))}: no longer a setting (benchmarks/RESULTS.md)")
    patched = {"hash", "lead", "early", "kthreads", "knice", "kspin", "switch", "sra", "rab", "fakegpu",
               "probe_after"} & kv.keys()
    cmd = ([sys.executable, "-c", PATCHED, kv.get("hash", "-1"), kv.get("lead", "-1"), kv.get("early", "1"),
            kv.get("kthreads", "0"), kv.get("knice", "0"), kv.get("kspin", "-1"), kv.get("switch", "0"),
            kv.get("sra", "0"),
            kv.get("rab", "-1"), kv.get("fakegpu", "0"), kv.get("probe_after", "-1"), *args]
           if patched else [sys.executable, "-m", "kimi_convert.cli", *args])
    shutil.rmtree(out, ignore_errors=True)  # outside the timing, as ct_speed.py does for both tools
    evict(src)
    r = measure(cmd, env, "kimi-convert", spec, "-", 0.1)
    return {"variant": spec, "wall_s": round(r.wall_s, 2), "cpu_s": round(r.cpu_s, 1),
            "peak_pss_gb": round(r.peak_pss / 1e9, 2), "stats": json.loads(stats.read_text())}


def chain(stats: dict) -> str:
    """The input file's sha256 chain's seconds from --stats: busy, of which on a CPU and on its own reads, and its
    thread's wait for a CPU."""
    st = stats.get("stages_s", {})
    keys = {"busy": "hash: input file digest chains (busy)", "on CPU": "hash: input file digest chains (on a CPU)",
            "own reads": "hash: input file digest chains (own reads)",
            "runqueue": "hash: input file digest chains' thread (waiting for a CPU)"}
    return ", ".join(f"{k} {st[v]}" for k, v in keys.items() if v in st)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--input", type=Path, required=True)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--recipe", default="ct-nvfp4-a16", help="pack's --recipe (another recipe: the same profile)")
    ap.add_argument("--variant", nargs="+", default=["cpu streams=1", "cpu streams=4", "cpu streams=1 hash=8"])
    a = ap.parse_args()
    res = {"cpus": os.cpu_count(), "sha256_gbps": {n: sha256_rate(n) for n in (1, 4, 8)},
           "cold_read_gbps": cold_read(a.input), "runs": []}
    print(json.dumps({k: v for k, v in res.items() if k != "runs"}), flush=True)
    with tempfile.TemporaryDirectory(dir=a.input.parent) as work:
        for spec in a.variant:
            r = run_variant(a.input, spec, Path(work), a.recipe)
            res["runs"].append(r)
            st = r["stats"]
            print(f"{spec}: wall {r['wall_s']} s, CPU {r['cpu_s']} s, PSS {r['peak_pss_gb']} GB; setup "
                  f"{st.get('setup_s')} convert {st['convert_s']:.2f} finish {st.get('finish_s')} backend "
                  f"{st['backend_s']:.2f} hash wait {st.get('input_hash_wait_s')} streams {st['stream_wall_s']}; chain "
                  f"{chain(st)}",
                  flush=True)
            a.json.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
