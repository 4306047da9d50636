"""Multi-token-prediction (MTP) layers: where they are, what each engine's speculative-decoding draft needs of them.

Most MoE releases store MTP layers that serving engines load as the speculative-decoding draft (vLLM's ``*MTP``
classes, SGLang's ``*NextN`` / ``*MTP`` models), while the main models drop them. A mapping table says, as data
(its ``[mtp]`` table, written by ``kimi-convert mapping derive`` from the engines' own draft classes, or by hand):

- **where** they are: ``prefix`` (``model.layers.{n}.`` for ``n`` from ``first`` (a config path, e.g.
  ``num_hidden_layers``, or a multiple of one: ``2 * num_layers``, LongCat-Flash's draft numbering) to
  ``first + count - 1``; or a block such as ``mtp.``) and ``count`` (config paths: the first present and positive
  counts the layers), or ``count_stored`` where no config key counts them (LongCat-Flash's and MiMo-V2-Flash's
  ``model.mtp.layers.{i}.``: the layers the checkpoint stores under the block are the ones there are);
- per engine (``[[mtp.draft]]``), what its draft model builds: the formats under which it builds the MTP layer's
  linear layers quantized (``quantized``; a draft that builds them unquantized under the output's format reads
  only the source's precision), the source modules it builds unquantized whatever the exclude list says
  (``unquantized``, per format), and the prefix under which it asks its quant method for each source module
  (``names``: [source module template, draft prefix template], ``{n}`` the MTP layer's number (``first`` + its
  index, also under a block prefix: DeepSeek V4's ``mtp.{i}.`` is vLLM's ``model.layers.{n}.``), ``{i}`` its index
  (0, 1, ...), ``{expert}`` an expert's): the exclude list names a kept module under those prefixes too, so that the
  draft's own matching (vLLM's ``Glm4MoeMTP`` has no ``packed_modules_mapping``, and builds the target's ``lm_head``
  as ``model.layers.{n}.head``) finds it; ``shadows`` (per format): [MTP source module template, main-model module
  template] pairs where the engines' exclusion matching cannot tell the draft's name of the kept MTP module from the
  main model's module (vLLM's ``MiniMaxM3MTP`` asks with ``model.layers.{i}.self_attn.qkv_proj``, which vLLM's
  substring rule and SGLang's rule after removing ``language_model.`` also read as the main model's layer ``{i}``):
  the main model's module is kept with it. ``absent``: the engine has no draft model for the architecture (SGLang
  0.5.23 and MiniMax M3): it reads no MTP layer, so it asks nothing of them.

The plan's rules (``plan/decide.py``, ``plan/names.py``): by default the MTP layers are kept as the source stores them
wherever an engine's draft cannot take them quantized under the output's format (as NVIDIA's converter keeps
DeepSeek V4's MTP experts); ``--quantize-mtp`` quantizes the MTP modules every draft builds quantized and keeps the
rest. Pure: no engine, no torch.
"""

from __future__ import annotations

import re
from collections.abc import Container, Iterable
from dataclasses import dataclass
from fnmatch import fnmatchcase

from .errors import ConvertError

_N = re.compile(r"\{n\}")
_FIRST = re.compile(r"^(?:(\d+)\s*\*\s*)?([A-Za-z_][\w.]*)$")  # ``path`` or ``k * path``


@dataclass(frozen=True)
class Draft:
    """One engine's draft model for the architecture, as the engine builds it."""

    engine: str
    model_class: str  # the class and file the engine builds (``vllm.model_executor.models.glm4_moe_mtp.Glm4MoeMTP``)
    quantized: tuple[str, ...]  # output formats under which it builds the MTP layer quantized
    unquantized: tuple[tuple[str, tuple[str, ...]], ...]  # (format, source module globs it builds unquantized)
    names: tuple[tuple[str, str], ...]  # (source module template, the draft's quant prefix template)
    from_target: tuple[str, ...]  # the draft's parameters the engine takes from the target model
    reason: str = ""
    # (format, ((MTP source module template, main-model module template), ...)): see the module docstring
    shadows: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()
    absent: bool = False  # the engine has no draft model for the architecture

    def keeps(self, fmt: str) -> tuple[str, ...]:
        return next((globs for f, globs in self.unquantized if f == fmt), ())

    def shadowed(self, fmt: str) -> tuple[tuple[str, str], ...]:
        return next((pairs for f, pairs in self.shadows if f == fmt), ())


