"""The manifest at the released Kimi K3's scale (issue 14 item 3): `verify-manifest`'s manifest-level
checks on a full-size output, format 3 (manifest.json + one JSON Lines records file per shard, streamed)
against format 2 (every module record in manifest.json, parsed whole).

    python benchmarks/manifest_scale.py [--dir DIR] [--runs N] [--layers N] [--experts N] [--before COMMIT]

A real pack of `synth k3-full-sparse` reads 1.56 TB, so the output is made the way pack makes its
manifest, without converting data: the plan of the sparse K3 (default options: recipe nvidia-k3,
source layout), each output shard written sparse (its real header, the data region a hole), each
shard's records file written by ``manifest.write_records`` (what a pack's stream calls as a shard
finishes) from stand-in hashes (sha256 of each tensor's name) and notes shaped like a real pack's
(cast counts, amax, zero tiles), then ``outfolder.OutputFolder.finish`` (configs, index, side files, manifest.json,
exactly as pack ends). The format 2 manifest is the same records in one file, written as format 2's
pack wrote it (``atomic.dumps`` with ``modules`` one compact entry a line), in a second folder whose
other files are links to the first's.

Then each verify runs in a child process: ``verify.verify(OUTPUT)`` (offline) with every check but
one: a shard's bytes are not read (1.56 TB of holes); its hashes are the stand-ins, so headers,
records, index, configs, row ranges and engine rules are all checked as for a real output (and must
pass). Reported: CPU seconds (user + sys) and peak RSS (wait4) of the child, the best of --runs, and
the same for a child that only imports verify (the interpreter and imports), and the load average.
No plan is built by an offline verify: its memory is the manifest's alone. --before COMMIT also
runs the format 2 manifest through that commit's verify (its package taken from git, as
tests/test_same_bytes.py does): the code before format 3, which parsed the index whole too.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import hashlib, sys
from pathlib import Path
import kimi_convert.verify as V
import kimi_convert.verify.offline as O
if sys.argv[1] == "import":
    sys.exit(0)
real = O.hash_file
def stand_in(path, ranges, progress=None, stop=None, **kw):
    # a shard's bytes are holes: its file and tensor hashes are the stand-ins the manifest was written with
    if path.name.endswith(".safetensors"):
        sha = lambda s: hashlib.sha256(s.encode()).hexdigest()
        return ({d: f"{d}:{sha(path.name)}" for d in kw.get("file_digests", ("blake3",))}, path.stat().st_size,
                {t: sha(t) for t in ranges})
    return real(path, ranges, progress, stop, **kw)
O.hash_file = stand_in
print("code:", V.__file__)
rep = V.verify(Path(sys.argv[1]))
for name, ok, detail in rep.checks:
    print("ok  " if ok else "FAIL", name, detail)
print("\n".join(rep.problems[:5]))
sys.exit(0 if rep.ok else 1)
"""


