"""The host path on a GPU: the launch cache launches the variant Triton's JIT would (``launch_cache.CHECKED``) with
the same results; no call synchronizes the host with the device; the default grouped call can be captured in a
CUDA graph once its workspace is cached."""

from __future__ import annotations

import pytest
import torch
from testlib.device import HAS_CUDA
from testlib.problems import neighbour_rows
from testlib.tolerances import assert_rows_close

import sparse_mla
from sparse_mla import launch_cache
from sparse_mla.mqa import selection
from sparse_mla.mqa.selection import NEVER, GroupingRule

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="launch cache / sync / graph checks need CUDA")]
GROUP_FROM_8 = (GroupingRule(32, 8), GroupingRule(128, NEVER))


def _inputs(T=300, H=16, K=64, N=2000, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, 576, generator=g).to(torch.bfloat16).cuda()
    kv = torch.randn(N, 576, generator=g).to(torch.bfloat16).cuda()
    idx = neighbour_rows(T, K, N, 0.8, generator=g).cuda()
    return q, kv, idx


def _calls(q, kv, idx):
    lens = torch.full((q.shape[0],), idx.shape[1] - 3, dtype=torch.int32, device="cuda")
    sink = torch.randn(q.shape[1], device="cuda")
    return {
        "per_token": lambda: sparse_mla.sparse_mla_fwd(q, kv, idx, 0.05, method="per_token", return_lse=True)[0],
        "grouped": lambda: sparse_mla.sparse_mla_fwd(q, kv, idx, 0.05, method="grouped", topk_length=lens)[0],
        "auto": lambda: sparse_mla.sparse_mla_fwd(q, kv, idx, 0.05),
        "drop_in": lambda: sparse_mla.flash_mla_sparse_fwd(q, kv[:, None], idx[:, None], 0.05, 512, sink, lens)[0],
    }


@pytest.mark.parametrize("name", ["per_token", "grouped", "auto", "drop_in"])
def test_launch_cache_launches_what_the_jit_would(name, monkeypatch):
    monkeypatch.setattr(selection, "GROUPING_RULES", GROUP_FROM_8)
    fn = _calls(*_inputs())[name]
    monkeypatch.setattr(launch_cache, "ENABLED", False)
    jit = fn().clone()
    monkeypatch.setattr(launch_cache, "ENABLED", True)
    monkeypatch.setattr(launch_cache, "CHECKED", True)  # raises if a key names two compiled variants
    for _ in range(2):
        fn()
    monkeypatch.setattr(launch_cache, "CHECKED", False)
    fast = fn()
    fn()
    torch.cuda.synchronize()
    assert torch.equal(fast, jit), "the direct launch must compute the same bits as the JIT's"


@pytest.mark.parametrize("name", ["per_token", "grouped", "auto", "drop_in"])
def test_calls_do_not_synchronize(name, monkeypatch):
    """Once warm (compiled, workspace cached), a call issues no host-device synchronization."""
    monkeypatch.setattr(selection, "GROUPING_RULES", GROUP_FROM_8)
    fn = _calls(*_inputs(seed=1))[name]
    fn()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("case_index", [0, 3, 6])
def test_dsa_prefill_does_not_synchronize(case_index):
    """Every path of the layer call that supports the step (and the automatic choice), warm: no synchronization."""
    from testlib.layer import CASES, build

    case = CASES[case_index]
    inp, _ = build(case)
    for path in (None, *case.paths):
        sparse_mla.dsa_prefill(**inp, path=path)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            sparse_mla.dsa_prefill(**inp, path=path)
        finally:
            torch.cuda.set_sync_debug_mode(0)


def test_default_grouped_call_captures_in_a_cuda_graph(monkeypatch):
    monkeypatch.setattr(selection, "GROUPING_RULES", GROUP_FROM_8)
    q, kv, idx = _inputs(seed=2)
    out = torch.empty(q.shape[0], q.shape[1], 512, dtype=q.dtype, device="cuda")
    sparse_mla.sparse_mla_fwd(q, kv, idx, 0.05, out=out)  # compiles, caches the workspace
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        sparse_mla.sparse_mla_fwd(q, kv, idx, 0.05, out=out)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        sparse_mla.sparse_mla_fwd(q, kv, idx, 0.05, out=out)
    q.copy_(torch.randn_like(q.float()).to(q.dtype))
    out.fill_(float("nan"))
    g.replay()
    ref, _ = sparse_mla.sparse_mla_ref(q, kv, idx, 0.05)
    assert_rows_close(out, ref, torch.bfloat16, "graph replay")
