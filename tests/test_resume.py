"""Reliability: kill and resume, Ctrl-C, a full or read-only disk, hostile input, determinism.

Kills, fault points, signals and resource limits need a real process (``run_process``, ``child``);
everything else (refusals at plan time, hostile input, resumes) runs the CLI in this process (``run``).
"""

from __future__ import annotations

import json
import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

import fault_inject
from helpers import (
    child,
    cli_command,
    copy_ckpt,
    edit_config,
    one_line_error,
    readline_within,
    replace_tensor,
    rewrite_tensors,
    run,
    run_process,
    synth_and_pack,
)

# SGLang's fused layout with its own shard size: shards of 1 MB at most, 14 of the medium input (the source
# layout keeps the input's files); one worker and one stream, pinned: which shards a kill leaves finished
# depends on them (the default streams follow the CPU count)
PACK_ARGS = ["--layout", "sglang", "--recipe", "nvfp4-w4a16", "--max-shard-size", "1MB", "-q", "--device", "cpu",
             "--workers", "1", "--streams", "1"]


def killed_at(point: str, *args) -> None:
    """``kimi-convert ARGS`` in a process that SIGKILLs itself at fault point ``point`` (NAME:N)."""
    r = run_process(*args, env={"KIMI_CONVERT_FAULT": point})
    assert r.code == -signal.SIGKILL, (r.code, r.stderr)


def assert_not_finished(out: Path) -> None:
    assert not (out / "manifest.json").exists()


@pytest.fixture(scope="module")
def medium(tmp_path_factory) -> tuple[Path, Path]:
    """tiny-k3 with 32 experts a layer and its uninterrupted pack (14 shards of 1 MB at most)."""
    return synth_and_pack(tmp_path_factory.mktemp("medium"), PACK_ARGS, "--experts", "32")


@pytest.mark.slow
@pytest.mark.parametrize(("point", "at"), [("header", 1), ("header", 2), ("tensor", 3), ("tensor", 150),
                                           ("shard", 1), ("shard", 2), ("records", 1), ("records", 3),
                                           ("journal", 3), ("json", 1), ("json", 4)])
def test_killed_at_a_fault_point_resumes_identically(medium, tmp_path, point, at):
    src, ref = medium
    out = tmp_path / "out"
    killed_at(f"{point}:{at}", "pack", src, out, *PACK_ARGS)
    assert_not_finished(out)
    # without --resume: the leftover is reported with the command that resumes it
    err = one_line_error(run("pack", src, out, *PACK_ARGS))
    cmd = re.search(r"resume it with: (.+)$", err).group(1)
    assert "--resume" in cmd and "--max-shard-size 1MB" in cmd
    r = run(*shlex.split(cmd)[1:])
    assert r.code == 0, r.stderr
    assert fault_inject.same_tree(ref, out) == []
    assert not list(out.rglob("*.partial")) and not (out / ".kimi-convert-pack.json").exists()


@pytest.mark.slow
def test_random_kills_short(tmp_path):
    """The fault-injection script, short: random points and random-time SIGKILLs."""
    assert fault_inject.main(["--trials", "4", "--seed", "7", "--work", str(tmp_path / "f")]) == 0


@pytest.mark.slow
def test_resume_reverifies_finished_shards(medium, tmp_path):
    src, ref = medium
    out = tmp_path / "out"
    # killed once shard 2 is renamed, before its journal entry: shard 1 is finished and journaled
    killed_at("shard:2", "pack", src, out, *PACK_ARGS)
    finished = sorted(out.glob("model-*.safetensors"))[0]
    data = bytearray(finished.read_bytes())
    data[-1] ^= 0xFF  # a finished shard damaged after the fact: not trusted, redone
    finished.write_bytes(bytes(data))
    r = run("pack", src, out, *PACK_ARGS, "--resume")
    assert r.code == 0 and "verified and kept" not in r.stdout
    assert fault_inject.same_tree(ref, out) == []