def stand_in(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def notes_for(it) -> dict:
    """Notes shaped like a real pack's (their keys and magnitudes), for the records' size."""
    from kimi_convert.plan import FP8, NVFP4, Encoding

    enc = it.sources[0].encoding
    if it.kind == NVFP4 and enc == Encoding.MXFP4:
        n = it.outputs[0].shape[0] * it.outputs[0].shape[1] * 2 // 16
        return {"blocks": n, "k_max": 3, "lossless_blocks": n - 1, "method": "mxfp4-cast", "source_encoding": enc}
    if it.kind == NVFP4:
        return {"amax": 0.123456789, "method": "quantized", "source_encoding": enc}
    if it.kind == FP8:
        return {"method": "fp8-block", "source_encoding": enc, "zero_tiles": 0}
    return {}


def make_output(src: Path, out: Path) -> dict:
    """The output pack would write, data regions as holes; returns what it took and wrote."""
    from kimi_convert import pack as P
    from kimi_convert.hashing import FILE_DIGEST, labelled
    from kimi_convert.journal import Journal, ShardRecord
    from kimi_convert.manifest import write_records
    from kimi_convert.options import Options
    from kimi_convert.outfolder import OutputFolder
    from kimi_convert.plan.serialize import plan_dict, plan_hash

    t0 = time.process_time()
    ckpt, plan = P.load_plan(src, Options())
    t_plan = time.process_time() - t0
    out.mkdir(parents=True)
    j = Journal(plan_hash(plan_dict(plan)), "bench", {})
    j.save(out)
    units_of: dict[str, list] = {s.file: [] for s in plan.shards}
    for u in plan.units:
        units_of[u.shard].append(u)
    t0 = time.process_time()
    for s in plan.shards:
        with open(out / s.file, "wb") as f:
            f.write(s.header)
        os.truncate(out / s.file, s.size)
        units = units_of[s.file]
        items = [it for u in units for it in u.items]
        rec = write_records(out, s.file, units, {t.name: stand_in(t.name) for it in items for t in it.outputs},
                            {p.name: stand_in(p.name) for it in items for x in it.sources for p in x.parts},
                            {it.name: notes_for(it) for it in items})
        j.shards[s.file] = ShardRecord(s.size, labelled(FILE_DIGEST, stand_in(s.file)), rec.size, rec.digest,
                                       rec.modules)
    t_records = time.process_time() - t0
    t0 = time.process_time()
    folder = OutputFolder(out, -1)  # (no lock: nothing else writes here)
    folder.journal = j
    folder.finish(ckpt, plan, {f: labelled(FILE_DIGEST, stand_in(f)) for f, _ in plan.inputs})
    t_finish = time.process_time() - t0
    return {"plan_cpu_s": t_plan, "records_cpu_s": t_records, "finish_cpu_s": t_finish,
            "modules": sum(len(u.items) for u in plan.units),
            "tensors": sum(len(s.placed) for s in plan.shards), "shards": len(plan.shards)}


def make_v2(out: Path, v2: Path) -> None:
    """The same manifest as format 2 wrote it: every records line in manifest.json's ``modules``."""
    from kimi_convert.atomic import dumps

    man = json.loads((out / "manifest.json").read_text())
    modules = [json.loads(line) for e in man.pop("records") for line in (out / e["file"]).open()]
    man["format_version"] = 2
    body = {}
    for k, v in man.items():  # format 2's key order: "modules" before "engine_groups"
        if k == "engine_groups":
            body["modules"] = modules
        body[k] = v
    v2.mkdir(parents=True)
    for p in out.iterdir():
        if p.name not in ("manifest.json", "manifest-records"):
            (v2 / p.name).symlink_to(p.resolve())
    (v2 / "manifest.json").write_text(dumps(body, compact_lists=("modules",)))


def old_package(commit: str, dest: Path) -> Path:
    """The package of ``commit`` laid out as installed (kimi_convert/...), from git."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from test_same_bytes import _old_package

    if not (dest / "kimi_convert").exists() and _old_package(dest, commit) is None:
        raise SystemExit(f"no git history with commit {commit}")
    return dest


def measure(target: str, runs: int, env: dict, cwd: Path | None = None) -> tuple[float, int, str]:
    best = (float("inf"), 0, "")
    for _ in range(runs):
        child = subprocess.Popen([sys.executable, "-c", CHILD, target], env=env, stdout=subprocess.PIPE, text=True,
                                 cwd=cwd)
        text = child.stdout.read()
        _, status, ru = os.wait4(child.pid, 0)
        if os.waitstatus_to_exitcode(status):
            raise SystemExit(f"verify of {target} failed:\n{text}")
        cpu = ru.ru_utime + ru.ru_stime
        best = min(best, (cpu, ru.ru_maxrss * 1024, text), key=lambda r: r[0])
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/kimi-manifest-scale"))
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--layers", type=int, help="synth --layers (default: the release's)")
    ap.add_argument("--experts", type=int, help="synth --experts (default: the release's)")
    ap.add_argument("--before", metavar="COMMIT", help="also verify format 2 with this commit's code")
    a = ap.parse_args(argv)
    env = {**os.environ, "TQDM_DISABLE": "1"}
    tag = f"L{a.layers or 'all'}-E{a.experts or 'all'}"
    src, out, v2 = a.dir / f"k3-{tag}", a.dir / f"out-{tag}", a.dir / f"out-v2-{tag}"
    if not src.exists():
        extra = [*(["--layers", str(a.layers)] if a.layers else []),
                 *(["--experts", str(a.experts)] if a.experts else [])]
        subprocess.run([sys.executable, "-m", "kimi_convert.cli", "synth", "k3-full-sparse", str(src), *extra],
                       check=True, env=env)
    if not out.exists():
        made = make_output(src, out)
        make_v2(out, v2)
        print(f"output: {made['shards']} shards, {made['tensors']:,} tensors, {made['modules']:,} modules; "
              f"plan {made['plan_cpu_s']:.1f} CPU s, records written in {made['records_cpu_s']:.1f} CPU s, "
              f"configs/index/manifest.json in {made['finish_cpu_s']:.1f} CPU s", flush=True)
        # measured from a fresh process: Linux carries a parent's peak RSS over into a forked child's
        # (wait4's ru_maxrss), and this one holds the plan and the format 2 manifest
        os.execv(sys.executable, [sys.executable, *sys.argv])
    records = sorted((out / "manifest-records").iterdir())
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    print(f"format 3: manifest.json {(out / 'manifest.json').stat().st_size / 1e6:.1f} MB + {len(records)} records "
          f"files, {sum(p.stat().st_size for p in records) / 1e6:.1f} MB (largest "
          f"{max(p.stat().st_size for p in records) / 1e6:.1f} MB)")
    print(f"format 2: manifest.json {(v2 / 'manifest.json').stat().st_size / 1e6:.1f} MB")
    print(f"index: {(out / 'model.safetensors.index.json').stat().st_size / 1e6:.1f} MB")
    base = measure("import", a.runs, env)
    print(f"{'':28} {'CPU s':>7} {'peak RSS':>10} {'RSS - import':>13}")
    print(f"{'python + import verify':28} {base[0]:7.1f} {base[1] / 2**20:8.0f} MiB {'':>13}")
    for name, target in (("verify, format 3 (stream)", out), ("verify, format 2 (one file)", v2)):
        cpu, rss, text = measure(str(target), a.runs, env)
        print(f"{name:28} {cpu:7.1f} {rss / 2**20:8.0f} MiB {(rss - base[1]) / 2**20:9.0f} MiB")
    if a.before:
        pkg = old_package(a.before, a.dir / f"pkg-{a.before}")
        cpu, rss, text = measure(str(v2.absolute()), a.runs, {**env, "PYTHONPATH": str(pkg)}, cwd=pkg)
        name = f"format 2, code of {a.before}"
        print(f"{name:28} {cpu:7.1f} {rss / 2**20:8.0f} MiB {(rss - base[1]) / 2**20:9.0f} MiB")
    print(text.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
