"""The released Kimi K3 end to end at its real shape (issue 43): ``synth k3-full-sparse`` (96 files of about 16 GB,
497,220 tensors; real headers, every data region a hole) packed under NVIDIA's recipe into a Hub repository,
``pack INPUT OUT --upload REPO --no-keep-output``, with the fake Hub (tests/fakehub.py) as the sink: it checks every
uploaded object's sha256 and size and keeps no bytes.

    python benchmarks/whole_release.py [--shards N] [--input local|hub] [--max-scratch SIZE] [--kill-seed S]
                                       [--full DIR] [--work DIR] [--name NAME] [--sample S] [--stop-after S]
                                       [--reference NAME.json] [--baseline NAME.json]

- ``--shards N``: the first N of the 96 shards (default all), laid out as the release: shards 1..N-1 are the
  release's files (hard links), shard N is cut at the last layer it holds whole (its header rewritten without
  the next layer's first tensors, still sparse), ``config.json`` says that many layers, the index lists exactly
  what the files hold. The whole release: ``--shards 96``.
- ``--input local``: the sparse folder itself; ``--input hub``: the same served by the fake Hub as
  ``hf://user/k3`` (from disk, never read into memory; each file's sha256 computed once and kept in
  ``FULL/../sha256-cache.json``, keyed by path, size and mtime), downloaded within ``--max-scratch``.
- ``--kill-seed S``: after the uninterrupted run, the same pack into a second repository, killed (SIGKILL) at a
  random point after half the shards (the seeded RNG picks the shard after whose upload it dies and the
  fraction of a shard's time it waits), resumed with ``--resume``, and the two repositories' trees compared
  file by file (sha256: the sink's recorded oids, the regular files hashed).
- ``--stop-after S``: the pack stopped (SIGKILL) after S seconds, and its samples reported (RSS, CPU, local disk; not
  the shards' arrivals, which are read from the commit): the memory of the whole release's run in minutes rather
  than its two hours (issue 43).
- ``--reference NAME.json`` (with ``--kill-seed``): the whole release packed twice is two runs of about two hours
  each, so the uninterrupted run writes every file's sha256 into its ``NAME.json`` (``tree_sha256``) and a later
  run given it packs only the killed and resumed leg and compares its tree with that one (same input, same code:
  the JSON's command and the results' commit say which). Each leg's peak RSS and local disk are reported too,
  so that this one run also gives the memory of the whole release.
- ``--baseline NAME.json``: a smaller input's run (``--shards 2``: the release's first 21.7 GB) whose peak RSS is the
  base of issue 43's bound: this run's peak (either leg's) over it, sampled and ``ru_maxrss``.

Measured from outside the pack, every ``--sample`` seconds: the RSS summed over the pack's process tree, its CPU
time (user + system, children included), and the local disk it holds (blocks allocated under OUTPUT and the
scratch folder). From the sink: when each output shard's last byte arrived. Reported: wall time, throughput
(input bytes / wall), peak RSS (sampled tree, and the pack process's own ``ru_maxrss``), peak local disk against
its bound (``--max-scratch`` for a Hub input, plus ``QUEUE + 2`` output shards in flight:
docs/pack-upload.md), the manifest's size (``manifest.json`` plus its records files), time to the first uploaded
shard, and per shard the wall and CPU time between one shard's arrival and the next (CPU time is what shows no
quadratic step on a shared, loaded machine). Writes ``NAME.json``, ``NAME.md`` (the command and a table),
``NAME.csv`` (per shard), ``NAME-samples.csv`` (every sample) and ``NAME.png`` (per shard, and RSS and disk over
time; when matplotlib is installed: ``pip install matplotlib``) into benchmarks/results/.
CPU only (``--device cpu``); run it under ``nice -n 19`` on a shared machine.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from fakehub import TOKEN, FakeHub  # noqa: E402

INDEX = "model.safetensors.index.json"
RESULTS = ROOT / "benchmarks" / "results"


# ------------------------------------------------------------------------------------------------
# The input: the whole sparse release, or its first N shards


def make_full(full: Path) -> Path:
    """``synth k3-full-sparse`` into ``full`` once (30 s, about 130 MB of real disk)."""
    if not (full / INDEX).exists():
        shutil.rmtree(full, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "kimi_convert.cli", "synth", "k3-full-sparse", str(full)], check=True,
                       stdout=subprocess.DEVNULL)
    return full


def _header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n)), 8 + n


def _layer(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1]) if "layers" in parts else None


def _cut_shard(src: Path, dst: Path, layers: int) -> dict[str, str]:
    """``src`` without the tensors of layers ``layers`` and above: the same order, offsets packed, data a hole.
    Returns its tensors' names."""
    from kimi_convert.safetensors_format import HeaderTensor, encode_header

    head, _ = _header(src)
    kept = sorted(((k, v) for k, v in head.items() if k != "__metadata__" and (_layer(k) or 0) < layers),
                  key=lambda kv: kv[1]["data_offsets"][0])
    starts, ends, at = [], [], 0
    for _, v in kept:
        a, b = v["data_offsets"]
        starts.append(at)
        at += b - a
        ends.append(at)
    raw = encode_header([HeaderTensor(k, v["dtype"], tuple(v["shape"])) for k, v in kept], starts, ends, align=8)
    with open(dst, "wb") as f:
        f.write(raw)
    os.truncate(dst, len(raw) + at)
    return {k: dst.name for k, _ in kept}


