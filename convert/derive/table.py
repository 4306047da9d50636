"""Turn what the engines showed (where each offered weight landed, how each module was built) into a mapping table.

The rules, each the hand tables' own (docs/families.md), now read off the engines instead of their source:

- **A packed module** is an engine parameter that received two or more of the source's modules: a ``[[group]]``
  named after the engine's module, its members in the order of the rows they fill (``cat``; ``stack`` where each
  member fills one index of an extra leading dimension), in the engines that build it.
- **Routed experts**: a ``FusedMoE`` parameter receiving several modules of one expert is a ``[[scale_group]]``
  (``w13``: the members share one global scale, stored apart); the parents of the expert indices of every bank
  some engine loaded per-expert modules into are the ``expert_sets`` (a non-gated bank's too: Nemotron-H's
  ``up_proj`` / ``down_proj``, one member a parameter).
- **Kept**: a source weight whose engine module either engine builds with an unquantized method under an output
  format's quantization config that ignores nothing is a ``[[keep]]`` (the reason names the engine, the class that
  built it and its file); one that neither engine builds as a linear layer (an embedding, a router held as a plain
  parameter by both) is ``not_linear``; a non-2-D weight an engine builds as a linear layer (conv1d) is ``linear``.
- Names are templated: ``layers.N`` -> ``layers.{layer}``, ``experts.N`` -> ``experts.{expert}`` (a rule applies where
  its members exist, in whichever layers those are).
- The drafts' packed modules (the MTP layers the main models drop) are groups too; a tied head an engine would build
  quantized is ``[lm_head] exclude_tied``; a 3-D source weight the loader writes into its bank one expert at a time,
  each expert's slice as stored, is a stacked bank (``[stacked]``: Step-3 text's ``moe.gate_proj`` [E, I, H]), its
  members sharing one engine parameter a ``[[scale_group]]`` as per-expert members do; a 3-D bank stored without
  ``.weight`` (the tensor named as a parameter: IQuest-Q1's ``mlp.experts.fc``) that the loader writes expert by
  expert, whole or in row parts, is a stacked bank kept as stored (``[stacked] keep = true``: the tool quantizes
  only banks stored as ``X.weight``); routed experts the stand-in cannot show otherwise (a fused 3-D bank copied
  whole, transposed or cut) are refused (:func:`unsplit_banks`).

Pure: no engine, no torch; the engines' results come in as the runners' JSON (``runner_common.describe`` /
``spans``).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

from ..errors import ConvertError
from ..mapping import layer_numbers
from .reduce import EXPERT_KEYS

_LAYER = re.compile(r"(^|\.)(layers|blocks)\.\d+(?=\.)")  # a vision tower's blocks are numbered like layers
_EXPERT = re.compile(r"\.experts\.\d+(?=\.|$)")
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}


def template(name: str) -> str:
    """``model.layers.3.mlp.experts.7.w1`` -> ``model.layers.{layer}.mlp.experts.{expert}.w1``."""
    return _EXPERT.sub(".experts.{expert}", _LAYER.sub(r"\1\2.{layer}", name))


def glob(name: str) -> str:
    """The keep-rule pattern of a module name: layer and expert numbers, and any other module-list index (a vision
    tower's ``blocks.N``: the release has 27 where the tiny preset has 1), as ``*``."""
    return _INDEX.sub(".*", template(name).replace("{layer}", "*").replace("{expert}", "*"))


_INDEX = re.compile(r"\.\d+(?=\.|$)")


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
    build_errors: dict[str, str] = field(default_factory=dict)  # format -> why the engine could not build under it
    # source module -> the engine's module, where the engine renames the weight but an exclude entry naming the
    # module stays as written (vllm_runner.unmapped_renames)
    renames: dict[str, str] = field(default_factory=dict)
    # format -> template of a module the engine refuses to build quantized -> its message (the build that ignores
    # it: derive.build_ignoring_refused)
    refused: dict[str, dict[str, str]] = field(default_factory=dict)
    # the engines the derivation left out (``derive.Unserved``) -> why: the table is these answers' alone
    not_served: dict[str, str] = field(default_factory=dict)

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
    layers: set[int] = field(default_factory=set)  # the decoder layers it was seen in
    unquantized_only: bool = False  # the engine builds it only for an unquantized model
    model_class: str = ""  # the model (main or draft) whose load_weights filled it


def fusions(view: EngineView) -> list[Fusion]:
    """The packed modules of one engine: parameters that received two or more source modules of one parent."""
    by_param: dict[str, list[Landing]] = defaultdict(list)
    for ld in landings(view):
        by_param[ld.param].append(ld)
    seen: dict[tuple, Fusion] = {}
    never = never_quantized(view)
    for param, lds in by_param.items():
        mod = view.modules.get(engine_module(param), {})
        if mod.get("kind") == "embedding":  # a table stored in row blocks (Qwen3.8's n-gram shards): no linear layer
            continue
        if template(engine_module(param)) in never:  # no global scale to share: its members are kept (_why_kept)
            continue
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
                       mod.get("class", "?"), mod.get("file", "?"), len(rows) == 1,
                       unquantized_only=not in_quant_builds(view, engine_module(param)))
            f = seen.setdefault((f.name, f.members, f.parent), f)
            # a decoder layer's number (an MTP block's mtp.layers.0 is no decoder layer 0: MiniMax M3)
            if (n := _layer_of(parent)) is not None and "mtp." not in f".{parent}":
                f.layers.add(n)
    return list(seen.values())


def never_quantized(view: EngineView) -> set[str]:
    """Templates of the modules the engine refuses to build quantized under every output format it builds under
    (``EngineView.refused``: vLLM 0.33 step5's ``qkv_indexer_proj`` of its DSA layers): no packed module for the
    table, since its members never share a global scale; each member is kept, and the exclude list names every
    shard, which is how the engines ask for a packed module (vLLM's ``is_layer_skipped`` with the class's
    ``packed_modules_mapping``). A group would also bind the layers that hold only some of its members (Step 5's
    sliding-window layers hold q/k/v/g, no indexer), which no config key tells apart here."""
    formats = [fmt for fmt, mods in view.quant_modules.items() if mods]
    if not formats or any(fmt not in view.refused for fmt in formats):
        return set()
    return set.intersection(*(set(view.refused[fmt]) for fmt in formats))


