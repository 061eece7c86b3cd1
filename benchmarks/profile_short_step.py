"""Where the time of a short cached step goes (32K cached + 256 / + 900 new tokens, 16 heads).

For each layer call the bench times (mqa_per_token, mqa_per_token_pad64, mqa_grouped) and for the bare
attention call (sparse_mla_fwd on the absorbed q, 16 and 64 heads): the device time
(``sparse_mla.bench.timing.median_ms``, the bench's do_bench budget, L2 flushed), the host time per call (perf_counter over back-to-back calls, no sync inside), and a
torch.profiler table of the host ops and device kernels of one call.

    python benchmarks/profile_short_step.py --json $OUT/short_step.json
"""

from __future__ import annotations

import argparse
import time

import torch

from sparse_mla import sparse_mla_fwd
from sparse_mla.bench.baselines import mqa_per_token_pad64
from sparse_mla.bench.common import run_meta, write_json
from sparse_mla.bench.inputs import make_inputs
from sparse_mla.bench.timing import median_ms
from sparse_mla.layer import dsa_prefill
from sparse_mla.layer.checks import validate_dsa_prefill_args
from sparse_mla.layer.paths import absorb_queries
from sparse_mla.layer.problem import restrict_to_windows, token_windows
from sparse_mla.workloads.models import MODELS


def host_ms(fn, n=50):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / n * 1e3, (t2 - t0) / n * 1e3


def profile_table(fn, rows=25):
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--model", default="glm-5")
    ap.add_argument("--tables", action="store_true", help="print the profiler tables")
    args = ap.parse_args()
    dev = torch.device("cuda")
    model = MODELS[args.model]
    rows = []
    for new in (256, 900):
        inputs = make_inputs(model, 32768, new, 2048, 16, "mid", 0, dev, torch.bfloat16)
        out = torch.empty(new, 16, model.v_head_dim, dtype=torch.bfloat16, device=dev)
        p = validate_dsa_prefill_args(**inputs)
        q16 = absorb_queries(p)
        q64 = absorb_queries(p, 64)
        lo, win = token_windows(p.step.new_lens, p.step.cached_lens, p.row_offsets, dev)
        idx = restrict_to_windows(p.indices, lo, win)
        kv_rows = p.kv_rows
        calls = {
            "layer mqa_per_token": lambda: dsa_prefill(**inputs, path="mqa_per_token", out=out),
            "layer pad64": lambda: mqa_per_token_pad64(inputs, out),
            "layer mqa_grouped": lambda: dsa_prefill(**inputs, path="mqa_grouped", out=out),
            "validate_dsa_prefill_args": lambda: validate_dsa_prefill_args(**inputs),
            "absorb_queries H16": lambda: absorb_queries(p),
            "absorb_queries pad64": lambda: absorb_queries(p, 64),
            "windows + restrict": lambda: restrict_to_windows(p.indices, *token_windows(
                p.step.new_lens, p.step.cached_lens, p.row_offsets, dev)),
            "sparse_mla_fwd H16": lambda: sparse_mla_fwd(q16, kv_rows, idx, p.sm_scale, d_v=512,
                                                         topk_length=p.topk_length),
            "sparse_mla_fwd H64": lambda: sparse_mla_fwd(q64, kv_rows, idx, p.sm_scale, d_v=512,
                                                         topk_length=p.topk_length),
        }
        for name, fn in calls.items():
            dev_ms = median_ms(fn)
            launch_ms, synced_ms = host_ms(fn)
            rec = {"new": new, "call": name, "do_bench_ms": dev_ms, "host_ms_per_call": launch_ms,
                   "back_to_back_ms_per_call": synced_ms}
            rows.append(rec)
            print(f"{new:5d} {name:28s} do_bench {dev_ms:7.3f} ms  host {launch_ms:7.3f} ms  b2b {synced_ms:7.3f} ms",
                  flush=True)
        if args.tables:
            for name in ("layer mqa_per_token", "layer pad64"):
                print(f"--- {name}, new {new}")
                print(profile_table(calls[name]))
    command = "python benchmarks/profile_short_step.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items())
    write_json(args.json, run_meta(command=command), rows)


if __name__ == "__main__":
    main()
