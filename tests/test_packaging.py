"""The wheel holds every package: setuptools installs only the packages pyproject.toml lists, so a new
sub-package of convert/ left out of that list imports in an editable install and fails in a wheel."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_every_package_folder_is_listed():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    folders = {"kimi_convert" + "".join(f".{p}" for p in d.relative_to(ROOT / "convert").parts)
               for d in (ROOT / "convert").rglob("__init__.py") for d in [d.parent]}
    assert folders - listed == set(), f"packages missing from pyproject.toml: {sorted(folders - listed)}"
