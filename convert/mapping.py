"""Architectures as data: the tables in ``mappings/*.toml`` and their typed form.

A table says, for one model family: where the text config lives, how layer kinds are read from it,
which modules the engines build as linear layers, which tensors they fuse (member order, cat or
stack, where a group applies), which members share one global scale without being fused, and the
default exclusion recipe. Adding a model means adding a table, not editing the pipeline.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from . import globs, tomlfile
from .errors import ConvertError
from .mtp import Mtp
from .mtp import parse as parse_mtp
from .schemes import SchemeName
from .vocabulary import KeepRule

ENGINES = ("vllm", "sglang")
PLACEHOLDERS = {"layer": r"(?P<layer>\d+)", "expert": r"(?P<expert>\d+)"}


@functools.lru_cache(maxsize=1024)
def template_regex(template: str) -> re.Pattern[str]:
    """``model.layers.{layer}.mlp`` -> a regex that captures the layer number (cached: the plan asks per module)."""
    out, pos = [], 0
    for m in re.finditer(r"\{(\w+)\}", template):
        if m.group(1) not in PLACEHOLDERS:
            raise ValueError(f"unknown placeholder {{{m.group(1)}}} in {template!r}")
        out.append(re.escape(template[pos : m.start()]))
        out.append(PLACEHOLDERS[m.group(1)])
        pos = m.end()
    out.append(re.escape(template[pos:]))
    return re.compile("".join(out))


@functools.lru_cache(maxsize=64)
def _expert_regexes(sets: tuple[str, ...], modules: bool) -> tuple[re.Pattern[str], ...]:
    rest = r"[^.]+" if modules else r".+"
    return tuple(re.compile(template_regex(t).pattern + rf"\.(?P<_expert_index>[0-9]+)\.(?P<_rest>{rest})")
                 for t in sets)


@dataclass(frozen=True)
class Group:
    """A packed module of the runtime: its members are concatenated (or stacked) along dim 0."""

    name: str
    members: tuple[str, ...]
    op: str  # "cat" or "stack"
    parents: tuple[str, ...]  # templates of the parent module, relative to the text prefix
    layer_type: str | None = None
    when: tuple[tuple[str, object], ...] = ()
    quantize: bool = True  # False: engines build it as a linear layer, but it is never NVFP4
    reason: str = ""  # why quantize (or on_disk) is False
    enabled: bool = True  # False: fused on disk only with --fuse NAME
    engines: tuple[str, ...] = ENGINES  # the engines that build this packed module
    unquantized_only: bool = False  # the engine builds it only for an unquantized model
    on_disk: bool = True  # False: fused inside the engine only (never written fused)
    # the row count the engine's fused parameter gives a member, as config paths summed ("a + b"): checked in
    # the plan under every layout (plan.fusion.check_members)
    rows: tuple[tuple[str, str], ...] = ()
    same_rows: bool = False  # the engine's parameter has equal halves (w13, gate_up): members' rows must match

    def parent_regexes(self) -> list[re.Pattern[str]]:
        return [template_regex(p) for p in self.parents]  # each cached


@dataclass(frozen=True)
class LayerType:
    """Which layers are of a type, read from the config: a list of layer numbers (``base`` 1 when it is
    1-based), or, with ``per_layer``, one entry a layer (MiniMax M3's ``sparse_attention_freq`` 0/1 flags):
    layer i is of the type where entry i is not 0 / false; or, with ``period``, a group size N (Ling 3.0's
    ``layer_group_size``: its engines make the last layer of every N an MLA layer and the others KDA, vLLM 0.33
    bailing_moe_v3.py ``_is_kda_layer``, SGLang 0.5.23 bailing_moe_v3.py ``is_linear_layer``): ``last``, layer i
    where (i + 1) % N == 0; ``rest``, every other layer."""

    name: str
    config: str  # dotted path in the text config
    base: int  # 1 when the list is 1-based
    # module templates ({layer}) only a layer of this type holds: a layer holding one must be listed, and a
    # listed layer must hold one (plan.consistency)
    holds: tuple[str, ...] = ()
    per_layer: bool = False
    period: str = ""  # "last" or "rest" of each group of N layers, N the config's entry

    def layers(self, value: object, where: str, count: object = None) -> list[int]:
        """The 0-based layer numbers ``value`` (the config's entry) names, of ``count`` layers (the config's
        ``num_hidden_layers``: a ``period`` type needs it); one line naming it when malformed."""
        if self.period:
            if type(value) is not int or value < 1:
                raise ConvertError(f"config.json: {where}{self.config} must be a positive integer (layers a group)")
            if type(count) is not int:
                raise ConvertError(f"config.json: {where}num_hidden_layers must be an integer (the {self.name} "
                                   f"layers are every {value}th's {self.period})")
            return [i for i in range(count) if ((i + 1) % value == 0) == (self.period == "last")]
        if self.per_layer:
            if not isinstance(value, list) or not all(type(f) is bool or f in (0, 1) for f in value):
                raise ConvertError(f"config.json: {where}{self.config} must be a list of 0/1 flags, one a layer")
            return [i for i, f in enumerate(value) if f]
        if not isinstance(value, list) or not all(type(i) is int for i in value):
            raise ConvertError(f"config.json: {where}{self.config} must be a list of layer numbers")
        return [i - self.base for i in value]


@dataclass(frozen=True)
class MoeCheck:
    """The config fields the engines build routed experts from, as data, so that plan.consistency can hold
    them against the tensors for any family: how many experts a MoE layer has, each expert's modules, and
    which decoder layers are MoE (a layer is MoE when every rule whose field is set says so)."""

    experts: str  # config path: routed experts in each MoE layer (``n_routed_experts``)
    members: tuple[str, ...]  # each routed expert's modules (``w1``, ``w2``, ``w3``)
    layers: str = ""  # decoder layer template (``model.layers.{layer}``): the rules below apply to it
    num_layers: str = ""  # config path: decoder layers (past them: MTP layers, checked for experts only)
    dense_below: str = ""  # config path: layers below it are dense (``first_k_dense_replace``)
    every: str = ""  # config path: MoE where layer % every == 0 (``moe_layer_freq``)
    dense_list: str = ""  # config path: a list of dense layers (``mlp_only_layers``)
    sparse_step: str = ""  # config path: MoE where (layer + 1) % step == 0 (``decoder_sparse_step``)
    flags: str = ""  # config path: one 0/1 flag a layer, MoE where set (MiniMax M3's ``moe_layer_freq`` list)
    pattern: str = ""  # config path: a string of one letter a layer (Nemotron-H's ``hybrid_override_pattern``)
    pattern_moe: str = ""  # the letter of a MoE layer in it (``E``)
    moe_list: str = ""  # config path: the MoE layers' numbers, a list or one comma-separated string (Step-3.5's
    # ``moe_layers_enum``: vLLM 0.33 step3p5.py ``Step3p5DecoderLayer``, SGLang 0.5.23 step3p5.py ``_is_moe_layer``)


def layer_numbers(value: object) -> list[int] | None:
    """A config's list of layer numbers, as a list of integers or one comma-separated string of them (Step-3.5's
    ``moe_layers_enum`` "3,4,5"); None where it is neither."""
    if isinstance(value, list) and all(type(i) is int for i in value):
        return value
    if isinstance(value, str) and re.fullmatch(r"\s*\d+(\s*,\s*\d+)*\s*", value):
        return [int(i) for i in value.split(",")]
    return None


@dataclass(frozen=True)
class LmHeadCheck:
    """``tie``: the config path saying the output head is the embedding; ``module``: the head's module, which
    an untied config needs (the engines build it and would leave it unset)."""

    tie: str
    module: str
    # the checkpoint stores no head where the config ties it, yet an engine builds one it would quantize (vLLM 0.33's
    # ModelOpt config quantizes a ParallelLMHead it is not told to exclude, and its tie copies the weight alone):
    # the exclude list names the head then (plan/make.py)
    exclude_tied: bool = False
    # (output format, engines) where an engine builds the head with a quantized method asked under an empty prefix
    # (vLLM 0.33 exaone_moe.py / afmoe.py, SGLang 0.5.23 hunyuan.py: ParallelLMHead with no prefix=): no exclude
    # entry reaches it (vLLM's ModelOpt is_layer_excluded matches each entry as a substring, so the one that names
    # "" names every layer), so the head is written as that engine builds it (plan/decide.py ``head_rule``)
    unnamed: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def unnamed_in(self, output_format: str, engines: Iterable[str]) -> tuple[str, ...]:
        """The engines among ``engines`` that build the head quantized under ``output_format`` whatever the
        exclude list says."""
        built = dict(self.unnamed).get(output_format, ())
        return tuple(e for e in engines if e in built)


@dataclass(frozen=True)
class Stacked:
    """Routed experts an engine reads only as stacked 3-D banks (``[stacked]``): each module matching ``modules``
    stores one weight [experts, N, K] holding every expert of its layer, and is written as one 3-D NVFP4 bank with
    one global scale per expert (docs/stacked-banks.md: vLLM 0.33's Step-3 text and Step 5 loaders hand
    ``loaded_weight[expert_id]`` to the fused-MoE loader and read no per-expert name)."""

    modules: tuple[str, ...]  # globs of the bank modules (``model.layers.*.moe.gate_proj``), or of banks stored
    #                          without ``.weight`` (IQuest-Q1's ``mlp.experts.fc``: the tensor is the bank)
    experts: str  # config path of the expert count (a bank's first dimension must equal it)
    reason: str = ""  # the engine's loader that reads the banks so
    #: the engine reads no quantized bank (SGLang 0.5.23 iquest_q1.py): every bank copied as stored, its experts
    #: module named in the exclude list so that the engine builds it unquantized
    keep: bool = False


def stacked_experts_module(bank: str) -> str:
    """The fused-MoE module an engine builds from a stacked expert bank, which its exclude list names: the bank's
    ``experts`` ancestor (``mlp.experts.fc``), else its sibling ``experts`` (``moe.gate_proj`` -> ``moe.experts``:
    vLLM 0.33 step3_text.py ``Step3TextMoEBlock`` / step5 ``Step5MoE``: ``FusedMoEFactory(prefix=...experts)``)."""
    head, sep, _ = bank.partition(".experts.")
    return head + ".experts" if sep else bank.rsplit(".", 1)[0] + ".experts"


@dataclass(frozen=True)
class Mapping:
    name: str
    description: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    text_config: str  # key of the nested text config, "" for a flat config
    text_prefix: str  # prefix of the text model's tensor names
    layer_types: tuple[LayerType, ...]
    linear: tuple[str, ...]  # globs of modules built as linear layers although their weight is not 2-D
    not_linear: tuple[str, ...]  # globs of modules whose 2-D weight is not a linear layer (embeddings)
    # what keeps a module in high precision (keep.py says in which order): linear modules that are never
    # quantized, whatever the user says; modules an engine loads only in some schemes (``KeepRule.schemes``, the
    # file's ``formats``: what else a recipe asks for is kept instead); the default exclusion recipe (origin
    # ``default (NAME)``)
    keep: tuple[KeepRule, ...]
    restrict: tuple[KeepRule, ...]
    exclude: tuple[KeepRule, ...]
    groups: tuple[Group, ...]
    expert_sets: tuple[str, ...]  # parents whose children the engine quantizes all-or-nothing
    config_defaults: dict = field(default_factory=dict)
    # name prefixes of blocks only some inputs of the family store (Qwen3.5's ``mtp.``): an input with no
    # module under one is not warned about the table's entries under it
    optional_blocks: tuple[str, ...] = ()
    layouts: dict = field(default_factory=dict)  # layout -> (schemes an engine takes fused on disk, why)
    moe: MoeCheck | None = None  # the config fields of the routed experts (plan.consistency)
    lm_head: LmHeadCheck | None = None
    mtp: Mtp | None = None  # the MTP layers and what each engine's draft model needs of them (convert/mtp.py)
    # (regex, replacement): how the engines rename a module of a checkpoint whose names are not their own
    # (Mistral Large 3: models/mistral_large_3.py hf_to_vllm_mapper / remapping); the exclude list names both
    engine_names: tuple[tuple[str, str], ...] = ()
    stacked: Stacked | None = None  # routed experts written as stacked 3-D NVFP4 banks (``[stacked]``)
    # a derived table's engines that do not serve the architecture quantized -> why (``derive.Unserved``)
    not_served: dict[str, str] = field(default_factory=dict)
    source: str = ""  # the table's text, for the manifest
    path: str = ""

    def notices(self) -> list[str]:
        """What a pack's user must be told of the table itself: each engine its derivation left out."""
        serving = ", ".join(e for e in ENGINES if e not in self.not_served)
        return [f"mapping {self.name}: derived without {e} ({why}): the output is made for {serving} alone"
                for e, why in sorted(self.not_served.items())]

    def expert_regexes(self, modules: bool = True) -> tuple[re.Pattern[str], ...]:
        """Names under each routed-expert set, ``SET.{index}.{rest}`` without the text prefix, groups
        ``_expert_index`` and ``_rest``: a module's (``rest`` one name part, ``w1``; for ``fullmatch``) or,
        with ``modules=False``, anything under the expert (``w1.weight``). The one expert-index pattern."""
        return _expert_regexes(self.expert_sets, modules)

    @functools.cached_property
    def _module_regexes(self) -> tuple[re.Pattern[str], ...]:
        """expert_regexes(), held: expert_template runs once per module of the plan (half a million for K3)."""
        return self.expert_regexes()

    def expert_template(self, module: str) -> str | None:
        """A routed expert module's name with its expert index replaced (``...experts.#.w1``); None for any
        other module."""
        short = self.strip(module)
        for rx in self._module_regexes:
            hit = rx.fullmatch(short)
            if hit is not None:
                a, b = hit.span("_expert_index")
                off = len(module) - len(short)
                return f"{module[:off + a]}#{module[off + b:]}"
        return None

    def mtp_prefixes(self, config: dict, tensors: Iterable[str] = ()) -> tuple[str, ...]:
        """The name prefixes of the MTP layers ``config`` announces, or ``tensors`` (the checkpoint's names) store
        where the ``[mtp]`` table counts them so (none without an ``[mtp]`` table)."""
        if self.mtp is None:
            return ()
        return self.mtp.prefixes(lambda path: self.config_value(config, path), tensors)

    def mtp_layers(self, config: dict, tensors: Iterable[str] = ()) -> tuple[dict[str, str], ...]:
        """What ``{i}`` and ``{n}`` of the ``[mtp]`` templates stand for in each MTP layer (:meth:`mtp_prefixes`)."""
        if self.mtp is None:
            return ()
        return self.mtp.layer_values(lambda path: self.config_value(config, path), tensors)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()

    def text_config_of(self, config: dict) -> dict:
        if not self.text_config:
            return config
        sub = config.get(self.text_config)
        if not isinstance(sub, dict):
            raise ConvertError(f"config.json: {self.name} needs a {self.text_config!r} object")
        return sub

    def config_value(self, config: dict, dotted: str) -> object:
        """The text config's value at a dotted path; the mapping's default (or None) where it is absent."""
        value: object = self.text_config_of(config)
        for part in dotted.split("."):
            if not isinstance(value, dict) or part not in value:
                return self.config_defaults.get(dotted)
            value = value[part]
        return value

    def layer_kinds(self, config: dict) -> dict[int, str]:
        """0-based layer number -> layer type name, from the config's layer lists."""
        kinds: dict[int, str] = {}
        where = f"{self.text_config}." if self.text_config else ""
        for lt in self.layer_types:
            layers = self.config_value(config, lt.config)
            if layers is None:
                raise ConvertError(f"config.json: {where}{lt.config} is missing (mapping {self.name} needs it "
                                   f"to tell {lt.name} layers)")
            for i in lt.layers(layers, where, self.config_value(config, "num_hidden_layers")):
                if kinds.get(i, lt.name) != lt.name:
                    raise ConvertError(f"config.json: layer {i + lt.base} is listed as both {kinds[i]} and {lt.name}")
                kinds[i] = lt.name
        return kinds

    def strip(self, name: str) -> str:
        if self.text_prefix and name.startswith(self.text_prefix):
            return name[len(self.text_prefix) :]
        return name

    def _hit(self, module: str, patterns: tuple[str, ...]) -> bool:
        return any(globs.match(p, module, self.text_prefix) for p in patterns)

    def is_linear(self, module: str, shape: tuple[int, ...]) -> bool:
        """A linear layer is found by what it is, not by its name: a 2-D ``.weight`` (``kv_a_proj_with_mqa``
        has no ``_proj`` suffix) unless the mapping says it is not one, or a module the mapping lists
        (depthwise conv weights [P, 1, K] that the engines build as linear layers)."""
        if self._hit(module, self.not_linear):
            return False
        return len(shape) == 2 or self._hit(module, self.linear) or self.stacked_bank(module)

    def stacked_bank(self, module: str) -> bool:
        """Whether ``module`` is a stacked expert bank the table's ``[stacked]`` names."""
        return self.stacked is not None and self._hit(module, self.stacked.modules)

    def stacked_tensor_bank(self, name: str) -> str | None:
        """The stacked bank a stored tensor is (``[stacked]``): its module's (``X.weight`` of a bank module ``X``), or
        the tensor itself where a glob names it (a bank stored without ``.weight``); None for any other tensor."""
        if self.stacked is None:
            return None
        if self._hit(name, self.stacked.modules):
            return name
        mod, _, leaf = name.rpartition(".")
        return mod if leaf == "weight" and self._hit(mod, self.stacked.modules) else None

    def stacked_error(self, name: str, shape: tuple[int, ...], config: dict) -> str | None:
        """Why stored tensor ``name`` cannot be a stacked expert bank of this table (its words after the file), or
        None: it must be [experts, N, K] with experts the config's count (``[stacked] experts``)."""
        assert self.stacked is not None
        want = self.config_value(config, self.stacked.experts)
        if len(shape) == 3 and type(want) is int and shape[0] == want:
            return None
        got = "absent" if want is None else repr(want)
        return (f"tensor {name} {list(shape)}: a stacked expert bank of mapping {self.name} must be [experts, N, K] "
                f"with experts = config.json {self.stacked.experts} ({got})")

    def _one_per_expert_template(self, modules: list[str]) -> list[str]:
        """``modules`` with each routed expert module kept for the first expert of its layer only (``w1`` of
        expert 0 standing for every ``w1``): a glob that cannot tell expert indices apart
        (globs.index_blind) matches one exactly when it matches all, and the released K3's half a million
        expert modules need not be scanned for a table's ``keep 'vision_tower.*'``."""
        seen: set[str] = set()
        out = []
        for mod in modules:
            key = self.expert_template(mod)
            if key is None or key not in seen:
                out.append(mod)
                if key is not None:
                    seen.add(key)
        return out

    def engine_spellings(self, module: str) -> list[str]:
        """``module`` as the engines name it after their own renames (``engine_names``: one engine's spelling may
        differ from the other's, DeepSeek V4's ``attn.wq_a`` SGLang's ``self_attn.wqkv_a``), in rule order."""
        return list(dict.fromkeys(re.sub(rx, new, module) for rx, new in self.engine_names
                                  if re.fullmatch(rx, module)))

    def fits(self, config: dict) -> str | None:
        """Why this table is not for ``config`` (a ``--mapping`` given by hand), or None."""
        archs = config.get("architectures") or []
        if any(a in self.architectures for a in archs) or config.get("model_type") in self.model_types:
            return None
        says = ", ".join(archs) or f"model_type {config.get('model_type')!r}"
        return (f"mapping {self.name} ({self.path}) is for {', '.join(self.architectures + self.model_types)}; "
                f"config.json says {says}")

    def unmatched(self, modules: Iterable[str]) -> list[str]:
        """The table's entries that name nothing in the input (a misspelt glob is otherwise silent:
        the weights are just copied or left unfused)."""
        modules = list(modules)
        shorts = {self.strip(mod) for mod in modules}
        parents = {s.rpartition(".")[0] for s in shorts}
        few = self._one_per_expert_template(modules)

        def hit(pattern: str) -> bool:
            return any(globs.match(pattern, mod, self.text_prefix)
                       for mod in (few if globs.index_blind(pattern) else modules))

        # an MTP block under a prefix of its own is optional too: a release re-saved without it (a fine-tune, a
        # quantized re-release, a bench preset) is not warned about every MTP entry of a derived table
        mtp = (self.strip(self.mtp.prefix),) if self.mtp is not None and "{n}" not in self.mtp.prefix else ()
        absent = tuple(b for b in self.optional_blocks + mtp if not any(x.startswith(b) for x in shorts))

        def wanted(entry: str) -> bool:  # not under an optional block this input does not store
            return not self.strip(entry).startswith(absent) if absent else True

        me = f"mapping {self.name} ({self.path})"
        out = [f"{me}: {what} {pat!r} matches no module of the input"
               for what, pats in (("linear", self.linear), ("not_linear", self.not_linear),
                                  ("keep", tuple(r.text for r in self.keep if not r.optional)),
                                  ("restrict", tuple(r.text for r in self.restrict)))
               for pat in pats if wanted(pat) and not hit(pat)]
        for g in self.groups:
            for parent, rx in zip(g.parents, g.parent_regexes(), strict=True):
                if wanted(parent) and not any(rx.fullmatch(p) for p in parents):
                    out.append(f"{me}: group {g.name}: parents {parent!r} matches no module of the input")
        leaves = {s.rpartition(".")[2] for s in shorts}
        for g in self.groups:
            if leaves.isdisjoint(g.members) and any(wanted(p) for p in g.parents):
                out.append(f"{me}: group {g.name}: members {', '.join(g.members)}: none is a module of the input")
        for tmpl in self.expert_sets:
            rx = re.compile(template_regex(tmpl).pattern + r"\.")
            if wanted(tmpl) and not any(rx.match(x) for x in shorts):
                out.append(f"{me}: expert_sets {tmpl!r} matches no module of the input")
        return list(dict.fromkeys(out))


