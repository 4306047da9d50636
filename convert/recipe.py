"""Recipes as data: which quantization scheme each linear module gets, and the quantization config written.

A recipe (``recipes/*.toml``, or a file given with ``--recipe FILE``) is an ordered list of rules;
the first rule whose module globs match a linear module decides its scheme (the rule's ``format`` key, a name
kept for the recipe files; the output format is the recipe's ``output_format``):

- ``nvfp4``: packed E2M1 weight, e4m3 block scales, fp32 global scale (shared over the engine
  fusion group), and optionally a constant ``input_scale``;
- ``fp8-block``: e4m3 weight with one fp32 scale per 128x128 tile, weight only;
- ``keep``: the source precision (MXFP4 or FP8 sources are decoded to BF16; with the recipe's
  ``keep_stored = true`` copied as stored instead, weight and scale tensors under their own names).

The mapping still has the last word: modules the engines build unquantized are kept whatever a
recipe says, and user exclusions (``--exclude``) keep a module too (``keep.py``: every source of a keep,
in order). Module globs read as every pattern does (``globs.match``). Adding a recipe means adding a
file, not editing the pipeline.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from . import formats, globs, schemes, tomlfile
from .errors import ConvertError
from .mapping import builtin_tables
from .schemes import SchemeName, scale_error
from .vocabulary import Recipe, RecipeRule


def rule_for(recipe: Recipe, module: str, text_prefix: str, is_expert: bool) -> RecipeRule | None:
    """The recipe's first rule for this module (``text_prefix``: the mapping's, globs.match): the recipe decides
    in rule order, so the first match wins."""
    for r in recipe.rules:
        if r.experts and is_expert:
            return r
        if any(globs.match(p, module, text_prefix) for p in r.modules):
            return r
    return None


def _schema() -> tomlfile.Spec:
    """Every key a recipe may hold and what its value must be (tomlfile.validate, at load)."""
    t = tomlfile
    scale = t.Spec((int, float), "a positive number", check=lambda v: scale_error(v))
    rule = t.table({"modules": t.strs(), "experts": t.BOOL,
                    "format": t.one_of(tuple(s.value for s in SchemeName), "format"), "input_scale": scale,
                    "reason": t.STR}, ("format",))
    return t.table({
        "name": t.STR, "description": t.STR, "default_for": t.strs(),
        "output_format": t.one_of(tuple(sorted(formats.FORMATS)), "output_format"),
        "quant_method": t.STR, "quant_algo": t.STR, "aliases": t.BOOL, "keep_stored": t.BOOL,
        "rule": t.array_of(rule, "an array of tables ([[rule]])"),
        "config": t.table({"exclude_modules": t.strs()}),
    }, ("name",))


def _rule(r: object, where: str) -> RecipeRule:
    mods = r.get("modules", [])
    if isinstance(mods, str):
        mods = [mods]
    if not isinstance(mods, list) or not all(isinstance(m, str) for m in mods):
        raise ConvertError(f"{where}: 'modules' must be a list of globs")
    mods = [globs.check(m, f"{where}: modules[{i}]") for i, m in enumerate(mods)]
    experts = r.get("experts", False)
    if not isinstance(experts, bool) or (not mods and not experts):
        raise ConvertError(f"{where}: a rule needs 'modules' globs or 'experts = true'")
    try:
        scheme = SchemeName(r.get("format"))  # the file's key stays "format"
    except ValueError:
        raise ConvertError(f"{where}: 'format' must be one of {', '.join(s.value for s in SchemeName)}, "
                           f"not {r.get('format')!r}") from None
    scale = r.get("input_scale")
    if scale is not None:
        if not (schemes.quantized(scheme) and schemes.get(scheme).INPUT_SCALE):
            takes = ", ".join(n for n, s in schemes.SCHEMES.items() if s.INPUT_SCALE)
            raise ConvertError(f"{where}: 'input_scale' applies to the {takes} format only")
        scale = float(scale)  # the schema checked it (schemes.scale_error)
    return RecipeRule(tuple(mods), experts, scheme, scale, str(r.get("reason", "")))


def parse_recipe(text: str, path: str) -> Recipe:
    """Parse and validate one recipe; errors name the file and the key."""
    t = tomlfile.loads(text, path)
    tomlfile.validate(t, _schema(), path)
    name = t.get("name")
    if not isinstance(name, str) or not name:
        raise ConvertError(f"{path}: missing key 'name'")
    out_format = t.get("output_format", formats.DEFAULT)
    if out_format not in formats.FORMATS:
        raise ConvertError(f"{path}: output_format {out_format!r} is not known "
                           f"(known: {', '.join(sorted(formats.FORMATS))})")
    methods = formats.get(out_format).QUANT_METHODS
    method, algo = t.get("quant_method", "modelopt"), t.get("quant_algo", "W4A16_NVFP4")
    if algo not in methods.get(method, ()):
        raise ConvertError(f"{path}: quant_method {method!r} with quant_algo {algo!r} is not supported "
                           f"(supported: {', '.join(f'{m}/{a}' for m, s in methods.items() for a in sorted(s))})")
    rules = tuple(_rule(r, f"{path}: rule[{i}]") for i, r in enumerate(t.get("rule", [])))
    if not rules:
        raise ConvertError(f"{path}: a recipe needs at least one [[rule]]")
    refused = sorted({r.scheme.value for r in rules} - formats.get(out_format).KINDS)
    if refused:
        raise ConvertError(f"{path}: output_format {out_format!r} has no {', '.join(refused)} modules")
    bare = [i for i, r in enumerate(rules)
            if schemes.quantized(r.scheme) and schemes.get(r.scheme).INPUT_SCALE and r.input_scale is None]
    if method == "modelopt" and algo == "NVFP4" and bare:  # one W4A4 algo: every module's activations quantized
        raise ConvertError(f"{path}: rule[{bare[0]}]: quant_algo 'NVFP4' quantizes activations too (W4A4), so every "
                           "nvfp4 rule needs an 'input_scale' (or use quant_algo 'W4A16_NVFP4')")
    single = [r.scheme.value for r in rules
              if schemes.quantized(r.scheme) and algo not in schemes.spelling(r.scheme, out_format).algos]
    if method == "modelopt" and single:  # one quant_algo for every layer: a scheme it does not name needs the map
        raise ConvertError(f"{path}: {single[0]} modules need quant_method 'modelopt_mixed' (one quant_algo per layer)")
    cfg = t.get("config", {})
    if not isinstance(cfg, dict) or set(cfg) - {"exclude_modules"}:
        raise ConvertError(f"{path}: [config] takes only 'exclude_modules'")
    excl = cfg.get("exclude_modules")
    if excl is not None and not (isinstance(excl, list) and all(isinstance(x, str) for x in excl)):
        raise ConvertError(f"{path}: config.exclude_modules must be a list of strings")
    default_for = t.get("default_for", [])
    return Recipe(
        name=name,
        description=str(t.get("description", "")),
        default_for=tuple(default_for if isinstance(default_for, list) else [default_for]),
        quant_method=method,
        quant_algo=algo,
        aliases=bool(t.get("aliases", False)),
        exclude_modules=tuple(excl) if excl is not None else None,
        rules=rules,
        source=text,
        path=path,
        output_format=out_format,
        keep_stored=t.get("keep_stored", False),  # a bool: the schema checked it
    )


def with_format(recipe: Recipe, name: str | None) -> Recipe:
    """``pack --format NAME``: the recipe's rules in another output format (None or its own: unchanged).
    Into compressed-tensors: ModelOpt's W4A16_NVFP4 becomes the NVFP4A16 scheme and its constant
    ``input_scale`` values are dropped (ModelOpt writes 1.0 only because SGLang's ModelOpt MoE path multiplies
    it in; NVFP4A16 has no activation scale); NVFP4 stays NVFP4 with them."""
    if name is None or name == recipe.output_format:
        return recipe
    fmt = formats.get(name)
    algo = getattr(fmt, "FROM_MODELOPT", {}).get(recipe.quant_algo) if recipe.output_format == "modelopt" else None
    refused = sorted({r.scheme.value for r in recipe.rules} - fmt.KINDS)
    if algo is None or refused:
        why = f"it has {', '.join(refused)} modules" if refused else f"its quant_algo is {recipe.quant_algo}"
        raise ConvertError(f"--format {name}: recipe {recipe.name!r} cannot be written in it ({why})")
    rules = recipe.rules
    if algo == "NVFP4A16":
        rules = tuple(replace(r, input_scale=None) for r in rules)
    method = next(iter(fmt.QUANT_METHODS))
    return replace(recipe, output_format=name, quant_method=method, quant_algo=algo, rules=rules)


def builtin_recipes() -> list[Recipe]:
    return builtin_tables("recipes", parse_recipe)


def find_recipe(name_or_file: str | None, mapping_name: str) -> Recipe:
    """``--recipe NAME|FILE``, or the default recipe of the mapping (a specific one before ``*``)."""
    tables = builtin_recipes()
    if name_or_file is None:
        for wanted in (mapping_name, "*"):
            hit = next((r for r in tables if wanted in r.default_for), None)
            if hit is not None:
                return hit
        raise ConvertError(f"no default recipe for {mapping_name}; pass --recipe NAME|FILE")
    hit = next((r for r in tables if r.name == name_or_file), None)
    if hit is not None:
        return hit
    p = Path(name_or_file)
    if not p.exists():
        raise ConvertError(f"--recipe {name_or_file}: no such recipe or file "
                           f"(built-in: {', '.join(r.name for r in tables)})")
    return parse_recipe(tomlfile.read_toml_text(p, str(p)), str(p))
