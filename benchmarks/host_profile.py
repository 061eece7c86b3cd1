"""Where a short call's host time goes: per-call CPU time of warm calls with the GPU kept busy, and a cProfile
breakdown, for sparse_mla_fwd (per token, grouped), flash_mla_sparse_fwd and FlashMLA itself when importable; with
the launch cache on and off (``sparse_mla.launch_cache.ENABLED``, the A/B of the direct launches).

    PYTHONPATH=.flashmla/build:. python benchmarks/host_profile.py --json results/host-profile.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch

import sparse_mla
from sparse_mla import launch_cache
from sparse_mla.bench.op import OpCase, case_inputs, flashmla_module, host_time_us, provenance


def calls_for(T: int, H: int) -> dict:
    inp = case_inputs(OpCase(H, "mid", 32768, T), "cuda", torch.bfloat16)
    q, kv, idx, s = inp["q"], inp["kv"], inp["indices"], inp["sm_scale"]
    out = torch.empty(T, H, 512, dtype=q.dtype, device="cuda")
    lse = torch.empty(T, H, device="cuda")
    ws = sparse_mla.SparseMLAWorkspace.for_problem(T, idx.shape[1], H, inp["N"], "cuda")
    fns = {
        "sparse_mla_fwd per_token": lambda: sparse_mla.sparse_mla_fwd(q, kv, idx, s, method="per_token", out=out, lse=lse,
                                                                      return_lse=True),
        "sparse_mla_fwd grouped": lambda: sparse_mla.sparse_mla_fwd(q, kv, idx, s, method="grouped", workspace=ws, out=out),
        "flash_mla_sparse_fwd": lambda: sparse_mla.flash_mla_sparse_fwd(q, kv[:, None], idx[:, None], s, out=out),
    }
    fm = flashmla_module()
    if fm is not None:
        qp = torch.zeros(T, 64, 576, dtype=q.dtype, device="cuda")
        qp[:, :H] = q
        fns["FlashMLA (q padded to 64)"] = lambda: fm(qp, kv[:, None], idx[:, None], s, 512, None, None)
    return fns


def profile(fn, calls: int = 40) -> str:
    torch.cuda.synchronize()
    torch.cuda._sleep(int(1e9))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(15)
    return text.getvalue()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--shapes", default="64x16,1024x16,1024x64", help="TxH pairs")
    args = ap.parse_args()
    rows = []
    for shape in args.shapes.split(","):
        T, H = map(int, shape.split("x"))
        for name, fn in calls_for(T, H).items():
            row = {"T": T, "H": H, "call": name}
            for enabled in (True, False):
                launch_cache.ENABLED = enabled
                for _ in range(5):
                    fn()
                row["host_us" if enabled else "host_us_jit"] = host_time_us(fn)
            launch_cache.ENABLED = True
            row["profile"] = profile(fn)
            rows.append(row)
            print(f"T {T:5d} H {H:3d} {name:28s} host {row['host_us']:7.1f} us (JIT launches {row['host_us_jit']:7.1f})",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": {**provenance(), "kind": "host_profile", "date_s": time.time()}, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
