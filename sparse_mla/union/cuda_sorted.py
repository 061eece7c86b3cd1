"""Sorted group unions for the inspection API: CUDA C++ (``cuda_sorted.cu``) compiled at run time.

``build_group_union`` returns every group's union sorted, padded to G * K columns. The step builders
(``cuda_smem``, ``triton_tl``) emit unsorted unions from a hash table, so that path needs a sort and a fill
afterwards. This kernel emits them sorted: one CTA per group marks each valid row of the group's row window
[lo, hi] in a membership array in shared memory (``FIELD_BITS`` bits per row: 8 for G <= 8, 16 for G <= 16),
then scans it in row order and writes rows, membership words and the -1 / 0 tail in the same launch. Its cost
per group is O(passes * G K + window / rows per word) (the entries are read once per pass; one pass covers up to
~0.9M rows at G <= 8); the kernel's header comment states the algorithm.

A group whose window needs more than ``MAX_PASSES`` passes (rows spread over more than ~0.9M (G <= 8) or ~0.45M
(G <= 16) kv rows) is not built (``union_len`` -2); ``build_sorted`` then returns None and the caller builds the
call the other way (``sparse_mla.union.interface.build_group_union``).

Opt-in (``SPARSE_MLA_UNION_SORTED=1``, ``backends.choose_inspection_builder``) until a GPU run holds it to the
reference and times it (tests/union/test_cuda_sorted.py). In CI it compiles without spills for sm_80 / sm_90 (NVRTC)
and its source runs on the CPU against Python sets (``tests/testlib/cuda_emulation.py``: one std::thread per CUDA
thread, garbage shared memory), in one pass, in several, and into the fallback.

Shared memory per CTA: ``PASS_SMEM_BYTES`` at most (two CTAs of 1024 threads per SM on sm_90), less when
``num_kv_rows`` bounds the window (46K rows at G = 8: 45 KiB) or the device allows less per block (99 KiB on
sm_86 / sm_89: fewer rows per pass).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from . import cuda_smem

SOURCE_PATH = Path(__file__).with_name("cuda_sorted.cu")
KERNEL_NAME = "sparse_mla_union_sorted"

THREADS = 1024
MIN_BLOCKS = 2  # __launch_bounds__: two CTAs of 1024 threads per SM (32 registers, no spills: NVRTC check in CI)
UNROLL = 4  # index loads in flight per thread
MAX_GROUP_SIZE = cuda_smem.MAX_GROUP_SIZE  # 16: membership fields of 8 or 16 bits
PASS_SMEM_BYTES = 112 * 1024  # two CTAs per SM on sm_90 (228 KiB per SM, 1 KiB of it reserved per CTA)
MAX_PASSES = 8
MAX_ENTRIES = cuda_smem.MAX_ENTRIES  # G * K per group: int32 entry counters inside the kernel


def source() -> str:
    """The CUDA C++ source of the kernel."""
    return SOURCE_PATH.read_text()


def field_bits(group_size: int) -> int:
    """Membership bits per row in shared memory: 8 for G <= 8, else 16."""
    return 8 if group_size <= 8 else 16


def compile_options(group_size: int, threads: int = THREADS, min_blocks: int = MIN_BLOCKS,
                    unroll: int = UNROLL) -> tuple[str, ...]:
    """NVRTC options (besides the architecture and the C++ standard, which CuPy sets)."""
    return (f"-DSORTED_THREADS={threads}", f"-DSORTED_MIN_BLOCKS={min_blocks}", f"-DSORTED_UNROLL={unroll}",
            f"-DFIELD_BITS={field_bits(group_size)}")


@dataclass(frozen=True)
class SortedPlan:
    """One launch: rows per pass (a multiple of the rows per 16-byte quad of words), dynamic shared memory bytes,
    the passes allowed, and whether the kernel finds each group's window (else [0, N) in one pass)."""

    pass_rows: int
    smem_bytes: int
    max_passes: int
    find_window: bool


