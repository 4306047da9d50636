"""A stand-in CUDA driver library (``libcuda.so.1``) for machines without a GPU.

The engines' compiled extensions (and a few of their dependencies) link ``libcuda.so.1`` directly;
Python loads extensions with ``RTLD_NOW``, so every driver symbol they reference must resolve or the
import fails. This builds, with the system C compiler, a library that defines each of those symbols
as a function returning ``CUDA_ERROR_NO_DEVICE`` (100), except ``cuDeviceGetCount`` and
``cuDriverGetVersion``, which report 0 devices and a CUDA 13.0 driver. Nothing in it ever runs a
kernel: the CUDA runtime sees "no device" and the engines' CPU code paths do the loading.

It is put on ``LD_LIBRARY_PATH`` of the engine subprocess only. The symbol list comes from the
engine environment's own shared libraries (their undefined ``cu*`` symbols), so the stub follows
the installed versions. Built once per symbol set into ``~/.cache/kimi-convert/stub-libcuda/``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

from ..errors import ConvertError

#: Always defined: what the CUDA runtime looks up through dlsym (not visible as undefined symbols).
BASE_SYMBOLS = (
    "cuInit", "cuDriverGetVersion", "cuDeviceGetCount", "cuDeviceGet", "cuDeviceGetAttribute",
    "cuDeviceGetName", "cuDeviceGetUuid", "cuDeviceGetUuid_v2", "cuDeviceTotalMem", "cuDeviceTotalMem_v2",
    "cuGetProcAddress", "cuGetProcAddress_v2", "cuGetErrorString", "cuGetErrorName", "cuCtxGetCurrent",
    "cuCtxSetCurrent", "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxGetState", "cuGetExportTable",
)

_SPECIAL = {
    "cuDeviceGetCount": "int cuDeviceGetCount(int *n) { if (n) *n = 0; return 0; }",
    "cuDriverGetVersion": "int cuDriverGetVersion(int *v) { if (v) *v = 13000; return 0; }",
    "cuGetErrorString": 'int cuGetErrorString(int e, const char **s) { if (s) *s = "no CUDA device (stub)"; '
                        "return 0; }",
    "cuGetErrorName": 'int cuGetErrorName(int e, const char **s) { if (s) *s = "CUDA_ERROR_NO_DEVICE"; return 0; }',
    "cuGetProcAddress": "int cuGetProcAddress(const char *n, void **p, int v, unsigned long long f) "
                        "{ if (p) *p = 0; return 100; }",
    "cuGetProcAddress_v2": "int cuGetProcAddress_v2(const char *n, void **p, int v, unsigned long long f, void *s) "
                           "{ if (p) *p = 0; if (s) *(int *)s = 1; return 100; }",
}


def elf_needs_and_undefined(path: Path) -> tuple[list[str], list[str]]:
    """DT_NEEDED entries and undefined dynamic symbols of a 64-bit little-endian ELF file."""
    with open(path, "rb") as f:
        head = f.read(64)
        if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            return [], []
        e_shoff, = struct.unpack_from("<Q", head, 0x28)
        e_shentsize, e_shnum = struct.unpack_from("<HH", head, 0x3A)
        if not e_shoff or not e_shnum:
            return [], []
        f.seek(e_shoff)
        raw = f.read(e_shentsize * e_shnum)
        secs = [struct.unpack_from("<IIQQQQIIQQ", raw, i * e_shentsize) for i in range(e_shnum)]

        def read(sec) -> bytes:
            f.seek(sec[4])
            return f.read(sec[5])

        needed, undef = [], []
        for sec in secs:
            typ = sec[1]
            if typ not in (6, 11):  # SHT_DYNAMIC, SHT_DYNSYM
                continue
            strtab = read(secs[sec[6]])

            def s(off: int, strtab=strtab) -> str:
                return strtab[off: strtab.index(b"\0", off)].decode("latin-1")
            data = read(sec)
            if typ == 6:
                for i in range(0, len(data) - 15, 16):
                    tag, val = struct.unpack_from("<qQ", data, i)
                    if tag == 0:
                        break
                    if tag == 1:
                        needed.append(s(val))
            else:
                for i in range(0, len(data) - 23, 24):
                    st_name, _info, _other, st_shndx = struct.unpack_from("<IBBH", data, i)
                    if st_shndx == 0 and st_name:
                        undef.append(s(st_name))
        return needed, undef


_CU_NAME = re.compile(rb"\bcu[A-Z][A-Za-z0-9_]*")


def driver_symbols(site_packages: list[str]) -> list[str]:
    """Undefined ``cu*`` symbols of every shared library under ``site_packages`` that links libcuda, and the
    ``cu*`` names in C sources compiled at run time against it (Triton's ``backends/nvidia/driver.c``)."""
    syms = set(BASE_SYMBOLS)
    for root in site_packages:
        for dirpath, _dirs, files in os.walk(root):
            for fn in files:
                if fn.endswith(".c") and "nvidia" in dirpath:
                    with contextlib.suppress(OSError):
                        syms.update(m.decode() for m in _CU_NAME.findall(Path(dirpath, fn).read_bytes()))
                    continue
                if ".so" not in fn:
                    continue
                p = Path(dirpath, fn)
                if p.is_symlink() or not p.is_file():
                    continue
                try:
                    needed, undef = elf_needs_and_undefined(p)
                except (OSError, struct.error, ValueError, IndexError):
                    continue
                if any(n.startswith("libcuda.so") for n in needed):
                    syms.update(u.split("@")[0] for u in undef if u.startswith("cu") and u[2:3].isupper())
    return sorted(syms)


def source(symbols: list[str]) -> str:
    lines = ["/* stub libcuda.so.1 written by kimi-convert: no device, nothing runs */"]
    for sym in symbols:
        lines.append(_SPECIAL.get(sym, f"int {sym}(void) {{ return 100; }}"))
    return "\n".join(lines) + "\n"


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kimi-convert" / "stub-libcuda"


def build(site_packages: list[str]) -> Path:
    """The folder holding ``libcuda.so.1`` for these environments (built on first use)."""
    src = source(driver_symbols(site_packages))
    digest = hashlib.sha256(src.encode()).hexdigest()[:16]
    out = cache_root() / digest
    lib = out / "libcuda.so.1"
    if lib.is_file():
        return out
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise ConvertError("the engine check needs a C compiler (cc) to build a stub CUDA driver library; "
                           "install one (e.g. apt-get install gcc) or run on a machine with a GPU driver")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        c = Path(tmp, "libcuda.c")
        c.write_text(src)
        so = Path(tmp, "libcuda.so.1")
        r = subprocess.run([cc, "-shared", "-fPIC", "-O0", "-Wl,-soname,libcuda.so.1", "-o", str(so), str(c)],
                           capture_output=True, text=True)
        if r.returncode:
            raise ConvertError(f"building the stub CUDA driver library failed: {r.stderr.strip()[-300:]}")
        shutil.copy(c, out / "libcuda.c")
        os.replace(so, lib)
    os.symlink("libcuda.so.1", out / "libcuda.so") if not (out / "libcuda.so").exists() else None
    return out
