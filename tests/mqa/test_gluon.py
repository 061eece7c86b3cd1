"""The Gluon sm_90 backend (``sparse_mla.mqa.gluon_sm90``) held to the fp32 reference and to its Triton twin.

GPU-only (Hopper with a supported Triton): each case runs ``sparse_mla_fwd`` twice on fresh random inputs,
once with ``SPARSE_MLA_MQA_BACKEND=gluon_sm90`` and once with ``=triton``, into NaN-poisoned views inside
larger NaN buffers (an unwritten element, or a store past the real rows, fails), and compares each
(token, head) row: to the reference within the dtype's tolerance, and to the twin. Cases cover per-token
(1..128 heads, D_qk 576 / 512, adversarial padding: -1, INT_MIN, N, INT_MAX, no valid row; topk_length
with garbage after it; K not a multiple of 64) and grouped (G = 128 // H for H = 8, 16, 32, 64; within
requests with odd lengths and an empty request, and token-major with a short tail group; overlap guard
on and off).
"""

from __future__ import annotations

import math

import pytest
import torch
from testlib.adversarial import adversarial_indices, garbage_topk_length
from testlib.device import HAS_CUDA
from testlib.problems import (
    assert_outside_untouched,
    cu_seqlens,
    make_problem,
    neighbour_rows,
    poisoned_out,
    poisoned_views,
)
from testlib.sm90 import hinted_kernels
from testlib.tolerances import TOLERANCE, assert_matches_reference

from sparse_mla import call_cache, sparse_mla_fwd, sparse_mla_ref
from sparse_mla.mqa import backends, gluon_sm90


def _gluon_applies() -> tuple[bool, str]:
    if not HAS_CUDA:
        return False, "no CUDA device"
    q = torch.empty(1, 1, 576, dtype=torch.bfloat16, device="cuda")
    return backends.gluon_sm90_applies(q, q[0])


_OK, _WHY = _gluon_applies()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=f"gluon_sm90 does not apply: {_WHY}")]


@pytest.fixture(params=gluon_sm90.SCHEDULES, autouse=True)
def schedule(request, monkeypatch):
    """Every test runs once per Gluon schedule."""
    monkeypatch.setattr(gluon_sm90.config, "SCHEDULE", request.param)
    return request.param


def assert_rows_close(out: torch.Tensor, ref: torch.Tensor, dtype, what: str) -> None:
    """Every (token, head) row of out within the dtype's relative tolerance of ref's row (rows whose
    reference is 0 must be exactly 0)."""
    o, r = out.float().flatten(0, -2), ref.float().flatten(0, -2)
    num = (o - r).norm(dim=-1)
    den = r.norm(dim=-1)
    zero = den == 0
    assert torch.all(o[zero] == 0), f"{what}: rows that must be 0 are not"
    rel = num[~zero] / den[~zero]
    if rel.numel():
        worst = rel.argmax().item()
        assert rel.max().item() < TOLERANCE[dtype], f"{what}: row {worst} relative error {rel.max().item():.2e}"


def _run(monkeypatch, backend: str, p, pad_heads: int = 1, **kw):
    monkeypatch.setenv(backends.ENV_VAR, backend)
    T, H, _ = p.q.shape
    out_big, lse_big, out, lse = poisoned_views(T, H, pad_tokens=2, pad_heads=pad_heads, dtype=p.q.dtype)
    sparse_mla_fwd(p.q, p.kv, p.indices, p.sm_scale, topk_length=p.topk_length, return_lse=True, out=out,
                   lse=lse, **kw)
    torch.cuda.synchronize()
    assert_outside_untouched(out_big, lse_big, T, pad_heads)
    return out, lse


def _compare(monkeypatch, p, **kw):
    out_g, lse_g = _run(monkeypatch, "gluon_sm90", p, **kw)
    out_t, lse_t = _run(monkeypatch, "triton", p, **kw)
    ref_out, ref_lse = sparse_mla_ref(p.q, p.kv, p.indices, p.sm_scale, topk_length=p.topk_length)
    dt = p.q.dtype
    assert_matches_reference(out_g, lse_g, ref_out, ref_lse, dt)
    assert_rows_close(out_g, ref_out, dt, "gluon vs reference")
    assert_rows_close(out_g, out_t, dt, "gluon vs triton twin")
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isinf(lse_g), ~fin)
    tol = 1e-2 if dt == torch.bfloat16 else 2e-3
    assert (lse_g[fin] - ref_lse[fin]).abs().max().item() < tol
    assert (lse_g[fin] - lse_t[fin]).abs().max().item() < tol


