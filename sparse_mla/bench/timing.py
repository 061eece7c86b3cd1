"""Timing: CUDA events through ``triton.testing.do_bench`` (warm-up, L2 flushed before every run,
median and 20 / 80 % quantiles of the runs), repeated over independent trials; or one wall-clock
run under the Triton interpreter (not a performance number).

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
QUANTILES = (0.5, 0.2, 0.8)  # per trial: median, then the 20 % and 80 % quantiles of the runs


def time_trial(fn: Callable[[], object], *, on_gpu: bool, warmup_ms: int = WARMUP_MS,
               rep_ms: int = REP_MS) -> tuple[float, float, float]:
    """One trial of ``fn``: (median, 20 % quantile, 80 % quantile) of one call's time in ms.

    On a GPU: ``triton.testing.do_bench(quantiles=QUANTILES)`` (CUDA events, L2 flushed between
    runs). Elsewhere: one wall-clock run, all three the same (the caller has run ``fn`` before,
    e.g. for its output check), not a performance number.
    """
    if on_gpu:
        import triton.testing

        p50, p20, p80 = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=list(QUANTILES))
        return float(p50), float(p20), float(p80)
    t0 = time.perf_counter()
    fn()
    ms = (time.perf_counter() - t0) * 1e3
    return ms, ms, ms


def time_trials(fn: Callable[[], object], *, on_gpu: bool, trials: int, warmup_ms: int = WARMUP_MS,
                rep_ms: int = REP_MS) -> dict:
    """``trials`` independent ``time_trial`` trials of ``fn``.

    Returns:
        {"ms": median of the trial medians, "p20_ms" / "p80_ms": median over the trials of each
        trial's 20 % / 80 % quantile (the spread within a trial), "min_ms" / "max_ms": fastest /
        slowest trial median (the spread across trials), "trials_ms": [each trial's median]}
        (milliseconds per call).

    Raises:
        ValueError: trials < 1.
    """
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    runs = [time_trial(fn, on_gpu=on_gpu, warmup_ms=warmup_ms, rep_ms=rep_ms) for _ in range(trials)]
    meds = [r[0] for r in runs]
    return {"ms": statistics.median(meds), "p20_ms": statistics.median(r[1] for r in runs),
            "p80_ms": statistics.median(r[2] for r in runs), "min_ms": min(meds), "max_ms": max(meds), "trials_ms": meds}


__all__ = ["time_trial", "time_trials", "WARMUP_MS", "REP_MS", "QUANTILES"]
