"""The layer's staged route for an FP8 cache: the rows of every request's window dequantized to q's dtype, the
indices moved onto them, then the bf16 / fp16 MQA paths (``sparse_mla.kv_staging`` has the kernel and the rule).

A window holds the rows a step can read (request b's positions 0 .. cached_b + new_b - 1), so staging the windows
stages exactly what the attention may gather, as engines do before a bf16-only kernel; the result is the layer
definition on the dequantized cache (``sparse_mla.layer.reference``), the same numbers the in-kernel route reads.
"""

from __future__ import annotations

import dataclasses

import torch

from ..kv_staging import dequantize_rows
from .host import to_device_async
from .problem import DSAPrefillProblem, causal_sums, token_windows, window_rows


def window_rows_total(p: DSAPrefillProblem) -> int:
    """Rows of all request windows (what ``stage_windows`` dequantizes)."""
    return sum(p.step.windows)


def fp8_route_rows(p: DSAPrefillProblem) -> tuple[int, int]:
    """(staged rows, list rows) of an FP8 step, what ``kv_staging.choose_kv_dequant`` weighs: the rows of all
    request windows, and the valid entries of every token's list (top-k within its causal window)."""
    keys = sum(causal_sums(c, n, p.step.topk) for c, n in zip(p.step.cached_lens, p.step.new_lens))
    return window_rows_total(p), keys


def stage_windows(p: DSAPrefillProblem) -> DSAPrefillProblem:
    """The same step on plain rows in q's dtype: every request window's rows of the FP8 cache dequantized
    (``kv_staging.dequantize_rows``), packed request by request, and each valid index moved to its row there
    (entries outside the token's window become -1, which the layer semantics ignore anyway).

    Args:
        p: a validated problem with an FP8 ``kv_format``.

    Returns:
        a problem with kv_format None, kv rows [sum of windows, r + qk_rope] in q's dtype (a new buffer),
        row_offsets = where each window starts in it, and int32 indices onto those rows (adjacent windows, the
        packed layout: the same indices shifted by the first window's row, no pass at all from row 0; others:
        remapped, entries outside the token's window -1).

    Raises:
        ValueError: p has no kv_format (nothing to dequantize).
    """
    if p.kv_format is None:
        raise ValueError("stage_windows needs an FP8 cache (kv_format), got plain rows")
    dev = p.q_nope.device
    rows, starts = window_rows(p)
    r = p.step.kv_lora_rank
    step = dataclasses.replace(p.step, kv_format=None)
    kv = dequantize_rows(p.kv_rows, p.q_nope.dtype, rows)
    if isinstance(rows, slice):  # adjacent windows (one request always): the indices shifted by the first row
        row0 = rows.start
        # an entry outside its token's window stays outside it (the MQA paths pad it: restrict_to_windows)
        idx = p.indices if row0 == 0 else torch.where(p.indices >= row0, p.indices - row0, -1)
        return dataclasses.replace(p, kv_c=kv[:, :r], k_pe=kv[:, r:], kv_rows=kv, indices=idx,
                                   row_offsets=tuple(starts), step=step, kv_format=None)
    lo, win = token_windows(p.step.new_lens, p.step.cached_lens, p.row_offsets, dev)
    start = torch.repeat_interleave(torch.tensor(starts, dtype=torch.int64), torch.tensor(p.step.new_lens))
    shift = (to_device_async(start, dev) - lo)[:, None]
    inside = (p.indices >= lo[:, None]) & (p.indices < (lo + win)[:, None])
    idx = torch.where(inside, p.indices + shift, -1).to(torch.int32)
    return dataclasses.replace(p, kv_c=kv[:, :r], k_pe=kv[:, r:], kv_rows=kv, indices=idx, row_offsets=tuple(starts),
                               step=step, kv_format=None)


__all__ = ["fp8_route_rows", "stage_windows", "window_rows_total"]
