"""The split count S of ``sparse_mla_fwd(kv_splits=None)`` (plain Python, CPU-testable).

A few-token step (decode, an MTP / speculative verify, a chunked-prefill tail) has fewer work items (lists x
64-pseudo-head tiles) than the GPU has SMs, and each item walks its whole list of up to 2048 kv rows alone. With S
splits, S programs share one list, each over 1 / S of its rows, and ``sparse_mla.mqa.split_combine`` merges their
partials exactly. The shape alone decides (no device data is read), so the choice is the same on every replay of a
captured CUDA graph.

The rule (``KV_SPLIT_MODEL``, the one place its constants live; the H200 issue fits them): S is the largest count
such that the split work still fits one wave of the SMs and every split keeps at least ``min_rows_per_split`` rows:
S = min(max_splits, num_sms // work_items, rows_per_list // min_rows_per_split), and 1 when that is below 2 (the
step already fills the GPU, or its lists are too short to pay for the combine). Its constants are first estimates,
not yet measured; ``fit_kv_split_model`` fits them on the H200 issue's timings of forced split counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..choices import Choice

MAX_KV_SPLITS = 64  # the largest forced split count accepted (more only adds empty splits and combine work)
TILE_PSEUDO_HEADS = 64  # pseudo-heads per work item (the Gluon kernels' BLOCK_H; the Triton kernel's 16-64 tiles)


@dataclass(frozen=True)
class KVSplitModel:
    """The constants of the automatic split choice."""

    min_rows_per_split: int = 256  # fewer rows per split spend more on the extra prologue / combine than they save
    max_splits: int = 16  # the combine reads S partial rows per (token, head)
    waves: float = 1.0  # split work items per SM aimed for


KV_SPLIT_MODEL = KVSplitModel()


def require_kv_splits(kv_splits: object) -> int | None:
    """``kv_splits`` validated: None or an int in [1, MAX_KV_SPLITS].

    Raises:
        TypeError: not None and not an int (a bool is refused).
        ValueError: an int outside [1, MAX_KV_SPLITS].
    """
    if kv_splits is None:
        return None
    if isinstance(kv_splits, bool) or not isinstance(kv_splits, int):
        raise TypeError(f"kv_splits must be None or an int, got {type(kv_splits).__name__}")
    if not 1 <= kv_splits <= MAX_KV_SPLITS:
        raise ValueError(f"kv_splits must be in [1, {MAX_KV_SPLITS}], got {kv_splits}")
    return kv_splits


def num_sms(device: torch.device) -> int:
    """SMs of ``device`` (a CUDA device's multiprocessor count); 1 elsewhere (the interpreter runs one program at a
    time: splitting only adds work)."""
    if device.type != "cuda":
        return 1
    key = str(device)
    if key not in _SMS:
        _SMS[key] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[key]


_SMS: dict[str, int] = {}


def work_items(num_lists: int, pseudo_heads: int) -> int:
    """Work items of a launch: lists x tiles of ``TILE_PSEUDO_HEADS`` pseudo-heads."""
    return num_lists * -(-pseudo_heads // TILE_PSEUDO_HEADS)


def choose_kv_splits(kv_splits: int | None, *, num_lists: int, pseudo_heads: int, rows_per_list: int, sms: int,
                     split_capable: bool = True, model: KVSplitModel | None = None) -> Choice:
    """``Choice(S, reason)``: the split count of a launch of ``num_lists`` lists of ``rows_per_list`` kv rows (top-k, or a
    group's estimated union) over ``pseudo_heads`` rows per list, on ``sms`` SMs.

    Args:
        kv_splits: the caller's value: an int forces S (validated by ``require_kv_splits``), None chooses by
            ``model`` (default ``KV_SPLIT_MODEL``).
        split_capable: whether the attention backend that would run has a split-KV variant; without one S is 1.

    Raises:
        TypeError, ValueError: a forced ``kv_splits`` that ``require_kv_splits`` refuses.
    """
    forced = require_kv_splits(kv_splits)
    if forced is not None:
        return Choice(forced, f"kv_splits={forced} forced")
    m = model or KV_SPLIT_MODEL
    if not split_capable:
        return Choice(1, "the attention backend that runs here has no split-KV variant")
    if sms <= 1:
        return Choice(1, "not a GPU: one program runs at a time, splitting only adds work")
    w = work_items(num_lists, pseudo_heads)
    if w == 0:
        return Choice(1, "no work item")
    by_fill = int(sms * m.waves) // w
    by_rows = rows_per_list // m.min_rows_per_split
    s = min(m.max_splits, by_fill, by_rows)
    if s < 2:
        if by_fill < 2:
            return Choice(1, f"{w} work items fill the {sms} SMs")
        return Choice(1, f"{rows_per_list} rows per list < 2 x {m.min_rows_per_split} rows per split")
    limit = ("max_splits" if s == m.max_splits else
             f"{sms} SMs / {w} work items" if s == by_fill else f"{rows_per_list} rows / {m.min_rows_per_split}")
    return Choice(s, f"{w} work items on {sms} SMs: S = {s} splits of ~{-(-rows_per_list // s)} rows (bound: {limit})")


def _measured_time(times: dict[int, float], s: int) -> float:
    """The time of the measured split count nearest to ``s`` (the larger one on a tie)."""
    best = min(times, key=lambda m: (abs(m - s), -m))
    return times[best]


def fit_kv_split_model(points: list[dict], sms: int,
                       candidates: list[KVSplitModel] | None = None) -> tuple[KVSplitModel, float]:
    """Fit ``KV_SPLIT_MODEL`` on measured points (the H200 issue's few-token and decode runs).

    Args:
        points: dicts with ``num_lists``, ``pseudo_heads``, ``rows_per_list`` (as ``choose_kv_splits`` takes them) and
            ``times``: {S: ms} of the same call forced to each measured split count (at least S = 1).
        sms: the SM count of the GPU measured.
        candidates: the models tried (default: min_rows_per_split 64-1024, max_splits 4-64, waves 0.5-2).

    Returns:
        (model, mean slowdown): the candidate whose choices lose least against the best measured S per point, as the
        mean of time(chosen S) / time(best S) (a chosen S not measured takes the nearest measured one's time); on a
        tie the one that splits less (larger min_rows_per_split, smaller max_splits, fewer waves).

    Raises:
        ValueError: no points, or a point without its S = 1 time.
    """
    if not points:
        raise ValueError("fit_kv_split_model needs at least one measured point")
    for pt in points:
        if 1 not in pt["times"]:
            raise ValueError(f"every point needs its unsplit (S = 1) time, got splits {sorted(pt['times'])}")
    if candidates is None:
        candidates = [KVSplitModel(r, m, w) for r in (64, 128, 256, 512, 1024) for m in (4, 8, 16, 32, 64)
                      for w in (0.5, 1.0, 2.0)]
    scored = []
    for model in candidates:
        loss = 0.0
        for pt in points:
            s, _ = choose_kv_splits(None, num_lists=pt["num_lists"], pseudo_heads=pt["pseudo_heads"],
                                    rows_per_list=pt["rows_per_list"], sms=sms, model=model)
            loss += _measured_time(pt["times"], s) / min(pt["times"].values())
        scored.append((loss / len(points), -model.min_rows_per_split, model.max_splits, model.waves, model))
    best = min(scored, key=lambda x: x[:4])
    return best[4], best[0]


__all__ = ["KVSplitModel", "KV_SPLIT_MODEL", "MAX_KV_SPLITS", "require_kv_splits", "choose_kv_splits", "num_sms",
           "work_items", "fit_kv_split_model"]
