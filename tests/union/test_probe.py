"""The overlap probe (``sparse_mla.union.probe``): a grouped step whose probed groups would all fall back
to per token skips the union build, on the device; results stay the reference's either way.

Small shapes for the CPU interpreter: the probe's thresholds are lowered per test (module constants read at
call time, the workspace sized after the change)."""

from __future__ import annotations

import math

import pytest
import torch
from testlib.device import DEVICE
from testlib.problems import cu_seqlens, make_problem, neighbour_rows, run_checked
from testlib.tolerances import all_of, assert_same_result

from sparse_mla import SparseMLAWorkspace, sparse_mla_fwd
from sparse_mla.union import probe

H, K, N = 16, 32, 4096  # G = 8


@pytest.fixture
def small_probe(monkeypatch):
    monkeypatch.setattr(probe, "PROBE_MIN_GROUPS", 4)
    monkeypatch.setattr(probe, "PROBE_STRIDE", 2)


def disjoint_rows(T: int, seed: int = 0) -> torch.Tensor:
    """[T, K]: token t takes rows t*K .. t*K + K - 1 in a random order (no two lists share a row)."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([t * K + torch.randperm(K, generator=g) for t in range(T)]).to(torch.int32)


def run_grouped(p, ws, **kw):
    ws.group_len.fill_(-7)  # stale values from an earlier call must not matter
    return run_checked(p, method="grouped", workspace=ws, **kw)


def test_no_overlap_skips_every_group(small_probe):
    T = 8 * 8
    p = make_problem(T, H, K, N, indices=disjoint_rows(T))
    ws = SparseMLAWorkspace.for_problem(T, K, H, N, DEVICE)
    out, lse = run_grouped(p, ws)
    assert int(ws.probe_skip[0]) == 1, "every probed group is guarded: the step must skip grouping"
    assert all_of(v == 0 for v in ws.group_len[:T // 8].tolist()), ws.group_len[:T // 8].tolist()
    assert all_of(v == 1 for v in ws.route[:T].tolist())
    out_pt, lse_pt = sparse_mla_fwd(p.q, p.kv, p.indices, p.sm_scale, method="per_token", return_lse=True)
    assert torch.equal(out, out_pt) and torch.equal(lse, lse_pt), "skipped step = the per-token kernel on every token"


def test_overlapping_lists_keep_their_groups(small_probe):
    T = 8 * 8
    g = torch.Generator().manual_seed(1)
    p = make_problem(T, H, K, N, indices=neighbour_rows(T, K, N, keep=0.9, generator=g), seed=1)
    ws = SparseMLAWorkspace.for_problem(T, K, H, N, DEVICE)
    out, lse = run_grouped(p, ws)
    assert int(ws.probe_skip[0]) == 0
    assert all_of(v == 8 for v in ws.group_len[:T // 8].tolist()), ws.group_len[:T // 8].tolist()
    out_pt, lse_pt = sparse_mla_fwd(p.q, p.kv, p.indices, p.sm_scale, method="per_token", return_lse=True)
    assert_same_result(out_pt, lse_pt, out, lse, p.q.dtype)


def test_guarded_share_at_the_threshold_skips(small_probe):
    """Groups 0-3 disjoint, 4-7 overlapping: the probed groups 0, 2 (guarded) and 4, 6 (kept) give 1/2 >= 1/2."""
    T = 8 * 8
    g = torch.Generator().manual_seed(2)
    idx = torch.cat([disjoint_rows(32, seed=2), 2048 + neighbour_rows(32, K, 1024, keep=0.9, generator=g)])
    p = make_problem(T, H, K, N, indices=idx, seed=2)
    ws = SparseMLAWorkspace.for_problem(T, K, H, N, DEVICE)
    run_grouped(p, ws)
    assert int(ws.probe_skip[0]) == 1


def test_below_the_threshold_keeps_the_per_group_guard(small_probe):
    """Groups 0-1 disjoint, 2-7 overlapping: probed 0 guarded, 2, 4, 6 kept (1/4 < 1/2): no skip, and the
    per-group guard still sends groups 0 and 1 per token."""
    T = 8 * 8
    g = torch.Generator().manual_seed(3)
    idx = torch.cat([disjoint_rows(16, seed=3), 2048 + neighbour_rows(48, K, 1024, keep=0.9, generator=g)])
    p = make_problem(T, H, K, N, indices=idx, seed=3)
    ws = SparseMLAWorkspace.for_problem(T, K, H, N, DEVICE)
    run_grouped(p, ws)
    assert int(ws.probe_skip[0]) == 0
    assert ws.group_len[:8].tolist() == [0, 0, 8, 8, 8, 8, 8, 8]


def test_requests_count_only_live_groups(small_probe):
    """With cu_seqlens_q the planned group slots include empty ones; the share counts the non-empty probed
    groups only (three requests of disjoint lists: skip)."""
    lengths = [16, 9, 23]
    T = sum(lengths)
    p = make_problem(T, H, K, N, indices=disjoint_rows(T, seed=4), seed=4)
    ws = SparseMLAWorkspace.for_problem(T + 40, K, H, N, DEVICE)
    run_grouped(p, ws, cu_seqlens_q=cu_seqlens(lengths))
    assert int(ws.probe_skip[0]) == 1
    assert all_of(v == 1 for v in ws.route[:T].tolist())


def test_no_probe_on_small_steps_or_without_guard(small_probe, monkeypatch):
    T = 8 * 8
    p = make_problem(T, H, K, N, indices=disjoint_rows(T, seed=5), seed=5)
    ws = SparseMLAWorkspace.for_problem(T, K, H, N, DEVICE)
    ws.probe_skip.fill_(-1)
    run_grouped(p, ws, overlap_guard=math.inf)  # no guard: no probe, every union built and used
    assert int(ws.probe_skip[0]) == -1 and ws.group_len[:8].tolist() == [8] * 8
    monkeypatch.setattr(probe, "PROBE_MIN_GROUPS", 9)  # 8 groups: below the minimum
    run_grouped(p, ws)
    assert int(ws.probe_skip[0]) == -1
    assert probe.probe_groups(8) == 0 and probe.probe_groups(9) == 5


def test_short_step_in_a_large_workspace_needs_enough_live_probed_groups(small_probe):
    """With cu_seqlens_q the probe runs over the workspace's slots; a short step has few live probed groups. Here
    only group 0 (disjoint lists) of the two is probed: one guarded group must not send the step per token, so
    the per-group guard decides (group 0 per token, group 1 grouped)."""
    T = 16
    g = torch.Generator().manual_seed(6)
    idx = torch.cat([disjoint_rows(8, seed=6), 2048 + neighbour_rows(8, K, 1024, keep=0.9, generator=g)])
    p = make_problem(T, H, K, N, indices=idx, seed=6)
    ws = SparseMLAWorkspace.for_problem(64, K, H, N, DEVICE)  # 8 group slots, probed 0, 2, 4, 6
    run_grouped(p, ws, cu_seqlens_q=cu_seqlens([T]))
    assert int(ws.probe_skip[0]) == 0, "one live probed group is too few to skip the step"
    assert ws.group_len[:2].tolist() == [0, 8]
    assert ws.route[:T].tolist() == [1] * 8 + [0] * 8
    assert probe.probe_min_live() == 2  # PROBE_MIN_GROUPS // PROBE_STRIDE under the fixture
