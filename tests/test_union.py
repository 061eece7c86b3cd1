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
from testlib import cuda_emulation
from testlib.adversarial import adversarial_indices, colliding_rows, garbage_topk_length
from testlib.backends import BACKEND_PARAMS, cuda_smem_unavailable
from testlib.device import DEVICE, HAS_CUDA, INT_MAX, INT_MIN
from testlib.problems import cu_seqlens, neighbour_rows
from testlib.tolerances import all_of

from sparse_mla import SparseMLAWorkspace, build_group_union
from sparse_mla.union import backends, cuda_smem
from sparse_mla.union.planning import plan_groups
from sparse_mla.union.triton_tl import build_union, hash_table_slots, union_num_warps, use_predicated_cas


def union_reference(indices: torch.Tensor, G: int, topk_length: torch.Tensor | None, N: int):
    """Per group: (sorted union rows, membership words), from Python sets."""
    T, K = indices.shape
    rows = indices.tolist()
    lengths = [K] * T if topk_length is None else [max(0, min(K, int(n))) for n in topk_length.tolist()]
    sets = [{r for r in rows[t][: lengths[t]] if 0 <= r < N} for t in range(T)]
    groups = []
    for g0 in range(0, T, G):
        members = sets[g0:g0 + G]
        union = sorted(set().union(*members))
        bits = [sum(1 << i for i, m in enumerate(members) if r in m) for r in union]
        groups.append((union, bits))
    return groups


