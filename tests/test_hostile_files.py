"""Files that are not files, JSON no parser survives, inputs that say nothing (issue 26, items 3, 4, 6).

Each case is built here from the tiny K3 and run through ``plan`` and ``pack``: one line naming the file,
exit 2, no traceback, no hang (a FIFO read would block forever: these run as processes with a timeout),
nothing finished-looking in the output, the input unchanged (snapshotted without opening anything that
is not a regular file).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # the Triton kernels run in the interpreter on CPU tensors (as in CI)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers import copy_ckpt, one_line_error, run, run_process
from kimi_convert.errors import ConvertError
from kimi_convert.jsonfile import MAX_DEPTH, loads, read_json

INDEX = "model.safetensors.index.json"
DEEP = 100_000


def snapshot(folder: Path) -> dict[str, tuple]:
    """Every entry of the tree by relative path: a regular file's sha256, a symlink's target, else its type
    (a FIFO is never opened)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in [*dirnames, *filenames]:
            p = Path(dirpath, name)
            st = os.lstat(p)
            rel = str(p.relative_to(folder))
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                out[rel] = ("file", hashlib.sha256(p.read_bytes()).hexdigest(), st.st_mtime_ns)
            else:
                out[rel] = ("other", stat.S_IFMT(st.st_mode))
    return out


def _fifo(name: str):
    def fn(ck: Path) -> None:
        (ck / name).unlink()
        os.mkfifo(ck / name)
    return fn


def _deep(name: str, key: str):
    def fn(ck: Path) -> None:
        obj = json.loads((ck / name).read_text())
        text = json.dumps(obj)[:-1] + f', "{key}": ' + "[" * DEEP + "]" * DEEP + "}"
        (ck / name).write_text(text)
    return fn


def _loop(rel: str, other: str | None = None):
    """``rel`` a symlink to itself, or ``rel`` <-> ``other`` (relative names)."""
    def fn(ck: Path) -> None:
        p = ck / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.exists() or p.is_symlink():
            p.unlink()
        if other is None:
            p.symlink_to(p.name)
        else:
            q = ck / other
            p.symlink_to(os.path.relpath(q, p.parent))
            q.symlink_to(os.path.relpath(p, q.parent))
    return fn


def rewrite_header(path: Path, edit) -> None:
    """Rewrite a safetensors file's header as ``edit(header)`` changes it (data untouched; json.dumps writes a
    string that is no Unicode text as its escape)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])


def set_metadata(path: Path, value) -> None:
    """Rewrite a safetensors file's header with ``__metadata__`` set to ``value``."""
    rewrite_header(path, lambda header: header.__setitem__("__metadata__", value))


def _meta(value):
    def fn(ck: Path) -> None:
        first = sorted(ck.glob("model-*.safetensors"))[0]
        set_metadata(first, value)
    return fn


def _surrogate_name(ck: Path) -> None:
    """The first shard's first tensor renamed with a lone surrogate's JSON escape."""
    def rename(header: dict) -> None:
        name = next(k for k in header if k != "__metadata__")
        header["x\ud800" + name] = header.pop(name)
    rewrite_header(sorted(ck.glob("model-*.safetensors"))[0], rename)


def _empty_map(ck: Path) -> None:
    idx = json.loads((ck / INDEX).read_text())
    idx["weight_map"] = {}
    (ck / INDEX).write_text(json.dumps(idx))


