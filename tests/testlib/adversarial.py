"""Adversarial inputs: index sentinels, rows with no valid entry, garbage past ``topk_length``, union hash collisions."""

from __future__ import annotations

import torch

from testlib.device import INT_MAX, INT_MIN
from testlib.problems import distinct_rows

# Per-token patterns cycled by ``adversarial_indices``; each is a way a row can be padding.
PATTERNS = ("clean", "pad_end", "pad_middle", "sentinels", "all_invalid")


def adversarial_indices(T: int, K: int, N: int, *, patterns=PATTERNS, generator=None,
                        base: torch.Tensor | None = None) -> torch.Tensor:
    """[T, K] int32 (CPU): distinct valid rows in [0, N), then token t gets ``patterns[t % len]``:

    * ``clean``: untouched.
    * ``pad_end``: the last third is -1 (FlashMLA's padding).
    * ``pad_middle``: every third entry is -1, valid entries on both sides.
    * ``sentinels``: INT_MIN, -2, N, N + 1 and INT_MAX at spread positions (all padding: < 0 or >= N;
      values >= N that do not fit int32 are replaced by negative ones).
    * ``all_invalid``: no valid entry (out must be 0, lse -inf).

    ``base`` (a [T, K] list of distinct rows) replaces the random draw, e.g. ``neighbour_rows``.
    """
    idx = distinct_rows(T, K, N, generator=generator) if base is None else base.clone().to(torch.int32).cpu()
    for t in range(T):
        kind = patterns[t % len(patterns)]
        if kind == "clean":
            continue
        if kind == "pad_end":
            idx[t, K - max(1, K // 3):] = -1
        elif kind == "pad_middle":
            idx[t, 1::3] = -1
        elif kind == "sentinels":
            pos = torch.linspace(0, K - 1, 5).round().long()
            high = [v for v in (N, N + 1, INT_MAX) if v <= INT_MAX]  # >= N, where int32 has such values
            vals = [INT_MIN, -2] + high + [-3, -4, -5][: 3 - len(high)]
            idx[t, pos] = torch.tensor(vals, dtype=torch.int32)
        elif kind == "all_invalid":
            high = N if N <= INT_MAX else -7
            idx[t] = torch.tensor([-1, INT_MIN, high, INT_MAX if N <= INT_MAX else -8], dtype=torch.int32).repeat(K // 4 + 1)[:K]
        else:
            raise ValueError(f"unknown pattern {kind!r}")
    return idx


def garbage_topk_length(indices: torch.Tensor, N: int, *, generator=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices', topk_length) [T, K], [T] int32 (CPU): lengths cycle through 0, 1, K // 2, K - 1, K and
    everything past a length is garbage that would change the result if read: rows >= N, INT_MAX,
    repeats of the token's own earlier rows, and valid rows outside its list."""
    T, K = indices.shape
    idx = indices.clone()
    choices = [0, 1, K // 2, K - 1, K]
    lengths = torch.tensor([choices[t % len(choices)] for t in range(T)], dtype=torch.int32)
    for t in range(T):
        n = int(lengths[t])
        for j in range(n, K):
            r = (j - n) % 4
            if r == 0:
                idx[t, j] = N + j
            elif r == 1:
                idx[t, j] = INT_MAX
            elif r == 2 and n > 0 and int(idx[t, 0]) >= 0:
                idx[t, j] = idx[t, 0]  # a repeat: counted twice if read
            else:
                idx[t, j] = int(torch.randint(0, N, (1,), generator=generator))
    return idx, lengths


def union_hash_slot(rows: torch.Tensor, log_slots: int) -> torch.Tensor:
    """The home slot of each row in the union builder's hash table (mirrors ``_build_union_hash_kernel``:
    Fibonacci hashing, ``(row * 0x9E3779B1 mod 2**32) >> (32 - log_slots)``)."""
    return ((rows.long() * 0x9E3779B1) % 2**32) >> (32 - log_slots)


def colliding_rows(n: int, log_slots: int, slot: int, limit: int) -> torch.Tensor:
    """[n] int32: the n smallest rows in [0, limit) whose home slot is ``slot`` (all collide, so the
    builder probes a chain of n slots; with slot = 2**log_slots - 1 the chain wraps to slot 0)."""
    cand = torch.arange(limit, dtype=torch.int64)
    hits = cand[union_hash_slot(cand, log_slots) == slot]
    if hits.numel() < n:
        raise ValueError(f"only {hits.numel()} rows below {limit} hash to slot {slot}; raise limit")
    return hits[:n].to(torch.int32)

