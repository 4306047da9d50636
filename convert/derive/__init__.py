"""Mapping tables derived from the engines' own model classes (``kimi-convert mapping derive``).

For an architecture with no table, the tool asks each serving engine, in the engine's own python (as
``verify-manifest --engine`` runs it), how it builds and loads a checkpoint of that architecture:

1. ``standin``: the source's config and weights' names and logical shapes (no tensor data read);
2. each engine's runner (``enginecheck/*_runner.py --derive``) builds its registered model class from that config,
   offers its own loader a zero tensor of every weight and reports where each landed (``trace``), then builds the
   model under each output format's quantization config that ignores nothing and reports every module's quant
   method (``build``);
3. ``table`` turns the answers into today's mapping format, each rule's reason naming the engine, class and file.

A derived table is cached per architecture, config, engine versions and the rules' code (``rules_digest``;
``~/.cache/kimi-convert/derived``; ``KIMI_CONVERT_CACHE`` moves it) and shipped for the architectures in
``mappings/derived/``; what the engines' structure cannot show (a quirk only an engine check reveals) goes in a hand
overlay, ``mappings/overlays/NAME.toml``, merged over it (:func:`merge`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import tomli_w

from .. import mistral_checkpoint
from ..checkpoint import Checkpoint
from ..errors import ConvertError
from . import draft as draft_mod
from . import standin as standin_mod
from . import table as table_mod

ENGINES = ("vllm", "sglang")
FORMATS = tuple(standin_mod.QUANT_CONFIGS)


@dataclass
class Derived:
    table: dict  # the mapping table as data (today's TOML format)
    text: str  # the same, as TOML with its header comment
    skipped: dict[str, list[str]]  # engine -> offered tensors its loader put nowhere (not MTP)
    mtp_skipped: dict[str, list[str]]
    versions: dict[str, str]


class Unserved(ConvertError):
    """An engine that does not serve the architecture quantized: its registry names none of the config's
    architectures, or it refuses to build the model under every output format's quantization config (SGLang 0.5.23's
    Beam: "Beam supports BF16, compressed-tensors FP8 ..., or ModelOpt serialized W4A4 NVFP4"). A derivation goes on
    with the engines that do (:func:`ask`), its table saying which it left out and why (``not_served``)."""


def view_of(engine: str, trace: dict, builds: dict[str, dict]) -> table_mod.EngineView:
    err = trace.get("error")
    if err is not None:
        where = f" (loading {err['tensor']})" if err.get("tensor") else ""
        raise ConvertError(f"{engine} {trace.get('version')}: cannot build or load the architecture{where}: "
                           f"{err['type']}: {err['message'].splitlines()[0] if err['message'] else ''}")
    # a format the engine cannot build the model under says nothing of that format (vLLM 0.33 cannot build K3 under
    # compressed-tensors: its output in that format cannot load there anyway); the table's header says so
    failed = {fmt: f"{b['error']['type']}: {(b['error']['message'] or '').splitlines()[0]}"
              for fmt, b in builds.items() if b.get("error") is not None}
    if failed and len(failed) == len(builds):
        fmt, why = next(iter(failed.items()))
        raise Unserved(f"{engine} {trace.get('version')}: cannot build the architecture under a {fmt} config: "
                       f"{why}")
    return table_mod.EngineView(
        engine, trace["version"], trace.get("model_class", "?"), trace.get("spans", []),
        [s["tensor"] for s in trace.get("skipped", [])], [s["tensor"] for s in trace.get("mtp_skipped", [])],
        trace.get("modules", {}), {fmt: b.get("modules", {}) for fmt, b in builds.items() if fmt not in failed},
        failed, trace.get("renames", {}),
        {fmt: b["refused"] for fmt, b in builds.items() if b.get("refused") and fmt not in failed})


def ask_engine(engine: str, dirs: dict[str, Path], trust_remote_code: bool = False) -> table_mod.EngineView:
    """One engine's trace and builds (three runs of its runner, through the engine check's fork server; a build the
    engine refuses over one module it will not build quantized runs again with that module ignored:
    :func:`build_ignoring_refused`)."""
    from ..enginecheck import run_derive

    trust = {"trust_remote_code": trust_remote_code}
    trace = run_derive(dirs["plain"], engine, "trace", dirs["weights"], **trust)
    if trace.get("registered") is False:
        archs = json.loads((Path(dirs["plain"]) / "config.json").read_text()).get("architectures")
        raise Unserved(f"{engine} {trace.get('version')} registers none of {archs}")
    builds = {fmt: build_ignoring_refused(engine, fmt, dirs[fmt], trace, trust_remote_code) for fmt in FORMATS}
    return view_of(engine, trace, builds)


#: the most modules a build may be retried without (each retry one more module kind ignored)
MAX_REFUSED = 4


def refused_module(build: dict, trace: dict) -> str | None:
    """The linear module of the plain build that a failed quantized build's message names (vLLM 0.33 step5's
    ``Step5FusedQKVIndexerLinear.__init__``: "Step5 DSA layers fuse qkv with the sparse indexer into one plain GEMM
    and cannot be quantized, but model.layers.3.self_attn.qkv_indexer_proj.weight resolved to
    ModelOptLinearMethod"), or None: the engine refuses to build that module quantized."""
    err = build.get("error") or {}
    mods = trace.get("modules", {})
    for tok in re.findall(r"[A-Za-z_][\w.]*\w", err.get("message") or ""):
        for cand in (tok, tok.rpartition(".")[0]):  # a parameter's name: its module
            if cand and (mods.get(cand) or {}).get("kind") == "linear":
                return cand
    return None