CASES = {
    "config.json a FIFO": (_fifo("config.json"), "config.json: is a FIFO"),
    "index a FIFO": (_fifo(INDEX), f"{INDEX}: is a FIFO"),
    "config.json nested 100,000 deep": (_deep("config.json", "x"), "config.json: JSON nested deeper than"),
    "index nested 100,000 deep": (_deep(INDEX, "metadata2"), f"{INDEX}: JSON nested deeper than"),
    "config.json a symlink loop": (_loop("config.json"), "config.json: is a symlink loop"),
    "index a symlink loop": (_loop(INDEX), f"{INDEX}: is a symlink loop"),
    "a side file a symlink loop": (_loop("loop.txt"), "loop.txt: is a symlink loop"),
    "two side files linked to each other, in a sub-folder": (_loop("sub/a.json", "sub/b.json"),
                                                             "is a symlink loop"),
    "__metadata__ a list": (_meta([1]), "__metadata__ must be a map of strings"),
    "__metadata__ an empty list": (_meta([]), "__metadata__ must be a map of strings"),
    "__metadata__ an empty string": (_meta(""), "__metadata__ must be a map of strings"),
    "__metadata__ 0": (_meta(0), "__metadata__ must be a map of strings"),
    "__metadata__ false": (_meta(False), "__metadata__ must be a map of strings"),
    "index with an empty weight_map": (_empty_map, f"{INDEX}: weight_map is empty"),
    "a tensor name with a lone surrogate escape": (_surrogate_name, "tensor name 'x\\ud800"),
    "__metadata__ with a lone surrogate escape": (_meta({"format": "pt\ud800"}),
                                                  "__metadata__ string 'pt\\ud800' holds a lone surrogate"),
}


@pytest.mark.parametrize("command", ["plan", "pack"])
@pytest.mark.parametrize("case", list(CASES))
def test_not_files_and_bad_json(tiny_k3, tmp_path, case, command):
    corrupt, msg = CASES[case]
    ck = copy_ckpt(tiny_k3, tmp_path / "c")
    corrupt(ck)
    before = snapshot(ck)
    out = tmp_path / "out"
    args = [command, ck, *([out, "--device", "cpu", "-q"] if command == "pack" else [])]
    err = one_line_error(run_process(*args, timeout=120))  # a FIFO read would block: the timeout fails the test
    assert msg in err, err
    assert not (out / "manifest.json").exists()
    assert snapshot(ck) == before


def test_metadata_null_or_map_is_accepted(tiny_k3, tmp_path):
    """``null`` and a map of strings are what the safetensors library itself loads."""
    from safetensors.torch import load_file

    from kimi_convert.checkpoint import open_checkpoint

    for value in (None, {"format": "pt"}):
        ck = copy_ckpt(tiny_k3, tmp_path / f"c{value is None}")
        _meta(value)(ck)
        first = sorted(ck.glob("model-*.safetensors"))[0]
        load_file(str(first))
        assert open_checkpoint(ck).tensors


def test_a_lone_surrogate_is_what_safetensors_refuses(tiny_k3, tmp_path):
    """The reason the tool refuses a header string that is no Unicode text: the safetensors library does too."""
    from safetensors.torch import load_file

    for k, corrupt in enumerate((_surrogate_name, _meta({"format": "pt\ud800"}))):
        ck = copy_ckpt(tiny_k3, tmp_path / f"c{k}")
        corrupt(ck)
        with pytest.raises(Exception):  # noqa: B017 - the library's own error type varies by version
            load_file(str(sorted(ck.glob("model-*.safetensors"))[0]))


@pytest.mark.parametrize("value", [[], "", 0, False, [1]])
def test_metadata_that_safetensors_refuses_is_refused(tiny_k3, tmp_path, value):
    """What the safetensors library refuses to load (the reason the tool refuses it too)."""
    from safetensors.torch import load_file

    ck = copy_ckpt(tiny_k3, tmp_path / "c")
    _meta(value)(ck)
    with pytest.raises(Exception):  # noqa: B017 - the library's own error type varies by version
        load_file(str(sorted(ck.glob("model-*.safetensors"))[0]))


def test_absolute_index_path_inside_the_input_is_accepted(tiny_k3, tmp_path):
    """An index that names its shards by absolute paths inside the folder packs as if they were relative,
    and the output's index names them relatively."""
    ck = copy_ckpt(tiny_k3, tmp_path / "c")
    idx = json.loads((ck / INDEX).read_text())
    idx["weight_map"] = {k: str((ck / v).absolute()) for k, v in idx["weight_map"].items()}
    (ck / INDEX).write_text(json.dumps(idx))
    r = run("pack", ck, tmp_path / "out", "--device", "cpu", "-q")
    assert r.code == 0, r.stderr
    out_idx = json.loads((tmp_path / "out" / INDEX).read_text())
    assert all(not os.path.isabs(v) for v in out_idx["weight_map"].values())
    assert run("verify-manifest", tmp_path / "out", "--input", ck, "-q").code == 0