GROUP_KEYS = {"name", "members", "op", "parents", "layer_type", "when", "quantize", "reason", "enabled", "engines",
              "unquantized_only", "on_disk", "rows", "same_rows"}


def _schema() -> tomlfile.Spec:
    """Every key a mapping table may hold and what its value must be (tomlfile.validate, at load)."""
    t = tomlfile
    tmpl, schemes = t.template(tuple(PLACEHOLDERS)), t.strs(t.one_of(tuple(s.value for s in SchemeName), "format"))
    path = t.STR
    rule = t.table({"pattern": t.STR, "reason": t.STR, "optional": t.BOOL}, ("pattern",))
    group_fields = {"name": t.STR, "members": t.strs(), "op": t.one_of(("cat", "stack"), "op"),
                    "parents": t.strs(tmpl), "layer_type": t.STR,
                    "when": t.map_of(t.SCALAR, "a table of config values"), "quantize": t.BOOL, "reason": t.STR,
                    "enabled": t.BOOL, "engines": t.strs(t.one_of(ENGINES, "engine")),
                    "unquantized_only": t.BOOL, "on_disk": t.BOOL,
                    "rows": t.map_of(t.STR, 'a table of member = "config.path [+ config.path ...]"'),
                    "same_rows": t.BOOL}
    scale_fields = {k: group_fields[k] for k in ("name", "members", "parents", "rows", "same_rows")}
    layout = t.table({"formats": schemes, "reason": t.STR})
    return t.table({
        "name": t.STR, "description": t.STR, "architectures": t.strs(), "model_types": t.strs(),
        "text_config": t.STR, "text_prefix": t.STR, "expert_sets": t.strs(tmpl), "linear": t.strs(),
        "not_linear": t.strs(), "config_defaults": t.map_of(t.Spec((bool, int, float, str, list), "a config value"),
                                                            "a table of config values"),
        "layer_types": t.map_of(t.table({"config": path, "base": t.INT, "holds": t.strs(tmpl), "per_layer": t.BOOL,
                                         "period": t.one_of(("last", "rest"), "period")},
                                        ("config",)),
                                "a table of layer types"),
        "keep": t.array_of(rule, "an array of tables ([[keep]])"),
        "restrict": t.array_of(t.table({"pattern": t.STR, "formats": schemes, "reason": t.STR}, ("pattern",)),
                               "an array of tables ([[restrict]])"),
        "exclude": t.array_of(rule, "an array of tables ([[exclude]])"),
        "group": t.array_of(t.table(group_fields, ("name", "members", "parents")), "an array of tables ([[group]])"),
        "scale_group": t.array_of(t.table(scale_fields, ("name", "members", "parents")),
                                  "an array of tables ([[scale_group]])"),
        "layout": t.table({e: layout for e in ENGINES}, expected="a table of layouts named after an engine"),
        "optional_blocks": t.strs(),
        "moe": t.table({"experts": path, "members": t.strs(), "layers": tmpl, "num_layers": path,
                        "dense_below": path, "every": path, "dense_list": path, "sparse_step": path,
                        "flags": path, "pattern": path, "pattern_moe": t.STR, "moe_list": path},
                       ("experts", "members")),
        "lm_head": t.table({"tie": path, "module": t.STR, "exclude_tied": t.BOOL,
                            "unnamed": t.map_of(t.strs(t.one_of(ENGINES, "engine")),
                                                "a table of output format = the engines")},
                           ("tie", "module")),
        "mtp": t.Spec((dict,), "a table ([mtp]; its keys are checked by convert/mtp.py)"),
        "engine_names": t.map_of(t.strs(), "a table of module regex = the engines' name (or names) for it"),
        "stacked": t.table({"modules": t.strs(), "experts": path, "reason": t.STR, "keep": t.BOOL},
                           ("modules", "experts")),
        "not_served": t.table({e: t.STR for e in ENGINES}, expected="a table of engine = why it was left out"),
    }, ("name",))