PER_TOKEN = [  # (T, H, D_qk, K, N, dtype, topk_length)
    pytest.param(5, 1, 576, 70, 300, torch.bfloat16, False, id="H1-K70"),
    pytest.param(5, 16, 576, 100, 300, torch.bfloat16, False, id="H16-K100"),
    pytest.param(10, 16, 512, 130, 300, torch.bfloat16, True, id="H16-d512-K130-topklen"),
    pytest.param(5, 64, 576, 70, 40, torch.bfloat16, False, id="H64-K70-N40"),
    pytest.param(7, 64, 576, 257, 3000, torch.float16, True, id="H64-fp16-K257-topklen"),
    pytest.param(5, 96, 576, 64, 300, torch.bfloat16, False, id="H96-K64"),
    pytest.param(9, 128, 576, 2048, 5000, torch.bfloat16, True, id="H128-K2048-topklen"),
    pytest.param(5, 128, 512, 190, 300, torch.float16, False, id="H128-d512-fp16-K190"),
]


@pytest.mark.parametrize("T, H, d_qk, K, N, dtype, topk_len", PER_TOKEN)
def test_per_token_matches_reference_and_twin(monkeypatch, T, H, d_qk, K, N, dtype, topk_len):
    g = torch.Generator().manual_seed(T * 1000 + H + K)
    idx = adversarial_indices(T, K, N, generator=g)
    tl_ = None
    if topk_len:
        idx, tl_ = garbage_topk_length(idx, N, generator=g)
    p = make_problem(T, H, K, N, d_qk=d_qk, dtype=dtype, seed=H + K, indices=idx, topk_length=tl_)
    _compare(monkeypatch, p, method="per_token")


GROUPED = [  # (H, K, lengths or None, T, keep, guard)
    pytest.param(16, 130, [3, 0, 19, 8], None, 0.8, None, id="H16-cu-3,0,19,8"),
    pytest.param(16, 2048, None, 21, 0.8, math.inf, id="H16-K2048-token-major-tail5"),
    pytest.param(8, 100, [33, 16], None, 0.9, None, id="H8-G16-cu-33,16"),
    pytest.param(32, 70, None, 11, 0.5, math.inf, id="H32-G4-token-major-tail3"),
    pytest.param(64, 90, [5, 4], None, 0.9, None, id="H64-G2-cu-5,4"),
    pytest.param(16, 64, None, 16, 0.0, None, id="H16-disjoint-guard-all-per-token"),
]


@pytest.mark.parametrize("H, K, lengths, T, keep, guard", GROUPED)
def test_grouped_matches_reference_and_twin(monkeypatch, H, K, lengths, T, keep, guard):
    T = sum(lengths) if lengths is not None else T
    N = 4 * K + 50
    g = torch.Generator().manual_seed(H * 7 + K)
    base = neighbour_rows(T, K, N, keep, generator=g)
    idx = adversarial_indices(T, K, N, generator=g, base=base,
                              patterns=("clean", "clean", "pad_end", "clean", "sentinels", "clean", "all_invalid"))
    p = make_problem(T, H, K, N, seed=H + K + T, indices=idx)
    kw = dict(method="grouped", overlap_guard=guard)
    if lengths is not None:
        kw["cu_seqlens_q"] = cu_seqlens(lengths)
    _compare(monkeypatch, p, **kw)


def test_fresh_inputs_repeatable(monkeypatch):
    """The same input twice gives bit-identical outputs (a race would show as a moving error)."""
    g = torch.Generator().manual_seed(5)
    p = make_problem(33, 64, 512, 2000, indices=adversarial_indices(33, 512, 2000, generator=g))
    a, la = _run(monkeypatch, "gluon_sm90", p, method="per_token")
    a, la = a.clone(), la.clone()
    b, lb = _run(monkeypatch, "gluon_sm90", p, method="per_token")
    assert torch.equal(a, b) and torch.equal(la, lb)