def test_absolute_index_path_outside_says_where_it_resolves(tiny_k3, tmp_path):
    ck = copy_ckpt(tiny_k3, tmp_path / "c")
    other = copy_ckpt(tiny_k3, tmp_path / "other")
    idx = json.loads((ck / INDEX).read_text())
    idx["weight_map"] = {k: str(other / v) for k, v in idx["weight_map"].items()}
    (ck / INDEX).write_text(json.dumps(idx))
    err = one_line_error(run("plan", ck))
    assert "resolves outside the input folder" in err and str(other) in err, err


def test_exclude_file_a_fifo_is_refused(tiny_k3, tmp_path):
    os.mkfifo(tmp_path / "ex.txt")
    err = one_line_error(run_process("plan", tiny_k3, "--exclude-from", tmp_path / "ex.txt", timeout=120))
    assert "ex.txt: is a FIFO" in err, err


def test_verify_index_a_fifo_or_deep(tiny_k3, tmp_path):
    """verify-manifest reads the output's index an entry at a time: a FIFO there or a value nested too deep is
    a failed check naming the index, not a hang or a traceback."""
    out = tmp_path / "out"
    assert run("pack", tiny_k3, out, "--device", "cpu", "-q").code == 0
    idx_text = (out / INDEX).read_text()
    (out / INDEX).write_text(idx_text[:-1] + ', "x": ' + "[" * DEEP + "]" * DEEP + "}")
    r = run_process("verify-manifest", out, "-q", timeout=120)
    assert r.code == 1 and "Traceback" not in r.stderr and INDEX in r.stdout, (r.stdout, r.stderr)
    (out / INDEX).unlink()
    os.mkfifo(out / INDEX)
    r = run_process("verify-manifest", out, "-q", timeout=120)
    assert r.code == 1 and "Traceback" not in r.stderr and "FIFO" in r.stdout, (r.stdout, r.stderr)


def test_reader_bounds(tmp_path):
    """jsonfile: the depth bound holds before any recursion, strings with brackets do not count, the size
    bound and the type of the top level are checked."""
    assert loads('{"a": "[[[[{{{{", "b": [[1]]}', "x") == {"a": "[[[[{{{{", "b": [[1]]}
    assert loads("[" * MAX_DEPTH + "]" * MAX_DEPTH, "x") == eval("[" * MAX_DEPTH + "]" * MAX_DEPTH)
    with pytest.raises(ConvertError, match="x: JSON nested deeper than"):
        loads("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), "x")
    p = tmp_path / "a.json"
    p.write_text("[1]")
    with pytest.raises(ConvertError, match="a.json: not a JSON object"):
        read_json(p, "a.json")
    with pytest.raises(ConvertError, match="more than the 2-byte limit"):
        read_json(p, "a.json", limit=2)
    with pytest.raises(ConvertError, match="a.json: not valid JSON"):
        p.write_text("{")
        read_json(p, "a.json")


def test_second_pack_into_one_output_is_told_another_holds_it(tiny_k3, tmp_path):
    """Two packs into one output at once: the second is refused at once, naming the first's pid (not told to
    --resume what the first is still writing); once the first is gone (killed: the kernel drops its lock)
    the output resumes as usual."""
    import signal
    import time

    from helpers import child, cli_command

    out = tmp_path / "out"
    env = {**os.environ, "KIMI_CONVERT_FAULT": "shard:1:pause"}
    with child(cli_command("pack", tiny_k3, out, "--device", "cpu", "-q"), env=env) as first:
        deadline = time.monotonic() + 120
        while not (out / ".kimi-convert-pack.json").exists() or not any(out.glob("*.safetensors")):
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        err = one_line_error(run("pack", tiny_k3, out, "--device", "cpu", "-q"))
        assert "another pack" in err and "is writing this output now" in err and "--resume" not in err, err
        assert f"another pack (pid {first.pid})" in err, err
        assert "another pack" in one_line_error(run("pack", tiny_k3, out, "--device", "cpu", "-q", "--resume"))
        first.send_signal(signal.SIGKILL)
        first.wait()
    r = run("pack", tiny_k3, out, "--device", "cpu", "-q", "--resume")
    assert r.code == 0, r.stderr
    assert not (out / ".kimi-convert-pack.lock").exists()  # a finished output holds only what its manifest lists
    assert run("verify-manifest", out, "-q").code == 0


def test_space_message_shows_the_numbers(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from kimi_convert import outfolder
    from kimi_convert.progress import human_bytes

    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10**9, 10**9 - 2048, 2048))
    Shard = namedtuple("Shard", "size")
    with pytest.raises(ConvertError) as e:
        outfolder.check_space(tmp_path, [Shard(1_500_000), Shard(3000)])
    assert "needs 1.50 MB for 2 shard(s), 2.05 kB free" in str(e.value), e.value
    assert human_bytes(0) == "0 B" and human_bytes(7_200_000_000_000) == "7.20 TB"


