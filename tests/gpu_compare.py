"""What the GPU checks (tests/test_gpu.py, tests/test_gpu_kernels.py) compare, kept apart from the GPU so that a
CPU-only test (tests/test_gpu.py's unplanted/planted pairs) shows that each comparison does find a difference:
a GPU check that passes then means equal bytes, not a comparison that cannot fail."""

from __future__ import annotations

import filecmp
import importlib.util
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

#: The GPU checks' marks (a module's ``pytestmark``): ``gpu`` (``TRITON_INTERPRET= python -m pytest -m gpu`` on the
#: GPU machine: Triton compiled), skipped where torch has no CUDA device (CI).
GPU = [pytest.mark.gpu,
       pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU check: torch.cuda is not available here")]


def on_gpu(test):
    """One test's :data:`GPU` marks, in a module whose other tests run anywhere."""
    for mark in GPU:
        test = mark(test)
    return test


def files_under(folder: Path) -> list[str]:
    """Every file under ``folder``, sub-folders (docs/, manifest-records/) included, as sorted relative paths."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def differing_files(a: Path, b: Path) -> list[str]:
    """The files of two output folders that are not the same bytes: in one folder only, or other contents."""
    fa, fb = set(files_under(a)), set(files_under(b))
    return sorted((fa ^ fb) | {n for n in fa & fb if not filecmp.cmp(a / n, b / n, shallow=False)})


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes on the CPU, flat (any dtype, any device)."""
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)


def differing_tensors(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> list[int]:
    """The positions where two results' tensors hold other bytes (or another shape); a missing tensor counts."""
    if len(got) != len(want):
        return list(range(min(len(got), len(want)), max(len(got), len(want))))
    return [i for i, (g, w) in enumerate(zip(got, want, strict=True))
            if g.shape != w.shape or not torch.equal(as_bytes(g), as_bytes(w))]


def differing_tiles(got: torch.Tensor, want: torch.Tensor, got_scales: torch.Tensor, want_scales: torch.Tensor,
                    tile: int = 128) -> torch.Tensor:
    """Block FP8 of one band of ``tile`` rows: a bool a tile, True where its codes or its scale differ."""
    g = as_bytes(got).reshape(tile, -1, tile)
    w = as_bytes(want).reshape(tile, -1, tile)
    scales = (as_bytes(got_scales).reshape(-1, 4) != as_bytes(want_scales).reshape(-1, 4)).any(dim=1)
    return (g != w).any(dim=2).any(dim=0) | scales


def division_check():
    """benchmarks/gpu_division_check.py, loaded from its file (one kernel for its figure, which counts every
    divisor, and for the tests, which count a sample)."""
    path = Path(__file__).parents[1] / "benchmarks" / "gpu_division_check.py"
    spec = importlib.util.spec_from_file_location("gpu_division_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
