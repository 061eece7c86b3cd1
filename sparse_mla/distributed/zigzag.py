"""Zigzag split of a step's token rows over the ranks of a tensor-parallel group (ShardQ).

The T token rows of a step are cut into 2W contiguous chunks (W = world size) whose sizes
differ by at most one (chunk c is rows ``[c * T // 2W, (c + 1) * T // 2W)``); rank r takes chunk r
and chunk 2W - 1 - r, an early and a late one.

Why zigzag (causal balance): in causal prefill the work of a query grows with its position
(dense causal attention, or sparse attention while the visible prefix is shorter than topk: work
is proportional to position + 1). With cost(t) = t + 1 and chunks of L rows, chunk c costs
L^2 c + L (L + 1) / 2, so rank r's two chunks cost L^2 (2W - 1) + L (L + 1): the same for every
rank. With chunk edges rounded down to whole rows the ranks' costs differ by less than the cost of
the step's last row (T + 1; checked for T < 3000, W <= 16), and their row counts by at most 2. Once positions pass
topk the per-query cost is flat (topk rows each), so any equal-count split balances it; the first
topk positions of a prompt are then the only cheap ones, and the ranks' costs differ by at most
about topk^2 / 2 row-visits (a fraction about topk * W / (2 T) of a rank's share).

Several requests per step: the split is over the flat rows of all requests, ignoring request
boundaries. That is correct because each query keeps its own top-k row of ``indices`` (and its own
``topk_length``): a rank computes exactly the per-token definition for the rows it holds, and no
row needs another row of its request. Balance then holds per step in the same sense as above.

Everything here is pure torch / Python, device-agnostic, and needs no communication.
"""

from __future__ import annotations

import torch

Chunk = tuple[int, int]  # (start row, number of rows)


def _check_sizes(num_tokens: int, world_size: int) -> None:
    for name, v, lo in (("num_tokens", num_tokens, 0), ("world_size", world_size, 1)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be a Python int, got {type(v).__name__}")
        if v < lo:
            raise ValueError(f"{name} must be >= {lo}, got {v}")


def zigzag_chunks(num_tokens: int, world_size: int) -> list[tuple[Chunk, Chunk]]:
    """The two (start, length) row ranges of every rank.

    Args:
        num_tokens: T >= 0, the step's token rows to split (real rows only: leave CUDA-graph
            padding rows out).
        world_size: W >= 1 ranks.

    Returns:
        W pairs ``((start_a, len_a), (start_b, len_b))``: rank r's chunk r and chunk 2W - 1 - r
        of the 2W chunks ``[c * T // 2W, (c + 1) * T // 2W)``. Lengths differ by at most 1; when
        T < 2W some are 0. For W = 1 rank 0 holds chunk 0 then chunk 1, i.e. rows 0..T-1 in order.

    Raises:
        TypeError: a non-int argument. ValueError: num_tokens < 0 or world_size < 1.
    """
    _check_sizes(num_tokens, world_size)
    n_chunks = 2 * world_size
    edges = [c * num_tokens // n_chunks for c in range(n_chunks + 1)]
    chunk = [(edges[c], edges[c + 1] - edges[c]) for c in range(n_chunks)]
    return [(chunk[r], chunk[n_chunks - 1 - r]) for r in range(world_size)]


def zigzag_partition(num_tokens: int, world_size: int, *, device: torch.device | str | None = None) -> list[torch.Tensor]:
    """Row indices of every rank under the zigzag split (see the module docstring).

    Args:
        num_tokens: T >= 0 rows. world_size: W >= 1.
        device: where the index tensors live (default CPU).

    Returns:
        W int64 tensors; tensor r lists rank r's rows ascending (chunk r, then chunk 2W - 1 - r),
        [T_r] with sum T_r = T. Every row 0..T-1 appears in exactly one tensor; T_r differ by at
        most 2 between ranks.

    Raises:
        TypeError, ValueError: as ``zigzag_chunks``.
    """
    parts = []
    for (sa, la), (sb, lb) in zigzag_chunks(num_tokens, world_size):
        idx = torch.cat([torch.arange(sa, sa + la), torch.arange(sb, sb + lb)])
        parts.append(idx.to(device=device or "cpu", dtype=torch.int64))
    return parts


def zigzag_inverse(num_tokens: int, world_size: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """The permutation that restores token order after the zigzag split.

    With ``order = torch.cat(zigzag_partition(T, W))`` (rank 0's rows, then rank 1's, ...; the
    order in which an all-to-all concatenates the ranks' results), ``order[inverse] == arange(T)``,
    so ``x_in_token_order = x_in_rank_order[inverse]`` for any tensor whose dim 0 is in that order.

    Args:
        num_tokens: T >= 0. world_size: W >= 1. device: where the result lives (default CPU).

    Returns:
        [T] int64 permutation.

    Raises:
        TypeError, ValueError: as ``zigzag_chunks``.
    """
    order = torch.cat(zigzag_partition(num_tokens, world_size))
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(num_tokens, dtype=torch.int64)
    return inverse.to(device or "cpu")


__all__ = ["zigzag_chunks", "zigzag_partition", "zigzag_inverse"]
