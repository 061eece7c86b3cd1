"""The fp32 reference ``sparse_mla_ref`` itself: against a float64 loop written from the definition
(attn_sink with +-inf, max_logits, topk_length, empty rows), and its independence from kv rows a query
does not select (issue 16 item 2: a NaN in kv row 0 used to turn every output NaN)."""

from __future__ import annotations

import math

import pytest
import torch
from testlib.device import DEVICE, DTYPE, INT_MAX, INT_MIN

from sparse_mla import sparse_mla_fwd, sparse_mla_ref

INF = float("inf")


def direct_f64(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    """The definition, one (token, head) at a time in float64 with Python-level control flow."""
    T, H, _ = q.shape
    N = kv.shape[0]
    q64, kv64 = q.double().cpu(), kv.double().cpu()
    out = torch.zeros(T, H, 512, dtype=torch.float64)
    lse = torch.full((T, H), -INF, dtype=torch.float64)
    mx = torch.full((T, H), -INF, dtype=torch.float64)
    for t in range(T):
        n = indices.shape[1] if topk_length is None else int(topk_length[t])
        rows = [int(r) for r in indices[t, :n] if 0 <= int(r) < N]
        if not rows:
            continue
        k = kv64[rows]
        for h in range(H):
            s = sm_scale * (k @ q64[t, h])
            m = s.max().item()
            e = torch.exp(s - m)
            lse[t, h] = m + math.log(e.sum().item())
            mx[t, h] = m
            denom = e.sum().item()
            if attn_sink is not None:
                sink = float(attn_sink[h])
                denom = INF if sink == INF else denom + math.exp(sink - m)
            out[t, h] = (e[:, None] * k[:, :512]).sum(0) / denom
    return out, lse, mx


def _problem(seed=0, T=6, H=4, K=24, N=40):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, 576, generator=g) / 4
    kv = torch.randn(N, 576, generator=g) / 4
    idx = torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    idx[1, ::4] = -1
    idx[2, 3:9] = torch.tensor([INT_MIN, INT_MAX, N, N + 7, -2, -1], dtype=torch.int32)
    idx[3] = -1  # no valid row
    lengths = torch.tensor([K, K, K - 5, K, 0, 7][:T], dtype=torch.int32)
    return q, kv, idx, lengths


@pytest.mark.parametrize("sink", [None, "finite", "mixed"])
@pytest.mark.parametrize("use_lengths", [False, True])
def test_reference_matches_direct_definition(sink, use_lengths):
    q, kv, idx, lengths = _problem()
    H = q.shape[1]
    attn_sink = None
    if sink == "finite":
        attn_sink = torch.tensor([0.5, 2.0, -1.0, 4.0])
    elif sink == "mixed":
        attn_sink = torch.tensor([INF, -INF, 1.5, INF])[:H]
    tl_ = lengths if use_lengths else None
    out, lse, mx = sparse_mla_ref(q, kv, idx, 0.7, topk_length=tl_, attn_sink=attn_sink, return_max_logits=True)
    d_out, d_lse, d_mx = direct_f64(q, kv, idx, 0.7, tl_, attn_sink)
    assert torch.allclose(out.double(), d_out, atol=1e-6, rtol=1e-5)
    assert torch.equal(torch.isinf(lse), torch.isinf(d_lse)) and torch.equal(torch.isinf(mx), torch.isinf(d_mx))
    fin = ~torch.isinf(d_lse)
    assert torch.allclose(lse.double()[fin], d_lse[fin], atol=1e-6, rtol=1e-6)
    assert torch.allclose(mx.double()[fin], d_mx[fin], atol=1e-6, rtol=1e-6)
    assert torch.all(lse[3] == -INF) and torch.all(out[3] == 0) and torch.all(mx[3] == -INF)


def test_reference_default_return_is_unchanged():
    q, kv, idx, _ = _problem()
    res = sparse_mla_ref(q, kv, idx, 0.7)
    assert isinstance(res, tuple) and len(res) == 2