def check_union(indices: torch.Tensor, G: int, *, topk_length: torch.Tensor | None = None,
                num_kv_rows: int | None = None) -> list[tuple[list[int], list[int]]]:
    """Run ``build_group_union`` and compare every output element to ``union_reference``."""
    T = indices.shape[0]
    K = indices.shape[-1]
    u = build_group_union(indices.to(DEVICE), G, topk_length=None if topk_length is None else topk_length.to(DEVICE),
                          num_kv_rows=num_kv_rows)
    n_groups = -(-T // G)
    assert u.group_size == G
    assert u.rows.shape == (n_groups, G * K) and u.member_mask.shape == (n_groups, G * K)
    assert u.lengths.shape == (n_groups,)
    assert u.rows.dtype == u.member_mask.dtype == u.lengths.dtype == torch.int32
    N = 2**31 - 1 if num_kv_rows is None else num_kv_rows
    expected = union_reference(indices.reshape(T, K).cpu(), G, topk_length, N)
    rows, bits, lengths = u.rows.cpu(), u.member_mask.cpu(), u.lengths.cpu()
    for g, (urows, ubits) in enumerate(expected):
        n = len(urows)
        assert int(lengths[g]) == n, f"group {g}: length {int(lengths[g])} != {n}"
        got = rows[g, :n]
        assert got.tolist() == urows, f"group {g}: union rows differ"
        assert bool((got[1:] > got[:-1]).all()), f"group {g}: rows not strictly ascending"
        assert bits[g, :n].tolist() == ubits, f"group {g}: membership bits differ"
        assert bool((rows[g, n:] == -1).all()), f"group {g}: rows after lengths must be -1"
        assert bool((bits[g, n:] == 0).all()), f"group {g}: member_mask after lengths must be 0"
        n_members = min(G, T - g * G)
        assert all(b >> n_members == 0 for b in ubits)  # a short group's missing queries have no bits
    return expected


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


def _lists(kind: str, T: int, K: int, N: int, g: torch.Generator) -> torch.Tensor:
    if kind == "neighbour":
        return neighbour_rows(T, K, N, keep=0.6, generator=g)
    if kind == "disjoint":
        return torch.randperm(N, generator=g)[: T * K].view(T, K).to(torch.int32)
    if kind == "identical":
        return torch.randperm(N, generator=g)[:K].to(torch.int32).expand(T, K)
    if kind == "all_invalid":
        return adversarial_indices(T, K, N, patterns=("all_invalid",))
    raise ValueError(kind)


@pytest.mark.parametrize("G, T, K, N, kind, padded, with_topk_length", CASES)
def test_union_matches_sets(G, T, K, N, kind, padded, with_topk_length, union_backend):
    g = torch.Generator().manual_seed(G * 100 + T)
    idx = _lists(kind, T, K, N, g)
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


def _plan_reference(lengths: list[int] | None, T: int, G: int):
    starts, lens, route = [], [], [1] * T
    spans = [(0, T)] if lengths is None else []
    if lengths is not None:
        s = 0
        for n in lengths:
            spans.append((s, s + n))
            s += n
    for a, b in spans:
        n_full = (b - a) // G if lengths is not None else -(-(b - a) // G)
        for j in range(n_full):
            starts.append(a + j * G)
            lens.append(min(G, b - a - j * G))
            route[a + j * G: a + j * G + lens[-1]] = [0] * lens[-1]
    return starts, lens, route


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
    starts, lens, route = _plan_reference(lengths, T, G)
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


# ---------------------------------------------------------------------------------------------
# The step path's builders (``build_union`` of each backend) against a plain-Python reference:
# both layouts, the overlap guard, and the CUDA builder's table overflow (small tables forced).

def builder_reference(idx: torch.Tensor, topk_length: torch.Tensor | None, N: int, G: int,
                      lengths: list[int] | None, guard: float | None, capacity: int | None):
    """Per planned group (plan as ``_plan_reference``): dict(start, glen, union (set), bits (row -> word),
    guarded, overflow). ``capacity``: the CUDA builder's table capacity (None: no overflow, Triton).
    The guard compares u * glen > ratio * (valid entries) in fp32, as both builders do."""
    T, K = idx.shape
    rows = idx.tolist()
    lens = [K] * T if topk_length is None else [max(0, min(K, int(n))) for n in topk_length.tolist()]
    lists = [[r for r in rows[t][: lens[t]] if 0 <= r < N] for t in range(T)]
    starts, glens, _ = _plan_reference(lengths, T, G)
    f32 = lambda x: torch.tensor(x, dtype=torch.float32)
    groups = []
    for s, n in zip(starts, glens):
        members = [set(lists[t]) for t in range(s, s + n)]
        union = set().union(*members)
        bits = {r: sum(1 << i for i, m in enumerate(members) if r in m) for r in union}
        n_valid = sum(len(lists[t]) for t in range(s, s + n))
        overflow = capacity is not None and len(union) > capacity
        guarded = guard is not None and not overflow and bool(f32(len(union)) * f32(n) > f32(guard) * f32(n_valid))
        groups.append(dict(start=s, glen=n, union=union, bits=bits, guarded=guarded, overflow=overflow))
    return groups


def run_builder(backend: str, idx: torch.Tensor, topk_length: torch.Tensor | None, N: int, G: int,
                lengths: list[int] | None, guard: float | None, slots: int | None = None):
    """Plan the groups and build their unions with one backend's launcher on poisoned buffers
    (rows / bits / union_len 7777, route 9 outside the requests' rows). Returns the workspace and the
    CUDA TablePlan (None for Triton)."""
    T, K = idx.shape
    ws = SparseMLAWorkspace(T, K, G, N, DEVICE)
    n_groups = ws.max_groups if lengths is not None else -(-T // G)
    gs, gl, ul = ws.group_start[:n_groups], ws.group_len[:n_groups], ws.union_len[:n_groups]
    for t in (ws.union_rows, ws.union_bits, ws.union_len):
        t.fill_(7777)
    ws.route.fill_(9)
    route = ws.route[:T]
    idx_d = idx.to(DEVICE)
    tl_d = topk_length.to(DEVICE) if topk_length is not None else None
    plan_groups(T, G, cu_seqlens(lengths) if lengths is not None else None, gs, gl, route)
    plan = None
    if backend == "cuda_smem":
        plan = cuda_smem.build_union(idx_d, tl_d, N, G, gs, gl, route, ws.union_rows, ws.union_bits, ul,
                                     guard_ratio=guard, slots=slots)
    elif backend.startswith("cuda_emu"):  # the kernel's source on the CPU (tests/testlib/cuda_emulation.py)
        threads, unroll = EMULATED[backend]
        lib, why = cuda_emulation.build(threads, unroll)
        if lib is None:
            pytest.skip(f"cannot build the CPU emulation of the CUDA kernel: {why}")
        bufs = [t.cpu().clone() for t in (gs, gl, route, ws.union_rows, ws.union_bits, ul)]
        idx_c, tl_c = idx.contiguous(), topk_length.contiguous() if topk_length is not None else None
        cfg = cuda_smem.launch_config(idx_c, tl_c, N, G, *bufs, guard_ratio=guard, slots=slots,
                                      max_smem=EMULATED_SMEM)
        cuda_emulation.emulate(lib, cfg, threads)
        for dst, src in zip((gs, gl, route, ws.union_rows, ws.union_bits, ul), bufs):
            dst.copy_(src)
        plan = cfg.plan
    else:
        build_union(idx_d, tl_d, N, G, gs, gl, route, ws.union_tables, ws.union_table_bits, ws.union_rows,
                    ws.union_bits, ul, guard_ratio=guard)
    return ws, n_groups, plan


def check_builder(backend: str, idx: torch.Tensor, topk_length: torch.Tensor | None, N: int, G: int,
                  lengths: list[int] | None, guard: float | None, slots: int | None = None):
    """``run_builder`` against ``builder_reference``: lengths (u, or -1 for an overflowed group), group_len
    (0 for guarded / overflowed groups), route (1 exactly for per-token rows), the union rows as a set
    with their membership words, and nothing written past union_len. Returns the reference groups."""
    T, K = idx.shape
    ws, n_groups, plan = run_builder(backend, idx, topk_length, N, G, lengths, guard, slots)
    capacity = plan.capacity if plan is not None else None
    expected = builder_reference(idx, topk_length, N, G, lengths, guard, capacity)
    gl, ul = ws.group_len[:n_groups].cpu(), ws.union_len[:n_groups].cpu()
    rows, bits, route = ws.union_rows.cpu(), ws.union_bits.cpu(), ws.route.cpu()
    per_token = [1] * T
    for g, e in enumerate(expected):
        u = len(e["union"])
        assert int(ul[g]) == (-1 if e["overflow"] else u), f"group {g}: union_len {int(ul[g])}, expected {e}"
        dropped = e["guarded"] or e["overflow"]
        assert int(gl[g]) == (0 if dropped else e["glen"]), f"group {g}: group_len {int(gl[g])}"
        if not dropped:
            per_token[e["start"]: e["start"] + e["glen"]] = [0] * e["glen"]
        if e["overflow"]:
            continue
        got_rows = rows[g, :u].tolist()
        assert len(set(got_rows)) == u and set(got_rows) == e["union"], f"group {g}: union rows differ"
        assert {r: b for r, b in zip(got_rows, bits[g, :u].tolist())} == e["bits"], f"group {g}: membership differs"
        assert bool((rows[g, u:] == 7777).all()) and bool((bits[g, u:] == 7777).all()), f"group {g}: wrote past u"
    for g in range(len(expected), n_groups):  # planner slots past the last group (request layout)
        assert int(gl[g]) == 0 and int(ul[g]) == 0, f"empty slot {g}: group_len {int(gl[g])}, union_len {int(ul[g])}"
    assert route[:T].tolist() == per_token, "route must mark exactly the per-token rows"
    assert bool((route[T:] == 9).all()), "route written past T"
    return expected


def _builder_lists(kind: str, T: int, K: int, N: int, g: torch.Generator, base_row: int = 0) -> torch.Tensor:
    """[T, K] int32 unsorted lists: neighbour / disjoint / identical / mixed (identical first half,
    disjoint second half) / all_invalid; ``base_row`` shifts the valid rows (global rows of a big cache)."""
    if kind == "mixed":
        idx = torch.randperm(N - base_row, generator=g)[: T * K].view(T, K).to(torch.int32) + base_row
        idx[: T // 2] = idx[0]
        return idx
    if kind in ("neighbour", "disjoint", "identical"):
        return _lists(kind, T, K, N - base_row, g) + base_row
    return _lists(kind, T, K, N, g)


# The CUDA kernel's source run on the CPU (tests/testlib/cuda_emulation.py): (threads, unroll) per variant. The
# production block (1024 threads, tables up to 16x smaller than the block) and a 64-thread block (several
# entries per thread across list boundaries, several compaction rounds). Shared memory: the H200's.
EMULATED = {"cuda_emu1024": (cuda_smem.THREADS, cuda_smem.UNROLL), "cuda_emu64": (64, 2)}
EMULATED_SMEM = 232448
STEP_BACKENDS = BACKEND_PARAMS + [pytest.param(name, id=name) for name in EMULATED]

# (id, G, K, N, lengths or None (token-major), T (token-major), lists, padded, topk_length, guard, slots)
BUILDER_CASES = [
    ("G1-tokenmajor-padded", 1, 16, 200, None, 5, "neighbour", True, False, None, None),
    ("G2-requests-short-empty-padded", 2, 16, 300, [3, 0, 5, 1, 4], None, "neighbour", True, False, None, None),
    ("G4-tokenmajor-identical-short-last", 4, 24, 300, None, 10, "identical", False, False, None, None),
    ("G4-requests-identical-guard", 4, 24, 300, [8, 4], None, "identical", False, False, 0.725 * 4, None),
    ("G8-requests-mixed-guard-both-ways", 8, 20, 2000, [16, 8, 3], None, "mixed", False, False, 0.725 * 8, None),
    ("G8-tokenmajor-topklen-garbage", 8, 20, 2000, None, 19, "neighbour", True, True, None, None),
    ("G16-requests-neighbour-guard", 16, 12, 3000, [20, 16, 40], None, "neighbour", True, True, 0.725 * 16, None),
    ("G16-tokenmajor-disjoint-short-last", 16, 12, 3000, None, 21, "disjoint", False, False, None, None),
    ("G5-tokenmajor-all-invalid", 5, 8, 100, None, 12, "all_invalid", False, False, 0.725 * 5, None),
    ("G8-tokenmajor-global-rows-in-millions", 8, 32, 40_000_000, None, 20, "neighbour", True, False, None, None),
    ("G8-requests-rows-near-2^31", 8, 16, 2**31, [8, 9], None, "neighbour", True, False, 0.725 * 8, None),
    ("G8-overflow-table64-mixed", 8, 20, 2000, None, 32, "mixed", False, False, None, 64),
    ("G8-overflow-table64-guard", 8, 20, 2000, [16, 16], None, "mixed", True, True, 0.725 * 8, 64),
    ("G16-overflow-table64-neighbour", 16, 12, 3000, None, 40, "neighbour", True, False, None, 64),
]


@pytest.mark.parametrize("backend", STEP_BACKENDS)
@pytest.mark.parametrize("case", [pytest.param(c[1:], id=c[0]) for c in BUILDER_CASES])
def test_step_builder_matches_reference(case, backend):
    """One backend's ``build_union`` on planned groups (request or token-major layout) vs the reference.
    For Triton the ``slots`` column is ignored (its table never overflows); for the CUDA builder a small
    table forces some groups past its capacity (they must come back as union_len -1, routed per token)."""
    if backend == "cuda_smem" and cuda_smem_unavailable():
        pytest.skip(f"the CUDA union builder cannot run here: {cuda_smem_unavailable()}")
    G, K, N, lengths, T, kind, padded, with_tl, guard, slots = case
    T = sum(lengths) if lengths is not None else T
    g = torch.Generator().manual_seed(G * 31 + T)
    base_row = N - 4 * T * K if N > 10**6 else 0  # global rows in the millions / near the int32 limit
    idx = _builder_lists(kind, T, K, N, g, base_row)
    if padded:
        idx = adversarial_indices(T, K, N, base=idx, generator=g, patterns=("clean", "pad_middle", "clean", "sentinels"))
    topk_length = None
    if with_tl:
        idx, topk_length = garbage_topk_length(idx.contiguous(), N, generator=g)
        topk_length[::2] = K
    expected = check_builder(backend, idx, topk_length, N, G, lengths, guard, slots if backend != "triton" else None)
    if slots is not None and backend != "triton":  # the table case must see both outcomes
        assert {e["overflow"] for e in expected} == {True, False}, [len(e["union"]) for e in expected]
    if base_row:
        assert all_of(min(e["union"], default=base_row) >= base_row for e in expected)


CUDA_BACKENDS = [p for p in STEP_BACKENDS if p.values[0] != "triton"]


@pytest.mark.parametrize("backend", CUDA_BACKENDS)
def test_cuda_table_capacity_boundary(backend):
    """A 64-slot table holds 48 rows: unions of exactly 48 rows are built, 49 overflow (union_len -1,
    routed per token), in both layouts; with a guard that would keep them too."""
    if backend == "cuda_smem" and cuda_smem_unavailable():
        pytest.skip(f"the CUDA union builder cannot run here: {cuda_smem_unavailable()}")
    K, N = 40, 5000
    g = torch.Generator().manual_seed(48)
    groups = []
    for u in (48, 49, 47, 40, 49):  # two lists of 40 rows sharing 80 - u
        pool = torch.randperm(N, generator=g)[:u].to(torch.int32)
        a, b = pool[:K], pool[u - K:]
        groups += [a[torch.randperm(K, generator=g)], b[torch.randperm(K, generator=g)]]
    idx = torch.stack(groups)
    for lengths, guard in ((None, None), ([4, 2, 3, 1], 2.0)):
        expected = check_builder(backend, idx, None, N, 2, lengths, guard, slots=64)
        assert [e["overflow"] for e in expected] == [len(e["union"]) > 48 for e in expected]
        assert [len(e["union"]) for e in expected] == ([48, 49, 47, 40, 49] if lengths is None else [48, 49, 47, 40])


@pytest.mark.parametrize("backend", [pytest.param(n, id=n) for n in EMULATED] + [p for p in BACKEND_PARAMS
                                                                              if p.values[0] == "cuda_smem"])
@pytest.mark.parametrize("G, overlap, guard", [
    pytest.param(8, "mid", True, id="G8-mid-guard"),
    pytest.param(8, "none", True, id="G8-none-guard-overflow-at-12288"),
    pytest.param(16, "low", False, id="G16-low-noguard-table-32768"),
])
def test_cuda_builder_full_size(backend, G, overlap, guard):
    """K = 2048 DSA-like lists (unsorted, ``synthetic_batch``) at the production table sizes (16384 slots at
    G = 8 with the guard, 32768 at G = 16 without): two groups each, against the reference. On the CPU this
    runs the kernel's source through the emulation (one std::thread per CUDA thread)."""
    if backend == "cuda_smem" and cuda_smem_unavailable():
        pytest.skip(f"the CUDA union builder cannot run here: {cuda_smem_unavailable()}")
    from sparse_mla.union.grouping import overlap_guard_ratio
    from sparse_mla.workloads import synthetic_batch

    K = 2048
    b = synthetic_batch([40000], [2 * G], K, overlap, seed=3)  # past 16 K rows: "none" lists are disjoint
    N = b.num_kv_rows
    expected = check_builder(backend, b.indices, b.valid, N, G, [2 * G], overlap_guard_ratio(G) if guard else None)
    sizes = [len(e["union"]) for e in expected]
    if overlap == "none":
        assert all_of(e["overflow"] for e in expected), sizes
    else:
        assert not any(e["overflow"] or e["guarded"] for e in expected), sizes


def test_builder_case_table_covers_guard_decisions():
    """The guard cases must see groups kept and groups sent per token (plain Python, no kernel)."""
    decisions = set()
    for c in BUILDER_CASES:
        _, G, K, N, lengths, T, kind, padded, with_tl, guard, _ = c
        if guard is None or kind == "all_invalid":
            continue
        T = sum(lengths) if lengths is not None else T
        g = torch.Generator().manual_seed(G * 31 + T)
        idx = _builder_lists(kind, T, K, N, g, N - 4 * T * K if N > 10**6 else 0)
        decisions.update(e["guarded"] for e in builder_reference(idx, None, N, G, lengths, guard, None))
    assert decisions == {True, False}


# ---------------------------------------------------------------------------------------------
# The two backends against each other on the GPU, on DSA-like lists at full size.

@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="compares the CUDA builder with the Triton one on a GPU")
@pytest.mark.parametrize("G, overlap, layout, guard", [
    pytest.param(8, "mid", "requests", True, id="G8-mid-requests-guard"),
    pytest.param(8, "none", "tokenmajor", True, id="G8-none-disjoint-tokenmajor-guard-overflow"),
    pytest.param(16, "low", "tokenmajor", False, id="G16-low-tokenmajor-noguard"),
    pytest.param(4, "random", "requests", True, id="G4-random-requests-guard"),
    pytest.param(2, "mid", "tokenmajor", True, id="G2-mid-tokenmajor-guard"),
])
def test_backends_equal_on_gpu(G, overlap, layout, guard):
    """K = 2048 synthetic lists (``sparse_mla.workloads.synthetic_batch``, unsorted like an indexer's)
    of two requests in a paged cache whose rows are scattered over 2**26 rows: the CUDA builder's unions
    equal the Triton builder's as sets with equal membership words, the same group_len and route; a
    union_len differs only where the CUDA table overflowed (-1), and only for groups the guard (or, with
    no guard, the table's capacity) sends per token."""
    why = cuda_smem_unavailable()
    if why is not None:
        pytest.skip(f"the CUDA union builder cannot run here: {why}")
    from sparse_mla.union.grouping import overlap_guard_ratio
    from sparse_mla.workloads import synthetic_batch

    K = 2048
    cached = [40000, 40000] if overlap == "none" else [3000, 0]  # "none": disjoint lists (union G * K)
    b = synthetic_batch(cached, [700, 1100], K, overlap, seed=G, device=DEVICE)
    blocks = torch.randperm(2**26 // 64, device=DEVICE)[: -(-b.num_kv_rows // 64)].to(torch.int64)
    glob_rows = torch.where(b.indices >= 0, blocks[(b.indices.clamp(min=0) // 64).long()] * 64 + b.indices % 64, -1)
    idx = glob_rows.to(torch.int32).contiguous()
    N, T = 2**26, idx.shape[0]
    lengths = [700, 1100] if layout == "requests" else None
    ratio = overlap_guard_ratio(G) if guard else None
    out = {}
    for backend in ("triton", "cuda_smem"):
        ws, n, plan = run_builder(backend, idx, b.valid, N, G, lengths, ratio)
        ul, gl = ws.union_len[:n].clone(), ws.group_len[:n].clone()
        inu = torch.arange(ws.union_rows.shape[1], device=DEVICE)[None] < ul[:, None].long()
        keys, order = torch.where(inu, ws.union_rows[:n], INT_MAX).sort(1)
        out[backend] = (ul, gl, ws.route[:T].clone(), keys, torch.where(inu, ws.union_bits[:n], 0).gather(1, order), plan)
    ul_t, gl_t, rt_t, keys_t, bits_t, _ = out["triton"]
    ul_c, gl_c, rt_c, keys_c, bits_c, plan = out["cuda_smem"]
    over = ul_c == -1
    assert torch.equal(gl_c, gl_t) and torch.equal(rt_c, rt_t), "group_len / route differ"
    assert bool((ul_t[over] > plan.capacity).all()), "a union within the table's capacity overflowed"
    assert bool((gl_t[over] == 0).all()) or ratio is None, "an overflowed group the guard keeps"
    ok = ~over
    assert torch.equal(ul_c[ok], ul_t[ok]) and torch.equal(keys_c[ok], keys_t[ok]) and torch.equal(bits_c[ok], bits_t[ok])
    assert torch.equal(over, ul_t > plan.capacity), "exactly the unions past the table's capacity overflow"
    if overlap == "none":
        assert bool(over[ul_t > 0].all()), "disjoint lists: every group overflows"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need a GPU")
def test_cuda_builder_in_a_cuda_graph():
    """Plan + CUDA union build captured in a CUDA graph (launch on torch's capture stream, no host read),
    replayed on new lists written into the same input buffer: equals an eager build of those lists."""
    why = cuda_smem_unavailable()
    if why is not None:
        pytest.skip(f"the CUDA union builder cannot run here: {why}")
    from sparse_mla.union.grouping import overlap_guard_ratio

    G, K, T, N = 8, 256, 203, 1 << 24
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    idx = torch.randint(0, 4096, (T, K), device=DEVICE, generator=gen, dtype=torch.int32)
    ws = SparseMLAWorkspace(T, K, G, N, DEVICE)
    n = -(-T // G)

    def step():
        plan_groups(T, G, None, ws.group_start[:n], ws.group_len[:n], ws.route[:T])
        cuda_smem.build_union(idx, None, N, G, ws.group_start[:n], ws.group_len[:n], ws.route[:T], ws.union_rows,
                              ws.union_bits, ws.union_len[:n], guard_ratio=overlap_guard_ratio(G))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiled and warm before the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in (1, 2):
        idx.copy_(torch.randint(0, 2000 * seed, (T, K), device=DEVICE, generator=gen, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        got = [t.clone() for t in (ws.union_len[:n], ws.group_len[:n], ws.route[:T])]
        got_rows = canonical_rows(ws, n)
        step()
        torch.cuda.synchronize()
        assert all_of(torch.equal(a, b) for a, b in zip(got, (ws.union_len[:n], ws.group_len[:n], ws.route[:T])))
        assert all_of(torch.equal(a, b) for a, b in zip(got_rows, canonical_rows(ws, n)))


def canonical_rows(ws, n):
    """(sorted rows, their membership words) per group, -1 / 0 past union_len (for comparisons)."""
    ul = ws.union_len[:n].clamp(min=0).long()
    inu = torch.arange(ws.union_rows.shape[1], device=ul.device)[None] < ul[:, None]
    keys, order = torch.where(inu, ws.union_rows[:n], INT_MAX).sort(1)
    return keys, torch.where(inu, ws.union_bits[:n], 0).gather(1, order)


# ---------------------------------------------------------------------------------------------
# The backend choice (plain Python on the CPU) and the table plan.

H200 = backends.UnionDeviceFacts("cuda", (9, 0), 232448, False, None)
A100 = backends.UnionDeviceFacts("cuda", (8, 0), 166912, False, None)


@pytest.mark.parametrize("mode, facts, G, K, guard, complete, expected, reason", [
    pytest.param("auto", H200, 8, 2048, 5.8, False, "cuda_smem", "16384-slot table (96 KiB", id="H200-G8-guard"),
    pytest.param("auto", H200, 16, 2048, 11.6, False, "cuda_smem", "32768-slot table (192 KiB", id="H200-G16-guard"),
    pytest.param("auto", H200, 8, 2048, None, False, "cuda_smem", "all G * K entries", id="H200-G8-noguard"),
    pytest.param("auto", H200, 16, 2048, None, False, "triton", "larger unions would run per token", id="H200-G16-noguard"),
    pytest.param("auto", H200, 16, 2048, None, True, "triton", "complete union", id="H200-G16-complete"),
    pytest.param("auto", H200, 8, 2048, None, True, "cuda_smem", "holds all G * K = 16384", id="H200-G8-complete"),
    pytest.param("auto", A100, 16, 2048, 11.6, False, "triton", "16384-slot table", id="A100-G16-guard-capped"),
    pytest.param("auto", A100, 8, 2048, 5.8, False, "cuda_smem", "overlap guard keeps", id="A100-G8-guard"),
    pytest.param("auto", backends.UnionDeviceFacts("cuda", (7, 5), 65536, False, None), 8, 64, None, False, "triton",
                 "compute capability 7.5 < 8.0", id="sm75"),
    pytest.param("auto", backends.UnionDeviceFacts("cuda", (9, 0), 232448, False, "ImportError: No module named 'cupy'"),
                 8, 64, None, False, "triton", "sparse-mla[cuda12]", id="no-cupy"),
    pytest.param("auto", backends.UnionDeviceFacts("cpu", None, 0, True, None), 8, 64, None, False, "triton",
                 "TRITON_INTERPRET=1", id="cpu-interpreter"),
    pytest.param("auto", backends.UnionDeviceFacts("cpu", None, 0, False, None), 8, 64, None, False, "triton",
                 "not a CUDA device", id="cpu"),
    pytest.param("auto", H200, 17, 64, None, False, "triton", "G = 17 outside 1..16", id="G17"),
    pytest.param("auto", H200, 16, 2**27, None, False, "triton", "entries per group", id="huge-K"),
    pytest.param("triton", H200, 8, 2048, 5.8, False, "triton", "forced by SPARSE_MLA_UNION_BACKEND=triton",
                 id="forced-triton"),
    pytest.param("cuda_smem", H200, 16, 2048, None, False, "cuda_smem", "larger unions would run per token",
                 id="forced-cuda-smem-beyond-capacity"),
    pytest.param(" ", H200, 8, 2048, 5.8, False, "cuda_smem", "", id="blank-is-auto"),
])
def test_choose_union_backend(mode, facts, G, K, guard, complete, expected, reason):
    name, why = backends.choose_union_backend(mode, facts, G, K, guard_ratio=guard, complete=complete)
    assert name == expected and reason in why, (name, why)


@pytest.mark.parametrize("mode, facts, G, K, complete, match", [
    pytest.param("cuda_smem", backends.UnionDeviceFacts("cpu", None, 0, False, None), 8, 64, False, "not a CUDA device",
                 id="forced-on-cpu"),
    pytest.param("cuda_smem", backends.UnionDeviceFacts("cuda", (9, 0), 232448, False, "ImportError: x"), 8, 64, False,
                 "CuPy is not importable", id="forced-without-cupy"),
    pytest.param("cuda_smem", H200, 16, 2048, True, "complete union", id="forced-complete-beyond-capacity"),
    pytest.param("gluon", H200, 8, 64, False, "must be one of auto, triton, cuda_smem", id="unknown"),
])
def test_choose_union_backend_errors(mode, facts, G, K, complete, match):
    with pytest.raises(ValueError, match=match):
        backends.choose_union_backend(mode, facts, G, K, complete=complete)


def test_select_union_backend_env_and_log(monkeypatch, caplog):
    """On this machine's device: the variable is read per call; one debug line per build names the backend."""
    import logging

    monkeypatch.setenv(backends.ENV_VAR, "triton")
    assert backends.select_union_backend(DEVICE, 8, 64) == ("triton", "forced by SPARSE_MLA_UNION_BACKEND=triton")
    monkeypatch.setenv(backends.ENV_VAR, "bogus")
    with pytest.raises(ValueError, match="bogus"):
        backends.select_union_backend(DEVICE, 8, 64)
    monkeypatch.delenv(backends.ENV_VAR)
    expected, _ = backends.select_union_backend(DEVICE, 4, 12, complete=True)
    assert expected == ("triton" if cuda_smem_unavailable() else "cuda_smem")
    caplog.set_level(logging.DEBUG, logger="sparse_mla")
    check_union(neighbour_rows(9, 12, 80, 0.5, torch.Generator().manual_seed(5)), 4, num_kv_rows=80)
    lines = [r.getMessage() for r in caplog.records if r.name == "sparse_mla" and "union builder" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(f"union builder: backend {expected} ("), lines
    assert f"union builder: {expected} (" in backends.describe_union_backend(DEVICE, 4, 12)


def test_plan_table():
    """Table sizes: every union the caller keeps fits at load <= 3/4, capped by the device's shared memory;
    where overflow is possible S - capacity >= THREADS; the override is checked."""
    p = cuda_smem.plan_table(8, 2048, 5.8, 232448)
    assert (p.slots, p.capacity, p.smem_bytes, p.exact, p.keeps_guarded) == (16384, 12288, 98304, False, True)
    assert cuda_smem.guard_limit(8, 2048, 5.8) == 11879 <= p.capacity
    p = cuda_smem.plan_table(16, 2048, 11.6, 232448)
    assert (p.slots, p.keeps_guarded, p.exact) == (32768, True, False)
    assert [cuda_smem.plan_table(G, 2048, 0.725 * G, 232448).slots for G in (1, 2, 4)] == [4096, 8192, 8192]
    p = cuda_smem.plan_table(16, 2048, 11.6, 166912)  # A100: capped at 16384 slots
    assert (p.slots, p.keeps_guarded) == (16384, False)
    for G in range(1, 17):
        for K in (1, 7, 64, 100, 2048, 4096):
            for guard in (None, 0.725 * G):
                p = cuda_smem.plan_table(G, K, guard, 232448)
                assert p.capacity == p.slots * 3 // 4 and p.smem_bytes + cuda_smem.STATIC_SMEM_BYTES <= 232448
                assert p.keeps_guarded or p.slots == 1 << cuda_smem.MAX_LOG_SLOTS
                assert p.exact or p.slots - p.capacity >= cuda_smem.THREADS
                assert p.exact == (G * K <= p.capacity)
                assert p.slots >= min(cuda_smem.SMALL_TABLE_SLOTS, 2 * G * K)  # small tables: load <= 1/2
    assert cuda_smem.plan_table(8, 20, None, 232448, slots=64).capacity == 48
    for bad in (48, 32, 1 << 16):
        with pytest.raises(ValueError, match="power of two"):
            cuda_smem.plan_table(8, 20, None, 232448, slots=bad)
    assert cuda_smem.max_log_slots(49152) == 12 and cuda_smem.max_log_slots(100) == 0


# ---------------------------------------------------------------------------------------------
# The CUDA source through NVRTC on the CPU (no GPU, no driver): a syntax error fails CI.

@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_cuda_source_compiles_with_nvrtc(arch):
    """The kernel compiles with the options the runtime uses, without spills (32 registers at 1024 threads
    x 2 CTAs per SM); a broken source is reported as such (the check is not vacuous)."""
    from testlib.nvrtc_compile import compile_cubin, load_nvrtc, nvrtc_version

    lib, where = load_nvrtc()
    if lib is None:
        pytest.skip(f"NVRTC cannot be loaded: {where}")
    opts = [*cuda_smem.compile_options(), f"--gpu-architecture={arch}", "--ptxas-options=-v"]
    res, log, cubin = compile_cubin(lib, cuda_smem.source(), opts, "cuda_smem.cu")
    assert res == 0, f"NVRTC {nvrtc_version(lib)} ({where}) failed for {arch}:\n{log}"
    assert cubin > 0 and cuda_smem.KERNEL_NAME in log
    assert "0 bytes spill stores" in log, log
    for variant in (cuda_smem.compile_options(512, 1, 4), cuda_smem.compile_options(256, 4, 1)):
        res, log, _ = compile_cubin(lib, cuda_smem.source(), [*variant, f"--gpu-architecture={arch}"], "cuda_smem.cu")
        assert res == 0, f"{variant}:\n{log}"
    res, log, _ = compile_cubin(lib, cuda_smem.source() + "\nint broken(", opts, "cuda_smem.cu")
    assert res != 0 and "error" in log
    res, log, _ = compile_cubin(lib, cuda_smem.source(), [*cuda_smem.compile_options(1000), f"--gpu-architecture={arch}"])
    assert res != 0 and "multiple of 32" in log


def test_explain_names_the_union_builder(monkeypatch):
    """``sparse_mla.layer.explain`` prints which union builder the grouped path runs here, and why."""
    from sparse_mla.layer import PrefillStep, explain

    step = PrefillStep(16, 512, 128, 64, 128, 2048, (0,), (8192,))
    expected = "triton" if cuda_smem_unavailable() else "cuda_smem"
    d = explain(step)
    assert d.union_backend.startswith(f"union builder: {expected} (") and "(grouped MQA path) union builder" in str(d)
    monkeypatch.setenv(backends.ENV_VAR, "triton")
    assert explain(step).union_backend == "union builder: triton (forced by SPARSE_MLA_UNION_BACKEND=triton)"
    monkeypatch.setenv(backends.ENV_VAR, "nope")
    assert explain(step).union_backend.startswith("union builder: error (SPARSE_MLA_UNION_BACKEND must be one of")
