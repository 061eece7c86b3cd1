"""Gluon helpers both schedules use: tile rows, pseudo-heads, work items, the Q copy, the epilogue statistics."""

from __future__ import annotations

from ...kv_format import FP8_DS_MLA
from .config import BLOCK_H, BLOCK_N, D_PE, D_V
from .gluon_api import async_copy, fence_async_shared, gl, gluon, mbarrier, warpgroup_mma, warpgroup_mma_wait  # noqa: F401

_BH = gl.constexpr(BLOCK_H)
_BN = gl.constexpr(BLOCK_N)
_DV = gl.constexpr(D_V)
_DPE = gl.constexpr(D_PE)
_LN2 = gl.constexpr(0.6931471805599453)
# fp8_ds_mla row layout (sparse_mla.kv_format): fp32 scales at byte _FP8_SCALES, one per _FP8_TILE NoPE values;
# the bf16 RoPE part at byte _FP8_ROPE
_FP8_SCALES = gl.constexpr(FP8_DS_MLA.scale_offset)
_FP8_ROPE = gl.constexpr(FP8_DS_MLA.rope_offset)
_FP8_TILE = gl.constexpr(FP8_DS_MLA.tile_size)

@gluon.jit
def _tile_rows(rows_ptr, row_stride, gid, n_rows, j, layout: gl.constexpr):
    """Row ids of kv tile j of list ``gid`` (positions >= n_rows read as -1), in ``layout`` (a [64] slice of the
    gather layout)."""
    pos = j * _BN + gl.arange(0, _BN, layout=layout)
    return gl.load(rows_ptr + gid.to(gl.int64) * row_stride + pos, mask=pos < n_rows, other=-1)

@gluon.constexpr_function
def _kv_policy(kv_evict):
    """The eviction policy of the kv-row copies for the constexpr KV_EVICT: "evict_last" when nonzero (a marked
    variant, made an L2 hint by ``l2_hints``), else none."""
    return "evict_last" if kv_evict else ""

@gluon.jit
def _pseudo_heads(mb, tok0, H, layout: gl.constexpr, GROUPED: gl.constexpr):
    """The 64 pseudo-heads of m-block mb in ``layout`` (a [64] slice layout): (p, token, head); grouped,
    p = mb * 64 + r is head p % H of token tok0 + p // H, per token head p of token tok0."""
    p = mb * _BH + gl.arange(0, _BH, layout=layout)
    if GROUPED:
        return p, tok0 + p // H, p % H
    else:
        return p, tok0 + p * 0, p

@gluon.jit
def _resolve_item(pid, nrows_ptr, gstart_ptr, glen_ptr, route_ptr, H, K, m_blocks, group_heads, has_nrows,
                  has_route, GROUPED: gl.constexpr):
    """Work item ``pid`` (list pid // m_blocks, m-block pid % m_blocks, m-blocks of a list adjacent): (gid, mb,
    first token, rows of the list, real pseudo-heads). A group with group_len 0 or a token with route 0 gets
    0 rows and 0 heads."""
    gid = pid // m_blocks
    mb = pid % m_blocks
    tok0, n_rows, n_heads = _resolve_list(gid, nrows_ptr, gstart_ptr, glen_ptr, route_ptr, H, K, group_heads,
                                          has_nrows, has_route, GROUPED)
    return gid, mb, tok0, n_rows, n_heads

@gluon.jit
def _resolve_list(gid, nrows_ptr, gstart_ptr, glen_ptr, route_ptr, H, K, group_heads, has_nrows, has_route,
                  GROUPED: gl.constexpr):
    """List ``gid``'s (first token, rows, real pseudo-heads)."""
    if GROUPED:
        glen = gl.load(glen_ptr + gid)
        tok0 = gl.load(gstart_ptr + gid)
        n_rows = gl.where(glen > 0, gl.load(nrows_ptr + gid), 0)
        n_heads = gl.minimum(glen * H, group_heads)
    else:
        tok0 = gid
        n_rows = K
        if has_nrows:
            n_rows = gl.minimum(gl.maximum(gl.load(nrows_ptr + gid), 0), K)
        n_heads = H
        if has_route:
            if gl.load(route_ptr + gid) == 0:
                n_rows = 0
                n_heads = 0
    return tok0, n_rows, n_heads

