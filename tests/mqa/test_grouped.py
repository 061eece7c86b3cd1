"""Grouped sparse MQA (``method="grouped"`` / ``"auto"``) against ``sparse_mla_ref`` and the per-token path.

G = 128 // H consecutive queries share one tile over the union of their rows. Each case runs with a
workspace we can inspect afterwards, so besides the outputs it checks *how* the work was split: the
groups (never spanning requests when ``cu_seqlens_q`` is given, a short tail group token-major) and
the overlap guard's per-group decision, recomputed here in plain Python from the lists. Outputs are
NaN-poisoned views inside larger NaN buffers: a short group's padded pseudo-heads must not store past
its rows. Sizes stay small (a handful of groups, K <= 70) for the CPU interpreter; the GPU-only tests
at the end run past the CUDA grid limits.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import pytest
import torch
from testlib.adversarial import adversarial_indices, colliding_rows, garbage_topk_length
from testlib.device import DEVICE, DTYPE
from testlib.grids import assert_grids_within_cuda_limits, record_launch_grids
from testlib.problems import cu_seqlens, make_problem, neighbour_rows, poisoned_views, run_checked
from testlib.tolerances import all_of, assert_matches_reference, assert_same_result

from sparse_mla import SparseMLAWorkspace, checks, default_group_size, sparse_mla_fwd, sparse_mla_ref
from sparse_mla.mqa import checks as mqa_checks
from sparse_mla.mqa import selection
from sparse_mla.mqa.interface import explain_fwd
from sparse_mla.union.grouping import overlap_guard_ratio
from sparse_mla.union.triton_tl import hash_table_slots


@dataclass
class Case:
    H: int
    K: int
    lengths: list[int] | None  # requests (cu_seqlens_q); None = token-major over T rows
    T: int | None = None
    lists: str = "neighbour"  # neighbour | disjoint | identical | mixed
    padded: bool = False  # adversarial padding patterns (testlib.adversarial.adversarial_indices)
    topk_length: bool = False  # lengths with garbage after them
    guard: float | None = None  # sparse_mla_fwd's overlap_guard: None default table, 0.0 all per token, inf off
    return_lse: bool = True
    group_size: int | None = None

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths) if self.lengths is not None else self.T


CASES = [
    pytest.param(Case(16, 70, [3, 0, 19, 5], padded=True, topk_length=True), id="H16-cu-3,0,19,5-padded-topklen-guard"),
    pytest.param(Case(16, 70, None, T=19, guard=math.inf, return_lse=False), id="H16-tokenmajor19-tail3-noguard-nolse"),
    pytest.param(Case(8, 40, None, T=21, topk_length=True, guard=math.inf), id="H8-tokenmajor21-tail5-topklen-noguard"),
    pytest.param(Case(8, 40, [17, 4], padded=True, guard=0.0), id="H8-cu-17,4-guard-forced"),
    pytest.param(Case(8, 40, None, T=5, padded=True, guard=math.inf), id="H8-tokenmajor5-one-short-group"),
    pytest.param(Case(32, 70, [9, 0, 2, 6], lists="disjoint", guard=math.inf), id="H32-cu-9,0,2,6-disjoint-noguard"),
    pytest.param(Case(32, 70, None, T=10, lists="mixed"), id="H32-tokenmajor10-mixed-overlap-guard"),
    pytest.param(Case(64, 70, [1, 6, 3], lists="identical", return_lse=False), id="H64-cu-1,6,3-identical"),
    pytest.param(Case(64, 65, None, T=7, padded=True, topk_length=True), id="H64-tokenmajor7-padded-topklen"),
    pytest.param(Case(16, 70, [3, 5, 7], padded=True), id="H16-cu-all-requests-shorter-than-G"),
    pytest.param(Case(16, 70, None, T=10, guard=math.inf, group_size=3), id="H16-group_size3"),
    pytest.param(Case(24, 70, None, T=11, padded=True, guard=math.inf), id="H24-G5-tokenmajor11"),
    pytest.param(Case(128, 70, None, T=3, padded=True), id="H128-G1"),
]


def _lists(case: Case, N: int, g: torch.Generator) -> torch.Tensor:
    T, K = case.num_tokens, case.K
    if case.lists == "neighbour":
        return neighbour_rows(T, K, N, keep=0.8, generator=g)
    if case.lists == "disjoint":
        return torch.randperm(N, generator=g)[: T * K].view(T, K).to(torch.int32)
    if case.lists == "identical":  # one list for every token, as a stride-0 view
        return torch.randperm(N, generator=g)[:K].to(torch.int32).expand(T, K)
    if case.lists == "mixed":  # first half identical (union 1 list), second half disjoint (G lists)
        idx = torch.randperm(N, generator=g)[: T * K].view(T, K).to(torch.int32)
        idx[: T // 2] = idx[0]
        return idx
    raise ValueError(case.lists)


def _build(case: Case, seed: int):
    g = torch.Generator().manual_seed(seed)
    T, K = case.num_tokens, case.K
    N = max(300, T * K)
    idx = _lists(case, N, g)
    if case.padded:
        idx = adversarial_indices(T, K, N, base=idx, generator=g)
    tl_ = None
    if case.topk_length:
        idx, tl_ = garbage_topk_length(idx.contiguous(), N, generator=g)
    stride0 = case.lists == "identical" and not case.padded and not case.topk_length
    if stride0:
        # the expanded view made on the kernels' device: a copy to another device (CPU -> CUDA)
        # materializes a stride-0 view, make_problem's .to(DEVICE) of a tensor already there keeps it
        idx = idx[0].to(DEVICE).expand(T, K)
    p = make_problem(T, case.H, K, N, indices=idx, topk_length=tl_, seed=seed)
    if stride0:
        assert p.indices.stride(0) == 0  # the kernels get one list for every token, stride 0
    return p


def _valid_sets(p) -> list[set[int]]:
    N, (T, K) = p.kv.shape[0], p.indices.shape
    out = []
    for t in range(T):
        n = K if p.topk_length is None else max(0, min(K, int(p.topk_length[t])))
        out.append({int(r) for r in p.indices[t, :n].tolist() if 0 <= r < N})
    return out


def _expected_plan(case: Case, G: int) -> list[tuple[int, int]]:
    """(group_start, group_len) of the groups, in order: within requests (remainders per token) or
    token-major with a short tail group."""
    if case.lengths is None:
        return [(s, min(G, case.T - s)) for s in range(0, case.T, G)]
    plan, start = [], 0
    for n in case.lengths:
        plan += [(start + j * G, G) for j in range(n // G)]
        start += n
    return plan


def _ratio(guard: float | None, G: int) -> float | None:
    """The guard ratio of ``sparse_mla_fwd(overlap_guard=guard)``: None the default table, inf no guard."""
    return overlap_guard_ratio(G) if guard is None else None if math.isinf(guard) else guard


def _expected_guarded(plan, sets, ratio: float | None) -> list[bool]:
    """Per group: True when the overlap guard sends it per token (union rows per mean valid list > ratio)."""
    if ratio is None:
        return [False] * len(plan)
    res = []
    for s, n in plan:
        members = sets[s:s + n]
        union, n_valid = set().union(*members), sum(len(m) for m in members)
        # in fp32, as the builder compares (so that exact ties decide the same way)
        f32 = lambda x: torch.tensor(x, dtype=torch.float32)
        res.append(bool(f32(len(union)) * f32(n) > f32(ratio) * f32(n_valid)))
    return res


@pytest.mark.parametrize("case", CASES)
def test_grouped_matches_reference_and_per_token(case: Case, union_backend):
    """Each case with each union builder (``union_backend``: the Triton twin, and the CUDA shared-memory
    builder on a GPU): outputs, the groups and the guard's decisions."""
    p = _build(case, seed=case.H * 7 + case.K)
    T, H = p.q.shape[:2]
    G = case.group_size or default_group_size(H)
    ws = SparseMLAWorkspace.for_problem(T, case.K, H, p.kv.shape[0], DEVICE, group_size=G)
    cu = cu_seqlens(case.lengths) if case.lengths is not None else None
    out, lse = run_checked(p, return_lse=case.return_lse, method="grouped", cu_seqlens_q=cu, workspace=ws,
                           overlap_guard=case.guard, group_size=case.group_size, pad_tokens=G, pad_heads=1)

    # how the work was split: groups as planned, guard decisions as recomputed from the lists
    plan = _expected_plan(case, G)
    ratio = _ratio(case.guard, G)
    guarded = _expected_guarded(plan, _valid_sets(p), ratio)
    n = len(plan)
    assert ws.group_start[:n].tolist() == [s for s, _ in plan]
    assert ws.group_len[:n].tolist() == [0 if gd else ln for (_, ln), gd in zip(plan, guarded)]
    assert not ws.group_len[n:ws.max_groups].any(), "unused group slots must be cleared"
    grouped_tokens = torch.zeros(T, dtype=torch.bool)
    for (s, ln), gd in zip(plan, guarded):
        grouped_tokens[s:s + ln] = not gd
    assert torch.equal(ws.route[:T].cpu() != 0, ~grouped_tokens), "route must mark exactly the per-token rows"
    if case.guard == math.inf and case.lengths is None:
        assert grouped_tokens.all()

    # the grouped result is the per-token result up to summation order
    ref_pt = sparse_mla_fwd(p.q, p.kv, p.indices, p.sm_scale, topk_length=p.topk_length, return_lse=True,
                            method="per_token")
    assert_same_result(out, lse, ref_pt[0], ref_pt[1] if lse is not None else None, DTYPE)