def _layer_of(name: str) -> int | None:
    m = _LAYER_NUMBER.search(name)
    return None if m is None else int(m.group(1))


_LAYER_NUMBER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def in_quant_builds(view: EngineView, module: str) -> bool:
    """Whether the engine builds ``module`` for a quantized checkpoint too (SGLang's Kimi KDA builds
    ``fused_qkvbfg_a_proj`` and ``fused_fg_b_proj`` only for an unquantized one)."""
    builds = [mods for mods in view.quant_modules.values() if mods]
    return not builds or any(module in mods for mods in builds)


@dataclass
class StackedBank:
    """A source weight [E, N, K] that an engine's loader writes into its routed-expert bank one expert at a time,
    each expert's [N, K] slice as stored (``loaded_weight[expert_id]``: vLLM 0.33 step3_text.py
    ``Step3TextModel.load_weights``): a stacked bank, written as one 3-D NVFP4 bank (``[stacked]``)."""

    module: str  # the source module (the offered ``....weight`` without ``.weight``), or the tensor itself where
    #              it is stored without ``.weight`` (``kept``)
    param: str  # the engine parameter it fills
    experts: int
    engine: str
    label: str
    model_class: str
    engine_class: str
    engine_file: str
    #: stored without ``.weight`` (a parameter's name, the tensor is the bank: IQuest-Q1's ``mlp.experts.fc``):
    #: copied as stored only (``[stacked] keep = true``)
    kept: bool = False
    parts: int = 1  # the loader's writes per expert (IQuest-Q1's ``fc``: rows ``:I`` to w1, ``I:`` to w3)


def _stacked_write(s: dict, shape: tuple[int, ...], pshape: tuple[int, ...]) -> bool:
    """A 3-D source tensor written expert by expert, each expert's slice as stored: one write per expert of the
    engine's bank, each of the tensor's own [N, K] (not a whole-bank copy, nor halves, nor a transpose)."""
    return (len(shape) == len(pshape) == 3 and shape[0] == pshape[0] > 1 and s.get("writes") == shape[0]
            and tuple(s["shape"]) == shape[1:] and shape[2] == pshape[2] and s["tensor"].endswith(".weight"))


def _kept_write(s: dict, shape: tuple[int, ...], pshape: tuple[int, ...]) -> int:
    """A 3-D source tensor stored without ``.weight`` (the tensor is the bank) written expert by expert, whole or in
    equal row parts, each part rows of expert e's [N, K] as stored (SGLang 0.5.23 iquest_q1.py
    ``load_iquest_q1_weights``: ``loaded_weight[e][:I]`` to w1, ``[I:]`` to w3): its writes per expert, else 0."""
    writes, one = s.get("writes") or 0, tuple(s["shape"])
    if (len(shape) != 3 or len(pshape) != 3 or not shape[0] == pshape[0] > 1 or s["tensor"].endswith(".weight")
            or writes % shape[0] or len(one) != 2 or not one[1] == shape[2] == pshape[2]):
        return 0
    parts = writes // shape[0]
    return parts if one[0] * parts == shape[1] else 0


def stacked_banks(view: EngineView, shapes: dict[str, tuple[int, ...]] | None = None) -> list[StackedBank]:
    """The source weights ``view``'s loader reads as stacked expert banks (:func:`_stacked_write`), and the tensors
    stored without ``.weight`` it reads so, whole or in row parts (:func:`_kept_write`: ``kept``)."""
    out = []
    for s in view.spans:
        mod = view.modules.get(engine_module(s["param"]), {})
        shape, pshape = tuple((shapes or {}).get(s["tensor"]) or s["shape"]), tuple(s["param_shape"])
        if mod.get("kind") != "moe":
            continue
        info = (shape[0], view.engine, view.label, view.model_class, mod.get("class", "?"), mod.get("file", "?"))
        if _stacked_write(s, shape, pshape):
            out.append(StackedBank(s["tensor"][: -len(".weight")], s["param"], *info))
        elif parts := _kept_write(s, shape, pshape):
            out.append(StackedBank(s["tensor"], s["param"], *info, kept=True, parts=parts))
    return out


def unsplit_banks(view: EngineView, shapes: dict[str, tuple[int, ...]] | None = None) -> list[str]:
    """Why the engine's routed experts cannot be read off the stand-in, one line each (empty: they can):

    - a source weight that fills several experts of the engine's bank in one tensor otherwise than expert by expert
      as stored (a BF16 gpt-oss ``gate_up_proj``, copied whole and transposed; GraniteMoe's ``input_linear`` cut
      into halves): a fused 3-D bank that no source encoding splits into per-expert modules
      (``encodings/expert_bank.py`` splits Granite's, Gemma 4's and Llama 4's, so the stand-in offers those per
      expert). One the loader writes expert by expert as stored is a stacked bank (:func:`stacked_banks`), no
      refusal;
    - a per-expert source weight (``experts.N.x``) the loader put nowhere in a layer where the engine builds a
      bank (gpt-oss, whose plain build reads the experts only under the release's 3-D names): the bank's
      members and fusions are not seen.
    """
    out = []
    for s in view.spans:
        mod = view.modules.get(engine_module(s["param"]), {})
        # the offered tensor's own shape (a loader that writes a bank expert by expert records one write's)
        shape, pshape = tuple((shapes or {}).get(s["tensor"]) or s["shape"]), tuple(s["param_shape"])
        if mod.get("kind") == "moe" and len(shape) == len(pshape) >= 3 and shape[0] == pshape[0] > 1 \
                and not _stacked_write(s, shape, pshape) and not _kept_write(s, shape, pshape):
            out.append(f"{s['tensor']} {list(shape)} fills every expert of {view.label}'s {s['param']} in one tensor: "
                       "a fused 3-D expert bank that no source encoding splits per expert, and not one the loader "
                       "writes expert by expert as stored (a stacked bank: [stacked]); this tool quantizes experts "
                       "as per-expert modules or stacked banks only; encodings/expert_bank.py names the layouts it "
                       "splits")
    banks = {_layer_of(m) for m, info in view.modules.items() if info.get("kind") == "moe"}
    for t in view.skipped:
        if _EXPERT.search(t) and t.endswith(".weight") and _layer_of(t) in banks:
            out.append(f"{t}: {view.label}'s loader puts this expert weight nowhere although it builds a routed-expert "
                       "bank in its layer (it reads the experts under other names, such as a release's 3-D bank)")
    return out


