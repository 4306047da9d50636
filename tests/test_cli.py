"""The command line: one-line errors, exit code 2, no traceback; help for every subcommand."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import run


def cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "kimi_convert.cli", *map(str, args)], capture_output=True,
                          text=True, **kw)


@pytest.mark.parametrize("cmd", ["synth", "inspect", "plan", "pack"])
def test_help(cmd):
    assert run(cmd, "--help").exit_code == 0


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
    for p in (tmp_path / "a").iterdir():
        assert p.read_bytes() == (tmp_path / "b" / p.name).read_bytes()
    assert run("synth", "tiny-kimi-linear", tmp_path / "c", "--seed", "4").exit_code == 0
    assert (tmp_path / "c/model-00002-of-00004.safetensors").read_bytes() != \
        (tmp_path / "a/model-00002-of-00004.safetensors").read_bytes()
