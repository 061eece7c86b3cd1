"""Timing: CUDA events through ``triton.testing.do_bench`` (warm-up, L2 flushed before every run,
median of many), or one wall-clock run under the Triton interpreter (not a performance number)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def time_ms(fn: Callable[[], object], *, on_gpu: bool, warmup_ms: int = 25, rep_ms: int = 100) -> dict:
    """Time ``fn``: returns {"ms": median, "p20": ..., "p80": ...} in milliseconds.

    On a GPU: ``triton.testing.do_bench`` (CUDA events, L2 flushed between runs). Elsewhere:
    one run after one warm-up, by wall clock (the interpreter: correctness only).
    """
    if on_gpu:
        import triton.testing

        p50, p20, p80 = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
        return {"ms": p50, "p20": p20, "p80": p80}
    fn()
    runs = []
    for _ in range(1):
        t0 = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - t0) * 1e3)
    med = statistics.median(runs)
    return {"ms": med, "p20": med, "p80": med}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
