"""GPU tuning run for the sparse MQA kernels (H200): bf16 correctness, then config sweeps and timings.

Usage on the GPU box:  OUT=out PYTHONPATH=. python3 benchmarks/tune_triton.py [--quick]
Writes $OUT/tune.json and prints a table. Times: ``sparse_mla.bench.timing.median_ms`` (do_bench at the bench's
budget: CUDA events, L2 flushed between runs, median). TFLOP/s of useful work = 2 * H * valid rows * (D_qk + 512) /
time; errors and floors: ``sparse_mla.bench.common``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sparse_mla import SparseMLAWorkspace, build_group_union, sparse_mla_fwd, sparse_mla_ref  # noqa: E402
from sparse_mla.bench.common import floor_ms, rel_err, run_meta, tflops, write_json  # noqa: E402
from sparse_mla.bench.timing import median_ms  # noqa: E402
from sparse_mla.mqa.triton_tl import sparse_mqa_grouped, sparse_mqa_per_token  # noqa: E402
from sparse_mla.union.grouping import overlap_guard_ratio  # noqa: E402
from sparse_mla.union.planning import plan_groups  # noqa: E402
from sparse_mla.union.triton_tl import build_union  # noqa: E402

DEV = "cuda"
D_QK, D_V = 576, 512
RESULTS: list[dict] = []


def bench(fn) -> float:
    return median_ms(fn)


def overlap_topk(T: int, K: int, N: int, block: int, sigma: float, seed: int = 0) -> torch.Tensor:
    """[T, K] distinct rows; tokens in one block of `block` share a base score, sigma mixes in noise."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    out = torch.empty(T, K, dtype=torch.int32, device=DEV)
    nb = triton.cdiv(T, block)
    base = torch.rand(nb, N, generator=g, device=DEV)
    for t0 in range(0, T, 2048):
        t1 = min(T, t0 + 2048)
        rows = torch.arange(t0, t1, device=DEV) // block
        s = base[rows] * (1 - sigma) + torch.rand(t1 - t0, N, generator=g, device=DEV) * sigma
        out[t0:t1] = s.topk(K, dim=1).indices.int()
    return out


def check_correctness() -> None:
    torch.manual_seed(0)
    N, K, T = 8192, 2048, 384
    for H in (16, 32, 64, 128):
        q = torch.randn(T, H, D_QK, device=DEV, dtype=torch.bfloat16)
        kv = torch.randn(N, D_QK, device=DEV, dtype=torch.bfloat16)
        idx = overlap_topk(T, K, N, 8, 0.3, seed=H)
        idx[5, 100:] = -1
        idx[7] = -1
        idx[9, ::3] = N + 7
        tl_ = torch.randint(0, K + 1, (T,), device=DEV, dtype=torch.int32)
        ro, rl = sparse_mla_ref(q, kv, idx, D_QK**-0.5, topk_length=tl_)
        for method, cu in (("per_token", None), ("grouped", None), ("grouped", torch.tensor([0, 100, 101, T], dtype=torch.int32, device=DEV))):
            if method == "grouped" and H == 128:
                continue
            o = torch.full((T, H, D_V), float("nan"), device=DEV, dtype=torch.bfloat16)
            lse = torch.full((T, H), float("nan"), device=DEV)
            sparse_mla_fwd(q, kv, idx, D_QK**-0.5, topk_length=tl_, method=method, cu_seqlens_q=cu, out=o, lse=lse, return_lse=True)
            torch.cuda.synchronize()
            fin = torch.isfinite(rl)
            e = rel_err(o, ro)
            lse_err = (lse[fin] - rl[fin]).abs().max().item()
            ok = (not torch.isnan(o).any().item()) and e < 1e-2 and torch.equal(torch.isfinite(lse), fin) and lse_err < 1e-2
            RESULTS.append(dict(kind="check", H=H, method=method, layout="requests" if cu is not None else "token-major", rel_err=e, lse_err=lse_err, ok=ok))
            print(f"check H={H:3d} {method:9s} {'cu' if cu is not None else 'tm'} rel_err={e:.2e} lse_err={lse_err:.1e} {'OK' if ok else 'FAIL'}", flush=True)