def _known(table: dict, keys: set[str], where: str) -> None:
    """Refuse unknown keys: in TOML a key after a [table] header silently lands in that table."""
    extra = sorted(set(table) - keys)
    if extra:
        raise ConvertError(f"{where}: unknown key(s) {', '.join(extra)} (allowed: {', '.join(sorted(keys))})")


def _req(table: dict, key: str, kind: type, where: str):
    if key not in table:
        raise ConvertError(f"{where}: missing key {key!r}")
    value = table[key]
    if not isinstance(value, kind):
        raise ConvertError(f"{where}: {key!r} must be a {kind.__name__}")
    return value


def _strs(table: dict, key: str, where: str, default: tuple = ()) -> tuple[str, ...]:
    value = table.get(key, list(default))
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConvertError(f"{where}: {key!r} must be a list of strings")
    return tuple(value)


def _tables(items: object, where: str, keys: set[str], build) -> tuple:
    """An array of TOML tables, each checked for unknown keys and built by ``build(table, where)``."""
    if not isinstance(items, list):
        raise ConvertError(f"{where}: must be an array of tables")
    out = []
    for i, r in enumerate(items):
        w = f"{where}[{i}]"
        if not isinstance(r, dict):
            raise ConvertError(f"{w}: must be a table")
        _known(r, keys, w)
        out.append(build(r, w))
    return tuple(out)


