"""The ctypes side of the CPU kernels, without torch: each C library built at first use with the system C
compiler and loaded, and the NVFP4 kernels' calls on raw buffers (numpy arrays).

Each library is ``kc_pool.c`` (a persistent pthread pool) followed by the kernel's file: one ctypes call runs a
whole kernel on the caller's ``threads`` (the pool splits the rows), instead of one call a thread from a Python
thread pool, whose dispatch cost tens of microseconds a call (docs/history/RESULTS-history.md, "C kernels, second
pass").
The shared library is cached per source, flags and compiler (``$KIMI_CONVERT_CACHE`` or
``~/.cache/kimi-convert``), written under a temporary name and renamed, so concurrent first uses
are safe. Without a compiler, :func:`load` returns None and the caller falls back to the torch
reference (same bytes, slower) with a warning.

Why no torch here: pack computes its first units while torch loads (3.6-5 s on the H200 machine, on the critical
path of a one-file input: docs/compressed-tensors.md), through these calls (``pipeline.early``); ``nvfp4_cpu``
wraps the same calls for torch tensors.
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
from functools import cache
from importlib import resources
from pathlib import Path

FLAGS = ["-O3", "-fPIC", "-shared", "-pthread", "-ffp-contract=off", "-fno-fast-math"]


def _cache_dir() -> Path:
    root = os.environ.get("KIMI_CONVERT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kimi-convert")
    return Path(root)


def _compiler() -> str | None:
    return os.environ.get("KIMI_CONVERT_CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def build(src: bytes, cc: str, stem: str = "nvfp4_cpu") -> Path:
    """The shared library of C source ``src`` built with ``cc``, cached under a key of the source, the flags and
    the compiler's version (so an edit or another compiler builds anew); public for ``nvfp4_cpu``, which names it
    among its own, and the tests of a build that fails."""
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
#: The pool workers' nice value, set as each library loads: 0 (the process's own) until a benchmark shows a
#: better one (benchmarks/ct_profile.py's ``knice=``: the kernels' bursts on every CPU against a file's one
#: sha256 chain, the stream's floor on a large one-file input)
KERNEL_NICE = 0
#: How long an idle pool worker polls before it sleeps, ns (``kc_pool_set_spin``); None: the C default, 100 us
#: (``ct_profile.py``'s ``kspin=``, measured against the same chain)
KERNEL_SPIN_NS: int | None = None


def open_library(stem: str, what: str) -> ctypes.CDLL | None:
    """``kernels/src/STEM.c`` (package data of ``kimi_convert.kernels``) built (or taken from the cache) and
    loaded, or None where it cannot be, said in one line on stderr like the CLI's other warnings (a UserWarning
    prints a source line too).
    Serialized: pack's warm-up thread and its streams ask at once, and each library is built once."""
    with _LOAD_LOCK:
        return _open_library(stem, what)


@cache
def _open_library(stem: str, what: str) -> ctypes.CDLL | None:
    cc = _compiler()
    files = resources.files("kimi_convert.kernels")
    src = b"".join(b'#line 1 "%s.c"\n' % name.encode() + files.joinpath(f"{name}.c").read_bytes()
                   for name in ("kc_pool", stem))
    try:
        if cc is None:
            raise OSError("no C compiler (cc, gcc or clang) on PATH")
        return ctypes.CDLL(str(build(src, cc, stem)))
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
    i32, i64, f32, p = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    lib.kc_amax_bf16_mt.argtypes = lib.kc_amax_f32_mt.argtypes = [p, i64, i32]
    lib.kc_amax_bf16_mt.restype = lib.kc_amax_f32_mt.restype = ctypes.c_uint32
    lib.kc_quant_bf16_mt.argtypes = lib.kc_quant_f32_mt.argtypes = [p, i64, i64, f32, p, p, i32]
    lib.kc_ct_quant_mt.argtypes = [p, i64, i64, f32, i32, p, p, i32]
    lib.kc_ct_quant_mt.restype = None
    lib.kc_int4_amax_mt.argtypes = [p, p, i64, i64, i64, i32]
    lib.kc_int4_amax_mt.restype = ctypes.c_uint32
    lib.kc_int4_quant_mt.argtypes = [p, p, i64, i64, i64, f32, i32, p, p, i32]
    lib.kc_int4_quant_mt.restype = None
    lib.kc_fp8_amax_mt.argtypes = [p, p, i64, i64, i64, i64, i32]
    lib.kc_fp8_amax_mt.restype = ctypes.c_uint32
    lib.kc_fp8_quant_mt.argtypes = [p, p, i64, i64, i64, i64, f32, i32, p, p, i32]
    lib.kc_fp8_quant_mt.restype = None
    lib.kc_fp8_decode_bf16_mt.argtypes = [p, p, i64, i64, i64, i64, p, i32]
    lib.kc_fp8_decode_bf16_mt.restype = None
    lib.kc_nvfp4_avx512.argtypes = []
    lib.kc_nvfp4_avx512.restype = ctypes.c_int
    set_pool_types(lib)
    return lib


def set_pool_types(lib: ctypes.CDLL) -> None:
    """Argument types of ``kc_pool.c``'s exports: a no-op (the dispatch cost alone, for benchmarks), the worker
    count (tests), the workers' nice value (``KERNEL_NICE``) and polling time (``KERNEL_SPIN_NS``)."""
    lib.kc_pool_nop.argtypes = [ctypes.c_int64, ctypes.c_int32]
    lib.kc_pool_nop.restype = None
    lib.kc_pool_workers.argtypes = []
    lib.kc_pool_workers.restype = ctypes.c_int32
    lib.kc_pool_set_nice.argtypes = [ctypes.c_int32]
    lib.kc_pool_set_nice.restype = None
    lib.kc_pool_set_spin.argtypes = [ctypes.c_int64]
    lib.kc_pool_set_spin.restype = None
    if KERNEL_NICE:
        lib.kc_pool_set_nice(KERNEL_NICE)
    if KERNEL_SPIN_NS is not None:
        lib.kc_pool_set_spin(KERNEL_SPIN_NS)


