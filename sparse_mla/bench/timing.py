"""Timing: CUDA events through ``triton.testing.do_bench`` (warm-up, L2 flushed before every run,
median and 20 / 80 % quantiles of the runs), repeated over independent trials; or one wall-clock
run under the Triton interpreter (not a performance number); ``host_time_us``: the CPU time per call of
back-to-back calls; ``graph_figures``: the device time of a call captured in a CUDA graph and replayed.

Repetitions are capped by time: ``do_bench`` estimates one call from 5 runs and then repeats
``max(1, rep_ms / estimate)`` times, so a trial of a 120 ms call costs about 8 calls (~1 s) and a
trial of a 1 ms call about ``rep_ms`` ms. The budget (``WARMUP_MS``, ``REP_MS``, ``QUANTILES``) is
``sparse_mla.bench.common``'s.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from .common import QUANTILES, REP_MS, WARMUP_MS


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


def median_ms(fn: Callable[[], object], *, warmup_ms: int = WARMUP_MS, rep_ms: int = REP_MS) -> float:
    """The median ms of one ``time_trial`` of ``fn`` on the GPU (``triton.testing.do_bench``, L2 flushed)."""
    return time_trial(fn, on_gpu=True, warmup_ms=warmup_ms, rep_ms=rep_ms)[0]


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


def host_time_us(fn: Callable[[], object], calls: int = 40) -> float:
    """CPU microseconds per call of ``calls`` back-to-back calls while a sleep kernel queued first keeps the GPU busy
    (the host work is measured, not the queue); few enough calls that their launches fit CUDA's launch queue."""
    import torch

    torch.cuda.synchronize()
    torch.cuda._sleep(int(1e9))  # ~0.5 s of GPU cycles ahead of the calls
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def _tensors(value) -> list:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    return [t for v in (value if isinstance(value, (tuple, list)) else ()) for t in _tensors(v)]


def capture_graph(fn: Callable[[], object]):
    """(graph, out): ``fn`` run once on a side stream (its warm-up: compilation, allocator pools), then captured in
    a ``torch.cuda.CUDAGraph``; ``out`` is what the captured call returned (rewritten by every ``graph.replay()``)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def graph_figures(fn: Callable[[], object], check: Callable[[object], float], tol: float, *, trials: int,
                  rep_ms: int = REP_MS) -> dict:
    """``fn`` as an engine's step runs it on a GPU: captured once in a CUDA graph (after a warm-up call on a side
    stream), then replayed; the device time without the host path. Its outputs (what the captured call returned,
    rewritten by every replay) are NaN-filled, one replay runs, ``check`` of them must be <= ``tol``.

    Returns:
        {"graph_ms": median replay ms (``time_trials``), "graph_err": check's figure, "graph_ok": within tol}, or
        {"graph_error": "<type>: <message>", "graph_ok": False} when the capture or a replay raises.
    """
    import torch

    try:
        graph, out = capture_graph(fn)
        for t in _tensors(out):
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        err = check(out)
        t = time_trials(graph.replay, on_gpu=True, trials=trials, rep_ms=rep_ms)
        return {"graph_ms": t["ms"], "graph_err": err, "graph_ok": err <= tol}
    except Exception as exc:  # recorded: a call that cannot be captured is a finding, not a crash of the bench
        return {"graph_error": f"{type(exc).__name__}: {exc}", "graph_ok": False}


__all__ = ["time_trial", "median_ms", "time_trials", "host_time_us", "capture_graph", "graph_figures", "WARMUP_MS", "REP_MS",
           "QUANTILES"]
