"""Prove by a serving engine's own loading code that an output checkpoint loads.

``check(output_dir, "vllm" | "sglang")`` runs a runner script (``vllm_runner.py`` /
``sglang_runner.py``, shipped next to this file) in the engine's own python, as a subprocess: the
engine builds the model its registry picks for the checkpoint's ``architectures`` with its own
config and quantization-config parsing, on the CPU at TP=1 (the device presented as a Blackwell
B200, sm_100), and runs its own weight iterator and ``load_weights`` over every tensor. The runner
reports, per parameter, what was never written (unfilled), which checkpoint tensors reached no
parameter (skipped), which writes changed a tensor's dtype (bad casts), and the engine's own
exception. This module turns that into a :class:`Report` with a one-line verdict.

The engine's python: the ``python`` argument, else ``KIMI_CONVERT_VLLM_PYTHON`` /
``KIMI_CONVERT_SGLANG_PYTHON``, else the environment ``scripts/engine-envs.sh`` creates under
``~/.cache/kimi-convert/engines/`` (``KIMI_CONVERT_ENGINE_ENVS`` moves it). The tool never installs
an engine. Engine versions are pinned (:data:`PINNED`); another version is refused unless
``any_version``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import filenames
from ..errors import ConvertError
from ..plan import Encoding, Kind, Op
from ..sources import Source
from .server import run_runner

ENGINES = ("vllm", "sglang")
#: The engine versions the runners are written and tested against.
PINNED = {"vllm": "0.33.0", "sglang": "0.5.23"}
PYTHON_ENV_VARS = {"vllm": "KIMI_CONVERT_VLLM_PYTHON", "sglang": "KIMI_CONVERT_SGLANG_PYTHON"}
RUNNERS = {"vllm": "vllm_runner.py", "sglang": "sglang_runner.py"}
DEFAULT_TIMEOUT = 1800


class EngineUnavailable(ConvertError):
    """No python with the engine installed (or not the pinned version)."""


def envs_root() -> Path:
    return Path(os.environ.get("KIMI_CONVERT_ENGINE_ENVS") or Path.home() / ".cache" / "kimi-convert" / "engines")


def default_python(engine: str) -> Path:
    return envs_root() / f"{engine}-{PINNED[engine]}" / "bin" / "python"


def find_python(engine: str, python: str | os.PathLike | None = None) -> Path:
    if engine not in ENGINES:
        raise ConvertError(f"unknown engine {engine!r} (expected one of {', '.join(ENGINES)})")
    if python:
        where, p = "--engine-python", Path(python)
    elif os.environ.get(PYTHON_ENV_VARS[engine]):
        where, p = PYTHON_ENV_VARS[engine], Path(os.environ[PYTHON_ENV_VARS[engine]])
    else:
        where, p = "the default engine environment", default_python(engine)
        if not p.exists():
            raise EngineUnavailable(
                f"no {engine} environment at {p.parent.parent}; create it with scripts/engine-envs.sh {engine}, "
                f"or point {PYTHON_ENV_VARS[engine]} / --engine-python at a python that has {engine} "
                f"{PINNED[engine]} installed")
    if not p.exists():
        raise EngineUnavailable(f"{where}: {p} does not exist")
    if not os.access(p, os.X_OK) or p.is_dir():
        raise EngineUnavailable(f"{where}: {p} is not an executable python")
    return p


@dataclass
class Probe:
    python: str
    version: str | None
    site_packages: list[str]


_PROBE = r"""
import importlib.metadata as m, json, site, sys, sysconfig
try:
    v = m.version(sys.argv[1])
except m.PackageNotFoundError:
    v = None
