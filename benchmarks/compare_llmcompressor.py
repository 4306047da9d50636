"""This tool's compressed-tensors output against llm-compressor's ``model_free_ptq`` (the peer) on one input.

    python benchmarks/compare_llmcompressor.py --preset tiny-kimi-linear [--input DIR] [--work DIR]
        [--peer-python PY] [--exclude GLOB ...] [--decode-fp8 float32|bfloat16] [--json OUT]

1. ``kimi-convert pack INPUT OURS --recipe ct-nvfp4-a16`` (this python);
2. the peer in its own python (``--peer-python``, default ``$KIMI_CONVERT_LLMC_PYTHON`` or
   /work/peers/llmc/bin/python) on the same input, ``scheme="NVFP4A16"``, ``ignore=`` our config's ``ignore``
   list (so both keep the same modules), on the CPU: first as installed; where it refuses the input its message
   is recorded and it is run again with ``--partners-present`` (benchmarks/peer_model_free.py: its one patch);
3. every tensor of both outputs by name (dtype, shape, bytes) and both ``config.json`` files (as JSON).

``--decode-fp8 DTYPE`` (a DeepSeek-style FP8 block source, which the peer cannot read): the peer is given the input
decoded by transformers' own FP8 dequantization to DTYPE (``benchmarks/peer_decode_fp8.py``, in the peer's python),
as its users do; ours packs the FP8 input itself.

Each module's global-scale group is taken from both sides: ours from the manifest records' ``shared_scale``,
the peer's by its own rule (``llmcompressor/entrypoints/model_free/microscale.py: DEFAULT_FUSED_MAPPINGS``,
restated in ``peer_groups``). A differing tensor is then either in a module whose group differs (named in the
report) or a real difference (``unexplained``, the check's failure). Exit 0 when every tensor of every module
whose groups agree is byte-identical and the configs are equal; 1 otherwise; 2 when the peer cannot be run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEER_PY = os.environ.get("KIMI_CONVERT_LLMC_PYTHON", "/work/peers/llmc/bin/python")
QUANT_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_global_scale", ".input_global_scale")

#: llm-compressor 0.14's fused sets (microscale.py: _DEFAULT_FUSED_MAPPINGS_LIST), as regexes on the module
_PEER_SETS = [
    (r"(.*(?:attn|attention))\.(q_proj|k_proj|v_proj)$", 3),
    (r"(.*(?:attn|attention))\.(wq_a|wkv_a_with_mqa)$", 2),
    (r"(.*mlp)\.(gate_proj|up_proj)$", 2),
    (r"(.*)\.(w1|w3)$", 2),
]


def tensors(folder: Path) -> dict[str, tuple[str, list[int], Path, int, int]]:
    """name -> (dtype, shape, file, start, end) over every shard (safetensors headers read directly)."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            head = json.loads(fh.read(n))
        for k, v in head.items():
            if k != "__metadata__":
                s, e = v["data_offsets"]
                out[k] = (v["dtype"], v["shape"], f, 8 + n + s, 8 + n + e)
    return out


def read(entry) -> bytes:
    _, _, f, s, e = entry
    with open(f, "rb") as fh:
        fh.seek(s)
        return fh.read(e - s)


def module_of(name: str) -> str:
    for suf in (*QUANT_SUFFIXES, ".weight"):
        if name.endswith(suf):
            return name[: -len(suf)]
    return name


def peer_groups(modules: list[str]) -> dict[str, frozenset[str]]:
    """Each quantized module's global-scale group under the peer's rule (a set complete in its parent only)."""
    out: dict[str, frozenset[str]] = {}
    for rx, size in _PEER_SETS:
        by_parent: dict[str, set[str]] = {}
        for m in modules:
            hit = re.fullmatch(rx, m)
            if hit:
                by_parent.setdefault(hit.group(1), set()).add(m)
        for members in by_parent.values():
            if len(members) == size:
                for m in members:
                    out[m] = frozenset(members)
    return {m: out.get(m, frozenset({m})) for m in modules}


def our_groups(folder: Path, modules: list[str]) -> dict[str, frozenset[str]]:
    shared: dict[str, str | None] = {}
    for f in (folder / "manifest-records").glob("*.jsonl"):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            q = r.get("quantization") or {}
            if q.get("format") == "nvfp4":
                shared[r["name"]] = q.get("shared_scale")
    by: dict[str, set[str]] = {}
    for m, s in shared.items():
        if s is not None:
            by.setdefault(s, set()).add(m)
    return {m: frozenset(by[shared[m]]) if shared.get(m) else frozenset({m}) for m in modules}


def run_ours(src: Path, out: Path, exclude: list[str], device: str) -> float:
    import time

    cmd = [sys.executable, "-c", "from kimi_convert.cli import main; main()", "pack", str(src), str(out),
           "--recipe", "ct-nvfp4-a16", "--overwrite", "-q", "--device", device]
    for e in exclude:
        cmd += ["--exclude", e]
    t = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - t


def run_peer(src: Path, out: Path, ignore: list[str], patched: bool, device: str, workers: int = 1
             ) -> tuple[int, str]:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(ignore, f)
    cmd = [PEER_PY, str(HERE / "peer_model_free.py"), str(src), str(out), "--ignore-json", f.name,
           "--device", device, "--max-workers", str(workers)] + (["--partners-present"] if patched else [])
    shutil.rmtree(out, ignore_errors=True)
    p = subprocess.run(cmd, capture_output=True, text=True)
    os.unlink(f.name)
    err = next((ln for ln in p.stderr.splitlines() if ln.startswith("PEER-ERROR")), p.stderr.strip()[-400:])
    return p.returncode, err


