"""Run the CUDA union kernel's own source on the CPU: a C++20 emulation of the CUDA built-ins it uses.

``sparse_mla/union/cuda_smem.cu`` is compiled by the host C++ compiler with a prelude that maps each
CUDA thread of a block to a ``std::thread`` (blocks run one after another): ``__syncthreads`` is a
block-wide ``std::barrier``, the warp votes and shuffles (``__ballot_sync``, ``__any_sync``,
``__shfl_up_sync``, ``__shfl_down_sync``, ``__syncwarp``) exchange through a per-warp barrier,
shared-memory atomics are ``std::atomic_ref`` operations, ``__shared__`` variables are shared
statics and the dynamic shared memory is one buffer, filled with garbage before each block.
The OS schedules the threads freely, so a missing barrier or a race between warps shows up as a
wrong union far more readily than in a GPU's lockstep warps; what it cannot show is a GPU memory-model
effect, a shared-memory size limit, or anything about the CuPy launch (tests on the GPU do).

``emulate(cfg)`` runs a ``cuda_smem.LaunchConfig`` built from CPU tensors (the same argument tuple the
GPU launch passes, so the argument order and types are checked against the kernel's signature); ``build_sorted`` and
``emulate_sorted`` do the same for ``sparse_mla/union/cuda_sorted.cu`` (``cuda_sorted.LaunchConfig``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile

import numpy as np

from sparse_mla.union import cuda_smem, cuda_sorted

PRELUDE = r"""
#include <atomic>
#include <barrier>
#include <cstddef>
#include <cstring>
#include <thread>
#include <vector>

struct emu_dim3 { unsigned x, y, z; };
static thread_local emu_dim3 threadIdx;
static emu_dim3 blockIdx;  // one block at a time
static std::barrier<>* emu_block_barrier;
struct EmuWarp { std::barrier<>* bar; unsigned long long vals[32]; };
static EmuWarp emu_warps[32];
alignas(16) static int emu_smem[(1 << 15) + (1 << 14) + 64];

#define __global__
#define __device__
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __shared__ static

static inline void __syncthreads() { emu_block_barrier->arrive_and_wait(); }
static inline int emu_lane() { return threadIdx.x & 31; }
static inline EmuWarp& emu_warp() { return emu_warps[threadIdx.x >> 5]; }
static inline unsigned long long emu_exchange(unsigned long long v, int src) {
    EmuWarp& w = emu_warp();
    w.vals[emu_lane()] = v;
    w.bar->arrive_and_wait();
    unsigned long long r = w.vals[src];
    w.bar->arrive_and_wait();
    return r;
}
static inline unsigned __ballot_sync(unsigned, int pred) {
    EmuWarp& w = emu_warp();
    w.vals[emu_lane()] = pred ? 1ull : 0ull;
    w.bar->arrive_and_wait();
    unsigned r = 0;
    for (int i = 0; i < 32; ++i) r |= (unsigned)w.vals[i] << i;
    w.bar->arrive_and_wait();
    return r;
}
static inline int __any_sync(unsigned m, int pred) { return __ballot_sync(m, pred) != 0u; }
static inline int __shfl_up_sync(unsigned, int v, unsigned d) {
    int lane = emu_lane();
    int src = lane >= (int)d ? lane - (int)d : lane;
    return (int)(long long)emu_exchange((unsigned long long)(long long)v, src);
}
static inline int __shfl_down_sync(unsigned, int v, unsigned d) {
    int lane = emu_lane();
    int src = lane + (int)d < 32 ? lane + (int)d : lane;
    return (int)(long long)emu_exchange((unsigned long long)(long long)v, src);
}
static inline int __shfl_xor_sync(unsigned, int v, int m) {
    return (int)(long long)emu_exchange((unsigned long long)(long long)v, emu_lane() ^ m);
}
static inline void __syncwarp(unsigned = 0xffffffffu) { emu_warp().bar->arrive_and_wait(); }
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
template <class T> static inline T __ldg(const T* p) { return *p; }
static inline int atomicCAS(int* p, int cmp, int val) {
    std::atomic_ref<int>(*p).compare_exchange_strong(cmp, val);
    return cmp;  // the old value either way
}
static inline unsigned atomicOr(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_or(v); }
static inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
static inline int atomicMin(int* p, int v) {
    std::atomic_ref<int> a(*p);
    int cur = a.load();
    while (v < cur && !a.compare_exchange_weak(cur, v)) {}
    return cur;
}
static inline int atomicMax(int* p, int v) {
    std::atomic_ref<int> a(*p);
    int cur = a.load();
    while (v > cur && !a.compare_exchange_weak(cur, v)) {}
    return cur;
}
struct alignas(16) uint4 { unsigned x, y, z, w; };
static inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
template <class T> static inline T min(T a, T b) { return a < b ? a : b; }
template <class T> static inline T max(T a, T b) { return a > b ? a : b; }
#define __forceinline__ inline
static inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }

// Blocks one after another, each as `threads` std::threads (threadIdx set) running body(); shared memory garbage
// before each.
template <class Body> static void emu_run_blocks(int grid, int threads, Body body) {
    std::barrier<> block_bar(threads);
    emu_block_barrier = &block_bar;
    std::vector<std::barrier<>*> bars;
    for (int w = 0; w < threads / 32; ++w) { bars.push_back(new std::barrier<>(32)); emu_warps[w].bar = bars.back(); }
    for (int b = 0; b < grid; ++b) {
        blockIdx.x = (unsigned)b;
        std::memset(emu_smem, 0x5a, sizeof(emu_smem));
        std::vector<std::thread> pool;
        pool.reserve(threads);
        for (int t = 0; t < threads; ++t) pool.emplace_back([=] { threadIdx.x = (unsigned)t; body(); });
        for (auto& th : pool) th.join();
    }
    for (auto* p : bars) delete p;
}
"""

ENTRY = r"""
extern "C" int emu_launch(int grid, int block, long long smem_bytes,
    const int* indices, const int* topk_length, const int* group_start, int* group_len, signed char* route,
    int* union_rows, int* union_bits, int* union_len, long long stride_it, long long stride_rg,
    long long num_kv_rows, int K, int G, int log_slots, int capacity, float guard_ratio,
    int has_topk_length, int has_guard)
{
    if (block != UNION_THREADS) return -1;
    if (smem_bytes > (long long)sizeof(emu_smem)) return -2;
    emu_run_blocks(grid, UNION_THREADS, [=] {
        sparse_mla_union_smem(indices, topk_length, group_start, group_len, route, union_rows, union_bits, union_len,
                              stride_it, stride_rg, num_kv_rows, K, G, log_slots, capacity, guard_ratio,
                              has_topk_length, has_guard);
    });
    return 0;
}
"""


def compiler() -> str | None:
    """A C++20 compiler on the PATH, or None."""
    for cxx in (os.environ.get("CXX"), "g++", "clang++"):
        if cxx and shutil.which(cxx):
            return cxx
    return None


def emulator_source() -> str:
    src = cuda_smem.source()
    marker = "extern __shared__ int smem[];"
    assert marker in src, "the kernel's dynamic shared memory declaration changed: update tests/testlib/cuda_emulation.py"
    return PRELUDE + src.replace(marker, "int* smem = emu_smem;") + ENTRY


_LIBS: dict[tuple, ctypes.CDLL] = {}


def _compile(src: str, defines: list[str], prefix: str) -> ctypes.CDLL:
    cxx = compiler()
    key = hashlib.sha256((src + " ".join(defines) + cxx).encode()).hexdigest()[:16]
    if key in _LIBS:
        return _LIBS[key]
    out_dir = os.path.join(tempfile.gettempdir(), "sparse_mla_cuda_emulation")
    os.makedirs(out_dir, exist_ok=True)
    so = os.path.join(out_dir, f"{prefix}_{key}.so")
    if not os.path.exists(so):
        cpp = os.path.join(out_dir, f"{prefix}_{key}.cpp")
        with open(cpp, "w") as f:
            f.write(src)
        tmp = f"{so}.{os.getpid()}.tmp"
        cmd = [cxx, "-std=c++20", "-O1", "-ffp-contract=off", "-fPIC", "-shared", "-pthread", *defines, cpp, "-o", tmp]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"the emulated kernel does not compile ({' '.join(cmd)}):\n{res.stderr[-4000:]}")
        os.replace(tmp, so)
    lib = ctypes.CDLL(so)
    _LIBS[key] = lib
    return lib


def build(threads: int = cuda_smem.THREADS, unroll: int = cuda_smem.UNROLL) -> tuple[ctypes.CDLL | None, str]:
    """(library, "") or (None, why not): the emulated kernel compiled for ``threads`` / ``unroll``."""
    if compiler() is None:
        return None, "no C++ compiler (g++ / clang++) on the PATH"
    defines = [f"-DUNION_THREADS={threads}", f"-DUNION_UNROLL={unroll}", "-DUNION_MIN_BLOCKS=1"]
    lib = _compile(emulator_source(), defines, "union")
    lib.emu_launch.restype = ctypes.c_int
    return lib, ""


_CTYPES = {np.dtype(np.uint64): ctypes.c_void_p, np.dtype(np.int64): ctypes.c_longlong,
           np.dtype(np.int32): ctypes.c_int, np.dtype(np.float32): ctypes.c_float}


def emulate(lib: ctypes.CDLL, cfg: cuda_smem.LaunchConfig, threads: int) -> None:
    """Run ``cfg`` (built from CPU tensors) on the emulated kernel compiled for ``threads``."""
    if cfg.grid == 0:
        return
    args = [_CTYPES[np.asarray(a).dtype](int(a) if np.asarray(a).dtype.kind in "iu" else float(a)) for a in cfg.args]
    res = lib.emu_launch(ctypes.c_int(cfg.grid), ctypes.c_int(threads), ctypes.c_longlong(cfg.smem_bytes), *args)
    if res != 0:
        raise RuntimeError(f"emu_launch returned {res}")


SORTED_ENTRY = r"""
extern "C" int emu_launch_sorted(int grid, int block, long long smem_bytes,
    const int* indices, const int* topk_length, int* rows, int* bits, int* union_len, long long stride_it,
    long long stride_rg, long long num_kv_rows, int T, int K, int G, int width, int pass_rows, int max_passes,
    int find_window, int has_topk_length)
{
    if (block != SORTED_THREADS) return -1;
    if (smem_bytes > (long long)sizeof(emu_smem)) return -2;
    emu_run_blocks(grid, SORTED_THREADS, [=] {
        sparse_mla_union_sorted(indices, topk_length, rows, bits, union_len, stride_it, stride_rg, num_kv_rows, T, K,
                                G, width, pass_rows, max_passes, find_window, has_topk_length);
    });
    return 0;
}
"""


def sorted_emulator_source() -> str:
    src = cuda_sorted.source()
    marker = "extern __shared__ uint4 words4[];"
    assert marker in src, "the sorted kernel's dynamic shared memory declaration changed: update cuda_emulation.py"
    return PRELUDE + src.replace(marker, "uint4* words4 = reinterpret_cast<uint4*>(emu_smem);") + SORTED_ENTRY


def build_sorted(threads: int, group_size: int, unroll: int = cuda_sorted.UNROLL) -> tuple[ctypes.CDLL | None, str]:
    """(library, "") or (None, why not): the emulated sorted kernel for ``threads`` and G's field width."""
    if compiler() is None:
        return None, "no C++ compiler (g++ / clang++) on the PATH"
    lib = _compile(sorted_emulator_source(), list(cuda_sorted.compile_options(group_size, threads, 1, unroll)), "sorted")
    lib.emu_launch_sorted.restype = ctypes.c_int
    return lib, ""


def emulate_sorted(lib: ctypes.CDLL, cfg: cuda_sorted.LaunchConfig) -> None:
    """Run ``cfg`` (built from CPU tensors with the library's block size) on the emulated sorted kernel."""
    if cfg.grid == 0:
        return
    args = [_CTYPES[np.asarray(a).dtype](int(a) if np.asarray(a).dtype.kind in "iu" else float(a)) for a in cfg.args]
    res = lib.emu_launch_sorted(ctypes.c_int(cfg.grid), ctypes.c_int(cfg.block), ctypes.c_longlong(cfg.smem_bytes),
                                *args)
    if res != 0:
        raise RuntimeError(f"emu_launch_sorted returned {res}")
