"""GPU-only engine-integration tests: warmup leaves nothing to compile, CUDA-graph capture and replay,
no device allocation per step, the custom ops in a CUDA graph and under inductor.

These need a CUDA GPU: the CPU interpreter compiles nothing, captures no graphs and has no caching
allocator statistics. Run on the GPU box with ``python benchmarks/gpu_integration.py`` (or pytest).

Engine set-up shared by the tests (module fixture): H = 16 heads per rank (G = 8), D_qk = 576,
topk 512, bf16, a cross-layer paged cache [blocks, 2 layers, 64, 576] viewed at layer 1 (block
stride 2 * 64 rows), one SparseMLAWorkspace for 256 tokens, warmup for up to 8 requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from testlib.device import HAS_CUDA
from testlib.tolerances import assert_matches_reference

from sparse_mla import SparseMLAWorkspace, sparse_mla_fwd, sparse_mla_ref
from sparse_mla.bench.timing import capture_graph
from sparse_mla.integration import ops  # noqa: F401  (registers torch.ops.sparse_mla.*)
from sparse_mla.integration.block_table import (
    convert_req_index_to_global,
    convert_req_index_to_global_ref,
    paged_kv_as_rows,
)
from sparse_mla.integration.ops import workspace_buffers
from sparse_mla.integration.warmup import WarmupReport, compiled_variant_counts, warmup

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU: Triton compilation, CUDA graphs and allocator stats "
                                            "do not exist under the CPU interpreter"),
]

H, D, K, BS = 16, 576, 512, 64
NUM_LAYERS, LAYER, NUM_BLOCKS, MAX_BLOCKS = 2, 1, 320, 24  # contexts up to 24 * 64 = 1536 tokens
MAX_TOKENS, MAX_REQUESTS = 1100, 8  # > 1024: warmup's few-heads per-token switch to the Triton kernel
DTYPE = torch.bfloat16
SCALE = D**-0.5


@dataclass
class Engine:
    rows: torch.Tensor  # [N, D] view of the paged cache
    stride_rows: int
    ws: SparseMLAWorkspace
    report: WarmupReport


@pytest.fixture(scope="module")
def engine() -> Engine:
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    storage = torch.randn(NUM_BLOCKS, NUM_LAYERS, BS, D, generator=g).to(DTYPE).to(dev)
    rows, stride_rows = paged_kv_as_rows(storage[:, LAYER])
    ws = SparseMLAWorkspace.for_problem(MAX_TOKENS, K, H, rows.shape[0], dev)
    report = warmup(H, D, K, DTYPE, dev, MAX_TOKENS, max_requests=MAX_REQUESTS, kv=rows, workspace=ws, block_size=BS)
    return Engine(rows, stride_rows, ws, report)


@dataclass
class Step:
    q: torch.Tensor  # [T, H, D]
    req_id: torch.Tensor  # [T] int32, -1 on padded rows
    block_table: torch.Tensor  # [B_total, MAX_BLOCKS] int32
    topk_local: torch.Tensor  # [T, K] int32, valid entries first
    cu: torch.Tensor  # [B_total + 1] int32; a trailing dummy request covers the padded rows
    n_real: int


def make_step(T: int, B: int, seed: int, *, n_pad: int = 0, n_decode: int = 1) -> Step:
    """B requests (the first n_decode are decodes of one token) over T - n_pad real rows, then n_pad padded rows.

    Each request's tokens share most of their top-k (a common set from the cached prefix plus the
    token's own position), so groups overlap heavily and the grouped kernel runs."""
    g = torch.Generator().manual_seed(seed)
    n_real = T - n_pad
    n_dec = min(n_decode, B - 1)
    rest = n_real - n_dec
    lens = [1] * n_dec + [rest // (B - n_dec) + (1 if i < rest % (B - n_dec) else 0) for i in range(B - n_dec)]
    assert min(lens) >= 1 and sum(lens) == n_real
    perm = torch.randperm(NUM_BLOCKS, generator=g)
    table = torch.full((B + (n_pad > 0), MAX_BLOCKS), -1, dtype=torch.int32)
    topk = torch.full((T, K), -1, dtype=torch.int32)
    req_id = torch.full((T,), -1, dtype=torch.int32)
    used, t = 0, 0
    for r, new in enumerate(lens):
        prefix = int(torch.randint(0, MAX_BLOCKS * BS - new + 1, (1,), generator=g))
        need = -(-(prefix + new) // BS)
        table[r, :need] = perm[used:used + need].to(torch.int32)
        used += need
        base = torch.randperm(max(prefix, 1), generator=g)[: min(K - 1, prefix)].to(torch.int32)
        for i in range(new):
            topk[t, : base.numel()] = base
            topk[t, base.numel()] = prefix + i  # the token's own position
            req_id[t] = r
            t += 1
    topk[n_real:] = torch.randint(0, 2 * BS, (n_pad, K), generator=g, dtype=torch.int32)  # garbage on padded rows
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()] + ([T] if n_pad else []), dtype=torch.int32)
    q = torch.randn(T, H, D, generator=g).to(DTYPE)
    dev = torch.device("cuda")
    return Step(q.to(dev), req_id.to(dev), table.to(dev), topk.to(dev), cu.to(dev), n_real)


