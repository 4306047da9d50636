"""The config against the tensors: every config field the engines build a layer from, held against what the
checkpoint stores, per family, from the mapping table's data (``[moe]``, ``[lm_head]``, ``layer_types.*.holds``,
each group's ``when``), never from code per family.

The engines build a model from ``config.json`` and then load the tensors into it. Where the two disagree the
output is one they cannot load (an expert the config announces and no file holds: a parameter left unset) or
read wrong (a KDA layer the config calls something else loses its shared global scale). Each of these was
packed before, and verified; ``plan`` now refuses it, naming the config field and the tensor or module.

Cheap at the released K3's size (half a million tensors): one pass over the names, split from the right, as
``banks`` does; gpt-oss's 3-D expert banks are the one place a source encoding is asked (its claim names the
experts a bank holds)."""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

from .. import encodings
from ..checkpoint import Checkpoint
from ..errors import ConvertError
from ..mapping import LayerType, Mapping, MoeCheck, layer_numbers, stacked_experts_module, template_regex


@dataclass(frozen=True, slots=True)
class _Field:
    """A config field as the mapping reads it: its dotted path, where it is shown, and its value."""

    path: str
    shown: str
    value: object

    def says(self) -> str:
        if isinstance(self.value, str):
            return f"the string {self.value!r}"
        return "absent" if self.value is None else str(self.value).lower() if isinstance(self.value, bool) \
            else repr(self.value)


def check_config_tensors(ckpt: Checkpoint, m: Mapping) -> None:
    """Refuse, in one line naming the config field and the tensor or module, a config the engines would build
    a model from that the tensors do not fit."""
    _check_when_types(ckpt.config, m)
    experts, others = _experts(ckpt, m)
    if m.moe is not None:
        _check_expert_counts(ckpt.config, m, m.moe, experts)
        _check_moe_layers(ckpt.config, m, m.moe, experts, others)
    for lt in m.layer_types:
        if lt.holds:
            _check_layer_type(ckpt.config, m, lt, others)
    _check_lm_head(ckpt, m)


def _field(config: dict, m: Mapping, path: str, top_too: bool = False) -> _Field:
    where = f"{m.text_config}." if m.text_config else ""
    value = m.config_value(config, path)
    if value is None and top_too and m.text_config and path in config:
        return _Field(path, path, config[path])
    return _Field(path, f"{where}{path}", value)


def _check_when_types(config: dict, m: Mapping) -> None:
    """A group's config condition must meet a value of its own type: ``"false"`` is neither true nor false, and
    the engines (Python's truth) read a non-empty string as true while the plan would read it as neither."""
    for g in m.groups:
        for path, want in g.when:
            f = _field(config, m, path)
            if f.value is not None and type(f.value) is not type(want):
                expected = "true or false" if isinstance(want, bool) else f"a {type(want).__name__}"
                raise ConvertError(f"config.json: {f.shown} is {f.says()}, expected {expected}: mapping {m.name} "
                                   f"builds {g.name} of {', '.join(g.parents)} from it")


def _experts(ckpt: Checkpoint, m: Mapping) -> tuple[dict[str, dict[int, set[str]]], set[str]]:
    """Routed experts (experts module, without the text prefix -> expert index -> its modules' leaves) and
    every other module name (without the text prefix)."""
    sets = [template_regex(t) for t in m.expert_sets]
    is_set: dict[str, bool] = {}

    def under_set(mod: str) -> bool:
        hit = is_set.get(mod)
        if hit is None:
            hit = is_set[mod] = any(rx.fullmatch(mod) for rx in sets)
        return hit

    experts: dict[str, dict[int, set[str]]] = defaultdict(lambda: defaultdict(set))
    others: set[str] = set()
    banked: list[str] = []
    claimers, strays = encodings.claimers(), encodings.strays()
    for name in ckpt.tensors:
        short = m.strip(name)
        cut = short.rsplit(".", 3)
        if len(cut) == 4 and cut[1].isdigit() and cut[1].isascii() and under_set(cut[0]):
            experts[cut[0]][int(cut[1])].add(cut[2])
            continue
        mod = short.rpartition(".")[0]
        if (bank := m.stacked_tensor_bank(name)) is not None:
            # a stacked bank (``[stacked]``): every expert of its layer, as the engine's fused-MoE module holds them
            info = ckpt.tensors[name]
            if (why := m.stacked_error(name, info.shape, ckpt.config)) is not None:
                raise ConvertError(f"{info.file}: {why}")
            for e in range(info.shape[0]):
                experts[m.strip(stacked_experts_module(bank))][e].add(bank.rpartition(".")[2])
            continue
        # a tensor of the experts module itself: a 3-D bank (gpt-oss); or a bank split into experts held under
        # another module (Granite's input_linear into experts.N)
        if sets and (under_set(mod) or any(enc.splits_experts(name, ckpt.config)
                                           for enc in claimers.get(name.rpartition(".")[2], ()))):
            banked.append(name)
        else:
            others.add(mod)
    for name in banked:
        suffix = name.rpartition(".")[2]
        for enc in strays.get(suffix, ()):  # a bank's scales without its codes: the encoding's own words
            enc.refuse_leftover(name, ckpt.tensors)
        for c in next((cs for enc in claimers.get(suffix, ()) if (cs := enc.claim(name, ckpt.tensors, ckpt.config))),
                      ()):
            cut = m.strip(c.module).rsplit(".", 2)
            if len(cut) == 3 and cut[1].isdigit():
                experts[cut[0]][int(cut[1])].add(cut[2])
    return experts, others


