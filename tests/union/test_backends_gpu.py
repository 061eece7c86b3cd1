"""The two union builders against each other on the GPU, on DSA-like lists at full size; the CUDA builder in a
CUDA graph."""

from __future__ import annotations

import pytest
import torch
from testlib.backends import cuda_smem_unavailable
from testlib.device import DEVICE, HAS_CUDA, INT_MAX
from testlib.tolerances import all_of
from testlib.union import (
    run_builder,
)

from sparse_mla import SparseMLAWorkspace
from sparse_mla.union import cuda_smem
from sparse_mla.union.planning import plan_groups


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


