"""Run one benchmark scenario at the layer level: every DSA prefill path side by side, each checked
against the fp32 layer reference, plus the padded-heads baseline and the kernel-level union figures.

Per scenario (one request: ``cached`` positions in the latent cache, ``new`` tokens, K = topk, H
heads per rank), on the same inputs (``sparse_mla.bench.inputs``):

* every path of ``sparse_mla.layer.dispatch.PATH_NAMES`` whose ``supports(step)`` holds runs as
  ``dsa_prefill(**inputs, path=name, out=out)`` (the whole layer call: decompression or absorption,
  masks or unions, attention, W_UV); ``out`` is NaN-poisoned first, the output checked on sampled
  token chunks (``check``), then timed (``timing``). A path that does not support the step is
  recorded with the reason, not timed.
* ``mqa_per_token_pad64`` (``baselines``): per-token sparse MQA on q zero-padded to 64 heads, what
  engines run on Hopper with FlashMLA; only when H < 64.
* the dispatcher's choice, ``sparse_mla.layer.explain(step)``: path and reason. Its time is the
  measured time of that path above (not a separate run).
* the union ratio and union build time of the grouped kernel (``union_stats``).

FP8 cache (``kv_format="fp8_ds_mla"``, ``sparse-mla bench --kv-dtype fp8``): the scenario's cache is quantized
once (``FP8_DS_MLA.quantize``, ue8m0 scales) and every path runs on it; each path's ``rel_err`` is against the
fp32 reference on the dequantized cache (its check), ``rel_err_vs_bf16_cache`` against the reference on the
unquantized cache (the quantization's own effect, informational); the pad-64 baseline dequantizes the windows
first (FlashMLA's sparse prefill is bf16-only) and ``mqa_per_token_dequant`` (dequantize, then the bf16 per-token
kernel at H heads) joins the paths. Without the flag, rows and paths are as before.

Useful work (TFLOP/s): ``sparse_mla.layer.dispatch.sparse_work`` = 2 H (kv_lora + qk_rope +
kv_lora) sum over queries of min(topk, window), the same for every path, so a higher figure is a
faster path. ``floor_ms``: that work or the per-token gather of those latent rows (kv_lora + qk_rope columns of the
cache dtype), whichever is longer at the H200's peaks (``common.floor_ms``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from ..kv_format import KV_FORMATS, check_kv_format
from ..layer import dsa_prefill, explain
from ..layer.dispatch import PATH_NAMES, PATHS, sparse_work, work_ratio
from ..layer.problem import causal_sums
from ..workloads.traces import TopkTrace
from .baselines import (
    DEQUANT_NAME,
    PAD64_NAME,
    dequant_supports,
    mqa_per_token_dequant,
    mqa_per_token_pad64,
    pad64_baseline_kind,
    pad64_supports,
)
from .check import CHECK_TOLERANCE, check_tolerance, chunk_bounds, max_rel_err, reference_chunks
from .common import floor_ms as roofline_ms
from .common import tflops
from .inputs import layer_step, make_inputs, trace_inputs
from .scenarios import Scenario
from .timing import time_trials
from .union_stats import union_stats

CHECK_TOL = CHECK_TOLERANCE[torch.bfloat16]  # the bf16 figure; run_scenario's default is the dtype's (check.CHECK_TOLERANCE)


def floor_ms(step, elem_bytes: int, row_bytes: int | None = None) -> float:
    """Roofline of the per-token sparse path in ms (``common.floor_ms``): sparse_work against the gathered latent
    bytes = sum(min(topk, window)) * (kv_lora + qk_rope) * elem_bytes, or ``row_bytes`` per gathered row when given
    (an FP8 cache: 656)."""
    keys = sum(causal_sums(c, n, step.topk) for c, n in zip(step.cached_lens, step.new_lens))
    per_row = row_bytes if row_bytes is not None else step.latent_d_qk * elem_bytes
    return roofline_ms(sparse_work(step), keys * per_row)


def _measure(fn: Callable[[], object], support: tuple[bool, str], out: torch.Tensor, refs: list, *, useful: int,
             on_gpu: bool, trials: int, tol: float, refs_bf16: list | None = None) -> dict:
    """Check then time one path: {"supported", "reason"} plus, when supported, "rel_err",
    "check_ok", the ``time_trials`` keys and "tflops", or "error" if the path raised a
    RuntimeError (out of memory, a CUDA error); any other exception is a bug and propagates.
    ``refs_bf16`` (FP8 cache runs): also "rel_err_vs_bf16_cache", against the unquantized cache's reference."""
    ok, why = support
    rec: dict = {"supported": ok, "reason": why}
    if not ok:
        return rec
    try:
        out.fill_(float("nan"))
        fn()
        err = max_rel_err(out, refs)
        rec.update(rel_err=err, check_ok=bool(err < tol))  # NaN fails
        if refs_bf16 is not None:
            rec["rel_err_vs_bf16_cache"] = max_rel_err(out, refs_bf16)
        rec.update(time_trials(fn, on_gpu=on_gpu, trials=trials))
        rec["tflops"] = tflops(useful, rec["ms"])
    except (RuntimeError, OutOfResources, CompilationError) as e:
        # torch.OutOfMemoryError (a RuntimeError) and Triton's resource / compile errors (a config that does
        # not fit this GPU): recorded so that one path does not end the run; programming errors propagate
        rec["error"] = f"{type(e).__name__}: {e}"
        if on_gpu:
            torch.cuda.empty_cache()
    return rec