def _globs(table: dict, key: str, where: str) -> tuple[str, ...]:
    """A list of module globs, each checked (globs.check) and named by its place (``FILE: linear[0]``)."""
    return tuple(globs.check(g, f"{where}: {key}[{i}]") for i, g in enumerate(_strs(table, key, where)))


def _rules(items: object, where: str, origin: str) -> tuple[KeepRule, ...]:
    return _tables(items, where, {"pattern", "reason", "optional"}, lambda r, w: KeepRule(
        globs.check(_req(r, "pattern", str, w), w), origin, r.get("reason", ""),
        optional=bool(r.get("optional", False))))


def _restricts(items: object, where: str, origin: str) -> tuple[KeepRule, ...]:
    return _tables(items, where, {"pattern", "formats", "reason"}, lambda r, w: KeepRule(
        globs.check(_req(r, "pattern", str, w), w), origin, r.get("reason", ""), _strs(r, "formats", w)))


def _layouts(table: object, where: str) -> dict[str, tuple[tuple[str, ...], str]]:
    if not isinstance(table, dict):
        raise ConvertError(f"{where}: must be a table of layouts")
    out = {}
    for name, lt in table.items():
        if name not in ENGINES or not isinstance(lt, dict):
            raise ConvertError(f"{where}.{name}: a layout is named after an engine ({', '.join(ENGINES)})")
        _known(lt, {"formats", "reason"}, f"{where}.{name}")
        out[name] = (_strs(lt, "formats", f"{where}.{name}"), str(lt.get("reason", "")))
    return out