paths = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
print(json.dumps({"version": v, "site_packages": sorted(set(paths))}))
"""


def probe(python: Path, engine: str) -> Probe:
    """The engine's installed version and the environment's site-packages (without importing the engine)."""
    try:
        r = subprocess.run([str(python), "-c", _PROBE, engine], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise EngineUnavailable(f"{python}: cannot run it ({e})") from None
    if r.returncode:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        raise EngineUnavailable(f"{python}: not a working python ({last})")
    d = json.loads(r.stdout.strip().splitlines()[-1])
    return Probe(str(python), d["version"], d["site_packages"])


def check_version(engine: str, pr: Probe, any_version: bool) -> None:
    if pr.version is None:
        raise EngineUnavailable(f"{pr.python} has no {engine} installed; create an environment with "
                                f"scripts/engine-envs.sh {engine}")
    if pr.version != PINNED[engine] and not any_version:
        raise EngineUnavailable(f"{engine} {pr.version} at {pr.python} is not the tested version {PINNED[engine]}; "
                                "pass --engine-any-version to try it anyway")


@dataclass
class Report:
    engine: str
    version: str | None
    output_dir: str
    python: str
    loaded: bool = False
    architectures: list[str] = field(default_factory=list)
    model_class: str | None = None
    quant_config: str | None = None
    params: int = 0
    offered: int = 0
    error: dict | None = None
    unfilled: list[dict] = field(default_factory=list)
    allowed_unfilled: list[dict] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    mtp_skipped: list[dict] = field(default_factory=list)  # MTP-layer tensors the main model drops by its own rule
    role: str = "main"  # "main": the model the checkpoint names; "draft": the engine's speculative-decoding draft
    main_skipped: list[dict] = field(default_factory=list)  # a draft's check: the main model's tensors it drops
    from_target: list[dict] = field(default_factory=list)  # a draft's parameters the engine takes from the target
    rule_dropped: list[dict] = field(default_factory=list)  # dropped by an engine rule whose condition holds
    rule_broken: list[dict] = field(default_factory=list)  # dropped by an engine rule whose condition fails here
    bad_casts: list[dict] = field(default_factory=list)
    widening_casts: list[dict] = field(default_factory=list)
    exact_casts: list[dict] = field(default_factory=list)  # bytes or values unchanged (runner_common._exact)
    source_casts: list[dict] = field(default_factory=list)  # narrowing of tensors copied unchanged from the input
    created_during_load: list[str] = field(default_factory=list)
    buffers_never_written: list[str] = field(default_factory=list)
    loaded_buffers: list[str] = field(default_factory=list)  # buffers the engine's own loader filled by name
    stored: dict = field(default_factory=dict)
    patches: list[str] = field(default_factory=list)
    observer_errors: list[str] = field(default_factory=list)
    post_load: dict | None = None
    timings: dict = field(default_factory=dict)
    seconds: float = 0.0
    log_tail: list[str] = field(default_factory=list)
    numerics: dict | None = None  # numerics.NumericReport.to_dict(), when the source was given

    @property
    def loads(self) -> bool:
        return self.loaded and not (self.unfilled or self.skipped or self.bad_casts or self.observer_errors
                                    or self.rule_broken)

    @property
    def ok(self) -> bool:
        return self.loads and (self.numerics is None or self.numerics["ok"])

    @property
    def numeric_verdict(self) -> str:
        """One line: every layer within its scheme's bound, or the first layer read wrong."""
        n = self.numerics
        if n is None:
            return "numeric check not run (needs --input SOURCE)"
        if not n["ok"]:
            probs = n["problems"]
            more = f" (+{len(probs) - 1} more)" if len(probs) > 1 else ""
            return f"reads weights wrong: {probs[0]}{more}"
        layers = sum(s["layers"] for s in n["summary"].values())
        exact = sum(s["exact_layers"] for s in n["summary"].values())
        worst = ", ".join(f"{k} {s['max_rel_err']:.3g} (bound {s['max_bound']:.3g})" for k, s in
                          sorted(n["summary"].items()))
        gone = n.get("overwritten") or []
        also = (f"; {len(gone)} checkpoint weight(s) written over by the engine's own loader, so not read (first: "
                f"{gone[0]})" if gone else "")
        return (f"numerics: {layers} layers read right, {exact} exactly; max relative error per format: {worst}"
                + also)

    @property
    def verdict(self) -> str:
        """The load verdict, and where the load holds but the numeric check does not, its first finding."""
        if self.loads and not self.ok:
            arch = ", ".join(self.architectures) or "?"
            return f"{self.engine} {self.version or '?'}: {self.output_dir} loads as {arch} but {self.numeric_verdict}"
        return self.load_verdict

    @property
    def load_verdict(self) -> str:
        head = f"{self.engine} {self.version or '?'}" + (" draft" if self.role == "draft" else "")
        where = self.output_dir
        if self.error:
            frame = self.error.get("frames") or []
            at = f" (at {frame[-1].split(': ', 1)[0].rsplit('/', 1)[-1]})" if frame else ""
            msg = " ".join(str(self.error.get("message", "")).split())
            if len(msg) > 240:
                msg = msg[:240] + "..."
            during = f" while loading {self.error['tensor']}" if self.error.get("tensor") else ""
            return f"{head}: {where} does NOT load: {self.error.get('type')}: {msg}{at}{during}"
        arch = ", ".join(self.architectures) or "?"
        if self.loads:
            extra = f"; {len(self.allowed_unfilled)} engine-optional parameter(s) left unset" \
                if self.allowed_unfilled else ""
            if self.source_casts:
                extra += f"; {len(self.source_casts)} input tensor(s) narrowed as the engine reads the input itself"
            if self.from_target:
                extra += (f"; {len(self.from_target)} taken from the target model "
                          f"({', '.join(t['param'] for t in self.from_target)})")
            if self.main_skipped:
                extra += f"; {len(self.main_skipped)} main-model tensor(s) left to the main model"
            if self.mtp_skipped:
                extra += (f"; {len(self.mtp_skipped)} MTP-layer tensor(s) left to the engine's MTP model (its main "
                          "model drops them by its own rule)")
            if self.rule_dropped:
                extra += (f"; {len(self.rule_dropped)} tensor(s) dropped by the engine's own rule, its condition "
                          f"checked (first: {self.rule_dropped[0]['why']})")
            return (f"{head}: {where} loads as {arch}: all {self.params} parameters filled from {self.offered} "
                    f"tensors, none skipped, no bad cast{extra}")
        parts = []
        if self.unfilled:
            parts.append(f"{len(self.unfilled)} unfilled parameter(s) (first: {self.unfilled[0]['param']})")
        if self.skipped:
            parts.append(f"{len(self.skipped)} skipped tensor(s) (first: {self.skipped[0]['tensor']})")
        if self.rule_broken:
            parts.append(f"{len(self.rule_broken)} tensor(s) dropped by an engine rule that does not hold here "
                         f"(first: {self.rule_broken[0]['tensor']}: {self.rule_broken[0]['why']})")
        if self.bad_casts:
            c = self.bad_casts[0]
            parts.append(f"{len(self.bad_casts)} bad cast(s) (first: {c['tensor']} {c['from']} -> {c['to']} "
                         f"{c['param']})")
        if self.observer_errors:
            parts.append(f"{len(self.observer_errors)} observer error(s)")
        return f"{head}: {where} loads as {arch} but " + "; ".join(parts)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        d["verdict"] = self.verdict
        return d


