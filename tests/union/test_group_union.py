"""The top-k union builders (``build_group_union`` and the step path's ``build_union``) and the group
planner against plain-Python sets, for each backend (``sparse_mla.union.backends``: the Triton twin
everywhere, the CUDA shared-memory builder on a GPU with CuPy).

Reference: group g holds queries g*G .. g*G + G - 1 (the last group may be short); a query's list is
its entries before topk_length that lie in [0, N); the union is the sorted set of those rows and a
row's membership word has bit i set iff the row is in query i's list. Also checked: -1 rows and 0
bits after ``lengths``, rows up to the int32 limit, rows chosen to collide in the builder's hash
table (long probe chains that wrap around the table end and spill past one probe chunk), and
``plan_groups``. ``build_union``'s ``predicated_cas`` choice: every allowed form exact on a GPU (tiny
probe tensors replicated across threads up to G = 8, K = 2048), a forced predicated CAS refused where
it would be wrong. The step-path builders (both layouts, overlap guard, the CUDA builder's table
overflow) against a plain-Python reference, the two backends against each other on a GPU, the backend
choice on the CPU, and the CUDA source compiled by NVRTC for sm_80 / sm_90 on the CPU.
"""

from __future__ import annotations

import pytest
import torch
import triton
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from testlib.adversarial import adversarial_indices, colliding_rows, garbage_topk_length
from testlib.device import DEVICE, INT_MAX, INT_MIN
from testlib.problems import cu_seqlens, neighbour_rows
from testlib.tolerances import all_of
from testlib.union import (
    check_union,
    lists_of_kind,
    plan_reference,
    union_reference,
)

from sparse_mla import SparseMLAWorkspace, build_group_union
from sparse_mla.union import cuda_smem
from sparse_mla.union.planning import plan_groups
from sparse_mla.union.triton_tl import build_union, hash_table_slots, union_num_warps, use_predicated_cas

# (G, T, K, N, list kind, padded, topk_length). T is chosen so most groups' last group is short.
CASES = [
    pytest.param(1, 5, 12, 100, "neighbour", True, False, id="G1-padded"),
    pytest.param(2, 7, 12, 100, "disjoint", True, False, id="G2-T7-short-last-disjoint-padded"),
    pytest.param(4, 10, 12, 100, "identical", False, False, id="G4-T10-identical"),
    pytest.param(8, 13, 12, 100, "neighbour", False, True, id="G8-T13-topklen-garbage"),
    pytest.param(16, 20, 12, 300, "neighbour", True, False, id="G16-T20-padded"),
    pytest.param(8, 3, 12, 100, "disjoint", False, False, id="G8-T3-single-short-group"),
    pytest.param(5, 12, 10, 100, "neighbour", True, True, id="G5-nonpow2-padded-topklen"),
    pytest.param(16, 16, 12, 300, "all_invalid", False, False, id="G16-all-invalid"),
]


@pytest.mark.parametrize("G, T, K, N, kind, padded, with_topk_length", CASES)
def test_union_matches_sets(G, T, K, N, kind, padded, with_topk_length, union_backend):
    g = torch.Generator().manual_seed(G * 100 + T)
    idx = lists_of_kind(kind, T, K, N, g)
    if padded:
        idx = adversarial_indices(T, K, N, base=idx, generator=g)
    topk_length = None
    if with_topk_length:
        idx, topk_length = garbage_topk_length(idx.contiguous(), N, generator=g)
    expected = check_union(idx, G, topk_length=topk_length, num_kv_rows=N)
    if kind == "identical":
        assert all_of(len(r) == K and set(b) == {(1 << min(G, T - i * G)) - 1} for i, (r, b) in enumerate(expected))
    if kind == "disjoint" and not padded:
        assert all_of(len(r) == K * min(G, T - i * G) for i, (r, _) in enumerate(expected))
    if kind == "all_invalid":
        assert all_of(len(r) == 0 for r, _ in expected)