def _rows(rows: object, members: tuple[str, ...], where: str) -> tuple[tuple[str, str], ...]:
    """A group's ``rows`` table: member -> config paths summed (``"kv_lora_rank + qk_rope_head_dim"``)."""
    if not isinstance(rows, dict) or not all(isinstance(v, str) and v.strip() for v in rows.values()):
        raise ConvertError(f"{where}: rows must be a table of member = \"config.path [+ config.path ...]\"")
    unknown = set(rows) - set(members)
    if unknown:
        raise ConvertError(f"{where}: rows names {', '.join(sorted(unknown))}, not a member")
    return tuple(sorted(rows.items()))


def _group(g: object, where: str) -> Group:
    if not isinstance(g, dict):
        raise ConvertError(f"{where}: must be a table")
    _known(g, GROUP_KEYS, where)
    op = g.get("op", "cat")
    if op not in ("cat", "stack"):
        raise ConvertError(f"{where}: op must be 'cat' or 'stack', not {op!r}")
    members = _strs(g, "members", where)
    if len(members) < 2 or len(set(members)) != len(members):
        raise ConvertError(f"{where}: members must name two or more distinct modules")
    parents = _strs(g, "parents", where)
    if not parents:
        raise ConvertError(f"{where}: parents must name at least one parent module template")
    when = g.get("when", {})
    if not isinstance(when, dict):
        raise ConvertError(f"{where}: when must be a table of config values")
    engines = _strs(g, "engines", where, ENGINES)
    if not engines or set(engines) - set(ENGINES):
        raise ConvertError(f"{where}: engines must name some of {', '.join(ENGINES)}")
    grp = Group(
        name=_req(g, "name", str, where),
        members=members,
        op=op,
        parents=parents,
        layer_type=g.get("layer_type"),
        when=tuple(sorted(when.items())),
        quantize=bool(g.get("quantize", True)),
        reason=str(g.get("reason", "")),
        enabled=bool(g.get("enabled", True)),
        engines=engines,
        unquantized_only=bool(g.get("unquantized_only", False)),
        on_disk=bool(g.get("on_disk", True)),
        rows=_rows(g.get("rows", {}), members, where),
        same_rows=bool(g.get("same_rows", False)),
    )
    try:
        grp.parent_regexes()
    except ValueError as e:
        raise ConvertError(f"{where}: {e}") from None
    return grp