def resolve(engine: str, python: str | os.PathLike | None = None, any_version: bool = False) -> Probe:
    """The engine's python, checked: exists, has the engine, at the pinned version (unless any_version)."""
    pr = probe(find_python(engine, python), engine)
    check_version(engine, pr, any_version)
    return pr


def runner_path(engine: str) -> Path:
    return Path(__file__).with_name(RUNNERS[engine])


def runner_env(pr: Probe) -> dict:
    """The environment a runner starts in: the engine's own (no PYTHONPATH of this one), offline, with the stub
    CUDA driver library first on the library path."""
    from . import stubcuda

    stub = stubcuda.build(pr.site_packages)
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(stub), env.get("LD_LIBRARY_PATH")) if p)
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONNOUSERSITE": "1",
                "TOKENIZERS_PARALLELISM": "false", "VLLM_CONFIGURE_LOGGING": "1"})
    env.pop("PYTHONPATH", None)  # the engine's environment, not this one's
    return env


def run_derive(model_dir: str | os.PathLike, engine: str, mode: str, weights: str | os.PathLike | None = None,
               python: str | os.PathLike | None = None, timeout: float = DEFAULT_TIMEOUT, draft: bool = False,
               trust_remote_code: bool = False) -> dict:
    """The runner in derivation mode (``mode`` 'trace' or 'build', see runner_common.main): its JSON result,
    with the engine's version; a crash without a result is an :class:`EngineUnavailable`-free ConvertError.
    ``draft``: of the engine's speculative-decoding draft model for the checkpoint (``derive/draft.py``)."""
    pr = resolve(engine, python)
    with tempfile.TemporaryDirectory(prefix="kimi-derive-") as tmp:
        res, log = Path(tmp, "result.json"), Path(tmp, "runner.log")
        argv = [str(Path(model_dir).resolve()), "--out", str(res), "--derive", mode] + (["--draft"] if draft else [])
        argv += ["--trust-remote-code"] if trust_remote_code else []
        if weights is not None:
            argv += ["--weights", str(Path(weights).resolve())]
        log.write_text("")
        rc = run_runner(Path(pr.python), runner_path(engine), argv, runner_env(pr), tmp, log, timeout)
        if not res.is_file():
            tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:]
            raise ConvertError(f"{engine} {pr.version}: the derivation runner exited with status {rc} without a "
                               f"result: {tail[0] if tail else ''}")
        d = json.loads(res.read_text())
    d["version"] = pr.version
    return d


