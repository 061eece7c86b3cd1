"""Choosing between the per-token and the grouped sparse MQA kernels (plain Python, CPU-testable).

Thresholds live here, in one table, with where they came from (NOTES-GPU.md has the runs).
"""

from __future__ import annotations

from .workspace import default_group_size

METHODS = ("auto", "per_token", "grouped")

# Overlap guard: a group whose union holds more than this many of its mean list length goes per
# token. Measured break-even at 16 heads, G = 8, with the Gluon grouped tile against the per-token
# Triton kernel (results/bench-none.json, rev 25cb24a: 16K tokens, no-overlap lists, union ratio 4.26,
# grouped 9.68-9.81 ms vs per token 9.00-9.13 ms; with the "mid" lists' 1.35 at 5.03-5.17 ms, the
# grouped step crosses per token near 3.8 lists): 3.8 of 8 lists, expressed as a fraction of G (the
# no-overlap union) so that it carries over to other G (G = 4: per token runs a half-empty 64-row
# Gluon tile, break-even ~2 lists), never below GUARD_MIN_LISTS, the guard G = 2 (64 heads, per-token
# tiles already full) had before (5.8 / 8 * 2; the first, published break-even was 5.8 of 8 lists).
GUARD_FRACTION_OF_G = 3.8 / 8
GUARD_MIN_LISTS = 1.45

# method="auto" groups only when a tile holds at least this many queries (G = 128 // H).
MIN_GROUP_SIZE_FOR_AUTO = 2

# Measured on the H200 (results/tune-v2.json, NOTES-GPU.md; H = 16, T = 16K, topk 2048): the
# grouped attention alone beats per token (5.6 vs 8.3 ms at union ratio 1.13), but with the union
# build (3.5 ms) the grouped step is slower at every overlap measured (9.5 vs 8.3 ms). Until the
# union build is faster, "auto" runs per token; method="grouped" forces grouping.
AUTO_GROUPS = False


def overlap_guard_ratio(group_size: int) -> float:
    """Union rows / mean valid rows per query above which a group runs per token
    (``GUARD_FRACTION_OF_G * group_size``, at least ``GUARD_MIN_LISTS``)."""
    return max(GUARD_FRACTION_OF_G * group_size, GUARD_MIN_LISTS)


def resolve_method(method: str, num_heads: int, num_tokens: int) -> tuple[str, str]:
    """Map ``method`` ("auto", "per_token", "grouped") to the kernel that runs, with the reason.

    Raises:
        ValueError: an unknown method name.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method != "auto":
        return method, "forced by method="
    G = default_group_size(num_heads)
    if not AUTO_GROUPS:
        return "per_token", "grouped step measured slower than per token on the H200 (union build cost; NOTES-GPU.md)"
    if G < MIN_GROUP_SIZE_FOR_AUTO:
        return "per_token", f"H = {num_heads} fills a 128-row tile alone (G = {G})"
    if num_tokens < G:
        return "per_token", f"T = {num_tokens} < G = {G}: no full group"
    return "grouped", f"G = {G} queries per tile; groups over the overlap guard run per token"