def _stacked(views: list[EngineView], config: dict, shapes: dict[str, tuple[int, ...]]) -> dict | None:
    """``[stacked]``: the bank modules some engine's loader reads as stacked 3-D banks (as globs over layers), the
    config path of their expert count (the ``[moe] experts`` key, whose value each bank's first dimension must
    equal) and the loaders that read them so. None without such banks; refused where no config key holds the
    banks' expert count (a bank an engine reads otherwise is refused by :func:`unsplit_banks`)."""
    found = [b for v in views for b in stacked_banks(v, shapes)]
    if not found:
        return None
    tc = _text(config)
    counts = sorted({b.experts for b in found})
    key = next((k for k in EXPERT_KEYS if len(counts) == 1 and tc.get(k) == counts[0] and type(tc[k]) is int), None)
    if key is None:
        raise ConvertError(f"{found[0].module}.weight: a stacked expert bank of {counts[0]} experts, but no config key "
                           f"of the expert count ({', '.join(EXPERT_KEYS)}) says {counts[0]}: the table's [stacked] "
                           "experts cannot be named")
    modules = list(dict.fromkeys(glob(b.module) for b in found))
    by_engine: dict[str, list[StackedBank]] = defaultdict(list)
    for b in found:
        by_engine[b.engine].append(b)
    why = [_stacked_why(banks) for banks in by_engine.values()]
    if not any(b.kept for b in found):
        return {"modules": modules, "experts": key,
                "reason": "derived: " + "; ".join(why) + ": written as 3-D NVFP4 banks, one global scale per expert"}
    return {"modules": modules, "experts": key, "keep": True,
            "reason": "derived: " + "; ".join(why) + ": a bank stored without .weight is no module's weight, "
                      "beside which a block and a global scale would be named; this tool copies such a bank as "
                      "stored only: every bank kept BF16, each layer's experts module in the exclude list (the "
                      "engine then builds it unquantized)"}


def _stacked_why(banks: list[StackedBank]) -> str:
    """One engine's loader reading ``banks`` (all of one engine), in the reason's words."""
    b = banks[0]

    def read(x: StackedBank) -> str:
        parts = f" in {x.parts} row parts an expert" if x.parts > 1 else ""
        return f"{glob(x.module)} -> {template(x.param).rpartition('.')[2]}{parts}"

    params = ", ".join(dict.fromkeys(read(x) for x in banks))
    stored = ("stored without .weight (the tensor is the bank)" if all(x.kept for x in banks)
              else "[experts, N, K]")
    return (f"{b.label}: {b.model_class.rpartition('.')[2]}.load_weights ({b.model_class.rpartition('.')[0]}) "
            f"writes each bank {stored} into {template(b.param).rpartition('.')[0]} ({b.engine_class}, "
            f"{b.engine_file}) one expert at a time, each expert's [N, K] as stored ({params})")


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
        if not in_quant_builds(view, em):  # built apart when quantized: the module named as the source's
            alt = f"{em.rpartition('.')[0]}.{ld.module.rpartition('.')[2]}"
            if any(alt in mods for mods in view.quant_modules.values()):
                em = alt
        plain = view.modules.get(em) or next((mods[em] for mods in view.quant_modules.values() if em in mods), {})
        # a format's build that lacks the module may build the source's own module under another class (SGLang's
        # ModelOpt Mixtral is QuantMixtralForCausalLM: one linear layer per expert and member): its method then
        qm = {fmt: (mods.get(em) or mods.get(ld.module) or {}).get("quant_method")
              for fmt, mods in view.quant_modules.items()}
        # a module a format's build lacks or leaves without a quant method (SGLang fuses GLM's shared experts into
        # the routed bank under compressed-tensors) says nothing of that format: only an Unquantized* method keeps
        out[ld.module] = Verdict(plain.get("kind", "absent"),
                                 {f: "Unquantized" not in m for f, m in qm.items() if m}, em,
                                 plain.get("class", "?"), plain.get("parent_class", "?"),
                                 plain.get("parent_file", "?"), qm)
    return out


def _group_entry(found: list[tuple[str, Fusion]], labels: dict[str, str], model_classes: dict[str, str]) -> dict:
    f = found[0][1]
    engines = [e for e, _ in found]
    who = "; ".join(f"{labels[e]} {g.model_class or model_classes[e]}.load_weights fills {g.name} ({g.engine_class}, "
                    f"{g.engine_file})" for e, g in found)
    entry: dict = {"name": f.name, "members": list(f.members), "parents": [f.parent],
                   "_layers": sorted(set().union(*(g.layers for _, g in found)))}
    if f.op != "cat":
        entry["op"] = f.op
    if all(g.unquantized_only for _, g in found):
        entry["unquantized_only"] = True
    if sorted(engines) != sorted(labels):
        entry["engines"] = sorted(engines)
    if f.experts and f.same_rows and len(f.members) == 2:  # a bank's w13: equal halves; elsewhere the written
        entry["same_rows"] = True  # pieces need not be the members' rows (Qwen3.5's in_proj_qkvz is written by head)
    entry["reason"] = f"derived: {who}, members in row order"
    return entry