def check(output_dir: str | os.PathLike, engine: str, python: str | os.PathLike | None = None,
          any_version: bool = False, timeout: float = DEFAULT_TIMEOUT,
          source: Source | str | os.PathLike | None = None, draft: bool = False,
          trust_remote_code: bool = False) -> Report:
    """Load ``output_dir`` with ``engine``'s own code in its own python and report what it did; with
    ``source`` (the checkpoint it was converted from), also the numeric check (``numerics``): every layer
    read as the engine's GEMM reads it, against the source's weight of the same rows. With ``draft``, the model
    loaded is the engine's speculative-decoding draft for the checkpoint (its MTP / NextN class, built as a
    deployment with ``--speculative-config`` / ``--speculative-algorithm NEXTN`` builds it). ``trust_remote_code``:
    the engine reads the config through the checkpoint's own config code (auto_map), as its own flag of that name
    (a release whose config class neither the engine nor transformers has: Ling 2.0's bailing_moe_v2)."""
    out = Path(output_dir)
    if not (out / "config.json").is_file() and not (out / "params.json").is_file():  # params.json: Mistral's layout
        raise ConvertError(f"{out}: no config.json (not a checkpoint folder)")
    pr = resolve(engine, python, any_version)
    py = Path(pr.python)
    env = runner_env(pr)
    if source is not None:  # the numeric check runs the engines' own Triton GEMMs on the CPU (runner_numerics)
        env["TRITON_INTERPRET"] = "1"
    t0 = time.perf_counter()
    rep = Report(engine=engine, version=pr.version, output_dir=str(out), python=str(py),
                 role="draft" if draft else "main")
    with tempfile.TemporaryDirectory(prefix="kimi-enginecheck-") as tmp:
        res = Path(tmp, "result.json")
        log = Path(tmp, "runner.log")
        argv = [str(out.resolve()), "--out", str(res)] + (["--draft"] if draft else [])
        argv += ["--trust-remote-code"] if trust_remote_code else []
        if source is not None:
            argv += ["--numerics", str(Path(tmp, "numerics"))]
        log.write_text("")
        rc = run_runner(py, runner_path(engine), argv, env, tmp, log, timeout)
        rep.seconds = round(time.perf_counter() - t0, 2)
        rep.log_tail = log.read_text(errors="replace").splitlines()[-40:]
        if not res.is_file():
            why = f"timed out after {timeout:.0f} s" if rc is None else f"exited with status {rc}"
            last = next((ln for ln in reversed(rep.log_tail) if ln.strip()), "")
            rep.error = {"type": "RunnerCrashed", "message": f"the {engine} runner {why} without a result: {last}",
                         "frames": []}
            return rep
        d = json.loads(res.read_text())
        compare_s = None
        if source is not None and d.get("error") is None and d.get("phase") == "done":
            from . import numerics

            t1 = time.perf_counter()
            rep.numerics = numerics.run(engine, res, Path(tmp, "numerics"), source, out).to_dict()
            compare_s = round(time.perf_counter() - t1, 2)
    for k in ("architectures", "model_class", "quant_config", "params", "offered", "error", "unfilled",
              "allowed_unfilled", "skipped", "mtp_skipped", "main_skipped", "from_target", "rule_dropped",
              "rule_broken", "bad_casts", "widening_casts", "exact_casts", "created_during_load",
              "buffers_never_written", "loaded_buffers", "stored", "patches", "observer_errors", "post_load",
              "timings"):
        if d.get(k) is not None:
            setattr(rep, k, d[k])
    if compare_s is not None:
        rep.timings["compare_s"] = compare_s
    rep.version = d.get("version") or rep.version
    rep.loaded = d.get("error") is None and d.get("phase") == "done"
    _separate_source_casts(rep, out, source)
    return rep


