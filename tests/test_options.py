"""The options of plan and pack, defined once (convert/options.py): the flags, the manifest's
``options`` and verify's reading of it all come from the one dataclass; the Size type."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import fields

import click
import pytest
from click.testing import CliRunner

from helpers import one_line_error, run
from kimi_convert.clioptions import SIZE, click_options
from kimi_convert.options import DEFAULT_MAX_SHARD, Options
from kimi_convert.plan import Options as PlanOptions

#: The manifest's ``options`` keys, in the order every manifest so far has written them.
MANIFEST_KEYS = ["recipe", "layout", "input_scale", "exclude", "exclude_from", "default_excludes", "keep_partial",
                 "max_shard_size", "fuse", "no_fuse"]


def _parsed(*args: str) -> Options:
    """The Options a command decorated with click_options receives for ``args``."""
    got = []

    @click.command()
    @click_options
    @click.option("--other", is_flag=True)
    def cmd(opts: Options, other: bool) -> None:
        got.append(opts)

    r = CliRunner().invoke(cmd, list(args), catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return got[0]


def test_plan_options_is_the_one_definition():
    assert PlanOptions is Options


def test_defaults_and_manifest_keys():
    d = Options().to_dict()
    assert list(d) == MANIFEST_KEYS
    assert d == {"recipe": None, "layout": "source", "input_scale": None, "exclude": [], "exclude_from": [],
                 "default_excludes": True, "keep_partial": False, "max_shard_size": DEFAULT_MAX_SHARD, "fuse": [],
                 "no_fuse": []}
    assert _parsed() == Options()
    assert "mapping" not in d and "strict" not in d


def test_round_trip_cli_options_manifest_options(tmp_path):
    ex = tmp_path / "ex.txt"
    ex.write_text("lm_head\n")
    opts = _parsed("--exclude", "lm_head", "--exclude", "*.gate", "--exclude-from", str(ex), "--no-default-excludes",
                   "--keep-partial", "--fuse", "a", "--no-fuse", "b", "--no-fuse", "c", "--max-shard-size", "2GiB",
                   "--mapping", "kimi_linear", "--recipe", "nvfp4-w4a16", "--layout", "sglang", "--input-scale",
                   "0.5", "--strict", "--other")
    assert opts == Options(exclude=("lm_head", "*.gate"), exclude_from=(str(ex),), default_excludes=False,
                           keep_partial=True, fuse=("a",), no_fuse=("b", "c"), max_shard_size=2 * 1024**3,
                           mapping="kimi_linear", recipe="nvfp4-w4a16", layout="sglang", input_scale=0.5, strict=True)
    assert opts.strict and opts.mapping == "kimi_linear"
    d = json.loads(json.dumps(opts.to_dict()))  # as the manifest stores it
    assert list(d) == MANIFEST_KEYS and d["exclude"] == ["lm_head", "*.gate"] and d["default_excludes"] is False
    back = Options.from_dict(d)
    assert back == opts  # mapping and strict are not in the manifest and not in equality
    assert back.strict is False and back.mapping is None and back.exclude == ("lm_head", "*.gate")
    assert back.to_dict() == opts.to_dict()


def test_from_dict_reads_an_old_manifest():
    old = {"exclude": ["x"], "exclude_from": [], "default_excludes": True, "keep_partial": False,
           "max_shard_size": 1000, "fuse": [], "no_fuse": []}  # before recipe, layout and input_scale
    assert Options.from_dict(old) == Options(exclude=("x",), max_shard_size=1000)
    assert Options.from_dict(old).layout == "source"


def test_every_field_is_a_flag_of_plan_and_pack():
    for cmd in ("plan", "pack"):
        out = run(cmd, "--help").stdout
        for f in fields(Options):
            flag = "--no-default-excludes" if f.name == "default_excludes" else "--" + f.name.replace("_", "-")
            assert flag in out, (cmd, flag)


def test_plan_json_records_the_options_it_was_given(tiny_kl):
    r = run("plan", tiny_kl, "--json", "--exclude", "lm_head", "--no-default-excludes", "--max-shard-size", "500kB",
            "--input-scale", "0.5", "--recipe", "nvfp4-w4a16", "--layout", "vllm")
    assert r.code == 0, r.stderr
    d = json.loads(r.stdout)["options"]
    assert list(d) == MANIFEST_KEYS
    assert Options.from_dict(d) == Options(exclude=("lm_head",), default_excludes=False, max_shard_size=500_000,
                                           input_scale=0.5, recipe="nvfp4-w4a16", layout="vllm")


@pytest.mark.parametrize(("text", "size"), [
    ("5GB", 5 * 1000**3), ("500MB", 500 * 1000**2), ("2GiB", 2 * 1024**3), ("300KB", 300_000), ("500kB", 500_000),
    ("1.5GB", 1_500_000_000), ("7 MiB", 7 * 1024**2), ("123", 123), ("4k", 4000), ("1T", None), ("1TB", 1000**4),
    ("2 tib", 2 * 1024**4), (42, 42),
])
def test_size_accepts(text, size):
    if size is None:  # "T" alone is not a unit (K, M, G are)
        with pytest.raises(click.BadParameter):
            SIZE.convert(text, None, None)
    else:
        assert SIZE.convert(text, None, None) == size


@pytest.mark.parametrize("text", ["lots", "5XB", "-1GB", "0", "0.0001", "GB", "", "5 G B", "1e9", "5GB5"])
def test_size_refuses_in_one_line(text):
    with pytest.raises(click.BadParameter) as e:
        SIZE.convert(text, None, None)
    assert len(e.value.message.splitlines()) == 1 and repr(text) in e.value.message


@pytest.mark.parametrize(("args", "needle"), [
    (["--max-shard-size", "lots"], "--max-shard-size: 'lots' is not a size like 5GB, 500MB or 2GiB"),
    (["--max-shard-size", "0"], "--max-shard-size: '0' is not a positive size"),
    (["--input-scale", "0"], "--input-scale: 0.0 is not a positive finite number"),
    (["--input-scale", "nan"], "--input-scale: nan is not a positive finite number"),
    (["--input-scale", "x"], "--input-scale: 'x' is not a number"),
    (["--layout", "nope"], "--layout: 'nope' is not one of"),
])
def test_bad_option_values_are_one_line_errors(tiny_kl, tmp_path, args, needle):
    for cmd in (["plan", tiny_kl], ["pack", tiny_kl, tmp_path / "out"]):
        r = run(*cmd, *args)
        assert needle in one_line_error(r)
        assert not (tmp_path / "out").exists()


def test_a_bad_size_is_one_line_on_stderr(tiny_kl):
    r = subprocess.run([sys.executable, "-m", "kimi_convert.cli", "plan", str(tiny_kl), "--max-shard-size", "5XB"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == "kimi-convert: error: --max-shard-size: '5XB' is not a size like 5GB, 500MB or 2GiB\n"
