"""The command line's side of :class:`~.options.Options`: the click flags of ``plan`` and ``pack``, made from
the fields' metadata (plain data in ``options``, so the plan that records an ``Options`` never imports click),
and the value types they take: a size (``5GB``, ``2GiB``), a positive scale, a path checked before any work."""

from __future__ import annotations

import functools
import re
from dataclasses import fields
from typing import Any

import click

from . import paths
from .options import Options
from .schemes import scale_error

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)?\s*$", re.I)
_UNITS = {"": 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4,
          "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "TIB": 1024**4, "K": 1000, "M": 1000**2, "G": 1000**3}


def checked(check, *args):
    """A click callback running one of ``paths``' checks (or another), so a bad value is refused in
    the tool's one-line form before any work, never in click's own wording."""
    def callback(ctx: click.Context, param: click.Parameter, value):
        if value is None:
            return value
        for v in value if isinstance(value, tuple) else (value,):
            check(v, *args)
        return value
    return callback


class Size(click.ParamType):
    """A byte count: ``5GB``, ``500MB``, ``2GiB``, ``300KB`` or plain bytes (an int passes through)."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            size = value
        else:
            m = _SIZE.match(str(value))
            unit = (m.group(2) or "").upper() if m else None
            if not m or unit not in _UNITS:
                self.fail(f"{value!r} is not a size like 5GB, 500MB or 2GiB", param, ctx)
            size = int(float(m.group(1)) * _UNITS[unit])
        if size <= 0:
            self.fail(f"{value!r} is not a positive size", param, ctx)
        return size


class PositiveFloat(click.ParamType):
    """A positive number a constant F32 scale can hold (schemes.scale_error)."""

    name = "float"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            x = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if (why := scale_error(x)) is not None:
            self.fail(why, param, ctx)
        return x


SIZE = Size()


def _click_type(t: str | tuple[str, ...]) -> click.ParamType:
    """The click type of a field's ``type`` (``options._opt``): its choices, a size or a scale."""
    if isinstance(t, tuple):
        return click.Choice(t)
    return {"size": SIZE, "scale": PositiveFloat()}[t]


def _flag(name: str, meta) -> str:
    return meta["flag"] or "--" + name.replace("_", "-")


def click_options(command):
    """Adds every :class:`Options` field as a flag of ``command``, which receives them as one
    keyword argument, ``opts``."""
    @functools.wraps(command)
    def wrapper(*args, **kw):
        names = [f.name for f in fields(Options)]
        opts = Options.from_cli({n: kw.pop(n) for n in names})
        return command(*args, opts=opts, **kw)

    f: Any = wrapper
    for fl in reversed(fields(Options)):
        m = fl.metadata
        kw: dict[str, Any] = {"help": m["help"]}
        if isinstance(fl.default, bool):
            kw.update(is_flag=True, flag_value=not fl.default, default=fl.default)
        elif isinstance(fl.default, tuple):
            kw.update(multiple=True)
        else:
            kw.update(default=fl.default)
        for key in ("metavar", "show_default"):
            if m[key] is not None:
                kw[key] = m[key]
        if m["type"] is not None:
            kw["type"] = _click_type(m["type"])
        if m["check"]:
            name, what = m["check"]
            kw["callback"] = checked(getattr(paths, name), what)
        f = click.option(_flag(fl.name, m), fl.name, **kw)(f)
    return f
