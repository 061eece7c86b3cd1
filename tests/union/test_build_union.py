"""The step path's builders (``build_union`` of each backend: the Triton twin, the CUDA builder on a GPU, the CUDA
kernel's source on the CPU) against a plain-Python reference: both layouts, the overlap guard, and the CUDA
builder's table overflow (small tables forced)."""

from __future__ import annotations

import pytest
import torch
from testlib.adversarial import adversarial_indices, garbage_topk_length
from testlib.backends import BACKEND_PARAMS, cuda_smem_unavailable
from testlib.tolerances import all_of
from testlib.union import (
    EMULATED,
    builder_lists,
    builder_reference,
    check_builder,
)

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


def _case_inputs(case, seed_mult: int):
    """(indices [T, K] int32, topk_length or None, base_row) of a ``BUILDER_CASES`` row: its kind of lists, shifted to
    global rows in the millions / near the int32 limit when N is that large, padded and given garbage topk_length
    as the row says."""
    G, K, N, lengths, T, kind, padded, with_tl, _, _ = case
    T = sum(lengths) if lengths is not None else T
    g = torch.Generator().manual_seed(G * seed_mult + T)
    base_row = N - 4 * T * K if N > 10**6 else 0
    idx = builder_lists(kind, T, K, N, g, base_row)
    if padded:
        idx = adversarial_indices(T, K, N, base=idx, generator=g, patterns=("clean", "pad_middle", "clean", "sentinels"))
    topk_length = None
    if with_tl:
        idx, topk_length = garbage_topk_length(idx.contiguous(), N, generator=g)
    return idx, topk_length, base_row


@pytest.mark.parametrize("backend", STEP_BACKENDS)
@pytest.mark.parametrize("case", [pytest.param(c[1:], id=c[0]) for c in BUILDER_CASES])
def test_step_builder_matches_reference(case, backend):
    """One backend's ``build_union`` on planned groups (request or token-major layout) vs the reference.
    For Triton the ``slots`` column is ignored (its table never overflows); for the CUDA builder a small
    table forces some groups past its capacity (they must come back as union_len -1, routed per token)."""
    if backend == "cuda_smem" and cuda_smem_unavailable():
        pytest.skip(f"the CUDA union builder cannot run here: {cuda_smem_unavailable()}")
    G, K, N, lengths, T, kind, padded, with_tl, guard, slots = case
    idx, topk_length, base_row = _case_inputs(case, 31)
    if topk_length is not None:
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
        idx = builder_lists(kind, T, K, N, g, N - 4 * T * K if N > 10**6 else 0)
        decisions.update(e["guarded"] for e in builder_reference(idx, None, N, G, lengths, guard, None))
    assert decisions == {True, False}