def test_end_to_end_bf16_matches_reference(engine):
    st = make_step(100, 5, seed=1, n_pad=3)
    idx, counts = convert_req_index_to_global(st.req_id, st.block_table, st.topk_local, BS,
                                              kv_block_stride_rows=engine.stride_rows, return_valid_counts=True)
    ref_idx, ref_counts = convert_req_index_to_global_ref(st.req_id, st.block_table, st.topk_local, BS,
                                                          kv_block_stride_rows=engine.stride_rows)
    assert torch.equal(idx, ref_idx) and torch.equal(counts, ref_counts)
    ref_out, ref_lse = sparse_mla_ref(st.q, engine.rows, idx, SCALE)
    for method, tl_ in (("grouped", None), ("grouped", counts), ("per_token", counts)):
        out = torch.full((100, H, 512), float("nan"), dtype=DTYPE, device="cuda")
        lse = torch.full((100, H), float("nan"), device="cuda")
        engine.ws.group_len.zero_()
        sparse_mla_fwd(st.q, engine.rows, idx, SCALE, topk_length=tl_, method=method, cu_seqlens_q=st.cu,
                       workspace=engine.ws, out=out, lse=lse)
        assert_matches_reference(out, lse, ref_out, ref_lse, DTYPE)
        assert torch.all(out[st.n_real:] == 0) and torch.all(lse[st.n_real:] == float("-inf"))
        if method == "grouped":
            assert int(engine.ws.group_len.sum()) > 0, "the grouped kernel should have run (overlapping lists)"


def test_converter_large_topk_many_blocks_matches_reference():
    """K = 2048, block size 64, requests of up to 300 blocks, a block stride of 3 blocks, padded rows."""
    g = torch.Generator().manual_seed(2)
    T, B, max_blocks = 300, 6, 300
    table = torch.randint(-1, 5000, (B, max_blocks), generator=g, dtype=torch.int32)
    req_id = torch.randint(-1, B, (T,), generator=g, dtype=torch.int32)
    topk = torch.randint(-1, max_blocks * 64 + 100, (T, 2048), generator=g, dtype=torch.int32)
    args = [x.to("cuda") for x in (req_id, table, topk)]
    out, counts = convert_req_index_to_global(*args, 64, kv_block_stride_rows=192, return_valid_counts=True)
    ref, ref_counts = convert_req_index_to_global_ref(*args, 64, kv_block_stride_rows=192)
    assert torch.equal(out, ref) and torch.equal(counts, ref_counts)


STEP_SHAPES = [(1, 1, 0), (7, 3, 0), (16, 8, 0), (100, 5, 3), (256, 7, 1), (33, 2, 0), (200, 4, 16), (1100, 3, 2)]


