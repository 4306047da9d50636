"""``kimi-convert plan``'s text: every module with its decision, sources and shard, a MoE layer's alike
routed experts folded into one entry per bank (``plan --json`` is the plan's serialization, in
``serialize.plan_json``)."""

from __future__ import annotations

from .. import encodings, schemes, sidefiles
from .model import Encoding, Kind, Op, Plan


def mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


def _shape(dtype: str, shape) -> str:
    return f"{dtype}[{','.join(map(str, shape))}]"


def render(p: Plan, input_dir: str) -> str:
    """Every module with its decision and sources; a MoE layer's routed experts as banks: the experts whose
    lines differ only in their index are one entry (the index written {e}, then which experts). ``--json``
    lists every module (the released K3: 250,000 modules, a million lines of text)."""
    o = p.outline
    shard_of = p.shard_of() if any(not u.shard for u in o.units) else None
    lines: list[str | _Bank] = [
        f"plan for {input_dir} (mapping {p.mapping.name}, {p.mapping.path}, sha256 {p.mapping.sha256[:12]})",
        f"recipe {p.recipe.name} ({p.recipe.path}): {p.recipe.description}",
        f"layout {p.options.layout}; quantization_config: {p.recipe.quant_method} / {p.recipe.quant_algo}",
        *(f"note: {n}" for n in p.notes), ""]
    expert = _expert_index(p.mapping)
    banks: dict[tuple[str, ...], _Bank] = {}
    for u in o.units:
        for it in u.items:
            shard = shard_of[it.outputs[0].name] if shard_of else u.shard
            where = expert(it.name)
            if where is None:
                lines += _item_lines(it, u.shared_scale, shard)
                continue
            tag, norm = f"{where[0]}.{where[1]}.", f"{where[0]}.{{e}}."
            cut = f"[{where[1]}]"  # a part narrowed to the expert from a 3-D bank (encodings.narrow)

            def n(x: str, tag: str = tag, norm: str = norm, cut: str = cut) -> str:
                return x.replace(tag, norm).replace(cut, "[{e}]")

            # what _item_lines shows, the index written {e}: experts alike by it are alike in their lines
            key = (it.kind, it.op, n(it.rule), n(it.name), n(u.shared_scale or ""), n(shard),
                   n(it.outputs[0].name), *((t.dtype, t.shape) for t in it.outputs), None,
                   *((n(s.name), s.encoding, n(s.file), s.dtype, s.shape, s.view,
                      *((n(x.name), n(x.file)) for x in s.parts), None)
                     for s in it.sources))
            bank = banks.get(key)
            if bank is None:
                item = _item_lines(it, u.shared_scale, shard)
                bank = banks[key] = _Bank(tuple(n(x) for x in item))
                lines.append(bank)
            bank.experts += o.experts(*where)
    if o.engine_groups:
        lines += ["", "engine packed modules (stored apart; quantized members share one global scale):"]
        for g in o.engine_groups:
            rows = ", ".join(f"{mod.rsplit('.', 1)[-1]} {a}:{b}" for mod, (a, b) in zip(g.members, g.rows, strict=True))
            _add(lines, banks, [f"  {g.name} [{', '.join(g.engines)}]: {rows}"], expert(g.members[0]), o)
    lines = [x for line in lines for x in (line.lines() if isinstance(line, _Bank) else (line,))]
    t = o.kinds
    lines += [
        "",
        "totals: " + "".join(f"{t[n]} {s.TITLE} modules, " for n, s in schemes.SCHEMES.items())
        + f"{t['keep']} kept linear modules, {t['copy']} tensors copied",
        f"bytes in {o.bytes_in} ({mb(o.bytes_in)}), bytes out {o.bytes_out} ({mb(o.bytes_out)}) "
        f"in {o.shards} shard(s)",
        f"exclude list: {len(p.exclude_modules)} names (hf_quant_config.json exclude_modules, config.json ignore)",
    ]
    return "\n".join([*lines, *sidefiles.render(p.side_files, p.side_folders, p.skipped_files)])


def _item_lines(it, shared_scale: str | None, shard: str) -> list[str]:
    srcs = ", ".join(_shape(s.dtype, s.shape) for s in it.sources)
    out = " + ".join(_shape(t.dtype, t.shape) for t in it.outputs)
    lines = [f"{it.kind:9} {it.name}  {out}  -> {shard}"]
    if it.kind != Kind.COPY:
        extra = f"; shared scale {shared_scale}" if shared_scale else ""
        lines.append(f"        why: {it.rule}{extra}")
    if (it.op != Op.NONE or it.sources[0].name != it.outputs[0].name or it.sources[0].encoding != Encoding.DENSE
            or it.sources[0].view or '[' in it.sources[0].parts[0].name):
        lines.append(f"        from {it.op}({srcs})" if it.op != Op.NONE else f"        from {srcs}")
        for s, (a, b) in zip(it.sources, it.row_ranges(), strict=True):
            narrowed = s.parts[0].name != encodings.stored_name(s.parts[0])  # shown: it is not s.name's stored tensor
            extra = "".join(f" + {x.name} ({x.file})" for x in s.parts[0 if narrowed else 1:])
            view = "".join(f" [dim {v.dim} {v.start}:{'' if v.stop is None else v.stop}:{v.step}]" for v in s.view)
            lines.append(f"          rows {a}:{b} <- {s.name}{view} [{s.encoding}] ({s.file}){extra}")
    return lines


class _Bank:
    """Routed experts whose plan lines are the same but for their index."""

    def __init__(self, lines: tuple[str, ...]):
        self.text, self.experts = lines, []

    def lines(self) -> list[str]:
        runs: list[list[int]] = []
        for e in sorted(set(self.experts)):
            if runs and e == runs[-1][1] + 1:
                runs[-1][1] = e
            else:
                runs.append([e, e])
        which = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)
        n = len(self.experts)
        return [self.text[0], f"{' ' * 8 if self.text[0][:1] != ' ' else '    '}for e in {which} "
                              f"({n} module{'s' if n > 1 else ''})", *self.text[1:]]


def _add(lines: list, banks: dict, item: list[str], expert: tuple[str, str] | None, o) -> None:
    if expert is None:
        lines += item
        return
    prefix, e = expert
    key = ("", *(x.replace(f"{prefix}.{e}.", f"{prefix}.{{e}}.") for x in item))
    bank = banks.get(key)
    if bank is None:
        bank = banks[key] = _Bank(key[1:])
        lines.append(bank)
    bank.experts += o.experts(prefix, e)


def _expert_index(m):
    """name -> (the name up to its expert index, the index) for routed expert modules (and the names
    under them); None for others."""
    rxs = m.expert_regexes(modules=False)

    def find(name: str) -> tuple[str, str] | None:
        short = m.strip(name)
        for rx in rxs:
            hit = rx.match(short)
            if hit is not None:
                a, b = hit.span("_expert_index")
                off = len(name) - len(short)
                return name[: off + a - 1], name[off + a : off + b]
        return None
    return find