def make_slice(full: Path, dst: Path, n: int) -> Path:
    """The first ``n`` shards of ``full`` as a checkpoint of its own (module docstring). Kept if already made."""
    if (dst / INDEX).exists():
        return dst
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    idx = json.loads((full / INDEX).read_text())
    files = sorted(set(idx["weight_map"].values()))
    keep, last = files[:n], files[n - 1]
    layers = max(_layer(k) for k, f in idx["weight_map"].items() if f == last and _layer(k) is not None)
    # ``layers``: the highest layer index in the last file; it may continue in the next file: cut it
    weight_map = {k: f for k, f in idx["weight_map"].items() if f in keep[:-1]}
    weight_map |= _cut_shard(full / last, dst / last, layers)
    for p in full.iterdir():
        if p.name == INDEX or p.name == last or (p.suffix == ".safetensors" and p.name not in keep):
            continue
        if p.is_dir():
            shutil.copytree(p, dst / p.name)
        elif p.suffix == ".safetensors":
            os.link(p, dst / p.name)
        else:
            shutil.copy2(p, dst / p.name)
    cfg = json.loads((dst / "config.json").read_text())
    text = cfg["text_config"]
    text["num_hidden_layers"] = layers
    cfg["tie_word_embeddings"] = text["tie_word_embeddings"] = True  # lm_head is in the release's last file
    attn = text["linear_attn_config"]  # 1-based layer numbers
    attn["kda_layers"] = [k for k in attn["kda_layers"] if k <= layers]
    attn["full_attn_layers"] = [k for k in attn["full_attn_layers"] if k <= layers]
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    total = sum(_tensor_bytes(dst / f) for f in keep)
    (dst / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(
        weight_map.items()))}, indent=2) + "\n")
    return dst


def _tensor_bytes(path: Path) -> int:
    head, _ = _header(path)
    return sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in head.items() if k != "__metadata__")


# ------------------------------------------------------------------------------------------------
# One pack, watched from outside


@dataclass
class Sample:
    t: float  # seconds since the pack started
    rss: int  # summed over the process tree
    cpu: float  # user + system seconds of the tree, ended children included
    disk: int  # blocks allocated under OUTPUT and the scratch folder


@dataclass
class Run:
    code: int
    wall_s: float
    maxrss: int  # the pack process's own peak (wait4), bytes
    samples: list[Sample] = field(default_factory=list)
    started: float = 0.0  # monotonic, for the sink's arrival times
    killed_at: float | None = None  # seconds since start
    low_disk: bool = False  # stopped: the filesystem's free space fell below --min-free

    def peak(self, what: str) -> int:
        """The largest sample of ``what`` (``rss`` or ``disk``); 0 without samples."""
        return max((getattr(s, what) for s in self.samples), default=0)


