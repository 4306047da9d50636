"""The command line: one-line errors, exit code 2, no traceback; help for every subcommand."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from helpers import one_line_error, run, run_process

COMMANDS = {"synth", "inspect", "plan", "pack", "verify-manifest", "upload", "mapping"}
SUBCOMMANDS = {"mapping": {"derive"}}


def test_help_for_every_command():
    from kimi_convert.cli import cli as group
    assert set(group.commands) == COMMANDS
    for cmd in sorted(COMMANDS):
        for flag in ("--help", "-h"):
            r = run(cmd, flag)
            assert r.code == 0 and r.stdout.startswith(f"Usage: kimi-convert {cmd} "), (cmd, flag, r.stdout)
            assert r.stderr == ""
    r = run("--help")
    assert r.code == 0 and all(f"  {cmd} " in r.stdout for cmd in COMMANDS), r.stdout
    for cmd, subs in SUBCOMMANDS.items():
        assert set(group.commands[cmd].commands) == subs
        for sub in subs:
            r = run(cmd, sub, "--help")
            assert r.code == 0 and r.stdout.startswith(f"Usage: kimi-convert {cmd} {sub} "), r.stdout


# ---- the real entry points: exit codes and streams of a process of their own (the rest runs in-process)

def test_entry_point_user_error_is_one_line_exit_2(tmp_path):
    err = one_line_error(run_process("plan", tmp_path / "nope"))
    assert err == f"kimi-convert: error: {tmp_path / 'nope'}: does not exist"


def test_console_script_runs(tmp_path, tiny_kl):
    exe = shutil.which("kimi-convert", path=str(Path(sys.executable).parent))
    assert exe, "the kimi-convert console script is not installed next to this python"
    r = subprocess.run([exe, "plan", tiny_kl, "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert json.loads(r.stdout)["shards"]
    r = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("kimi-convert, version "), r.stdout


def test_user_errors_are_one_line_exit_2(tmp_path, tiny_k3):
    one_line_error(run("plan", tmp_path / "nope"))
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "cfg" / "model.safetensors").write_bytes(b"\x02\0\0\0\0\0\0\0{}")
    err = one_line_error(run("plan", tmp_path / "cfg"))
    assert "unknown architecture" in err and "--mapping" in err
    err = one_line_error(run("plan", tiny_k3, "--exclude", "language_model.model.layers.0.self_attn.v_proj"))
    assert "in_proj_qkvgfab" in err and "v_proj: keep" in err


def test_bad_mapping_and_exclude_files(tmp_path, tiny_k3):
    bad = tmp_path / "m.toml"
    bad.write_text('name = "x"\nlinear = = 3\n')
    err = one_line_error(run("plan", tiny_k3, "--mapping", bad))
    assert "m.toml" in err and "line 2" in err
    bad.write_text('name = "x"\n[[group]]\nname = "g"\nmembers = ["a"]\nparents = ["p"]\n')
    assert "group[0]: members must name two or more" in one_line_error(run("plan", tiny_k3, "--mapping", bad))
    ex = tmp_path / "ex.txt"
    ex.write_text("lm_head\nbad pattern\n")
    assert "ex.txt:2" in one_line_error(run("plan", tiny_k3, "--exclude-from", ex))


def test_max_shard_size_parsing(tiny_kl):
    r = run("plan", tiny_kl, "--max-shard-size", "lots")
    assert r.code == 2 and "is not a size like 5GB" in r.stderr
    r = run("plan", tiny_kl, "--max-shard-size", "500kB", "--json")
    assert r.code == 0 and len(json.loads(r.stdout)["shards"]) >= 2


def test_synth_is_deterministic(tmp_path):
    for d in ("a", "b"):
        assert run("synth", "tiny-kimi-linear", tmp_path / d, "--seed", "3").code == 0
    files = [p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file()]
    assert len(files) == len([p for p in (tmp_path / "b").rglob("*") if p.is_file()])
    for rel in files:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel
    assert run("synth", "tiny-kimi-linear", tmp_path / "c", "--seed", "4").code == 0
    assert (tmp_path / "c/model-00002-of-00004.safetensors").read_bytes() != \
        (tmp_path / "a/model-00002-of-00004.safetensors").read_bytes()


# ---- wrong paths: one form in every subcommand, before any work (no progress bar, no click wording)

def _one_line(r, needle):
    assert one_line_error(r) == f"kimi-convert: error: {needle}"


def test_missing_and_wrong_kind_paths_read_the_same_in_every_subcommand(tmp_path, packed_kl):
    f = tmp_path / "afile"
    f.write_text("x")
    nope = tmp_path / "nope"
    missing = {
        ("plan", nope): nope, ("pack", nope, tmp_path / "o"): nope, ("inspect", nope): nope,
        ("verify-manifest", nope): nope, ("verify-manifest", packed_kl, "--input", nope): nope,
        ("upload", nope, "me/repo"): nope, ("plan", packed_kl, "--exclude-from", nope): nope,
    }
    for args, path in missing.items():
        _one_line(run(*args), f"{path}: does not exist")
    is_file = {
        ("plan", f): "a checkpoint folder", ("pack", f, tmp_path / "o"): "a checkpoint folder",
        ("verify-manifest", f): "a kimi-convert output folder",
        ("upload", f, "me/repo"): "a kimi-convert output folder",
        ("verify-manifest", packed_kl, "--input", f): "a checkpoint folder",
        ("pack", packed_kl, f): "an output folder", ("synth", "tiny-k3", f): "an output folder",
    }
    for args, what in is_file.items():
        _one_line(run(*args), f"{f}: is a file, expected {what}")
    _one_line(run("plan", packed_kl, "--exclude-from", tmp_path), f"{tmp_path}: is a folder, expected an exclude file")
    assert not (tmp_path / "o").exists()


def test_bad_device_is_a_usage_error_listing_every_value(packed_kl, tiny_kl, tmp_path):
    for args in (("verify-manifest", packed_kl, "--device", "gpu"),
                 ("pack", tiny_kl, tmp_path / "o", "--device", "gpu")):
        err = one_line_error(run(*args))
        for value in ("auto", "cpu", "cuda", "cuda:N", "reference", "triton"):
            assert value in err
    assert not (tmp_path / "o").exists()


def test_verify_of_a_folder_without_manifest_prints_no_bar(tiny_kl):
    # a process of its own: tqdm reads TQDM_* when it is imported
    r = run_process("verify-manifest", tiny_kl, env={"TQDM_DISABLE": ""})
    _one_line(r, f"{tiny_kl}: no manifest.json: not a finished kimi-convert output")


def test_progress_is_decimal_and_has_no_eta_at_the_start(capsys, monkeypatch):
    import functools

    from kimi_convert import progress
    from kimi_convert.progress import ETA_AFTER, Progress

    # a bar that shows whatever TQDM_DISABLE said when tqdm was imported (tqdm reads it then)
    monkeypatch.setattr(progress, "tqdm", functools.partial(progress.tqdm, disable=False))
    bar = Progress("pack", total=10_000_000_000)
    bar.update(10_000_000)  # 0.1 %: too early for an estimate
    early = str(bar._shown())
    bar.update(int(ETA_AFTER * 10_000_000_000))
    later = str(bar._shown())
    bar.close()
    assert "GB" in early and "GiB" not in early and "<" not in early, early
    assert "<" in later, later  # elapsed<remaining once there is something to estimate from


def test_output_paths_are_printed_without_doubled_slashes(tiny_kl, tmp_path):
    r = run("pack", tiny_kl, f"{tmp_path}/o/", "-q")
    assert r.code == 0, r.stderr
    assert f"wrote {tmp_path}/o/ (recipe" in r.stdout and "//" not in r.stdout