@dataclass(frozen=True)
class Mtp:
    """Where a family's MTP layers are, and its engines' drafts."""

    prefix: str  # "model.layers.{n}." or "mtp."
    first: str  # config path of the first MTP layer's number ("" for 0)
    count: tuple[str, ...]  # config paths counting the MTP layers
    drafts: tuple[Draft, ...]
    reason: str = ""
    # (source module globs, reason): MTP modules the default leaves to the recipe although a draft builds them
    # unquantized, because keeping them breaks another check (a hand rule naming the failing engine check)
    quantize: tuple[tuple[str, ...], str] = ((), "")
    count_stored: bool = False  # no config key counts the layers: those stored under the block prefix are the count

    def layers(self, value, tensors: Iterable[str] = ()) -> int:
        """The number of MTP layers the config announces (``value(path)`` reads the text config), else with
        ``count_stored`` the number of layers ``tensors`` (the checkpoint's names) store under the block prefix."""
        if self.from_storage(value):
            return len(numbered_block(tensors, self.prefix))
        return self._config_count(value)

    def _config_count(self, value) -> int:
        """The first present and positive count path's value (0: none)."""
        for path in self.count:
            n = value(path)
            if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                return n
        return 0

    def from_storage(self, value) -> bool:
        """Whether the layers are counted from the storage: ``count_stored`` and no config key counts them."""
        return self.count_stored and "{n}" not in self.prefix and not self._config_count(value)

    def counted_by(self) -> str:
        """What counts the layers, for a message."""
        return " / ".join(self.count) or ("the layers stored under " + self.prefix if self.count_stored
                                          else "its MTP count")

    def first_number(self, value) -> int:
        """The first MTP layer's number: ``first`` read from the config (``k * path`` multiplied), 0 without it."""
        if not self.first:
            return 0
        k, path = first_parts(self.first)
        v = value(path)
        if not isinstance(v, int) or isinstance(v, bool):
            raise ConvertError(f"config.json: {path} must be an integer (the first MTP layer's number is "
                               f"{self.first})")
        return k * v

    def present(self) -> tuple[Draft, ...]:
        """The drafts the engines have (not ``absent``)."""
        return tuple(d for d in self.drafts if not d.absent)

    def layer_values(self, value, tensors: Iterable[str] = ()) -> tuple[dict[str, str], ...]:
        """Per MTP layer (:meth:`layers`), what its templates' ``{i}`` (its index) and ``{n}`` (``first`` + the
        index: its number where the prefix is ``model.layers.{n}.``, the draft's under a block prefix) stand for."""
        first = self.first_number(value)
        return tuple({"i": str(i), "n": str(first + i)} for i in range(self.layers(value, tensors)))

    def prefixes(self, value, tensors: Iterable[str] = ()) -> tuple[str, ...]:
        """The name prefixes of the MTP layers (:meth:`layers`)."""
        n = self.layers(value, tensors)
        if not _N.search(self.prefix):
            return (self.prefix,) if n else ()
        first = self.first_number(value)
        return tuple(self.prefix.replace("{n}", str(first + i)) for i in range(n))

    def pattern(self) -> re.Pattern[str]:
        """Names under the prefix, any ``{n}`` (group 1: its number)."""
        head, _, tail = self.prefix.partition("{n}")
        return re.compile(re.escape(head) + (r"(\d+)" + re.escape(tail) if "{n}" in self.prefix else ""))

    def stored(self, tensors, value) -> list[str]:
        """The stored names that are MTP layers whatever the config announces: under the block prefix, or under a
        layer numbered ``first`` or more (the decoder layers are numbered below it)."""
        rx = self.pattern()
        if "{n}" not in self.prefix:
            return [t for t in tensors if rx.match(t)]
        first = self.first_number(value)
        return [t for t in tensors if (h := rx.match(t)) and int(h.group(1)) >= first]