def _moe(table: dict | None) -> MoeCheck | None:
    if table is None:
        return None
    return MoeCheck(**{**table, "members": tuple([table["members"]] if isinstance(table["members"], str)
                                                 else table["members"])})


def _lm_head(table: dict | None) -> LmHeadCheck | None:
    if table is None:
        return None
    unnamed = tuple(sorted((f, tuple([e] if isinstance(e, str) else e)) for f, e in table.get("unnamed", {}).items()))
    return LmHeadCheck(**{**table, "unnamed": unnamed})


def _stacked(table: dict | None, where: str) -> Stacked | None:
    if table is None:
        return None
    return Stacked(_globs(table, "modules", where), table["experts"], table.get("reason", ""),
                   bool(table.get("keep", False)))


def _engine_names(table: dict, where: str) -> tuple[tuple[str, str], ...]:
    for rx in table:
        try:
            re.compile(rx)
        except re.error as e:
            raise ConvertError(f"{where}: {rx!r} is not a regular expression: {e}") from None
    return tuple((rx, new) for rx, news in table.items() for new in ([news] if isinstance(news, str) else news))


def parse_mapping(text: str, path: str) -> Mapping:
    """Parse and validate one table; errors name the file and the key (or TOML line)."""
    t = tomlfile.loads(text, path)
    tomlfile.validate(t, _schema(), path)
    lts = [LayerType(name, lt["config"], lt.get("base", 0), _strs(lt, "holds", path), lt.get("per_layer", False),
                     lt.get("period", ""))
           for name, lt in t.get("layer_types", {}).items()]
    groups = tuple(_group(g, f"{path}: group[{i}]") for i, g in enumerate(t.get("group", [])))
    # A scale_group is a packed module the engines build inside a layer (MoE w13) and that is never
    # written fused: sugar for a group with on_disk = false.
    for i, s in enumerate(t.get("scale_group", [])):
        w = f"{path}: scale_group[{i}]"
        if not isinstance(s, dict):
            raise ConvertError(f"{w}: must be a table")
        _known(s, {"name", "members", "parents", "rows", "same_rows"}, w)
        groups += (_group({**s, "on_disk": False}, w),)
    known_types = {lt.name for lt in lts}
    for g in groups:
        if g.layer_type is not None and g.layer_type not in known_types:
            raise ConvertError(f"{path}: group {g.name}: unknown layer_type {g.layer_type!r}")
    keys = [(g.name, g.engines, g.when) for g in groups]
    if len(set(keys)) != len(keys):
        raise ConvertError(f"{path}: two groups of one name need different engines or conditions")
    name = _req(t, "name", str, path)
    return Mapping(
        name=name,
        description=t.get("description", ""),
        architectures=_strs(t, "architectures", path),
        model_types=_strs(t, "model_types", path),
        text_config=t.get("text_config", ""),
        text_prefix=t.get("text_prefix", ""),
        layer_types=tuple(lts),
        linear=_globs(t, "linear", path),
        not_linear=_globs(t, "not_linear", path),
        keep=_rules(t.get("keep", []), f"{path}: keep", f"mapping {name}: keep"),
        restrict=_restricts(t.get("restrict", []), f"{path}: restrict", f"mapping {name}: restrict"),
        exclude=_rules(t.get("exclude", []), f"{path}: exclude", f"default ({name})"),
        groups=groups,
        expert_sets=_strs(t, "expert_sets", path),
        config_defaults=dict(t.get("config_defaults", {})),
        optional_blocks=_strs(t, "optional_blocks", path),
        layouts=_layouts(t.get("layout", {}), f"{path}: layout"),
        moe=_moe(t.get("moe")),
        lm_head=_lm_head(t.get("lm_head")),
        mtp=parse_mtp(t.get("mtp"), f"{path}: mtp"),
        engine_names=_engine_names(t.get("engine_names", {}), f"{path}: engine_names"),
        stacked=_stacked(t.get("stacked"), f"{path}: stacked"),
        not_served=dict(t.get("not_served", {})),
        source=text,
        path=path,
    )