def _ratio(num: dict | None, den: dict) -> float | None:
    return num["ms"] / den["ms"] if num and "ms" in num and "ms" in den else None


def best_path(paths: dict[str, dict]) -> str | None:
    """The fastest dispatcher path (``PATH_NAMES``) that was timed and passed its check; None if
    none did. The pad64 baseline (not a path the dispatcher can choose) is never the best."""
    timed = {name: paths[name]["ms"] for name in PATH_NAMES
             if name in paths and "ms" in paths[name] and paths[name].get("check_ok") is True}
    return min(timed, key=timed.get) if timed else None


def run_scenario(sc: Scenario, *, dtype: torch.dtype, device: torch.device, overlap: str = "mid", seed: int = 0,
                 trials: int = 1, trace: TopkTrace | None = None, tol: float | None = None,
                 kv_format: str | None = None) -> dict:
    """Check and time every layer path of one scenario (module docstring).

    Args:
        sc: the scenario (with a trace, its cached / new must be the trace's: N - T and T).
        dtype: q / kv / weight dtype (bf16 or fp16); device: CUDA, or CPU under TRITON_INTERPRET=1.
        overlap: synthetic top-k preset; ignored with ``trace``.
        seed: inputs and synthetic lists.
        trials: timing trials per path (``timing.time_trials``).
        trace: an engine's top-k lists (topk [T, K], valid [T] int32) instead of synthetic ones.
        tol: rel_err at or above which a path's check fails; default the dtype's
            (``check.CHECK_TOLERANCE``: 1e-2 bf16, 2e-3 fp16).
        kv_format: None (the cache in ``dtype``) or "fp8_ds_mla": the cache quantized once, every path on it
            (module docstring); the row then also has "kv_format" and "max_rel_err_vs_bf16_cache", and its
            paths "mqa_per_token_dequant" and each "rel_err_vs_bf16_cache".

    Returns:
        JSON-ready dict (times in ms, rates in TFLOP/s; keys described in ``report.FIELD_NOTES``), with
        "failures": the paths whose check failed or that raised.

    Raises:
        ValueError: trials is not an int >= 1, or tol is not a finite float > 0, an unknown kv_format (before
            any kernel runs).
    """
    if not isinstance(trials, int) or isinstance(trials, bool) or trials < 1:
        raise ValueError(f"trials must be an int >= 1, got {trials!r}")
    if tol is None:
        tol = check_tolerance(dtype)
    if not isinstance(tol, (int, float)) or isinstance(tol, bool) or not 0 < tol < math.inf:
        raise ValueError(f"tol must be a finite number > 0, got {tol!r}")
    check_kv_format(kv_format)
    on_gpu = device.type == "cuda"
    if trace is None:
        inputs = make_inputs(sc.model, sc.cached, sc.new, sc.topk, sc.heads, overlap, seed, device, dtype)
    else:
        inputs = trace_inputs(sc.model, trace.topk, trace.valid, sc.heads, seed, device, dtype)
    plain_inputs = None
    if kv_format is not None:  # quantize the cache once; every path (and the reference) reads that
        plain_inputs = inputs
        inputs = {**inputs, "kv": KV_FORMATS[kv_format].quantize(inputs["kv"]), "kv_format": kv_format}
    step = layer_step(inputs)
    supports = {name: PATHS[name].supports(step) for name in PATH_NAMES}
    try:
        decision = explain(step)
        chosen_name, chosen_reason = decision.path, decision.reason
    except ValueError as e:  # no path supports the step: every path is recorded as unsupported
        chosen_name, chosen_reason = None, str(e)
    T, H = step.num_tokens, step.num_heads
    refs = reference_chunks(inputs, chunk_bounds(T))
    refs_bf16 = None if plain_inputs is None else reference_chunks(plain_inputs, chunk_bounds(T))
    out = torch.empty(T, H, step.v_head_dim, dtype=dtype, device=device)
    useful = sparse_work(step)

    def forced(name: str) -> Callable[[], object]:
        return lambda: dsa_prefill(**inputs, path=name, out=out)

    runs = {name: (supports[name], forced(name)) for name in PATH_NAMES}
    runs[PAD64_NAME] = (pad64_supports(step), lambda: mqa_per_token_pad64(inputs, out))
    if kv_format is not None:
        runs[DEQUANT_NAME] = (dequant_supports(step), lambda: mqa_per_token_dequant(inputs, out))
    paths = {name: _measure(fn, support, out, refs, useful=useful, on_gpu=on_gpu, trials=trials, tol=tol,
                            refs_bf16=refs_bf16)
             for name, (support, fn) in runs.items()}
    pt, pad = paths.get("mqa_per_token"), paths.get(PAD64_NAME)
    for rec in paths.values():
        if "ms" in rec:
            rec["speedup_vs_per_token"] = _ratio(pt, rec)
            rec["speedup_vs_pad64"] = _ratio(pad, rec)
    union = union_stats(inputs, H, on_gpu=on_gpu, trials=trials)
    chosen = paths.get(chosen_name, {})
    errs = [rec["rel_err"] for rec in paths.values() if "rel_err" in rec]
    failures = [f"{name}: {rec['error']}" if "error" in rec else f"{name}: rel_err {rec['rel_err']:.2e} >= {tol}"
                for name, rec in paths.items() if "error" in rec or rec.get("check_ok") is False]
    m = sc.model
    fp8_fields = {}
    if kv_format is not None:
        e16 = [rec["rel_err_vs_bf16_cache"] for rec in paths.values() if "rel_err_vs_bf16_cache" in rec]
        fp8_fields = {"kv_format": kv_format,
                      "max_rel_err_vs_bf16_cache": max(e16, default=float("nan"))}
    return {
        "scenario": sc.name, "model": m.name, "tp": sc.tp, "heads": H,
        "dims": {"kv_lora_rank": m.kv_lora_rank, "qk_nope_head_dim": m.qk_nope_head_dim,
                 "qk_rope_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim},
        "cached": step.cached_lens[0], "new": T, "topk": step.topk, "kv_rows": inputs["kv"].shape[0],
        "useful_tflop": useful / 1e12, "work_ratio": work_ratio(step),
        "floor_ms": floor_ms(step, torch.empty((), dtype=dtype).element_size(),
                             None if kv_format is None else KV_FORMATS[kv_format].row_bytes),
        "group_size": union["group_size"], "union_ratio": union["union_ratio"], "union_build": union["union_build"],
        "union_backend": union["union_backend"],
        "chosen_path": chosen_name, "chosen_reason": chosen_reason,
        "chosen_ms": chosen.get("ms"), "chosen_tflops": chosen.get("tflops"),
        "chosen_speedup_vs_per_token": chosen.get("speedup_vs_per_token"),
        "chosen_speedup_vs_pad64": chosen.get("speedup_vs_pad64"),
        "pad64_baseline": pad64_baseline_kind(device, kv_format, topk=step.topk, dtype=dtype),
        "best_path": best_path(paths),
        "max_rel_err": max(errs, default=float("nan")),
        "check_tol": tol,
        **fp8_fields,
        "failures": failures,
        "paths": paths,
    }


__all__ = ["run_scenario", "best_path", "floor_ms", "CHECK_TOL"]
