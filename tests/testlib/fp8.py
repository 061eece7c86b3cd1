"""The FP8 ``fp8_ds_mla`` cache the FP8 tests share: caches whose tile scales spread over four decades, problems
on them, the checked ``sparse_mla_fwd`` call, the layer's inputs."""

from __future__ import annotations

import torch

from sparse_mla import sparse_mla_fwd, sparse_mla_ref
from sparse_mla.kv_format import FP8_DS_MLA
from testlib.adversarial import adversarial_indices
from testlib.device import DEVICE, DTYPE
from testlib.problems import assert_outside_untouched, poisoned_views
from testlib.tolerances import (
    assert_matches_reference,
)

FMT = FP8_DS_MLA
FP8 = "fp8_ds_mla"


def spread_kv(N: int, *, seed: int, dtype=torch.float32, device=DEVICE) -> torch.Tensor:
    """[N, 576] latent rows whose four 128-value tiles have magnitudes ~1e-2, 1e-1, 1, 10 (permuted per row),
    so the four scales of a row differ by up to 1000x; k_pe ~ 1."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, 576, generator=g)
    mags = torch.tensor([1e-2, 1e-1, 1.0, 10.0])
    perm = torch.stack([torch.randperm(4, generator=g) for _ in range(N)])
    x[:, :512] *= mags[perm].repeat_interleave(128, dim=1)
    return x.to(dtype).to(device)


def fp8_problem(T: int, H: int, K: int, N: int, *, seed: int, indices=None, scale_format="ue8m0"):
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(T, H, 576, generator=g).to(DTYPE).to(DEVICE)
    cache = FMT.quantize(spread_kv(N, seed=seed), scale_format=scale_format)
    if indices is None:
        indices = adversarial_indices(T, K, N, generator=g)
    return q, cache, indices.to(DEVICE)


def run_fp8_checked(q, cache, indices, sm_scale, *, topk_length=None, attn_sink=None, pad_tokens=1, pad_heads=1,
                    **kwargs):
    """``sparse_mla_fwd(kv_format="fp8_ds_mla")`` into NaN-poisoned views, compared per (token, head) row to the
    fp32 reference on the dequantized cache; the poisoned padding around the views must stay NaN."""
    T, H, _ = q.shape
    out_big, lse_big, out, lse = poisoned_views(T, H, pad_tokens=pad_tokens, pad_heads=pad_heads)
    sparse_mla_fwd(q, cache, indices, sm_scale, topk_length=topk_length, return_lse=True, out=out, lse=lse,
                   kv_format=FP8, attn_sink=attn_sink, **kwargs)
    ref_out, ref_lse = sparse_mla_ref(q, cache, indices, sm_scale, topk_length=topk_length, attn_sink=attn_sink,
                                      kv_format=FP8)
    assert_matches_reference(out, lse, ref_out, ref_lse, DTYPE)
    assert_outside_untouched(out_big, lse_big, T, pad_heads)
    return out, lse, ref_out, ref_lse


def layer_inputs(seed: int, *, paged: bool = False):
    """Two requests (20 cached + 6 new at rows 0.., 0 cached + 5 new at rows 30..; rows 26..29 belong to no
    window), K = 16 (the first request's windows exceed it), H 16, qk_nope = v = 32."""
    g = torch.Generator().manual_seed(seed)
    H, dn, dv, K, N = 16, 32, 32, 16, 40
    cached, new, offs = [20, 0], [6, 5], [0, 30]
    T = sum(new)
    idx = torch.full((T, K), -1, dtype=torch.int32)
    t = 0
    for b in range(2):
        for i in range(new[b]):
            win = cached[b] + i + 1
            sel = torch.randperm(win, generator=g)[:min(K, win)] + offs[b]
            idx[t, :sel.numel()] = sel.to(torch.int32)
            t += 1
    cache = FMT.quantize(spread_kv(N, seed=seed))
    return dict(q_nope=torch.randn(T, H, dn, generator=g).to(DTYPE).to(DEVICE),
                q_pe=torch.randn(T, H, 64, generator=g).to(DTYPE).to(DEVICE),
                w_kv_b=(torch.randn(H * (dn + dv), 512, generator=g) / 512**0.5).to(DTYPE).to(DEVICE),
                indices=idx.to(DEVICE), kv=cache.view(5, 8, 656) if paged else cache, cached_lens=cached,
                new_lens=new, row_offsets=offs, sm_scale=0.1, kv_format=FP8)