def first_parts(first: str) -> tuple[int, str]:
    """``first`` as (multiplier, config path): ``num_hidden_layers`` (1, ...), ``2 * num_layers`` (2, ...)."""
    hit = _FIRST.match(first.strip())
    if hit is None:
        raise ConvertError(f"[mtp] first = {first!r}: expected a config path or INTEGER * a config path")
    return int(hit.group(1) or 1), hit.group(2)


def numbered_block(tensors: Iterable[str], prefix: str) -> dict[int, str]:
    """The layer numbers stored under a block prefix (DeepSeek V4's ``mtp.0.``, Qwen3.5's and LongCat-Flash's
    ``...mtp.layers.0.``), each with the prefix its names spell it under."""
    rx = re.compile(re.escape(prefix) + r"((?:layers\.)?)(\d+)\.")
    found: dict[int, str] = {}
    for t in tensors:
        if h := rx.match(t):
            found.setdefault(int(h.group(2)), f"{prefix}{h.group(1)}")
    return found


def _strs(t: dict, key: str, where: str) -> tuple[str, ...]:
    v = t.get(key, [])
    v = [v] if isinstance(v, str) else v
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ConvertError(f"{where}: {key!r} must be a list of strings")
    return tuple(v)


def _pairs(t: dict, key: str, where: str) -> tuple[tuple[str, str], ...]:
    v = t.get(key, [])
    if not isinstance(v, list) or not all(isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p)
                                          for p in v):
        raise ConvertError(f"{where}: {key!r} must be a list of [source module, draft prefix] pairs")
    return tuple((a, b) for a, b in v)


DRAFT_KEYS = {"engine", "model_class", "quantized", "unquantized", "names", "from_target", "reason", "shadows",
              "absent"}
MTP_KEYS = {"prefix", "first", "count", "count_stored", "draft", "reason", "quantize", "quantize_reason"}


def _draft(t: object, where: str) -> Draft:
    if not isinstance(t, dict):
        raise ConvertError(f"{where}: must be a table")
    extra = sorted(set(t) - DRAFT_KEYS)
    if extra:
        raise ConvertError(f"{where}: unknown key(s) {', '.join(extra)} (allowed: {', '.join(sorted(DRAFT_KEYS))})")
    if t.get("engine") not in ("vllm", "sglang"):
        raise ConvertError(f"{where}: engine must be 'vllm' or 'sglang'")
    unq = t.get("unquantized", {})
    if not isinstance(unq, dict):
        raise ConvertError(f"{where}: 'unquantized' must be a table of format = [source module globs]")
    shadows = t.get("shadows", {})
    if not isinstance(shadows, dict):
        raise ConvertError(f"{where}: 'shadows' must be a table of format = [[MTP module, main module], ...]")
    if not isinstance(t.get("absent", False), bool):
        raise ConvertError(f"{where}: 'absent' must be true or false")
    return Draft(t["engine"], str(t.get("model_class", "")), _strs(t, "quantized", where),
                 tuple(sorted((f, _strs(unq, f, f"{where}.unquantized")) for f in unq)),
                 _pairs(t, "names", where), _strs(t, "from_target", where), str(t.get("reason", "")),
                 tuple(sorted((f, _pairs(shadows, f, f"{where}.shadows")) for f in shadows)),
                 bool(t.get("absent", False)))


