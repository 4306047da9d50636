"""A full-size source made small enough for the engines to build: fewer layers, experts and vocabulary, same structure.

The engines build the derivation's model at the config's size, so the released K3 (93 layers of 896 experts) cannot
be offered whole. What the table needs is each kind of layer once, an expert bank with its indices, and every
module's name; so the stand-in keeps:

- **layers**: the shortest prefix of the main layers that holds every kind of layer the source has (a kind is the
  set of a layer's tensor names with layer and expert numbers removed: DeepSeek's dense and MoE layers, K3's KDA and
  MLA layers), and every layer past ``num_hidden_layers`` (MTP), renumbered after the prefix. The config follows:
  ``num_hidden_layers``; a list as long as the layers (``layer_types``) cut to the prefix; a list of layer numbers
  (``kda_layers``, ``mlp_only_layers``) keeps those in the prefix, 1-based where the lists name the last layer and
  never 0;
- **experts**: the first ``n`` of each bank, ``n`` the smallest count that the router's groups allow for its top-k
  (``n_group`` groups of at least ``ceil(top_k / topk_group)``), at least ``top_k``; the router's rows and the
  correction bias cut alike (dimension 0 of a tensor under a ``gate`` / ``router`` module, or a
  ``e_score_correction_bias``, equal to the old count);
- **vocabulary**: 256 rows of every tensor whose first dimension is ``vocab_size``.

Widths stay as released (a width is shared by many tensors in ways only the engine knows). Pure: names and shapes.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass

EXPERT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts", "num_routed_experts")
TOPK_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_top_k")
GROUP_KEYS = ("n_group", "num_expert_group")
VOCAB = 256

_LAYER = re.compile(r"^(?P<pre>(?:.*\.)?layers\.)(?P<n>\d+)(?P<rest>\..*)$")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


@dataclass(frozen=True)
class Reduction:
    layers: int  # main layers kept (a prefix)
    mtp: int  # layers past num_hidden_layers kept, renumbered after the prefix
    experts: int | None  # experts kept per bank (None: no bank)
    vocab: int | None

    def describe(self, was: dict) -> str:
        parts = [f"{self.layers} of {was['layers']} layers"]
        if self.mtp:
            parts.append(f"{self.mtp} MTP layer(s)")
        if self.experts is not None:
            parts.append(f"{self.experts} of {was['experts']} experts a bank")
        if self.vocab is not None:
            parts.append(f"{self.vocab} of {was['vocab']} vocabulary rows")
        return ", ".join(parts)


def text_config(config: dict) -> dict:
    """The (nested) config that holds ``num_hidden_layers``: the text model's."""
    if "num_hidden_layers" in config:
        return config
    for v in config.values():
        if isinstance(v, dict) and "num_hidden_layers" in v:
            return v
    return config


def _kind(names: list[str]) -> frozenset[str]:
    return frozenset(_EXPERT.sub(".experts.#.", m.group("rest")) for n in names if (m := _LAYER.match(n)))


def _prefix(by_layer: dict[int, list[str]], main: int) -> int:
    kinds = {n: _kind(names) for n, names in by_layer.items() if n < main}
    wanted = set(kinds.values())
    seen: set = set()
    for k in range(main):
        seen.add(kinds.get(k, frozenset()))
        if wanted <= seen:
            return k + 1
    return main


def _expert_count(tc: dict) -> tuple[str | None, int | None, int]:
    key = next((k for k in EXPERT_KEYS if isinstance(tc.get(k), int) and tc[k] > 1), None)
    if key is None:
        return None, None, 0
    topk = next((tc[k] for k in TOPK_KEYS if isinstance(tc.get(k), int)), 1)
    groups = next((tc[k] for k in GROUP_KEYS if isinstance(tc.get(k), int) and tc[k] > 0), 1)
    per_group = math.ceil(topk / max(1, tc.get("topk_group") or 1)) if groups > 1 else topk
    n = max(topk, groups * max(1, per_group), 2)
    if n % groups:
        n += groups - n % groups
    return key, min(n, tc[key]), tc[key]


def _layer_lists(d: dict, old: int, keep: int) -> None:
    """Cut every list that describes the layers (see the module docstring), recursively."""
    lists = [(d, k) for k, v in d.items() if isinstance(v, list) and v and all(isinstance(x, int) for x in v)
             and "layer" in k]
    values = {x for t, k in lists for x in t[k]}
    base = 1 if (0 not in values and old in values) else 0
    for t, k in lists:
        t[k] = [x for x in t[k] if x - base < keep]
    for k, v in d.items():
        if isinstance(v, list) and len(v) == old and not all(isinstance(x, int) for x in v):
            d[k] = v[:keep]
        elif isinstance(v, dict):
            _layer_lists(v, old, keep)


def plan(config: dict, names: list[str]) -> Reduction:
    tc = text_config(config)
    main = int(tc.get("num_hidden_layers") or 0)
    by_layer: dict[int, list[str]] = {}
    for n in names:
        if m := _LAYER.match(n):
            by_layer.setdefault(int(m.group("n")), []).append(n)
    keep = _prefix(by_layer, main) if main else 0
    mtp = len([n for n in by_layer if n >= main]) if main else 0
    _, experts, _ = _expert_count(tc)
    vocab = VOCAB if isinstance(tc.get("vocab_size"), int) and tc["vocab_size"] > VOCAB else None
    return Reduction(keep, mtp, experts, vocab)


def _rename(name: str, main: int, keep: int) -> str | None:
    """The name in the reduced stand-in, None where it is dropped."""
    m = _LAYER.match(name)
    if m is not None:
        n = int(m.group("n"))
        if n >= main:
            n = keep + (n - main)
        elif n >= keep:
            return None
        name = f"{m.group('pre')}{n}{m.group('rest')}"
    return name


def apply(config: dict, tensors: list[tuple[str, tuple[int, ...], str]],
          r: Reduction) -> tuple[dict, list[tuple[str, tuple[int, ...], str]]]:
    """The reduced config and stand-in tensors (see the module docstring)."""
    config = copy.deepcopy(config)
    tc = text_config(config)
    main = int(tc.get("num_hidden_layers") or 0)
    key, experts, old_experts = _expert_count(tc)
    old_vocab = tc.get("vocab_size")
    out = []
    for name, shape, dtype in tensors:
        if (m := _EXPERT.search(name)) and experts is not None and int(m.group(1)) >= experts:
            continue
        new = _rename(name, main, r.layers) if main else name
        if new is None:
            continue
        shape = list(shape)
        if experts is not None and shape and shape[0] == old_experts and (
                re.search(r"(^|\.)(gate|router)(\.|$)", name) or name.endswith("e_score_correction_bias")
                or re.search(r"\.experts\.[^.\d]", name)):
            shape[0] = experts
        if r.vocab is not None and shape and shape[0] == old_vocab:
            shape[0] = r.vocab
        out.append((new, tuple(shape), dtype))
    if main:
        _layer_lists(tc, main, r.layers)
        tc["num_hidden_layers"] = r.layers
    if key is not None and experts is not None:
        tc[key] = experts
    if r.vocab is not None:
        tc["vocab_size"] = r.vocab
    return config, out