@pytest.mark.parametrize("H", [16, 128])
def test_persistent_ctas_skip_routed_away_tokens(monkeypatch, H):
    """A per-token launch with most tokens routed away (route 0: the grouped path's per-token pass): every CTA
    skips those items (no Q copy, no barrier round, no store), so their poisoned rows stay NaN, and the routed
    tokens around them, on three persistent CTAs, still match the reference (the CTAs' barrier phases count only
    the items they run)."""
    T, K, N = 37, 150, 700
    g = torch.Generator().manual_seed(H)
    p = make_problem(T, H, K, N, seed=H + 1, indices=adversarial_indices(T, K, N, generator=g))
    route = torch.zeros(T, dtype=torch.int8)
    route[[0, 5, 6, 7, 20, 23, 34, 36]] = 1  # 23, 34: sentinel / all-invalid rows (adversarial_indices' patterns)
    route, keep = route.to(p.q.device), route.bool().to(p.q.device)
    monkeypatch.setitem(gluon_sm90.launcher._NUM_SMS, str(p.q.device), 3)
    monkeypatch.setenv(backends.ENV_VAR, "gluon_sm90")
    out, lse = poisoned_out(T, H, p.q.dtype)
    assert backends.per_token(p.q, p.kv, p.indices, p.sm_scale, None, out, lse, route) == "gluon_sm90"
    assert torch.isnan(out[~keep]).all() and torch.isnan(lse[~keep]).all()
    ref_out, ref_lse = sparse_mla_ref(p.q[keep], p.kv, p.indices[keep], p.sm_scale)
    assert torch.isinf(ref_lse).any(), "no routed token without a valid row"
    assert_matches_reference(out[keep], lse[keep], ref_out, ref_lse, p.q.dtype)


@pytest.mark.parametrize("method, H, K", [("per_token", 64, 300), ("per_token", 128, 200), ("grouped", 16, 130),
                                          ("grouped", 32, 200)])
def test_persistent_ctas_over_items_of_every_length(monkeypatch, method, H, K):
    """Three persistent CTAs loop over dozens of work items whose lists hold 0 to ceil(K / 64) tiles (odd and even
    tile counts, so a schedule's barrier phases must carry across items), into NaN-poisoned views."""
    T = 41
    N = 4 * K + 50
    g = torch.Generator().manual_seed(H + K)
    base = neighbour_rows(T, K, N, 0.8, generator=g)
    idx = adversarial_indices(T, K, N, generator=g, base=base,
                              patterns=("clean", "clean", "pad_end", "clean", "sentinels", "clean", "all_invalid"))
    tl_ = None
    if method == "per_token":
        tl_ = torch.randint(0, K + 1, (T,), generator=g).to(torch.int32)
        tl_[::6] = 0
        tl_[1::6] = 64  # one tile
        tl_[2::6] = 65  # two tiles, the second with one row
    p = make_problem(T, H, K, N, seed=H * 3 + K, indices=idx, topk_length=tl_)
    monkeypatch.setitem(gluon_sm90.launcher._NUM_SMS, str(p.q.device), 3)
    kw = dict(method=method)
    if method == "grouped":
        kw |= dict(cu_seqlens_q=cu_seqlens([20, 0, 17, 4]), overlap_guard=math.inf)
    _compare(monkeypatch, p, **kw)


L2_HINTS = [  # (method, H, D_qk, K, N, dtype); the fp8_ds_mla variant: tests/mqa/test_kv_fp8.py
    pytest.param("per_token", 64, 576, 257, 3000, torch.bfloat16, id="per-token-H64-K257"),
    pytest.param("per_token", 128, 512, 190, 300, torch.float16, id="per-token-H128-d512-fp16"),
    pytest.param("grouped", 16, 576, 130, 600, torch.bfloat16, id="grouped-H16-K130"),
]


@pytest.mark.parametrize("method, H, d_qk, K, N, dtype", L2_HINTS)
def test_kv_l2_hints_change_no_bit(monkeypatch, method, H, d_qk, K, N, dtype):
    """SPARSE_MLA_GLUON_KV_L2=evict_last (FlashMLA's cp.async L2 hints on the kv copies, ``gluon_sm90.l2_hints``)
    gives bit-identical outputs to plain cp.async, and both match the reference and the Triton twin."""
    T = 19
    g = torch.Generator().manual_seed(H + K)
    idx = adversarial_indices(T, K, N, generator=g, base=neighbour_rows(T, K, N, 0.8, generator=g))
    idx, topk_length = garbage_topk_length(idx, N, generator=g)
    p = make_problem(T, H, K, N, seed=K, indices=idx, d_qk=d_qk, dtype=dtype, topk_length=topk_length)
    outs = {}
    for mode in gluon_sm90.config.KV_L2_MODES:
        monkeypatch.setattr(gluon_sm90.config, "KV_L2", mode)
        call_cache.invalidate()  # a knob changed at run time: no replay of the other mode's launches
        _compare(monkeypatch, p, method=method)
        outs[mode] = _run(monkeypatch, "gluon_sm90", p, method=method)
    (a, la), (b, lb) = outs.values()
    assert torch.equal(a, b) and torch.equal(la, lb)
    assert hinted_kernels(gluon_sm90.config.SCHEDULE) > 0, "no kernel with the L2-hinted copies was compiled"

