"""Mixed decode + prefill steps, torch custom ops under torch.compile, and warmup (CPU-testable parts).

The GPU-only parts (no compilation after warmup, CUDA-graph replay, no allocation per step) are in
tests/integration/test_gpu_integration.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from testlib.device import DEVICE, DTYPE, HAS_CUDA
from testlib.problems import make_problem, neighbour_rows, poisoned_out
from testlib.tolerances import all_of, assert_matches_reference

from sparse_mla import SparseMLAWorkspace, sparse_mla_fwd, sparse_mla_ref
from sparse_mla.integration import (
    index_convert,
    ops,  # noqa: F401  (registers torch.ops.sparse_mla.*)
)
from sparse_mla.integration.block_table import convert_req_index_to_global_ref
from sparse_mla.integration.ops import workspace_buffers
from sparse_mla.integration.warmup import (
    WarmupReport,
    _int_class,
    _unspecialized,
    compiled_variant_counts,
    step_shape_reps,
    warmup,
)

H, K, N = 32, 32, 120  # G = 4


def mixed_step(seed=0):
    """Requests: decode, prefill of 9 (two groups + a remainder), decode with no valid row, prefill of 3 (< G)."""
    cu = torch.tensor([0, 1, 10, 11, 14], dtype=torch.int32)
    T = int(cu[-1])
    g = torch.Generator().manual_seed(seed)
    indices = neighbour_rows(T, K, N, keep=0.8, generator=g)
    indices[10] = -1  # a decode token whose top-k is all padding
    indices[2, 5] = N  # out of range: padding
    topk_length = torch.full((T,), K, dtype=torch.int32)
    topk_length[3], topk_length[12] = 7, 0
    p = make_problem(T, H, K, N, indices=indices, topk_length=topk_length, seed=seed)
    return p, cu.to(DEVICE)


def test_mixed_decode_prefill_step_equals_separate_calls():
    p, cu = mixed_step()
    T = p.q.shape[0]
    ws = SparseMLAWorkspace.for_problem(T, K, H, N, DEVICE)
    out, lse = poisoned_out(T, H)
    # no overlap guard (it would decide per group on the lists' overlap; tests/mqa/test_grouped.py covers it): the
    # planned groups themselves are checked here
    sparse_mla_fwd(p.q, p.kv, p.indices, p.sm_scale, topk_length=p.topk_length, method="grouped",
                   cu_seqlens_q=cu, workspace=ws, out=out, lse=lse, overlap_guard=math.inf)
    # groups stay inside the 9-token request (rows 1-4 and 5-8), its row 9 and every other request run per token
    assert ws.group_start[:2].tolist() == [1, 5] and ws.group_len.tolist() == [4, 4, 0, 0]
    assert ws.route[:T].tolist() == [1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1]
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        o_r, l_r = sparse_mla_fwd(p.q[a:b], p.kv, p.indices[a:b], p.sm_scale, topk_length=p.topk_length[a:b],
                                  method="grouped", cu_seqlens_q=torch.tensor([0, b - a], dtype=torch.int32, device=DEVICE),
                                  return_lse=True, overlap_guard=math.inf)
        assert torch.equal(out[a:b], o_r), f"request rows {a}:{b}: mixed step differs from its own call"
        assert torch.equal(lse[a:b], l_r)
    ref_out, ref_lse = sparse_mla_ref(p.q, p.kv, p.indices, p.sm_scale, topk_length=p.topk_length)
    assert_matches_reference(out, lse, ref_out, ref_lse, DTYPE)
    assert torch.all(lse[10] == float("-inf")) and torch.all(lse[12] == float("-inf"))


def test_ops_eager_match_library_functions():
    p = make_problem(4, H, K, N, topk_length=torch.tensor([K, 0, 5, K], dtype=torch.int32), seed=1)
    out, lse = torch.ops.sparse_mla.fwd(p.q, p.kv, p.indices, p.sm_scale, topk_length=p.topk_length, method="per_token")
    ref_out, ref_lse = sparse_mla_ref(p.q, p.kv, p.indices, p.sm_scale, topk_length=p.topk_length)
    assert_matches_reference(out, lse, ref_out, ref_lse, DTYPE)
    req_id = torch.tensor([0, 1, -1, 1], dtype=torch.int32, device=DEVICE)
    table = torch.tensor([[3, 0, -1], [2, 1, 4]], dtype=torch.int32, device=DEVICE)
    local = torch.tensor([[0, 17, 40, -1], [5, 16, 47, 48], [1, 2, 3, 4], [31, 32, 33, 200]], dtype=torch.int32, device=DEVICE)
    idx, counts = torch.ops.sparse_mla.convert_req_index(req_id, table, local, 16, 48)
    ref_idx, ref_counts = convert_req_index_to_global_ref(req_id, table, local, 16, kv_block_stride_rows=48)
    assert torch.equal(idx, ref_idx) and torch.equal(counts, ref_counts)
    assert idx[0].tolist() == [3 * 48, 0 * 48 + 1, -1, -1]


def _step(q, kv, req_id, block_table, topk_local, cu, out, lse, bufs, sm_scale: float):
    idx, counts = torch.ops.sparse_mla.convert_req_index(req_id, block_table, topk_local, 16)
    torch.ops.sparse_mla.fwd_out(q, kv, idx, out, lse, bufs, sm_scale, cu_seqlens_q=cu, method="grouped")
    o2, l2 = torch.ops.sparse_mla.fwd(q, kv, idx, sm_scale, topk_length=counts, method="per_token")
    return idx, o2 * 1.0, l2


def test_torch_compile_fullgraph_traces_the_ops():
    """torch.compile(fullgraph=True) over converter -> fwd_out (mutating, with workspace) -> fwd, equal to eager."""
    T, bs = 7, 16
    g = torch.Generator().manual_seed(5)
    q = torch.randn(T, H, 576, generator=g).to(DTYPE).to(DEVICE)
    kv = torch.randn(6 * bs, 576, generator=g).to(DTYPE).to(DEVICE)
    req_id = torch.tensor([0, 0, 0, 0, 0, 1, -1], dtype=torch.int32, device=DEVICE)
    table = torch.tensor([[4, 1, 2], [0, 5, -1]], dtype=torch.int32, device=DEVICE)
    local = torch.full((T, K), -1, dtype=torch.int32)
    for t in range(T):  # valid entries first (within each request's 3 or 2 blocks), so the counts are a topk_length
        local[t, :20] = torch.randperm(40 if t < 5 else 32, generator=g)[:20].to(torch.int32)
    local = local.to(DEVICE)
    cu = torch.tensor([0, 5, 6, 7], dtype=torch.int32, device=DEVICE)
    ws = SparseMLAWorkspace.for_problem(T, K, H, kv.shape[0], DEVICE)
    results = []
    for fn in (_step, torch.compile(_step, fullgraph=True, backend="aot_eager")):
        out, lse = poisoned_out(T, H)
        idx, o2, l2 = fn(q, kv, req_id, table, local, cu, out, lse, workspace_buffers(ws), 576**-0.5)
        results.append((idx, out, lse, o2, l2))
    (idx_e, out_e, lse_e, o2_e, l2_e), (idx_c, out_c, lse_c, o2_c, l2_c) = results
    assert torch.equal(idx_e, idx_c) and torch.equal(out_e, out_c) and torch.equal(lse_e, lse_c)
    assert torch.equal(o2_e, o2_c) and torch.equal(l2_e, l2_c)
    ref_out, ref_lse = sparse_mla_ref(q, kv, idx_e, 576**-0.5)
    assert_matches_reference(out_c, lse_c, ref_out, ref_lse, DTYPE)
    assert_matches_reference(o2_c, l2_c, ref_out, ref_lse, DTYPE)
    assert torch.all(lse_c[-1] == float("-inf")), "the padded row (req_id -1) has no valid index"


def test_opcheck():
    p = make_problem(2, 64, 16, 40)
    torch.library.opcheck(torch.ops.sparse_mla.fwd.default, (p.q, p.kv, p.indices, p.sm_scale), {"method": "per_token"})
    ws = SparseMLAWorkspace.for_problem(2, 16, 64, 40, DEVICE)
    out, lse = poisoned_out(2, 64)
    torch.library.opcheck(torch.ops.sparse_mla.fwd_out.default,
                          (p.q, p.kv, p.indices, out, lse, workspace_buffers(ws), p.sm_scale), {"method": "grouped"})
    req_id = torch.tensor([0, -1], dtype=torch.int32, device=DEVICE)
    table = torch.tensor([[1, 0], [2, -1]], dtype=torch.int32, device=DEVICE)
    torch.library.opcheck(torch.ops.sparse_mla.convert_req_index.default, (req_id, table, p.indices, 16))


def test_fake_impls_check_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(5, 8, 576, dtype=DTYPE)
        kv = torch.empty(100, 576, dtype=DTYPE)
        idx = torch.empty(5, 12, dtype=torch.int32)
        out, lse = torch.ops.sparse_mla.fwd(q, kv, idx, 0.1)
        assert out.shape == (5, 8, 512) and out.dtype == DTYPE and lse.shape == (5, 8) and lse.dtype == torch.float32
        g, c = torch.ops.sparse_mla.convert_req_index(torch.empty(5, dtype=torch.int32), torch.empty(2, 3, dtype=torch.int32),
                                                      idx, 64)
        assert g.shape == (5, 12) and c.shape == (5,)
        with pytest.raises(ValueError, match="token rows"):
            torch.ops.sparse_mla.convert_req_index(torch.empty(9, dtype=torch.int32), torch.empty(2, 3, dtype=torch.int32),
                                                   idx, 64)
        with pytest.raises(ValueError, match="indices must be"):
            torch.ops.sparse_mla.fwd(q, kv, idx[:4], 0.1)


def test_fwd_out_rejects_foreign_workspace():
    p = make_problem(4, 64, 16, 40)
    out, lse = poisoned_out(4, 64)
    bufs = workspace_buffers(SparseMLAWorkspace.for_problem(4, 16, 64, 40, DEVICE))
    with pytest.raises(ValueError, match="workspace must be"):
        torch.ops.sparse_mla.fwd_out(p.q, p.kv, p.indices, out, lse, bufs[:3], p.sm_scale, method="grouped")
    bad = workspace_buffers(SparseMLAWorkspace.for_problem(4, 12, 64, 40, DEVICE))
    with pytest.raises(ValueError, match="are not those of a SparseMLAWorkspace"):
        torch.ops.sparse_mla.fwd_out(p.q, p.kv, p.indices, out, lse, bad, p.sm_scale, method="grouped")


@pytest.mark.parametrize("G", [2, 8, 4])
def test_step_shape_reps_cover_every_step_shape(G):
    """Every (T, B) a step can have falls in the class of one shape that warmup runs (brute force over all
    T up to max_tokens, past the 32 * G + 16 rows that step_shape_reps scans): the integer classes of T, of the
    ceil(T / G) groups it plans and of B (and B's power of two), one shape per class; and, for the steps that plan
    enough groups to run the overlap probe, one probe shape per layout (the probe's integers are run-time values)."""
    from sparse_mla.union.probe import PROBE_MIN_GROUPS

    max_tokens, max_requests = 600 if G > 2 else 200, 70
    layout = lambda B: None if B is None else (_int_class(B), 1 << (B - 1).bit_length())  # noqa: E731
    cls = lambda T, B: (_int_class(T), _int_class(-(-T // G)), layout(B))  # noqa: E731
    probes = lambda T: -(-T // G) >= PROBE_MIN_GROUPS  # noqa: E731

    reps = step_shape_reps(G, max_tokens, max_requests)
    steps = [(T, B) for T in range(1, max_tokens + 1) for B in [None, *range(1, max_requests + 1)]]
    classes = {cls(T, B) for T, B in reps}
    assert classes == {cls(T, B) for T, B in steps}, "every class warmed, no other"
    probe_layouts = {layout(B) for T, B in steps if probes(T)}
    assert {layout(B) for T, B in reps if probes(T)} == probe_layouts
    assert len(reps) == len(classes) + len(probe_layouts), "one shape per class, plus one probe shape per layout"
    assert all_of((T <= max_tokens and (B is None or B <= max_requests) for T, B in reps), "step_shape_reps")


def test_converter_kernel_declares_unspecialized_sizes():
    assert {"num_reqs", "max_blocks", "K", "num_kv_rows"} <= _unspecialized(index_convert._convert_req_index_kernel)


@pytest.mark.skipif(HAS_CUDA, reason="CPU-only: on a GPU warmup compiles (tests/integration/test_gpu_integration.py covers it)")
def test_warmup_runs_every_variant_on_cpu():
    """Under the interpreter nothing compiles (counts stay 0); warmup must still run every path without error."""
    ws = SparseMLAWorkspace.for_problem(4, 16, 64, 40, DEVICE)
    rep = warmup(64, 576, 16, DTYPE, DEVICE, 4, max_requests=3, num_kv_rows=40, workspace=ws,
                 return_lse=(True,), topk_length=(True,), block_size=16)
    assert isinstance(rep, WarmupReport)
    assert rep.calls == 1 + 2 + len(step_shape_reps(2, 4, 3)) + 2  # per token, split-KV per token and grouped, ...
    assert rep.new_variants == {k: 0 for k in compiled_variant_counts()}
    rep2 = warmup(64, 576, 16, DTYPE, DEVICE, 4, max_requests=1, num_kv_rows=40, return_lse=(True,),
                  topk_length=(False,), attn_sink=(False, True), max_logits=(True,), converter=False)
    assert rep2.calls == 2 * (1 + 2 + len(step_shape_reps(2, 4, 1)))  # per-token, split-KV, grouped steps, x2 sink modes
    with pytest.raises(ValueError, match="num_kv_rows"):
        warmup(64, 576, 16, DTYPE, DEVICE, 8)
    with pytest.raises(ValueError, match="workspace does not fit"):
        warmup(64, 576, 32, DTYPE, DEVICE, 8, num_kv_rows=40, workspace=ws)
    with pytest.raises(TypeError, match="dtype"):
        warmup(64, 576, 16, torch.float32, DEVICE, 8, num_kv_rows=40)