#: Output bytes from which the recipe kernels store the codes non-temporally (no read for ownership of lines that
#: will not be read before they leave the cache; below, a weight's codes may still be in cache when the writer copies
#: them). The same bytes either way.
STREAM_MIN_BYTES = 8 << 20


@cache
def load_recipe() -> ctypes.CDLL | None:
    """NVIDIA's K3 recipe kernels (``recipe_cpu.c``: the MXFP4 -> NVFP4 cast, 128x128 block FP8), argument types
    set (None: the caller runs the torch code)."""
    lib = open_library("recipe_cpu", "fast CPU recipe kernels")
    if lib is None:
        return None
    set_recipe_types(lib)
    return lib


def set_recipe_types(lib: ctypes.CDLL) -> None:
    """The argument and result types of ``recipe_cpu.c``'s entry points and of its pool (``kc_pool.c``), on a
    library built from them (``load_recipe``; a benchmark's build of an older source)."""
    i64, i32, p = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
    lib.kc_cast_mxfp4_mt.argtypes = [p, p, i64, i64, i32, i32, p, p, i32, i32]
    lib.kc_cast_mxfp4_mt.restype = i64
    lib.kc_fp8_block_bf16_mt.argtypes = [p, i64, i64, p, p, i32, i32]
    lib.kc_fp8_block_bf16_mt.restype = i32
    lib.kc_int4_decode_mt.argtypes = [p, p, i64, i64, i64, p, i32]
    lib.kc_int4_decode_mt.restype = i32
    set_pool_types(lib)


def amax_bits(lib: ctypes.CDLL, ptr: int, n: int, fp32: bool, threads: int) -> int:
    """The bits of the fp32 amax of ``n`` bf16 (or fp32) values at ``ptr`` (NaN or Inf: a NaN or an Inf there)."""
    return (lib.kc_amax_f32_mt if fp32 else lib.kc_amax_bf16_mt)(ptr, n, threads)


def quant(lib: ctypes.CDLL, ptr: int, m: int, k: int, fp32: bool, s2: float, packed: int, scales: int,
          threads: int) -> None:
    """ModelOpt's NVFP4 of the [m, k] rows at ``ptr`` under ``weight_scale_2`` ``s2``: codes into ``packed``
    [m, k/2], e4m3 scales into ``scales`` [m, k/16]."""
    (lib.kc_quant_f32_mt if fp32 else lib.kc_quant_bf16_mt)(ptr, m, k, s2, packed, scales, threads)


def ct_quant(lib: ctypes.CDLL, ptr: int, m: int, k: int, fp32: bool, g: float, packed: int, scales: int,
             threads: int) -> None:
    """compressed-tensors' NVFP4 of the same rows under ``weight_global_scale`` ``g``."""
    lib.kc_ct_quant_mt(ptr, m, k, g, int(fp32), packed, scales, threads)


def int4_amax_bits(lib: ctypes.CDLL, packed: int, scale: int, m: int, k: int, groups: int, threads: int) -> int:
    """The bits of the fp32 amax of an INT4 ``pack-quantized`` weight [m, k] decoded (codes at ``packed``, ``groups``
    finite fp32 scales a row at ``scale``), without it in memory; 0x7F800000: a product overflows fp32."""
    return lib.kc_int4_amax_mt(packed, scale, m, k, groups, threads)


def int4_quant(lib: ctypes.CDLL, packed: int, scale: int, m: int, k: int, groups: int, ct: bool, s2: float, out: int,
               scales: int, threads: int) -> None:
    """:func:`quant` (``ct``: :func:`ct_quant`) of the same weight's fp32 values, decoded a row at a time."""
    lib.kc_int4_quant_mt(packed, scale, m, k, groups, s2, int(ct), out, scales, threads)


def fp8_amax_bits(lib: ctypes.CDLL, codes: int, scale: int, m: int, k: int, block: tuple[int, int],
                  threads: int) -> int:
    """The bits of the fp32 amax of a block FP8 weight [m, k] decoded (e4m3 codes at ``codes``, the finite fp32
    scale of each ``block`` tile at ``scale``), without it in memory; 0x7F800000: a NaN code."""
    return lib.kc_fp8_amax_mt(codes, scale, m, k, block[0], block[1], threads)


def fp8_quant(lib: ctypes.CDLL, codes: int, scale: int, m: int, k: int, block: tuple[int, int], ct: bool, s2: float,
              out: int, scales: int, threads: int) -> None:
    """:func:`quant` (``ct``: :func:`ct_quant`) of the same weight's fp32 values, decoded a row at a time."""
    lib.kc_fp8_quant_mt(codes, scale, m, k, block[0], block[1], s2, int(ct), out, scales, threads)


def fp8_decode_bf16(lib: ctypes.CDLL, codes: int, scale: int, m: int, k: int, block: tuple[int, int], out: int,
                    threads: int) -> None:
    """The same weight's values rounded to bf16 as torch's CPU ``to(torch.bfloat16)`` (a NaN
    0xFFFF), into ``out`` [m, k] (uint16), decoded a row at a time."""
    lib.kc_fp8_decode_bf16_mt(codes, scale, m, k, block[0], block[1], out, threads)