def parse(t: object, where: str) -> Mtp | None:
    """A mapping table's ``[mtp]``."""
    if t is None:
        return None
    if not isinstance(t, dict):
        raise ConvertError(f"{where}: must be a table")
    extra = sorted(set(t) - MTP_KEYS)
    if extra:
        raise ConvertError(f"{where}: unknown key(s) {', '.join(extra)} (allowed: {', '.join(sorted(MTP_KEYS))})")
    prefix = t.get("prefix")
    if not isinstance(prefix, str) or not prefix.endswith("."):
        raise ConvertError(f"{where}: 'prefix' must be a name prefix ending in '.' (model.layers.{{n}}. or mtp.)")
    drafts = t.get("draft", [])
    if not isinstance(drafts, list):
        raise ConvertError(f"{where}: 'draft' must be an array of tables")
    stored = t.get("count_stored", False)
    if not isinstance(stored, bool) or (stored and "{n}" in prefix):
        raise ConvertError(f"{where}: 'count_stored' must be true or false, and only with a block prefix "
                           "(the layers stored under it are counted)")
    first = str(t.get("first", ""))
    if first:
        try:
            first_parts(first)
        except ConvertError as e:
            raise ConvertError(f"{where}: {e}") from None
    return Mtp(prefix, first, _strs(t, "count", where),
               tuple(_draft(d, f"{where}.draft[{i}]") for i, d in enumerate(drafts)), str(t.get("reason", "")),
               (_strs(t, "quantize", where), str(t.get("quantize_reason", ""))), stored)


def in_layers(module: str, prefixes: tuple[str, ...]) -> bool:
    return module.startswith(prefixes)


def _matches(template: str, module: str) -> dict[str, str] | None:
    """``{expert}`` (and any other ``{x}``) of a names template matched against ``module``: the values, or None."""
    parts = re.split(r"(\{\w+\})", template)
    rx = "".join(f"(?P<{p[1:-1]}>\\d+)" if p.startswith("{") else re.escape(p) for p in parts)
    hit = re.fullmatch(rx, module)
    return hit.groupdict() if hit else None


def _fill(template: str, values: dict[str, str]) -> str:
    for k, v in values.items():
        template = template.replace(f"{{{k}}}", v)
    return template


def draft_aliases(kept: set[str], present: set[str], mtp: Mtp, prefixes: tuple[str, ...],
                  layers: tuple[dict[str, str], ...]) -> list[str]:
    """The names the exclude list must also hold so that each engine's draft finds the kept modules: the draft's
    prefix of every source module it builds, where every source module it builds there is kept (a draft module
    built from kept and quantized modules is not excluded: the plan keeps an engine's packed module whole).
    ``layers``: ``Mtp.layer_values``, what ``{i}`` and ``{n}`` stand for in each MTP layer."""
    out: set[str] = set()
    in_mtp = sorted(x for x in present if x.startswith(prefixes))
    for d in mtp.present():
        sources: dict[str, set[str]] = {}
        for src_t, dst_t in d.names:
            for lv in layers:
                src_n = _fill(src_t, lv)
                for mod in (in_mtp if "{" in src_n else [src_n] if src_n in present else []):
                    vals = _matches(src_n, mod)
                    if vals is not None:
                        sources.setdefault(_fill(_fill(dst_t, lv), vals), set()).add(mod)
        out.update(dst for dst, mods in sources.items() if mods <= kept and dst not in present)
    return sorted(out)


def draft_keeps(mtp: Mtp, fmt: str) -> list[tuple[Draft, str]]:
    """(draft, glob) of the MTP modules some draft builds unquantized under ``fmt`` whatever the exclude list says."""
    return [(d, g) for d in mtp.present() for g in d.keeps(fmt)]


def decide(module: str, mtp: Mtp, prefixes: tuple[str, ...], fmt: str, quantize: bool,
           present: Container[str] = frozenset()) -> str | None:
    """Why MTP module ``module`` stays in the source's precision, or None (the recipe decides). Default: the whole
    MTP layer is kept where some engine's draft does not build it quantized under ``fmt``; ``quantize``
    (``--quantize-mtp``): only the modules a draft builds unquantized. A main-model module is kept where a draft's
    ``shadows`` pair it with an MTP module ``present`` (the checkpoint's modules): :func:`shadowed`."""
    if not in_layers(module, prefixes):
        return shadowed(module, mtp, fmt, present)
    if any(_glob(module, g) for g in mtp.quantize[0]):
        return None
    refusing = [d for d in mtp.present() if fmt not in d.quantized]
    if not quantize and refusing:
        d = refusing[0]
        return (f"MTP layer kept as the source stores it: {d.engine} {d.model_class} (its speculative-decoding "
                f"draft) builds it unquantized under a {fmt} config" + (f" ({d.reason})" if d.reason else ""))
    for d, g in draft_keeps(mtp, fmt):
        if _glob(module, g):
            return f"MTP module kept: {d.engine} {d.model_class} builds it unquantized under a {fmt} config"
    return None