def _tree_usage(proc) -> tuple[int, float]:
    import psutil

    rss, cpu = 0, 0.0
    try:
        procs = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0.0
    for k, p in enumerate(procs):
        try:
            t = p.cpu_times()
            rss += p.memory_info().rss
            cpu += t.user + t.system + (t.children_user + t.children_system if k == 0 else 0.0)
        except psutil.NoSuchProcess:
            pass
    return rss, cpu


def _allocated(*folders: Path) -> int:
    n = 0
    for d in folders:
        for root, _, files in os.walk(d):
            for f in files:
                with contextlib.suppress(FileNotFoundError):  # deleted while listed
                    n += os.lstat(os.path.join(root, f)).st_blocks * 512
    return n


def watch(cmd: list[str], env: dict, log: Path, folders: list[Path], every: float, min_free: int,
          kill_when=None) -> Run:
    """Run ``cmd`` (its own process group), sampling it every ``every`` s until it exits. ``kill_when(t)``: called
    at each sample with the seconds since the start; True kills the group (SIGKILL). The filesystem's free
    space below ``min_free`` stops it too (a shared disk)."""
    import psutil

    t0 = time.monotonic()
    with open(log, "ab") as f:
        child = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    run = Run(0, 0.0, 0, started=t0)
    proc, done = psutil.Process(child.pid), threading.Event()

    def sample() -> None:
        while not done.wait(every):
            t = time.monotonic() - t0
            rss, cpu = _tree_usage(proc)
            if rss:  # (0: the process has ended, not yet reaped)
                run.samples.append(Sample(round(t, 2), rss, round(cpu, 2), _allocated(*folders)))
            low = shutil.disk_usage(folders[0].parent).free < min_free
            if run.killed_at is None and (low or (kill_when is not None and kill_when(t))):
                run.killed_at, run.low_disk = round(t, 2), low
                os.killpg(child.pid, signal.SIGKILL)
    th = threading.Thread(target=sample, daemon=True)
    th.start()
    _, status, usage = os.wait4(child.pid, 0)
    run.wall_s = round(time.monotonic() - t0, 2)
    done.set()
    th.join()
    child.returncode = run.code = os.waitstatus_to_exitcode(status)
    run.maxrss = usage.ru_maxrss * 1024
    return run


# ------------------------------------------------------------------------------------------------
# The legs


@dataclass
class Leg:
    """What every pack of one benchmark shares."""

    hub: FakeHub
    source: str  # the folder, or hf://user/k3
    work: Path
    env: dict
    args: argparse.Namespace

    def command(self, out: Path, repo: str) -> list[str]:
        cmd = [sys.executable, "-m", "kimi_convert.cli", "pack", self.source, str(out), "--device", "cpu", "-q",
               "--upload", repo, "--no-keep-output", "--stats", str(out.parent / f"{out.name}-stats.json"),
               "--token", TOKEN]
        if self.source.startswith("hf://"):
            cmd += ["--scratch", str(self.scratch(out)), "--max-scratch", self.args.max_scratch]
        return cmd

    def scratch(self, out: Path) -> Path:
        return self.work / f"{out.name}.scratch"

    def pack(self, out: Path, repo: str, kill_when=None, cmd: list[str] | None = None) -> Run:
        return watch(cmd or self.command(out, repo), self.env, self.work / f"{out.name}.log",
                     [out, self.scratch(out)], self.args.sample, _size(self.args.min_free), kill_when)


