"""Group planning (Triton): which query rows form each group of the grouped path.

``plan_groups`` splits the T query rows into groups of G consecutive rows, either within requests
(``cu_seqlens_q`` given: a request's last ``n % G`` rows are routed per token) or token-major over
all rows (the short tail group is kept as a short group). It writes ``group_start``, ``group_len``
and a per-token ``route`` (1 = the per-token kernel computes this token), on the device; with ``probe``
buffers also every ``probe_stride``-th group's start and length (twice: the probe's input and the copy
its union build may zero, ``sparse_mla.union.probe``), in the same launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launch_cache import LaunchCache


@triton.jit(do_not_specialize=["B", "T", "max_groups"])
def _plan_groups_kernel(
    CU, GROUP_START, GROUP_LEN, ROUTE, B, T, max_groups, PROBE_START, PROBE_BEFORE, PROBE_LEN,
    G: tl.constexpr, SHORT_TAIL: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK: tl.constexpr,
    PROBE_STRIDE: tl.constexpr,
):
    b = tl.program_id(0)
    offs_b = tl.arange(0, BLOCK_B)
    if SHORT_TAIL:
        # token-major: one span [0, T), the tail forms a short group
        seq_begin = 0
        seq_end = T
        first_group = 0
        n_groups = tl.cdiv(T, G)
        grouped_end = T
        total_groups = n_groups
    else:
        cu_lo = tl.load(CU + offs_b, mask=offs_b < B, other=0)
        cu_hi = tl.load(CU + 1 + offs_b, mask=offs_b < B, other=0)
        cu_lo = tl.minimum(tl.maximum(cu_lo, 0), T)
        cu_hi = tl.minimum(tl.maximum(cu_hi, cu_lo), T)
        full = (cu_hi - cu_lo) // G
        first_group = tl.sum(tl.where(offs_b < b, full, 0), 0)
        total_groups = tl.sum(full, 0)
        seq_begin = tl.sum(tl.where(offs_b == b, cu_lo, 0), 0)
        seq_end = tl.sum(tl.where(offs_b == b, cu_hi, 0), 0)
        n_groups = (seq_end - seq_begin) // G
        grouped_end = seq_begin + n_groups * G
    for j0 in range(0, n_groups, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        ok = (j < n_groups) & (first_group + j < max_groups)
        start = seq_begin + j * G
        glen = tl.minimum(seq_end - start, G)
        tl.store(GROUP_START + first_group + j, start, mask=ok)
        tl.store(GROUP_LEN + first_group + j, glen, mask=ok)
        if PROBE_STRIDE > 0:
            g = first_group + j
            pm = ok & (g % PROBE_STRIDE == 0)
            tl.store(PROBE_START + g // PROBE_STRIDE, start, mask=pm)
            tl.store(PROBE_BEFORE + g // PROBE_STRIDE, glen, mask=pm)
            tl.store(PROBE_LEN + g // PROBE_STRIDE, glen, mask=pm)
    for t0 in range(seq_begin, seq_end, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        tl.store(ROUTE + t, (t >= grouped_end).to(tl.int8), mask=t < seq_end)
    if b == 0:  # rows before the first request run per token
        for t0 in range(0, tl.minimum(seq_begin, T), BLOCK):
            t = t0 + tl.arange(0, BLOCK)
            tl.store(ROUTE + t, tl.full([BLOCK], 1, tl.int8), mask=t < seq_begin)
    if b == B - 1:  # the last program: rows past the last request run per token; clear unused slots
        for t0 in range(seq_end, T, BLOCK):
            t = t0 + tl.arange(0, BLOCK)
            tl.store(ROUTE + t, tl.full([BLOCK], 1, tl.int8), mask=t < T)
        for j0 in range(total_groups, max_groups, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            ok = j < max_groups
            tl.store(GROUP_START + j, tl.zeros([BLOCK], tl.int32), mask=ok)
            tl.store(GROUP_LEN + j, tl.zeros([BLOCK], tl.int32), mask=ok)
            if PROBE_STRIDE > 0:
                pm = ok & (j % PROBE_STRIDE == 0)
                tl.store(PROBE_START + j // PROBE_STRIDE, tl.zeros([BLOCK], tl.int32), mask=pm)
                tl.store(PROBE_BEFORE + j // PROBE_STRIDE, tl.zeros([BLOCK], tl.int32), mask=pm)
                tl.store(PROBE_LEN + j // PROBE_STRIDE, tl.zeros([BLOCK], tl.int32), mask=pm)


def plan_groups(
    num_tokens: int, group_size: int, cu_seqlens_q: torch.Tensor | None,
    group_start: torch.Tensor, group_len: torch.Tensor, route: torch.Tensor,
    probe: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, probe_stride: int = 0,
) -> None:
    """Fill group_start / group_len ([max_groups] int32) and route ([>= T] int8) on the device.

    ``probe``: (start, len_before, len) [>= ceil(max_groups / probe_stride)] int32, filled with group
    ``i * probe_stride``'s start and length (both len arrays) for every i; None with probe_stride 0: no probe."""
    max_groups = group_start.shape[0]
    if cu_seqlens_q is None:
        B, cu, short_tail = 1, group_start, True
    else:
        B, cu, short_tail = cu_seqlens_q.shape[0] - 1, cu_seqlens_q, False
    p_start, p_before, p_len = probe if probe is not None else (group_start, group_start, group_start)
    stride = probe_stride if probe is not None else 0
    _LAUNCH((short_tail, group_size, triton.next_power_of_2(B), stride), (B, ),
            (cu, group_start, group_len, route, B, num_tokens, max_groups, p_start, p_before, p_len),
            dict(G=group_size, SHORT_TAIL=short_tail, BLOCK_B=triton.next_power_of_2(B), BLOCK=1024,
                 PROBE_STRIDE=stride))


# Launch cache key: the constexprs; the alignment of every pointer (the caller's views and cu_seqlens_q) joins it.
_LAUNCH = LaunchCache(namespace=globals(), name="_plan_groups_kernel", align=(0, 1, 2, 3, 7, 8, 9))