@pytest.mark.parametrize("kv_format", [None, "fp8_ds_mla"])
def test_empty_cache_gives_zero_out_and_minus_inf_lse(kv_format):
    """N = 0 (every index padding): the reference gives out 0, lse -inf, max_logits -inf for every query, as
    the kernels do (per token and grouped)."""
    from sparse_mla.kv_format import FP8_DS_MLA

    T, H = 5, 16
    q = torch.randn(T, H, 576, generator=torch.Generator().manual_seed(3)).to(DTYPE).to(DEVICE)
    kv = torch.empty(0, 576, dtype=DTYPE, device=DEVICE)
    if kv_format is not None:
        kv = FP8_DS_MLA.quantize(kv)
    idx = torch.tensor([-1, INT_MIN, 0, INT_MAX, 7, -2, 1, -1], dtype=torch.int32, device=DEVICE).repeat(T, 1)
    out, lse, mx = sparse_mla_ref(q, kv, idx, 0.1, return_max_logits=True, kv_format=kv_format)
    assert out.shape == (T, H, 512) and torch.all(out == 0)
    assert torch.all(lse == -INF) and torch.all(mx == -INF)
    for method in ("per_token", "grouped"):
        o, l_ = sparse_mla_fwd(q, kv, idx, 0.1, return_lse=True, method=method, kv_format=kv_format)
        assert torch.all(o == 0) and torch.all(l_ == -INF), method


@pytest.mark.parametrize("bad", [float("nan"), INF, -INF])
def test_unselected_non_finite_rows_change_nothing(bad):
    """kv rows that no query selects (row 0 included, rows only past topk_length, rows behind invalid
    entries) hold NaN / inf: the reference and the per-token kernel give exactly what they give on a kv
    where those rows are finite."""
    T, H, K, N = 5, 16, 32, 64
    g = torch.Generator().manual_seed(1)
    q = (torch.randn(T, H, 576, generator=g) / 4).to(DTYPE)
    kv_clean = (torch.randn(N, 576, generator=g) / 4).to(DTYPE)
    reserved = torch.arange(N - (K - 10), N)  # rows only token 2 lists, past its topk_length
    pool = torch.arange(1, N - (K - 10))  # never row 0
    idx = torch.stack([pool[torch.randperm(pool.numel(), generator=g)[:K]] for _ in range(T)]).to(torch.int32)
    lengths = torch.full((T,), K, dtype=torch.int32)
    lengths[2] = 10
    idx[2, 10:] = reserved.to(torch.int32)
    idx[4, 5] = N  # invalid entry (>= N): never read
    selected = {int(r) for t in range(T) for r in idx[t, : int(lengths[t])] if 0 <= int(r) < N}
    poisoned = [r for r in range(N) if r not in selected]
    assert 0 in poisoned and set(reserved.tolist()) <= set(poisoned)
    kv_bad = kv_clean.clone()
    kv_bad[poisoned] = bad
    ref_clean = sparse_mla_ref(q, kv_clean, idx, 0.3, topk_length=lengths, return_max_logits=True)
    ref_bad = sparse_mla_ref(q, kv_bad, idx, 0.3, topk_length=lengths, return_max_logits=True)
    for a, b in zip(ref_bad, ref_clean):
        assert torch.equal(a, b), "the reference read a row its query does not select"
    dev = lambda x: x.to(DEVICE)
    o_clean, l_clean = sparse_mla_fwd(dev(q), dev(kv_clean), dev(idx), 0.3, topk_length=dev(lengths), return_lse=True,
                                      method="per_token")
    o_bad, l_bad = sparse_mla_fwd(dev(q), dev(kv_bad), dev(idx), 0.3, topk_length=dev(lengths), return_lse=True,
                                  method="per_token")
    assert torch.equal(o_bad, o_clean) and torch.equal(l_bad, l_clean)


def test_selected_nan_row_poisons_only_its_queries():
    """A NaN in a row that query 1 alone selects makes query 1's out NaN (reference and per-token kernel)
    and leaves every other query as it was."""
    T, H, K, N = 4, 16, 16, 64
    g = torch.Generator().manual_seed(2)
    q = (torch.randn(T, H, 576, generator=g) / 4).to(DTYPE)
    kv = (torch.randn(N, 576, generator=g) / 4).to(DTYPE)
    idx = torch.arange(T * K, dtype=torch.int32).reshape(T, K)  # disjoint lists
    kv_bad = kv.clone()
    kv_bad[int(idx[1, 3])] = float("nan")
    ref_out, _ = sparse_mla_ref(q, kv_bad, idx, 0.3)
    ref_clean, _ = sparse_mla_ref(q, kv, idx, 0.3)
    out = sparse_mla_fwd(q.to(DEVICE), kv_bad.to(DEVICE), idx.to(DEVICE), 0.3, method="per_token").float().cpu()
    for o in (ref_out, out):
        assert o[1].isnan().all()
        assert not o[[0, 2, 3]].isnan().any()
    assert torch.equal(ref_out[[0, 2, 3]], ref_clean[[0, 2, 3]])