def _same_as_source(out: Path, source: Source | str | os.PathLike, names: set[str]) -> set[str]:
    """Of ``names``, the tensors ``out`` stores byte for byte as ``source`` does (both read through their
    headers and byte ranges), for a checkpoint without a manifest."""
    from ..checkpoint import open_checkpoint
    from ..sources import read_range

    a, b = open_checkpoint(out), open_checkpoint(source)
    same = set()
    for n in sorted(names & a.tensors.keys() & b.tensors.keys()):
        x, y = a.tensors[n], b.tensors[n]
        if (x.dtype, x.shape) == (y.dtype, y.shape) and read_range(a.source, x.file, x.start, x.nbytes) == \
                read_range(b.source, y.file, y.start, y.nbytes):
            same.add(n)
    return same


def _unchanged(out: Path, source: Source | str | os.PathLike | None, narrowed: set[str]) -> set[str]:
    """The output tensors held byte for byte as the input holds them: what the manifest records as copied or
    kept unchanged from a dense source, or, without a manifest, those of ``narrowed`` equal to ``source``'s."""
    from ..manifest import iter_modules

    if not (out / filenames.MANIFEST).is_file():
        return _same_as_source(out, source, narrowed) if source is not None else set()
    try:
        man = json.loads((out / filenames.MANIFEST).read_text())
        return {t["name"] for _, m in iter_modules(out, man) if m.get("kind") in (Kind.COPY, Kind.KEEP)
                and all(s.get("encoding") == Encoding.DENSE for s in m.get("sources", []))
                and m.get("op") == Op.NONE for t in m.get("tensors", [])}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return set()


def _separate_source_casts(rep: Report, out: Path, source: Source | str | os.PathLike | None = None) -> None:
    """A float narrowed on load (fp32 ``o_norm`` into a bf16 parameter, say) is the engine's reading of
    the input checkpoint itself when the output holds that tensor byte for byte as the input does (the
    manifest says so; without one, the source given for the numeric check, compared byte for byte): listed
    as a source cast, not a conversion defect. Reinterpretations always fail."""
    narrowed = {c["tensor"] for c in rep.bad_casts if c.get("class") == "narrowing"}
    if not narrowed:
        return
    unchanged = _unchanged(out, source, narrowed)
    rep.source_casts = [c for c in rep.bad_casts if c.get("class") == "narrowing" and c.get("tensor") in unchanged]
    rep.bad_casts = [c for c in rep.bad_casts if c not in rep.source_casts]


def main(argv: list[str] | None = None) -> int:
    """``python -m kimi_convert.enginecheck OUTPUT ENGINE [--json]`` (a debugging entry point)."""
    args = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in args
    args = [a for a in args if a != "--json"]
    rep = check(args[0], args[1])
    print(json.dumps(rep.to_dict(), indent=1) if as_json else rep.verdict)
    return 0 if rep.ok else 1