def hub_env(hub: FakeHub, work: Path, queue: int | None) -> dict:
    """A hermetic environment for the pack (``tests/fakehub.hub_cli``'s): the fake Hub, no Xet, no stored login."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE_"))}
    env.update(HF_ENDPOINT=hub.url, HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1", TQDM_DISABLE="1",
               HF_HOME=str(work / "hf-home"), HF_HUB_DISABLE_PROGRESS_BARS="1")
    if queue is not None:
        env["KIMI_CONVERT_UPLOAD_QUEUE"] = str(queue)
    return env


def _size(text: str) -> int:
    from kimi_convert.clioptions import Size

    return Size().convert(text, None, None)


def arrivals(hub: FakeHub, repo: str, started: float, since: int = 0) -> list[tuple[str, float, int]]:
    """(shard, seconds since ``started`` when its last byte reached the sink, its size), in arrival order; only the
    objects the sink received from its ``since``-th on (a later pack of the same objects counts its own)."""
    by_oid = {oid: p for p, oid in hub.tree_sha256(repo).items() if p.endswith(".safetensors")}
    got = [(by_oid[oid], round(rec.at - started, 2), rec.size) for oid, rec in hub.received[since:] if oid in by_oid]
    seen: dict[str, tuple[str, float, int]] = {}
    for a in got:  # an object sent twice (it should not be) counts at its first arrival
        seen.setdefault(a[0], a)
    return sorted(seen.values(), key=lambda a: a[1])


def _cpu_at(samples: list[Sample], t: float) -> float:
    """The tree's CPU seconds at ``t``, interpolated between the samples around it."""
    before = [s for s in samples if s.t <= t] or samples[:1]
    after = [s for s in samples if s.t >= t] or samples[-1:]
    a, b = before[-1], after[0]
    return a.cpu if b.t == a.t else a.cpu + (b.cpu - a.cpu) * (t - a.t) / (b.t - a.t)


# ------------------------------------------------------------------------------------------------
# Figures


def per_shard(run: Run, arr: list[tuple[str, float, int]]) -> list[dict]:
    """Each shard's wall and CPU time since the previous shard's arrival (the first: since the pack started)."""
    rows, prev = [], 0.0
    for k, (name, t, size) in enumerate(arr, 1):
        wall, cpu = t - prev, _cpu_at(run.samples, t) - _cpu_at(run.samples, prev)
        rows.append({"index": k, "shard": name, "arrival_s": t, "out_bytes": size, "wall_s": round(wall, 2),
                     "cpu_s": round(cpu, 2), "wall_s_per_gb": round(wall / (size / 1e9), 3),
                     "cpu_s_per_gb": round(cpu / (size / 1e9), 3)})
        prev = t
    return rows


def figures(run: Run, rows: list[dict], input_bytes: int, out: Path, release_bytes: int) -> dict:
    """The run's figures, and the whole release's time estimated from the steady shards (all but the first,
    which carries the start-up; the slice's cut last shard counted by its bytes)."""
    first = rows[0]["arrival_s"] if rows else None
    records = out / "manifest-records"
    steady = rows[1:] or rows
    wall_gb = statistics.median(r["wall_s_per_gb"] for r in steady) if steady else None
    cpu_gb = statistics.median(r["cpu_s_per_gb"] for r in steady) if steady else None
    finish = run.wall_s - rows[-1]["arrival_s"] if rows else None
    out_gb = sum(r["out_bytes"] for r in rows) / 1e9
    f = {"code": run.code, "wall_s": run.wall_s, "input_bytes": input_bytes,
         "throughput_gb_s": round(input_bytes / 1e9 / run.wall_s, 3), "output_bytes": int(out_gb * 1e9),
         "shards": len(rows), "time_to_first_uploaded_shard_s": first,
         "peak_rss_tree": run.peak("rss"), "pack_maxrss": run.maxrss,
         "peak_rss_first_shard": max((s.rss for s in run.samples if first is None or s.t <= first), default=0),
         "peak_local_disk": run.peak("disk"),
         "cpu_s": max((s.cpu for s in run.samples), default=None),
         "manifest_bytes": (out / "manifest.json").stat().st_size if (out / "manifest.json").exists() else None,
         "records_bytes": sum(p.stat().st_size for p in records.iterdir()) if records.is_dir() else None,
         "finish_s": round(finish, 2) if finish is not None else None,
         "steady_wall_s_per_gb_median": wall_gb, "steady_cpu_s_per_gb_median": cpu_gb}
    if rows and wall_gb is not None:
        full_gb = release_bytes / 1e9 * (out_gb * 1e9 / input_bytes)  # the release's output, at this ratio
        f["estimate_whole_release_s"] = round(first + (full_gb - rows[0]["out_bytes"] / 1e9) * wall_gb + finish)
        f["estimate_whole_release_cpu_s"] = round(_cpu_at(run.samples, first) + (full_gb - rows[0]["out_bytes"]
                                                                                 / 1e9) * cpu_gb)
    f["rss_peak_over_first_shard"] = round(f["peak_rss_tree"] / max(1, f["peak_rss_first_shard"]), 3)
    if len(steady) > 1:
        per = [r["cpu_s_per_gb"] for r in steady]
        f["steady_cpu_s_per_gb_last_over_first"] = round(per[-1] / per[0], 3)
    return f