@pytest.mark.slow
def test_resume_redoes_a_shard_whose_records_file_changed(medium, tmp_path):
    """A journaled shard is kept only with its records file as journaled: an edited records file
    (the shard itself intact) makes the resume write both again."""
    src, ref = medium
    out = tmp_path / "out"
    killed_at("shard:3", "pack", src, out, *PACK_ARGS)
    records = sorted((out / "manifest-records").glob("*.jsonl"))
    assert len(records) == 2
    edited = records[0].read_bytes().replace(b'"blake3":"', b'"blake3":"0', 1)
    assert edited != records[0].read_bytes()
    records[0].write_bytes(edited)
    r = run("pack", src, out, *PACK_ARGS, "--resume")
    assert r.code == 0, r.stderr
    assert fault_inject.same_tree(ref, out) == []


@pytest.mark.slow
def test_resume_refuses_other_options_and_changed_input(medium, tmp_path):
    src = copy_ckpt(medium[0], tmp_path / "in")
    out = tmp_path / "out"
    killed_at("shard:1", "pack", src, out, *PACK_ARGS)
    journal = (out / ".kimi-convert-pack.json").read_bytes()
    # the same input, other options: the plan differs (and the inputs are unchanged)
    err = one_line_error(run("pack", src, out, "--max-shard-size", "2MB", "-q", "--resume"))
    assert "cannot resume: the plan (input headers, mapping or options) differs since the interrupted run" in err
    # the same options, an input file touched since: the inputs changed (the plan, from the headers, did not)
    os.utime(sorted(src.glob("*.safetensors"))[0], ns=(1, 1))
    err = one_line_error(run("pack", src, out, *PACK_ARGS, "--resume"))
    assert "cannot resume: input files changed since the interrupted run" in err
    assert (out / ".kimi-convert-pack.json").read_bytes() == journal  # refused: nothing rewritten
    assert_not_finished(out)


def test_an_earlier_versions_interrupted_pack_is_not_continued(tiny_k3, tmp_path):
    """A pack interrupted under format_version 3 (its finished shards' records hold sha256; packed by that
    version's code, taken from git): continuing it here would put two tensor digests in one manifest, so its
    journal (version 3) is refused in one line; --overwrite starts again, with BLAKE3 throughout."""
    import sys

    from test_same_bytes import _old_package
    from test_verify import V3_COMMIT

    old = _old_package(tmp_path / "old", V3_COMMIT)
    if old is None:
        pytest.skip(f"no git history with commit {V3_COMMIT} to take the earlier code from")
    out = tmp_path / "out"
    args = ["pack", tiny_k3, out, "--max-shard-size", "1000000", "-q", "--device", "cpu", "--workers", "1",
            "--streams", "1"]
    r = subprocess.run([sys.executable, "-m", "kimi_convert.cli", *map(str, args)], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(old), "KIMI_CONVERT_FAULT": "shard:2"}, cwd=old,
                       timeout=600)
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr)
    assert json.loads((out / ".kimi-convert-pack.json").read_text())["version"] == 3
    records = sorted((out / "manifest-records").glob("*.jsonl"))
    assert records and b'"sha256":"' in records[0].read_bytes()
    err = one_line_error(run(*args, "--resume"))
    assert "journal version 3 is not 5; start again with --overwrite" in err, err
    assert_not_finished(out)
    r = run(*args, "--overwrite")
    assert r.code == 0, r.stderr
    assert json.loads((out / "manifest.json").read_text())["tensor_digest"] == "blake3"
    assert all(b'"sha256":"' not in f.read_bytes() for f in (out / "manifest-records").glob("*.jsonl"))


