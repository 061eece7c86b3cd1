"""Overlap statistics of top-k lists: the union ratio that decides whether grouping pays.

Union ratio of a group of G consecutive queries = (distinct valid rows in the union of their
lists) / (mean number of valid rows per query of the group): 1 when all lists are equal, G when
they are disjoint (docs/DESIGN.md "Grouped execution"; the grouped kernel gathers the union once).

Plain torch (sort-based, vectorized), no Triton: runs on any device without the interpreter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .traces import TopkTrace, load_trace

_BIG = torch.iinfo(torch.int64).max
_CHUNK_ELEMS = 1 << 23


@dataclass(frozen=True)
class UnionStats:
    """Union statistics of the complete groups of one top-k tensor at one group size.

    Attributes:
        group_size: G.
        num_groups: complete groups with at least one valid row (those the figures average).
        ratio_mean: mean over groups of union_rows / mean valid rows per query (NaN if no group).
        ratio_p50, ratio_p90, ratio_max: the distribution of that per-group ratio.
        union_rows_mean: mean union size per group, rows.
        valid_mean: mean valid rows per query over the grouped queries.
        per_group: [num_groups] float64 per-group ratios, on the input's device.
    """

    group_size: int
    num_groups: int
    ratio_mean: float
    ratio_p50: float
    ratio_p90: float
    ratio_max: float
    union_rows_mean: float
    valid_mean: float
    per_group: torch.Tensor


def _group_starts(T: int, G: int, cu_seqlens_q: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    if cu_seqlens_q is None:
        return torch.arange(0, T - T % G, G, device=device, dtype=torch.int64)
    cu = cu_seqlens_q.to(torch.int64).cpu()
    if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != T or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens_q must be [B + 1] non-decreasing from 0 to T = {T}, got {cu.tolist()}")
    starts = [torch.arange(int(a), int(b) - (int(b) - int(a)) % G, G) for a, b in zip(cu[:-1], cu[1:])]
    return torch.cat(starts).to(device)


def union_ratio(
    indices: torch.Tensor,
    valid: torch.Tensor | None = None,
    group_size: int = 8,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
) -> UnionStats:
    """Union ratio of groups of ``group_size`` consecutive queries.

    Groups are queries [g * G, g * G + G) (token-major), or with ``cu_seqlens_q`` the same inside
    each request (groups never span requests); a trailing group of fewer than G queries is left
    out, as are groups with no valid row.

    Args:
        indices: [T, K] (or FlashMLA's [T, 1, K]) integer rows, any device; entries < 0 are
            padding. The valid rows of one query are assumed distinct (top-k guarantees it).
        valid: optional [T] integer counts: only the first valid[t] entries of row t count
            (``topk_length``); values in [0, K].
        group_size: G >= 1.
        cu_seqlens_q: optional [B + 1] integer request boundaries (0 .. T, non-decreasing).

    Returns:
        ``UnionStats`` (ratios are dimensionless: rows / rows).

    Raises:
        TypeError: indices / valid not integer tensors, group_size not an int.
        ValueError: wrong shapes, valid outside [0, K], group_size < 1, bad cu_seqlens_q.
    """
    if not isinstance(indices, torch.Tensor) or indices.dtype.is_floating_point or indices.dtype == torch.bool:
        raise TypeError(f"indices must be an integer tensor [T, K], got {getattr(indices, 'dtype', type(indices).__name__)}")
    if indices.dim() == 3 and indices.shape[1] == 1:
        indices = indices[:, 0]
    if indices.dim() != 2:
        raise ValueError(f"indices must be [T, K] or [T, 1, K], got shape {tuple(indices.shape)}")
    if not isinstance(group_size, int) or isinstance(group_size, bool):
        raise TypeError(f"group_size must be an int, got {type(group_size).__name__}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    T, K = indices.shape
    dev = indices.device
    counted = indices >= 0
    if valid is not None:
        if not isinstance(valid, torch.Tensor) or valid.dtype.is_floating_point or valid.dtype == torch.bool:
            raise TypeError(f"valid must be an integer tensor [T], got {getattr(valid, 'dtype', type(valid).__name__)}")
        if valid.shape != (T,):
            raise ValueError(f"valid must be [T] = [{T}], got shape {tuple(valid.shape)}")
        valid = valid.to(dev)
        if T and (int(valid.min()) < 0 or int(valid.max()) > K):
            raise ValueError(f"valid must be in [0, K = {K}], got range [{int(valid.min())}, {int(valid.max())}]")
        counted &= torch.arange(K, device=dev)[None, :] < valid[:, None]
    G = group_size
    starts = _group_starts(T, G, cu_seqlens_q, dev)
    n_valid = counted.sum(dim=1)
    keys = torch.where(counted, indices.to(torch.int64), _BIG)
    unions, means = [], []
    per = max(1, _CHUNK_ELEMS // max(1, G * K))
    ar_g = torch.arange(G, device=dev)
    for i in range(0, starts.numel(), per):
        rows = starts[i:i + per, None] + ar_g[None, :]  # [n, G] query indices
        sv = keys[rows].reshape(rows.shape[0], G * K).sort(dim=1).values
        distinct = sv != _BIG
        distinct[:, 1:] &= sv[:, 1:] != sv[:, :-1]
        unions.append(distinct.sum(dim=1))
        means.append(n_valid[rows].to(torch.float64).mean(dim=1))
    if unions:
        union = torch.cat(unions).to(torch.float64)
        mean_valid = torch.cat(means)
    else:
        union = mean_valid = torch.zeros(0, dtype=torch.float64, device=dev)
    keep = mean_valid > 0
    union, mean_valid = union[keep], mean_valid[keep]
    ratio = union / mean_valid
    if ratio.numel() == 0:
        nan = float("nan")
        return UnionStats(G, 0, nan, nan, nan, nan, nan, nan, ratio)
    q = torch.quantile(ratio, torch.tensor([0.5, 0.9], dtype=torch.float64, device=dev))
    return UnionStats(G, ratio.numel(), float(ratio.mean()), float(q[0]), float(q[1]), float(ratio.max()),
                      float(union.mean()), float(mean_valid.mean()), ratio)


TOPK_STATS_COLUMNS = ("layer", "tokens", "topk", "valid_mean", "G", "groups", "union_rows",
                      "ratio_mean", "ratio_p50", "ratio_p90", "ratio_max")


def topk_stats(
    traces_or_indices: TopkTrace | Sequence[TopkTrace] | torch.Tensor,
    group_sizes: Sequence[int] = (2, 4, 8, 16),
    *,
    valid: torch.Tensor | None = None,
) -> list[dict]:
    """Union-ratio table of top-k lists: one row per (layer, G).

    Args:
        traces_or_indices: a ``TopkTrace``, a sequence of them (``load_trace``), or an indices
            tensor [T, K] (with optional ``valid`` [T]; its rows get layer None).
        group_sizes: the G values, each >= 1.

    Returns:
        list of dicts with the keys of ``TOPK_STATS_COLUMNS``: layer (int or None), tokens (T),
        topk (K), valid_mean (rows per query), G, groups (complete groups counted), union_rows
        (mean rows per group), ratio_mean / ratio_p50 / ratio_p90 / ratio_max (union ratio, lists).

    Raises:
        TypeError / ValueError: as ``union_ratio``, or an empty trace list.
    """
    if isinstance(traces_or_indices, torch.Tensor):
        items = [(None, traces_or_indices, valid)]
    elif isinstance(traces_or_indices, TopkTrace):
        items = [(traces_or_indices.layer, traces_or_indices.topk, traces_or_indices.valid)]
    else:
        traces = list(traces_or_indices)
        if not traces or not all(isinstance(t, TopkTrace) for t in traces):
            raise TypeError("traces_or_indices must be a tensor, a TopkTrace or a non-empty sequence of TopkTrace")
        items = [(t.layer, t.topk, t.valid) for t in traces]
    out = []
    for layer, topk, val in items:
        if topk.dim() == 3 and topk.shape[1] == 1:
            topk = topk[:, 0]
        for G in group_sizes:
            st = union_ratio(topk, val, G)
            out.append({
                "layer": layer, "tokens": topk.shape[0], "topk": topk.shape[1], "valid_mean": st.valid_mean,
                "G": G, "groups": st.num_groups, "union_rows": st.union_rows_mean, "ratio_mean": st.ratio_mean,
                "ratio_p50": st.ratio_p50, "ratio_p90": st.ratio_p90, "ratio_max": st.ratio_max,
            })
    return out


def topk_stats_table(path: str, group_sizes: Sequence[int] = (2, 4, 8, 16)) -> list[dict]:
    """``topk_stats`` of a trace file (.pt or .safetensors, see ``load_trace``), for the CLI
    command ``sparse-mla topk-stats FILE``. Columns: ``TOPK_STATS_COLUMNS``.

    Raises:
        FileNotFoundError, ValueError, TypeError: from ``load_trace`` / ``union_ratio``.
    """
    return topk_stats(load_trace(path), group_sizes)
