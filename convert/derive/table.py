"""Turn what the engines showed (where each offered weight landed, how each module was built) into a mapping table.

The rules, each the hand tables' own (docs/families.md), now read off the engines instead of their source:

- **A packed module** is an engine parameter that received two or more of the source's modules: a ``[[group]]``
  named after the engine's module, its members in the order of the rows they fill (``cat``; ``stack`` where each
  member fills one index of an extra leading dimension), in the engines that build it.
- **Routed experts**: a ``FusedMoE`` parameter receiving several modules of one expert is a ``[[scale_group]]``
  (``w13``: the members share one global scale, stored apart); the parents of the expert indices are the
  ``expert_sets``.
- **Kept**: a source weight whose engine module either engine builds with an unquantized method under an output
  format's quantization config that ignores nothing is a ``[[keep]]`` (the reason names the engine, the class that
  built it and its file); one that neither engine builds as a linear layer (an embedding, a router held as a plain
  parameter by both) is ``not_linear``; a non-2-D weight an engine builds as a linear layer (conv1d) is ``linear``.
- Names are templated: ``layers.N`` -> ``layers.{layer}``, ``experts.N`` -> ``experts.{expert}`` (a rule applies where
  its members exist, in whichever layers those are).

Pure: no engine, no torch; the engines' results come in as the runners' JSON (``runner_common.describe`` /
``spans``).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

_LAYER = re.compile(r"(^|\.)layers\.\d+(?=\.)")
_EXPERT = re.compile(r"\.experts\.\d+(?=\.|$)")
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}


def template(name: str) -> str:
    """``model.layers.3.mlp.experts.7.w1`` -> ``model.layers.{layer}.mlp.experts.{expert}.w1``."""
    return _EXPERT.sub(".experts.{expert}", _LAYER.sub(r"\1layers.{layer}", name))


def glob(name: str) -> str:
    """The keep-rule pattern of a module name: layer and expert numbers as ``*``."""
    return template(name).replace("{layer}", "*").replace("{expert}", "*")


@dataclass
class EngineView:
    """One engine's answers: its version, the trace (plain build: where each offered tensor landed, what it skipped
    on purpose) and the module builds under each output format's quantization config."""

    engine: str
    version: str
    model_class: str
    spans: list[dict]
    skipped: list[str]
    mtp_skipped: list[str]
    modules: dict[str, dict]  # plain build
    quant_modules: dict[str, dict[str, dict]] = field(default_factory=dict)  # format -> modules

    @property
    def label(self) -> str:
        return f"{ENGINE_NAMES.get(self.engine, self.engine)} {self.version}"


@dataclass
class Landing:
    module: str  # the source module (the offered ``....weight`` without ``.weight``)
    param: str  # the engine parameter it landed in
    at: tuple[int, ...]
    shape: tuple[int, ...]
    param_shape: tuple[int, ...]


def landings(view: EngineView) -> list[Landing]:
    """Each offered ``.weight``'s landing in the engine's parameters (other tensors: norms, biases, scales, carry no
    fusion the table needs)."""
    out = []
    for s in view.spans:
        if not s["tensor"].endswith(".weight") or not s["param"].endswith("weight"):
            continue
        out.append(Landing(s["tensor"][: -len(".weight")], s["param"], tuple(s["at"]), tuple(s["shape"]),
                           tuple(s["param_shape"])))
    return out


def engine_module(param: str) -> str:
    return param.rpartition(".")[0]


@dataclass
class Fusion:
    """One packed module as one engine builds it, in template form."""

    name: str  # the engine module's last name part (``qkv_proj``, ``w13``)
    members: tuple[str, ...]
    parent: str  # template of the members' parent
    op: str
    experts: bool  # a routed-expert bank (a scale group)
    engine_class: str
    engine_file: str
    same_rows: bool