@gluon.jit
def _resolve_work(w, nrows_ptr, gstart_ptr, glen_ptr, route_ptr, H, K, m_blocks, group_heads, has_nrows, has_route,
                  num_splits, GROUPED: gl.constexpr, KV_SPLIT: gl.constexpr):
    """Work item w: (gid, mb, first token, rows, real pseudo-heads, first column). Without KV_SPLIT,
    ``_resolve_item``'s with column 0 (``_item_outputs`` derives the split from w where the epilogue needs it).
    With KV_SPLIT, w = (list * num_splits + split) * m_blocks + mb (a
    list's splits and m-blocks adjacent: they share its rows in L2); the split takes the list's columns
    [col0, col0 + rows), col0 = split * chunk, chunk = the list's rows / num_splits rounded up to a pair of tiles
    (0 rows past the list's end: the item writes an empty partial)."""
    if KV_SPLIT:
        q1 = w // m_blocks
        mb = w - q1 * m_blocks
        gid = q1 // num_splits
        sid = q1 - gid * num_splits
        tok0, n_rows, n_heads = _resolve_list(gid, nrows_ptr, gstart_ptr, glen_ptr, route_ptr, H, K, group_heads,
                                              has_nrows, has_route, GROUPED)
        chunk = gl.cdiv(gl.cdiv(n_rows, num_splits), 2 * _BN) * (2 * _BN)
        col0 = sid * chunk
        n_rows = gl.minimum(gl.maximum(n_rows - col0, 0), chunk)
    else:
        gid, mb, tok0, n_rows, n_heads = _resolve_item(w, nrows_ptr, gstart_ptr, glen_ptr, route_ptr, H, K, m_blocks,
                                                       group_heads, has_nrows, has_route, GROUPED)
        col0 = 0
    return gid, mb, tok0, n_rows, n_heads, col0

@gluon.jit
def _item_rows(rows_ptr, col0, KV_SPLIT: gl.constexpr):
    """A list pointer (rows or membership words) at an item's first column: its split's (KV_SPLIT) or the list's."""
    if KV_SPLIT:
        return rows_ptr + col0
    else:
        return rows_ptr

@gluon.jit
def _item_outputs(out_ptr, lse_ptr, maxl_ptr, w, m_blocks, num_splits, H, KV_SPLIT: gl.constexpr):
    """The out / lse / max_logits pointers of work item w: its split's slices of the contiguous partials (KV_SPLIT:
    out [T, S, H, 512], lse / max_logits [T, S, H], ``sparse_mla.mqa.split_combine``; split and strides recomputed
    here from w and H, so that no value of them is held through the tile loops) or the call's outputs."""
    if KV_SPLIT:
        sid = (w // m_blocks) % num_splits
        return out_ptr + sid * H * _DV, lse_ptr + sid * H, maxl_ptr + sid * H
    else:
        return out_ptr, lse_ptr, maxl_ptr

@gluon.jit
def _issue_q(q_ptr, q_v, q_r, stride_qt, stride_qh, mb, tok0, H, n_heads, GROUPED: gl.constexpr,
             HAS_PE: gl.constexpr):
    """The Q tile [64, D_qk] of an item as cp.async copies into shared memory (pseudo-head rows gathered, rows past
    the real ones zero-filled), issued by the producer of a persistent CTA (the caller arrives on a barrier)."""
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    p_q, q_tok, q_head = _pseudo_heads(mb, tok0, H, gl.SliceLayout(1, blk), GROUPED)
    q_ok = p_q < n_heads
    q_row = q_ptr + q_tok.to(gl.int64) * stride_qt + gl.where(q_ok, q_head, 0).to(gl.int64) * stride_qh
    cv = gl.arange(0, _DV, layout=gl.SliceLayout(0, blk))
    async_copy.async_copy_global_to_shared(q_v, q_row[:, None] + cv[None, :], mask=q_ok[:, None])
    if HAS_PE:
        cr = gl.arange(0, _DPE, layout=gl.SliceLayout(0, blk))
        async_copy.async_copy_global_to_shared(q_r, q_row[:, None] + _DV + cr[None, :], mask=q_ok[:, None])


@gluon.jit
def _epilogue_stats(l_i, m_i, hh, row_ok, tok, lse_ptr, stride_lt, has_lse, sink_ptr, maxl_ptr, stride_mt,
                    has_sink, has_maxl, WRITE: gl.constexpr = True):
    """The denominator of out per row (l, plus exp(attn_sink[h]) in the row's scale when given; 1 for a row
    with no valid key, whose O is 0), and with WRITE the lse / max_logits stores (natural log; -inf for a
    row with no valid key; the sink is in neither). m_i is the final row max in base-2 units."""
    has_any = l_i > 0.0
    denom = gl.where(has_any, l_i, 1.0)
    m_use = gl.where(has_any, m_i, 0.0)
    if has_sink:  # -inf adds 0; +inf makes the denominator inf (out 0)
        sink = gl.load(sink_ptr + hh, mask=row_ok, other=float("-inf"))
        denom = denom + gl.where(has_any, gl.exp2(sink * 1.4426950408889634 - m_use), 0.0)
    if WRITE:
        if has_lse:
            lse = gl.where(has_any, (m_use + gl.log2(gl.where(has_any, l_i, 1.0))) * _LN2, float("-inf"))
            gl.store(lse_ptr + tok.to(gl.int64) * stride_lt + hh, lse, mask=row_ok)
        if has_maxl:
            gl.store(maxl_ptr + tok.to(gl.int64) * stride_mt + hh, gl.where(has_any, m_use * _LN2, float("-inf")),
                     mask=row_ok)
    return denom

