"""Timing: CUDA events through ``triton.testing.do_bench`` (warm-up, L2 flushed before every run,
median of the runs), repeated over independent trials; or one wall-clock run under the Triton
interpreter (not a performance number).

Repetitions are capped by time: ``do_bench`` estimates one call from 5 runs and then repeats
``max(1, rep_ms / estimate)`` times, so a trial of a 120 ms call costs about 8 calls (~1 s) and a
trial of a 1 ms call about ``rep_ms`` ms.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

WARMUP_MS = 10  # do_bench warm-up budget per trial
REP_MS = 50  # do_bench measuring budget per trial


def time_ms(fn: Callable[[], object], *, on_gpu: bool, warmup_ms: int = WARMUP_MS, rep_ms: int = REP_MS) -> float:
    """One trial of ``fn``: the median time of one call in ms.

    On a GPU: ``triton.testing.do_bench`` (CUDA events, L2 flushed between runs). Elsewhere: one
    wall-clock run (the caller has run ``fn`` before, e.g. for its output check), not a
    performance number.
    """
    if on_gpu:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def time_trials(fn: Callable[[], object], *, on_gpu: bool, trials: int, warmup_ms: int = WARMUP_MS,
                rep_ms: int = REP_MS) -> dict:
    """``trials`` independent ``time_ms`` trials of ``fn``.

    Returns:
        {"ms": median of the trial medians, "min_ms": fastest trial, "max_ms": slowest trial,
        "trials_ms": [each trial's median]} (milliseconds per call).

    Raises:
        ValueError: trials < 1.
    """
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    runs = [time_ms(fn, on_gpu=on_gpu, warmup_ms=warmup_ms, rep_ms=rep_ms) for _ in range(trials)]
    return {"ms": statistics.median(runs), "min_ms": min(runs), "max_ms": max(runs), "trials_ms": runs}


__all__ = ["time_ms", "time_trials", "WARMUP_MS", "REP_MS"]