def fusions(view: EngineView) -> list[Fusion]:
    """The packed modules of one engine: parameters that received two or more source modules of one parent."""
    by_param: dict[str, list[Landing]] = defaultdict(list)
    for ld in landings(view):
        by_param[ld.param].append(ld)
    seen: dict[tuple, Fusion] = {}
    for param, lds in by_param.items():
        mod = view.modules.get(engine_module(param), {})
        experts = mod.get("kind") == "moe"
        groups: dict[str, list[Landing]] = defaultdict(list)
        for ld in lds:
            parent = ld.module.rpartition(".")[0]
            groups[parent].append(ld)  # an expert bank: one group per expert
        for parent, members in groups.items():
            if len(members) < 2:
                continue
            members.sort(key=lambda ld: ld.at)
            leaves = tuple(ld.module.rpartition(".")[2] for ld in members)
            stacked = not experts and len(members[0].shape) < len(members[0].param_shape)
            rows = {ld.shape[0] if ld.shape else 0 for ld in members}
            leaf = param.rpartition(".")[0].rpartition(".")[2] if not experts else _bank_name(param)
            f = Fusion(leaf, leaves, template(parent), "stack" if stacked else "cat", experts,
                       mod.get("class", "?"), mod.get("file", "?"), len(rows) == 1)
            seen.setdefault((f.name, f.members, f.parent), f)
    return list(seen.values())


def _bank_name(param: str) -> str:
    """``...experts.w13_weight`` -> ``w13``."""
    last = param.rpartition(".")[2]
    return last[: -len("_weight")] if last.endswith("_weight") else last


@dataclass
class Verdict:
    """How one engine builds one source module under the output formats' configs."""

    kind: str  # "linear", "moe", "embedding", "other", "absent"
    quantized: dict[str, bool]  # format -> quantized
    engine_module: str
    module_class: str
    parent_class: str
    parent_file: str
    quant_method: dict[str, str | None]


def verdicts(view: EngineView) -> dict[str, Verdict]:
    """Source module -> how the engine builds the module its weight lands in."""
    out = {}
    for ld in landings(view):
        em = engine_module(ld.param)
        plain = view.modules.get(em, {})
        qm = {fmt: mods.get(em, {}).get("quant_method") for fmt, mods in view.quant_modules.items()}
        out[ld.module] = Verdict(plain.get("kind", "absent"),
                                 {f: bool(m) and "Unquantized" not in m for f, m in qm.items()}, em,
                                 plain.get("class", "?"), plain.get("parent_class", "?"),
                                 plain.get("parent_file", "?"), qm)
    return out


def _group_entry(found: list[tuple[str, Fusion]], labels: dict[str, str], model_classes: dict[str, str]) -> dict:
    f = found[0][1]
    engines = [e for e, _ in found]
    who = "; ".join(f"{labels[e]} {model_classes[e]}.load_weights fills {g.engine_class} ({g.engine_file})"
                    for e, g in found)
    entry: dict = {"name": f.name, "members": list(f.members), "parents": [f.parent]}
    if f.op != "cat":
        entry["op"] = f.op
    if sorted(engines) != sorted(labels):
        entry["engines"] = sorted(engines)
    if f.same_rows and len(f.members) == 2:
        entry["same_rows"] = True
    entry["reason"] = f"derived: {who}, members in row order"
    return entry


def _groups(views: list[EngineView]) -> tuple[list[dict], list[dict], list[str]]:
    """([[group]], [[scale_group]], expert_sets) from both engines' packed modules."""
    labels = {v.engine: v.label for v in views}
    classes = {v.engine: v.model_class.rpartition(".")[2] for v in views}
    found: dict[tuple, list[tuple[str, Fusion]]] = {}
    for v in views:
        for f in fusions(v):
            # a bank's members share one global scale whatever order an engine stacks them in (SGLang's w13 may
            # hold up before gate): one scale group
            members = tuple(sorted(f.members)) if f.experts else f.members
            found.setdefault((f.name, members, f.parent, f.op, f.experts), []).append((v.engine, f))
    groups, scale_groups, sets = [], [], []
    names: dict[tuple, int] = defaultdict(int)
    for pairs in found.values():
        f = pairs[0][1]
        entry = _group_entry(pairs, labels, classes)
        if f.experts:
            entry.pop("engines", None)  # a scale group binds in every engine that holds one global scale
            entry.pop("reason", None)
            scale_groups.append(entry)
            bank = f.parent.rpartition(".{expert}")[0]
            if bank and bank not in sets:
                sets.append(bank)
            continue
        key = (entry["name"], tuple(entry.get("engines", ())))
        names[key] += 1
        if names[key] > 1:  # one engine module name for other members elsewhere (another layer kind)
            entry["name"] = f"{entry['name']}_{names[key]}"
        groups.append(entry)
    return groups, _dedupe(scale_groups), sets