# --- item 1: an E8M0 NaN scale byte in a routed expert the cast converts ------------------------------------

EXPERT_W3 = "language_model.model.layers.1.block_sparse_moe.experts.3.w3"


def _nan_scale(t):
    t = t.clone()
    t[5, 1] = 0xFF
    return t


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_cast_refuses_a_nan_scale_on_every_backend(backend):
    """Each backend's cast (the C kernel, Triton, the torch code) refuses byte 0xFF, naming the block, where it
    would otherwise read it as exponent 128 (weight_scale_2 = 2^120)."""
    import torch

    from kimi_convert.devices import get_backend
    from kimi_convert.kernels import DecodeError

    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (32, 64), dtype=torch.uint8, generator=g)
    scale = torch.randint(120, 130, (32, 4), dtype=torch.uint8, generator=g)
    b = get_backend(backend)
    b.cast_mxfp4(packed, scale, 2)  # the clean tensor casts
    scale[7, 2] = 0xFF
    with pytest.raises(DecodeError, match=r"0xFF \(NaN in the OCP MX spec\) at row 7, block 2"):
        b.cast_mxfp4(packed, scale, 2)


@pytest.mark.parametrize("recipe", ["nvidia-k3", "nvfp4-w4a16"])
def test_pack_refuses_a_nan_scale(tiny_k3, tmp_path, recipe):
    from safetensors.torch import load_file

    from helpers import replace_tensor

    ck = copy_ckpt(tiny_k3, tmp_path / "c")
    name = f"{EXPERT_W3}.weight_scale"
    shard = next(p for p in ck.glob("model-*.safetensors") if name in load_file(str(p)))
    replace_tensor(ck, name, _nan_scale(load_file(str(shard))[name]))
    before = snapshot(ck)
    out = tmp_path / "out"
    err = one_line_error(run("pack", ck, out, "--recipe", recipe, "--device", "cpu", "-q"))
    assert f"{shard.name}: tensor {name}: E8M0 scale byte 0xFF" in err and "row 5, block 1" in err, err
    assert not (out / "manifest.json").exists() and not list(out.rglob("*.partial"))
    assert run("verify-manifest", out, "-q").code == 2  # unfinished, not verified
    assert snapshot(ck) == before


# --- item 2: engine packed modules whose members the engines cannot fuse, under every layout ---------------

L1 = "language_model.model.layers.1"
L3 = "language_model.model.layers.3"


def _reshape(name: str, fn):
    def corrupt(ck: Path) -> None:
        from safetensors.torch import load_file

        from helpers import replace_tensor

        shard = next(p for p in ck.glob("model-*.safetensors") if name in load_file(str(p)))
        replace_tensor(ck, name, fn(load_file(str(shard))[name]))
    return corrupt


