"""The top-k union builder in shared memory: CUDA C++ (``cuda_smem.cu``) compiled at run time.

One CTA of ``THREADS`` threads per group builds the group's union in an open-addressing hash table
in shared memory keyed by the global kv row (shared-memory atomicCAS for the key, atomicOr for the
membership bits), then compacts the occupied slots with warp ballots and a warp scan into
``union_rows`` / ``union_bits`` (unsorted) and ``union_len``. Its cost is O(G K) per group whatever
the number of kv rows N (a paged cache of millions of rows included) or the sequence length, and
it serves both layouts (groups inside requests, and token-major groups spanning requests). The
kernel's header comment states the algorithm; ``sparse_mla.union.triton_tl.build_union`` is its
CPU-tested twin (same outputs, same overlap guard).

Table (``plan_table``): S = 2^n slots of 6 bytes (int32 key, 16 membership bits), sized so that
every union the caller keeps fits at a load factor <= 3/4: all G * K entries without the overlap
guard, else the guard's limit (``guard_ratio * K`` rows: a group above it runs per token anyway),
and at least min(2 G K, 8192) slots; capped by the device's shared memory per block (227 KiB on the
H200: up to 32768 slots, 192 KiB). With the default guard at K = 2048: G = 2 and 4: 8192 slots
(48 KiB), G = 8: 16384 (96 KiB, two CTAs per SM), G = 16: 32768 (192 KiB, one CTA per SM).
Overflow: a group whose union holds more than ``capacity`` = 3/4 S rows stops early and gets
``union_len = -1``, ``group_len = 0`` and ``route = 1`` for its rows (they run per token): exact
results, never a crash. With the plan above this happens only to groups the guard would send per
token anyway, except where the cap binds (e.g. G = 16, K = 2048 without a guard).

Runtime compilation: CuPy's ``RawKernel`` (NVRTC; CuPy caches the binary on disk under
``~/.cupy/kernel_cache``), compiled on the first call per (device, options) or by
``sparse_mla.integration.warmup.warmup``. Launches take the torch tensors' raw device pointers
and run on torch's current stream; nothing is allocated per call and nothing is read back, so a
call can be captured in a CUDA graph (once compiled).
"""

from __future__ import annotations

import functools
import math
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..launch_cache import recorder

SOURCE_PATH = Path(__file__).with_name("cuda_smem.cu")
KERNEL_NAME = "sparse_mla_union_smem"

THREADS = 1024  # one CTA per group; 32 warps vote and scan in the compaction
MIN_BLOCKS = 2  # __launch_bounds__ minimum resident CTAs per SM: caps registers at 32 (no spills, checked by NVRTC)
UNROLL = 8  # index loads in flight per thread before its probes
MAX_GROUP_SIZE = 16  # membership words are 16 bits per slot
MAX_LOAD = 0.75  # capacity = 3/4 of the slots
# Tables are at least min(2 G K, this) slots (48 KiB): H200, 16K tokens, G = 2, "mid" top-k (union 1.14 K),
# plan + build: 0.518 ms with 4096 slots, 0.442 ms with 8192 (results/union-cuda.json: the guarded and
# the guard-less runs); at G = 4 8192 slots (0.297 ms) beat 16384 (0.312 ms), at G = 8 16384 beat 32768.
SMALL_TABLE_SLOTS = 8192
MIN_LOG_SLOTS = 6
MAX_LOG_SLOTS = 15  # 32768 slots = 192 KiB
SLOT_BYTES = 6  # int32 key + 16 membership bits
STATIC_SMEM_BYTES = 512  # bound on the kernel's static shared memory (208 B with NVRTC 13.x)
MAX_ENTRIES = 1 << 30  # G * K per group: int32 entry counters inside the kernel


def source() -> str:
    """The CUDA C++ source of the kernel."""
    return SOURCE_PATH.read_text()


