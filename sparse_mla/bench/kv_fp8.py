"""Attention-kernel A/B of the FP8 ``fp8_ds_mla`` cache against the bf16 one (same run, same q, same indices).

    python -m sparse_mla.bench.kv_fp8 --json out/kv_fp8.json [--sweep-configs] [--variants bf16,fp8]

Per case (per token at each ``--heads``; grouped at each ``--grouped-heads``, G = 128 // H, union built once
and not timed, as ``benchmarks/bench_gluon.py`` times it), the rows:

* ``bf16``: the bf16 cache through the selection point (``sparse_mla.mqa.backends``: on an H200 the Gluon kernel,
  pair schedule; the Triton kernel below 32 pseudo-heads on > 1024 tokens when the split schedule is selected).
* ``bf16 triton``: the bf16 cache forced onto the Triton kernel (the cost of that kernel's in-register
  dequantization alone is ``fp8 triton`` against this).
* ``fp8``: the FP8 cache through the selection point (on an H200 with bf16 q: the Gluon kernel, whose producer
  dequantizes in registers; elsewhere the Triton kernel with ``KV_FP8``).
* ``fp8 triton``: the FP8 cache forced onto the Triton kernel (``triton_tl.LAUNCH_CONFIGS_FP8``).
* ``dequant+bf16``: what engines run with FlashMLA's bf16-only sparse prefill: the whole cache dequantized into
  a preallocated bf16 workspace (``FP8_DS_MLA.dequantize``, torch), then the bf16 kernel as ``bf16``; timed
  together, with the dequantization alone in ``dequant_ms``.
* with ``--sweep-configs``: ``fp8 triton cfg=BLOCK_N/warps/stages`` for the Triton kernel's alternatives in
  ``SWEEP_CONFIGS``.

Each row records the ``backend`` the selection point picked for it (and, on the Gluon kernel, its ``schedule``).
``--variants`` keeps only the named rows (e.g. ``bf16,fp8`` for a quick A/B).

Inputs (the protocol of ``benchmarks/bench_gluon.py``): T query tokens over N cache rows, query i taking topk distinct
uniform rows of [0, N - T + i] per token; grouped: the "mid" synthetic top-k of N - T cached + T new tokens. Every
row: ms (``timing.time_trials``: do_bench median, L2 flushed), useful TFLOP/s (2 H valid (576 + 512) per query),
the roofline floor (``common.floor_ms`` of the computed FLOPs and the gathered bytes: 1152 B per row for bf16, 656
for FP8; per token every valid row of every query, grouped the groups' union rows once on the
128-pseudo-head tile), and the largest per-(token, head) row error (``common.max_row_err``) on sampled tokens against
the fp32 reference of the cache it read (``max_row_err``: the dequantized cache for ``fp8`` / ``dequant+bf16``) and against
the bf16 cache's (``max_row_err_vs_bf16_cache``: the quantization's own effect). Without a GPU it runs tiny sizes
through the Triton interpreter (fp16; not performance numbers).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from .common import floor_ms, fmt, make_table, max_row_err, render_text, run_meta, tflops, timing_note, write_json

D_QK, D_V = 576, 512
ROW_TOL = {torch.bfloat16: 3 * 2**-8, torch.float16: 3 * 2**-11}  # tests/testlib/tolerances.py ROW_TOLERANCE
# Triton launch configs (BLOCK_N, num_warps, num_stages) tried by --sweep-configs for the FP8 cache.
SWEEP_CONFIGS = ((64, 4, 2), (64, 8, 2), (32, 4, 2), (32, 8, 2), (32, 8, 3), (64, 8, 1))
VARIANTS = ("bf16", "bf16 triton", "fp8", "fp8 triton", "dequant+bf16")  # the rows of a case, sweep rows aside


def causal_uniform(T: int, K: int, N: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """[T, K] int32: query i takes min(K, N - T + i + 1) distinct uniform rows of [0, N - T + i], -1 after."""
    p0 = N - T
    idx = torch.full((T, K), -1, dtype=torch.int32, device=device)
    cols = torch.arange(N, device=device)
    for i0 in range(0, T, 1024):
        n = min(1024, T - i0)
        r = torch.rand(n, N, generator=gen, device=device)
        lim = p0 + torch.arange(i0, i0 + n, device=device)
        r[cols[None, :] > lim[:, None]] = -1.0
        take = min(K, N)
        top = r.topk(take, dim=1)
        idx[i0:i0 + n, :take] = torch.where(top.values >= 0, top.indices, -1).to(torch.int32)
    return idx


def run_case(kind: str, H: int, T: int, K: int, N: int, *, dtype: torch.dtype, device: torch.device, trials: int,
             scale_format: str, sweep: bool, seed: int = 0, only: frozenset[str] | None = None) -> list[dict]:
    """The rows of one case (module docstring); ``kind`` "per_token" or "grouped"; ``only``: the names of
    ``VARIANTS`` to run (None: all)."""
    from triton.compiler.errors import CompilationError
    from triton.errors import TritonError

    from .. import SparseMLAWorkspace, sparse_mla_ref
    from ..kv_format import FP8_DS_MLA
    from ..mqa import backends, gluon_sm90, triton_tl
    from ..union import backends as union_backends
    from ..union.planning import plan_groups
    from ..workloads import synthetic_batch
    from .timing import time_trials

    on_gpu = device.type == "cuda"
    gen = torch.Generator(device=device).manual_seed(seed)
    q = (torch.randn(T, H, D_QK, generator=gen, device=device) * 0.5).to(dtype)
    kv = (torch.randn(N, D_QK, generator=gen, device=device) * 0.5).to(dtype)
    cache = FP8_DS_MLA.quantize(kv, scale_format=scale_format)
    rows8 = FP8_DS_MLA.as_rows(cache)
    workspace = torch.empty(N, D_QK, dtype=dtype, device=device)  # the dequantize-then-bf16 baseline's buffer
    sm = D_QK**-0.5
    out = torch.empty(T, H, D_V, dtype=dtype, device=device)
    lse = torch.empty(T, H, dtype=torch.float32, device=device)
    if kind == "per_token":
        idx, tlen = causal_uniform(T, K, N, gen, device), None
        case = f"per_token H{H}"

        def launch(kv_rows, config=None):
            if config is None:
                return lambda: backends.per_token(q, kv_rows, idx, sm, tlen, out, lse)
            return lambda: triton_tl.sparse_mqa_per_token(q, kv_rows, idx, sm, tlen, out, lse, config=config)
    else:
        G = 128 // H
        b = synthetic_batch([N - T], [T], K, "mid", seed=seed, device=device)
        idx, tlen = b.indices, b.valid
        case = f"grouped H{H} G{G}"
        ws = SparseMLAWorkspace(T, K, G, N, device)
        ng = -(-T // G)
        gs, gl, ul, route = ws.group_start[:ng], ws.group_len[:ng], ws.union_len[:ng], ws.route[:T]
        plan_groups(T, G, None, gs, gl, route)
        union_backends.build_union(idx, tlen, N, G, gs, gl, route, ws, ws.union_rows, ws.union_bits, ul, guard_ratio=None)

        def launch(kv_rows, config=None):
            if config is None:
                return lambda: backends.grouped(q, kv_rows, sm, G, ws.union_rows, ws.union_bits, ul, gs, gl, out, lse)
            return lambda: triton_tl.sparse_mqa_grouped(q, kv_rows, sm, G, ws.union_rows, ws.union_bits, ul, gs, gl, out,
                                                        lse, config=config)
    valid = int(((idx >= 0) & (idx < N)).sum()) if tlen is None else int(tlen.clamp(0, K).sum())
    useful = 2 * H * valid * (D_QK + D_V)
    if kind == "per_token":  # the floor's work: every valid row of every query, gathered once per query
        gathered, computed = valid, useful
    else:  # a group's union rows, gathered once, on the 128-pseudo-head tile
        gathered = int(ul.clamp_min(0).sum())
        computed = 2 * G * H * gathered * (D_QK + D_V)
    toks = torch.randperm(T, generator=gen, device=device)[:min(T, 32)]
    tl_s = None if tlen is None else tlen[toks]
    ref16, _ = sparse_mla_ref(q[toks], kv, idx[toks], sm, topk_length=tl_s)
    ref8, _ = sparse_mla_ref(q[toks], cache, idx[toks], sm, topk_length=tl_s, kv_format="fp8_ds_mla")

    def dequant_then(fn):
        def run():
            FP8_DS_MLA.dequantize(cache, dtype, out=workspace)
            fn()
        return run

    fp8b = FP8_DS_MLA.row_bytes
    rows_of = {"bf16": ("auto", kv, launch(kv), ref16, 2 * D_QK),  # name -> (backend, kv, launch, reference, bytes)
               "bf16 triton": ("triton", kv, launch(kv), ref16, 2 * D_QK),
               "fp8": ("auto", rows8, launch(rows8), ref8, fp8b),
               "fp8 triton": ("triton", rows8, launch(rows8), ref8, fp8b),
               "dequant+bf16": ("auto", workspace, dequant_then(launch(workspace)), ref8, 2 * D_QK)}
    variants = [(name, *rows_of[name]) for name in VARIANTS if only is None or name in only]
    if sweep:
        variants += [(f"fp8 triton cfg={bn}/{w}/{s}", "triton", rows8, launch(rows8, (bn, w, s)), ref8, fp8b)
                     for bn, w, s in SWEEP_CONFIGS]
    pseudo_heads = H if kind == "per_token" else G * H
    out_rows = []
    env_before = os.environ.get(backends.ENV_VAR)
    try:
        for name, backend, kv_rows, fn, ref, row_bytes in variants:
            os.environ[backends.ENV_VAR] = backend
            rec = dict(case=case, variant=name, heads=H, tokens=T, topk=K, kv_rows=N,
                       backend="triton" if " cfg=" in name else backends.choose_backend(q, kv_rows, out, pseudo_heads).name)
            if rec["backend"] == "gluon_sm90":
                rec["schedule"] = gluon_sm90.schedule_for(kv_rows.dtype == torch.uint8)
            try:
                out.fill_(float("nan"))
                fn()
                err, err16 = max_row_err(out[toks], ref), max_row_err(out[toks], ref16)
                rec.update(max_row_err=err, max_row_err_vs_bf16_cache=err16, check_ok=bool(err < ROW_TOL[dtype]))
                rec.update(time_trials(fn, on_gpu=on_gpu, trials=trials))
            except (RuntimeError, TritonError, CompilationError) as e:
                # a config that does not fit the GPU (OutOfResources, PTXASError), an OOM: recorded, the sweep goes
                # on; any other exception is a bug and propagates
                rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                out_rows.append(rec)
                print(rec, flush=True)
                continue
            rec["tflops"] = tflops(useful, rec["ms"])
            rec["floor_ms"] = floor_ms(computed, gathered * row_bytes)
            if name == "dequant+bf16":
                rec["dequant_ms"] = time_trials(lambda: FP8_DS_MLA.dequantize(cache, dtype, out=workspace),
                                                on_gpu=on_gpu, trials=trials)["ms"]
            out_rows.append(rec)
            print({k: rec[k] for k in ("case", "variant", "ms", "tflops", "max_row_err", "max_row_err_vs_bf16_cache")},
                  flush=True)
    finally:
        if env_before is None:
            os.environ.pop(backends.ENV_VAR, None)
        else:
            os.environ[backends.ENV_VAR] = env_before
    return out_rows


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def main(argv: list[str] | None = None) -> list[dict]:
    """Parse ``argv``, run every case, write the JSON, print the table; returns the rows."""
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    ap = argparse.ArgumentParser(prog="python -m sparse_mla.bench.kv_fp8", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", default="128,64" if on_gpu else "16", help="per-token cases: heads, comma-separated")
    ap.add_argument("--grouped-heads", default="16", help="grouped cases: heads (G = 128 // H), comma-separated; '' none")
    ap.add_argument("--tokens", type=int, default=8192 if on_gpu else 9, help="query tokens T")
    ap.add_argument("--topk", type=int, default=2048 if on_gpu else 16, help="top-k K")
    ap.add_argument("--rows", type=int, default=32768 if on_gpu else 64, help="cache rows N (N - T cached)")
    ap.add_argument("--scale-format", default="ue8m0", choices=("ue8m0", "fp32"), help="FP8 scale rule")
    ap.add_argument("--trials", type=int, default=3 if on_gpu else 1, help="timing trials per row")
    ap.add_argument("--sweep-configs", action="store_true", help="also time the FP8 cache at SWEEP_CONFIGS")
    ap.add_argument("--variants", default="", help=f"only these rows, comma-separated, of {', '.join(VARIANTS)} "
                    "(default: all; --sweep-configs adds its rows either way)")
    ap.add_argument("--json", default="out/kv_fp8.json", help="where to write the results")
    ap.add_argument("--wide", action="store_true", help="print every figure (backend, floor, dequantization, spread)")
    a = ap.parse_args(argv)
    if a.rows < a.tokens or min(a.tokens, a.topk) < 1:
        ap.error(f"need tokens >= 1, topk >= 1 and rows >= tokens, got {a.tokens}, {a.topk}, {a.rows}")
    only = frozenset(v.strip() for v in a.variants.split(",") if v.strip()) or None
    if only is not None and not only <= set(VARIANTS):
        ap.error(f"--variants: unknown {sorted(only - set(VARIANTS))}; the rows are {', '.join(VARIANTS)}")
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float16
    rows = []
    for H in _ints(a.heads):
        rows += run_case("per_token", H, a.tokens, a.topk, a.rows, dtype=dtype, device=device, trials=a.trials,
                         scale_format=a.scale_format, sweep=a.sweep_configs, only=only)
    for H in _ints(a.grouped_heads):
        rows += run_case("grouped", H, a.tokens, a.topk, a.rows, dtype=dtype, device=device, trials=a.trials,
                         scale_format=a.scale_format, sweep=a.sweep_configs, only=only)
    meta = run_meta("kv_fp8", command=" ".join(["python -m sparse_mla.bench.kv_fp8",
                                                *(argv if argv is not None else sys.argv[1:])]),
                    timing=timing_note(trials=a.trials, interpreted=not on_gpu), dtype=str(dtype),
                    scale_format=a.scale_format, timings_meaningful=on_gpu)
    write_json(a.json, meta, rows)
    print()
    print(format_rows(rows, wide=a.wide, interpreted=not on_gpu))
    print(f"wrote {a.json}" + ("" if on_gpu else " (Triton interpreter: the times are not performance numbers)"))
    return rows


COMPACT_COLUMNS = ("case", "variant", "ms", "TFLOP/s", "row err", "vs bf16")  # fits 80 columns
WIDE_COLUMNS = ("case", "variant", "backend", "ms", "p20", "p80", "TFLOP/s", "floor ms", "row err", "vs bf16", "dequant ms")


def _row_figures(r: dict) -> dict[str, str]:
    def f(key: str, spec: str) -> str:
        return fmt(r.get(key), spec)

    return {"case": r["case"], "variant": r["variant"],
            "backend": r.get("backend", "-") + (f":{r['schedule']}" if r.get("schedule") else ""),
            "ms": "ERR" if "error" in r else f("ms", ".3f"), "p20": f("p20_ms", ".3f"), "p80": f("p80_ms", ".3f"),
            "TFLOP/s": f("tflops", ".1f"), "floor ms": f("floor_ms", ".3f"),
            "row err": f("max_row_err", ".1e") + ("!" if r.get("check_ok") is False else ""),
            "vs bf16": f("max_row_err_vs_bf16_cache", ".1e"), "dequant ms": f("dequant_ms", ".3f")}


def row_cells(rows: list[dict], wide: bool = False) -> tuple[list[str], list[list[str]]]:
    """(head, cells) of ``run_case`` rows: ``COMPACT_COLUMNS`` (case, variant, ms, TFLOP/s, max row error against the
    reference of the cache read and against the bf16 cache's; "!" after a failed check, ERR for a row that raised),
    or with ``wide`` ``WIDE_COLUMNS`` (the backend and its schedule, the trial quantiles, the floor and the
    dequantization alone as well)."""
    head = list(WIDE_COLUMNS if wide else COMPACT_COLUMNS)
    return head, [[fig[h] for h in head] for fig in map(_row_figures, rows)]


def tables(rows: list[dict], wide: bool = False, interpreted: bool = False) -> list:
    """The rich table of ``row_cells``, then the errors of the rows that raised; ``interpreted``: a Triton-interpreter
    run (its banner in the title)."""
    head, cells = row_cells(rows, wide)
    note = " [INTERPRETER: timings not meaningful]" if interpreted else ""
    caption = ("ms per call; row err = max per-(token, head) row error vs the reference of the cache read, vs bf16 = "
               "vs the bf16 cache's" + ("" if wide else "; --wide: backend, floor, dequantization"))
    failed = [r.get("check_ok") is False or "error" in r for r in rows]
    out: list = [make_table("bf16 vs FP8 cache, attention kernels" + note, head, cells, caption=caption,
                            left=(0, 1, 2) if wide else (0, 1), failed=failed)]
    return out + [f"{r['case']} / {r['variant']}: {r['error']}" for r in rows if "error" in r]


def format_rows(rows: list[dict], wide: bool = False, width: int | None = None, interpreted: bool = False) -> str:
    """``tables`` as text, ``width`` columns wide (default 80; ``wide``: as wide as the table needs)."""
    return render_text(*tables(rows, wide, interpreted), width=width, wide=wide)


if __name__ == "__main__":
    main()