def _all_fusions(views: list[EngineView], drafts: list[EngineView]) -> list[tuple[str, Fusion]]:
    """(engine, fusion) of the main models, then those of the drafts (the MTP layers the main models drop: Qwen3.5's
    ``mtp.layers.N.self_attn`` ``qkv_proj``), each named after the model that filled it."""
    out = []
    for v in [*views, *drafts]:
        for f in fusions(v):
            f.model_class = v.model_class.rpartition(".")[2]
            out.append((v.engine, f))
    return out


def _groups(views: list[EngineView], drafts: list[EngineView] = ()) -> tuple[list[dict], list[dict], list[str]]:
    """([[group]], [[scale_group]], expert_sets) from both engines' packed modules (the drafts' too)."""
    labels = {v.engine: v.label for v in views}
    classes = {v.engine: v.model_class.rpartition(".")[2] for v in views}
    found: dict[tuple, list[tuple[str, Fusion]]] = {}
    for engine, f in _all_fusions(views, list(drafts)):
        # a bank's members share one global scale whatever order an engine stacks them in (SGLang's w13 may
        # hold up before gate): one scale group
        # one fusion of the same members in both engines is one group (named as the first engine names it:
        # vLLM's fused_qkv_a_proj and SGLang's fused_qkv_a_proj_with_mqa hold one global scale alike)
        members = tuple(sorted(f.members)) if f.experts else f.members
        key = (f.name if f.experts else "", members, f.parent, f.op, f.experts)
        if all(e != engine for e, _ in found.get(key, [])):  # a draft's fusion the main model has: once
            found.setdefault(key, []).append((engine, f))
    groups, scale_groups, sets = [], [], []
    names: dict[tuple, int] = defaultdict(int)
    for pairs in found.values():
        f = pairs[0][1]
        entry = _group_entry(pairs, labels, classes)
        if f.experts:
            entry.pop("engines", None)  # a scale group binds in every engine that holds one global scale
            entry.pop("reason", None)
            entry.pop("_layers")
            scale_groups.append(entry)
            bank = f.parent.rpartition(".{expert}")[0]
            if bank and bank not in sets:
                sets.append(bank)
            continue
        same = next((g for g in groups if (g["name"], g["members"], g.get("op"), g.get("engines")) ==
                     (entry["name"], entry["members"], entry.get("op"), entry.get("engines"))), None)
        if same is not None:  # the same packed module under another parent (a dense MLP and a shared expert)
            same["parents"] += [p for p in entry["parents"] if p not in same["parents"]]
            same["_layers"] = sorted(set(same["_layers"]) | set(entry["_layers"]))
            continue
        key = (entry["name"], tuple(entry.get("engines", ())))
        names[key] += 1
        if names[key] > 1:  # one engine module name for other members elsewhere (another layer kind)
            entry["name"] = f"{entry['name']}_{names[key]}"
        groups.append(entry)
    sets += [b for b in _banks([*views, *drafts]) if b not in sets]
    return groups, _apart(groups, _dedupe(scale_groups)), sets


def _banks(views: list[EngineView]) -> list[str]:
    """The parents of the expert indices of every routed-expert bank some engine loaded per-expert source modules
    into, in order seen: a bank of non-gated experts (Nemotron-H's relu2 ``up_proj`` into ``w13``, ``down_proj`` into
    ``w2``) has no member sharing a parameter, so no scale group names it, yet the recipe's expert rule must reach
    it (both engines' ModelOpt MoE reads its ``w13_input_scale`` / ``w2_input_scale``)."""
    out: list[str] = []
    for v in views:
        for ld in landings(v):
            if v.modules.get(engine_module(ld.param), {}).get("kind") != "moe" or not _EXPERT.search(ld.module):
                continue
            bank = template(ld.module.rpartition(".")[0]).rpartition(".{expert}")[0]
            if bank and bank not in out:
                out.append(bank)
    return out


def _apart(groups: list[dict], scale_groups: list[dict]) -> list[dict]:
    """The scale groups, one named as a packed module of every engine renamed apart (``w13_2``): LFM2 MoE's dense
    MLP is vLLM's ``w13`` (``feed_forward.w1`` + ``w3``, a MergedColumnParallelLinear) beside the routed experts'
    ``w13`` bank; a table's groups and scale groups of one name must differ in engines (``mapping.parse``)."""
    taken = {(g["name"], tuple(g.get("engines", ()))) for g in groups}
    out = []
    for sg in scale_groups:
        name, n = sg["name"], 1
        while (name, ()) in taken:
            n += 1
            name = f"{sg['name']}_{n}"
        taken.add((name, ()))
        out.append({**sg, "name": name})
    return out


def _dedupe(entries: list[dict]) -> list[dict]:
    """One scale group per bank name and members, its parents merged; a bank of the same name over other members
    (MiniMax M3: SGLang's routed ``w13`` holds ``w1``/``w3``, the shared expert fused in as slot E holds
    ``gate_proj``/``up_proj``) is named apart (``w13_2``): a table's groups of one name must differ in engines."""
    out: list[dict] = []
    for e in entries:
        same = next((o for o in out if o["_bank"] == e["name"] and sorted(o["members"]) == sorted(e["members"])),
                    None)  # one bank's members, whatever order an engine stacks them in
        if same is None:
            n = sum(o["_bank"] == e["name"] for o in out)
            out.append({**e, "_bank": e["name"], "name": f"{e['name']}_{n + 1}" if n else e["name"]})
        elif e["parents"][0] not in same["parents"]:
            same["parents"].append(e["parents"][0])
    for o in out:
        del o["_bank"]
    return out


def _embedding_blocks(views: list[EngineView]) -> dict[str, str]:
    """Source module -> its parent, for the modules an engine loads as row blocks of one embedding table
    (Qwen3.8's ``ngram_embedding.shard_N``, as many as the config's ``split_ngram_parts``): one rule for them all."""
    out: dict[str, str] = {}
    for v in views:
        by_param: dict[str, list[str]] = defaultdict(list)
        for ld in landings(v):
            if v.modules.get(engine_module(ld.param), {}).get("kind") == "embedding":
                by_param[ld.param].append(ld.module)
        out.update({m: m.rpartition(".")[0] for mods in by_param.values() if len(mods) > 1 for m in mods})
    return out


