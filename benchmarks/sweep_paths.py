#!/usr/bin/env python
"""GPU crossover sweep of the layer-level DSA prefill paths: build + check + time in one run.

For each layout (DeepSeek-V3.2, GLM-5, GLM-5.3-Flash NoPE), heads per rank (16/32/64/128 where the
model has them) and prompt point (1K..64K new tokens, pure and after a cached prefix), it times
every path that supports the step (``dsa_prefill(..., path=<forced>)``, the whole layer call:
decompression / absorption, masks or unions, attention, W_UV) with ``sparse_mla.bench.timing.time_trial``
(do_bench, L2 flushed between runs; median and 20/80 % quantiles), checks each path's output on the first and
last ``--check-tokens`` tokens against the fp32 layer reference ``dsa_prefill_ref``, prints the best
path per point next to the dispatcher's automatic pick, and the thresholds the timings imply for
``sparse_mla.layer.dispatch.THRESHOLDS``.

Run on the H200 (torch 2.11 / triton 3.6, bf16), from the repository root:

    OUT=./out python benchmarks/sweep_paths.py                    # default subset, about 4 minutes
    OUT=./out python benchmarks/sweep_paths.py --models glm-5 --heads 16 --budget-s 60

Points run cheapest first until ``--budget-s`` seconds have passed; the rest are listed as skipped.
Writes ``$OUT/sweep_paths.json`` (``meta``: ``sparse_mla.bench.common.run_meta`` with the arguments; ``rows``: every
timing; the implied thresholds). Exit status 1 when any output check failed or a path raised.

Useful work (TFLOP/s column): the per-token sparse MLA FLOPs 2 * H * K_valid * (D_qk + D_v) with the
latent dims (576 + 512, or 512 + 512 for NoPE), summed over queries (``dispatch.sparse_work``), the
same for every path, so a higher figure is a faster path.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch

from sparse_mla.bench.common import REP_MS, WARMUP_MS

DEFAULT_PURE = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
DEFAULT_CACHED = ((2048, 2048), (4096, 4096), (6144, 2048), (12288, 4096), (28672, 4096))
PATHS_ORDER = ("dense_mha", "masked_mha", "mqa_grouped", "mqa_per_token")
# rough rates (FLOP/s) used only to order the points and to skip calls longer than --max-call-s
EST_MHA_RATE = 250e12
EST_SPARSE_RATE = 120e12


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="deepseek-v3.2,glm-5,glm-5.3-flash", help="comma-separated MODELS keys")
    ap.add_argument("--heads", default="16,32,64,128", help="heads per rank to run (those dividing num_heads)")
    ap.add_argument("--pure", default=",".join(map(str, DEFAULT_PURE)), help="prompt lengths without cache")
    ap.add_argument("--cached", default=",".join(f"{c}+{n}" for c, n in DEFAULT_CACHED),
                    help="cached+new points, e.g. 6144+2048")
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--overlap", default="mid", help="sparse_mla.workloads overlap preset (high, mid, low, none, random)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop starting new points after this many seconds")
    ap.add_argument("--max-call-s", type=float, default=1.0, help="skip a path whose estimated call time exceeds this")
    ap.add_argument("--warmup-ms", type=int, default=WARMUP_MS, help="do_bench warm-up budget per call (ms)")
    ap.add_argument("--rep-ms", type=int, default=REP_MS, help="do_bench measuring budget per call (ms)")
    ap.add_argument("--check-tokens", type=int, default=128, help="tokens checked at each end (0 = no check)")
    ap.add_argument("--tol", type=float, default=1e-2, help="relative Frobenius error allowed (bf16)")
    ap.add_argument("--smoke-cpu", action="store_true",
                    help="run the script's code on the CPU (Triton interpreter, fp16, one wall-clock run per path): "
                         "a test of the script, not a measurement; use tiny --pure/--cached/--heads/--topk")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.pop("SPARSE_MLA_PATH", None)  # the "auto" column must be the dispatcher's own choice
    if args.smoke_cpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before the first kernel module is imported
        dev, dtype = torch.device("cpu"), torch.float16
    elif torch.cuda.is_available():
        dev, dtype = torch.device("cuda"), torch.bfloat16
    else:
        print("sweep_paths.py needs a CUDA GPU (it times Triton kernels); --smoke-cpu tests the script", file=sys.stderr)
        return 2
    from sparse_mla.bench.common import rel_err, run_meta, timing_note, write_json
    from sparse_mla.bench.inputs import make_inputs, slice_heads, sub_problem
    from sparse_mla.bench.timing import time_trial

    def bench(fn):
        return time_trial(fn, on_gpu=not args.smoke_cpu, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    from sparse_mla.layer import PrefillStep, dsa_prefill, dsa_prefill_ref, explain
    from sparse_mla.layer.dispatch import THRESHOLDS, mha_work, sparse_work, work_ratio
    from sparse_mla.workloads.models import MODELS

    out_dir = os.environ.get("OUT", "./out")
    os.makedirs(out_dir, exist_ok=True)
    models = [MODELS[m.strip()] for m in args.models.split(",") if m.strip()]
    heads_req = [int(h) for h in args.heads.split(",") if h.strip()]
    points = [(0, int(n)) for n in args.pure.split(",") if n.strip()]
    points += [tuple(int(x) for x in p.split("+")) for p in args.cached.split(",") if p.strip()]

    def step_for(model, H, c, n):
        return PrefillStep(H, model.kv_lora_rank, model.qk_nope_head_dim, model.qk_rope_head_dim, model.v_head_dim,
                           args.topk, (c,), (n,))

    def est_s(step, path):
        if path in ("dense_mha", "masked_mha"):
            return mha_work(step) / EST_MHA_RATE
        return sparse_work(step) / EST_SPARSE_RATE

    work = []  # (estimated seconds, model, point, heads list)
    for m in models:
        hs = [h for h in heads_req if h <= m.num_heads and m.num_heads % h == 0]
        for c, n in points:
            est = sum(est_s(step_for(m, h, c, n), p) for h in hs for p in PATHS_ORDER)
            work.append((est, m, (c, n), hs))
    work.sort(key=lambda w: w[0])

    meta = run_meta(device=dev, timing=timing_note(warmup_ms=args.warmup_ms, rep_ms=args.rep_ms,
                                                   interpreted=args.smoke_cpu),
                    args=vars(args), thresholds_in_code=repr(THRESHOLDS))
    print(f"# {meta['gpu']}  torch {meta['torch']}  triton {meta['triton']}  rev {meta['git_revision']}  {meta['date']}")
    hdr = f"{'model':14s} {'H':>3s} {'cached':>6s} {'new':>6s} {'ratio':>5s} | " + " ".join(f"{p:>13s}" for p in PATHS_ORDER)
    print(hdr + " | best          auto (x best)")
    rows, skipped, failures = [], [], 0
    t_start = time.monotonic()
    for _est, m, (c, n), hs in work:
        if time.monotonic() - t_start > args.budget_s:
            skipped.append({"model": m.name, "cached": c, "new": n, "heads": hs, "why": "budget"})
            continue
        t_gen = time.monotonic()
        try:
            base = make_inputs(m, c, n, args.topk, max(hs), args.overlap, args.seed, dev, dtype)
        except Exception as e:  # report and continue: one point must not end the sweep
            failures += 1
            skipped.append({"model": m.name, "cached": c, "new": n, "heads": hs, "why": f"input generation: {e!r}"})
            continue
        gen_s = time.monotonic() - t_gen
        for H in hs:
            inp = slice_heads(base, m, H)
            step = step_for(m, H, c, n)
            decision = explain(step, "auto")
            refs = []
            k = min(args.check_tokens, n)
            if k > 0:
                for lo, hi in ((0, k), (n - k, n)):
                    refs.append((lo, hi, dsa_prefill_ref(**sub_problem(inp, lo, hi))))
            useful = sparse_work(step)
            row = {"model": m.name, "heads": H, "cached": c, "new": n, "topk": args.topk, "overlap": args.overlap,
                   "work_ratio": work_ratio(step), "dense_eligible": decision.supports["dense_mha"][0],
                   "useful_flop": useful, "input_gen_s": gen_s, "auto": decision.path, "auto_reason": decision.reason,
                   "paths": {}}
            out = torch.empty(n, H, m.v_head_dim, dtype=dtype, device=dev)
            for path in PATHS_ORDER:
                ok, why = decision.supports[path]
                rec: dict = {"supported": ok, "reason": why}
                row["paths"][path] = rec
                if not ok:
                    continue
                if est_s(step, path) > args.max_call_s:
                    rec["skipped"] = f"estimated {est_s(step, path):.2f} s per call > --max-call-s"
                    continue
                try:
                    out.fill_(float("nan"))
                    dsa_prefill(**inp, path=path, out=out)
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    errs = [rel_err(out[lo:hi], ref) for lo, hi, ref in refs]
                    rec["check_rel_err"] = max(errs) if errs else None
                    if errs and not (max(errs) < args.tol):  # NaN fails too
                        failures += 1
                        rec["check_failed"] = True
                    fn = lambda inp=inp, path=path, out=out: dsa_prefill(**inp, path=path, out=out)  # noqa: E731
                    med, p20, p80 = bench(fn)
                    rec.update(ms=med, ms_p20=p20, ms_p80=p80, tflops=useful / (med * 1e-3) / 1e12)
                except Exception as e:  # record (e.g. out of memory) and keep sweeping
                    failures += 1
                    rec["error"] = repr(e)
                    rec["traceback"] = traceback.format_exc(limit=3)
                    if dev.type == "cuda":
                        torch.cuda.empty_cache()
            timed = {p: v["ms"] for p, v in row["paths"].items() if v.get("ms") is not None}
            row["best"] = min(timed, key=timed.get) if timed else None
            row["auto_slowdown"] = (timed[row["auto"]] / timed[row["best"]]) if row["auto"] in timed and timed else None
            rows.append(row)

            def cell(p, row=row):
                v = row["paths"][p]
                if v.get("ms") is not None:
                    flag = "!" if v.get("check_failed") else ""
                    return f"{v['ms']:8.3f}ms{flag:1s}".rjust(13)
                return ("ERR" if "error" in v else "skip" if "skipped" in v else "-").rjust(13)

            slow = f"x{row['auto_slowdown']:.2f}" if row["auto_slowdown"] else "n/a"
            print(f"{m.name:14s} {H:3d} {c:6d} {n:6d} {row['work_ratio']:5.2f} | " + " ".join(cell(p) for p in PATHS_ORDER)
                  + f" | {str(row['best']):13s} {row['auto']} ({slow})", flush=True)
        del base
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    from dataclasses import asdict

    from sparse_mla.layer.calibration import TOLERANCE, evaluate, fit_thresholds

    fitted = fit_thresholds(rows)
    ev_code = evaluate(rows)
    ev_fit = evaluate(rows, fitted)
    grouped_wins = [f"{r['model']}/H{r['heads']}/{r['cached']}+{r['new']}" for r in rows
                    if r["paths"]["mqa_grouped"].get("ms") and r["paths"]["mqa_per_token"].get("ms")
                    and r["paths"]["mqa_grouped"]["ms"] * TOLERANCE < r["paths"]["mqa_per_token"]["ms"]]
    print("\n# thresholds fitted to this sweep (sparse_mla.layer.calibration.fit_thresholds):")
    print("THRESHOLDS = (\n" + "".join(f"    {row!r},\n" for row in fitted) + ")")
    for name, ev in (("thresholds in code", ev_code), ("fitted thresholds", ev_fit)):
        worst = max(ev, key=lambda e: e["slowdown"]) if ev else None
        n_bad = sum(e["slowdown"] > TOLERANCE for e in ev)
        print(f"# {name}: {n_bad} of {len(ev)} points slower than {TOLERANCE}x the best; worst {worst}")
    print(f"# grouped beat per token by more than {TOLERANCE}x at {len(grouped_wins)} point(s): {grouped_wins}")
    if skipped:
        print(f"# skipped {len(skipped)} point(s): " + ", ".join(f"{s['model']} {s['cached']}+{s['new']} ({s['why']})"
                                                               for s in skipped))
    path = os.path.join(out_dir, "sweep_paths.json")
    write_json(path, meta, rows, skipped=skipped, fitted_thresholds=[asdict(x) for x in fitted],
               evaluation_thresholds_in_code=ev_code, evaluation_fitted=ev_fit, grouped_wins=grouped_wins,
               elapsed_s=time.monotonic() - t_start, failures=failures)
    print(f"# wrote {path}; {failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
