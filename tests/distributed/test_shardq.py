"""ShardQ (token-sharded sparse MLA across TP ranks), its zigzag split, and its benchmark.

Multi-process tests spawn W ranks (file rendezvous in tmp_path); each rank holds the TP head shard
of q, calls ``shardq_sparse_mla_fwd`` and compares its shard with the fp32 ``sparse_mla_ref`` (the
per-row tolerance of tests/testlib/tolerances.py); the gathered shards are compared, within the same tolerance, with
one process running ``sparse_mla_fwd`` on all heads. Not bitwise: a rank runs the kernel on other head
or row counts than the single process (the TP path: H / W heads), and the CPU's BLAS, like cuBLAS, may
round a product of one shape differently from one of another. Two backends
(``BACKENDS``): gloo on the CPU, the Triton kernels through the interpreter in fp16
(TRITON_INTERPRET=1 is put in the environment the workers inherit, before they import any
kernel), run everywhere; NCCL with one GPU per rank in bf16, compiled kernels (the workers must
not inherit TRITON_INTERPRET=1), run where torch.cuda.device_count() >= 2.

One spawn per world size runs the case table (starting W interpreters costs seconds; W = 4 runs
the cases where the world size matters). A failing rank records its case and traceback in a file the
test reports (``_spawn``), so a peer's "connection closed" cannot hide it; a spawn that scales one
row of one rank's attention output by 1.01 must fail the comparisons. One more gloo spawn runs
``sparse_mla.bench.shardq.run_shardq_bench`` on a tiny model point.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from testlib.device import DEVICE, DTYPE, INT_MAX, INT_MIN
from testlib.distributed import (
    D_V,
    GLOO,
    NCCL,
    WRONG_ROW_FACTOR,
    Backend,
    Case,
    WrongRow,
    build_problem,
    case_named,
    expect_detected,
    gloo_only,
    needs_two_gpus,
    spawn_ranks,
)
from testlib.problems import make_problem
from testlib.tolerances import assert_matches_reference, assert_same_result

from sparse_mla.distributed import (
    shardq_sparse_mla_fwd,
    tp_sparse_mla_fwd,
    zigzag_chunks,
    zigzag_inverse,
    zigzag_partition,
)
from sparse_mla.mqa.reference import sparse_mla_ref

# ---------------------------------------------------------------------------------------------
# zigzag_partition
# ---------------------------------------------------------------------------------------------

ZIGZAG_SIZES = [(0, 1), (0, 3), (1, 1), (1, 2), (3, 2), (5, 4), (7, 4), (8, 2), (29, 2), (30, 4), (31, 8), (1000, 3),
                (1027, 8), (4096, 16)]


@pytest.mark.parametrize("T,W", ZIGZAG_SIZES, ids=[f"T{T}-W{W}" for T, W in ZIGZAG_SIZES])
def test_zigzag_covers_every_row_once_and_inverts(T, W):
    parts = zigzag_partition(T, W)
    assert len(parts) == W
    order = torch.cat(parts)
    assert order.dtype == torch.int64
    assert torch.equal(order.sort().values, torch.arange(T)), "every row exactly once"
    for r, ((sa, la), (sb, lb)) in enumerate(zigzag_chunks(T, W)):
        assert torch.equal(parts[r], torch.cat([torch.arange(sa, sa + la), torch.arange(sb, sb + lb)]))
        assert torch.equal(parts[r], parts[r].sort().values), "a rank's rows ascend (chunk r before 2W - 1 - r)"
    lengths = [n for pair in zigzag_chunks(T, W) for _, n in pair]
    assert max(lengths) - min(lengths) <= 1, f"chunk sizes {lengths} differ by more than 1"
    counts = [p.numel() for p in parts]
    assert max(counts) - min(counts) <= 2
    inv = zigzag_inverse(T, W)
    assert torch.equal(order[inv], torch.arange(T))
    x = torch.randn(T, 3)
    assert torch.equal(x[order][inv], x), "inverse restores token order"


def test_zigzag_balances_causal_work():
    """cost(t) = t + 1 (dense causal / prefix shorter than topk): ranks differ by less than one
    row's cost; a contiguous split would differ by about T^2 / W."""
    for W in (2, 3, 4, 8):
        for T in list(range(0, 300)) + [4095, 8192, 65537]:
            costs = [float((p + 1).sum()) for p in zigzag_partition(T, W)]
            assert max(costs) - min(costs) <= T + 1, (T, W, costs)
    # The contiguous split is what zigzag avoids: the bound above must be able to fail.
    T, W = 4096, 4
    contiguous = [float((torch.arange(r * T // W, (r + 1) * T // W) + 1).sum()) for r in range(W)]
    assert max(contiguous) - min(contiguous) > 100 * (T + 1)


def test_zigzag_topk_capped_work_within_documented_bound():
    """cost(t) = min(t + 1, topk): imbalance at most ~topk^2 / 2 + 2 * topk (module docstring)."""
    for T, W, K in [(8192, 2, 2048), (65536, 2, 2048), (20000, 8, 2048), (300, 4, 40)]:
        costs = [float(torch.clamp(p + 1, max=K).sum()) for p in zigzag_partition(T, W)]
        assert max(costs) - min(costs) <= K * K / 2 + 2 * K, (T, W, K, costs)


@pytest.mark.parametrize("args,exc", [((-1, 2), ValueError), ((4, 0), ValueError), ((4.0, 2), TypeError),
                                      ((4, True), TypeError)], ids=["neg-T", "W0", "float-T", "bool-W"])
def test_zigzag_rejects_bad_sizes(args, exc):
    with pytest.raises(exc, match="num_tokens|world_size"):
        zigzag_partition(*args)


# ---------------------------------------------------------------------------------------------
# Problems: several requests with cached prefixes, request-local causal top-k through a block table
# ---------------------------------------------------------------------------------------------


WORKER_CASES = [
    Case("one_request_odd_T", ((0, 23),), return_lse=False, world_sizes=(2,)),
    Case("requests_cross_chunks_sentinels_topk_length_paged", ((20, 5), (0, 7), (50, 1), (5, 8)),
         use_topk_length=True, paged=True),
    Case("cuda_graph_padding_rows", ((3, 6), (30, 9)), pad_rows=7),
    Case("below_min_tokens_runs_tp", ((10, 12),), min_tokens=1024, pad_rows=3, world_sizes=(2,)),
    Case("fewer_rows_than_chunks", ((40, 3),)),
    Case("grouped_token_major_across_requests", ((0, 7), (12, 11)), method="grouped", topk=32, noise=0.3,
         use_topk_length=True),
]


def _spy(calls: list, rank: int = 0, wrong_row: WrongRow | None = None):
    """attn_fn that records what it was handed, poisons the output buffers it must write with NaN,
    then runs sparse_mla_fwd into them; on rank ``wrong_row[0]`` it then scales output row
    ``wrong_row[1:]`` by WRONG_ROW_FACTOR."""
    from sparse_mla.mqa.interface import sparse_mla_fwd

    def attn_fn(q, kv, indices, sm_scale, **kwargs):
        calls.append(dict(q=q.clone(), indices=indices.clone(), **kwargs))
        assert kwargs["out"].shape == (*q.shape[:2], D_V)
        kwargs["out"].fill_(float("nan"))
        if kwargs["lse"] is not None:
            kwargs["lse"].fill_(float("nan"))
        res = sparse_mla_fwd(q, kv, indices, sm_scale, **kwargs)
        if wrong_row is not None and wrong_row[0] == rank:
            kwargs["out"][wrong_row[1:]] *= WRONG_ROW_FACTOR
        return res

    return attn_fn


def _assert_groups_below_overlap_guard(indices: torch.Tensor, topk_length: torch.Tensor | None, H: int, N: int) -> None:
    """The grouped case must really run grouped: every token-major group of G = 128 // H rows has a
    union (torch.unique) under the overlap guard, so no group falls back to per token."""
    from sparse_mla.union.grouping import default_group_size, overlap_guard_ratio

    G = default_group_size(H)
    indices = indices.cpu()
    K = indices.shape[1]
    valid = (indices >= 0) & (indices < N)
    if topk_length is not None:
        valid &= torch.arange(K)[None, :] < topk_length.cpu()[:, None]
    for g0 in range(0, indices.shape[0], G):
        v, rows = valid[g0:g0 + G], indices[g0:g0 + G]
        union = torch.unique(rows[v]).numel()
        mean = v.sum().item() / v.shape[0]
        assert union <= overlap_guard_ratio(G) * max(mean, 1.0), f"group at row {g0}: union {union}, mean list {mean}"


def _run_case(case: Case, rank: int, W: int, backend: Backend, wrong_row: WrongRow | None = None) -> None:
    """One case on this rank: every collective first (ShardQ, the gathers), then the checks, so a failing
    check leaves no peer inside a collective. ``wrong_row``: see ``_spy``."""
    from sparse_mla.mqa.interface import sparse_mla_fwd

    dtype, dev = backend.dtype, backend.device(rank)
    q, kv, indices, topk_length, scale = build_problem(case, backend=backend, rank=rank)
    T, H, _ = q.shape
    Hl, n = H // W, case.num_real
    heads = slice(rank * Hl, (rank + 1) * Hl)
    q_local = q[:, heads]  # a strided view, as a TP rank's slice may be
    out = torch.full((T, Hl, D_V), float("nan"), dtype=dtype, device=dev)
    lse = torch.full((T, Hl), float("nan"), device=dev) if case.return_lse else None
    calls, timings, info = [], {}, {}
    res = shardq_sparse_mla_fwd(
        q_local, kv, indices, scale, topk_length=topk_length, return_lse=case.return_lse, method=case.method,
        min_tokens=case.min_tokens, num_real_tokens=n if case.pad_rows else None, attn_fn=_spy(calls, rank, wrong_row),
        out=out, lse=lse, timings=timings, info=info,
    )
    if case.return_lse:
        assert res[0] is out and res[1] is lse
    else:
        assert res is out
    gathered = [torch.empty_like(out) for _ in range(W)]
    dist.all_gather(gathered, out)
    full_out = torch.cat(gathered, dim=1)
    full_lse = None
    if case.return_lse:
        gl = [torch.empty_like(lse) for _ in range(W)]
        dist.all_gather(gl, lse)
        full_lse = torch.cat(gl, dim=1)

    # Which path, and exactly what the attention was handed.
    shardq = W > 1 and n >= case.min_tokens and n > 0
    assert info["path"] == ("shardq" if shardq else "tp"), info
    assert timings["path"] == info["path"] and all(timings[k] >= 0 for k in
                                                   ("exchange_q_ms", "attention_ms", "exchange_out_ms", "total_ms"))
    mine = zigzag_partition(n, W)[rank] if shardq else torch.arange(n)
    if mine.numel() == 0:
        assert calls == [], "a rank without rows must not call the attention"
    else:
        (call,) = calls
        expect_q = q[mine] if shardq else q[:n, heads]
        assert torch.equal(call["q"], expect_q), "the exchanged q must be exactly this rank's rows, all heads"
        assert torch.equal(call["indices"], indices[mine])
        assert call["method"] == case.method and call["return_lse"] == case.return_lse
        if topk_length is None:
            assert call["topk_length"] is None
        else:
            assert torch.equal(call["topk_length"], topk_length[mine])
    assert info["rank_rows"] == mine.numel()
    if case.method == "grouped" and mine.numel() > 0:
        _assert_groups_below_overlap_guard(indices[mine], None if topk_length is None else topk_length[mine], H,
                                          kv.shape[0] * (kv.shape[1] if kv.dim() == 3 else 1))

    # Padding rows: never computed, out 0, lse -inf.
    assert torch.all(out[n:] == 0), "padding rows must be 0"
    if case.return_lse:
        assert torch.all(lse[n:] == float("-inf")), "padding rows must have lse -inf"

    # This rank's shard against the fp32 reference on its heads.
    ref_out, ref_lse = sparse_mla_ref(q[:n, heads], kv, indices[:n], scale,
                                      topk_length=None if topk_length is None else topk_length[:n])
    assert_matches_reference(out[:n], lse[:n] if case.return_lse else None, ref_out, ref_lse, dtype)

    # All shards against one process running every head: the same attention per (token, head) row, each
    # row within the row tolerance of the other (not bitwise: the TP path runs H / W heads per call, the
    # grouped method other groups, and a kernel on other head or row counts may round differently).
    if rank == 0:
        single = sparse_mla_fwd(q[:n], kv, indices[:n], scale, topk_length=None if topk_length is None else topk_length[:n],
                                return_lse=True, method=case.method)
        assert_same_result(full_out[:n], full_lse[:n] if case.return_lse else None, single[0],
                           single[1] if case.return_lse else None, dtype)
        full_ref, full_ref_lse = sparse_mla_ref(q[:n], kv, indices[:n], scale,
                                                topk_length=None if topk_length is None else topk_length[:n])
        assert_matches_reference(full_out[:n], full_lse[:n] if case.return_lse else None, full_ref, full_ref_lse,
                                 dtype)


def _check_bad_input(rank: int, W: int, backend: Backend) -> None:
    """Bad arguments raise on every rank before any communication (no rank is left hanging); a
    step with no real rows returns zeros / -inf without communicating."""
    case = WORKER_CASES[0]
    dev = backend.device(rank)
    q, kv, indices, _, scale = build_problem(case, backend=backend, rank=rank)
    T = q.shape[0]
    q_local = q[:, : q.shape[1] // W]
    bad = [
        (dict(q_local=q_local[0]), ValueError, "q must be"),
        (dict(indices=indices[:-1]), ValueError, "indices must be"),
        (dict(indices=indices.long()), TypeError, "indices must be int32"),
        (dict(kv=kv.float()), TypeError, "kv must have the dtype"),
        (dict(topk_length=torch.zeros(T - 1, dtype=torch.int32, device=dev)), ValueError, "topk_length must be"),
        (dict(num_real_tokens=T + 1), ValueError, "num_real_tokens"),
        (dict(num_real_tokens=-1), ValueError, "num_real_tokens"),
        (dict(num_real_tokens=torch.tensor(3)), TypeError, "num_real_tokens"),
        (dict(min_tokens=-5), ValueError, "min_tokens"),
        (dict(min_tokens=1.5), TypeError, "min_tokens"),
        (dict(out=torch.empty(T, 3, D_V, dtype=backend.dtype, device=dev)), ValueError, "out must be"),
        (dict(lse=torch.empty(T, q_local.shape[1], device=dev), return_lse=False), ValueError, "lse"),
        (dict(sm_scale=float("nan")), ValueError, "sm_scale"),
    ]
    for change, exc, msg in bad:
        kwargs = dict(q_local=q_local, kv=kv, indices=indices, sm_scale=scale, min_tokens=1)
        kwargs.update(change)
        args = [kwargs.pop(k) for k in ("q_local", "kv", "indices", "sm_scale")]
        with pytest.raises(exc, match=msg):
            shardq_sparse_mla_fwd(*args, **kwargs)
    # A step of padding rows only: nothing to exchange or compute, zeros / -inf everywhere.
    info = {}
    out, lse = shardq_sparse_mla_fwd(q_local, kv, indices, scale, return_lse=True, min_tokens=0, num_real_tokens=0,
                                     info=info)
    assert info["path"] == "tp" and info["reason"] == "no real rows"
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))
    dist.barrier()  # every rank got here without a collective in between


def _run_cases(rank: int, W: int, backend: Backend, case_ids: list[str], check_bad_input: bool) -> None:
    if check_bad_input:
        _check_bad_input(rank, W, backend)
    for case in WORKER_CASES:
        if case.id in case_ids:
            with case_named(case.id, rank, W, backend):
                _run_case(case, rank, W, backend)


def _run_cases_with_a_wrong_row(rank: int, W: int, backend: Backend, wrong_rows: dict[str, WrongRow]) -> None:
    for case in WORKER_CASES:
        if case.id in wrong_rows:
            expect_detected(W, case.id, _run_case, case, rank, W, backend, wrong_rows[case.id])


@pytest.mark.slow
@pytest.mark.parametrize("backend,world_size", [
    pytest.param(GLOO, 2, marks=gloo_only),
    pytest.param(GLOO, 4, marks=gloo_only),
    pytest.param(NCCL, 2, marks=[pytest.mark.gpu, needs_two_gpus]),
], ids=["gloo-W2", "gloo-W4", "nccl-W2"])
def test_shardq_matches_single_process_and_reference(backend, world_size, tmp_path, monkeypatch):
    """Every WORKER_CASES case on W ranks: path choice, exact exchange (the q rows and index rows each
    rank's attention gets are copies, compared bitwise), padding rows, each rank's shard against the fp32
    reference and the gathered shards against one process on all heads (per-row tolerance of the backend's
    dtype)."""
    spawn_ranks(monkeypatch, tmp_path, world_size, backend, _run_cases,
           [c.id for c in WORKER_CASES if world_size in c.world_sizes], world_size == 2)


# One (rank, row, head) of a rank's attention output per case: a ShardQ row (all heads of rank 1's rows), a row
# of the TP path (rank 0's heads) and a grouped one; each row's query has valid rows (its output is not 0).
WRONG_ROWS: dict[str, WrongRow] = {"one_request_odd_T": (1, 2, 5), "below_min_tokens_runs_tp": (0, 4, 3),
                                   "grouped_token_major_across_requests": (1, 1, 9)}


@pytest.mark.slow
@gloo_only
def test_shardq_comparisons_catch_one_wrong_row(tmp_path, monkeypatch):
    """The comparisons of test_shardq_matches_single_process_and_reference fail when one row of one rank's
    attention output is scaled by 1.01 (the per-row tolerance is 3 fp16 ulps, 1.5e-3)."""
    spawn_ranks(monkeypatch, tmp_path, 2, GLOO, _run_cases_with_a_wrong_row, WRONG_ROWS)


# ---------------------------------------------------------------------------------------------
# In-process: W = 1 and the TP baseline (no communication; current device / dtype)
# ---------------------------------------------------------------------------------------------


def test_shardq_world_size_1_is_local_and_tp_baseline_matches(tmp_path):
    T, H, K, N, pad = 13, 8, 24, 96, 4
    p = make_problem(T, H, K, N, seed=3)
    n = T - pad
    with pytest.raises(RuntimeError, match="initialized"):
        shardq_sparse_mla_fwd(p.q, p.kv, p.indices, p.sm_scale)
    ref_out, ref_lse = sparse_mla_ref(p.q[:n], p.kv, p.indices[:n], p.sm_scale)

    out_tp, lse_tp = torch.full((T, H, D_V), float("nan"), dtype=DTYPE, device=DEVICE), None
    timings = {}
    out_tp, lse_tp = tp_sparse_mla_fwd(p.q, p.kv, p.indices, p.sm_scale, return_lse=True, num_real_tokens=n,
                                       out=out_tp, timings=timings)
    assert timings["path"] == "tp" and timings["exchange_q_ms"] == 0.0 and timings["attention_ms"] >= 0
    assert_matches_reference(out_tp[:n], lse_tp[:n], ref_out, ref_lse, DTYPE)
    assert torch.all(out_tp[n:] == 0) and torch.all(lse_tp[n:] == float("-inf"))

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        info = {}
        out, lse = shardq_sparse_mla_fwd(p.q, p.kv, p.indices, p.sm_scale, return_lse=True, min_tokens=1,
                                         num_real_tokens=n, info=info)
    finally:
        dist.destroy_process_group()
    assert info["path"] == "tp" and "world size 1" in info["reason"]
    assert torch.equal(out, out_tp) and torch.equal(lse, lse_tp)


def test_tp_baseline_all_padding_rows():
    """num_real_tokens = 0: nothing computed, all zeros / -inf, no NaN left."""
    p = make_problem(5, 4, 16, 64, seed=4)
    out, lse = tp_sparse_mla_fwd(p.q, p.kv, p.indices, p.sm_scale, return_lse=True, num_real_tokens=0,
                                 out=torch.full((5, 4, D_V), float("nan"), dtype=DTYPE, device=DEVICE))
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))


@pytest.mark.parametrize("change, exc, match", [
    pytest.param(dict(out=torch.empty(1, 4, D_V, dtype=DTYPE, device=DEVICE).expand(5, 4, D_V)), ValueError,
                 "out must be .*contiguous", id="out-expanded"),
    pytest.param(dict(out=torch.empty(5, 4, D_V, dtype=torch.float32, device=DEVICE)), TypeError,
                 r"out must be \[T, H / W, d_v\] = \[5, 4, 512\] .*got dtype torch.float32", id="out-fp32"),
    pytest.param(dict(lse=torch.empty(4, 5, device=DEVICE).t()), ValueError, r"lse must be .*contiguous; got strides",
                 id="lse-transposed"),
    pytest.param(dict(return_lse=1), TypeError, "return_lse must be a bool", id="return_lse-int"),
    pytest.param(dict(method="flash"), ValueError, "method must be one of", id="method-unknown"),
    pytest.param(dict(sm_scale=True), TypeError, "sm_scale must be a finite float.*bool", id="sm_scale-bool"),
    pytest.param(dict(d_v=512.0), TypeError, "d_v must be an int, got float", id="d_v-float"),
])
def test_tp_and_shardq_bad_arguments(change, exc, match, monkeypatch):
    """The checks both entry points share (``_check_common``), in-process: they run before any collective
    or launch (no process group is started)."""
    import sparse_mla.mqa.interface as interface

    monkeypatch.setattr(interface, "sparse_mla_fwd", lambda *a, **k: pytest.fail("attention ran on a bad argument"))
    p = make_problem(5, 4, 16, 64, seed=4)
    kwargs = {"return_lse": True, **change}
    sm_scale = kwargs.pop("sm_scale", p.sm_scale)
    for fn in (tp_sparse_mla_fwd, shardq_sparse_mla_fwd):
        with pytest.raises(exc, match=match):
            fn(p.q, p.kv, p.indices, sm_scale, **kwargs)
    assert not dist.is_initialized()


def test_build_problem_is_adversarial():
    """The worker problems contain what they claim: sentinels, padding rows, an empty query."""
    case = replace(WORKER_CASES[1], pad_rows=2)
    q, kv, indices, topk_length, _ = build_problem(case)
    N = kv.shape[0] * kv.shape[1]
    for s in (-1, INT_MIN, N, INT_MAX):
        assert (indices == s).any(), f"sentinel {s} missing"
    assert (topk_length == 0).any()
    assert q.shape[0] == case.num_real + 2