def _ignoring(folder: Path, fmt: str, names: list[str]) -> Path:
    """A copy of a format's stand-in folder whose quantization config ignores ``names`` (both formats read the key
    ``ignore``: vLLM 0.33 modelopt.py ``ModelOptQuantConfigBase.from_config``, compressed-tensors' own)."""
    out = folder.parent / f"{folder.name}-ignoring-{len(names)}"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(folder, out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {**config["quantization_config"], "ignore": sorted(names)}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def build_ignoring_refused(engine: str, fmt: str, folder: Path, trace: dict, trust_remote_code: bool = False) -> dict:
    """The engine's build under format ``fmt``; where it fails naming a linear module it refuses to build quantized
    (:func:`refused_module`), again with that module, in every layer holding it, and its source modules (the shards
    an exclude list names) ignored, up to :data:`MAX_REFUSED` module kinds. The build's ``refused`` maps each such
    module's template to the engine's message: the table keeps its members (``table._why_kept``)."""
    from ..enginecheck import run_derive

    build = run_derive(folder, engine, "build", trust_remote_code=trust_remote_code)
    refused: dict[str, str] = {}
    ignore: list[str] = []
    while build.get("error") is not None and len(refused) < MAX_REFUSED:
        mod = refused_module(build, trace)
        if mod is None or table_mod.template(mod) in refused:
            break
        err = build["error"]
        refused[table_mod.template(mod)] = f"{err['type']}: {(err['message'] or '').splitlines()[0]}"
        same = {m for m in trace.get("modules", {}) if table_mod.template(m) == table_mod.template(mod)}
        shards = {s["tensor"].rpartition(".")[0] for s in trace.get("spans", [])
                  if s["param"].rpartition(".")[0] in same and s["tensor"].endswith(".weight")}
        ignore = sorted({*ignore, *same, *shards})
        build = run_derive(_ignoring(folder, fmt, ignore), engine, "build", trust_remote_code=trust_remote_code)
    if refused:
        build["refused"] = refused
    return build


def _header(views: list[table_mod.EngineView], config: dict, skipped: dict, mtp: dict) -> str:
    lines = [f"# Derived by kimi-convert mapping derive for {config.get('architectures')} "
             f"(model_type {config.get('model_type')!r}) from the engines' own model classes:"]
    for v in views:
        lines.append(f"#   {v.label}: {v.model_class}")
    for e, why in sorted(not_served(views).items()):
        lines.append(f"# {e}: left out, it does not serve the architecture quantized ({why[:200]}): the table is "
                     f"{', '.join(v.label for v in views)}'s alone")
    for v in views:
        for fmt, why in v.build_errors.items():
            lines.append(f"# {v.label}: cannot build the model under a {fmt} config ({why[:160]}): nothing read of it")
    for e, names in mtp.items():
        if names:
            lines.append(f"# {e}: {len(names)} MTP tensors its main model drops on purpose (its draft loads them)")
    for e, names in skipped.items():
        if names:
            lines.append(f"# {e}: {len(names)} tensors its loader puts nowhere: {', '.join(names[:6])}"
                         + (" ..." if len(names) > 6 else ""))
    return "\n".join(lines) + "\n"


def ask(ckpt: Checkpoint, engines: tuple[str, ...] = ENGINES, trust_remote_code: bool = False
        ) -> tuple[list[table_mod.EngineView], dict, dict, dict]:
    """Each engine's answers for ``ckpt``'s architecture, the stand-in's config and logical shapes, and, where a
    main model drops MTP layers, each engine's speculative-decoding draft's answers (``draft.ask``). The config is
    the stand-in's: a reduced stand-in's names (its MTP layer renumbered after the kept layers) are read against the
    config that numbers them so; the table holds config paths only, which the full config then resolves."""
    s = standin_mod.make(ckpt, with_code=trust_remote_code)
    with tempfile.TemporaryDirectory(prefix="kimi-derive-") as tmp, _zygotes(Path(tmp) / "servers"):
        dirs = standin_mod.write(s, Path(tmp))
        views, unserved = [], {}
        for e in engines:
            try:
                views.append(ask_engine(e, dirs, trust_remote_code))
            except Unserved as why:
                unserved[e] = str(why)
        if not views:
            raise ConvertError("; ".join(unserved.values()))
        serving = tuple(v.engine for v in views)
        drafts = (draft_mod.ask(dirs, serving, FORMATS, trust_remote_code) if any(v.mtp_skipped for v in views)
                  else {})
    for v in views:
        v.not_served = dict(unserved)
    return views, s.config, {n: list(shape) for n, shape, _ in s.tensors}, drafts


@contextlib.contextmanager
def _zygotes(folder: Path):
    """Each engine imported once for its three runs (the engine check's fork server, ``enginecheck.server``),
    unless the caller already names a server folder (the test suite's, shared by every check)."""
    from ..enginecheck.server import SERVERS_ENV, stop_all

    if os.environ.get(SERVERS_ENV):
        yield
        return
    folder.mkdir()
    os.environ[SERVERS_ENV] = str(folder)
    try:
        yield
    finally:
        del os.environ[SERVERS_ENV]
        stop_all(folder)


def _draft_views(drafts: dict) -> list[table_mod.EngineView]:
    """Each engine's draft model's trace and builds as a view (its packed modules in the MTP layers); a draft that
    failed says nothing."""
    out = []
    for engine, a in sorted(drafts.items()):
        trace = a.get("trace", {})
        if trace.get("error") is None and trace.get("spans"):
            out.append(table_mod.EngineView(engine, trace.get("version", "?"), trace.get("model_class", "?"),
                                            trace["spans"], [], [], trace.get("modules", {}),
                                            {f: b.get("modules", {}) for f, b in a.get("builds", {}).items()}))
    return out


def not_served(views: list[table_mod.EngineView]) -> dict[str, str]:
    """The engines a derivation left out, and why (``Unserved``)."""
    return {e: why for v in views for e, why in v.not_served.items()}


def from_views(views: list[table_mod.EngineView], config: dict, shapes: dict, drafts: dict | None = None,
               name: str | None = None) -> Derived:
    """The table the engines' answers give (pure: see ``table``; the ``[mtp]`` table: ``draft``; ``name``:
    ``table.build``'s)."""
    unsplit = [line for v in views for line in table_mod.unsplit_banks(v, {n: tuple(s) for n, s in shapes.items()})]
    if unsplit:
        more = f" (+{len(unsplit) - 1} more)" if len(unsplit) > 1 else ""
        raise ConvertError(f"{unsplit[0]}{more}; the routed experts' rules cannot be derived: write a table by hand "
                           "and pass it with --mapping")
    t = table_mod.build(views, config, {n: tuple(s) for n, s in shapes.items()}, _draft_views(drafts or {}), name)
    mtp_names = sorted({n for v in views for n in v.mtp_skipped})
    mtp = draft_mod.section(mtp_names, config, drafts or {})
    if mtp is not None:
        if extra := draft_mod.mtp_embeddings(mtp_names, config, drafts or {}):  # the MTP layer's own embedding
            t["not_linear"] = list(dict.fromkeys([*t.get("not_linear", []), *extra]))
        t["mtp"] = mtp
    if unserved := not_served(views):
        t["not_served"] = unserved
    skipped = {v.engine: v.skipped for v in views}
    mtp = {v.engine: v.mtp_skipped for v in views}
    text = _header(views, config, skipped, mtp) + tomli_w.dumps(t)
    return Derived(t, text, skipped, mtp, {v.engine: v.version for v in views})


def save_answers(path: Path, views: list[table_mod.EngineView], config: dict, shapes: dict,
                 drafts: dict | None = None, name: str | None = None) -> None:
    """The engines' raw answers, kept beside a derived table: it can be rebuilt (and tested) without the engines."""
    d = {"config": config, "shapes": shapes, "views": [asdict(v) for v in views]}
    if drafts:
        d["drafts"] = drafts
    if name:
        d["name"] = name
    path.write_text(json.dumps(d))


def from_answers(path: Path, drafts: Path | None = None) -> Derived:
    """The table of recorded answers (``save_answers``), with the drafts' answers in ``drafts`` where they were
    asked apart (else in ``path`` itself)."""
    d = json.loads(path.read_text())
    return from_views(*_answers(d), load_draft_answers(drafts) if drafts else d.get("drafts", {}), d.get("name"))


def load_answers(path: Path) -> tuple[list[table_mod.EngineView], dict, dict]:
    """(views, config, shapes); the drafts' answers: :func:`load_draft_answers`."""
    return _answers(json.loads(path.read_text()))


def _answers(d: dict) -> tuple[list[table_mod.EngineView], dict, dict]:
    return [table_mod.EngineView(**v) for v in d["views"]], d["config"], d["shapes"]


def load_draft_answers(path: Path) -> dict:
    return json.loads(path.read_text()).get("drafts", {})


#: Architectures whose derived table is named apart from their config's model_type, which another architecture's table
#: bears: ``derived-NAME``, shipped as ``mappings/derived/NAME.toml``, its hand overlay ``mappings/overlays/NAME.toml``.
#: Ling 3.0's config says model_type bailing_hybrid, as Ling 2.5's (``mappings/derived/bailing_hybrid.toml``) does.
TABLE_NAMES = {"BailingMoeV3ForCausalLM": "bailing_moe_v3",
               # LongCat-Flash-Lite's config.json has no model_type; its own config class's is longcat_flash_ngram
               "LongcatFlashNgramForCausalLM": "longcat_flash_ngram"}


def table_name(ckpt: Checkpoint) -> str | None:
    """The name ``derive`` gives ``ckpt``'s table where it is not its model_type's: Mistral's own layout
    (``mistral_checkpoint.TABLE``: the view's model_type is the engines' adaptation), or ``TABLE_NAMES``."""
    if mistral_checkpoint.in_layout(ckpt.source):
        return mistral_checkpoint.TABLE
    return next((TABLE_NAMES[a] for a in ckpt.config.get("architectures") or () if a in TABLE_NAMES), None)


def derive(ckpt: Checkpoint, engines: tuple[str, ...] = ENGINES, answers: Path | None = None,
           trust_remote_code: bool = False) -> Derived:
    """The derived table of ``ckpt``'s architecture (both engines asked; see the module docstring); with
    ``answers``, the engines' raw answers are written there too."""
    views, config, shapes, drafts = ask(ckpt, engines, trust_remote_code)
    name = table_name(ckpt)
    if answers is not None:
        save_answers(answers, views, config, shapes, drafts, name)
    return from_views(views, config, shapes, drafts, name)


def merge(derived: dict, overlay: dict) -> dict:
    """A hand overlay over a derived table: scalar keys replace, lists of rules and groups are appended (an overlay
    group of the same name, engines and parents replaces the derived one), tables are merged key by key (an
    overlay's ``[mtp] quantize`` beside the derived ``[mtp]``)."""
    out = dict(derived)
    for k, v in overlay.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        elif isinstance(v, list) and isinstance(out.get(k), list):
            if k in ("group", "scale_group", "draft"):  # an [[mtp.draft]] of the same engine replaces the derived one
                def key(g: dict, k: str = k) -> tuple:
                    if k == "draft":
                        return (g.get("engine"),)
                    return g["name"], tuple(g.get("engines", ())), tuple(g.get("parents", ()))
                mine = {key(g) for g in v}
                out[k] = [g for g in out[k] if key(g) not in mine] + list(v)
            else:
                out[k] = list(dict.fromkeys([*out[k], *v])) if all(isinstance(x, str) for x in v) else [*out[k], *v]
        else:
            out[k] = v
    return out


def cache_dir() -> Path:
    root = os.environ.get("KIMI_CONVERT_CACHE") or Path.home() / ".cache" / "kimi-convert"
    return Path(root) / "derived"


#: The code whose change changes a derived table: what the runners report and how the rules read it (a table cached
#: by an earlier version of them is derived again: session 37's [engine_names] and head rules were not in older ones).
RULE_FILES = ("derive/__init__.py", "derive/table.py", "derive/draft.py", "derive/standin.py", "derive/reduce.py",
              "enginecheck/vllm_runner.py", "enginecheck/sglang_runner.py", "enginecheck/runner_common.py")


def rules_digest() -> str:
    """sha256 of ``RULE_FILES``' text, as installed."""
    root, h = Path(__file__).resolve().parent.parent, hashlib.sha256()
    for rel in RULE_FILES:
        h.update(rel.encode() + b"\0" + (root / rel).read_bytes() + b"\0")
    return h.hexdigest()


def cache_key(config: dict, versions: dict[str, str]) -> str:
    """Architecture, config (its structure decides the model the engines build), engine versions and the rules'
    code (``rules_digest``)."""
    blob = json.dumps({"config": {k: v for k, v in config.items() if k != "quantization_config"},
                       "engines": versions, "rules": rules_digest()}, sort_keys=True, default=str)
    archs = "-".join(config.get("architectures") or [str(config.get("model_type"))])
    return f"{archs}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"