def compare(ours: Path, peer: Path) -> dict:
    a, b = tensors(ours), tensors(peer)
    mods = sorted({module_of(n) for n in a if n.endswith(".weight_packed")})
    og, pg = our_groups(ours, mods), peer_groups(mods)
    rep: dict = {"tensors_ours": len(a), "tensors_peer": len(b), "only_ours": sorted(set(a) - set(b)),
                 "only_peer": sorted(set(b) - set(a)), "equal": 0, "differ": [], "unexplained": [],
                 "group_differs": {}}
    for name in sorted(set(a) & set(b)):
        if a[name][:2] == b[name][:2] and read(a[name]) == read(b[name]):
            rep["equal"] += 1
            continue
        rep["differ"].append(name)
        m = module_of(name)
        if m in og and og[m] != pg[m]:
            rep["group_differs"][m] = {"ours": sorted(og[m]), "peer": sorted(pg[m])}
        else:
            rep["unexplained"].append(name)
    same = [m for m in mods if og[m] == pg[m]]
    rep["modules"] = {"quantized": len(mods), "same_group": len(same), "group_differs": len(mods) - len(same)}
    rep["same_group_tensors_equal"] = sum(1 for n in set(a) & set(b) if module_of(n) in set(same)
                                          and n not in rep["differ"])
    ca = json.loads((ours / "config.json").read_text())
    cb = json.loads((peer / "config.json").read_text())
    rep["config_equal"] = ca == cb
    if not rep["config_equal"]:
        rep["config_diff"] = sorted(k for k in set(ca) | set(cb) if ca.get(k) != cb.get(k))
        qa, qb = ca.get("quantization_config", {}), cb.get("quantization_config", {})
        rep["quantization_config_diff"] = sorted(k for k in set(qa) | set(qb) if qa.get(k) != qb.get(k))
    return rep


def move_to_next_shard(src: Path, dst: Path, tensor: str) -> Path:
    """A copy of ``src`` with ``tensor`` stored in the next shard file, as a release's byte-cut shards split
    an expert's w1 and w3 (the layout on which the peer's index check stops)."""
    import torch  # noqa: F401 (safetensors.torch needs it)
    from safetensors.torch import load_file, save_file

    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    here = index["weight_map"][tensor]
    there = files[(files.index(here) + 1) % len(files)]
    a, b = load_file(dst / here), load_file(dst / there)
    b[tensor] = a.pop(tensor)
    save_file(a, dst / here, metadata={"format": "pt"})
    save_file(b, dst / there, metadata={"format": "pt"})
    index["weight_map"][tensor] = there
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return dst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny-kimi-linear", help="kimi-convert synth preset (when no --input)")
    ap.add_argument("--input", type=Path)
    ap.add_argument("--work", type=Path)
    ap.add_argument("--exclude", action="append", default=[], help="kept by both (our --exclude, the peer's ignore)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--decode-fp8", choices=("float32", "bfloat16"),
                    help="give the peer the FP8 input decoded by transformers (peer_decode_fp8.py) to this dtype")
    ap.add_argument("--move-to-next-shard", metavar="TENSOR",
                    help="compare on a copy of the input with TENSOR stored in the next shard")
    a = ap.parse_args()
    if not Path(PEER_PY).exists():
        print(f"the peer's python {PEER_PY} is absent (KIMI_CONVERT_LLMC_PYTHON)", file=sys.stderr)
        return 2
    work = a.work or Path(tempfile.mkdtemp(prefix="ct-compare-"))
    src = a.input
    if src is None:
        src = work / "input"
        subprocess.run([sys.executable, "-c", "from kimi_convert.cli import main; main()", "synth", a.preset, str(src),
                        "--overwrite"], check=True, stdout=subprocess.DEVNULL)
    if a.move_to_next_shard:
        src = move_to_next_shard(src, work / "input-moved", a.move_to_next_shard)
    ours, peer = work / "ours", work / "peer"
    run_ours(src, ours, a.exclude, "cpu")
    ignore = json.loads((ours / "config.json").read_text())["quantization_config"]["ignore"]
    result: dict = {"input": str(src)}
    peer_src = src
    if a.decode_fp8:
        peer_src = work / f"input-decoded-{a.decode_fp8}"
        p = subprocess.run([PEER_PY, str(HERE / "peer_decode_fp8.py"), str(src), str(peer_src),
                            "--dtype", a.decode_fp8], capture_output=True, text=True)
        if p.returncode != 0:
            print(f"the peer's decode of {src} failed: {p.stderr.strip()[-400:]}", file=sys.stderr)
            return 2
        result["peer_input"] = {"path": str(peer_src), "decoded_by": "transformers Fp8Dequantize._dequantize_one",
                                **json.loads(p.stdout.splitlines()[-1])}
    rc, err = run_peer(peer_src, peer, ignore, patched=False, device="cpu")
    result["peer_as_installed"] = "ran" if rc == 0 else err
    if rc != 0:
        rc, err2 = run_peer(peer_src, peer, ignore, patched=True, device="cpu")
        result["peer_patched"] = "ran" if rc == 0 else err2
        if rc != 0:
            print(json.dumps(result, indent=1))
            return 2
    rep = compare(ours, peer)
    result.update(rep)
    text = json.dumps(result, indent=1)
    if a.json:
        a.json.write_text(text + "\n")
    short = {k: v for k, v in result.items() if k not in ("differ", "group_differs")}
    short["group_differs"] = sorted(rep["group_differs"])
    print(json.dumps(short, indent=1))
    return 0 if not rep["unexplained"] and rep["config_equal"] and not rep["only_ours"] and not rep["only_peer"] else 1


if __name__ == "__main__":
    sys.exit(main())