def _why_kept(v: EngineView, module: str, vd: Verdict, two_d: bool) -> str | None:
    leaf = module.rpartition(".")[2]
    if vd.kind in ("linear", "moe"):
        off = [f for f, q in vd.quantized.items() if not q]
        if not off:
            return None
        fmt = off[0]
        refused = (v.refused.get(fmt) or {}).get(template(vd.engine_module))
        if refused is not None:
            return (f"{v.label}: {vd.parent_file} {vd.parent_class} refuses to build {leaf}'s module "
                    f"{vd.engine_module.rpartition('.')[2]} ({vd.module_class}) quantized under a {fmt} NVFP4 config "
                    f"({refused[:200]}); built with it ignored")
        return (f"{v.label}: {vd.parent_file} {vd.parent_class} builds {leaf} as {vd.module_class} with "
                f"{vd.quant_method[fmt]} under a {fmt} NVFP4 config that ignores nothing")
    if vd.kind == "other" and two_d:
        return (f"{v.label}: {vd.parent_file} {vd.parent_class} holds {leaf}'s weight in {vd.module_class}, not a "
                "linear layer: it reads the raw weight")
    return None


def _rules(views: list[EngineView], shapes: dict[str, tuple[int, ...]]) -> tuple[list[dict], list[str], list[str]]:
    """([[keep]], not_linear, linear) from how each engine builds each source weight's module."""
    per = {v.engine: verdicts(v) for v in views}
    blocks = _embedding_blocks(views)
    keep: dict[str, str] = {}
    not_linear, linear = [], []
    for module in sorted({m for vds in per.values() for m in vds}):
        vds = [(v, per[v.engine][module]) for v in views if module in per[v.engine]]
        kinds = {vd.kind for _, vd in vds}
        two_d = len(shapes.get(module + ".weight", ())) == 2
        if kinds <= {"embedding", "other", "absent"} and two_d:
            if not any(vd.module_class == "ParallelLMHead" for _, vd in vds):
                not_linear.append(f"{glob(blocks[module])}.*" if module in blocks else glob(module))
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


#: config key -> the [moe] field that reads it (plan.consistency: which decoder layers hold experts), by the
#: meaning these keys have in every config that carries them
LAYER_RULES = {"first_k_dense_replace": "dense_below", "moe_layer_freq": "every", "mlp_only_layers": "dense_list",
               "decoder_sparse_step": "sparse_step",
               # Ernie 4.5 MoE: layer_idx >= moe_layer_start_index (vLLM ernie45_moe.py Ernie4_5_MoeDecoderLayer)
               "moe_layer_start_index": "dense_below",
               # Afmoe (Arcee Trinity): layer_idx >= num_dense_layers (vLLM afmoe.py AfmoeDecoderLayer; SGLang afmoe.py)
               "num_dense_layers": "dense_below",
               # Step-3.5: the MoE layers' numbers as one string (vLLM 0.33 step3p5.py Step3p5DecoderLayer,
               # SGLang 0.5.23 step3p5.py _is_moe_layer: int(i) for i in moe_layers_enum.strip().split(","))
               "moe_layers_enum": "moe_list"}


def _text(config: dict) -> dict:
    sub = config.get("text_config")
    return sub if isinstance(sub, dict) else config


def _moe_check(views: list[EngineView], config: dict, sets: list[str], modules: set[str],
               stacked: list[str] = ()) -> dict | None:
    """The ``[moe]`` section plan.consistency holds the tensors against: the expert count's config key, each
    expert's members as the engines loaded them, and the config keys that say which layers are MoE. ``stacked``: the
    stacked banks' modules (one stored weight a layer's every expert, ``[stacked]``), whose layer's experts the
    check counts from the bank (``plan.consistency``: the bank's first dimension, its leaf a member)."""
    tc = _text(config)
    key = next((k for k in EXPERT_KEYS if isinstance(tc.get(k), int)), None)
    main = [s for s in sets if "{layer}" in s and not s.startswith("mtp.")]
    banks = [b for b in stacked if "{layer}" in b and not b.startswith("mtp.")]
    if key is None or not (main or banks):
        return None
    leaves = set()
    if main:
        for v in views:
            for ld in landings(v):
                if v.modules.get(engine_module(ld.param), {}).get("kind") == "moe" and ".experts." in ld.module:
                    leaves.add(ld.module.rpartition(".")[2])
    else:
        leaves = {b.rpartition(".")[2] for b in banks}
    if not leaves:
        return None
    first = main[0] if main else banks[0]
    layers = first[: first.index("{layer}") + len("{layer}")]
    out = {"experts": key, "members": sorted(leaves), "layers": layers}
    if isinstance(tc.get("num_hidden_layers"), int):
        out["num_layers"] = "num_hidden_layers"
    out.update({f: k for k, field in LAYER_RULES.items() if k in tc and (f := _reads(field, tc[k]))})
    if not any(f in out for f in ("dense_below", "every", "dense_list", "sparse_step", "flags", "moe_list")):
        banked = (lambda mod: _in_bank(mod, main[0])) if main else (lambda mod: any(_in_stack(mod, b) for b in banks))
        out.update(_moe_pattern(tc, first, modules, banked))
    return out


