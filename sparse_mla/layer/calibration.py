"""Calibration of the dispatcher against a measured crossover sweep (plain Python, no tensors).

A sweep (``benchmarks/sweep_paths.py`` on the H200, committed as ``results/sweep_paths.json``) holds,
per point (model layout, heads per rank, cached + new tokens), the time of every path. This module

* re-evaluates the dispatcher's automatic choice on every measured point (``evaluate``): the chosen
  path's time over the best measured time, the figure the layer issue bounds by 1.05;
* fits ``dispatch.THRESHOLDS`` to the sweep (``fit_thresholds``): per heads-per-rank bucket, the
  masked-MHA pure / cached work-ratio limits, its window limit and the grouped token threshold
  that minimise the worst slowdown over the bucket's points, each placed halfway (geometric)
  between the last measured point it admits and the next one, so that it does not sit on a point.

Rows are the sweep JSON's: ``{"model", "heads", "cached", "new", "topk", "paths": {name: {"ms"}}}``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

from ..workloads.models import MODELS
from . import dispatch
from .dispatch import NEVER, PATHS, HeadsThresholds, has_cached_prefix, path_rule, work_ratio
from .problem import PrefillStep

TOLERANCE = 1.05  # the layer issue: the automatic choice within 5% of the best path


def row_step(row: dict) -> PrefillStep:
    """The ``PrefillStep`` of one sweep row (one request: ``cached`` + ``new`` tokens).

    Raises:
        KeyError: an unknown model name.
    """
    m = MODELS[row["model"]]
    return PrefillStep(int(row["heads"]), m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim,
                       int(row["topk"]), (int(row["cached"]),), (int(row["new"]),))


def measured_ms(row: dict) -> dict[str, float]:
    """{path: median ms} of the dispatcher's paths the row timed (errors, skips and baselines such
    as the benchmark's pad-64 column left out, and so are paths whose output check failed: a fast
    wrong path must not become the best)."""
    return {p: v["ms"] for p, v in row["paths"].items()
            if p in PATHS and v.get("ms") is not None and not v.get("check_failed") and v.get("check_ok", True)}


def choice(step: PrefillStep, table: tuple[HeadsThresholds, ...] | None = None) -> str:
    """The automatic path for ``step`` under ``table`` (default: the dispatcher's ``THRESHOLDS``)."""
    sup = {name: p.supports(step) for name, p in PATHS.items()}
    return path_rule(step, sup, work_ratio(step), table).name


def evaluate(rows: list[dict], table: tuple[HeadsThresholds, ...] | None = None) -> list[dict]:
    """Per measured point with at least one timed path: the automatic choice, the best path and
    ``slowdown`` = time(choice) / time(best) (``inf`` when the choice was not timed there).

    Returns:
        list of {"model", "heads", "cached", "new", "work_ratio", "choice", "best", "slowdown"}.
    """
    out = []
    for r in rows:
        ms = measured_ms(r)
        if not ms:
            continue
        step = row_step(r)
        c = choice(step, table)
        best = min(ms, key=ms.get)
        out.append({"model": r["model"], "heads": r["heads"], "cached": r["cached"], "new": r["new"],
                    "work_ratio": work_ratio(step), "choice": c, "best": best,
                    "slowdown": ms[c] / ms[best] if c in ms else math.inf})
    return out


def _between(lo: float, candidates: list[float]) -> float:
    """A limit admitting ``lo`` and nothing measured above it: halfway (geometric) to the next
    candidate, or 10% above ``lo`` when it is the largest; 0 stays 0 (never)."""
    if lo <= 0:
        return 0.0
    above = [c for c in candidates if c > lo]
    return math.sqrt(lo * min(above)) if above else lo * 1.1


def _limit(lo: float, candidates: list[float]) -> float:
    """``_between(lo, candidates)`` rounded up to 3 decimals (it must still admit ``lo``) unless that
    would reach the next measured point (it must not admit that one); then unrounded."""
    x = _between(lo, candidates)
    r = math.ceil(x * 1000 - 1e-9) / 1000
    above = [c for c in candidates if c > lo]
    return x if above and r >= min(above) else r


def _slowdowns(pts: list[tuple[PrefillStep, dict[str, float]]], table: tuple[HeadsThresholds, ...]) -> list[float]:
    out = []
    for s, ms in pts:
        c = choice(s, table)
        out.append(ms[c] / min(ms.values()) if c in ms else math.inf)
    return out


def _fit_bucket(cur: HeadsThresholds, pts: list[tuple[PrefillStep, dict[str, float]]]) -> HeadsThresholds:
    pure = sorted({work_ratio(s) for s, _ in pts if not has_cached_prefix(s)})
    cached = sorted({work_ratio(s) for s, _ in pts if has_cached_prefix(s)})
    windows = sorted({s.max_window for s, _ in pts})
    tokens = sorted({s.num_tokens for s, _ in pts})

    def key(c: HeadsThresholds) -> tuple:
        slow = _slowdowns(pts, (c,))
        grouped = c.grouped_min_tokens < NEVER
        return (max(slow), sum(slow) / len(slow), c.masked_max_ratio_pure + c.masked_max_ratio_cached,
                -c.masked_max_window, grouped, c.grouped_cached, min(c.grouped_max_tokens, 2**40) - c.grouped_min_tokens)

    best = replace(cur, grouped_min_tokens=NEVER, grouped_max_tokens=NEVER)
    bands = [(NEVER, NEVER)] + [(a, b) for a in tokens for b in [*tokens, NEVER] if a <= b]
    for _ in range(2):  # coordinate descent: masked limits given the grouped band, then the band
        best = min((replace(best, masked_max_ratio_pure=rp, masked_max_ratio_cached=rc, masked_max_window=w)
                    for rp, rc, w in itertools.product([0.0, *pure], [0.0, *cached], [*windows, NEVER])), key=key)
        best = min((replace(best, grouped_min_tokens=a, grouped_max_tokens=b, grouped_cached=gc)
                    for a, b in bands for gc in (False, True)), key=key)
    # place every limit between the last measured point it admits and the next one
    rp = _limit(best.masked_max_ratio_pure, pure)
    rc = _limit(best.masked_max_ratio_cached, cached)
    w = best.masked_max_window
    if rp == rc == 0.0:
        w = 0  # masked MHA never chosen: no window limit to state
    elif w >= NEVER:
        w = max(windows)  # not measured beyond
    else:
        larger = [x for x in windows if x > w]
        w = max(w, int(math.sqrt(w * min(larger))) // 1024 * 1024) if larger else w
    lo, hi = best.grouped_min_tokens, best.grouped_max_tokens
    if lo < NEVER:
        smaller = [x for x in tokens if x < lo]
        lo = min(lo, int(math.sqrt(lo * max(smaller))) // 256 * 256 + 256) if smaller else lo
        if hi < NEVER:
            larger = [x for x in tokens if x > hi]
            hi = max(hi, int(math.sqrt(hi * min(larger))) // 256 * 256) if larger else hi
    return replace(best, masked_max_ratio_pure=rp, masked_max_ratio_cached=rc, masked_max_window=w,
                   grouped_min_tokens=lo, grouped_max_tokens=hi)


def fit_thresholds(rows: list[dict], table: tuple[HeadsThresholds, ...] | None = None) -> tuple[HeadsThresholds, ...]:
    """``THRESHOLDS`` fitted to the sweep rows: one row per bucket of ``table`` (default the
    dispatcher's), heads in (previous max_heads, max_heads].

    Per bucket, by coordinate descent (twice): every combination of measured pure ratio, cached
    ratio and window (plus "never" / "no window limit") for masked MHA, then every band
    [min, max] of measured token counts (plus "never") for grouping. The smallest worst slowdown
    wins, then the smallest mean slowdown, then the smallest ratio limits, the loosest window and
    no or the narrowest grouping band (the simplest rule that explains the timings). A bucket
    without measured points keeps its row.
    """
    table = table or dispatch.THRESHOLDS  # read at call time, like the dispatcher
    fitted = []
    lo_heads = 0
    for k, cur in enumerate(table):
        last = k == len(table) - 1  # the last row also serves more heads than its max_heads
        pts = [(row_step(r), measured_ms(r)) for r in rows if lo_heads < r["heads"] and (last or r["heads"] <= cur.max_heads)]
        pts = [(s, ms) for s, ms in pts if ms]
        lo_heads = cur.max_heads
        fitted.append(_fit_bucket(cur, pts) if pts else cur)
    return tuple(fitted)


__all__ = ["TOLERANCE", "row_step", "measured_ms", "choice", "evaluate", "fit_thresholds"]
