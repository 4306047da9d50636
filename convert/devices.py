"""Which device each worker uses, decided without importing torch.

``pack`` plans and starts reading before torch loads (about a second, several on some machines),
and a GPU worker is a process of its own: the parent never needs torch, only how many GPUs there
are, which the CUDA driver answers directly (``cuDeviceGetCount``, honouring CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

import ctypes
import importlib.util
import re
from functools import cache
from pathlib import Path

from .errors import ConvertError

_CUDA = re.compile(r"^cuda(?::(\d+))?$")


@cache
def gpu_count() -> int:
    """GPUs the CUDA driver sees (0 without a driver)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    n = ctypes.c_int(0)
    if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(n)) != 0:
        return 0
    return n.value


@cache
def torch_has_cuda() -> bool:
    """Whether the installed torch is a CUDA build (its CUDA library is there), without importing it."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    return any((Path(p) / "lib" / "libtorch_cuda.so").exists() for p in spec.submodule_search_locations)


#: Every value --device takes, in the words of the error that lists them.
ACCEPTED = "auto, cpu, cuda, cuda:N, reference (the torch code), triton (the Triton kernel; on the CPU under " \
    "TRITON_INTERPRET=1)"


def valid(device: str) -> str:
    """``device`` if it is one of the accepted spellings (what the machine has is checked later)."""
    if device in ("auto", "cpu", "reference", "triton") or _CUDA.match(device):
        return device
    raise ConvertError(f"--device {device!r}: expected one of {ACCEPTED}")


def check(device: str) -> str:
    """The device with ``auto`` resolved: ``cuda`` when a GPU is visible and torch can use it, else
    ``cpu``."""
    if device == "auto":
        return "cuda" if gpu_count() and torch_has_cuda() else "cpu"
    if device in ("cpu", "reference", "triton"):
        return device
    m = _CUDA.match(valid(device))
    assert m is not None
    n = gpu_count()
    if n == 0:
        raise ConvertError(f"--device {device}: no CUDA device visible")
    if m.group(1) is not None and int(m.group(1)) >= n:
        raise ConvertError(f"--device {device}: only {n} CUDA device(s) visible")
    return device


def worker_devices(device: str, workers: int | None) -> list[str]:
    """One device per worker: ``cuda`` spreads workers over every visible GPU (one each by
    default), ``cuda:N`` puts them all on GPU N, the CPU backends give every worker the CPU."""
    device = check(device)
    if device != "cuda":
        return [device] * (workers or 1)
    n = gpu_count()
    return [f"cuda:{k % n}" for k in range(workers or n)]
