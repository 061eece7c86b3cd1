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
import sys

import torch

import sparse_mla
from sparse_mla import launch_cache
from sparse_mla.bench.baselines import flash_mla_fwd
from sparse_mla.bench.common import run_meta, write_json
from sparse_mla.bench.op import OpCase, case_inputs, replay_status
from sparse_mla.bench.timing import host_time_us


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
    fm = flash_mla_fwd()
    if fm is not None:
        qp = torch.zeros(T, 64, 576, dtype=q.dtype, device="cuda")
        qp[:, :H] = q
        fns["FlashMLA (q padded to 64)"] = lambda: fm(qp, kv[:, None], idx[:, None], s, 512, None, None)
    return fns


def pieces_for(T: int, H: int) -> dict:
    """The stages of one warm call, each alone (host time of the stage, GPU kept busy)."""
    from sparse_mla.mqa import backends as mqa_backends
    from sparse_mla.mqa import gluon_sm90
    from sparse_mla.mqa.checks import check_sink_and_max_logits, validate_fwd_buffers, validate_sparse_mla_args
    from sparse_mla.mqa.selection import choose_method
    from sparse_mla.union import backends as union_backends
    from sparse_mla.union import probe as union_probe
    from sparse_mla.union.grouping import default_group_size, overlap_guard_ratio
    from sparse_mla.union.planning import plan_groups

    inp = case_inputs(OpCase(H, "mid", 32768, T), "cuda", torch.bfloat16)
    q, kv, idx, s = inp["q"], inp["kv"], inp["indices"], inp["sm_scale"]
    out = torch.empty(T, H, 512, dtype=q.dtype, device="cuda")
    lse = torch.empty(T, H, device="cuda")
    G = default_group_size(H)
    ws = sparse_mla.SparseMLAWorkspace.for_problem(T, idx.shape[1], H, inp["N"], "cuda")
    p = validate_sparse_mla_args(q, kv, idx, s, d_v=512, topk_length=None, cu_seqlens_q=None, check=False,
                                 kv_format=None)
    n_groups = -(-T // G)
    gs, gl, ul = ws.group_start[:n_groups], ws.group_len[:n_groups], ws.union_len[:n_groups]
    route = ws.route[:T]
    guard = overlap_guard_ratio(G)
    planned = union_probe.probe_buffers(n_groups, ws, guard)
    N = inp["N"]
    return {
        "validate_sparse_mla_args": lambda: validate_sparse_mla_args(q, kv, idx, s, d_v=512, topk_length=None,
                                                                     cu_seqlens_q=None, check=False, kv_format=None),
        "choose_method": lambda: choose_method("auto", H, T, None),
        "check_sink_and_max_logits": lambda: check_sink_and_max_logits(None, None, T, H, q.device, check=False),
        "validate_fwd_buffers": lambda: validate_fwd_buffers(p, return_lse=True, grouped=True, group_size=None,
                                                             overlap_guard=None, out=out, lse=lse, workspace=ws,
                                                             extra_outputs={"max_logits": None},
                                                             extra_inputs={"attn_sink": None}),
        "choose_backend": lambda: mqa_backends.choose_backend(q, kv, out),
        "gluon launch per token": lambda: gluon_sm90.launch(q, kv, idx, None, None, None, None, None, out, lse, s,
                                                            grouped=False, num_lists=T, group_heads=H),
        "backends.per_token": lambda: mqa_backends.per_token(q, kv, idx, s, None, out, lse),
        "torch.empty out": lambda: torch.empty(T, H, 512, dtype=q.dtype, device="cuda"),
        "4 workspace slices": lambda: (ws.group_start[:n_groups], ws.group_len[:n_groups], ws.union_len[:n_groups],
                                       ws.route[:T]),
        "plan_groups": lambda: plan_groups(T, G, None, gs, gl, route, planned, union_probe.PROBE_STRIDE),
        "probe_and_skip": lambda: union_probe.probe_and_skip(idx, None, N, G, gs, gl, route, ws, guard, planned),
        "build_union": lambda: union_backends.build_union(idx, None, N, G, gs, gl, route, ws, ws.union_rows,
                                                          ws.union_bits, ul, guard_ratio=guard),
        "backends.grouped": lambda: mqa_backends.grouped(q, kv, s, G, ws.union_rows, ws.union_bits, ul, gs, gl, out,
                                                         lse),
    }


def profile(fn, calls: int = 40, sort: str = "tottime", lines: int = 15) -> str:
    torch.cuda.synchronize()
    torch.cuda._sleep(int(1e9))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(pr, stream=text).sort_stats(sort).print_stats(lines)
    return text.getvalue()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--shapes", default="64x16,1024x16,1024x64", help="TxH pairs")
    ap.add_argument("--pieces", action="store_true", help="also time each stage of a call alone")
    ap.add_argument("--sort", default="tottime", help="cProfile sort key (tottime, cumulative)")
    ap.add_argument("--lines", type=int, default=15, help="cProfile lines per call")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("host_profile.py profiles host time around GPU launches: it needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    for shape in args.shapes.split(","):
        T, H = map(int, shape.split("x"))
        if args.pieces:
            for name, fn in pieces_for(T, H).items():
                for _ in range(5):
                    fn()
                us = host_time_us(fn)
                rows.append({"T": T, "H": H, "piece": name, "host_us": us})
                print(f"T {T:5d} H {H:3d} piece {name:28s} host {us:7.1f} us", flush=True)
        for name, fn in calls_for(T, H).items():
            row = {"T": T, "H": H, "call": name}
            for enabled in (True, False):
                launch_cache.ENABLED = enabled
                for _ in range(5):
                    fn()
                row["host_us" if enabled else "host_us_jit"] = host_time_us(fn)
            launch_cache.ENABLED = True
            row["profile"] = profile(fn, sort=args.sort, lines=args.lines)
            rows.append(row)
            print(f"T {T:5d} H {H:3d} {name:28s} host {row['host_us']:7.1f} us (no replay, JIT launches {row['host_us_jit']:7.1f})",
                  flush=True)
    if args.json:
        timing = "host_time_us: CPU time per call of 40 back-to-back warm calls, the GPU kept busy by a sleep kernel"
        write_json(args.json, run_meta("host_profile", timing=timing, replay=replay_status()), rows)
    print("replay:", json.dumps(replay_status()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