def _dedupe(entries: list[dict]) -> list[dict]:
    out: list[dict] = []
    for e in entries:
        same = next((o for o in out if o["name"] == e["name"] and o["members"] == e["members"]), None)
        if same is None:
            out.append(e)
        elif e["parents"][0] not in same["parents"]:
            same["parents"].append(e["parents"][0])
    return out


def _why_kept(v: EngineView, module: str, vd: Verdict, two_d: bool) -> str | None:
    leaf = module.rpartition(".")[2]
    if vd.kind in ("linear", "moe"):
        off = [f for f, q in vd.quantized.items() if not q]
        if not off:
            return None
        fmt = off[0]
        return (f"{v.label}: {vd.parent_file} {vd.parent_class} builds {leaf} as {vd.module_class} with "
                f"{vd.quant_method[fmt]} under a {fmt} NVFP4 config that ignores nothing")
    if vd.kind == "other" and two_d:
        return (f"{v.label}: {vd.parent_file} {vd.parent_class} holds {leaf}'s weight in {vd.module_class}, not a "
                "linear layer: it reads the raw weight")
    return None


def _rules(views: list[EngineView], shapes: dict[str, tuple[int, ...]]) -> tuple[list[dict], list[str], list[str]]:
    """([[keep]], not_linear, linear) from how each engine builds each source weight's module."""
    per = {v.engine: verdicts(v) for v in views}
    keep: dict[str, str] = {}
    not_linear, linear = [], []
    for module in sorted({m for vds in per.values() for m in vds}):
        vds = [(v, per[v.engine][module]) for v in views if module in per[v.engine]]
        kinds = {vd.kind for _, vd in vds}
        two_d = len(shapes.get(module + ".weight", ())) == 2
        if kinds <= {"embedding", "other", "absent"} and two_d:
            if not any(vd.module_class == "ParallelLMHead" for _, vd in vds):
                not_linear.append(glob(module))
            continue
        if not two_d and kinds & {"linear"}:
            linear.append(glob(module))
        for v, vd in vds:
            why = _why_kept(v, module, vd, two_d)
            if why:
                keep.setdefault(glob(module), why)
                break
    uniq = lambda xs: list(dict.fromkeys(xs))  # noqa: E731
    return [{"pattern": p, "reason": r} for p, r in keep.items()], uniq(not_linear), uniq(linear)


def build(views: list[EngineView], config: dict, shapes: dict[str, tuple[int, ...]]) -> dict:
    """The mapping table (as a dict in today's TOML format) for ``config``'s architecture."""
    archs = list(config.get("architectures") or [])
    model_type = config.get("model_type", "")
    groups, scale_groups, sets = _groups(views)
    keep, not_linear, linear = _rules(views, shapes)
    versions = ", ".join(v.label for v in views)
    t: dict = {
        "name": f"derived-{model_type or (archs[0] if archs else 'model')}",
        "description": f"derived from {versions} ({', '.join(v.model_class for v in views)})",
        "architectures": archs,
        "model_types": [model_type] if model_type else [],
    }
    if isinstance(config.get("text_config"), dict):
        t["text_config"] = "text_config"
    if sets:
        t["expert_sets"] = sets
    if linear:
        t["linear"] = linear
    if not_linear:
        t["not_linear"] = not_linear
    if keep:
        t["keep"] = keep
    if groups:
        t["group"] = groups
    if scale_groups:
        t["scale_group"] = scale_groups
    return t