def test_overlap_guard_case_table_covers_both_decisions():
    """The case table is only meaningful if its guard checks see both outcomes."""
    decisions = set()
    for param in CASES:
        case = param.values[0]
        if case.guard == math.inf:
            continue
        p = _build(case, seed=case.H * 7 + case.K)
        G = case.group_size or default_group_size(case.H)
        ratio = _ratio(case.guard, G)
        decisions.update(_expected_guarded(_expected_plan(case, G), _valid_sets(p), ratio))
    assert decisions == {True, False}


def test_overlap_guard_none_is_the_default_table():
    """overlap_guard=None (the default) applies the default table, as the deprecated -1.0 does; math.inf turns the
    guard off; a float is the ratio itself. Disjoint lists: the default table sends both groups per token."""
    H, K, N, T = 16, 64, 400, 16
    G = default_group_size(H)
    p = make_problem(T, H, K, N, seed=5, indices=neighbour_rows(T, K, N, 0.0, generator=torch.Generator().manual_seed(3)))

    def group_lens(**kw):
        ws = SparseMLAWorkspace.for_problem(T, K, H, N, DEVICE)
        run_checked(p, method="grouped", workspace=ws, **kw)
        return ws.group_len[:T // G].tolist()

    default = group_lens()
    assert default == [0, 0]
    assert group_lens(overlap_guard=None) == default == group_lens(overlap_guard=overlap_guard_ratio(G))
    with pytest.warns(DeprecationWarning, match="overlap_guard=-1.0"):
        assert group_lens(overlap_guard=-1.0) == default
    assert group_lens(overlap_guard=math.inf) == [G, G]
    assert group_lens(overlap_guard=float(G)) == [G, G]  # a union of at most G mean lists always fits
    # the deprecation points at the caller's line (past the call-cache wrapper), so Python's default filter shows it
    with pytest.warns(DeprecationWarning, match="overlap_guard=-1.0") as rec:
        sparse_mla_fwd(p.q, p.kv, p.indices, p.sm_scale, method="grouped", overlap_guard=-1.0)
    assert rec[0].filename == __file__, rec[0].filename
    lines = explain_fwd(p.q, p.kv, p.indices, p.sm_scale, method="grouped", overlap_guard=2.5).splitlines()
    guard = [ln for ln in lines if "overlap guard" in ln]
    assert len(guard) == 1 and "2.5 x the mean list" in guard[0] and "overlap_guard=2.5 for G" in guard[0], guard


@pytest.mark.parametrize("N", [pytest.param(2**28, id="N2^28"), pytest.param(2**31, id="N2^31-row-INT_MAX-valid")])
def test_huge_kv_rows_end_to_end(N):
    """Rows up to the int32 limit through the whole grouped path. kv is one row expanded to N rows
    (stride 0, no memory), so every valid row holds the same data and the reference is the problem with
    every valid index mapped to row 0 of a one-row cache (validity as in the definition: 0 <= row < N).
    With N = 2**31 the row INT_MAX is valid."""
    H, K, T = 16, 24, 11  # G = 8: a full group and a short one
    g = torch.Generator().manual_seed(23)
    row = torch.randn(1, 576, generator=g).to(DTYPE).to(DEVICE)
    kv = row.expand(N, 576)
    top = min(N, 2**31) - 1 - torch.randperm(4 * K, generator=g)[: T * K // 3]  # rows just below the end
    base = torch.cat([top, torch.randint(0, N, (T * K - top.numel(),), generator=g)])
    base = base[torch.randperm(T * K, generator=g)].view(T, K).to(torch.int32)
    idx = adversarial_indices(T, K, N, base=base, generator=g, patterns=("clean", "pad_middle", "sentinels"))
    # rows must be distinct within a list; random draws over 2**28 collide with negligible probability
    assert all_of(len(set(r.tolist())) == K for r in base)
    q = torch.randn(T, H, 576, generator=g).to(DTYPE).to(DEVICE)
    idx = idx.to(DEVICE)
    ws = SparseMLAWorkspace.for_problem(T, K, H, N, DEVICE)
    out_big, lse_big, out, lse = poisoned_views(T, H, pad_tokens=8)
    sparse_mla_fwd(q, kv, idx, 576**-0.5, return_lse=True, method="grouped", workspace=ws, overlap_guard=math.inf,
                   out=out, lse=lse)
    assert ws.group_len[: ws.max_groups].tolist() == [8, 3]
    remapped = torch.where((idx.long() >= 0) & (idx.long() < N), 0, -1).to(torch.int32)
    ref_out, ref_lse = sparse_mla_ref(q, row, remapped, 576**-0.5)
    assert_matches_reference(out, lse, ref_out, ref_lse, DTYPE)
    assert torch.isnan(out_big[T:]).all() and torch.isnan(lse_big[T:]).all()
    out_pt, lse_pt = sparse_mla_fwd(q, kv, idx, 576**-0.5, return_lse=True, method="per_token")
    assert_matches_reference(out_pt, lse_pt, ref_out, ref_lse, DTYPE)


@pytest.mark.parametrize("K, overlap", [
    pytest.param(12, False, id="K12-disjoint-chain-of-48"),
    pytest.param(20, False, id="K20-disjoint-chain-of-80"),
    pytest.param(20, True, id="K20-shared-pool-of-40"),
])
def test_hash_collisions_end_to_end(K, overlap, union_backend):
    """Every row of a group hashes to the last slot of the union builder's table (``testlib.adversarial.colliding_rows``
    mirrors its hash), so the union is built along one probe chain that wraps to slot 0. The result must
    be exact whichever way the builder handles a long chain: a group it reports as overflowed
    (union_len -1, see ``sparse_mla.union.triton_tl.build_union``) must have been routed per token."""
    H, T = 32, 6  # G = 4: groups of 4 and 2
    G = default_group_size(H)
    log_s = hash_table_slots(G, K).bit_length() - 1
    pool_size = 2 * K if overlap else G * K
    pool = colliding_rows(pool_size, log_s, 2**log_s - 1, limit=60_000)
    N = int(pool.max()) + 1
    g = torch.Generator().manual_seed(31)
    idx = torch.empty(T, K, dtype=torch.int32)
    for t in range(T):
        idx[t] = pool[torch.randperm(pool_size, generator=g)[:K]] if overlap else pool[(t % G) * K:(t % G + 1) * K]
    idx = adversarial_indices(T, K, N, base=idx, generator=g, patterns=("clean",) * 4 + ("pad_middle", "sentinels"))
    p = make_problem(T, H, K, N, indices=idx, seed=31)
    ws = SparseMLAWorkspace.for_problem(T, K, H, N, DEVICE)
    run_checked(p, method="grouped", workspace=ws, overlap_guard=math.inf, pad_tokens=G)
    overflowed = (ws.union_len[:2] < 0).tolist()
    assert ws.group_len[:2].tolist() == [0 if o else n for o, n in zip(overflowed, [4, 2])]
    assert ws.route[:T].tolist() == [int(overflowed[t // G]) for t in range(T)]
    if K == 12:  # a chain of 48 slots must not count as an overflow
        assert overflowed == [False, False]


@pytest.mark.parametrize("H, T, expected", [
    pytest.param(16, 12, "grouped", id="H16-T12-grouped"),
    pytest.param(16, 5, "per_token", id="H16-T5-below-min-tokens"),
    pytest.param(128, 3, "per_token", id="H128-G1"),
])
def test_auto_method_follows_the_rule_table(H, T, expected, caplog, monkeypatch):
    """With a rule table that groups from 8 rows at 16 heads, "auto" groups T = 12 (token-major, no cu_seqlens_q,
    on the package's cached workspace), runs T = 5 and 128 heads (G = 1) per token, says so in its one log line,
    and is exact either way."""
    rules = (selection.GroupingRule(16, 8), selection.GroupingRule(128, selection.NEVER))
    monkeypatch.setattr(selection, "GROUPING_RULES", rules)
    _check_auto(H, T, expected, caplog)


def test_auto_method_default_table(caplog):
    """With the shipped table, "auto" runs what ``choose_method`` picks (whatever the measured
    thresholds say) and is exact."""
    H, T = 16, 12
    _check_auto(H, T, selection.choose_method("auto", H, T)[0], caplog)


def _check_auto(H, T, expected, caplog):
    caplog.set_level(logging.DEBUG, logger="sparse_mla")
    g = torch.Generator().manual_seed(H + T)
    p = make_problem(T, H, 30, 300, indices=adversarial_indices(T, 30, 300, base=neighbour_rows(T, 30, 300, 0.8, g)))
    run_checked(p, method="auto", pad_tokens=8)
    chosen = [r.getMessage() for r in caplog.records if r.name == "sparse_mla" and "sparse_mla_fwd" in r.getMessage()]
    assert len(chosen) == 1 and f"-> {expected} " in chosen[0], chosen


def test_workspace_reuse_across_calls(union_backend):
    """One workspace, three calls with different q / kv and layouts (token-major T = 16, then requests
    with fewer groups, then a short token-major call) over the same rows in other orders: stale groups,
    unions, routes or hash-table entries of an earlier call must not leak into a later one (a stale
    table entry would hide a row from the next union). Outputs are views of larger poisoned buffers."""
    H, K, G, N = 16, 20, 8, 400
    ws = SparseMLAWorkspace.for_problem(16, K, H, N, DEVICE)
    lists = neighbour_rows(16, K, N, keep=0.7, generator=torch.Generator().manual_seed(99))
    calls = [
        (16, None),  # 2 groups
        (12, [2, 10]),  # 1 group (rows 2..9): the second slot must be cleared; rows 0, 1, 10, 11 per token
        (5, None),  # 1 short group
    ]
    for i, (T, lengths) in enumerate(calls):
        g = torch.Generator().manual_seed(100 + i)
        base = torch.stack([r[torch.randperm(K, generator=g)] for r in lists[torch.randperm(16, generator=g)[:T]]])
        idx = adversarial_indices(T, K, N, base=base, generator=g, patterns=("clean",) * 3 + ("pad_end",))
        p = make_problem(T, H, K, N, indices=idx, seed=100 + i)
        cu = cu_seqlens(lengths) if lengths is not None else None
        run_checked(p, method="grouped", workspace=ws, cu_seqlens_q=cu, overlap_guard=math.inf, pad_tokens=G)
        n_groups = len(_expected_plan(Case(H, K, lengths, T=T), G))
        planned = -(-T // G)  # the call plans ceil(T / G) group slots of the workspace
        assert int((ws.group_len[:planned] > 0).sum()) == n_groups
        # the builder's persistent hash tables (union_tables: -1 = empty; union_table_bits: 0) are left clean
        assert (ws.union_tables == -1).all() and (ws.union_table_bits == 0).all()


def test_grouped_zero_tokens():
    p = make_problem(0, 16, 8, 50, indices=torch.zeros(0, 8, dtype=torch.int32))
    out, lse = sparse_mla_fwd(p.q, p.kv, p.indices, p.sm_scale, return_lse=True, method="grouped",
                              cu_seqlens_q=cu_seqlens([0]))
    assert out.shape == (0, 16, 512) and lse.shape == (0, 16)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="sizes past the CUDA grid's y limit need a GPU")
def test_grouped_many_tokens():
    """T past the CUDA grid's y limit (65535) in the grouped path: 8K+ groups and per-token remainders
    (request lengths not multiples of G) must all be computed."""
    H, K, N = 16, 32, 8192
    lengths = [3, 65536 + 6, 5]
    T = sum(lengths)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(T, H, 576, device=DEVICE, generator=g).to(DTYPE)
    kv = torch.randn(N, 576, device=DEVICE, generator=g).to(DTYPE)
    base = torch.randint(0, N - 64, (T, 1), device=DEVICE, generator=g, dtype=torch.int32)
    idx = base + torch.arange(0, 2 * K, 2, device=DEVICE, dtype=torch.int32)  # distinct, overlapping neighbours
    out_big, lse_big, out, lse = poisoned_views(T, H, pad_tokens=8)
    sparse_mla_fwd(q, kv, idx, 576**-0.5, return_lse=True, method="grouped", cu_seqlens_q=cu_seqlens(lengths),
                   overlap_guard=math.inf, out=out, lse=lse)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "some tokens were not computed"
    assert torch.isnan(out_big[T:]).all()
    for sl in (slice(0, 16), slice(T - 16, T), slice(40000, 40016)):
        ref_out, ref_lse = sparse_mla_ref(q[sl], kv, idx[sl], 576**-0.5)
        assert_matches_reference(out[sl], lse[sl], ref_out, ref_lse, DTYPE)


@pytest.mark.parametrize("T, cu", [
    pytest.param(65536 + 5, False, id="T65541-per-token-remainder-launch"),
    pytest.param(65536 + 5, True, id="T65541-requests"),
    pytest.param(8 * 65536 + 8, False, id="65537-groups"),
])
def test_launch_grids_within_cuda_limits(T, cu, monkeypatch):
    """Every grid of a grouped call (planner, union builder, grouped and per-token attention) must fit
    CUDA's limits (y and z <= 65535) for any T: checked on the CPU by recording the launches instead of
    running them (test_grouped_many_tokens runs such a call on a GPU)."""
    grids = record_launch_grids(monkeypatch)
    # out as a stride-0 view (T x 16 x 512 would be 8.6 GB): the stubbed kernels write nothing, so the check
    # that a written buffer has its own memory per element is switched off for this test only
    for mod in (checks, mqa_checks):
        monkeypatch.setattr(mod, "has_self_overlap", lambda x: False)
    H = 16
    q = torch.zeros(1, H, 512, dtype=DTYPE, device=DEVICE).expand(T, H, 512)  # stride-0 rows: no memory
    out = torch.empty(1, H, 512, dtype=DTYPE, device=DEVICE).expand(T, H, 512)
    kv = torch.zeros(8, 512, dtype=DTYPE, device=DEVICE)
    idx = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE).expand(T, 1)
    cu_seqlens_q = cu_seqlens([3, T - 8, 5]) if cu else None
    sparse_mla_fwd(q, kv, idx, 1.0, method="grouped", cu_seqlens_q=cu_seqlens_q, out=out)
    assert_grids_within_cuda_limits(grids)