def compile_options(threads: int = THREADS, min_blocks: int = MIN_BLOCKS, unroll: int = UNROLL) -> tuple[str, ...]:
    """NVRTC options (besides the architecture and the C++ standard, which CuPy sets)."""
    return (f"-DUNION_THREADS={threads}", f"-DUNION_MIN_BLOCKS={min_blocks}", f"-DUNION_UNROLL={unroll}")


@dataclass(frozen=True)
class TablePlan:
    """Shared-memory table of one launch.

    slots: S = 2^log_slots; capacity: most union rows a group keeps (more -> union_len = -1);
    smem_bytes: dynamic shared memory per CTA; exact: no group can overflow (G * K <= capacity);
    keeps_guarded: every union the overlap guard keeps fits (identical routing to the Triton builder).
    """

    log_slots: int
    slots: int
    capacity: int
    smem_bytes: int
    exact: bool
    keeps_guarded: bool


def max_log_slots(max_smem_per_block: int) -> int:
    """The largest table (log2 slots) whose 6-byte slots fit ``max_smem_per_block`` bytes with the
    kernel's static shared memory, at most ``MAX_LOG_SLOTS``; 0 when not even 2^MIN_LOG_SLOTS fit."""
    for n in range(MAX_LOG_SLOTS, MIN_LOG_SLOTS - 1, -1):
        if table_bytes(1 << n) + STATIC_SMEM_BYTES <= max_smem_per_block:
            return n
    return 0


