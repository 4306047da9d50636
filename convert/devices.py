"""Which device each worker uses, and how many CPUs, decided without importing torch.

``pack`` plans and starts reading before torch loads (about a second, several on some machines),
and a GPU worker is a process of its own: the parent never needs torch, only how many GPUs there
are, which the CUDA driver answers directly (``cuDeviceGetCount``, honouring CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import ConvertError

if TYPE_CHECKING:
    from .kernels import Backend


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
_DEVICE = re.compile(r"^(auto|cpu|reference|triton|cuda)(?::(\d+))?$")


@dataclass(frozen=True)
class Device:
    """A resolved ``--device``: ``cpu`` (the C kernel), ``cuda`` (the Triton kernel on a GPU),
    ``auto`` (a GPU and the CPUs both usable: a pipeline measures which is faster for each kind of work,
    ``pipeline.choose``; anything else uses the GPU), ``reference`` (the torch code) or ``triton`` (the
    Triton kernel; on the CPU under TRITON_INTERPRET=1). ``index``: cuda's (or auto's) GPU; None: the
    workers spread over every visible GPU (one backend alone: the current GPU)."""

    kind: str
    index: int | None = None

    def __str__(self) -> str:
        return self.kind if self.index is None else f"{self.kind}:{self.index}"


def _parse(text: str) -> tuple[str, int | None]:
    m = _DEVICE.match(text)
    if m is None or (m.group(2) is not None and m.group(1) != "cuda"):
        raise ConvertError(f"--device {text!r}: expected one of {ACCEPTED}")
    return m.group(1), None if m.group(2) is None else int(m.group(2))


def valid(text: str) -> str:
    """``text`` if it is one of the accepted spellings (what the machine has is checked by
    :func:`resolve_device`, where the device is used)."""
    _parse(text)
    return text


def resolve_device(text: str | Device) -> Device:
    """The one reading of ``--device``: ``cuda[:N]`` needs that GPU visible to the CUDA driver and a
    CUDA build of torch; ``auto`` stays ``auto`` where that holds (the GPU or the CPUs, whichever a
    measurement finds faster: ``pipeline.choose``), else it is ``cpu``."""
    if isinstance(text, Device):
        return text
    kind, index = _parse(text)
    if kind == "auto":
        return Device("auto" if gpu_count() and torch_has_cuda() else "cpu")
    if kind == "cuda":
        n = gpu_count()
        if n == 0:
            raise ConvertError(f"--device {text}: no CUDA device visible")
        if index is not None and index >= n:
            raise ConvertError(f"--device {text}: only {n} CUDA device(s) visible")
        if not torch_has_cuda():
            raise ConvertError(f"--device {text}: the installed torch is not a CUDA build")
    return Device(kind, index)


def gpus_at_most(root: Path = Path("/proc/driver/nvidia/gpus")) -> int | None:
    """An upper bound on the GPUs the CUDA driver would see, without starting it (``cuInit`` takes most of a
    second): the GPUs the kernel driver lists (``/proc/driver/nvidia/gpus``, none without the driver),
    fewer where ``CUDA_VISIBLE_DEVICES`` names fewer; None where it cannot say."""
    try:
        listed = len(list(root.iterdir())) if root.is_dir() else 0
    except OSError:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return listed
    return min(listed, len([v for v in visible.split(",") if v.strip()]))


def _one_auto_worker(device: str | Device, workers: int | None) -> Device | None:
    """``auto``'s one worker where the answer needs no driver start: no GPU listed, or a CPU build of torch, is
    ``cpu``; at most one GPU is ``auto`` on GPU 0 left to confirm (``gpu_count``) where the worker makes its
    backends, off the pipeline's way (``pipeline.runner.candidates``). None: ask the driver."""
    if str(device) != "auto" or workers not in (None, 1):
        return None
    if not torch_has_cuda():
        return Device("cpu")
    bound = gpus_at_most()
    if bound is None or bound > 1:
        return None
    return Device("cpu") if bound == 0 else Device("auto", 0)


def worker_devices(device: str | Device, workers: int | None) -> list[Device]:
    """One device per worker: ``cuda`` (and ``auto`` with a GPU) spreads workers over every visible
    GPU (one each by default), ``cuda:N`` puts them all on GPU N, the CPU backends give every worker
    the CPU."""
    if (one := _one_auto_worker(device, workers)) is not None:
        return [one]
    device = resolve_device(device)
    if device.kind not in ("cuda", "auto") or device.index is not None:
        return [device] * (workers or 1)
    n = gpu_count()
    return [Device(device.kind, k % n) for k in range(workers or n)]


def cpus() -> int:
    """CPUs this process may use: ``$KIMI_CONVERT_THREADS`` when set, else its affinity mask. The
    one count behind every default (workers' shares, streams, hashing and C-kernel threads), passed
    on as an argument."""
    env = os.environ.get("KIMI_CONVERT_THREADS", "").strip()
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            raise ConvertError(f"KIMI_CONVERT_THREADS={env!r}: expected a number of threads") from None
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def get_backend(device: Device | str = "auto", threads: int | None = None) -> Backend:
    """The kernels' backend of a device (a string is resolved by ``resolve_device``: ``auto``, ``cpu``,
    ``cuda[:N]``, ``reference``, ``triton``). ``threads``: the C kernel's threads (default: ``cpus()``). Here, not
    in the kernels: the spelling of ``--device`` and what the machine has are the application's; the kernels take
    the resolved device (``kernels.make_backend``)."""
    from .kernels import make_backend

    device = resolve_device(device)
    return make_backend(device.kind, device.index, threads or cpus())