def test_warmup_then_steps_compile_nothing(engine):
    """After warmup, steps of other token / request counts, both layouts, with and without lse and
    topk_length, and the converter with and without counts add no compiled kernel variant."""
    assert engine.report.calls > 0
    torch.cuda.synchronize()
    before = compiled_variant_counts()
    for seed, (T, B, n_pad) in enumerate(STEP_SHAPES):
        st = make_step(T, B, seed=100 + seed, n_pad=n_pad)
        idx, counts = convert_req_index_to_global(st.req_id, st.block_table, st.topk_local, BS,
                                                  kv_block_stride_rows=engine.stride_rows, return_valid_counts=True)
        convert_req_index_to_global(st.req_id, st.block_table, st.topk_local, BS, kv_block_stride_rows=engine.stride_rows,
                                    out=idx)
        for return_lse in (False, True):
            for tl_ in (None, counts):
                sparse_mla_fwd(st.q, engine.rows, idx, SCALE, topk_length=tl_, return_lse=return_lse, method="grouped",
                               cu_seqlens_q=st.cu, workspace=engine.ws)
                sparse_mla_fwd(st.q, engine.rows, idx, SCALE, topk_length=tl_, return_lse=return_lse, method="grouped",
                               workspace=engine.ws)  # token-major (ShardQ layout)
                sparse_mla_fwd(st.q, engine.rows, idx, SCALE, topk_length=tl_, return_lse=return_lse, method="per_token")
        sparse_mla_fwd(st.q, engine.rows, idx, SCALE, method="auto", cu_seqlens_q=st.cu, workspace=engine.ws)
    torch.cuda.synchronize()
    after = compiled_variant_counts()
    new = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    assert not new, f"kernel variants compiled after warmup: {new} (warmup compiled {engine.report.new_variants})"


def _graph_statics(st: Step):
    return dict(q=st.q.clone(), req_id=st.req_id.clone(), block_table=st.block_table.clone(),
                topk_local=st.topk_local.clone(), cu=st.cu.clone(),
                idx=torch.empty_like(st.topk_local), out=torch.empty(st.q.shape[0], H, 512, dtype=DTYPE, device="cuda"),
                lse=torch.empty(st.q.shape[0], H, device="cuda"))


def _load(s: dict, st: Step) -> None:
    for name in ("q", "req_id", "block_table", "topk_local", "cu"):
        s[name].copy_(getattr(st, name))


def _capture(fn):
    return capture_graph(fn)[0]


def _eager(engine, st: Step):
    idx = convert_req_index_to_global(st.req_id, st.block_table, st.topk_local, BS, kv_block_stride_rows=engine.stride_rows)
    out, lse = sparse_mla_fwd(st.q, engine.rows, idx, SCALE, method="grouped", cu_seqlens_q=st.cu, workspace=engine.ws,
                              return_lse=True)
    return idx, out, lse


@pytest.mark.parametrize("use_op", [False, True], ids=["sparse_mla_fwd", "torch.ops.sparse_mla.fwd_out"])
def test_cuda_graph_replay_with_new_data_equals_eager(engine, use_op):
    """Capture converter + grouped step (workspace, preallocated out/lse) once; replay it with new q, top-k,
    block tables and a different request split (same T and B): equal to eager, and to the reference."""
    T, B, n_pad = 96, 4, 5
    s = _graph_statics(make_step(T, B, seed=10, n_pad=n_pad))
    bufs = workspace_buffers(engine.ws)

    def step():
        convert_req_index_to_global(s["req_id"], s["block_table"], s["topk_local"], BS,
                                    kv_block_stride_rows=engine.stride_rows, out=s["idx"])
        if use_op:
            torch.ops.sparse_mla.fwd_out(s["q"], engine.rows, s["idx"], s["out"], s["lse"], bufs, SCALE,
                                         cu_seqlens_q=s["cu"], method="grouped")
        else:
            sparse_mla_fwd(s["q"], engine.rows, s["idx"], SCALE, method="grouped", cu_seqlens_q=s["cu"],
                           workspace=engine.ws, out=s["out"], lse=s["lse"])

    graph = _capture(step)
    for seed in (11, 12, 13):
        st = make_step(T, B, seed=seed, n_pad=n_pad, n_decode=seed - 10)
        _load(s, st)
        s["out"].fill_(float("nan"))
        s["lse"].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        replay = [s[k].clone() for k in ("idx", "out", "lse")]
        idx_e, out_e, lse_e = _eager(engine, st)
        assert torch.equal(replay[0], idx_e), "converted indices differ from eager"
        # The grouped union's row order depends on the order of atomics, so two runs of the same step
        # differ by fp32 summation order only: compare with a rounding tolerance, not bitwise.
        assert _close(replay[1], out_e) and _close(replay[2], lse_e), "replayed step differs from eager"
        ref_out, ref_lse = sparse_mla_ref(st.q, engine.rows, idx_e, SCALE)
        assert_matches_reference(replay[1], replay[2], ref_out, ref_lse, DTYPE)