def over_baseline(base: dict, result: dict, where: str) -> dict:
    """This run's peak RSS (sampled, and the pack's own ``ru_maxrss``; a killed and resumed run's: either leg's)
    over a smaller input's (``--baseline``)."""
    kr = result.get("kill_and_resume") or {}
    sampled = max(result.get("peak_rss_tree", 0), kr.get("killed_peak_rss_tree", 0), kr.get("resume_peak_rss_tree", 0))
    own = max(result.get("pack_maxrss", 0), kr.get("killed_pack_maxrss", 0), kr.get("resume_pack_maxrss", 0))
    return {"baseline": where, "baseline_input_bytes": base["input_bytes"],
            "baseline_peak_rss_tree": base["peak_rss_tree"], "baseline_pack_maxrss": base["pack_maxrss"],
            "rss_peak_over_baseline": round(sampled / base["peak_rss_tree"], 3),
            "maxrss_over_baseline": round(own / base["pack_maxrss"], 3)}


def write_report(name: str, result: dict, rows: list[dict], run: Run, cmd: str) -> list[Path]:
    """NAME.json, NAME.md, NAME.csv, NAME.png (matplotlib permitting) in benchmarks/results/."""
    base = RESULTS / name
    base.parent.mkdir(parents=True, exist_ok=True)  # (--name session29/run: its folder too)
    (base.with_suffix(".json")).write_text(json.dumps({**result, "per_shard": rows}, indent=1) + "\n")
    with open(base.parent / f"{base.name}-samples.csv", "w", newline="") as f:  # for another look
        w = csv.writer(f)
        w.writerow(["t_s", "rss_tree_bytes", "cpu_tree_s", "local_disk_bytes"])
        w.writerows([s.t, s.rss, s.cpu, s.disk] for s in run.samples)
    with open(base.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["index"])
        w.writeheader()
        w.writerows(rows)
    table = "\n".join(f"| {k} | {_fmt(k, v)} |" for k, v in result.items() if not isinstance(v, dict | list))
    shard_rows = "\n".join(f"| {r['index']} | {r['shard']} | {r['out_bytes'] / 1e9:.2f} | {r['arrival_s']} | "
                           f"{r['wall_s']} | {r['cpu_s']} | {r['wall_s_per_gb']} | {r['cpu_s_per_gb']} |" for r in rows)
    (base.with_suffix(".md")).write_text(
        f"`{cmd}`\n\n| figure | value |\n|---|---|\n{table}\n\n| # | shard | GB out | arrived s | wall s | CPU s | "
        f"wall s/GB | CPU s/GB |\n|---|---|---|---|---|---|---|---|\n{shard_rows}\n")
    written = [base.with_suffix(s) for s in (".json", ".csv", ".md")] + [base.parent / f"{base.name}-samples.csv"]
    if _plot(base.with_suffix(".png"), rows, run):
        written.append(base.with_suffix(".png"))
    return written


def _fmt(key: str, v) -> str:
    if isinstance(v, int) and ("bytes" in key or "rss" in key or "disk" in key) and v > 1e6:
        return f"{v / 1e9:.3f} GB" if v > 1e9 else f"{v / 1e6:.1f} MB"
    return str(v)


