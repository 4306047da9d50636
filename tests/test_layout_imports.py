"""Python run from the repository root: the top-level ``kernels/`` folder does not pass for the Hub's ``kernels``
package, which transformers probes (issue 26, item 7), and ``kimi_convert.kernels`` still imports there.

Each check runs in a child whose working directory is the repository root (``sys.path[0]`` is then the root, as
for ``python -c`` or ``python -m pytest`` there)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]

# What transformers' probe (utils/import_utils.py, _is_package_available("kernels", return_version=True)) reads:
# find_spec, then the distribution's metadata (transformers 4.x stops there: no metadata, absent), then
# (transformers 5.x) the imported module's __version__ and __file__ (neither: a namespace package, absent).
PROBE = """
import importlib, importlib.metadata, importlib.util, json
spec = importlib.util.find_spec("kernels")
out = {"found": spec is not None}
if spec is not None:
    out["origin"] = spec.origin
    out["locations"] = list(spec.submodule_search_locations or [])
    try:
        importlib.metadata.version("kernels")
        out["metadata"] = True
    except importlib.metadata.PackageNotFoundError:
        out["metadata"] = False
    m = importlib.import_module("kernels")
    out["file"] = getattr(m, "__file__", None)
    out["version"] = getattr(m, "__version__", None)
print(json.dumps(out))
"""


def _from_root(code: str, extra_path: Path | None = None) -> str:
    """stdout of ``python -c CODE`` run in the repository root (``extra_path``: put on PYTHONPATH, after it)."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if extra_path is not None:
        env["PYTHONPATH"] = str(extra_path)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


def _hub_kernels_installed() -> bool:
    """A real ``kernels`` distribution in this environment (then it, not the folder, is what the root finds)."""
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_kernels_folder_holds_no_module():
    assert not (ROOT / "kernels" / "__init__.py").exists()
    assert not [p.name for p in (ROOT / "kernels").iterdir() if p.suffix in (".py", ".so", ".pyc")]


def test_kernels_from_the_root_is_a_namespace_that_transformers_probe_takes_as_absent():
    if _hub_kernels_installed():
        pytest.skip("the Hub's kernels package is installed here: the probe finds it")
    out = json.loads(_from_root(PROBE))
    if not out["found"]:
        return  # nothing named kernels at all: absent for every probe
    assert out["origin"] is None and out["locations"] == [str(ROOT / "kernels")], out  # a namespace package
    assert out["metadata"] is False and out["file"] is None and out["version"] is None, out


def test_transformers_from_the_root_loads_its_models():
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed (not a test dependency): the probe's logic is checked above")
    if _hub_kernels_installed():
        pytest.skip("the Hub's kernels package is installed here: the probe finds it")
    # where kimi_convert is not installed (transformers' own environment) the old kernels/__init__.py made this
    # raise; where it is, the probe ran it as a second, top-level copy of kimi_convert.kernels
    out = _from_root("import sys, transformers\nfrom transformers.utils.import_utils import is_kernels_available\n"
                     "transformers.PreTrainedModel\n"
                     "print(is_kernels_available(), getattr(sys.modules.get('kernels'), '__file__', None))")
    assert out.split() == ["False", "None"], out


def test_an_installed_hub_kernels_still_wins_over_the_folder(tmp_path):
    hub = tmp_path / "site" / "kernels"
    hub.mkdir(parents=True)
    (hub / "__init__.py").write_text('__version__ = "0.12.0"\ndef get_kernel(name): return name\n')
    out = json.loads(_from_root(PROBE, extra_path=tmp_path / "site"))
    assert out["file"] == str(hub / "__init__.py") and out["version"] == "0.12.0", out


def test_kimi_convert_kernels_imports_from_the_root_with_its_c_sources():
    out = _from_root(
        "import sys, json\nfrom importlib import resources\n"
        "import kimi_convert.kernels as k\nfrom kimi_convert.kernels import nvfp4_cpu\n"
        "files = resources.files('kimi_convert.kernels')\n"
        "print(json.dumps({'backend': k.make_backend('reference').name, 'top_level': 'kernels' in sys.modules,\n"
        "  'c': sorted(n for n in ('kc_pool.c', 'nvfp4_cpu.c', 'recipe_cpu.c') if files.joinpath(n).is_file()),\n"
        "  'open_library': callable(nvfp4_cpu.open_library)}))")
    assert json.loads(out) == {"backend": "reference", "top_level": False,
                               "c": ["kc_pool.c", "nvfp4_cpu.c", "recipe_cpu.c"], "open_library": True}
