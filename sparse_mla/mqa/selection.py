"""The method of ``sparse_mla_fwd(method="auto")``: per-token or grouped sparse MQA (plain Python, CPU-testable).

This module holds that one decision (``resolve_method``, ``AUTO_GROUPS``, ``MIN_GROUP_SIZE_FOR_AUTO``); the layer's
path, the attention backend and the union builder are decided elsewhere (docs/decisions.md lists each with its
switch and result file).
"""

from __future__ import annotations

from ..union.grouping import default_group_size

METHODS = ("auto", "per_token", "grouped")

# method="auto" groups only when a tile holds at least this many queries (G = 128 // H).
MIN_GROUP_SIZE_FOR_AUTO = 2

# Measured on the H200 (results/tune-v2.json, NOTES-GPU.md; H = 16, T = 16K, topk 2048): the
# grouped attention alone beats per token (5.6 vs 8.3 ms at union ratio 1.13), but with the union
# build (3.5 ms) the grouped step is slower at every overlap measured (9.5 vs 8.3 ms). Until the
# union build is faster, "auto" runs per token; method="grouped" forces grouping.
AUTO_GROUPS = False


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