def _plot(path: Path, rows: list[dict], run: Run) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 7))
    idx = [r["index"] for r in rows]
    a.plot(idx, [r["wall_s_per_gb"] for r in rows], "o-", label="wall s per GB out")
    a.plot(idx, [r["cpu_s_per_gb"] for r in rows], "s-", label="CPU s per GB out")
    a.set_xlabel("output shard (arrival order; the first carries the start-up)")
    a.set_ylim(bottom=0)
    a.legend()
    a.set_title("time per shard")
    t = [s.t for s in run.samples]
    b.plot(t, [s.rss / 1e9 for s in run.samples], label="RSS of the process tree, GB")
    b.plot(t, [s.disk / 1e9 for s in run.samples], label="local disk held, GB")
    for r in rows:
        b.axvline(r["arrival_s"], color="grey", lw=0.5)
    b.set_xlabel("seconds (grey: a shard on the Hub)")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


# ------------------------------------------------------------------------------------------------
# Killed once after half the shards, resumed: the same tree


def kill_and_resume(leg: Leg, ref: dict[str, str], ref_rows: list[dict], ref_finish: float,
                    seed: int) -> tuple[dict, Run, list[dict]]:
    """The pack again into ``user/k3-killed``, SIGKILLed after shard ``j`` (``j`` drawn from half the shards to
    all of them) reached the sink plus a random fraction of a typical shard's time (of the finish, after the
    last), resumed with the journal's command; its tree against ``ref`` (the uninterrupted run's). Also the killed
    pack's run and its shards' rows (those on the Hub before the kill), for the time per shard up to the kill."""
    rng = random.Random(seed)
    n = len(ref_rows)
    j = rng.randint((n + 1) // 2, n)
    gap = ref_finish if j == n else statistics.median(r["wall_s"] for r in ref_rows[1:] or ref_rows)
    delay = round(rng.random() * gap, 2)
    oids = {ref[r["shard"]] for r in ref_rows}
    out, repo, mark = leg.work / "out-killed", "user/k3-killed", len(leg.hub.received)
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(leg.scratch(out), ignore_errors=True)
    seen: dict[str, float] = {}

    def kill_when(t: float) -> bool:
        for oid, _ in leg.hub.received[mark:]:
            if oid in oids:
                seen.setdefault(oid, t)
        return len(seen) >= j and t >= sorted(seen.values())[j - 1] + delay
    first = leg.pack(out, repo, kill_when)
    leg.hub.wait_idle()
    r = {"seed": seed, "killed_after_shards": j, "delay_s": delay, "killed_at_s": first.killed_at,
         "killed_code": first.code, "shards_on_hub_at_kill": len(seen),
         "killed_peak_rss_tree": first.peak("rss"), "killed_pack_maxrss": first.maxrss,
         "killed_peak_local_disk": first.peak("disk")}
    if first.killed_at is not None:  # (a kill point in the finish may come after the pack ended: not resumed)
        cmd = shlex.split(json.loads((out / ".kimi-convert-pack.json").read_text())["command"])
        assert cmd[:2] == ["kimi-convert", "pack"], cmd
        resumed = leg.pack(out, repo, cmd=[sys.executable, "-m", "kimi_convert.cli", *cmd[1:], "--token", TOKEN])
        r |= {"resume_code": resumed.code, "resume_wall_s": resumed.wall_s, "resume_command": shlex.join(cmd),
              "resume_peak_rss_tree": resumed.peak("rss"),
              "resume_pack_maxrss": resumed.maxrss,
              "resume_peak_local_disk": resumed.peak("disk")}
    got = leg.hub.tree_sha256(repo) if repo in leg.hub.repos else {}
    sent = [oid for oid, _ in leg.hub.received[mark:]]
    rows = []
    if repo in leg.hub.repos:
        end = first.killed_at if first.killed_at is not None else first.wall_s
        rows = per_shard(first, [a for a in arrivals(leg.hub, repo, first.started, mark) if a[1] <= end])
    r |= killed_steady(rows)
    return {**r,
            "objects_sent_twice": len(sent) - len(set(sent)), "files": len(got),
            "same_tree": got == ref, "differing_files": sorted(k for k in ref.keys() | got.keys()
                                                              if ref.get(k) != got.get(k))}, first, rows


def killed_steady(rows: list[dict]) -> dict:
    """The killed pack's time per shard: the steady shards' (all but the first) median wall and CPU seconds per GB
    out, and the last third's median over the first third's (flat: about 1)."""
    steady = rows[1:]
    if len(steady) < 3:
        return {}
    third = len(steady) // 3
    med = {k: [statistics.median(r[k] for r in part) for part in (steady[:third], steady[-third:])]
           for k in ("wall_s_per_gb", "cpu_s_per_gb")}
    return {"killed_steady_wall_s_per_gb_median": statistics.median(r["wall_s_per_gb"] for r in steady),
            "killed_steady_cpu_s_per_gb_median": statistics.median(r["cpu_s_per_gb"] for r in steady),
            "killed_wall_s_per_gb_last_third_over_first": round(med["wall_s_per_gb"][1] / med["wall_s_per_gb"][0], 3),
            "killed_cpu_s_per_gb_last_third_over_first": round(med["cpu_s_per_gb"][1] / med["cpu_s_per_gb"][0], 3)}


# ------------------------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=96, help="the first N of the release's 96 shards")
    ap.add_argument("--input", choices=["local", "hub"], default="local")
    ap.add_argument("--max-scratch", default="17GB", help="a Hub input's download bound (one 16.3 GB file at least)")
    ap.add_argument("--upload-queue", type=int, help="KIMI_CONVERT_UPLOAD_QUEUE (default: the tool's, 2)")
    ap.add_argument("--kill-seed", type=int, help="also kill once after half the shards, resume, compare")
    ap.add_argument("--reference", type=Path, help="an earlier uninterrupted run's NAME.json (same input, "
                    "same code): only the killed and resumed pack runs, its tree compared with that run's "
                    "(with --kill-seed)")
    ap.add_argument("--baseline", type=Path, help="a smaller input's run (its NAME.json, such as --shards 2's: "
                    "the release's first 21.7 GB): its peak RSS is the base of issue 43's bound (1.2x)")
    ap.add_argument("--full", type=Path, default=Path("/tmp/kimi-convert-whole-release/k3-full"))
    ap.add_argument("--work", type=Path, help="default: beside --full")
    ap.add_argument("--name", help="the results' file name (default whole-release-INPUT-NSHARDS)")
    ap.add_argument("--sample", type=float, default=0.5, help="seconds between samples")
    ap.add_argument("--min-free", default="3GB", help="stop the pack if the filesystem's free space falls below")
    ap.add_argument("--stop-after", type=float, help="stop the pack after this many seconds and report what it did "
                    "until then (the memory of the whole release's run without its two hours)")
    ap.add_argument("--replot", metavar="NAME", help="draw NAME.png again from NAME.json and NAME-samples.csv (a run "
                    "made where matplotlib was not installed), and nothing else")
    return ap.parse_args(argv)


def replot(name: str) -> None:
    """NAME.png from the files a run wrote (its shards from NAME.json, its samples from NAME-samples.csv)."""
    from types import SimpleNamespace

    rows = json.loads((RESULTS / f"{name}.json").read_text())["per_shard"]
    with open(RESULTS / f"{name}-samples.csv", newline="") as f:
        samples = [SimpleNamespace(t=float(r["t_s"]), rss=int(r["rss_tree_bytes"]), disk=int(r["local_disk_bytes"]))
                   for r in csv.DictReader(f)]
    if not _plot(RESULTS / f"{name}.png", rows, SimpleNamespace(samples=samples)):
        sys.exit("matplotlib is not installed: pip install matplotlib")


def main(argv: list[str] | None = None) -> dict:
    a = parse(argv)
    if a.replot:
        replot(a.replot)
        return {}
    if a.reference is not None and a.kill_seed is None:
        sys.exit("--reference compares a killed and resumed run: give --kill-seed")
    a.work = a.work or a.full.parent / f"work-{a.input}-{a.shards}"
    a.work.mkdir(parents=True, exist_ok=True)
    full = make_full(a.full)
    release_bytes = json.loads((full / INDEX).read_text())["metadata"]["total_size"]
    src = full if a.shards >= 96 else make_slice(full, a.full.parent / f"slice-{a.shards}", a.shards)
    input_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    result: dict = {"input": a.input, "shards_in": a.shards, "release_input_bytes": release_bytes,
                    "cpus": len(os.sched_getaffinity(0)), "load_before": round(os.getloadavg()[0], 2),
                    "upload_queue": a.upload_queue, "max_scratch": a.max_scratch if a.input == "hub" else None}
    with FakeHub(TOKEN, keep_uploads=False) as hub:
        t = time.monotonic()
        source = str(src)
        if a.input == "hub":
            hub.seed("user/k3", src, on_disk=True, sha_cache=a.full.parent / "sha256-cache.json")
            source = "hf://user/k3"
        result["seed_s"] = round(time.monotonic() - t, 2)
        leg = Leg(hub, source, a.work, hub_env(hub, a.work, a.upload_queue), a)
        if a.reference is not None:  # the whole release twice is two runs of two hours: one a session
            ref = json.loads(a.reference.read_text())
            result |= {"reference": str(a.reference), "reference_command": ref["command"]}
            result["kill_and_resume"], killed, rows = kill_and_resume(leg, ref["tree_sha256"], ref["per_shard"],
                                                                      ref["finish_s"], a.kill_seed)
            return _report(a, argv, result, rows, killed)  # the killed pack's shards and samples
        out, repo = a.work / "out", "user/k3-nvfp4"
        shutil.rmtree(out, ignore_errors=True)
        run = leg.pack(out, repo, (lambda t: t >= a.stop_after) if a.stop_after else None)
        stopped = run.killed_at is not None and not run.low_disk
        if run.code != 0 and not run.low_disk and not stopped:
            sys.exit(f"the pack failed ({run.code}): {(a.work / 'out.log').read_text()[-2000:]}")
        rows = per_shard(run, arrivals(hub, repo, run.started)) if run.code == 0 or stopped else []
        result["stopped_after_s"] = run.killed_at if stopped else None
        result |= figures(run, rows, input_bytes, out, release_bytes)
        if stopped:  # stopped, not finished: no finish to time, nor a whole run to estimate from it
            for k in ("finish_s", "estimate_whole_release_s", "estimate_whole_release_cpu_s"):
                result.pop(k, None)
        queue = 2 if a.upload_queue is None else a.upload_queue  # Tuning.upload_queue's default
        result["local_disk_bound"] = (queue + 2) * max((r["out_bytes"] for r in rows), default=0) + (
            _size(a.max_scratch) if a.input == "hub" else 0)  # docs/pack-upload.md, docs/hub-input.md
        result["local_disk_within_bound"] = result["peak_local_disk"] <= result["local_disk_bound"]
        result["stopped_for_low_disk"] = run.low_disk
        result["load_after"] = round(os.getloadavg()[0], 2)
        if run.code == 0:  # every file's sha256, kept: a later --reference run's tree is compared with it
            result["tree_sha256"] = hub.tree_sha256(repo)
        if a.kill_seed is not None and run.code == 0:
            ref = result["tree_sha256"]
            for oid, _ in hub.received:  # the same objects again: the killed run must send them itself
                hub.lfs.pop(oid, None)
            result["kill_and_resume"] = kill_and_resume(leg, ref, rows, result["finish_s"], a.kill_seed)[0]
    return _report(a, argv, result, rows, run)


def _report(a: argparse.Namespace, argv: list[str] | None, result: dict, rows: list[dict], run: Run) -> dict:
    cmd = shlex.join(["python", "benchmarks/whole_release.py", *(argv if argv is not None else sys.argv[1:])])
    if a.baseline is not None:
        result |= over_baseline(json.loads(a.baseline.read_text()), result, str(a.baseline))
    result["command"] = cmd
    name = a.name or f"whole-release-{a.input}-{a.shards}"
    written = write_report(name, result, rows, run, cmd)
    print(json.dumps({k: v for k, v in result.items()}, indent=1))
    print("wrote", *map(str, written))
    return result


if __name__ == "__main__":
    main()