def shadowed(module: str, mtp: Mtp, fmt: str, present: Container[str]) -> str | None:
    """Why main-model module ``module`` is kept with an MTP module: a draft's exclude entry for the kept MTP module
    is one the engines' exclusion matching also applies to ``module`` (the draft's ``shadows``), so both are kept
    or the main model would build ``module`` unquantized against its quantized tensors."""
    for d in mtp.present():
        for mtp_t, main_t in d.shadowed(fmt):
            vals = _matches(main_t, module)
            if vals is not None and _fill(mtp_t, vals) in present:
                return (f"kept with MTP module {_fill(mtp_t, vals)}: {d.engine} {d.model_class} asks for that module "
                        f"under a name the engines' exclusion matching also reads as this one ({d.reason})")
    return None


def _glob(module: str, template: str) -> bool:
    return fnmatchcase(module, template.replace("{n}", "*").replace("{i}", "*").replace("{expert}", "*"))


def check_layers(tensors: list[str], value, mtp: Mtp) -> None:
    """Bad input, before any work: a config that announces MTP layers the checkpoint lacks, or stores MTP layers
    the config does not announce (the engines' main models would then load them as decoder layers, or their drafts
    find nothing)."""
    prefixes = mtp.prefixes(value, tensors)
    count = mtp.counted_by()
    stored = mtp.from_storage(value)
    if stored and not prefixes:  # counted from the storage: block tensors, but no numbered layer among them
        stray = next((t for t in mtp.stored(tensors, value)), None)
        if stray is not None:
            raise ConvertError(f"{stray}: an MTP-layer tensor, but the checkpoint stores no numbered MTP layer under "
                               f"{mtp.prefix} ({mtp.prefix}layers.0.*), and config.json counts none")
        return
    for p in prefixes:
        if not any(t.startswith(p) for t in tensors):
            raise ConvertError(f"config.json: {count} announces MTP layer {p}* but the checkpoint stores no tensor "
                               "under it")
    stray = next((t for t in mtp.stored(tensors, value) if not t.startswith(prefixes)), None)
    if stray is not None:
        raise ConvertError(f"{stray}: an MTP-layer tensor, but config.json's {count} announces "
                           + (f"only {', '.join(prefixes)}" if prefixes else "no MTP layer"))
    if prefixes and "{n}" not in mtp.prefix:
        _check_numbered_block(tensors, mtp.prefix, mtp.layers(value, tensors), count, stored)


def _check_numbered_block(tensors: list[str], prefix: str, n: int, count: str, stored: bool = False) -> None:
    """A block prefix whose layers are numbered under it (DeepSeek V4's ``mtp.0.``, Qwen3.5's ``mtp.layers.0.``):
    the numbers stored must be the config's count, 0 to n - 1, or the drafts build more layers than the checkpoint
    fills (or leave some unloaded). Counted from the storage (``count_stored``), the numbers must still run from 0."""
    found = numbered_block(tensors, prefix)
    if not found:
        return
    head = next(iter(found.values()))
    lost = next((i for i in range(n) if i not in found), None)
    if lost is not None and stored:
        raise ConvertError(f"{head}: MTP layers stored as {', '.join(map(str, sorted(found)))}, no {lost}: their "
                           "numbers must run from 0 with no gap (the drafts number them so)")
    if lost is not None:
        raise ConvertError(f"config.json: {count} announces MTP layer {head}{lost}.* but the checkpoint stores no "
                           "tensor under it")
    extra = min((i for i in found if i >= n), default=None)
    if extra is not None:
        raise ConvertError(f"{found[extra]}{extra}.*: an MTP layer, but config.json's {count} announces only {n}")