def test_step_allocates_no_device_memory(engine):
    """With a workspace, preallocated out / lse / indices / counts, a step makes no allocator call."""
    st = make_step(64, 3, seed=20, n_pad=2)
    idx = torch.empty_like(st.topk_local)
    counts = torch.empty_like(st.req_id)
    out = torch.empty(64, H, 512, dtype=DTYPE, device="cuda")
    lse = torch.empty(64, H, device="cuda")
    bufs = workspace_buffers(engine.ws)

    def step():
        convert_req_index_to_global(st.req_id, st.block_table, st.topk_local, BS, kv_block_stride_rows=engine.stride_rows,
                                    out=idx, valid_counts=counts)
        sparse_mla_fwd(st.q, engine.rows, idx, SCALE, method="grouped", cu_seqlens_q=st.cu, workspace=engine.ws,
                       out=out, lse=lse)
        sparse_mla_fwd(st.q, engine.rows, idx, SCALE, method="grouped", workspace=engine.ws, out=out, lse=lse)
        sparse_mla_fwd(st.q, engine.rows, idx, SCALE, topk_length=counts, method="per_token", out=out, lse=lse)
        sparse_mla_fwd(st.q, engine.rows, idx, SCALE, method="per_token", out=out)
        torch.ops.sparse_mla.fwd_out(st.q, engine.rows, idx, out, lse, bufs, SCALE, cu_seqlens_q=st.cu, method="grouped")

    step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    step()
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    for key in ("allocation.all.allocated", "allocated_bytes.all.allocated", "segment.all.allocated"):
        assert after[key] == before[key], f"{key}: {before[key]} -> {after[key]} during a step"


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same inf/NaN positions and values equal up to bf16 rounding of a different fp32 summation order."""
    if not torch.equal(torch.isfinite(a), torch.isfinite(b)):
        return False
    fin = torch.isfinite(a)
    d = (a[fin].float() - b[fin].float()).norm()
    return bool(d <= 5e-3 * b[fin].float().norm() + 1e-6)


def test_torch_compile_inductor_matches_eager(engine):
    st = make_step(40, 3, seed=30, n_pad=2)
    bufs = workspace_buffers(engine.ws)

    def fn(q, req_id, table, local, cu, out, lse):
        idx, counts = torch.ops.sparse_mla.convert_req_index(req_id, table, local, BS, engine.stride_rows)
        torch.ops.sparse_mla.fwd_out(q, engine.rows, idx, out, lse, bufs, SCALE, cu_seqlens_q=cu, method="grouped")
        o2, l2 = torch.ops.sparse_mla.fwd(q, engine.rows, idx, SCALE, topk_length=counts, method="per_token")
        return idx, o2, l2

    results = []
    for f in (fn, torch.compile(fn, fullgraph=True)):
        out = torch.full((40, H, 512), float("nan"), dtype=DTYPE, device="cuda")
        lse = torch.full((40, H), float("nan"), device="cuda")
        results.append((*f(st.q, st.req_id, st.block_table, st.topk_local, st.cu, out, lse), out, lse))
    for a, b in zip(*results):
        assert torch.equal(a, b) if a.dtype == torch.int32 else _close(a, b)
    idx, o2, l2, out, lse = results[1]
    ref_out, ref_lse = sparse_mla_ref(st.q, engine.rows, idx, SCALE)
    assert_matches_reference(out, lse, ref_out, ref_lse, DTYPE)
    assert_matches_reference(o2, l2, ref_out, ref_lse, DTYPE)