def table_bytes(slots: int) -> int:
    """Dynamic shared memory of a table: slots int32 keys + slots / 2 uint32 membership words."""
    return slots * 4 + (slots // 2) * 4


def guard_limit(group_size: int, topk: int, guard_ratio: float | None) -> int:
    """Most union rows a group can hold and still be kept by the overlap guard (all G * K without a
    guard): the guard routes a group per token when u * glen > ratio * valid entries, and
    valid entries <= glen * K, so a kept union has u <= ratio * K (+1 for fp32 rounding)."""
    total = group_size * topk
    if guard_ratio is None:
        return total
    return max(0, min(total, math.floor(guard_ratio * topk) + 1))


@functools.lru_cache(maxsize=256)
def plan_table(group_size: int, topk: int, guard_ratio: float | None, max_smem_per_block: int,
               slots: int | None = None) -> TablePlan:
    """The table of a launch (module docstring). ``slots`` overrides the size (a power of two in
    [2^MIN_LOG_SLOTS, the device's limit]; tests use small tables to force overflows).

    Raises:
        ValueError: ``slots`` not a power of two in range, or no table fits the device.
    """
    top = max_log_slots(max_smem_per_block)
    if top == 0:
        raise ValueError(f"{max_smem_per_block} bytes of shared memory per block hold no {1 << MIN_LOG_SLOTS}-slot table")
    total = group_size * topk
    need = guard_limit(group_size, topk, guard_ratio)
    if slots is None:
        log_s = max(MIN_LOG_SLOTS, math.ceil(math.log2(max(1, math.ceil(need / MAX_LOAD)))))
        while (1 << log_s) * 3 // 4 < need:  # float rounding of the log
            log_s += 1
        if total > (1 << log_s) * 3 // 4:
            # overflow is possible: keep S - capacity >= THREADS so that rows inserted by warps that
            # have not yet seen the count pass the capacity still find free slots quickly
            log_s = max(log_s, (4 * THREADS).bit_length() - 1)
        # small tables: at least 2 G K slots (load <= 1/2 with no overlap at all) up to SMALL_TABLE_SLOTS,
        # where clearing and compacting cost little next to the probe chains of a fuller table
        log_s = max(log_s, (min(SMALL_TABLE_SLOTS, 2 * total) - 1).bit_length())
        log_s = min(log_s, top)
    else:
        if slots < 1 or slots & (slots - 1) or not MIN_LOG_SLOTS <= slots.bit_length() - 1 <= top:
            raise ValueError(f"slots must be a power of two in [{1 << MIN_LOG_SLOTS}, {1 << top}], got {slots}")
        log_s = slots.bit_length() - 1
    S = 1 << log_s
    capacity = S * 3 // 4
    return TablePlan(log_s, S, capacity, table_bytes(S), total <= capacity, need <= capacity)


# ---------------------------------------------------------------------------------------------
# CuPy: import, device facts, compiled kernels, streams (all cached; no CUDA call at import time)

_LOCK = threading.Lock()
_KERNELS: dict[tuple[int, tuple[str, ...]], object] = {}
_STREAMS: dict[tuple[int, int], object] = {}


@functools.lru_cache(maxsize=1)
def cupy_import_error() -> str | None:
    """None when CuPy imports, else why not (the optional ``cuda12`` / ``cuda13`` extra)."""
    try:
        import cupy  # noqa: F401
    except Exception as exc:  # ImportError, or a CuPy built for another CUDA failing to load
        return f"{type(exc).__name__}: {exc}"
    return None


def _cupy():
    import cupy

    return cupy


@functools.cache
def max_smem_per_block(device_index: int) -> int:
    """Opt-in shared memory per block of a CUDA device, in bytes (227 KiB on sm_90)."""
    props = torch.cuda.get_device_properties(device_index)
    v = getattr(props, "shared_memory_per_block_optin", None)
    if v:
        return int(v)
    if cupy_import_error() is None:
        return int(_cupy().cuda.Device(device_index).attributes["MaxSharedMemoryPerBlockOptin"])
    return {(9, 0): 232448, (8, 0): 166912}.get((props.major, props.minor), 101376)


def compiled_kernel_count() -> int:
    """Compiled (device, options) variants held (``integration.warmup.compiled_variant_counts``)."""
    return len(_KERNELS)


def get_kernel(device_index: int, options: tuple[str, ...] | None = None):
    """The compiled kernel for a device (CuPy ``RawKernel``), compiling it on first use; its dynamic
    shared memory limit is raised to the device's opt-in maximum and the carveout set to maximum
    shared memory (two 96 KiB tables per SM on the H200)."""
    options = compile_options() if options is None else tuple(options)
    return compiled_raw_kernel(_KERNELS, device_index, source, KERNEL_NAME, options)


def compiled_raw_kernel(cache: dict, device_index: int, source_fn, name: str, options: tuple[str, ...]):
    """``cache[(device_index, options)]``, compiled on first use from ``source_fn()`` (CuPy ``RawKernel`` ``name``)
    with the dynamic shared memory limit at the device's opt-in maximum and the carveout at maximum shared memory.
    Thread-safe; the union kernels' one compile path (``get_kernel``, ``cuda_sorted.get_kernel``)."""
    key = (device_index, options)
    kern = cache.get(key)
    if kern is not None:
        return kern
    with _LOCK:
        kern = cache.get(key)
        if kern is None:
            cp = _cupy()
            with cp.cuda.Device(device_index):
                kern = cp.RawKernel(source_fn(), name, options=options)
                kern.compile()
                kern.max_dynamic_shared_size_bytes = max_smem_per_block(device_index) - kern.shared_size_bytes
                kern.preferred_shared_memory_carveout = 100
            cache[key] = kern
    return kern


def launch_on(kern, device_index: int, grid: tuple, block: tuple, smem: int, args: tuple, stream_ptr: int) -> None:
    """Launch ``kern`` on device ``device_index``'s raw stream ``stream_ptr``: ``build_union``'s launch, and a recorded
    one again with its ``args`` rebased (``sparse_mla.call_cache``)."""
    stream = stream_for(device_index, stream_ptr)
    if torch.cuda.current_device() == device_index:
        kern(grid, block, args, shared_mem=smem, stream=stream)
    else:
        with _cupy().cuda.Device(device_index):
            kern(grid, block, args, shared_mem=smem, stream=stream)


def stream_for(device_index: int, ptr: int):
    """The CuPy stream object of the raw stream handle ``ptr`` on device ``device_index`` (cached)."""
    key = (device_index, ptr)
    s = _STREAMS.get(key)
    if s is None:
        cp = _cupy()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # CuPy 14 prefers Stream.from_external
            try:
                s = cp.cuda.ExternalStream(ptr, device_index)
            except TypeError:  # CuPy < 12: no device_id argument
                s = cp.cuda.ExternalStream(ptr)
        _STREAMS[key] = s
    return s


@dataclass(frozen=True)
class LaunchConfig:
    """One launch: grid (groups; 0 = nothing to do), block, dynamic shared memory, the kernel's
    arguments in order (numpy scalars: pointers as uint64), and the table plan."""

    grid: int
    block: int
    smem_bytes: int
    args: tuple
    plan: TablePlan


def launch_config(
    indices: torch.Tensor, topk_length: torch.Tensor | None, num_kv_rows: int, group_size: int,
    group_start: torch.Tensor, group_len: torch.Tensor, route: torch.Tensor,
    rows: torch.Tensor, bits: torch.Tensor, union_len: torch.Tensor,
    guard_ratio: float | None, slots: int | None, max_smem: int, threads: int = THREADS,
) -> LaunchConfig:
    """Check the tensors and build the launch of ``build_union`` (any device: the CPU tests run the
    same arguments through an emulation of the kernel). ``max_smem``: shared memory per block;
    ``threads``: the block size the kernel was compiled for."""
    num_groups = group_start.shape[0]
    T, K = indices.shape
    if not 1 <= group_size <= MAX_GROUP_SIZE:
        raise ValueError(f"group_size must be in [1, {MAX_GROUP_SIZE}], got {group_size}")
    if group_size * K > MAX_ENTRIES:
        raise ValueError(f"G * K = {group_size * K} entries per group exceed {MAX_ENTRIES}")
    dev = indices.device
    tensors = [("indices", indices), ("group_start", group_start), ("group_len", group_len), ("route", route),
               ("rows", rows), ("bits", bits), ("union_len", union_len)]
    if topk_length is not None:
        tensors.append(("topk_length", topk_length))
    for name, t in tensors:
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device}, indices on {dev}")
    dtypes = {"route": torch.int8}
    for name, t in tensors:
        if t.dtype != dtypes.get(name, torch.int32):
            raise ValueError(f"{name} must be {dtypes.get(name, torch.int32)}, got {t.dtype}")
    if indices.stride(1) != 1 or rows.stride(1) != 1 or bits.stride(1) != 1 or rows.stride(0) != bits.stride(0):
        raise ValueError("indices / rows / bits need a contiguous last dim, rows and bits the same row stride")
    if rows.shape[0] < num_groups or rows.shape[1] < group_size * K or bits.shape[:2] != rows.shape[:2]:
        raise ValueError(f"rows / bits must be [>= {num_groups}, >= {group_size * K}], got {tuple(rows.shape)}")
    for name, t in (("group_start", group_start), ("group_len", group_len), ("union_len", union_len),
                    ("topk_length", topk_length), ("route", route)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if route.shape[0] < T or group_len.shape[0] != num_groups or union_len.shape[0] != num_groups:
        raise ValueError("route must hold T rows, group_len / union_len one entry per group")
    if topk_length is not None and topk_length.shape[0] < T:
        raise ValueError("topk_length must hold T entries")
    plan = plan_table(group_size, K, guard_ratio, max_smem, slots)
    import numpy as np

    args = (
        np.uint64(indices.data_ptr()), np.uint64(topk_length.data_ptr() if topk_length is not None else 0),
        np.uint64(group_start.data_ptr()), np.uint64(group_len.data_ptr()), np.uint64(route.data_ptr()),
        np.uint64(rows.data_ptr()), np.uint64(bits.data_ptr()), np.uint64(union_len.data_ptr()),
        np.int64(indices.stride(0)), np.int64(rows.stride(0)), np.int64(num_kv_rows),
        np.int32(K), np.int32(group_size), np.int32(plan.log_slots), np.int32(plan.capacity),
        np.float32(guard_ratio if guard_ratio is not None else 0.0),
        np.int32(topk_length is not None), np.int32(guard_ratio is not None),
    )
    grid = num_groups if T > 0 else 0
    return LaunchConfig(grid, threads, plan.smem_bytes, args, plan)


def build_union(
    indices: torch.Tensor, topk_length: torch.Tensor | None, num_kv_rows: int, group_size: int,
    group_start: torch.Tensor, group_len: torch.Tensor, route: torch.Tensor,
    rows: torch.Tensor, bits: torch.Tensor, union_len: torch.Tensor,
    guard_ratio: float | None = None, slots: int | None = None, threads: int = THREADS, unroll: int = UNROLL,
) -> TablePlan:
    """Launch the shared-memory union builder over ``group_start.shape[0]`` groups (one CTA each).

    Args (CUDA tensors on one device; the caller validated contents, as for the Triton builder):
        indices: [T, K] int32, last dim contiguous (any row stride, 0 included); entries < 0,
            >= num_kv_rows or at positions >= topk_length[t] are padding.
        topk_length: [T] int32 contiguous or None.
        num_kv_rows: N (up to 2**31: every non-negative int32 row valid).
        group_size: G, 1..16.
        group_start, group_len: [num_groups] int32 (``plan_groups``); group_len 0 = no group.
        route: [>= T] int8; set to 1 for the rows of guarded / overflowed groups.
        rows, bits: [num_groups, >= G * K] int32, last dim contiguous: the first union_len[g]
            entries of row g receive the union rows (unsorted) and membership words.
        union_len: [num_groups] int32: u, or -1 for a group whose union overflowed the table.
        guard_ratio: the overlap guard (``triton_tl.build_union``'s semantics) or None.
        slots: table size override (``plan_table``).
        threads, unroll: kernel variant (block size, a multiple of 32 up to 1024; loads in flight per
            thread); the defaults are the measured choice, the others exist for tuning runs.

    Returns:
        The ``TablePlan`` used.

    Raises:
        ValueError: G out of range, G * K past ``MAX_ENTRIES``, tensors not on one CUDA device,
            wrong dtypes or layouts.
    """
    dev = indices.device
    if dev.type != "cuda":
        raise ValueError(f"the CUDA union builder needs CUDA tensors, got {dev}")
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    if threads % 32 or not 32 <= threads <= 1024 or unroll < 1:
        raise ValueError(f"threads must be a multiple of 32 in [32, 1024] and unroll >= 1, got {threads}, {unroll}")
    cfg = launch_config(indices, topk_length, num_kv_rows, group_size, group_start, group_len, route, rows, bits,
                        union_len, guard_ratio, slots, max_smem_per_block(idx), threads)
    if cfg.grid == 0:
        return cfg.plan
    kern = get_kernel(idx, compile_options(threads, 2048 // threads if threads >= 512 else 1, unroll))
    rec = recorder()
    if rec is not None:  # a call being recorded (sparse_mla.call_cache): the pointer arguments' tensors name them
        pointers = (indices, topk_length, group_start, group_len, route, rows, bits, union_len)
        rec.cupy(launch_on, kern, idx, (cfg.grid, ), (cfg.block, ), cfg.smem_bytes, cfg.args, pointers)
        if rec.dry:
            return cfg.plan
    launch_on(kern, idx, (cfg.grid, ), (cfg.block, ), cfg.smem_bytes, cfg.args,
              torch.cuda.current_stream(idx).cuda_stream)
    return cfg.plan