@pytest.mark.parametrize("G, N", [
    pytest.param(3, INT_MAX, id="G3-N-int32max"),
    pytest.param(16, INT_MAX - 5, id="G16-N-just-below-int32max"),
    pytest.param(8, 2**31, id="G8-N-2^31-every-int32-row-valid"),
])
def test_rows_near_the_int32_limit(G, N, union_backend):
    """Rows just below N (and N itself, N + 1 where it fits, INT_MAX, INT_MIN as padding) with N at or
    past the int32 limit: no row may be lost, wrapped or taken for a sentinel."""
    T, K = G + 1, 8  # a full group and a short one
    g = torch.Generator().manual_seed(N % 1000)
    top = (min(N, 2**31) - 2 - torch.randperm(3 * K, generator=g)).to(torch.int32)  # rows just below N - 1
    idx = torch.empty(T, K, dtype=torch.int32)
    for t in range(T):
        near = top[torch.randperm(top.numel(), generator=g)[: K // 2]]
        low = torch.randperm(50, generator=g)[: K - K // 2].to(torch.int32)
        idx[t] = torch.cat([near, low])[torch.randperm(K, generator=g)]
    last = min(N, 2**31) - 1  # the largest valid row (INT_MAX itself when N = 2**31)
    idx[0, :3] = torch.tensor([last, -1, INT_MIN], dtype=torch.int32)
    if N <= INT_MAX:
        idx[1, 0] = N  # the first row past the cache is padding
    if N < INT_MAX:
        idx[-1, -1] = N + 1
    idx[-1, 0] = INT_MAX
    expected = check_union(idx, G, num_kv_rows=N)
    assert expected[0][0][-1] == last, "the largest valid row must be in the union"


def test_default_num_kv_rows_keeps_rows_up_to_int32_max(union_backend):
    """num_kv_rows=None: every non-negative int32 row below 2**31 - 1 is valid; INT_MAX is padding."""
    idx = torch.tensor([[INT_MAX - 1, 0, INT_MAX, -1], [INT_MAX - 2, INT_MAX - 1, 5, INT_MIN]], dtype=torch.int32)
    expected = check_union(idx, 2)
    assert expected[0] == ([0, 5, INT_MAX - 2, INT_MAX - 1], [1, 2, 2, 3])


@pytest.mark.parametrize("G, K, overlap", [
    pytest.param(4, 12, False, id="G4-K12-disjoint-chain-of-48"),
    pytest.param(4, 12, True, id="G4-K12-shared-pool-of-24"),
    pytest.param(16, 20, False, id="G16-K20-disjoint-chain-of-320"),
    pytest.param(16, 20, True, id="G16-K20-shared-pool-of-40"),
])
def test_hash_collisions(G, K, overlap, union_backend):
    """Every valid row hashes to the last slot of the builder's table (``testlib.adversarial.colliding_rows`` mirrors its
    hash), so entries probe one long chain that wraps to slot 0 (320 slots for G = 16, K = 20).
    ``overlap``: lists draw from a shared pool of colliding rows, so copies of one row meet in
    different rounds. A short second group with padding too. The union must still be exact."""
    if union_backend == "cuda_smem":  # collide in the CUDA builder's table (build_group_union: no guard)
        log_s = cuda_smem.plan_table(G, K, None, 232448).log_slots
    else:
        log_s = hash_table_slots(G, K).bit_length() - 1
    T = G + 2
    pool_size = G * K if not overlap else 2 * K
    pool = colliding_rows(pool_size, log_s, 2**log_s - 1, limit=600_000)
    N = int(pool.max()) + 1
    g = torch.Generator().manual_seed(G + K)
    idx = torch.empty(T, K, dtype=torch.int32)
    for t in range(T):
        if overlap:
            idx[t] = pool[torch.randperm(pool_size, generator=g)[:K]]
        else:
            idx[t] = pool[(t % G) * K:(t % G + 1) * K]
    idx[G + 1, ::4] = -1
    idx[G, 1] = N
    expected = check_union(idx, G, num_kv_rows=N)
    if not overlap:
        assert len(expected[0][0]) == G * K


def test_indices_layouts(union_backend):
    """[T, 1, K] (FlashMLA) and a row-strided [T, K] slice give the union of the plain [T, K] tensor."""
    g = torch.Generator().manual_seed(3)
    idx = adversarial_indices(9, 12, 80, base=neighbour_rows(9, 12, 80, 0.5, g), generator=g)
    wide = torch.full((9, 20), 7, dtype=torch.int32)
    wide[:, :12] = idx
    check_union(wide[:, :12], 4, num_kv_rows=80)
    check_union(idx[:, None, :], 4, num_kv_rows=80)


def test_zero_tokens(union_backend):
    u = build_group_union(torch.zeros(0, 8, dtype=torch.int32, device=DEVICE), 4)
    assert u.rows.shape == (0, 32) and u.member_mask.shape == (0, 32) and u.lengths.shape == (0,)


_SENTINELS = [-1, INT_MIN, -7]


@st.composite
def _union_inputs(draw):
    G = draw(st.sampled_from([1, 2, 3, 4]))
    K = draw(st.integers(1, 8))
    N = draw(st.integers(1, 40))
    T = draw(st.integers(1, 9))
    rows = []
    for _ in range(T):
        valid = draw(st.lists(st.integers(0, N - 1), unique=True, max_size=min(K, N)))
        pad = draw(st.lists(st.sampled_from(_SENTINELS + [N, N + 3, INT_MAX]), min_size=K - len(valid), max_size=K - len(valid)))
        rows.append(draw(st.permutations(valid + pad)))
    lengths = draw(st.none() | st.lists(st.integers(-2, K + 2), min_size=T, max_size=T))
    return G, N, torch.tensor(rows, dtype=torch.int32), None if lengths is None else torch.tensor(lengths, dtype=torch.int32)


@settings(max_examples=12, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(_union_inputs())
def test_union_random_small(union_backend, inputs):
    """Random small problems (distinct valid rows per list, sentinels, lengths outside [0, K])."""
    G, N, idx, topk_length = inputs
    check_union(idx, G, topk_length=topk_length, num_kv_rows=N)


@pytest.mark.parametrize("G, lengths, T", [
    pytest.param(8, [3, 0, 19, 5, 8, 0, 1, 16], None, id="G8-requests-odd-and-empty"),
    pytest.param(4, [int(x) for x in torch.randint(0, 11, (37,), generator=torch.Generator().manual_seed(1))], None,
                 id="G4-37-random-requests"),
    pytest.param(3, None, 23, id="G3-tokenmajor-short-tail"),
    pytest.param(16, None, 16, id="G16-tokenmajor-exact"),
])
def test_plan_groups(G, lengths, T):
    """Groups stay inside requests (remainders route per token) or run token-major with a short tail;
    stale slots past the last group are cleared and stale routes overwritten."""
    T = sum(lengths) if lengths is not None else T
    starts, lens, route = plan_reference(lengths, T, G)
    max_groups = -(-T // G) + 2  # room for stale slots
    gs = torch.full((max_groups,), 99, dtype=torch.int32, device=DEVICE)
    gl = torch.full((max_groups,), 99, dtype=torch.int32, device=DEVICE)
    rt = torch.full((T + 3,), 7, dtype=torch.int8, device=DEVICE)
    n = max_groups if lengths is not None else -(-T // G)
    plan_groups(T, G, cu_seqlens(lengths) if lengths is not None else None, gs[:n], gl[:n], rt[:T])
    assert gs[: len(starts)].tolist() == starts and gl[: len(lens)].tolist() == lens
    assert (gl[len(lens):n] == 0).all(), "group slots past the last group must have length 0"
    assert rt[:T].tolist() == route and (rt[T:] == 7).all()



def _build_union_direct(idx: torch.Tensor, G: int, topk_length: torch.Tensor | None, N: int,
                        predicated_cas: bool | None, programs: int):
    """``build_union`` with an explicit ``predicated_cas`` on ``programs`` persistent programs (fewer than
    the groups, so each program builds several unions in one table). Returns the workspace."""
    T, K = idx.shape
    n_groups = -(-T // G)
    ws = SparseMLAWorkspace(T, K, G, N, DEVICE)
    gs, gl, ul = ws.group_start[:n_groups], ws.group_len[:n_groups], ws.union_len[:n_groups]
    plan_groups(T, G, None, gs, gl, ws.route[:T])
    build_union(idx, topk_length, N, G, gs, gl, ws.route[:T], ws.union_tables[:programs],
                ws.union_table_bits[:programs], ws.union_rows[:n_groups], ws.union_bits[:n_groups], ul,
                predicated_cas=predicated_cas)
    return ws


# (G, K): G_P * K_P below, at and far above 32 * num_warps (4 warps up to 2048 entries, 16 at 16384)
PRED_SIZES = [
    pytest.param(1, 1, id="G1-K1-total1"),
    pytest.param(2, 16, id="G2-K16-total32"),
    pytest.param(4, 12, id="G4-K12-total64"),
    pytest.param(8, 12, id="G8-K12-total128-limit"),
    pytest.param(16, 100, id="G16-K100-total2048"),
    pytest.param(8, 2048, id="G8-K2048-total16384"),
]


@pytest.mark.parametrize("mode", [
    "default", "off",  # no PTX: the interpreter runs them on the CPU too (K up to 2048)
    pytest.param("forced", marks=[pytest.mark.gpu, pytest.mark.skipif(
        DEVICE.type != "cuda", reason="the predicated CAS is inline PTX: CUDA only")]),
])
@pytest.mark.parametrize("G, K", PRED_SIZES)
def test_predicated_cas_forms_match_sets(G, K, mode):
    """Each ``predicated_cas`` form (None, False, True where allowed) builds the exact unions, with 2
    programs for 5+ groups (table reuse across groups), padding and garbage past topk_length; the hash
    tables are left clean. Forcing True where threads hold replicated entries raises ValueError."""
    total = triton.next_power_of_2(G) * triton.next_power_of_2(K)
    allowed = total >= 32 * union_num_warps(G, K)
    predicated_cas = {"default": None, "off": False, "forced": True}[mode]
    assert use_predicated_cas(True, G, K) == allowed
    T = 5 * G + max(1, G // 2)  # five full groups and a short one
    N = max(64, 4 * K)
    g = torch.Generator().manual_seed(G * 1000 + K)
    base = neighbour_rows(T, K, N, keep=0.5, generator=g) if K <= N // 2 else None
    idx = adversarial_indices(T, K, N, base=base, generator=g,
                              patterns=("clean", "pad_end", "clean", "pad_middle", "sentinels"))
    idx, topk_length = garbage_topk_length(idx, N, generator=g)
    topk_length[::3] = K  # most lists whole
    if mode == "forced" and not allowed:
        with pytest.raises(ValueError, match="32 \\* num_warps"):
            _build_union_direct(idx.to(DEVICE), G, topk_length.to(DEVICE), N, True, programs=2)
        return
    ws = _build_union_direct(idx.to(DEVICE), G, topk_length.to(DEVICE), N, predicated_cas, programs=2)
    expected = union_reference(idx, G, topk_length, N)
    n_groups = len(expected)
    lengths = ws.union_len[:n_groups].cpu()
    rows, bits = ws.union_rows[:n_groups].cpu(), ws.union_bits[:n_groups].cpu()
    for i, (urows, ubits) in enumerate(expected):
        n = len(urows)
        assert int(lengths[i]) == n, f"group {i}: length {int(lengths[i])} != {n}"
        got, order = rows[i, :n].sort()
        assert got.tolist() == urows, f"group {i}: union rows differ"
        assert bits[i, :n][order].tolist() == ubits, f"group {i}: membership bits differ"
    assert (ws.union_tables == -1).all() and (ws.union_table_bits == 0).all(), "hash tables must be left clean"


@pytest.mark.parametrize("G, K", [pytest.param(1, 1, id="G1-K1"), pytest.param(2, 16, id="G2-K16-total32"),
                                  pytest.param(4, 16, id="G4-K16-total64")])
def test_forced_predicated_cas_below_the_block_size_raises(G, K):
    """predicated_cas=True with G_P * K_P < 32 * num_warps raises ValueError before any launch (CPU
    tensors: a launch would reach the interpreter, which cannot run the inline PTX)."""
    assert triton.next_power_of_2(G) * triton.next_power_of_2(K) < 32 * union_num_warps(G, K)
    idx = torch.arange(3 * G * K, dtype=torch.int32).view(3 * G, K)
    T, N = idx.shape[0], 3 * G * K
    ws = SparseMLAWorkspace(T, K, G, N, torch.device("cpu"))
    with pytest.raises(ValueError, match="predicated_cas=True.*32 \\* num_warps"):
        build_union(idx, None, N, G, ws.group_start, ws.group_len, ws.route, ws.union_tables, ws.union_table_bits,
                    ws.union_rows, ws.union_bits, ws.union_len, predicated_cas=True)
    with pytest.raises(ValueError, match="replicated"):
        use_predicated_cas(True, G, K, True)


def test_predicated_cas_decision():
    """Predicated only on CUDA with G_P * K_P >= 32 * num_warps, and never when switched off."""
    assert [union_num_warps(G, K) for G, K in [(8, 16), (16, 128), (8, 512), (8, 2048)]] == [4, 4, 8, 16]
    assert use_predicated_cas(True, 8, 2048) and use_predicated_cas(True, 8, 2048, True)
    assert use_predicated_cas(True, 8, 12)  # 8 * 16 = 128 = 32 * 4: one entry per thread
    assert not use_predicated_cas(True, 4, 16)  # 64 < 128
    assert not use_predicated_cas(True, 8, 2048, False)
    assert not use_predicated_cas(False, 8, 2048)  # the interpreter cannot run inline PTX
    assert not use_predicated_cas(True, 2, 16, False)
    with pytest.raises(ValueError, match="CUDA"):
        use_predicated_cas(False, 8, 2048, True)


