"""The union's public inspection function, ``build_group_union`` (``sparse_mla.build_group_union``): the per-group
union of top-k lists with membership bits, sorted, as a ``GroupUnion``. Not on the step path (``sparse_mla_fwd``
builds its unions in a workspace, unsorted)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..checks import check_tensor, require_int, require_kernel_tensor
from . import backends as union_backends
from . import cuda_sorted
from .grouping import MAX_GROUP_SIZE
from .planning import plan_groups
from .workspace import SparseMLAWorkspace

logger = logging.getLogger("sparse_mla")


@dataclass
class GroupUnion:
    """Per-group union of top-k lists (``build_group_union``).

    rows: [num_groups, U] int32, sorted ascending valid rows, -1 after the last.
    member_mask: [num_groups, U] int32, bit i set iff the row is in query i's list.
    lengths: [num_groups] int32, union size per group.
    group_size: G. U = G * K (the no-overlap bound).
    """

    rows: torch.Tensor
    member_mask: torch.Tensor
    lengths: torch.Tensor
    group_size: int


def validate_group_union_args(indices: object, group_size: object, topk_length: object, num_kv_rows: object,
                              max_group_size: int) -> tuple[torch.Tensor, int, torch.Tensor | None, int]:
    """The arguments of ``build_group_union``, checked before any launch.

    Returns:
        (indices [T, K] view, G, topk_length contiguous or None, N bound: num_kv_rows or 2**31 - 1).

    Raises:
        TypeError: a non-tensor or non-int32 indices / topk_length, a group_size or num_kv_rows that is
            not an int (a bool or a float is refused).
        ValueError: indices not [T, K] / [T, 1, K] with K >= 1, group_size outside [1, max_group_size],
            topk_length not [T] on indices' device, num_kv_rows < 1.
    """
    indices = check_tensor("indices", indices, dims="[T, K] or [T, 1, K]", dtype=torch.int32)
    if indices.dim() == 3 and indices.shape[1] == 1:
        indices = indices[:, 0]
    if indices.dim() != 2 or indices.shape[1] < 1:
        raise ValueError(f"indices must be [T, K] or [T, 1, K] with K >= 1, got shape {list(indices.shape)}")
    G = require_int("group_size", group_size, minimum=1, maximum=max_group_size)
    T = indices.shape[0]
    if topk_length is not None:
        topk_length = check_tensor("topk_length", topk_length, dims="[T]", shape=(T,), dtype=torch.int32,
                                   device=indices.device).contiguous()
    N = 2**31 - 1 if num_kv_rows is None else require_int("num_kv_rows", num_kv_rows, minimum=1)
    return indices, G, topk_length, N


def build_group_union(
    indices: torch.Tensor,
    group_size: int,
    *,
    topk_length: torch.Tensor | None = None,
    num_kv_rows: int | None = None,
) -> GroupUnion:
    """Union of the top-k lists of ``group_size`` consecutive queries (token-major groups).

    Args:
        indices: [T, K] (or [T, 1, K]) int32 rows on CUDA (or CPU under TRITON_INTERPRET=1);
            negative entries, entries past topk_length and entries >= num_kv_rows are padding.
        group_size: G, 1..16; group g holds queries g*G .. g*G + G - 1; the last may be short.
        topk_length: optional [T] int32.
        num_kv_rows: N; rows >= N are dropped (default: no upper bound, 2**31 - 1).

    Returns:
        GroupUnion with rows / member_mask [ceil(T / G), G * K] int32 and lengths [ceil(T / G)]. Synchronizes with the
        device once: the step builder's unsorted unions are sorted in torch (the longest union sizes the sort). With
        ``SPARSE_MLA_UNION_SORTED=1`` on a GPU that runs the CUDA builders, they come sorted from ``cuda_sorted``'s
        kernel instead (the sync checks that no group's rows spread too wide for it; such a call is built the first
        way, a second sync).

    Raises:
        TypeError: non-tensor or non-int32 indices / topk_length, a group_size or num_kv_rows that is not
            an int (``validate_group_union_args``). ValueError: bad shapes or devices,
            group_size out of range, num_kv_rows < 1, CPU tensors without TRITON_INTERPRET=1,
            SPARSE_MLA_UNION_SORTED neither 0 nor 1.
    """
    indices, group_size, topk_length, N = validate_group_union_args(indices, group_size, topk_length, num_kv_rows,
                                                                    MAX_GROUP_SIZE)
    T, K = indices.shape
    require_kernel_tensor("indices", indices)
    indices = indices.contiguous()
    n_groups = -(-T // group_size)
    builder = union_backends.choose_inspection_builder(indices.device, group_size, K)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("build_group_union: builder %s (%s)", *builder)
    if T > 0 and builder.name == "cuda_sorted":
        built = cuda_sorted.build_sorted(indices, group_size, topk_length, N)
        if built is not None:
            return GroupUnion(*built, group_size)
    ws = SparseMLAWorkspace(max(T, 1), K, group_size, N, indices.device)
    gs, gl, ul = ws.group_start[:n_groups], ws.group_len[:n_groups], ws.union_len[:n_groups]
    rows, bits = ws.union_rows[:n_groups], ws.union_bits[:n_groups]
    if T > 0:
        plan_groups(T, group_size, None, gs, gl, ws.route[:T])
        union_backends.build_union(indices, topk_length, N, group_size, gs, gl, ws.route[:T], ws, rows, bits, ul,
                                   complete=True)
    # The kernel's union is unsorted, in the first union_len slots of each row; this inspection API returns it
    # sorted, -1 / 0 after the end. Only the first P columns are sorted (P: the longest union rounded up to a
    # power of two, read back with one sync), in place in the workspace's rows, which are returned.
    if n_groups > 0:
        longest = int(ul.max())
        P = min(rows.shape[1], 1 << max(longest - 1, 0).bit_length())
        in_union = torch.arange(P, device=rows.device)[None, :] < ul[:, None].long()
        # stable: a real row 2**31 - 1 sorts before the empty slots that carry the same key
        keys, order = torch.where(in_union, rows[:, :P], torch.iinfo(torch.int32).max).sort(dim=1, stable=True)
        bits[:, :P] = torch.where(in_union, bits[:, :P].gather(1, order), 0)
        rows[:, :P] = torch.where(in_union, keys, -1)
        rows[:, P:].fill_(-1)
        bits[:, P:].fill_(0)
    return GroupUnion(rows, bits, ul, group_size)



__all__ = ["GroupUnion", "build_group_union"]