def per_token_sweep(quick: bool) -> None:
    N, K, T = 32768, 2048, 8192
    idx = overlap_topk(T, K, N, 8, 1.0, seed=1)  # iid random lists (no neighbour reuse)
    kv = torch.randn(N, D_QK, device=DEV, dtype=torch.bfloat16)
    cfgs = {
        16: [(64, 4, 2), (64, 4, 3), (32, 4, 3), (64, 8, 2)],
        64: [(64, 8, 2), (64, 8, 3), (32, 8, 3), (32, 4, 2), (64, 4, 2)],
    }
    for H in (16, 64, 128):
        q = torch.randn(T, H, D_QK, device=DEV, dtype=torch.bfloat16)
        out = torch.empty(T, H, D_V, device=DEV, dtype=torch.bfloat16)
        flops = 2 * H * T * K * (D_QK + D_V)
        for cfg in cfgs[16 if H == 16 else 64][: 2 if quick else None]:
            try:
                ms = bench(lambda: sparse_mqa_per_token(q, kv, idx, 0.04, None, out, None, config=cfg))
            except Exception as e:  # noqa: BLE001 - a config that fails to compile is reported, not fatal
                print(f"per_token H={H} cfg={cfg} FAILED: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            RESULTS.append(dict(kind="per_token", H=H, T=T, K=K, N=N, config=cfg, ms=ms, tflops=tflops(flops, ms)))
            print(f"per_token H={H:3d} cfg={cfg} {ms:7.3f} ms {tflops(flops, ms):6.1f} TFLOP/s", flush=True)


def grouped_runs(quick: bool) -> None:
    N, K, T, H = 32768, 2048, 16384, 16
    G = 128 // H
    kv = torch.randn(N, D_QK, device=DEV, dtype=torch.bfloat16)
    q = torch.randn(T, H, D_QK, device=DEV, dtype=torch.bfloat16)
    q64 = torch.zeros(T, 64, D_QK, device=DEV, dtype=torch.bfloat16)
    q64[:, :H] = q
    out = torch.empty(T, H, D_V, device=DEV, dtype=torch.bfloat16)
    out64 = torch.empty(T, 64, D_V, device=DEV, dtype=torch.bfloat16)
    ws = SparseMLAWorkspace(T, K, G, N, torch.device(DEV))
    flops = 2 * H * T * K * (D_QK + D_V)
    sigmas = [0.02, 0.08, 0.2, 1.0] if not quick else [0.08]
    for sigma in sigmas:
        idx = overlap_topk(T, K, N, G, sigma, seed=2)
        u = build_group_union(idx, G, num_kv_rows=N)
        ratio = u.lengths.float().mean().item() / K
        gs, gl, ul = ws.group_start, ws.group_len, ws.union_len
        route = ws.route[:T]

        def union_build():
            plan_groups(T, G, None, gs, gl, route)
            build_union(idx, None, N, G, gs, gl, route, ws.union_tables, ws.union_table_bits,
                        ws.union_rows, ws.union_bits, ul)

        sms = torch.cuda.get_device_properties(0).multi_processor_count
        per_sm = {}
        for p in (2, 4, 8):
            def union_p(p=p):
                plan_groups(T, G, None, gs, gl, route)
                build_union(idx, None, N, G, gs, gl, route, ws.union_tables[: p * sms], ws.union_table_bits[: p * sms],
                            ws.union_rows, ws.union_bits, ul)
            per_sm[p] = bench(union_p)
        print(f"union build programs/SM -> ms: {per_sm}", flush=True)
        t_union = bench(union_build)
        union_build()
        row = dict(kind="grouped", H=H, T=T, K=K, N=N, G=G, sigma=sigma, union_ratio=ratio, union_ms=t_union,
                   union_ms_by_programs_per_sm=per_sm)
        print(f"union build {t_union:.3f} ms", flush=True)
        for bm, cfg in ((64, (64, 8, 2)), (64, (64, 8, 3))):
            try:
                ms = bench(lambda: sparse_mqa_grouped(q, kv, 0.04, G, ws.union_rows, ws.union_bits, ul, gs, gl, out, None, block_m=bm, config=cfg))
            except Exception as e:  # noqa: BLE001
                print(f"grouped bm={bm} cfg={cfg} FAILED: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            row[f"attn_ms_bm{bm}_{cfg[0]}_{cfg[1]}_{cfg[2]}"] = ms
            print(f"grouped sigma={sigma} ratio={ratio:.2f} bm={bm} cfg={cfg} attn {ms:.3f} ms ({tflops(flops, ms):.0f} TFLOP/s useful), union {t_union:.3f} ms", flush=True)
        row["end_to_end_ms"] = bench(lambda: sparse_mla_fwd(q, kv, idx, 0.04, method="grouped", workspace=ws, out=out))
        row["per_token_ms"] = bench(lambda: sparse_mqa_per_token(q, kv, idx, 0.04, None, out, None))
        row["padded64_ms"] = bench(lambda: sparse_mqa_per_token(q64, kv, idx, 0.04, None, out64, None))
        gathered = ratio * K * (T // G) * D_QK * 2
        row["floor_ms"] = floor_ms(2 * 128 * ratio * K * (T // G) * (D_QK + D_V), gathered)
        row["guard_ratio"] = overlap_guard_ratio(G)
        RESULTS.append(row)
        print(f"  sigma={sigma} ratio={ratio:.2f}: e2e {row['end_to_end_ms']:.3f} ms, per_token {row['per_token_ms']:.3f}, padded64 {row['padded64_ms']:.3f}, floor {row['floor_ms']:.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip", default="")
    args = ap.parse_args()
    t0 = time.time()
    if "check" not in args.skip:
        check_correctness()
    if "per_token" not in args.skip:
        per_token_sweep(args.quick)
    if "grouped" not in args.skip:
        grouped_runs(args.quick)
    out_dir = os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)
    meta = run_meta(wall_s=time.time() - t0)
    write_json(os.path.join(out_dir, "tune.json"), meta, RESULTS)
    print(meta)


if __name__ == "__main__":
    main()