def test_resume_of_a_complete_output(medium, tmp_path):
    src, ref = medium
    out = tmp_path / "out"
    shutil.copytree(ref, out)
    r = run("pack", src, out, *PACK_ARGS, "--resume")
    assert r.code == 0 and "already complete" in r.stdout
    shard = sorted(out.glob("model-*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    assert "does not match manifest.json" in one_line_error(run("pack", src, out, *PACK_ARGS, "--resume"))


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_stops_within_two_seconds_and_resumes(medium, tmp_path, sig):
    src, ref = medium
    out = tmp_path / "out"
    # the run pauses mid-header of the second shard, where the signal arrives
    env = {**os.environ, "KIMI_CONVERT_FAULT": "header:2:pause"}
    with child(cli_command("pack", src, out, *PACK_ARGS), stderr=subprocess.PIPE, text=True, env=env) as p:
        deadline = time.time() + 60
        while not list(out.glob("model-00002-of-*.safetensors.partial")) and time.time() < deadline \
                and p.poll() is None:
            time.sleep(0.01)
        assert p.poll() is None and list(out.glob("model-00002-of-*.safetensors.partial")), "never paused"
        time.sleep(0.5)
        t = time.perf_counter()
        p.send_signal(sig)
        first = readline_within(p.stderr, 30)  # printed once the pipeline has stopped and the journal is saved
        stopped = time.perf_counter() - t
        _, rest = p.communicate(timeout=30)
        exited = time.perf_counter() - t
        err = first + rest
        assert p.returncode == 130, err
        assert stopped < 2.0, stopped
        # the process ends at once after its message: the interpreter's finalization (seconds once torch is
        # imported) is skipped
        assert exited - stopped < 1.0, (stopped, exited)
        line = err.strip()
        assert len(line.splitlines()) == 1 and "interrupted" in line and "resume with:" in line, line
        assert_not_finished(out)
        assert "1 shard(s) finished" in line
        cmd = line.split("resume with: ", 1)[1]
        r = run(*shlex.split(cmd)[1:])
        assert r.code == 0, r.stderr
        assert fault_inject.same_tree(ref, out) == []


def _mount_tmpfs(path: Path, size: str, ro: bool = False) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if ro else "")
    return subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True).returncode == 0


@pytest.fixture
def tmpfs(tmp_path):
    mounted = []

    def make(name: str, size: str, ro: bool = False) -> Path:
        p = tmp_path / name
        if not _mount_tmpfs(p, size, ro):
            pytest.skip("cannot mount a tmpfs here")
        mounted.append(p)
        return p
    yield make
    for p in mounted:
        subprocess.run(["umount", "-l", str(p)], capture_output=True)


def test_disk_too_small_fails_before_writing(medium, tmpfs):
    src, _ = medium
    small = tmpfs("small", "1m")
    err = one_line_error(run("pack", src, small / "out", *PACK_ARGS))
    # both numbers in a unit that shows them (a fixed GB said "needs 0.00 GB ... 0.00 GB free")
    assert re.search(r"needs [1-9][0-9.]* [kMG]?B for \d+ shard\(s\), [1-9][0-9.]* [kMG]?B free", err), err
    assert not list((small / "out").glob("*.safetensors"))


def test_read_only_output(medium, tmpfs):
    src, _ = medium
    ro = tmpfs("ro", "1m", ro=True)
    err = one_line_error(run("pack", src, ro / "out", *PACK_ARGS))
    assert "Read-only file system" in err


@pytest.mark.slow
def test_write_failure_mid_pack_then_resume(medium, tmp_path):
    """A file-size limit makes a shard's space reservation fail (EFBIG), like a disk filling up."""
    src, ref = medium
    out = tmp_path / "out"

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, 1_000_000))
    err = one_line_error(run_process("pack", src, out, *PACK_ARGS, preexec_fn=limit))
    assert "cannot write" in err and "--resume" in err
    assert_not_finished(out)
    assert (out / ".kimi-convert-pack.json").exists()  # resumable
    r = run("pack", src, out, *PACK_ARGS, "--resume")
    assert r.code == 0, r.stderr
    assert fault_inject.same_tree(ref, out) == []


# --- hostile and broken input: one line, exit 2, nothing that looks finished -------------------

def _shard_of(folder: Path, tensor: str) -> Path:
    return folder / json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][tensor]


def _second_shard(folder: Path) -> Path:
    return sorted(folder.glob("model-*.safetensors"))[1]


def _truncate(folder: Path):
    p = _second_shard(folder)
    p.write_bytes(p.read_bytes()[:-100])