def _int_field(config: dict, m: Mapping, path: str, low: int) -> _Field:
    f = _field(config, m, path)
    if f.value is not None and (type(f.value) is not int or f.value < low):
        raise ConvertError(f"config.json: {f.shown} is {f.says()}, expected an integer of at least {low}: "
                           f"mapping {m.name} reads it to build the routed experts")
    return f


def _check_expert_counts(config: dict, m: Mapping, moe: MoeCheck, experts: dict[str, dict[int, set[str]]]) -> None:
    """Every experts module holds experts 0..N-1 of the config's N, each with every member."""
    if not experts:
        return
    n = _int_field(config, m, moe.experts, 1)
    for mod in sorted(experts):
        held = experts[mod]
        if n.value is None:
            raise ConvertError(f"config.json: {n.shown} is absent, but {_full(m, mod)} holds {len(held)} routed "
                               "experts (the engines build the experts from it)")
        extra = sorted(i for i in held if i >= n.value)
        if extra:
            raise ConvertError(f"config.json: {n.shown} is {n.value}, but {_full(m, mod)}.{extra[0]} exists "
                               f"({len(held)} experts stored): the engines build {n.value} and would not load it")
        missing = sorted(set(range(n.value)) - set(held))
        if missing:
            raise ConvertError(f"config.json: {n.shown} is {n.value}, but {_full(m, mod)}.{missing[0]} is missing "
                               f"({_few(missing)} of {n.value} absent): the engines would leave it unset")
        for i in sorted(held):
            lacks = [x for x in moe.members if x not in held[i]]
            if lacks:
                raise ConvertError(f"{_full(m, mod)}.{i}.{lacks[0]} is missing: config.json's {n.shown} {n.value} "
                                   f"makes every routed expert hold {', '.join(moe.members)} (mapping {m.name})")


def _moe_rule(config: dict, m: Mapping, moe: MoeCheck) -> tuple:
    """The config fields deciding which decoder layers are MoE, checked for type."""
    below = _int_field(config, m, moe.dense_below, 0) if moe.dense_below else None
    every = _int_field(config, m, moe.every, 1) if moe.every else None
    step = _int_field(config, m, moe.sparse_step, 1) if moe.sparse_step else None
    dense = _field(config, m, moe.dense_list) if moe.dense_list else None
    if dense is not None and dense.value is not None and not (
            isinstance(dense.value, list) and all(type(i) is int for i in dense.value)):
        raise ConvertError(f"config.json: {dense.shown} is {dense.says()}, expected a list of layer numbers")
    flags = _field(config, m, moe.flags) if moe.flags else None
    if flags is not None and flags.value is not None and not (
            isinstance(flags.value, list) and all(type(f) is bool or f in (0, 1) for f in flags.value)):
        raise ConvertError(f"config.json: {flags.shown} is {flags.says()}, expected a list of 0/1 flags, one a layer")
    pattern = _field(config, m, moe.pattern) if moe.pattern else None
    if pattern is not None and pattern.value is not None and not isinstance(pattern.value, str):
        raise ConvertError(f"config.json: {pattern.shown} is {pattern.says()}, expected a string of one letter a "
                           f"layer ({moe.pattern_moe!r}: a MoE layer)")
    listed = _field(config, m, moe.moe_list) if moe.moe_list else None
    moe_layers = layer_numbers(listed.value) if listed is not None and listed.value is not None else None
    if listed is not None and listed.value is not None and moe_layers is None:
        raise ConvertError(f"config.json: {listed.shown} is {listed.says()}, expected the MoE layers' numbers (a "
                           "list, or one comma-separated string)")
    return below, every, step, dense, flags, (pattern, moe.pattern_moe), (listed, frozenset(moe_layers or ()))