def _half_k(t):
    return t[:, : t.shape[1] // 2].contiguous()


UNFUSABLE = {
    # an expert's w3 with half the K of its w1 (MXFP4: its codes and its scales)
    "expert w3 of half K": ([_reshape(f"{L1}.block_sparse_moe.experts.2.w3.weight_packed", _half_k),
                             _reshape(f"{L1}.block_sparse_moe.experts.2.w3.weight_scale", _half_k)],
                            "experts.2.w13: members w1 [", "input dimension (K) differs"),
    "expert w3 of fewer rows": ([_reshape(f"{L1}.block_sparse_moe.experts.2.w3.weight_packed",
                                          lambda t: t[:-16].clone()),
                                 _reshape(f"{L1}.block_sparse_moe.experts.2.w3.weight_scale",
                                          lambda t: t[:-16].clone())],
                                "experts.2.w13: members w1 [", "row counts differ"),
    "MLA kv_a_proj_with_mqa of another K": ([_reshape(f"{L3}.self_attn.kv_a_proj_with_mqa.weight", _half_k)],
                                            "fused_qkv_a_", "kv_a_proj_with_mqa"),
    "KDA k_proj reshaped to [2N, K/2]": ([_reshape("language_model.model.layers.0.self_attn.k_proj.weight",
                                                   lambda t: t.reshape(2 * t.shape[0], -1).contiguous())],
                                         "layers.0.self_attn.", "k_proj ["),
    "MLA q_a_proj rows against q_lora_rank": ([_reshape(f"{L3}.self_attn.q_a_proj.weight", lambda t: t[:-16].clone())],
                                              "fused_qkv_a_", "q_lora_rank"),
}


@pytest.mark.parametrize("layout", ["source", "sglang", "vllm"])
@pytest.mark.parametrize("case", list(UNFUSABLE))
def test_unfusable_members_fail_the_plan_under_every_layout(tiny_k3, tmp_path, case, layout):
    corrupts, module, what = UNFUSABLE[case]
    ck = copy_ckpt(tiny_k3, tmp_path / "c")
    for c in corrupts:
        c(ck)
    before = snapshot(ck)
    for recipe in ("nvidia-k3", "nvfp4-w4a16"):
        err = one_line_error(run("plan", ck, "--layout", layout, "--recipe", recipe))
        assert "module " in err and module in err and what in err, err
    err = one_line_error(run("pack", ck, tmp_path / "out", "--layout", layout, "--device", "cpu", "-q"))
    assert module in err and what in err, err
    assert not (tmp_path / "out" / "manifest.json").exists()
    assert snapshot(ck) == before


def test_kept_members_of_other_dtypes_fail(tiny_kl, tmp_path):
    """Members kept in high precision are loaded byte for byte into one parameter: their dtypes must agree."""
    ck = copy_ckpt(tiny_kl, tmp_path / "c")
    _reshape("model.layers.0.mlp.up_proj.weight", lambda t: t.float())(ck)
    err = one_line_error(run("plan", ck, "--exclude", "model.layers.0.mlp.*"))
    assert "gate_up_proj: members gate_proj (BF16) and up_proj (F32): dtypes differ" in err, err


# --- item 5: outputs with strangers in them ------------------------------------------------------------------

@pytest.fixture(scope="module")
def k3_out(tiny_k3, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("strangers") / "out"
    assert run("pack", tiny_k3, out, "--device", "cpu", "-q").code == 0
    return out


@pytest.mark.parametrize("stranger", ["model-00004-of-00004.safetensors", "pytorch_model.bin", "sub/extra.pt",
                                      "q4.gguf", "consolidated.safetensors"])
def test_unlisted_weight_file_fails_verify_and_upload(k3_out, tiny_k3, tmp_path, stranger):
    import shutil

    out = tmp_path / "out"
    shutil.copytree(k3_out, out)
    first = sorted(out.glob("model-*.safetensors"))[0]
    (out / stranger).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(first, out / stranger)
    for extra in ([], ["--input", tiny_k3]):
        r = run("verify-manifest", out, "-q", *extra)
        assert r.code == 1 and f"{stranger}: a weight file that manifest.json does not list" in r.stdout, r.stdout
    from fakehub import TOKEN, FakeHub
    from fakehub import hub_cli as cli

    with FakeHub(TOKEN) as hub:  # upload verifies before it sends anything: refused, the stranger named
        err = one_line_error(cli(hub, "upload", out, "user/model", tmp=tmp_path))
        assert "refusing to upload" in err and stranger in err, err
        assert not any("upload" in p or "commit" in p for _, p, _ in hub.log), hub.log
    (out / stranger).unlink()
    assert run("verify-manifest", out, "-q").code == 0