def plan_passes(group_size: int, num_kv_rows: int, smem_cap: int = PASS_SMEM_BYTES,
                max_passes: int = MAX_PASSES) -> SortedPlan:
    """Rows per pass: as many as ``smem_cap`` bytes hold, no more than ``num_kv_rows`` need (rows are < N); when
    one pass covers [0, N) the kernel skips finding each group's window."""
    per_quad = 4 * 32 // field_bits(group_size)
    cap_quads = max(1, smem_cap // 16)
    need_quads = -(-max(1, num_kv_rows) // per_quad)
    quads = min(cap_quads, need_quads)
    return SortedPlan(quads * per_quad, quads * 16, max_passes, need_quads > cap_quads)


_KERNELS: dict[tuple[int, tuple[str, ...]], object] = {}


def get_kernel(device_index: int, options: tuple[str, ...]):
    """The compiled kernel (CuPy ``RawKernel``) for a device and options, compiled on first use
    (``cuda_smem.compiled_raw_kernel``)."""
    return cuda_smem.compiled_raw_kernel(_KERNELS, device_index, source, KERNEL_NAME, options)


@dataclass(frozen=True)
class LaunchConfig:
    """One launch: grid (groups), block, dynamic shared memory, the kernel's arguments in order (numpy scalars:
    pointers as uint64), and the pass plan."""

    grid: int
    block: int
    smem_bytes: int
    args: tuple
    plan: SortedPlan


def launch_config(indices: torch.Tensor, group_size: int, topk_length: torch.Tensor | None, num_kv_rows: int,
                  rows: torch.Tensor, bits: torch.Tensor, lengths: torch.Tensor, smem_cap: int, max_passes: int,
                  threads: int = THREADS) -> LaunchConfig:
    """The launch of ``build_sorted`` on any device (the CPU tests run the same arguments through the kernel's source
    compiled for the host, tests/testlib/cuda_emulation.py)."""
    T, K = indices.shape
    plan = plan_passes(group_size, num_kv_rows, smem_cap, max_passes)
    import numpy as np

    args = (
        np.uint64(indices.data_ptr()), np.uint64(topk_length.data_ptr() if topk_length is not None else 0),
        np.uint64(rows.data_ptr()), np.uint64(bits.data_ptr()), np.uint64(lengths.data_ptr()),
        np.int64(indices.stride(0)), np.int64(rows.stride(0)), np.int64(num_kv_rows),
        np.int32(T), np.int32(K), np.int32(group_size), np.int32(group_size * K), np.int32(plan.pass_rows),
        np.int32(plan.max_passes), np.int32(plan.find_window), np.int32(topk_length is not None),
    )
    return LaunchConfig(-(-T // group_size), threads, plan.smem_bytes, args, plan)


def build_sorted(indices: torch.Tensor, group_size: int, topk_length: torch.Tensor | None, num_kv_rows: int, *,
                 smem_cap: int | None = None, max_passes: int | None = None):
    """Sorted unions of token-major groups, or None when some group's rows span too wide a window.

    Args (validated by ``build_group_union``; CUDA tensors on one device):
        indices: [T, K] int32, last dim contiguous; entries < 0, >= num_kv_rows or past topk_length are padding.
        group_size: G, 1..16.
        topk_length: [T] int32 contiguous or None.
        num_kv_rows: N (up to 2**31).
        smem_cap, max_passes: shared memory per pass and passes allowed (default ``PASS_SMEM_BYTES``,
            ``MAX_PASSES``; tests shrink them to force several passes and the fallback); the pass never asks for
            more than the device allows per block.

    Returns:
        (rows, bits, lengths): [ceil(T / G), G * K] int32 rows sorted ascending, -1 after lengths; membership
        words, 0 after lengths; [ceil(T / G)] int32. None: a group needed more than ``max_passes`` passes.
        Synchronizes once (the fallback check).

    Raises:
        ValueError: G out of range, G * K past ``MAX_ENTRIES``, tensors not on a CUDA device, indices' last dim
            or topk_length not contiguous.
    """
    dev = indices.device
    if dev.type != "cuda":
        raise ValueError(f"the sorted CUDA union builder needs CUDA tensors, got {dev}")
    if not 1 <= group_size <= MAX_GROUP_SIZE:
        raise ValueError(f"group_size must be in [1, {MAX_GROUP_SIZE}], got {group_size}")
    T, K = indices.shape
    if group_size * K > MAX_ENTRIES:
        raise ValueError(f"G * K = {group_size * K} entries per group exceed {MAX_ENTRIES}")
    if indices.stride(1) != 1:
        raise ValueError(f"indices must have a contiguous last dim, got strides {tuple(indices.stride())}")
    if topk_length is not None and not topk_length.is_contiguous():
        raise ValueError("topk_length must be contiguous")
    n_groups = -(-T // group_size)
    width = group_size * K
    rows = torch.empty(n_groups, width, dtype=torch.int32, device=dev)
    bits = torch.empty(n_groups, width, dtype=torch.int32, device=dev)
    lengths = torch.empty(n_groups, dtype=torch.int32, device=dev)
    if n_groups == 0:
        return rows, bits, lengths
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    kern = get_kernel(idx, compile_options(group_size))
    device_cap = (cuda_smem.max_smem_per_block(idx) - kern.shared_size_bytes) // 16 * 16
    cap = min(PASS_SMEM_BYTES if smem_cap is None else smem_cap, device_cap)
    cfg = launch_config(indices, group_size, topk_length, num_kv_rows, rows, bits, lengths, cap,
                        MAX_PASSES if max_passes is None else max_passes)
    cuda_smem.launch_on(kern, idx, (cfg.grid, ), (cfg.block, ), cfg.smem_bytes, cfg.args,
                        torch.cuda.current_stream(idx).cuda_stream)
    if int(lengths.min()) < -1:  # the one sync: some window was too wide
        return None
    return rows, bits, lengths


__all__ = ["LaunchConfig", "MAX_PASSES", "PASS_SMEM_BYTES", "SortedPlan", "build_sorted", "compile_options",
           "field_bits", "launch_config", "plan_passes", "source"]