def _moe_pattern(tc: dict, bank: str, modules: set[str], banked_module=None) -> dict:
    """Where no layer rule's key is in the config and only some decoder layers hold the bank: the config string of
    one letter a layer whose one letter marks exactly those layers (Nemotron-H's ``hybrid_override_pattern``, ``E``:
    vLLM 0.33 nemotron_h.py ``NemotronHModel`` builds layer i by ``hybrid_override_pattern[i]``, ``"E"`` a
    ``NemotronHMoEDecoderLayer``), read off the stand-in's modules, not named per family. ``banked_module``: whether
    a module is one of the bank's (default: an expert of ``bank``)."""
    banked_module = banked_module or (lambda mod: _in_bank(mod, bank))
    layers = bank[: bank.index("{layer}")]
    rx = re.compile(re.escape(layers) + r"(\d+)\.")
    present = {int(m.group(1)) for mod in modules if (m := rx.match(mod))}
    banked = {int(m.group(1)) for mod in modules if (m := rx.match(mod)) and banked_module(mod)}
    if not present or banked == present or not banked:
        return {}
    for key, value in tc.items():
        if isinstance(value, str) and len(value) == max(present) + 1:
            for letter in sorted(set(value)):
                if {i for i, c in enumerate(value) if c == letter} == banked:
                    return {"pattern": key, "pattern_moe": letter}
    return {}


def _in_stack(module: str, bank: str) -> bool:
    """``module`` is stacked bank ``bank`` (a template: ``model.layers.{layer}.moe.gate_proj``) of some layer."""
    return re.fullmatch(re.escape(bank).replace(re.escape("{layer}"), r"\d+"), module) is not None


def _in_bank(module: str, bank: str) -> bool:
    return re.fullmatch(re.escape(bank).replace(re.escape("{layer}"), r"\d+") + r"\.\d+\..+", module) is not None


def _reads(field: str, value: object) -> str | None:
    """The ``[moe]`` field that reads ``value`` as the config gives it: a list of layer numbers for ``dense_list``,
    an integer for the others; MiniMax M3's ``moe_layer_freq`` is one 0/1 flag a layer, not MiniMax M2's /
    DeepSeek's step: ``flags`` then (plan.consistency refuses a list where it reads an integer)."""
    if field == "dense_list":
        return field if isinstance(value, list) and all(type(i) is int for i in value) else None
    if field == "moe_list":
        return field if layer_numbers(value) is not None else None
    if type(value) is int:
        return field
    flags = isinstance(value, list) and value and all(type(f) is bool or f in (0, 1) for f in value)
    return "flags" if field == "every" and flags else None


def _quantized_heads(views: list[EngineView]) -> list[str]:
    """The output heads (``*LMHead`` modules) some engine builds with a quantized method under some output
    format's config: vLLM 0.33's ModelOpt config gives a ``ParallelLMHead`` its linear method unless excluded."""
    out = []
    for v in views:
        for mods in v.quant_modules.values():
            for name, info in mods.items():
                qm = info.get("quant_method")
                if "LMHead" in (info.get("class") or "") and qm and "Unquantized" not in qm and name not in out:
                    out.append(name)
    return out


def _unnamed_heads(views: list[EngineView], head: str) -> dict[str, list[str]]:
    """``[lm_head] unnamed``: output format -> the engines whose build under it gives the head a quantized method
    asked under an empty prefix (vLLM 0.33 exaone_moe.py / afmoe.py and SGLang 0.5.23 hunyuan.py build their
    ``ParallelLMHead`` with no ``prefix=``): no exclude entry keeps that head (vLLM's ModelOpt ``is_layer_excluded``
    matches each entry as a substring of the prefix, so ``""`` would exclude every layer)."""
    out: dict[str, list[str]] = {}
    for v in views:
        for fmt, mods in sorted(v.quant_modules.items()):
            info = mods.get(head) or {}
            qm = info.get("quant_method")
            if "LMHead" in (info.get("class") or "") and qm and "Unquantized" not in qm \
                    and info.get("quant_prefix") == "":
                out.setdefault(fmt, []).append(v.engine)
    return out


def _head_check(views: list[EngineView], config: dict, shapes: dict[str, tuple[int, ...]]) -> dict | None:
    """``[lm_head]``: the head's module and the config key that ties it; where the source stores no head (tied)
    and an engine would build one quantized, ``exclude_tied`` names it in the exclude list (else vLLM leaves its
    quantized parameters unset: Ernie 4.5 MoE's ``lm_head.weight_scale_2``)."""
    if "tie_word_embeddings" not in _text(config):
        return None
    head = next((n.removesuffix(".weight") for n in shapes if n.endswith("lm_head.weight")), None)
    if head is not None:
        unnamed = _unnamed_heads(views, head)
        return {"tie": "tie_word_embeddings", "module": head, **({"unnamed": unnamed} if unnamed else {})}
    built = [h for h in _quantized_heads(views) if h.endswith("lm_head")]
    if not built or _text(config)["tie_word_embeddings"] is not True:  # untied, no lm_head: the head is another's
        return None  # (DeepSeek V4's ``head``), which [lm_head] would wrongly ask for
    return {"tie": "tie_word_embeddings", "module": built[0], "exclude_tied": True}


def _leaves(d: dict, path: str = "") -> list[tuple[str, str, object]]:
    """Every config value that is not a table: (dotted path, its key, the value), depth first in the config's order."""
    out = []
    for k, v in d.items():
        out += _leaves(v, f"{path}{k}.") if isinstance(v, dict) else [(f"{path}{k}", k, v)]
    return out


def _int_lists(d: dict) -> list[tuple[str, list[int]]]:
    """Every config list of layer numbers (a key naming layers), by dotted path."""
    return [(path, v) for path, k, v in _leaves(d)
            if isinstance(v, list) and v and "layer" in k and all(type(x) is int for x in v)]


def _flag_lists(d: dict, n: int) -> list[tuple[str, list]]:
    """Every config list of one 0/1 flag a layer (``n`` of them; MiniMax M3's ``sparse_attention_freq``), by
    dotted path; not the MoE layer rules (``LAYER_RULES``: ``[moe]`` reads them, and they tell MLPs apart)."""
    return [(path, v) for path, k, v in _leaves(d)
            if isinstance(v, list) and len(v) == n and k not in LAYER_RULES
            and all(type(f) is bool or f in (0, 1) for f in v)]


def _group_sizes(d: dict, n: int) -> list[tuple[str, int]]:
    """Every config integer naming a group of layers (a key holding ``layer`` and ``group``: Ling 2.5 / 3.0's
    ``layer_group_size``) between 2 and ``n``, by dotted path: a type of every such group's last layer, or of its
    others (``LayerType.period``)."""
    return [(path, v) for path, k, v in _leaves(d) if type(v) is int and "layer" in k and "group" in k and 2 <= v <= n]


