"""Compile CUDA C++ with NVRTC through ctypes, without a GPU or a driver (CPU CI checks the runtime-
compiled kernels' source: a syntax error or a register spill fails the test, not the first GPU run).

The NVRTC library comes from a wheel (``nvidia-cuda-nvrtc`` for CUDA 13: ``nvidia/cu13/lib``;
``nvidia-cuda-nvrtc-cu12``: ``nvidia/cuda_nvrtc/lib``), a CUDA toolkit (``$CUDA_HOME/lib64``), or the
loader's search path. The test extra installs the CUDA 13 wheel (58 MB, Linux).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import site
import sys


def _candidates() -> list[str]:
    roots = list(site.getsitepackages()) + [site.getusersitepackages()] + [p for p in sys.path if p.endswith("site-packages")]
    found = []
    for root in dict.fromkeys(roots):
        for pattern in ("nvidia/cu*/lib/libnvrtc.so*", "nvidia/cuda_nvrtc/lib/libnvrtc.so*"):
            found += sorted(glob.glob(os.path.join(root, pattern)), reverse=True)
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            found += sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")), reverse=True)
    name = ctypes.util.find_library("nvrtc")
    if name:
        found.append(name)
    return [f for f in found if "builtins" not in os.path.basename(f) and "alt" not in os.path.basename(f)]


def load_nvrtc() -> tuple[ctypes.CDLL | None, str]:
    """(library, where) or (None, why not)."""
    errors = []
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path)
            lib.nvrtcVersion  # noqa: B018 (a symbol lookup: is this NVRTC?)
            return lib, path
        except (OSError, AttributeError) as exc:
            errors.append(f"{path}: {exc}")
    return None, "no loadable libnvrtc (pip install nvidia-cuda-nvrtc, or a CUDA toolkit)" + (
        f"; tried {errors}" if errors else "")


def nvrtc_version(lib: ctypes.CDLL) -> tuple[int, int]:
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


def compile_cubin(lib: ctypes.CDLL, source: str, options: list[str], name: str = "kernel.cu") -> tuple[int, str, int]:
    """(nvrtcResult of the compile, program log, cubin bytes) for ``source`` with ``options``."""
    prog = ctypes.c_void_p()
    res = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None)
    if res != 0:
        return res, f"nvrtcCreateProgram failed ({res})", 0
    try:
        opts = [o.encode() for o in options]
        arr = (ctypes.c_char_p * len(opts))(*opts)
        res = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(max(1, size.value))
        lib.nvrtcGetProgramLog(prog, buf)
        cubin = ctypes.c_size_t()
        if res == 0:
            lib.nvrtcGetCUBINSize(prog, ctypes.byref(cubin))
        return res, buf.value.decode(errors="replace"), cubin.value
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
