"""A folder whose ``kimi_convert`` is one checkout's code, all of it, for A/B runs with ``PYTHONPATH=DEST``.

    python benchmarks/import_tree.py CHECKOUT DEST      # then PYTHONPATH=DEST kimi-convert ...

``DEST/kimi_convert`` links each entry of ``CHECKOUT/convert/`` and the folders pyproject.toml maps into the package
(``kernels/src`` as ``kernels``, ``mappings``, ``recipes``, ``presets``). A link to ``convert/`` alone is not enough:
the editable install maps ``kimi_convert.kernels`` (and the tables) to the installed checkout's folders whatever
``PYTHONPATH`` says, so such an "old" tree ran the new C kernels and tables (session 36: benchmarks/RESULTS.md).
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path


def build(checkout: Path, dest: Path) -> Path:
    mapped = tomllib.loads((checkout / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    pkg = dest / "kimi_convert"
    pkg.mkdir(parents=True, exist_ok=True)
    for old in pkg.iterdir():
        old.unlink()
    for entry in sorted((checkout / mapped["kimi_convert"]).iterdir()):
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry.resolve())
    for name, folder in mapped.items():
        if name.startswith("kimi_convert."):
            link = pkg / name.removeprefix("kimi_convert.")
            link.unlink(missing_ok=True)
            link.symlink_to((checkout / folder).resolve())
    return dest


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    print(build(Path(sys.argv[1]), Path(sys.argv[2])))
