"""fp32 references of the layer-level DSA prefill (what every path of ``dsa_prefill`` reproduces).

The definition (docs/DESIGN.md "The paths"; per-token sparse MLA of ``sparse_mla.mqa.reference``, lifted to
the MLA layer through kv_b_proj). With W = kv_b_proj.weight viewed as [H, qk_nope + v, r]
(W_UK[h] = W[h, :qk_nope], W_UV[h] = W[h, qk_nope:]):

    q_absorbed[t, h] = concat(q_nope[t, h] @ W_UK[h], q_pe[t, h])         [r + qk_rope]
    kv_row[n]        = concat(kv_c[n], k_pe[n])                             [r + qk_rope]
    latent[t, h]     = sparse_mla_ref(q_absorbed, kv_row, indices', sm_scale, d_v=r)
    o[t, h]          = latent[t, h] @ W_UV[h].T                             [v_head_dim]

where indices' are the top-k lists with every entry outside the token's causal window (rows
row_offsets[b] .. row_offsets[b] + cached_b + i of its request) turned into padding. The MHA form
is the same value: k_nope[n, h] = W_UK[h] @ kv_c[n], v[n, h] = W_UV[h] @ kv_c[n], and attention of
concat(q_nope, q_pe) against concat(k_nope, k_pe) over the same rows (``form="mha"``).

With an FP8 cache (``kv_format="fp8_ds_mla"``) kv_row[n] is the cache row dequantized to q_nope's dtype
(``sparse_mla.kv_format``); both forms read those values.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..mqa.reference import sparse_mla_ref
from .checks import validate_dsa_prefill_args
from .problem import restrict_to_windows, token_windows

REF_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def dsa_prefill_ref(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor | None,
    w_kv_b: torch.Tensor,
    indices: torch.Tensor,
    *,
    kv: torch.Tensor | None = None,
    kv_c: torch.Tensor | None = None,
    k_pe: torch.Tensor | None = None,
    cached_lens: Sequence[int] | torch.Tensor,
    new_lens: Sequence[int] | torch.Tensor,
    row_offsets: Sequence[int] | torch.Tensor | None = None,
    sm_scale: float,
    topk_length: torch.Tensor | None = None,
    form: str = "mqa",
    chunk_tokens: int = 16,
    kv_format: str | None = None,
) -> torch.Tensor:
    """fp32 reference of ``sparse_mla.layer.dsa_prefill`` (same arguments; see its docstring).

    Args:
        q_nope, q_pe, w_kv_b, indices, kv / kv_c / k_pe, cached_lens, new_lens, row_offsets,
            sm_scale, topk_length: as ``dsa_prefill``; any of bf16 / fp16 / fp32, any device.
        form: "mqa" (absorbed, through ``sparse_mla_ref``; needs kv_lora_rank 512 and qk_rope in
            {0, 64}) or "mha" (decompressed per-head K/V, any dims).
        chunk_tokens: tokens evaluated at once in the "mha" form.
        kv_format: None, or "fp8_ds_mla" with kv the FP8 cache: the definition on the cache dequantized
            to q_nope's dtype (module docstring).

    Returns:
        o: [T, H, v_head_dim] fp32 on q_nope's device; 0 for a token with no valid entry.

    Raises:
        TypeError, ValueError: as ``validate_dsa_prefill_args``; ValueError for an unknown form or
            (form "mqa") dims ``sparse_mla_ref`` does not take.
    """
    if form not in ("mqa", "mha"):
        raise ValueError(f"form must be 'mqa' or 'mha', got {form!r}")
    p = validate_dsa_prefill_args(
        q_nope, q_pe, w_kv_b, indices, kv=kv, kv_c=kv_c, k_pe=k_pe, cached_lens=cached_lens, new_lens=new_lens,
        row_offsets=row_offsets, sm_scale=sm_scale, topk_length=topk_length, allowed_dtypes=REF_DTYPES,
        kv_format=kv_format,
    )
    dev = p.q_nope.device
    lo, win = token_windows(p.step.new_lens, p.step.cached_lens, p.row_offsets, dev)
    idx = restrict_to_windows(p.indices, lo, win)
    w_uk, w_uv = p.w_uk.float(), p.w_uv.float()
    T, H, _ = p.q_nope.shape
    kv_c, k_pe = p.latent_rows(slice(None))  # the whole cache (dequantized to q's dtype for an FP8 one)
    if form == "mqa":
        q = torch.einsum("thn,hnr->thr", p.q_nope.float(), w_uk)
        kv_rows = kv_c.float()
        if p.q_pe is not None:
            q = torch.cat([q, p.q_pe.float()], dim=-1)
            kv_rows = torch.cat([kv_rows, k_pe.float()], dim=-1)
        latent, _ = sparse_mla_ref(q.contiguous(), kv_rows.contiguous(), idx, p.sm_scale, d_v=p.step.kv_lora_rank,
                                   topk_length=p.topk_length)
        return torch.einsum("thr,hvr->thv", latent, w_uv)

    k_nope = torch.einsum("nr,hdr->nhd", kv_c.float(), w_uk)  # [N, H, qk_nope]
    v = torch.einsum("nr,hdr->nhd", kv_c.float(), w_uv)  # [N, H, v_head_dim]
    N, K = p.num_kv_rows, idx.shape[1]
    out = torch.empty(T, H, p.step.v_head_dim, dtype=torch.float32, device=dev)
    cols = torch.arange(K, device=dev)
    for t0 in range(0, T, chunk_tokens):
        t1 = min(T, t0 + chunk_tokens)
        rows = idx[t0:t1].long()
        valid = (rows >= 0) & (rows < N)
        if p.topk_length is not None:
            valid &= cols[None, :] < p.topk_length[t0:t1, None].long()
        rows = torch.where(valid, rows, 0)
        s = torch.einsum("thd,tkhd->thk", p.q_nope[t0:t1].float(), k_nope[rows])
        if p.q_pe is not None:
            s = s + torch.einsum("thd,tkd->thk", p.q_pe[t0:t1].float(), k_pe.float()[rows])
        s = (s * p.sm_scale).masked_fill(~valid[:, None, :], float("-inf"))
        lse = torch.logsumexp(s, dim=-1, keepdim=True)
        probs = torch.where(valid.any(-1)[:, None, None], torch.exp(s - lse), 0.0)
        out[t0:t1] = torch.einsum("thk,tkhd->thd", probs, v[rows])
    return out


def window_allowed_ref(indices: torch.Tensor, topk_length: torch.Tensor | None, lo: torch.Tensor, win: torch.Tensor,
                       width: int) -> torch.Tensor:
    """[T, width] bool: token t may see request-local position j (j < win[t] and row lo[t] + j in
    its counted list). The definition the packed masks of ``masked_mha`` encode.

    Args:
        indices: [T, K] int32 global rows; topk_length: optional [T] int32;
        lo, win: [T] int64 (``problem.token_windows``); width: positions per row (>= max window).
    """
    T, K = indices.shape
    idx = restrict_to_windows(indices, lo, win)
    if topk_length is not None:
        idx = torch.where(torch.arange(K, device=idx.device)[None, :] < topk_length[:, None].long(), idx, -1)
    pos = idx.long() - lo[:, None]
    ok = idx >= 0
    out = torch.zeros(T, width, dtype=torch.bool, device=indices.device)
    rows = torch.arange(T, device=indices.device)[:, None].expand(T, K)
    out[rows[ok], pos[ok]] = True
    return out


def masked_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                         sm_scale: float) -> torch.Tensor:
    """fp32 masked attention: o[t, h] = softmax_j(sm_scale * q[t, h] . k[j, h] over allowed[t, j]) @ v[:, h].

    Args:
        q: [T, H, D_qk]; k: [L, H, D_qk]; v: [L, H, D_v] (any float dtype, one device).
        allowed: [T, L] bool.
        sm_scale: softmax scale.

    Returns:
        [T, H, D_v] fp32; 0 for a query with no allowed key.
    """
    s = torch.einsum("thd,lhd->thl", q.float(), k.float()) * sm_scale
    s = s.masked_fill(~allowed[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    probs = torch.where(allowed.any(-1)[:, None, None], torch.exp(s - lse), 0.0)
    return torch.einsum("thl,lhd->thd", probs, v.float())


__all__ = ["dsa_prefill_ref", "window_allowed_ref", "masked_attention_ref"]
