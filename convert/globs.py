"""Module globs: the one way every pattern of the tool selects source modules.

Every pattern (a mapping's ``linear``, ``not_linear``, ``keep``, ``restrict`` and ``exclude``, a recipe
rule's ``modules``, ``--exclude``, an ``--exclude-from`` file, an ``hf_quant_config.json``'s exclude list)
is a shell glob read the same way, by ``match``:

- a pattern with a dot is matched (``fnmatch``, case-sensitive; ``*`` crosses dots) against the module's
  full name, its tensor name (``NAME.weight``), and both without the mapping's text prefix
  (``language_model.``): ``model.layers.*.mlp.gate`` names every layer's router, with or without the prefix;
- a pattern without a dot (``lm_head``, ``*_conv1d``) is matched against each dot-separated part of the
  name as a whole: ``v_conv1d`` names every ``v_conv1d`` module and never ``qkv_conv1d`` (a substring test,
  vLLM's legacy one, takes both).

One text is not a selector of this tool and keeps the engines' reading: a recipe's ``[config]
exclude_modules``, written into the output's config as is (``engines.is_layer_skipped`` reads it back).
Here too live the checks every pattern gets (``check``) and the test of whether a pattern can tell two
routed experts apart (``index_blind``). A leaf: it imports nothing of the package but its error type.
"""

from __future__ import annotations

import functools
import re
from fnmatch import fnmatchcase, translate

from .errors import ConvertError


def match(pattern: str, module: str, text_prefix: str = "") -> bool:
    """Whether ``pattern`` selects the source module ``module`` (the semantics above)."""
    whole_part, rx = _compiled(pattern)
    if whole_part:
        return any(map(rx.match, module.split(".")))
    name = module + ".weight"
    if rx.match(name):
        return True
    return bool(text_prefix) and module.startswith(text_prefix) and rx.match(name, len(text_prefix)) is not None


@functools.lru_cache(maxsize=4096)
def _compiled(pattern: str) -> tuple[bool, re.Pattern[str]]:
    """A dotless pattern: fnmatch's own regex, for one name part. A dotted one: fnmatch's regex followed
    by an optional ``.weight``, tried on ``NAME.weight`` (from the start, and past the text prefix): it
    matches there exactly when the glob matches ``NAME`` or ``NAME.weight``; one regex call a name, not
    four (the plan asks for every module of the released K3: half a million)."""
    regex = translate(pattern)
    if "." not in pattern:
        return True, re.compile(regex)
    body = regex.removesuffix(r"\Z").removesuffix(r"\z")  # fnmatch ends its regex with an end anchor
    assert body != regex, regex
    return False, re.compile(rf"{body}(?:\.weight)?\Z")


def check(text: str, where: str) -> str:
    """A pattern as given (surrounding white space dropped), or one line naming ``where`` it came from
    (``FILE:LINE``, ``--exclude``, ``mappings/x.toml: keep[2]``) and what is wrong: a pattern that is
    empty, holds white space or has an unbalanced ``[`` is a typo that would silently select nothing."""
    text = text.strip()
    if not text:
        raise ConvertError(f"{where}: empty pattern")
    if any(c.isspace() for c in text):
        raise ConvertError(f"{where}: pattern {text!r} contains white space")
    if text.count("[") != text.count("]"):
        raise ConvertError(f"{where}: pattern {text!r} has an unbalanced '['")
    return text


def index_blind(glob: str) -> bool:
    """Whether a glob matches all expert indices alike (an index: ASCII digits between dots). It must
    have no ``?`` and no ``[...]`` class that takes a digit (fnmatch's own parsing), and each run of
    literal digits must touch a literal that is neither a digit nor a dot (``conv1d``, ``w13``): such a
    run cannot lie inside an index. Every other token is a ``*`` or matches only non-digits, so an index
    lies inside what one ``*`` matches, and another index matches the same way. Under ``match``'s reading
    of a dotless glob (each name part whole) this still holds: such a glob is all ``*`` (it takes every
    part) or has a token no digit matches (it takes no index part)."""
    tokens: list[str | None] = []  # literal characters; None for a '*' or a class
    i, n = 0, len(glob)
    while i < n:
        c = glob[i]
        i += 1
        if c == "?":
            return False
        if c == "[":
            j = i
            if j < n and glob[j] == "!":
                j += 1
            if j < n and glob[j] == "]":
                j += 1
            while j < n and glob[j] != "]":
                j += 1
            if j < n:  # a class (else '[' is a literal)
                if any(fnmatchcase(d, glob[i - 1 : j + 1]) for d in "0123456789"):
                    return False
                tokens.append(None)
                i = j + 1
                continue
        tokens.append(None if c == "*" else c)

    def digit(k: int) -> bool:
        return 0 <= k < len(tokens) and tokens[k] is not None and tokens[k] in "0123456789"

    def stops(k: int) -> bool:  # a literal an index cannot contain or end at
        return 0 <= k < len(tokens) and tokens[k] is not None and not digit(k) and tokens[k] != "."

    for k in range(len(tokens)):
        if digit(k) and not digit(k - 1):
            end = k
            while digit(end):
                end += 1
            if not (stops(k - 1) or stops(end)):
                return False
    return True
