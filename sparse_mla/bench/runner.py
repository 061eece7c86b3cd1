"""Run the benchmark scenarios: every sparse MQA path side by side, checked against the reference.

Paths per scenario (all on the same q, kv, top-k):
  per_token        ``sparse_mla_fwd(method="per_token")``: one query's heads per tile.
  grouped          ``sparse_mla_fwd(method="grouped")`` end to end (union build + attention).
  per_token_pad64  the per-token kernel on q zero-padded to 64 heads: what engines do on Hopper
                   with FlashMLA's sparse prefill (64-head minimum); the baseline to beat.
  auto             the path ``method="auto"`` picks (and why).
Useful TFLOP/s = 2 * H * (valid rows summed over queries) * (D_qk + 512) / time (per-token FLOPs;
padded heads and masked union rows count as waste).
"""

from __future__ import annotations

import torch

from ..interface import sparse_mla_fwd
from ..kernels.union import build_union, plan_groups
from ..reference import sparse_mla_ref
from ..selection import resolve_method
from ..workloads.topk import synthetic_batch
from ..workspace import SparseMLAWorkspace, default_group_size
from .scenarios import Scenario
from .timing import time_ms

D_V = 512


def _sample_rows(T: int, n: int = 16) -> torch.Tensor:
    return torch.unique(torch.linspace(0, T - 1, steps=min(n, T)).round().long())


def run_scenario(sc: Scenario, *, dtype: torch.dtype, device: torch.device, overlap: str, seed: int = 0,
                 trace_indices: torch.Tensor | None = None, trace_valid: torch.Tensor | None = None) -> dict:
    """Time every path of one scenario; returns a JSON-ready dict (times in ms, rates in TFLOP/s).

    With ``trace_indices`` [T, K] int32 (global rows into a cache of max+1 rows) and
    ``trace_valid`` [T] int32 from an engine dump, those lists replace the synthetic ones.
    """
    on_gpu = device.type == "cuda"
    H, D = sc.heads, sc.model.d_qk
    if trace_indices is None:
        batch = synthetic_batch([sc.cached], [sc.new], sc.topk, overlap, seed=seed, device=device)
        indices, valid, N = batch.indices, batch.valid, batch.num_kv_rows
    else:
        indices, valid = trace_indices.to(device), trace_valid.to(device)
        N = int(indices.max().item()) + 1
    T, K = indices.shape
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(T, H, D, generator=g, device=device).to(dtype)
    kv = torch.randn(N, D, generator=g, device=device).to(dtype)
    scale = sc.model.sm_scale
    cu = torch.tensor([0, T], dtype=torch.int32, device=device)
    G = default_group_size(H)
    ws = SparseMLAWorkspace(T, K, G, N, device)
    out = torch.empty(T, H, D_V, dtype=dtype, device=device)
    valid_total = int(valid.long().sum().item())
    flops = 2 * H * valid_total * (D + D_V)

    rows = _sample_rows(T)
    ref, _ = sparse_mla_ref(q[rows], kv, indices[rows], scale, topk_length=valid[rows])

    def rel_err(o: torch.Tensor) -> float:
        o = o.float()
        return float((o - ref).norm() / ref.norm().clamp_min(1e-30))

    paths: dict[str, dict] = {}

    def record(name: str, fn, out_rows) -> None:
        fn()
        err = rel_err(out_rows())
        t = time_ms(fn, on_gpu=on_gpu)
        paths[name] = {**t, "tflops": flops / t["ms"] / 1e9, "rel_err": err}

    record("per_token", lambda: sparse_mla_fwd(q, kv, indices, scale, topk_length=valid, method="per_token", out=out),
           lambda: out[rows])
    record("grouped", lambda: sparse_mla_fwd(q, kv, indices, scale, topk_length=valid, method="grouped",
                                             cu_seqlens_q=cu, workspace=ws, out=out), lambda: out[rows])
    n_groups = T // G

    def union_only() -> None:
        plan_groups(T, G, cu, ws.group_start, ws.group_len, ws.route[:T])
        build_union(indices, valid, N, G, ws.group_start, ws.group_len, ws.route[:T], ws.union_tables,
                    ws.union_table_bits, ws.union_rows, ws.union_bits, ws.union_len, guard_ratio=None)

    union_only()
    union_rows = ws.union_len[:n_groups].double().mean().item() if n_groups else float("nan")
    per_group_valid = valid[: n_groups * G].double().view(-1, G).mean(1).mean().item() if n_groups else float("nan")
    union_ratio = union_rows / per_group_valid if n_groups else float("nan")
    union_t = time_ms(union_only, on_gpu=on_gpu)
    if H < 64:
        q64 = torch.zeros(T, 64, D, dtype=dtype, device=device)
        q64[:, :H] = q
        out64 = torch.empty(T, 64, D_V, dtype=dtype, device=device)
        record("per_token_pad64", lambda: sparse_mla_fwd(q64, kv, indices, scale, topk_length=valid, method="per_token",
                                                          out=out64), lambda: out64[rows, :H])
        del q64, out64
    chosen, reason = resolve_method("auto", H, T)
    base = paths["per_token"]["ms"]
    for p in paths.values():
        p["speedup_vs_per_token"] = base / p["ms"]
        if "per_token_pad64" in paths:
            p["speedup_vs_pad64"] = paths["per_token_pad64"]["ms"] / p["ms"]
    return {
        "scenario": sc.name, "model": sc.model.name, "tp": sc.tp, "heads": H, "d_qk": D, "cached": sc.cached,
        "new": sc.new, "tokens": T, "topk": K, "kv_rows": N, "valid_rows_mean": valid_total / max(T, 1),
        "group_size": G, "union_ratio": union_ratio, "union_build_ms": union_t["ms"],
        "useful_tflop": flops / 1e12, "auto_path": chosen, "auto_reason": reason, "paths": paths,
        # roofline of the per-token path: FLOPs at 790 TFLOP/s vs every query gathering its rows at 4.3 TB/s
        "floor_ms_per_token": max(flops / 790e12, valid_total * D * 2 / 4.3e12) * 1e3,
    }
