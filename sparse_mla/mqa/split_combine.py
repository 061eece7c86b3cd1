"""Split-KV partials and their exact merge.

With S > 1 splits (``sparse_mla.mqa.kv_splits``), S programs share one work item's list of kv rows: split s takes
columns [s * chunk, (s + 1) * chunk) of the list (chunk = the list's length / S rounded up to the kernel's tile), and
writes, per (token, head), a partial:

* ``out[t, s, h]``: its softmax-weighted sum of V normalized by its own sum (fp32; 0 when the split saw no valid row),
* ``lse[t, s, h]``: the natural-log sum of exp(sm_scale * q . k) over its valid rows (-inf when none),
* ``max_logits[t, s, h]``: the max of sm_scale * q . k over its valid rows (-inf when none), when asked for.

``combine_splits`` merges them in one launch: lse = log(sum_s exp(lse_s)), out = sum_s exp(lse_s - lse) * out_s,
max_logits = max_s max_logits_s, and attn_sink applied once, after the merge (out *= 1 / (1 + exp(sink[h] - lse))),
so every contract of ``sparse_mla_fwd`` holds (a query with no valid row in any split: out 0, lse -inf,
max_logits -inf). The partial buffers are plain ``torch.empty`` allocations whose sizes follow from the shapes
alone (no host sync; CUDA-graph capture allocates them from the graph's pool).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..launch_cache import LaunchCache

D_V = 512


@dataclass
class SplitPartials:
    """The partial results of one split-KV call: out [T, S, H, 512], lse [T, S, H], max_logits [T, S, H] or None,
    fp32 on the call's device, contiguous (token-major: a split's slice is a [T, H, ...] view with small strides, and
    the combine reads a token's partials together)."""

    num_splits: int
    out: torch.Tensor
    lse: torch.Tensor
    max_logits: torch.Tensor | None


MAX_SPLIT_PARTIAL_BYTES = 4 * 2**30  # a forced kv_splits past this raises (the automatic choice does not split then)


def partial_bytes(num_splits: int, num_tokens: int, num_heads: int, d_v: int = D_V) -> int:
    """Bytes of the fp32 partials of a split call (out, lse and max_logits)."""
    return num_splits * num_tokens * num_heads * (d_v + 2) * 4


def split_partials(num_splits: int, num_tokens: int, num_heads: int, device: torch.device, *,
                   with_max_logits: bool, d_v: int = D_V) -> SplitPartials:
    """Allocate the partial buffers of a split-KV call (uninitialized: every element is written by the kernels).

    Args:
        num_splits: S >= 2. num_tokens, num_heads: T, H of the call. device: q's device.
        with_max_logits: also a partial max-logit buffer (the caller asked for max_logits).
    """
    S, T, H = num_splits, num_tokens, num_heads
    out = torch.empty(T, S, H, d_v, dtype=torch.float32, device=device)
    lse = torch.empty(T, S, H, dtype=torch.float32, device=device)
    ml = torch.empty(T, S, H, dtype=torch.float32, device=device) if with_max_logits else None
    return SplitPartials(S, out, lse, ml)


