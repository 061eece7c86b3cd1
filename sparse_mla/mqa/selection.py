"""The method of ``sparse_mla_fwd(method="auto")``: per-token or grouped sparse MQA (plain Python, CPU-testable).

This module holds that one decision; the layer's path, the attention backend and the union builder are decided
elsewhere (docs/decisions.md lists each with its switch and result file).

The rule (``GROUPING_RULES``, one row per heads-per-rank bucket, fitted on an H200 sweep by ``fit_grouping_rules``):
group when the tile holds G = 128 // H >= 2 queries and the step has at least the row's ``min_tokens`` query rows;
otherwise per token. The shape decides on the host (no device data is read); the step's overlap is judged on the
device, where the overlap probe (``sparse_mla.union.probe``) sends a step whose lists barely overlap per token and
the overlap guard (``sparse_mla.union.grouping``) each group whose union is too large, so a grouped call on
no-overlap lists costs about what the per-token call costs. Groups run token-major over all rows without
``cu_seqlens_q`` (a group may span requests: each query keeps its own rows through its membership bit).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..choices import NEVER, Choice, deprecated_alias, line
from ..union.grouping import default_group_size

METHODS = ("auto", "per_token", "grouped")


@dataclass(frozen=True)
class GroupingRule:
    """``method="auto"`` groups steps of at least ``min_tokens`` query rows at up to ``max_heads`` heads."""

    max_heads: int
    min_tokens: int


# results/op-sweep-rule.json (H200; H 8-64; 1K-64K new tokens over a 32K context; mid / low / none / random lists;
# mid with and without cu_seqlens_q): fit_grouping_rules' answer, each limit halfway (geometric) between the last
# measured loss of grouping and the first win from which grouping wins at every larger step.
GROUPING_RULES: tuple[GroupingRule, ...] = (
    GroupingRule(8, 2896),
    GroupingRule(16, 2896),
    GroupingRule(32, 2896),
    GroupingRule(64, NEVER),
    GroupingRule(128, NEVER),
)


def grouping_rule(num_heads: int, rules: tuple[GroupingRule, ...] | None = None) -> GroupingRule:
    """The row of ``rules`` (default ``GROUPING_RULES``) for ``num_heads``: the first with max_heads >= it."""
    rules = rules or GROUPING_RULES
    for r in rules:
        if num_heads <= r.max_heads:
            return r
    return rules[-1]


def choose_method(method: str, num_heads: int, num_tokens: int, group_size: int | None = None,
                  rules: tuple[GroupingRule, ...] | None = None) -> Choice:
    """``Choice(kernel, reason)``: the kernel that runs for ``method`` ("auto", "per_token", "grouped").

    Args:
        method: the caller's method.
        num_heads, num_tokens: H and T of the call.
        group_size: the caller's G (default ``default_group_size(H)``).
        rules: the rule table (default ``GROUPING_RULES``; the fit tries candidates).

    Raises:
        ValueError: an unknown method name.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method != "auto":
        return Choice(method, "forced by method=")
    G = group_size or default_group_size(num_heads)
    if G < 2 or G * num_heads > 128:
        return Choice("per_token", f"H = {num_heads} fills a 128-row tile alone (G = {G})")
    row = grouping_rule(num_heads, rules)
    if row.min_tokens >= NEVER:
        return Choice("per_token", f"H = {num_heads}: grouping {G} queries per tile measured slower than per token at "
                                   "every step size (results/op-sweep-rule.json)")
    if num_tokens < row.min_tokens:
        return Choice("per_token", f"T = {num_tokens} < {row.min_tokens} rows, where grouping starts to pay at H <= "
                                   f"{row.max_heads}")
    return Choice("grouped", f"T = {num_tokens} >= {row.min_tokens} at H = {num_heads}: G = {G} queries per tile; the "
                             "overlap probe and guard send low-overlap steps and groups per token on the device")


resolve_method = deprecated_alias(choose_method, "resolve_method")


def explain_method(num_heads: int, num_tokens: int, *, method: str = "auto", group_size: int | None = None,
                   has_cu_seqlens: bool = False) -> str:
    """One line: what ``sparse_mla_fwd(method=...)`` runs for such a call, and why."""
    chosen, why = choose_method(method, num_heads, num_tokens, group_size)
    layout = "within requests (cu_seqlens_q)" if has_cu_seqlens else "token-major over all rows"
    return line("method", (chosen, why + (f"; groups {layout}" if chosen == "grouped" else "")))


def fit_grouping_rules(points: list[dict], heads_buckets: tuple[int, ...] = (8, 16, 32, 64, 128),
                       tolerance: float = 0.0) -> tuple[GroupingRule, ...]:
    """Fit ``GROUPING_RULES`` on measured points.

    Args:
        points: dicts with ``heads``, ``tokens``, ``per_token_ms``, ``grouped_ms`` and ``lists`` (the overlap preset:
            only lists with overlap — not "none" / "random" / "uniform", which the probe routes per token — set the
            rule).
        heads_buckets: the table's rows (max_heads).
        tolerance: grouping counts as a win when grouped_ms <= per_token_ms * (1 + tolerance).

    Returns:
        One ``GroupingRule`` per bucket: ``min_tokens`` = the geometric midpoint between the largest measured step
        where grouping lost and the smallest step above it (every larger measured step won); NEVER when grouping
        lost at the largest step measured or no point falls in the bucket.
    """
    out, lo = [], 0
    for hb in heads_buckets:
        pts = [p for p in points if lo < p["heads"] <= hb and p["lists"] not in ("none", "random", "uniform")]
        lo = hb
        if not pts or default_group_size(hb) < 2:
            out.append(GroupingRule(hb, NEVER))
            continue
        by_t: dict[int, bool] = {}
        for p in pts:
            win = p["grouped_ms"] <= p["per_token_ms"] * (1 + tolerance)
            by_t[p["tokens"]] = by_t.get(p["tokens"], True) and win
        ts = sorted(by_t)
        losses = [t for t in ts if not by_t[t]]
        if not losses:
            out.append(GroupingRule(hb, 1))
            continue
        last_loss = max(losses)
        above = [t for t in ts if t > last_loss]
        if not above:
            out.append(GroupingRule(hb, NEVER))
            continue
        out.append(GroupingRule(hb, int(round((last_loss * above[0]) ** 0.5))))
    return tuple(out)


__all__ = ["METHODS", "NEVER", "GroupingRule", "GROUPING_RULES", "grouping_rule", "choose_method", "resolve_method",
           "explain_method", "fit_grouping_rules"]