def builtin_tables(folder: str, parse, naming: Sequence[str] = ()):
    """Every ``*.toml`` shipped in ``kimi_convert.FOLDER``, parsed (mappings, recipes); with ``naming``, only those
    whose text holds one of those strings (a table is parsed only when it may be the one asked for: parsing the nine
    hand tables was a tenth of a small pack's start)."""
    files = resources.files(f"kimi_convert.{folder}")
    texts = ((f.name, f.read_text(encoding="utf-8")) for f in sorted(files.iterdir(), key=lambda f: f.name)
             if f.name.endswith(".toml"))
    return [parse(text, f"{folder}/{name}") for name, text in texts if not naming or any(n in text for n in naming)]


def builtin_mappings() -> list[Mapping]:
    return builtin_tables("mappings", parse_mapping)


def load_mapping(path: str | Path) -> Mapping:
    p = Path(path)
    return parse_mapping(tomlfile.read_toml_text(p, str(p)), str(p))


class UnknownArchitecture(ConvertError):
    """No hand table names the config's architecture (``derive.lookup`` then tries a derived one). Its message, which
    lists every hand table's architectures, is written only when shown: an architecture a shipped derived table
    covers never shows it, and parsing the nine tables for it was most of the table lookup's time."""

    def __init__(self, named: object):
        super().__init__(named)
        self.named = named

    def __str__(self) -> str:
        known = ", ".join(sorted(a for m in builtin_mappings() for a in m.architectures))
        return (f"config.json: unknown architecture {self.named!r}; known: {known}; "
                "pass --mapping FILE.toml for another model")


def find_mapping(config: dict, override: str | Path | None = None, by_model_type: bool = True) -> Mapping:
    """The table for ``config`` (by architecture, then, with ``by_model_type``, model_type), or the one given with
    --mapping."""
    if override is not None:
        if Path(str(override)).exists():
            return load_mapping(override)
        m = builtin_by_name(str(override))
        if m is None and ("/" in str(override) or str(override).endswith(".toml")):
            raise ConvertError(f"{override}: mapping file does not exist")
        if m is None:
            known = ", ".join(t.name for t in builtin_mappings())
            raise ConvertError(f"--mapping {override}: no such table or file; known tables: {known}; "
                               "or the path of a FILE.toml")
        return m
    archs = config.get("architectures") or []
    model_type = config.get("model_type")
    tables = builtin_tables("mappings", parse_mapping, [str(n) for n in [*archs, model_type] if n])
    for m in tables:
        if any(a in m.architectures for a in archs):
            return m
    for m in tables if by_model_type else ():
        if model_type in m.model_types:
            return m
    raise UnknownArchitecture(archs or model_type)


def builtin_by_name(name: str) -> Mapping | None:
    return next((m for m in builtin_mappings() if m.name == name), None)