def _partial_layers(entry: dict, modules: set[str]) -> set[int]:
    """Layers where some but not all of a group's members exist and the engines built no such group."""
    rx = [re.compile(re.escape(p).replace(re.escape("{layer}"), r"(\d+)") + r"\.([^.]+)") for p in entry["parents"]
          if "{layer}" in p]  # a parent outside the numbered layers (a vision tower's) has no layer to be partial in
    have: dict[tuple[int, int], set[str]] = defaultdict(set)  # (parent, layer): an MTP block's layer 0 is not
    for mod in modules:                                        # the decoder's layer 0 (MiniMax M3)
        for i, r in enumerate(rx):
            if (m := r.fullmatch(mod)) is not None:
                have[i, int(m.group(1))].add(m.group(2))
    return {n for (_, n), leaves in have.items()
            if n not in entry["_layers"] and leaves & set(entry["members"]) and not set(entry["members"]) <= leaves}


def _layer_types(groups: list[dict], config: dict, modules: set[str]) -> dict[str, dict]:
    """A group that the engines build in some layers while other layers hold only some of its members (Kimi
    Linear's KDA ``q_proj`` beside its MLA ``q_proj``) applies by layer type: the config's list of layer numbers
    (0- or 1-based) that is exactly the layers it was seen in, else its list of one flag a layer set exactly there
    (MiniMax M3's five-member ``qkv_proj`` of its sparse-attention layers, ``per_layer``), else a group size whose
    groups' last layers, or their others, are exactly those (Ling 3.0's KDA ``qkvb_proj`` in every layer but each
    ``layer_group_size``th, ``period``)."""
    types: dict[str, dict] = {}
    text = _text(config)
    lists = _int_lists(text)
    n = text.get("num_hidden_layers")
    flags = _flag_lists(text, n) if type(n) is int else []
    sizes = _group_sizes(text, n) if type(n) is int else []
    for g in groups:
        seen = set(g["_layers"])
        if not seen or not _partial_layers(g, modules):
            continue
        found = next(({"config": path, "base": base} for path, values in lists
                      for base in (0, 1) if {v - base for v in values} == seen), None)
        if found is None:
            found = next(({"config": path, "per_layer": True} for path, values in flags
                          if {i for i, f in enumerate(values) if f} == seen), None)
        if found is None:
            found = next(({"config": path, "period": period} for path, size in sizes for period in ("last", "rest")
                          if {i for i in range(n) if ((i + 1) % size == 0) == (period == "last")} == seen), None)
        if found is not None:
            name = found["config"].rpartition(".")[2] + (f"_{found['period']}" if "period" in found else "")
            types[name] = found
            g["layer_type"] = name
    return types


def _rename_rule(src: str, dst: str) -> tuple[str, str]:
    """One module's rename as a rule over every index (``engine_names``): ``layers.1.experts.3.w1`` ->
    ``model.layers.1.mlp.experts.3.gate_proj`` is ``layers\\.(\\d+)\\.experts\\.(\\d+)\\.w1`` ->
    ``model.layers.\\1.mlp.experts.\\2.gate_proj``; where the engine's name does not hold the source's indices in
    order, the rule names that module alone."""
    a, b = src.split("."), dst.split(".")
    idx = [p for p in a if p.isdigit()]
    if [p for p in b if p.isdigit()] != idx:
        return re.escape(src), dst
    n = iter(range(1, len(idx) + 1))
    return (r"\.".join(r"(\d+)" if p.isdigit() else re.escape(p) for p in a),
            ".".join(f"\\{next(n)}" if p.isdigit() else p for p in b))


def _dotted_prefixes(views: list[EngineView]) -> dict[str, str]:
    """Source module -> the prefix vLLM asks its quant method with, where that prefix starts with a dot: a model class
    that builds its decoder under ``prefix=""`` (vLLM 0.33 step3_text.py ``Step3TextForCausalLM`` builds
    ``Step3TextModel(prefix=prefix)``, whose ``make_layers(..., prefix=f"{prefix}.layers")`` names layer N
    ``.layers.N``) asks ``.layers.N.self_attn.qkv_proj`` where the module is ``model.layers.N.self_attn.qkv_proj``,
    and the exclude entry ``model.layers.N.self_attn.q_proj`` is no part of it (ModelOpt's ``is_layer_excluded``:
    ``exclude_module in prefix``; Step-3 text has no ``packed_modules_mapping`` either): the exclude list names the
    prefix itself, its dot kept (``.layers.N.self_attn.qkv_proj``: compressed-tensors' ``should_ignore_layer``
    matches ignore entries whole, where ``layers.N.self_attn.qkv_proj`` left it quantized: "KeyError:
    'layers.0.self_attn.qkv_proj.weight' (at step3_text.py:499)"; ModelOpt finds it in the prefix too). vLLM only:
    SGLang 0.5.23 matches its ModelOpt entries whole (``modelopt_quant.py`` ``is_layer_excluded``), where a shortened
    name would exclude every layer's module (HunYuan's ``.self_attn.qkv_proj``)."""
    out: dict[str, str] = {}
    for v in views:
        if v.engine != "vllm":
            continue
        for ld in landings(v):
            em = engine_module(ld.param)
            for mods in v.quant_modules.values():
                p = (mods.get(em) or {}).get("quant_prefix")
                if p and p.startswith(".") and em.endswith(p) and ld.module not in p:
                    out.setdefault(ld.module, p)
    return out