@triton.jit(do_not_specialize=["T", "H", "num_splits", "stride_ot", "stride_oh", "stride_lt", "stride_mt"])
def _combine_splits_kernel(O_PART, L_PART, M_PART, OUT, LSE, MAX_LOGITS, SINK, T, H, num_splits,
                           stride_ot, stride_oh, stride_lt, stride_mt,
                           HAS_LSE: tl.constexpr, HAS_MAXL: tl.constexpr, HAS_SINK: tl.constexpr,
                           BLOCK_H: tl.constexpr, D_V: tl.constexpr):
    """One program per (token, block of BLOCK_H heads): the lse-weighted merge of the S partials."""
    t = tl.program_id(0).to(tl.int64)
    hh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = hh < H
    cols = tl.arange(0, D_V)
    row = t * num_splits * H + hh  # (t, split 0, h) in the [T, S, H] partials
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for s in range(num_splits):
        m = tl.maximum(m, tl.load(L_PART + s * H + row, mask=h_ok, other=float("-inf")))
    has_any = m > float("-inf")
    m_use = tl.where(has_any, m, 0.0)
    acc = tl.zeros([BLOCK_H, D_V], tl.float32)
    wsum = tl.zeros([BLOCK_H], tl.float32)
    mx = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for s in range(num_splits):
        ls = tl.load(L_PART + s * H + row, mask=h_ok, other=float("-inf"))
        w = tl.exp(ls - m_use)  # 0 for an empty split (lse -inf), whose out is 0 and never read
        use = h_ok & (w > 0.0)
        o = tl.load(O_PART + (s * H + row)[:, None] * D_V + cols[None, :], mask=use[:, None], other=0.0)
        acc += w[:, None] * o
        wsum += w
        if HAS_MAXL:
            mx = tl.maximum(mx, tl.load(M_PART + s * H + row, mask=h_ok, other=float("-inf")))
    denom = tl.where(has_any, wsum, 1.0)
    if HAS_SINK:  # the sink as one more key of value 0, once: -inf adds 0, +inf gives out 0, NaN gives NaN
        sink = tl.load(SINK + hh, mask=h_ok, other=float("-inf"))
        denom = denom + tl.where(has_any, tl.exp(sink - m_use), 0.0)
    out = acc / denom[:, None]
    o_row = OUT + t * stride_ot + hh.to(tl.int64) * stride_oh
    tl.store(o_row[:, None] + cols[None, :], out.to(OUT.dtype.element_ty), mask=h_ok[:, None])
    if HAS_LSE:
        lse = tl.where(has_any, m_use + tl.log(tl.where(has_any, wsum, 1.0)), float("-inf"))
        tl.store(LSE + t * stride_lt + hh, lse, mask=h_ok)
    if HAS_MAXL:
        tl.store(MAX_LOGITS + t * stride_mt + hh, mx, mask=h_ok)


_COMBINE = LaunchCache(namespace=globals(), name="_combine_splits_kernel", align=tuple(range(7)))
COMBINE_BLOCK_H = 16
COMBINE_WARPS = 4


def combine_splits(parts: SplitPartials, out: torch.Tensor, lse: torch.Tensor | None,
                   max_logits: torch.Tensor | None, attn_sink: torch.Tensor | None) -> None:
    """Merge ``parts`` into out [T, H, 512] (q's dtype, last dim contiguous), lse [T, H] fp32 (heads contiguous) or
    None, max_logits [T, H] fp32 (heads contiguous) or None; attn_sink [H] fp32 contiguous or None. Every (t, h) of
    out (and of lse / max_logits when given) is written. One launch."""
    T, S, H = parts.lse.shape
    if T == 0 or H == 0:
        return
    if max_logits is not None and parts.max_logits is None:
        raise ValueError("max_logits asked for but the partials hold none (split_partials(with_max_logits=True))")
    f32 = parts.lse  # a placeholder for absent fp32 pointers (never read)
    grid = (T, triton.cdiv(H, COMBINE_BLOCK_H))
    flags = (lse is not None, max_logits is not None, attn_sink is not None)
    _COMBINE((out.dtype, *flags), grid, (
        parts.out, parts.lse, parts.max_logits if parts.max_logits is not None else f32, out,
        lse if lse is not None else f32, max_logits if max_logits is not None else f32,
        attn_sink if attn_sink is not None else f32, T, H, S,
        out.stride(0), out.stride(1), lse.stride(0) if lse is not None else 0,
        max_logits.stride(0) if max_logits is not None else 0),
        dict(HAS_LSE=flags[0], HAS_MAXL=flags[1], HAS_SINK=flags[2], BLOCK_H=COMBINE_BLOCK_H, D_V=D_V),
        {"num_warps": COMBINE_WARPS})


__all__ = ["SplitPartials", "split_partials", "combine_splits", "partial_bytes", "MAX_SPLIT_PARTIAL_BYTES"]