def _dense_because(layer: int, rule: tuple) -> _Field | None:
    """The field that makes ``layer`` dense, or None when every rule says MoE (an absent field says MoE)."""
    below, every, step, dense, flags, (pattern, letter), (listed, moe_layers) = rule
    if listed is not None and listed.value is not None and layer not in moe_layers:
        return listed
    if below is not None and below.value is not None and layer < below.value:
        return below
    if every is not None and every.value is not None and layer % every.value:
        return every
    if step is not None and step.value is not None and (layer + 1) % step.value:
        return step
    if dense is not None and dense.value is not None and layer in dense.value:
        return dense
    if flags is not None and flags.value is not None and not (layer < len(flags.value) and flags.value[layer]):
        return flags
    if pattern is not None and isinstance(pattern.value, str) and pattern.value[layer:layer + 1] != letter:
        return pattern
    return None


def _check_moe_layers(config: dict, m: Mapping, moe: MoeCheck, experts: dict[str, dict[int, set[str]]],
                      others: set[str]) -> None:
    """A decoder layer holds routed experts exactly where the config makes it a MoE layer."""
    if not moe.layers:
        return
    rule = _moe_rule(config, m, moe)
    n = _field(config, m, moe.experts)
    count = _int_field(config, m, moe.num_layers, 0) if moe.num_layers else None
    layer_rx = re.compile(template_regex(moe.layers).pattern + r"\.")
    with_experts = {int(hit.group("layer")): mod for mod in experts if (hit := layer_rx.match(mod))}
    present = {int(hit.group("layer")) for mod in others if (hit := layer_rx.match(mod))} | set(with_experts)
    for layer in sorted(present):
        if count is not None and count.value is not None and layer >= count.value:
            continue  # an MTP layer past the decoder's: built apart, its experts counted above
        why = _dense_because(layer, rule) if n.value is not None else n
        mod = with_experts.get(layer)
        if mod is not None and why is not None:
            raise ConvertError(f"config.json: {why.shown} {why.says()} makes layer {layer} dense, but "
                               f"{_full(m, mod)} holds {len(experts[mod])} routed experts")
        if mod is None and why is None:
            where = moe.layers.replace("{layer}", str(layer))
            raise ConvertError(f"config.json: {n.shown} {n.value} makes layer {layer} a MoE layer, but "
                               f"{m.text_prefix}{where} holds no routed experts: the engines would leave them unset")


def _check_layer_type(config: dict, m: Mapping, lt: LayerType, others: set[str]) -> None:
    """A layer holding a module only this type has is listed as this type, and a listed layer holds one."""
    kinds = m.layer_kinds(config)
    f = _field(config, m, lt.config)
    holding: dict[int, str] = {}
    present: set[int] = set()
    for tmpl in lt.holds:
        rx = template_regex(tmpl)
        layer_rx = re.compile(template_regex(tmpl[: tmpl.index("{layer}") + len("{layer}")]).pattern + r"\.")
        for mod in others:
            if (hit := rx.fullmatch(mod)) is not None:
                holding.setdefault(int(hit.group("layer")), mod)
            if (hit := layer_rx.match(mod)) is not None:
                present.add(int(hit.group("layer")))
    for layer, mod in sorted(holding.items()):
        if kinds.get(layer) != lt.name:
            now = f"it is listed as {kinds[layer]}" if layer in kinds else "no layer list names it"
            raise ConvertError(f"config.json: {f.shown} leaves out layer {layer + lt.base}, but {m.text_prefix}{mod} "
                               f"is a {lt.name} module ({now}): the engines would build it as another layer")
    for layer in sorted(present):
        if kinds.get(layer) == lt.name and layer not in holding:
            what = " or ".join(t.replace("{layer}", str(layer)) for t in lt.holds)
            raise ConvertError(f"config.json: {f.shown} lists layer {layer + lt.base}, but {m.text_prefix}{what} "
                               f"is missing: the layer stores no {lt.name} module")


def _check_lm_head(ckpt: Checkpoint, m: Mapping) -> None:
    """An untied config needs the output head's weight: the engines build it apart from the embedding."""
    if m.lm_head is None:
        return
    tie = _field(ckpt.config, m, m.lm_head.tie, top_too=True)
    if tie.value is not None and not isinstance(tie.value, bool):
        raise ConvertError(f"config.json: {tie.shown} is {tie.says()}, expected true or false")
    name = f"{m.text_prefix}{m.lm_head.module}.weight"
    if tie.value is False and name not in ckpt.tensors:
        raise ConvertError(f"config.json: {tie.shown} is false, but the checkpoint has no {name}: the engines "
                           "build an untied output head and would leave it unset")


def _full(m: Mapping, short: str) -> str:
    return f"{m.text_prefix}{short}"


def _few(numbers: list[int]) -> str:
    shown = ", ".join(map(str, numbers[:5]))
    return f"experts {shown}{' ...' if len(numbers) > 5 else ''}"
