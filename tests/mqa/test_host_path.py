"""The host path on a GPU: the launch cache launches the variant Triton's JIT would (``launch_cache.CHECKED``) with
the same results; a warm call's replay (``sparse_mla.call_cache``) computes the full path's bits on fresh tensors;
no call synchronizes the host with the device; the default grouped call can be captured in a CUDA graph once its
workspace is cached."""

from __future__ import annotations

import pytest
import torch
from testlib.device import HAS_CUDA
from testlib.problems import neighbour_rows
from testlib.tolerances import assert_rows_close

import sparse_mla
from sparse_mla import call_cache, launch_cache
from sparse_mla.kv_format import FP8_DS_MLA
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
        "grouped": lambda: sparse_mla.sparse_mla_fwd(q, kv, idx, 0.05, method="grouped", topk_length=lens),
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


REPLAYED = ["per_token", "grouped", "auto", "drop_in", "out_given", "fp8_staged", "fp8_in_kernel", "fp8_auto"]


def _replay_calls(q, kv, idx):
    calls = _calls(q, kv, idx)
    T, H = q.shape[:2]
    out = torch.full((T, H, 512), float("nan"), dtype=q.dtype, device="cuda")
    lse = torch.full((T, H), float("nan"), device="cuda")
    cache = FP8_DS_MLA.quantize(kv)
    sink = torch.randn(H, device="cuda")
    calls.update({
        "out_given": lambda: sparse_mla.sparse_mla_fwd(q, kv, idx, 0.05, out=out, lse=lse, return_lse=True)[0],
        "fp8_staged": lambda: sparse_mla.sparse_mla_fwd(q, cache, idx, 0.05, kv_format="fp8_ds_mla", kv_dequant="staged"),
        "fp8_in_kernel": lambda: sparse_mla.sparse_mla_fwd(q, cache, idx, 0.05, kv_format="fp8_ds_mla",
                                                           kv_dequant="in_kernel", attn_sink=sink),
        "fp8_auto": lambda: sparse_mla.sparse_mla_fwd(q, cache, idx, 0.05, kv_format="fp8_ds_mla"),
    })
    return calls


@pytest.mark.parametrize("name", REPLAYED)
def test_warm_calls_replay_the_full_paths_bits(name, monkeypatch):
    """The first call of a shape records, later ones (fresh tensors at other addresses, outputs poisoned) replay:
    bitwise the full path's result (call_cache off), per row the fp32 reference's; CHECKED (conftest) also re-runs
    the full path dry on each replay and compares the launches."""
    monkeypatch.setattr(selection, "GROUPING_RULES", GROUP_FROM_8)
    wrapper = sparse_mla.flash_mla_sparse_fwd if name == "drop_in" else sparse_mla.sparse_mla_fwd
    for seed in (3, 4, 5):
        q, kv, idx = _inputs(seed=seed)
        fn = _replay_calls(q, kv, idx)[name]
        monkeypatch.setattr(call_cache, "ENABLED", False)
        full = fn().clone()
        monkeypatch.setattr(call_cache, "ENABLED", True)
        warm = fn()
        torch.cuda.synchronize()
        assert torch.equal(warm, full), f"seed {seed}: the replay must compute the full path's bits"
        if name in ("per_token", "out_given", "grouped", "auto"):
            lens = None if name != "grouped" else torch.full((q.shape[0],), idx.shape[1] - 3, dtype=torch.int32,
                                                             device="cuda")
            ref, _ = sparse_mla.sparse_mla_ref(q, kv, idx, 0.05, topk_length=lens)
            assert_rows_close(warm, ref, torch.bfloat16, f"{name} replay, seed {seed}")
    st = call_cache.status(wrapper)
    assert st["replayed"] and not st["not_replayable"], f"{name}: the warm calls were not all replayed: {st}"


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