def _header_length(folder: Path):
    p = _second_shard(folder)
    data = p.read_bytes()
    p.write_bytes((10**15).to_bytes(8, "little") + data[8:])


def _header_not_json(folder: Path):
    p = _second_shard(folder)
    data = bytearray(p.read_bytes())
    data[8] = ord("x")
    p.write_bytes(bytes(data))


def _unknown_dtype(folder: Path):
    p = _second_shard(folder)
    data = p.read_bytes()
    n = int.from_bytes(data[:8], "little")
    head = data[8 : 8 + n].replace(b'"BF16"', b'"BF17"', 1)
    p.write_bytes(data[:8] + head + data[8 + n :])


def _duplicate(folder: Path):
    name = "language_model.model.norm.weight"
    idx = json.loads((folder / "model.safetensors.index.json").read_text())
    target = next(f for f in sorted(set(idx["weight_map"].values())) if f != idx["weight_map"][name])
    from safetensors.torch import load_file, save_file
    t = load_file(str(folder / target))
    t[name] = load_file(str(_shard_of(folder, name)))[name]
    save_file(t, str(folder / target), metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").unlink()  # with an index, the index check fires first


def _index_edit(value: str):
    def fn(folder: Path):
        p = folder / "model.safetensors.index.json"
        idx = json.loads(p.read_text())
        idx["weight_map"]["language_model.model.norm.weight"] = value
        p.write_text(json.dumps(idx))
    return fn


def _symlink_escape(folder: Path):
    p = _second_shard(folder)
    outside = folder.parent / "escaped.safetensors"
    shutil.move(p, outside)
    p.symlink_to(outside)


def _index_ghost(folder: Path):
    p = folder / "model.safetensors.index.json"
    idx = json.loads(p.read_text())
    idx["weight_map"]["language_model.model.ghost.weight"] = sorted(folder.glob("model-*.safetensors"))[0].name
    p.write_text(json.dumps(idx))


def _drop(name: str):
    return lambda folder: rewrite_tensors(folder, lambda t: t.pop(name, None))


def _config_text(text: str | None):
    def fn(folder: Path):
        if text is None:
            (folder / "config.json").unlink()
        else:
            (folder / "config.json").write_text(text)
    return fn


def _set(name: str, make):
    def fn(folder: Path):
        from safetensors.torch import load_file
        t = load_file(str(_shard_of(folder, name)))[name]
        replace_tensor(folder, name, make(t))
    return fn


def _nan(t):
    t = t.clone()
    t.view(-1)[5] = float("nan")
    return t


def _inf(t):
    t = t.clone()
    t.view(-1)[7] = float("-inf")
    return t


L1 = "language_model.model.layers.1"
EXPERT = f"{L1}.block_sparse_moe.experts.3.w1"
HOSTILE = {
    "truncated shard": (_truncate, "truncated"),
    "header length beyond the file": (_header_length, "exceeds"),
    "header not JSON": (_header_not_json, "not valid JSON"),
    "unknown dtype": (_unknown_dtype, "unknown dtype 'BF17'"),
    "duplicate tensor across shards": (_duplicate, "is also stored in"),
    "index names a missing file": (_index_edit("nope.safetensors"), "missing file"),
    "index names ../": (_index_edit("../x.safetensors"), "outside the input folder"),
    "index names an absolute path": (_index_edit("/etc/hostname"), "outside the input folder"),
    "symlink escaping the folder": (_symlink_escape, "resolves outside the input folder"),
    "index names a tensor not in the file": (_index_ghost, "ghost.weight is not in model-00001"),
    "config.json missing": (_config_text(None), "config.json: missing"),
    "config.json not JSON": (_config_text("{nope"), "not valid JSON"),
    "config lacks the layer lists": (lambda f: edit_config(f, lambda c: c["text_config"].pop("linear_attn_config")),
                                     "linear_attn_config.kda_layers is missing"),
    "config lacks text_config": (lambda f: edit_config(f, lambda c: c.pop("text_config")), "needs a 'text_config'"),
    "unknown architecture": (lambda f: edit_config(f, lambda c: c.update(architectures=["Foo"], model_type="foo")),
                             "unknown architecture"),
    "fused members of different dtypes": (_set(f"{L1}.self_attn.k_proj.weight", lambda t: t.half()), "dtypes differ",
                                          "--layout", "sglang"),
    "NaN in a weight": (_set(f"{L1}.self_attn.o_proj.weight", _nan), "holds NaN or Inf"),
    "Inf in a weight": (_set("language_model.model.layers.0.self_attn.q_proj.weight", _inf), "holds NaN or Inf"),
    "MXFP4 scale missing": (_drop(f"{EXPERT}.weight_scale"), "MXFP4 weight without its"),
    "MXFP4 scale mis-shaped": (_set(f"{EXPERT}.weight_scale", lambda t: t[:, :1].contiguous()), "MXFP4 scale must be"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_input(tiny_k3, tmp_path, case):
    corrupt, msg, *args = HOSTILE[case]
    ck = copy_ckpt(tiny_k3, tmp_path / "c")
    corrupt(ck)
    before = {p.name: p.read_bytes() for p in ck.iterdir() if p.is_file()}
    err = one_line_error(run("pack", ck, tmp_path / "out", "-q", "--device", "cpu", *args))
    assert msg in err, err
    assert_not_finished(tmp_path / "out")
    assert before == {p.name: p.read_bytes() for p in ck.iterdir() if p.is_file()}  # input untouched


@pytest.mark.parametrize("case", ["FP8 scale missing", "FP8 scale mis-shaped"])
def test_hostile_fp8_input(tiny_ds, tmp_path, case):
    ck = copy_ckpt(tiny_ds, tmp_path / "c")
    name = "model.layers.0.self_attn.q_a_proj.weight_scale_inv"
    if case == "FP8 scale missing":
        rewrite_tensors(ck, lambda t: t.pop(name, None))
        msg = "FP8 weight without its"
    else:
        _set(name, lambda t: t[:, :1].contiguous().repeat(1, 3))(ck)
        msg = "FP8 scale must be"
    err = one_line_error(run("pack", ck, tmp_path / "out", "-q"))
    assert msg in err


def test_bad_mapping_and_exclude_file_name_the_line(tiny_k3, tmp_path):
    m = tmp_path / "m.toml"
    m.write_text('name = "x"\n\nlinear = = 1\n')
    assert "line 3" in one_line_error(run("pack", tiny_k3, tmp_path / "o", "--mapping", m))
    ex = tmp_path / "ex.txt"
    ex.write_text("# comment\nlm_head\nfoo bar\n")
    assert "ex.txt:3" in one_line_error(run("pack", tiny_k3, tmp_path / "o", "--exclude-from", ex))


# --- determinism ----------------------------------------------------------------------------

def test_output_independent_of_threads(tiny_k3, tmp_path):
    for n in ("1", "3"):  # processes of their own: the CPU kernel's thread pool is made once per process
        r = run_process("pack", tiny_k3, tmp_path / n, "-q", "--device", "cpu", env={"KIMI_CONVERT_THREADS": n})
        assert r.code == 0, r.stderr
    assert fault_inject.same_tree(tmp_path / "1", tmp_path / "3") == []


def test_plan_independent_of_listing_order(tiny_kl, tmp_path, monkeypatch):
    from kimi_convert.pack import load_plan
    from kimi_convert.plan import Options
    from kimi_convert.plan.serialize import plan_dict
    ck = copy_ckpt(tiny_kl, tmp_path / "c")
    (ck / "model.safetensors.index.json").unlink()  # shards found by listing the folder
    a = plan_dict(load_plan(ck, Options())[1])
    for meth in ("iterdir", "glob", "rglob"):
        orig = getattr(Path, meth)
        monkeypatch.setattr(Path, meth, lambda self, *args, _o=orig: iter(reversed(list(_o(self, *args)))))
    assert plan_dict(load_plan(ck, Options())[1]) == a
