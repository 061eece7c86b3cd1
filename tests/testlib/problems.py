"""Random sparse MLA problems, NaN-poisoned outputs and the checked ``sparse_mla_fwd`` call."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from testlib.device import DEVICE, DTYPE
from testlib.tolerances import assert_matches_reference


@dataclass
class Problem:
    q: torch.Tensor  # [T, H, D_qk]
    kv: torch.Tensor  # [N, D_qk]
    indices: torch.Tensor  # [T, K] int32
    topk_length: torch.Tensor | None
    sm_scale: float


def distinct_rows(T: int, K: int, N: int, *, causal_from: int | None = None, generator=None) -> torch.Tensor:
    """[T, K] int32 distinct rows per token; with causal_from=c, token t draws from [0, c + t] and
    pads with -1 where fewer than K rows exist."""
    out = torch.full((T, K), -1, dtype=torch.int32)
    for t in range(T):
        limit = N if causal_from is None else min(N, causal_from + t + 1)
        take = min(K, limit)
        out[t, :take] = torch.randperm(limit, generator=generator)[:take].to(torch.int32)
    return out


def neighbour_rows(T: int, K: int, N: int, keep: float, generator=None) -> torch.Tensor:
    """[T, K] distinct rows where each token keeps a fraction ``keep`` of its predecessor's list
    (so groups have unions between 1 and G lists)."""
    out = torch.empty((T, K), dtype=torch.int32)
    prev = torch.randperm(N, generator=generator)[:K]
    for t in range(T):
        n_keep = int(keep * K)
        kept = prev[torch.randperm(K, generator=generator)[:n_keep]]
        mask = torch.ones(N, dtype=torch.bool)
        mask[kept] = False
        fresh_pool = mask.nonzero()[:, 0]
        fresh = fresh_pool[torch.randperm(fresh_pool.numel(), generator=generator)[: K - n_keep]]
        row = torch.cat([kept, fresh])[torch.randperm(K, generator=generator)]
        out[t] = row.to(torch.int32)
        prev = row
    return out


def make_problem(T: int, H: int, K: int, N: int, *, d_qk: int = 576, dtype=None, seed: int = 0,
                 indices: torch.Tensor | None = None, topk_length: torch.Tensor | None = None) -> Problem:
    g = torch.Generator().manual_seed(seed)
    dtype = dtype or DTYPE
    q = torch.randn(T, H, d_qk, generator=g).to(dtype)
    kv = torch.randn(N, d_qk, generator=g).to(dtype)
    if indices is None:
        indices = distinct_rows(T, K, N, generator=g)
    sm_scale = d_qk**-0.5
    tl_ = None if topk_length is None else topk_length.to(DEVICE)
    return Problem(q.to(DEVICE), kv.to(DEVICE), indices.to(DEVICE), tl_, sm_scale)


def poisoned_out(T: int, H: int, dtype=None, d_v: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """NaN-filled out [T, H, d_v] and lse [T, H]: an element the kernel fails to write fails the test."""
    out = torch.full((T, H, d_v), float("nan"), dtype=dtype or DTYPE, device=DEVICE)
    lse = torch.full((T, H), float("nan"), dtype=torch.float32, device=DEVICE)
    return out, lse


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    """[B + 1] int32 on DEVICE: request boundaries of requests with the given lengths."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=DEVICE)


def poisoned_views(T: int, H: int, *, pad_tokens: int = 0, pad_heads: int = 0, dtype=None, d_v: int = 512):
    """NaN-filled buffers out_big [T + pad_tokens, H + pad_heads, d_v] and lse_big [T + pad_tokens, H],
    and the views a call writes: out = out_big[:T, pad_heads:] (head stride kept, so non-contiguous when
    pad_heads > 0) and lse = lse_big[:T] (contiguous). Everything outside the views must stay NaN."""
    out_big = torch.full((T + pad_tokens, H + pad_heads, d_v), float("nan"), dtype=dtype or DTYPE, device=DEVICE)
    lse_big = torch.full((T + pad_tokens, H), float("nan"), dtype=torch.float32, device=DEVICE)
    return out_big, lse_big, out_big[:T, pad_heads:], lse_big[:T]


def assert_outside_untouched(out_big: torch.Tensor, lse_big: torch.Tensor, T: int, pad_heads: int) -> None:
    """The rows / heads of ``poisoned_views`` buffers outside the written views are still all NaN."""
    assert torch.isnan(out_big[T:]).all(), "out rows past T were written (a padded tile stored past its rows)"
    assert torch.isnan(out_big[:, :pad_heads]).all(), "out heads outside the view were written"
    assert torch.isnan(lse_big[T:]).all(), "lse rows past T were written"


def run_checked(p: Problem, *, return_lse: bool = True, pad_tokens: int = 0, pad_heads: int = 0, **kwargs):
    """``sparse_mla_fwd`` on ``p`` into NaN-poisoned out= / lse= views (``poisoned_views``), compared to
    ``sparse_mla_ref``; the poisoned padding around the views must stay NaN.

    kwargs go to ``sparse_mla_fwd`` (method, cu_seqlens_q, workspace, overlap_guard, ...). Returns
    (out, lse) as written by the kernel (lse None with return_lse=False).
    """
    from sparse_mla import sparse_mla_fwd, sparse_mla_ref

    T, H, _ = p.q.shape
    out_big, lse_big, out, lse = poisoned_views(T, H, pad_tokens=pad_tokens, pad_heads=pad_heads, dtype=p.q.dtype)
    res = sparse_mla_fwd(p.q, p.kv, p.indices, p.sm_scale, topk_length=p.topk_length, return_lse=return_lse,
                         out=out, lse=lse if return_lse else None, **kwargs)
    if return_lse:
        assert isinstance(res, tuple) and res[0] is out and res[1] is lse, "must return the given out= / lse="
    else:
        assert res is out, "return_lse=False must return the out= tensor alone"
    ref_out, ref_lse = sparse_mla_ref(p.q, p.kv, p.indices, p.sm_scale, topk_length=p.topk_length)
    assert_matches_reference(out, lse if return_lse else None, ref_out, ref_lse, p.q.dtype)
    assert_outside_untouched(out_big, lse_big, T, pad_heads)
    return out, (lse if return_lse else None)


def compact_reference(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                      topk_length: torch.Tensor | None = None):
    """``sparse_mla_ref`` on a cache holding only the rows ``indices`` uses (valid ones remapped), so a
    huge kv is never converted to fp32 as a whole. Same result as the reference on the full kv."""
    from sparse_mla import sparse_mla_ref

    N = kv.shape[0]
    idx = indices.reshape(indices.shape[0], -1).long()
    valid = (idx >= 0) & (idx < N)
    used, inverse = torch.unique(torch.where(valid, idx, 0), return_inverse=True)
    small = kv.reshape(N, -1)[used]
    remapped = torch.where(valid, inverse, -1).to(torch.int32)
    return sparse_mla_ref(q, small, remapped, sm_scale, topk_length=topk_length)
