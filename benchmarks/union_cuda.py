#!/usr/bin/env python
"""The CUDA shared-memory union builder (sparse_mla.union.cuda_smem) on the GPU: checked, then timed.

1. Checks (fresh random inputs, seed printed): the CUDA builder and the Triton builder against a torch
   reference (torch.unique over (group, row) keys) and against each other: union rows as sets, membership
   words, union_len (-1 only for groups whose union passes the CUDA table's capacity), group_len and route
   after the overlap guard; both layouts (groups inside requests with cu_seqlens, token-major groups
   spanning requests over global rows of a big paged cache), G = 1 .. 16, K = 64 .. 2048, padding,
   topk_length, rows near 2**31, stride-0 lists, the fallback (a forced small table, the no-overlap worst
   case, G = 16 without a guard), other block sizes; with --e2e also the grouped sparse_mla_fwd with each
   builder (compiles the attention kernels). Odd shapes are checked against the reference only (no Triton
   compile for them). One PASS / FAIL line per check.
2. Timings (``sparse_mla.bench.timing.median_ms``: do_bench at the bench's budget, median, L2 flushed): group plan + union build as the grouped step runs
   it (overlap guard on), Triton vs CUDA, for the bench's synthetic "mid" top-k (sparse_mla.workloads,
   as sparse_mla.bench.inputs makes it: one request from an empty cache): 16K tokens at G = 8, 46K tokens
   at G = 8, 16K at G = 2, 4, 16, and the no-overlap worst case ("none" lists behind a 32K cached prefix,
   disjoint); each in both layouts. Also the CUDA builder without the guard (what `sparse-mla bench`'s
   union_build column times) and kernel variants (block size, loads in flight, table size) at 16K, G = 8, 2, 4.

Writes a JSON to --json (``meta``: ``sparse_mla.bench.common.run_meta`` with the seed and the kernel; ``rows``: the
timings; ``checks``) and prints a short table last. Exit status 1 if a check failed. About 1-3 minutes on an H200:

    python3 benchmarks/union_cuda.py --json results/union-cuda.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sparse_mla import SparseMLAWorkspace  # noqa: E402
from sparse_mla.bench.common import fmt, print_rows, rel_err, run_meta, timing_note, write_json  # noqa: E402
from sparse_mla.bench.timing import median_ms  # noqa: E402
from sparse_mla.union import backends, cuda_smem, planning, triton_tl  # noqa: E402
from sparse_mla.union.grouping import overlap_guard_ratio  # noqa: E402
from sparse_mla.workloads import synthetic_batch  # noqa: E402

DEV = torch.device("cuda")
PAGED_N = 1 << 26  # rows of the "big paged cache" of the token-major layout (64-row blocks, scattered)


# ---------------------------------------------------------------------------------------------
# inputs

def paged(idx: torch.Tensor, n_rows: int, gen: torch.Generator, N: int = PAGED_N, block: int = 64) -> torch.Tensor:
    """Contiguous-cache rows [0, n_rows) -> rows of a paged cache of N rows whose blocks are scattered at random."""
    blocks = torch.randperm(N // block, device=DEV, generator=gen)[: -(-n_rows // block)]
    r = idx.long().clamp(min=0)
    return torch.where(idx >= 0, blocks[r // block] * block + r % block, -1).to(torch.int32).contiguous()


def cu_of(lengths) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=DEV)


class Problem:
    """indices [T, K] int32, valid [T] int32 or None, N, cu_seqlens or None (token-major)."""

    def __init__(self, idx, valid, N, cu):
        self.idx, self.valid, self.N, self.cu = idx.contiguous() if idx.stride(0) else idx, valid, N, cu
        self.T, self.K = idx.shape


def run(backend: str, p: Problem, G: int, guard: float | None, ws: SparseMLAWorkspace, **cuda_kw):
    """Plan + build with one backend into ws. Returns (n_groups, planned group_len, cuda TablePlan or None)."""
    n = ws.max_groups if p.cu is not None else -(-p.T // G)
    gs, gl, ul, route = ws.group_start[:n], ws.group_len[:n], ws.union_len[:n], ws.route[:p.T]
    planning.plan_groups(p.T, G, p.cu, gs, gl, route)
    planned = gl.clone()
    plan = None
    if backend == "cuda_smem":
        plan = cuda_smem.build_union(p.idx, p.valid, p.N, G, gs, gl, route, ws.union_rows, ws.union_bits, ul,
                                     guard_ratio=guard, **cuda_kw)
    else:
        triton_tl.build_union(p.idx, p.valid, p.N, G, gs, gl, route, ws.union_tables, ws.union_table_bits,
                              ws.union_rows, ws.union_bits, ul, guard_ratio=guard)
    return n, planned, plan


def step_fn(backend: str, p: Problem, G: int, guard: float | None, ws: SparseMLAWorkspace, **cuda_kw):
    """The timed step: group plan + union build (the plan resets group_len / route the guard changes)."""
    n = ws.max_groups if p.cu is not None else -(-p.T // G)
    gs, gl, ul, route = ws.group_start[:n], ws.group_len[:n], ws.union_len[:n], ws.route[:p.T]
    if backend == "cuda_smem":
        def f():
            planning.plan_groups(p.T, G, p.cu, gs, gl, route)
            cuda_smem.build_union(p.idx, p.valid, p.N, G, gs, gl, route, ws.union_rows, ws.union_bits, ul,
                                  guard_ratio=guard, **cuda_kw)
    elif backend == "triton":
        def f():
            planning.plan_groups(p.T, G, p.cu, gs, gl, route)
            triton_tl.build_union(p.idx, p.valid, p.N, G, gs, gl, route, ws.union_tables, ws.union_table_bits,
                                  ws.union_rows, ws.union_bits, ul, guard_ratio=guard)
    else:  # plan only
        def f():
            planning.plan_groups(p.T, G, p.cu, gs, gl, route)
    return f


# ---------------------------------------------------------------------------------------------
# reference and comparison

def reference(p: Problem, G: int, gs: torch.Tensor, gl: torch.Tensor):
    """Per planned group: union length, sorted keys (group << 32 | row), membership words, valid entries."""
    n, K = gs.shape[0], p.K
    q = torch.arange(G, device=DEV)
    tok = gs.long()[:, None] + q[None, :]
    qok = q[None, :] < gl.long()[:, None]
    tokc = torch.where(qok, tok, 0)
    rows = p.idx[tokc]  # [n, G, K]
    lens = torch.full_like(tokc, K) if p.valid is None else p.valid[tokc].long().clamp(0, K)
    ok = qok[..., None] & (torch.arange(K, device=DEV) < lens[..., None]) & (rows >= 0) & (rows.long() < p.N)
    g_id = torch.arange(n, device=DEV)[:, None, None].expand_as(rows)
    q_id = q[None, :, None].expand_as(rows)
    kq = torch.unique((g_id[ok] * 2**32 + rows[ok].long()) * 16 + q_id[ok])  # (key, query) pairs, deduped
    keys, inv = torch.unique(kq // 16, return_inverse=True)
    bits = torch.zeros_like(keys).scatter_add_(0, inv, 1 << (kq % 16))
    return torch.bincount(keys >> 32, minlength=n), keys, bits, ok.sum((1, 2))


def canonical(ws: SparseMLAWorkspace, n: int, ul: torch.Tensor, keep: torch.Tensor):
    """Sorted (group << 32 | row) keys and membership words of the groups in ``keep`` (their first ul rows)."""
    U = ws.union_rows.shape[1]
    m = (torch.arange(U, device=DEV)[None] < ul.clamp(min=0).long()[:, None]) & keep[:, None]
    key = (torch.arange(n, device=DEV)[:, None] * 2**32 + ws.union_rows[:n].long())[m]
    order = key.argsort()
    return key[order], ws.union_bits[:n].long()[m][order]


def expected_after(p, G, guard, planned, ulen_ref, nvalid, capacity):
    """(union_len, group_len, per-token rows) the builder must leave; capacity None = no overflow (Triton)."""
    real = planned > 0
    over = real & (ulen_ref > capacity) if capacity is not None else torch.zeros_like(real)
    if guard is None:
        guarded = torch.zeros_like(real)
    else:
        f = torch.float32
        guarded = real & ~over & (ulen_ref.to(f) * planned.to(f) > torch.tensor(guard, dtype=f) * nvalid.to(f))
    ul = torch.where(real, torch.where(over, -1, ulen_ref), 0)
    gl = torch.where(guarded | over, 0, planned)
    return ul.to(torch.int32), gl.to(torch.int32), over, guarded


class _Done(Exception):
    """No cross-comparison to make (the Triton builder was not run)."""


def check_case(name: str, p: Problem, G: int, guard: float | None, results: list, with_triton: bool = True,
               **cuda_kw) -> dict:
    """The CUDA builder (and the Triton one unless ``with_triton`` is False: that saves its compile for odd
    shapes) vs the reference, and the two vs each other; appends and prints one PASS / FAIL line."""
    t0 = time.perf_counter()
    rec = {"name": name, "G": G, "K": p.K, "T": p.T, "N": p.N, "layout": "requests" if p.cu is not None else "token-major",
           "guard": guard, **{k: v for k, v in cuda_kw.items()}}
    problems = []
    try:
        ws = SparseMLAWorkspace(p.T, p.K, G, p.N, DEV)
        out = {}
        for backend in ("triton", "cuda_smem") if with_triton else ("cuda_smem",):
            for t in (ws.union_rows, ws.union_bits, ws.union_len):
                t.fill_(-7)
            n, planned, plan = run(backend, p, G, guard, ws, **(cuda_kw if backend == "cuda_smem" else {}))
            gs = ws.group_start[:n].clone()
            ul, gl, route = ws.union_len[:n].clone(), ws.group_len[:n].clone(), ws.route[:p.T].clone()
            ulen_ref, keys_ref, bits_ref, nvalid = reference(p, G, gs, planned)
            cap = plan.capacity if plan is not None else None
            ul_x, gl_x, over, guarded = expected_after(p, G, guard, planned, ulen_ref, nvalid, cap)
            if not torch.equal(ul, ul_x):
                bad = (ul != ul_x).nonzero()[:3, 0].tolist()
                problems.append(f"{backend}: union_len differs at groups {bad}: {ul[bad].tolist()} vs {ul_x[bad].tolist()}")
            if not torch.equal(gl, gl_x):
                problems.append(f"{backend}: group_len differs ({int((gl != gl_x).sum())} groups)")
            covered = torch.zeros(p.T + 1, dtype=torch.int32, device=DEV)
            kept = gl_x > 0
            covered.index_add_(0, gs[kept].long(), torch.ones(int(kept.sum()), dtype=torch.int32, device=DEV))
            covered.index_add_(0, (gs[kept] + gl_x[kept]).long(), -torch.ones(int(kept.sum()), dtype=torch.int32, device=DEV))
            per_token = covered.cumsum(0)[: p.T] == 0
            if not torch.equal(route != 0, per_token):
                problems.append(f"{backend}: route differs at {int(((route != 0) != per_token).sum())} rows")
            keep = (planned > 0) & ~over
            k_got, b_got = canonical(ws, n, ul, keep)
            in_keep = keep[(keys_ref >> 32)]
            if not (torch.equal(k_got, keys_ref[in_keep]) and torch.equal(b_got, bits_ref[in_keep])):
                problems.append(f"{backend}: union rows / membership words differ from the reference")
            out[backend] = (ul, gl, route, k_got, b_got, keep)
            rec[backend] = {"groups": int((planned > 0).sum()), "guarded": int(guarded.sum()), "overflowed": int(over.sum())}
            if plan is not None:
                rec["table"] = {"slots": plan.slots, "capacity": plan.capacity, "smem_bytes": plan.smem_bytes,
                                "keeps_guarded": plan.keeps_guarded}
                cuda_plan = plan
        if not with_triton:
            raise _Done
        (_, gl_t, rt_t, k_t, b_t, keep_t), (ul_c, gl_c, rt_c, k_c, b_c, keep_c) = out["triton"], out["cuda_smem"]
        # where the CUDA table holds every union the guard keeps, routing is identical; elsewhere it is
        # identical on the groups that did not overflow
        same = slice(None) if cuda_plan.keeps_guarded else ul_c >= 0
        if not torch.equal(gl_t[same], gl_c[same]):
            problems.append("triton vs cuda_smem: group_len differs")
        if cuda_plan.keeps_guarded and not torch.equal(rt_t, rt_c):
            problems.append("triton vs cuda_smem: route differs")
        both = keep_t & keep_c
        kt, bt = canonical_subset(k_t, b_t, both)
        kc, bc = canonical_subset(k_c, b_c, both)
        if not (torch.equal(kt, kc) and torch.equal(bt, bc)):
            problems.append("triton vs cuda_smem: unions differ")
    except _Done:
        pass
    except Exception as exc:  # a crash is a failed check, with its traceback
        problems.append(f"{type(exc).__name__}: {exc}")
        traceback.print_exc()
    rec["ok"] = not problems
    rec["problems"] = problems
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    results.append(rec)
    extra = "" if rec["ok"] else " -- " + "; ".join(problems)
    stats = rec.get("cuda_smem", {})
    print(f"{'PASS' if rec['ok'] else 'FAIL'} check {name}: groups {stats.get('groups')}, guarded {stats.get('guarded')}, "
          f"overflowed {stats.get('overflowed')}{extra}", flush=True)
    return rec


def canonical_subset(keys, bits, groups):
    m = groups[(keys >> 32)]
    return keys[m], bits[m]


def e2e_check(results: list, seed: int) -> None:
    """The grouped sparse_mla_fwd with each union builder (SPARSE_MLA_UNION_BACKEND): same output up to
    summation order (the union order differs), both close to the fp32 reference on sampled tokens."""
    from sparse_mla import sparse_mla_fwd, sparse_mla_ref

    name = "e2e-grouped-sparse_mla_fwd-H16-T2048-mid"
    problems = []
    try:
        b = synthetic_batch([1024], [2048], 2048, "mid", seed=seed, device=DEV)
        g = torch.Generator(device=DEV).manual_seed(seed)
        q = torch.randn(2048, 16, 576, device=DEV, generator=g).to(torch.bfloat16)
        kv = torch.randn(b.num_kv_rows, 576, device=DEV, generator=g).to(torch.bfloat16)
        outs = {}
        old = os.environ.get(backends.ENV_VAR)
        for backend in ("triton", "cuda_smem"):
            os.environ[backends.ENV_VAR] = backend
            outs[backend] = sparse_mla_fwd(q, kv, b.indices, 0.07, topk_length=b.valid, method="grouped",
                                           cu_seqlens_q=b.cu_seqlens_q, return_lse=True)
        if old is None:
            del os.environ[backends.ENV_VAR]
        else:
            os.environ[backends.ENV_VAR] = old
        (o_t, _), (o_c, _) = outs["triton"], outs["cuda_smem"]
        d = rel_err(o_c, o_t)
        if not d < 1e-2 or torch.isnan(o_c).any():
            problems.append(f"outputs differ: rel {d:.2e}")
        sl = torch.arange(0, 2048, 97, device=DEV)
        ref_o, _ = sparse_mla_ref(q[sl], kv, b.indices[sl], 0.07, topk_length=b.valid[sl])
        e = rel_err(o_c[sl], ref_o)
        if not e < 1e-2:
            problems.append(f"cuda_smem run vs reference: rel {e:.2e}")
    except Exception as exc:
        problems.append(f"{type(exc).__name__}: {exc}")
        traceback.print_exc()
    results.append({"name": name, "ok": not problems, "problems": problems})
    print(f"{'PASS' if not problems else 'FAIL'} check {name}{'' if not problems else ' -- ' + '; '.join(problems)}",
          flush=True)


def run_checks(seed: int, e2e: bool) -> list:
    results = []
    gen = torch.Generator(device=DEV).manual_seed(seed)
    K = 2048
    # 1. "mid" lists, three requests (one shorter than G), request layout, guard
    b = synthetic_batch([3000, 0, 100], [1500, 1000, 7], K, "mid", seed=seed, device=DEV)
    mid3 = Problem(b.indices, b.valid, b.num_kv_rows, b.cu_seqlens_q)
    check_case("G8-K2048-mid-3-requests-guard", mid3, 8, overlap_guard_ratio(8), results)
    check_case("G8-K2048-mid-3-requests-noguard", mid3, 8, None, results)
    check_case("G8-K2048-mid-threads512-unroll4", mid3, 8, overlap_guard_ratio(8), results, threads=512, unroll=4)
    check_case("G8-K2048-mid-threads256-unroll1", mid3, 8, overlap_guard_ratio(8), results, threads=256, unroll=1)
    check_case("G8-K2048-mid-forced-table4096-fallback", mid3, 8, overlap_guard_ratio(8), results, slots=4096)
    check_case("G1-K2048-mid-requests-noguard", mid3, 1, None, results, with_triton=False)
    # 2. token-major over a paged cache of 2**26 rows
    tm = Problem(paged(b.indices, b.num_kv_rows, gen), b.valid, PAGED_N, None)
    check_case("G4-K2048-mid-tokenmajor-paged-guard", tm, 4, overlap_guard_ratio(4), results)
    check_case("G2-K2048-mid-tokenmajor-paged-guard", tm, 2, overlap_guard_ratio(2), results)
    bl = synthetic_batch([20000], [1024], K, "low", seed=seed + 1, device=DEV)
    low = Problem(paged(bl.indices, bl.num_kv_rows, gen), bl.valid, PAGED_N, None)
    check_case("G16-K2048-low-tokenmajor-paged-noguard", low, 16, None, results)
    check_case("G16-K2048-low-tokenmajor-paged-guard", low, 16, overlap_guard_ratio(16), results)
    # 3. the no-overlap worst case (disjoint lists behind a 33K prefix): overflow / guard
    bn = synthetic_batch([33000], [512], K, "none", seed=seed + 2, device=DEV)
    none = Problem(paged(bn.indices, bn.num_kv_rows, gen), bn.valid, PAGED_N, None)
    check_case("G8-K2048-none-tokenmajor-guard-overflow", none, 8, overlap_guard_ratio(8), results)
    check_case("G16-K2048-none-tokenmajor-noguard-overflow", none, 16, None, results)
    # 4. iid lists with padding and garbage past topk_length, rows in the millions
    T, K4 = 1203, 512
    idx = torch.randint(0, 5_000_000, (T, K4), device=DEV, generator=gen, dtype=torch.int32)
    idx[:, ::7] = -1
    idx[::5, 3] = 5_000_000  # == N: padding
    idx[::11] = idx[::11].flip(1)
    tl = torch.randint(-3, K4 + 3, (T,), device=DEV, generator=gen, dtype=torch.int32)
    check_case("G4-K512-iid-tokenmajor-topklen-guard", Problem(idx, tl, 5_000_000, None), 4, overlap_guard_ratio(4), results,
               with_triton=False)
    lengths = [int(x) for x in torch.randint(0, 40, (60,), generator=torch.Generator().manual_seed(seed))]
    T2 = sum(lengths)
    near = (2**31 - 1 - torch.randint(0, 50_000, (T2, 1000), device=DEV, generator=gen)).to(torch.int32)
    tl2 = torch.randint(0, 1001, (T2,), device=DEV, generator=gen, dtype=torch.int32)
    check_case("G2-K1000-near-2^31-requests-topklen-guard", Problem(near, tl2, 2**31, cu_of(lengths)), 2,
               overlap_guard_ratio(2), results)
    check_case("G16-K1000-near-2^31-requests-noguard", Problem(near, None, 2**31, cu_of(lengths)), 16, None, results,
               with_triton=False)
    # 5. one list for every row (stride 0), G = 5
    one = torch.randperm(300_000, device=DEV, generator=gen)[:300].to(torch.int32)
    check_case("G5-K300-stride0-identical-tokenmajor", Problem(one.expand(777, 300), None, 300_000, None), 5,
               overlap_guard_ratio(5), results, with_triton=False)
    check_case("G16-K64-tiny-requests", Problem(idx[:, :64].contiguous(), None, 5_000_000, cu_of([50, 17, 0, 100])), 16,
               None, results, with_triton=False)
    if e2e:
        e2e_check(results, seed)
    return results


# ---------------------------------------------------------------------------------------------
# timings

def bench(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return median_ms(fn)


def union_ratio(p: Problem, G: int) -> float:
    """Mean union rows of the planned groups / mean valid entries per query (Triton builder, no guard)."""
    ws = SparseMLAWorkspace(p.T, p.K, G, p.N, DEV)
    n, planned, _ = run("triton", p, G, None, ws)
    real = planned > 0
    nvalid = valid_counts(p, G, ws.group_start[:n], planned)
    return float(ws.union_len[:n][real].double().mean() / (nvalid[real].double().sum() / planned[real].double().sum()))


def valid_counts(p, G, gs, gl) -> torch.Tensor:
    """Valid entries per planned group (in chunks of 256 groups)."""
    n, K = gs.shape[0], p.K
    q = torch.arange(G, device=DEV)
    tok = torch.where(q[None, :] < gl.long()[:, None], gs.long()[:, None] + q[None, :], -1)
    lens = torch.zeros_like(tok)
    okq = tok >= 0
    lens[okq] = K if p.valid is None else p.valid[tok[okq]].long().clamp(0, K)
    nvalid = torch.zeros(n, dtype=torch.long, device=DEV)
    for g0 in range(0, n, 256):  # chunks: [256, G, K] at a time
        t = tok[g0:g0 + 256]
        rows = p.idx[t.clamp(min=0)]
        ok = (t[..., None] >= 0) & (torch.arange(K, device=DEV) < lens[g0:g0 + 256, :, None]) & (rows >= 0) & \
            (rows.long() < p.N)
        nvalid[g0:g0 + 256] = ok.sum((1, 2))
    return nvalid


def same_unions(p: Problem, G: int, guard) -> bool:
    """Triton and CUDA unions equal (as sets, membership words) on the groups both built, same group_len / route."""
    ws = SparseMLAWorkspace(p.T, p.K, G, p.N, DEV)
    res = {}
    for backend in ("triton", "cuda_smem"):
        n, planned, _ = run(backend, p, G, guard, ws)
        ul = ws.union_len[:n].clone()
        res[backend] = (ul, ws.group_len[:n].clone(), ws.route[:p.T].clone(),
                        *canonical(ws, n, ul, (planned > 0) & (ul >= 0)))
    (ul_t, gl_t, rt_t, k_t, b_t), (ul_c, gl_c, rt_c, k_c, b_c) = res["triton"], res["cuda_smem"]
    both = (ul_c >= 0)
    kt, bt = canonical_subset(k_t, b_t, both)
    ok = torch.equal(gl_t, gl_c) and torch.equal(rt_t, rt_c) and torch.equal(kt, k_c) and torch.equal(bt, b_c)
    return bool(ok) and torch.equal(ul_t[both], ul_c[both])


def run_timings(seed: int) -> list:
    rows = []
    gen = torch.Generator(device=DEV).manual_seed(seed)
    K = 2048
    lists = {}
    for key, cached, T, overlap in (("mid16k", 0, 16384, "mid"), ("mid46k", 0, 46080, "mid"),
                                    ("none16k", 32768, 16384, "none")):
        b = synthetic_batch([cached], [T], K, overlap, seed=seed, device=DEV)
        lists[key] = {
            "requests": Problem(b.indices, b.valid, b.num_kv_rows, b.cu_seqlens_q),
            "token-major": Problem(paged(b.indices, b.num_kv_rows, gen), b.valid, PAGED_N, None),
        }
    cases = [("16K G8 mid", "mid16k", 8), ("46K G8 mid", "mid46k", 8), ("16K G2 mid", "mid16k", 2),
             ("16K G4 mid", "mid16k", 4), ("16K G16 mid", "mid16k", 16), ("16K G8 none (worst)", "none16k", 8)]
    for label, key, G in cases:
        for layout in ("requests", "token-major"):
            p = lists[key][layout]
            guard = overlap_guard_ratio(G)
            ws = SparseMLAWorkspace(p.T, p.K, G, p.N, DEV)
            rec = {"case": label, "layout": layout, "tokens": p.T, "topk": K, "G": G, "N": p.N,
                   "guard_ratio": guard, "union_ratio": union_ratio(p, G)}
            rec["same_unions"] = same_unions(p, G, guard)
            rec["plan_ms"] = bench(step_fn("plan", p, G, guard, ws))
            rec["triton_ms"] = bench(step_fn("triton", p, G, guard, ws))
            rec["cuda_smem_ms"] = bench(step_fn("cuda_smem", p, G, guard, ws))
            rec["cuda_smem_noguard_ms"] = bench(step_fn("cuda_smem", p, G, None, ws))
            n, planned, plan = run("cuda_smem", p, G, guard, ws)
            real = planned > 0
            rec["table"] = {"slots": plan.slots, "capacity": plan.capacity, "smem_bytes": plan.smem_bytes}
            rec["groups"] = int(real.sum())
            rec["cuda_overflowed"] = int((ws.union_len[:n][real] < 0).sum())
            rec["per_token_groups"] = int((ws.group_len[:n][real] == 0).sum())
            rec["speedup"] = rec["triton_ms"] / rec["cuda_smem_ms"]
            rows.append(rec)
            print(f"time {label:22s} {layout:11s} ratio {rec['union_ratio']:5.2f}  triton {rec['triton_ms']:7.3f} ms  "
                  f"cuda {rec['cuda_smem_ms']:6.3f} ms (no guard {rec['cuda_smem_noguard_ms']:6.3f}, plan {rec['plan_ms']:.3f})"
                  f"  x{rec['speedup']:5.1f}  same {rec['same_unions']}", flush=True)
            del ws
            torch.cuda.empty_cache()
    # kernel variants at 16K tokens, mid, request layout (G = 8; G = 2, where a CTA has 4 entries per thread)
    p = lists["mid16k"]["requests"]
    variants = [(8, "threads 1024 unroll 8 (default)", {}), (8, "threads 1024 unroll 4", {"unroll": 4}),
                (8, "threads 512 unroll 8", {"threads": 512}), (8, "threads 512 unroll 4", {"threads": 512, "unroll": 4}),
                (8, "table 32768 slots (1 CTA/SM)", {"slots": 32768}), (8, "table 8192 slots", {"slots": 8192}),
                (2, "default", {}), (2, "table 4096 slots", {"slots": 4096}), (2, "table 16384 slots", {"slots": 16384}),
                (2, "threads 512", {"threads": 512}), (2, "threads 256 unroll 4", {"threads": 256, "unroll": 4}),
                (4, "default", {}), (4, "threads 512", {"threads": 512})]
    for G, label, kw in variants:
        ws = SparseMLAWorkspace(p.T, p.K, G, p.N, DEV)
        ms = bench(step_fn("cuda_smem", p, G, overlap_guard_ratio(G), ws, **kw))
        rows.append({"case": f"16K G{G} mid variant", "variant": label, "layout": "requests", "cuda_smem_ms": ms, **kw})
        print(f"time variant G{G} {label:34s} {ms:6.3f} ms", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="out/union-cuda.json", help="where to write the results JSON")
    ap.add_argument("--seed", type=int, default=None, help="seed of the random inputs (default: from the clock)")
    ap.add_argument("--skip-timings", action="store_true")
    ap.add_argument("--e2e", action="store_true", help="also the grouped sparse_mla_fwd with each builder (compiles the "
                    "attention kernels: slower)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("FAIL: no CUDA device")
        return 1
    seed = args.seed if args.seed is not None else int(time.time()) % 100_000
    print(f"seed {seed}; {backends.describe_union_backend(DEV, 8, 2048, overlap_guard_ratio(8))}", flush=True)
    why = cuda_smem.cupy_import_error()
    if why is not None:
        print(f"FAIL: CuPy is not importable: {why}")
        return 1
    t0 = time.perf_counter()
    cuda_smem.get_kernel(torch.cuda.current_device())
    compile_s = time.perf_counter() - t0
    checks = run_checks(seed, args.e2e)
    timings = [] if args.skip_timings else run_timings(seed)
    import cupy

    meta = run_meta(timing=timing_note() + "; each timed call is plan_groups + the builder with the default overlap "
                    "guard (the grouped step's union phase); plan_ms: plan_groups alone; cuda_smem_noguard_ms: without "
                    "the guard", cupy=cupy.__version__, seed=seed, first_compile_seconds=compile_s,
                    kernel={"threads": cuda_smem.THREADS, "min_blocks": cuda_smem.MIN_BLOCKS, "unroll": cuda_smem.UNROLL,
                            "attributes": dict(cuda_smem.get_kernel(torch.cuda.current_device()).attributes.items())})
    write_json(args.json, meta, timings, checks=checks)
    n_fail = sum(not c["ok"] for c in checks) + sum(not r.get("same_unions", True) for r in timings)
    print(f"\nwrote {args.json}; checks: {len(checks) - sum(not c['ok'] for c in checks)} passed, "
          f"{sum(not c['ok'] for c in checks)} failed; first compile {compile_s:.1f} s")
    print_rows("union build: ms per grouped step's union phase", [r for r in timings if "variant" not in r], {
        "case": lambda r: r["case"], "layout": lambda r: r["layout"], "union ratio": lambda r: fmt(r["union_ratio"], ".2f"),
        "triton ms": lambda r: fmt(r["triton_ms"], ".3f"), "cuda_smem ms": lambda r: fmt(r["cuda_smem_ms"], ".3f"),
        "speedup": lambda r: fmt(r["speedup"], ".1f") + "x", "no guard ms": lambda r: fmt(r["cuda_smem_noguard_ms"], ".3f"),
        "table": lambda r: str(r["table"]["slots"]), "same": lambda r: str(r["same_unions"])}, left=(0, 1))
    print_rows("CUDA builder variants (requests layout)", [r for r in timings if "variant" in r], {
        "case": lambda r: r["case"], "variant": lambda r: r["variant"],
        "cuda_smem ms": lambda r: fmt(r["cuda_smem_ms"], ".3f")}, left=(0, 1))
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
