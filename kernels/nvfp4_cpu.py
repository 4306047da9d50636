"""The fast CPU path: ``nvfp4_cpu.c`` built at first use with the system C compiler, called via ctypes.

The shared library is cached per source, flags and compiler (``$KIMI_CONVERT_CACHE`` or
``~/.cache/kimi-convert``), written under a temporary name and renamed, so concurrent first uses
are safe. Without a compiler, :func:`load` returns None and the caller falls back to the torch
reference (same bytes, slower) with a warning.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from importlib import resources
from pathlib import Path

import torch

FLAGS = ["-O3", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math"]
#: Elements below which one thread does the whole tensor.
MIN_SPLIT = 1 << 16


def _cache_dir() -> Path:
    root = os.environ.get("KIMI_CONVERT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kimi-convert")
    return Path(root)


def _compiler() -> str | None:
    return os.environ.get("KIMI_CONVERT_CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _build(src: bytes, cc: str, stem: str = "nvfp4_cpu") -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(src + " ".join(FLAGS).encode() + version.encode()).hexdigest()[:16]
    out = _cache_dir() / f"{stem}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        c = Path(tmp) / f"{stem}.c"
        c.write_bytes(src)
        so = Path(tmp) / "out.so"
        r = subprocess.run([cc, *FLAGS, str(c), "-o", str(so)], capture_output=True, text=True)
        if r.returncode:
            raise OSError(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "compiler failed")
        os.replace(so, out)
    return out


_LOAD_LOCK = threading.Lock()


def open_library(stem: str, what: str) -> ctypes.CDLL | None:
    """``kernels/STEM.c`` built (or taken from the cache) and loaded, or None where it cannot be, said
    in one line on stderr like the CLI's other warnings (a UserWarning prints a source line too).
    Serialized: pack's warm-up thread and its streams ask at once, and each library is built once."""
    with _LOAD_LOCK:
        return _open_library(stem, what)


@cache
def _open_library(stem: str, what: str) -> ctypes.CDLL | None:
    cc = _compiler()
    src = resources.files("kimi_convert.kernels").joinpath(f"{stem}.c").read_bytes()
    try:
        if cc is None:
            raise OSError("no C compiler (cc, gcc or clang) on PATH")
        return ctypes.CDLL(str(_build(src, cc, stem)))
    except OSError as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"kimi-convert: warning: {what} unavailable ({reason}); using the torch code (same bytes, slower)",
              file=sys.stderr, flush=True)
        return None


@cache
def load() -> ctypes.CDLL | None:
    """The NVFP4 kernels, argument types set (None: the caller falls back to the torch reference)."""
    lib = open_library("nvfp4_cpu", "fast CPU kernel")
    if lib is None:
        return None
    i64, f32, p = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    lib.kc_amax_bf16.argtypes = lib.kc_amax_f32.argtypes = [p, i64]
    lib.kc_amax_bf16.restype = lib.kc_amax_f32.restype = ctypes.c_uint32
    lib.kc_quant_bf16.argtypes = lib.kc_quant_f32.argtypes = [p, i64, i64, f32, p, p]
    return lib


@cache
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kimi-convert-cpu")


def _split(rows: int, k: int, threads: int) -> list[tuple[int, int]]:
    """Row ranges, one a thread (ctypes releases the GIL while the C code runs)."""
    n = 1 if rows * k < MIN_SPLIT else max(1, min(threads, rows))
    step = -(-rows // n)
    return [(i, min(rows, i + step)) for i in range(0, rows, step)]


def _prepare(x: torch.Tensor) -> torch.Tensor:
    """bf16 and fp32 go in as they are; fp16 (rare) is widened to fp32, which is exact."""
    x = x.contiguous()
    return x if x.dtype in (torch.bfloat16, torch.float32) else x.float()


def amax(lib: ctypes.CDLL, x: torch.Tensor, threads: int) -> torch.Tensor:
    x = _prepare(x).reshape(-1)
    fn = lib.kc_amax_bf16 if x.dtype == torch.bfloat16 else lib.kc_amax_f32
    size = x.element_size()
    parts = _split(x.numel(), 1, threads) if x.numel() else []
    bits = max(_pool(threads).map(lambda r: fn(x.data_ptr() + r[0] * size, r[1] - r[0]), parts), default=0)
    return torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32).reshape(())


def quantize(lib: ctypes.CDLL, x: torch.Tensor, s2: torch.Tensor, threads: int) -> tuple[torch.Tensor, torch.Tensor]:
    k = x.shape[-1]
    x2 = _prepare(x).reshape(-1, k)
    m = x2.shape[0]
    packed = torch.empty((m, k // 2), dtype=torch.uint8)
    scales = torch.empty((m, k // 16), dtype=torch.uint8)
    fn = lib.kc_quant_bf16 if x2.dtype == torch.bfloat16 else lib.kc_quant_f32
    size, s2f = x2.element_size(), float(s2)

    def run(r: tuple[int, int]) -> None:
        a, b = r
        fn(x2.data_ptr() + a * k * size, b - a, k, s2f, packed.data_ptr() + a * (k // 2),
           scales.data_ptr() + a * (k // 16))
    if m:
        list(_pool(threads).map(run, _split(m, k, threads)))
    lead = x.shape[:-1]
    return packed.reshape(*lead, k // 2), scales.view(torch.float8_e4m3fn).reshape(*lead, k // 16)
