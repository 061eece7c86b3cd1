"""Plain-Python references of the union builders and the group planner (Python sets), and a run of one
builder backend on planned groups (the Triton twin, the CUDA builder, or the CUDA kernel's source emulated on the CPU)."""

from __future__ import annotations

import pytest
import torch

from sparse_mla import SparseMLAWorkspace, build_group_union
from sparse_mla.union import cuda_smem
from sparse_mla.union.planning import plan_groups
from sparse_mla.union.triton_tl import build_union
from testlib import cuda_emulation
from testlib.adversarial import adversarial_indices
from testlib.device import DEVICE
from testlib.problems import cu_seqlens, neighbour_rows


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


def lists_of_kind(kind: str, T: int, K: int, N: int, g: torch.Generator) -> torch.Tensor:
    if kind == "neighbour":
        return neighbour_rows(T, K, N, keep=0.6, generator=g)
    if kind == "disjoint":
        return torch.randperm(N, generator=g)[: T * K].view(T, K).to(torch.int32)
    if kind == "identical":
        return torch.randperm(N, generator=g)[:K].to(torch.int32).expand(T, K)
    if kind == "all_invalid":
        return adversarial_indices(T, K, N, patterns=("all_invalid",))
    raise ValueError(kind)


def plan_reference(lengths: list[int] | None, T: int, G: int):
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


def builder_reference(idx: torch.Tensor, topk_length: torch.Tensor | None, N: int, G: int,
                      lengths: list[int] | None, guard: float | None, capacity: int | None):
    """Per planned group (plan as ``plan_reference``): dict(start, glen, union (set), bits (row -> word),
    guarded, overflow). ``capacity``: the CUDA builder's table capacity (None: no overflow, Triton).
    The guard compares u * glen > ratio * (valid entries) in fp32, as both builders do."""
    T, K = idx.shape
    rows = idx.tolist()
    lens = [K] * T if topk_length is None else [max(0, min(K, int(n))) for n in topk_length.tolist()]
    lists = [[r for r in rows[t][: lens[t]] if 0 <= r < N] for t in range(T)]
    starts, glens, _ = plan_reference(lengths, T, G)
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


def builder_lists(kind: str, T: int, K: int, N: int, g: torch.Generator, base_row: int = 0) -> torch.Tensor:
    """[T, K] int32 unsorted lists: neighbour / disjoint / identical / mixed (identical first half,
    disjoint second half) / all_invalid; ``base_row`` shifts the valid rows (global rows of a big cache)."""
    if kind == "mixed":
        idx = torch.randperm(N - base_row, generator=g)[: T * K].view(T, K).to(torch.int32) + base_row
        idx[: T // 2] = idx[0]
        return idx
    if kind in ("neighbour", "disjoint", "identical"):
        return lists_of_kind(kind, T, K, N - base_row, g) + base_row
    return lists_of_kind(kind, T, K, N, g)


# The CUDA kernel's source run on the CPU (tests/testlib/cuda_emulation.py): (threads, unroll) per variant. The
# production block (1024 threads, tables up to 16x smaller than the block) and a 64-thread block (several
# entries per thread across list boundaries, several compaction rounds). Shared memory: the H200's.
EMULATED = {"cuda_emu1024": (cuda_smem.THREADS, cuda_smem.UNROLL), "cuda_emu64": (64, 2)}


EMULATED_SMEM = 232448