def _engine_names(views: list[EngineView], sets: list[str], shapes: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """``[engine_names]``: each source module of a 2-D weight (what an exclude list can name; a norm never) that an
    engine renames where an exclude entry naming it stays as written (``EngineView.renames``), as rules over every
    index, and each routed-expert set's parent as its members' renames imply it (an exclude list names a set whose
    experts are all kept: plan/names.py ``exclude_list``); and each source module of a 2-D weight that vLLM builds
    into a module whose quant method it asks under a prefix that name is no part of (:func:`_dotted_prefixes`)."""
    renamed = {k: v for view in views for k, v in view.renames.items()}
    renamed.update({k: v for k, v in _dotted_prefixes(views).items() if k not in renamed})
    pairs = dict(sorted({k: v for k, v in renamed.items() if len(shapes.get(k + ".weight", ())) == 2}.items()))
    rules: dict[str, str] = {}
    for src, dst in pairs.items():
        rx, new = _rename_rule(src, dst)
        rules.setdefault(rx, new)
    sets_rx = [re.compile(re.escape(s).replace(re.escape("{layer}"), r"\d+") + r"\.(\d+)\.[^.]+") for s in sets]
    for src, dst in pairs.items():
        for rx in sets_rx:
            if (m := rx.fullmatch(src)) is not None and f".{m.group(1)}." in dst:
                rx2, new = _rename_rule(src[: m.start(1) - 1], dst[: dst.rindex(f".{m.group(1)}.")])
                rules.setdefault(rx2, new)
    return rules


def _head_exclude(views: list[EngineView], shapes: dict[str, tuple[int, ...]]) -> tuple[str, str] | None:
    """The source's output head where it is not called ``lm_head`` (Mistral's ``output``, DeepSeek V4's ``head``):
    the source module the engines load into their ``*LMHead`` module ``lm_head`` and nowhere else, and that module;
    the recipes keep the head by that name (``modules = ["lm_head"]``), which does not select it."""
    found: dict[str, str] = {}
    elsewhere = set()
    for v in views:
        for ld in landings(v):
            em = engine_module(ld.param)
            if em.rpartition(".")[2] == "lm_head" and "LMHead" in (v.modules.get(em, {}).get("class") or ""):
                found[ld.module] = em
            else:
                elsewhere.add(ld.module)
    heads = set(found) - elsewhere  # a tied head: the embedding loaded into both (LFM2 MoE): the tie rules cover it
    if len(heads) != 1:
        return None
    (head,) = heads
    if head.rpartition(".")[2] == "lm_head" or len(shapes.get(head + ".weight", ())) != 2:
        return None
    return head, found[head]


def _experts(views: list[EngineView], config: dict, shapes: dict[str, tuple[int, ...]], sets: list[str],
             modules: set[str]) -> dict:
    """``[moe]`` and ``[stacked]``, where they apply: a bank stored without ``.weight`` is its own module for the
    ``[moe]`` check's layers (``mapping.stacked_tensor_bank``)."""
    out: dict = {}
    stacked = _stacked(views, config, shapes)
    found = [b for v in views for b in stacked_banks(v, shapes)]
    banks = list(dict.fromkeys(template(b.module) for b in found))
    if (moe := _moe_check(views, config, sets, modules | {b.module for b in found if b.kept}, banks)) is not None:
        out["moe"] = moe
    if stacked is not None:
        out["stacked"] = stacked
    return out


def build(views: list[EngineView], config: dict, shapes: dict[str, tuple[int, ...]],
          drafts: list[EngineView] = (), name: str | None = None) -> dict:
    """The mapping table (as a dict in today's TOML format) for ``config``'s architecture; ``drafts``: the engines'
    draft models' traces (their packed modules in the MTP layers); ``name``: the table's name where the config's
    ``model_type`` is not the checkpoint's own but an engine's adaptation (Mistral's ``params.json`` read as DeepSeek
    V3's config: ``mistral_checkpoint.TABLE``), which the table then does not claim."""
    archs = list(config.get("architectures") or [])
    model_type = config.get("model_type", "")
    groups, scale_groups, sets = _groups(views, drafts)
    modules = {n.rpartition(".")[0] for n in shapes}
    layer_types = _layer_types(groups, config, modules)
    for g in groups:
        del g["_layers"]
    keep, not_linear, linear = _rules(views, shapes)
    versions = ", ".join(v.label for v in views)
    t: dict = {
        "name": f"derived-{name or model_type or (archs[0] if archs else 'model')}",
        "description": f"derived from {versions} ({', '.join(v.model_class for v in views)})",
        "architectures": archs,
        "model_types": [model_type] if model_type and not name else [],
    }
    if isinstance(config.get("text_config"), dict):
        t["text_config"] = "text_config"
    if sets:
        t["expert_sets"] = sets
    if layer_types:
        t["layer_types"] = layer_types
    # nothing is written fused on disk from a derived table: that a module fused on disk loads is an engine check's
    # finding (an overlay's [layout.*] allows it)
    t["layout"] = {e: {"formats": [], "reason": f"derived table: no module fused on disk has been checked in {e}"}
                   for e in ("vllm", "sglang")}
    if linear:
        t["linear"] = linear
    if not_linear:
        t["not_linear"] = not_linear
    if keep:
        t["keep"] = keep
    t.update(_experts(views, config, shapes, sets, modules))
    if (head := _head_check(views, config, shapes)) is not None:
        t["lm_head"] = head
    if (renamed := _head_exclude(views, shapes)) is not None:
        other, engine_head = renamed
        if "tie_word_embeddings" in _text(config):
            t.setdefault("lm_head", {"tie": "tie_word_embeddings", "module": other})
        t["exclude"] = [{"pattern": other, "reason": (
            f"the output head: {' and '.join(v.label for v in views)} load {other}.weight as {engine_head} (a "
            "ParallelLMHead); stays in high precision as the recipes keep lm_head (ModelOpt's default)")}]
    if groups:
        t["group"] = groups
    if scale_groups:
        t["scale_group"] = scale_groups
    names = _engine_names(views, sets, shapes)
    if renamed is not None:  # the exclude list names the head as the engines do: SGLang 0.5.23 modelopt_quant.py
        names.setdefault(re.escape(renamed[0]), renamed[1])  # is_layer_excluded matches names whole, not within
    if names:
        t["engine_names"] = names
    return t
