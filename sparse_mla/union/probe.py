"""Overlap probe: skip the union build of a step whose groups would all fall back to per token.

The grouped path builds every group's union and routes a group per token when its union holds more
than the overlap guard allows (``sparse_mla.union.grouping.overlap_guard_ratio``). When the lists of
neighbouring queries do not overlap at all (the "none" preset), every group falls back, and the
full build is pure overhead on top of the per-token pass (0.6-0.7 ms at 8K-16K tokens on the H200,
7-15% of the step). The probe builds the unions of every ``PROBE_STRIDE``-th planned group first
(into scratch buffers of the workspace) and, if at least ``PROBE_SKIP_FRACTION`` of the probed
non-empty groups were guarded, marks every group empty and every token per token, on the device
(no host sync, no allocation: CUDA-graph safe). The full build then returns at once for every
group. Results stay exact either way: grouped and per-token compute the same definition; only
which kernel computes a token changes (as with the per-group guard).

Steps with fewer than ``PROBE_MIN_GROUPS`` planned groups are not probed (their build is one
short wave). With ``cu_seqlens_q`` the planned slots are the workspace's (``max_groups``, most of them
empty in a short step), so the decision also needs ``PROBE_MIN_GROUPS // PROBE_STRIDE`` non-empty probed
groups (``probe_min_live``), as a token-major step of ``PROBE_MIN_GROUPS`` groups has: a short step under a
large workspace is not sent per token on the word of one group.
Semantics: ``sparse_mla.mqa.interface.sparse_mla_fwd`` (method="grouped").
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..launch_cache import LaunchCache
from . import backends as union_backends

PROBE_STRIDE = 16  # probe groups 0, 16, 32, ...
PROBE_MIN_GROUPS = 64  # planned groups (incl. empty slots) below which no probe runs
PROBE_SKIP_FRACTION = 0.5  # guarded share of the probed non-empty groups at which the step skips grouping


def probe_groups(max_groups: int) -> int:
    """Groups the probe builds for ``max_groups`` planned group slots (0: no probe)."""
    return 0 if max_groups < PROBE_MIN_GROUPS else -(-max_groups // PROBE_STRIDE)


def probe_min_live() -> int:
    """Non-empty probed groups a skip needs: as many as a token-major step of ``PROBE_MIN_GROUPS`` groups probes."""
    return max(1, PROBE_MIN_GROUPS // PROBE_STRIDE)


@triton.jit(do_not_specialize=["n_probe", "n_groups", "n_tokens", "min_live"])
def _probe_decide_apply_kernel(len_before_ptr, len_after_ptr, n_probe, group_len_ptr, n_groups, route_ptr,
                               n_tokens, skip_ptr, skip_fraction, min_live, BLOCK: tl.constexpr):
    """One program: the share of probed non-empty groups that the guard emptied; at or above
    ``skip_fraction``, with at least ``min_live`` non-empty probed groups, group_len[:] = 0 and route[:] = 1.
    skip_ptr[0] records the decision (0 / 1)."""
    offs = tl.arange(0, BLOCK)
    n_live = 0
    n_guarded = 0
    for i0 in range(0, n_probe, BLOCK):
        m = i0 + offs < n_probe
        before = tl.load(len_before_ptr + i0 + offs, mask=m, other=0)
        after = tl.load(len_after_ptr + i0 + offs, mask=m, other=0)
        n_live += tl.sum((before > 0).to(tl.int32), axis=0)
        n_guarded += tl.sum(((before > 0) & (after == 0)).to(tl.int32), axis=0)
    skip = (n_live >= tl.maximum(min_live, 1)) & (n_guarded.to(tl.float32) >= skip_fraction * n_live.to(tl.float32))
    tl.store(skip_ptr, skip.to(tl.int32))
    if skip:
        for g0 in range(0, n_groups, BLOCK):
            tl.store(group_len_ptr + g0 + offs, tl.zeros([BLOCK], tl.int32), mask=g0 + offs < n_groups)
        for t0 in range(0, n_tokens, BLOCK):
            tl.store(route_ptr + t0 + offs, tl.full([BLOCK], 1, tl.int8), mask=t0 + offs < n_tokens)


def probe_buffers(n_groups: int, ws, guard_ratio: float | None):
    """The probe's planning buffers for ``n_groups`` planned groups: (start, len_before, len) views of ``ws``
    that ``plan_groups`` fills (``probe=``, ``probe_stride=PROBE_STRIDE``), or None when no probe runs (no guard,
    fewer than ``PROBE_MIN_GROUPS`` groups, or a workspace too small)."""
    k = probe_groups(n_groups)
    if guard_ratio is None or k == 0 or k > ws.probe_group_start.shape[0]:
        return None
    return ws.probe_group_start[:k], ws.probe_len_before[:k], ws.probe_group_len[:k]


def probe_and_skip(indices, topk_length, num_kv_rows: int, group_size: int, group_start, group_len, route, ws,
                   guard_ratio: float | None, planned=None) -> bool:
    """Run the probe on the planned groups (``plan_groups`` outputs; device tensors of ``ws``); returns
    whether it ran (the decision itself stays on the device, in ``ws.probe_skip[0]``).

    Args:
        indices [T, K] int32, topk_length [T] int32 or None, num_kv_rows: as ``build_union``.
        group_start, group_len: [n_groups] int32 planned groups (views of ``ws``); route: [T] int8.
        ws: the ``SparseMLAWorkspace`` (its probe_* buffers are the scratch).
        guard_ratio: the overlap guard of the step; None (no guard) runs no probe.
        planned: the ``probe_buffers`` that ``plan_groups`` filled in the same launch; None: copied here from
            the planned groups (two small copies).
    """
    n_groups = group_start.shape[0]
    bufs = planned if planned is not None else probe_buffers(n_groups, ws, guard_ratio)
    if bufs is None or guard_ratio is None:
        return False
    p_start, p_before, p_len = bufs
    k = p_start.shape[0]
    if planned is None:
        p_start.copy_(group_start[::PROBE_STRIDE])
        p_before.copy_(group_len[::PROBE_STRIDE])
        p_len.copy_(p_before)
    T = route.shape[0]
    p_route = ws.probe_route[:T]
    union_backends.build_union(indices, topk_length, num_kv_rows, group_size, p_start, p_len, p_route, ws,
                               ws.union_rows, ws.union_bits, ws.probe_union_len[:k], guard_ratio=guard_ratio)
    _DECIDE((), (1, ), (p_before, p_len, k, group_len, n_groups, route, T, ws.probe_skip, PROBE_SKIP_FRACTION,
                        probe_min_live()), dict(BLOCK=1024))
    return True


# Its pointers are workspace views; their alignment joins the launch-cache key.
_DECIDE = LaunchCache(namespace=globals(), name="_probe_decide_apply_kernel", align=(0, 1, 3, 5, 7))


__all__ = ["PROBE_MIN_GROUPS", "PROBE_SKIP_FRACTION", "PROBE_STRIDE", "probe_and_skip", "probe_buffers", "probe_groups",
           "probe_min_live"]
