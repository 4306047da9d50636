"""The command line: one-line errors, exit code 2, no traceback; help for every subcommand."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import run


def cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "kimi_convert.cli", *map(str, args)], capture_output=True,
                          text=True, **kw)


def test_help_for_every_command():
    from kimi_convert.cli import cli as group
    assert set(group.commands) == {"synth", "inspect", "plan", "pack", "verify-manifest", "upload"}
    for cmd in group.commands:
        r = run(cmd, "--help")
        assert r.exit_code == 0 and f"Usage: cli {cmd}" in r.output.replace("kimi-convert", "cli"), (cmd, r.output)


def test_user_errors_are_one_line_exit_2(tmp_path, tiny_k3):
    r = cli("plan", tmp_path / "nope")
    assert r.returncode == 2 and r.stderr.strip().startswith("kimi-convert: error:") and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "cfg" / "model.safetensors").write_bytes(b"\x02\0\0\0\0\0\0\0{}")
    r = cli("plan", tmp_path / "cfg")
    assert r.returncode == 2 and "unknown architecture" in r.stderr and "--mapping" in r.stderr
    r = cli("plan", tiny_k3, "--exclude", "language_model.model.layers.0.self_attn.v_proj")
    assert r.returncode == 2 and "in_proj_qkvgfab" in r.stderr and "Traceback" not in r.stderr
    assert "v_proj: keep" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_bad_mapping_and_exclude_files(tmp_path, tiny_k3):
    bad = tmp_path / "m.toml"
    bad.write_text('name = "x"\nlinear = = 3\n')
    r = cli("plan", tiny_k3, "--mapping", bad)
    assert r.returncode == 2 and "m.toml" in r.stderr and "line" in r.stderr
    bad.write_text('name = "x"\n[[group]]\nname = "g"\nmembers = ["a"]\nparents = ["p"]\n')
    r = cli("plan", tiny_k3, "--mapping", bad)
    assert r.returncode == 2 and "group[0]: members must name two or more" in r.stderr
    ex = tmp_path / "ex.txt"
    ex.write_text("lm_head\nbad pattern\n")
    r = cli("plan", tiny_k3, "--exclude-from", ex)
    assert r.returncode == 2 and "ex.txt:2" in r.stderr


def test_max_shard_size_parsing(tiny_kl):
    assert run("plan", tiny_kl, "--max-shard-size", "lots").exit_code == 2
    r = run("plan", tiny_kl, "--max-shard-size", "500kB", "--json")
    assert r.exit_code == 0 and len(json.loads(r.output)["shards"]) >= 2


def test_synth_is_deterministic(tmp_path):
    for d in ("a", "b"):
        assert run("synth", "tiny-kimi-linear", tmp_path / d, "--seed", "3").exit_code == 0
    files = [p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file()]
    assert len(files) == len([p for p in (tmp_path / "b").rglob("*") if p.is_file()])
    for rel in files:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel
    assert run("synth", "tiny-kimi-linear", tmp_path / "c", "--seed", "4").exit_code == 0
    assert (tmp_path / "c/model-00002-of-00004.safetensors").read_bytes() != \
        (tmp_path / "a/model-00002-of-00004.safetensors").read_bytes()


# ---- wrong paths: one form in every subcommand, before any work (no progress bar, no click wording)

def _one_line(r, needle):
    err = r.stderr.strip()
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert len(err.splitlines()) == 1 and err == f"kimi-convert: error: {needle}", err
    assert "Usage:" not in r.stderr and "%|" not in r.stderr


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
        _one_line(cli(*args), f"{path}: does not exist")
    is_file = {
        ("plan", f): "a checkpoint folder", ("pack", f, tmp_path / "o"): "a checkpoint folder",
        ("verify-manifest", f): "a kimi-convert output folder",
        ("upload", f, "me/repo"): "a kimi-convert output folder",
        ("verify-manifest", packed_kl, "--input", f): "a checkpoint folder",
        ("pack", packed_kl, f): "an output folder", ("synth", "tiny-k3", f): "an output folder",
    }
    for args, what in is_file.items():
        _one_line(cli(*args), f"{f}: is a file, expected {what}")
    _one_line(cli("plan", packed_kl, "--exclude-from", tmp_path), f"{tmp_path}: is a folder, expected an exclude file")
    assert not (tmp_path / "o").exists()


def test_bad_device_is_a_usage_error_listing_every_value(packed_kl, tiny_kl, tmp_path):
    for args in (("verify-manifest", packed_kl, "--device", "gpu"),
                 ("pack", tiny_kl, tmp_path / "o", "--device", "gpu")):
        r = cli(*args)
        _one_line(r, r.stderr.strip().removeprefix("kimi-convert: error: "))
        for value in ("auto", "cpu", "cuda", "cuda:N", "reference", "triton"):
            assert value in r.stderr
    assert not (tmp_path / "o").exists()


def test_verify_of_a_folder_without_manifest_prints_no_bar(tiny_kl):
    r = cli("verify-manifest", tiny_kl, env={**__import__("os").environ, "TQDM_DISABLE": ""})
    _one_line(r, f"{tiny_kl}: no manifest.json: not a finished kimi-convert output")


def test_progress_is_decimal_and_has_no_eta_at_the_start(capsys):
    from kimi_convert.progress import ETA_AFTER, Progress
    bar = Progress("pack", total=10_000_000_000)
    bar._shown().disable = False
    bar.update(10_000_000)  # 0.1 %: too early for an estimate
    early = str(bar._shown())
    bar.update(int(ETA_AFTER * 10_000_000_000))
    later = str(bar._shown())
    bar.close()
    assert "GB" in early and "GiB" not in early and "<" not in early, early
    assert "<" in later, later  # elapsed<remaining once there is something to estimate from


def test_output_paths_are_printed_without_doubled_slashes(tiny_kl, tmp_path):
    r = cli("pack", tiny_kl, f"{tmp_path}/o/", "-q")
    assert r.returncode == 0, r.stderr
    assert f"wrote {tmp_path}/o/ (recipe" in r.stdout and "//" not in r.stdout
