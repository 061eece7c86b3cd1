"""The "pair" schedule (FlashMLA's SM90 design, read, not copied): a kv tile per consumer warpgroup."""

from __future__ import annotations

from .common import (  # noqa: F401
    _BH,
    _BN,
    _DPE,
    _DV,
    _FP8_ROPE,
    _FP8_SCALES,
    _FP8_TILE,
    _LN2,
    _epilogue_stats,
    _issue_q,
    _item_outputs,
    _item_rows,
    _kv_policy,
    _pseudo_heads,
    _resolve_work,
    _tile_rows,
)
from .gluon_api import async_copy, fence_async_shared, gl, gluon, mbarrier, warpgroup_mma, warpgroup_mma_wait  # noqa: F401
from .signature import DO_NOT_SPECIALIZE

# ------------------------------------------------------------------ "pair" schedule (FlashMLA's SM90 split)
# Two 4-warp consumer partitions, each computing the full S of its own kv tile (warpgroup 0: even tiles in
# stage 0, warpgroup 1: odd tiles in stage 1; N = 64 wgmma) and owning half of O's value columns
# (wg 0: 0..255, wg 1: 256..511). Per pair of tiles: wg 0 publishes its running max m0, wg 1 takes
# m1 = max(m0, its row max) and publishes it; each multiplies its own P (registers) by its V half, then the
# other's P (shared memory, at the common max m1) by its V half. The tensor core alternates between the
# warpgroups: wg 0's softmax overlaps wg 1's Q.K^T, wg 1's softmax overlaps wg 0's first P.V.
_NEG: gl.constexpr = gl.constexpr(-1.0e30)  # finite "no row yet" max: no inf - inf, no 0 * inf

@gluon.jit
def _tile_cols(rows_ptr, bits_ptr, row_stride, N, gid, n_rows, j, s_l: gl.constexpr, GROUPED: gl.constexpr):
    """Per kv column of tile j: the membership word (grouped), or per token the additive mask, 0.0 for a valid
    row and -inf for a padded / out-of-range one. ``_scaled_logits`` applies it after the Q.K^T. Where it is loaded
    (results/gluon-v14-ab1.json, same run): per token before the tile's barrier waits (537 vs 525 TFLOP/s at 64
    heads, 554 vs 545 at 128), grouped once the tile's Q.K^T is issued (1.49 vs 1.54-1.61 ms at 16 heads; loaded
    before a wait, the fence after the wait, a MEMBAR, waits for the load). An item's first tile loads them after
    its Q.K^T issue in both modes (once per item)."""
    pos = j * _BN + gl.arange(0, _BN, layout=gl.SliceLayout(0, s_l))
    in_list = pos < n_rows
    if GROUPED:
        return gl.load(bits_ptr + gid.to(gl.int64) * row_stride + pos, mask=in_list, other=0)
    else:
        idx = gl.load(rows_ptr + gid.to(gl.int64) * row_stride + pos, mask=in_list, other=-1)
        return gl.where((idx >= 0) & (idx < N), 0.0, float("-inf"))

@gluon.jit
def _no_cols(s_l: gl.constexpr, GROUPED: gl.constexpr):
    """A placeholder of ``_tile_cols``'s type (an item with no tile never reads it)."""
    if GROUPED:
        return gl.zeros([_BN], gl.int32, layout=gl.SliceLayout(0, s_l))
    else:
        return gl.zeros([_BN], gl.float32, layout=gl.SliceLayout(0, s_l))

@gluon.jit
def _scaled_logits(s, cols, row_bit, qk_scale, GROUPED: gl.constexpr):
    """[64, 64] logits in base-2 units, -inf where a (pseudo-head, kv row) pair does not count. Grouped: the
    column's membership word has the row's query bit (row_bit = 1 << its query in the group, 0 past the real
    pseudo-heads). Per token: the column's additive mask, one FFMA per logit (a row past the real heads holds a
    zero-filled Q row: finite logits, never stored)."""
    if GROUPED:
        return gl.where((cols[None, :] & row_bit[:, None]) != 0, s * qk_scale, float("-inf"))
    else:
        return s * qk_scale + cols[None, :]

@gluon.jit
def _to_operand(p, dt: gl.constexpr):
    """fp32 P -> bf16 / fp16 with one packed, round-to-nearest cvt per two values (Triton 3.6 emits a scalar cvt,
    a quarter-rate F2F, per value here); the same bits as ``p.to(dt)``."""
    if dt == gl.bfloat16:
        return gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [p], dtype=gl.bfloat16,
                                         is_pure=True, pack=2)
    else:
        return gl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [p], dtype=gl.float16,
                                         is_pure=True, pack=2)

# Half stages: a tile's columns 0..255 ("L") and 256..511 + RoPE ("R") live in separate buffers with their own
# ready / empty barriers, so the producer refills a half as soon as its last reader is done with it:
# L0 (even tile's V[:, 0:256]) after wg 0's own P.V, R0 after wg 1's P0.V0 (P0 lives in R0's RoPE part),
# R1 after wg 1's own P.V, L1 after wg 0's P1.V1. Barrier array ``hb``: ready L0, L1, R0, R1, then empty
# L0, L1, R0, R1. Warpgroup 0 issues the next even tile's Q.K^T (L half first) before waiting on P1.V1.
# Persistent like the split kernel: one CTA per SM loops over the work items; barrier phases follow the CTA's
# running pair count k (tiles 2k, 2k + 1 of its stream), so items of any length follow each other.
# Stage and Q buffers are indexed by an opaque 0 / 1 (z = (k + N < 0), never true), which keeps their wgmma
# descriptors inside the loop: hoisted out of it they are ~40 live 64-bit values, and spilled (592 B).
@gluon.jit
def _pair_qk_half(q_v, ring, q_off: gl.constexpr, st, z, s, use_acc: gl.constexpr):
    """s (+)= Q[:, q_off:q_off + 256] . ring[st]^T (async, one wgmma group); Q is [1, 64, 512], indexed by z."""
    return warpgroup_mma(q_v.index(z).slice(q_off, 256, dim=1), ring.index(st).permute((1, 0)), s,
                         use_acc=use_acc, is_async=True)

@gluon.jit
def _pair_qk_rope(q_r, ring_r, st, z, s):
    return warpgroup_mma(q_r.index(z), ring_r.index(st).permute((1, 0)), s, is_async=True)

@gluon.jit
def _pair_gather(kv_ptr, rows_ptr, row_stride, stride_kvn, N, gid, n_rows, i, k, ring_l, ring_h, ring_r, hb,
                 HAS_PE: gl.constexpr, KV_EVICT: gl.constexpr):
    """Tiles 2i, 2i + 1 of list ``gid`` (the CTA's pair k) as half tiles, in the order the consumers free them:
    L0, R1, R0, L1. KV_EVICT: nonzero marks the copies for the L2 hint (``common._kv_policy``, ``l2_hints``)."""
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    ch = gl.arange(0, 256, layout=gl.SliceLayout(0, blk))
    cr = gl.arange(0, _DPE, layout=gl.SliceLayout(0, blk))
    ph = (k & 1) ^ 1  # a fresh barrier passes parity 1
    idx0 = _tile_rows(rows_ptr, row_stride, gid, n_rows, 2 * i, gl.SliceLayout(1, blk))
    idx1 = _tile_rows(rows_ptr, row_stride, gid, n_rows, 2 * i + 1, gl.SliceLayout(1, blk))
    ok0 = (idx0 >= 0) & (idx0 < N)
    ok1 = (idx1 >= 0) & (idx1 < N)
    base0 = kv_ptr + gl.where(ok0, idx0, 0).to(gl.int64)[:, None] * stride_kvn
    base1 = kv_ptr + gl.where(ok1, idx1, 0).to(gl.int64)[:, None] * stride_kvn
    mbarrier.wait(hb.index(4), ph)  # L0 free
    async_copy.async_copy_global_to_shared(ring_l.index(0), base0 + ch[None, :], mask=ok0[:, None],
                                           eviction_policy=_kv_policy(KV_EVICT))
    async_copy.mbarrier_arrive(hb.index(0), increment_count=False)
    mbarrier.wait(hb.index(7), ph)  # R1 free
    async_copy.async_copy_global_to_shared(ring_h.index(1), base1 + 256 + ch[None, :], mask=ok1[:, None],
                                           eviction_policy=_kv_policy(KV_EVICT))
    if HAS_PE:
        async_copy.async_copy_global_to_shared(ring_r.index(1), base1 + _DV + cr[None, :], mask=ok1[:, None],
                                               eviction_policy=_kv_policy(KV_EVICT))
    async_copy.mbarrier_arrive(hb.index(3), increment_count=False)
    mbarrier.wait(hb.index(6), ph)  # R0 free
    async_copy.async_copy_global_to_shared(ring_h.index(0), base0 + 256 + ch[None, :], mask=ok0[:, None],
                                           eviction_policy=_kv_policy(KV_EVICT))
    if HAS_PE:
        async_copy.async_copy_global_to_shared(ring_r.index(0), base0 + _DV + cr[None, :], mask=ok0[:, None],
                                               eviction_policy=_kv_policy(KV_EVICT))
    async_copy.mbarrier_arrive(hb.index(2), increment_count=False)
    mbarrier.wait(hb.index(5), ph)  # L1 free
    async_copy.async_copy_global_to_shared(ring_l.index(1), base1 + ch[None, :], mask=ok1[:, None],
                                           eviction_policy=_kv_policy(KV_EVICT))
    async_copy.mbarrier_arrive(hb.index(1), increment_count=False)

@gluon.jit
def _pair_producer(q_ptr, kv_ptr, rows_ptr, nrows_ptr, gstart_ptr, glen_ptr, route_ptr, stride_qt, stride_qh,
                   stride_kvn, row_stride, N, H, K, m_blocks, group_heads, has_nrows, has_route, num_work, q_v, q_r,
                   ring_l, ring_h, ring_r, hb, q_bars, num_splits, GROUPED: gl.constexpr, HAS_PE: gl.constexpr,
                   KV_SPLIT: gl.constexpr, KV_EVICT: gl.constexpr):
    """Persistent producer: per work item, its first pair of tiles (they may land while the consumers finish
    the previous item), then Q (once both consumers freed it: q_bars[1]; landed: q_bars[0]), then the rest."""
    k = 0
    it = 0  # the items this CTA has run (items with no real pseudo-head are skipped by every partition)
    for w in range(gl.program_id(0), num_work, gl.num_programs(0)):
        gid, mb, tok0, n_rows, n_heads, col0 = _resolve_work(w, nrows_ptr, gstart_ptr, glen_ptr, route_ptr, H, K,
                                                                  m_blocks, group_heads, has_nrows, has_route,
                                                                  num_splits, GROUPED, KV_SPLIT)
        rows_w = _item_rows(rows_ptr, col0, KV_SPLIT)
        if mb * _BH < n_heads:
            n_pairs = gl.cdiv(n_rows, 2 * _BN)
            if n_pairs > 0:
                _pair_gather(kv_ptr, rows_w, row_stride, stride_kvn, N, gid, n_rows, 0, k, ring_l, ring_h, ring_r,
                             hb, HAS_PE, KV_EVICT)
            mbarrier.wait(q_bars.index(1), (it & 1) ^ 1)  # Q buffer free (a fresh barrier passes parity 1)
            _issue_q(q_ptr, q_v.index(0), q_r.index(0), stride_qt, stride_qh, mb, tok0, H, n_heads, GROUPED, HAS_PE)
            async_copy.mbarrier_arrive(q_bars.index(0), increment_count=False)
            for i in range(1, n_pairs):
                _pair_gather(kv_ptr, rows_w, row_stride, stride_kvn, N, gid, n_rows, i, k + i, ring_l, ring_h,
                             ring_r, hb, HAS_PE, KV_EVICT)
            k += n_pairs
            it += 1

@gluon.jit
def _pair_epilogue(o, l_own, m_i, l_mine, l_other, bars, it, q_v, q_bars, out_ptr, lse_ptr, mb, tok0, H, n_heads,
                   stride_ot, stride_oh, stride_lt, has_lse, sink_ptr, maxl_ptr, stride_mt, has_sink, has_maxl,
                   w, m_blocks, num_splits, WG: gl.constexpr, GROUPED: gl.constexpr,
                   O_VIA_SMEM: gl.constexpr, KV_SPLIT: gl.constexpr):
    """Exchange the partial row sums (bars[5 + WG]: this warpgroup's are in l_mine), normalise its 256 columns of
    O, store them (warpgroup 0 also lse), then free Q. l_mine is rewritten only after the other warpgroup read
    it: the next item starts with its Q, which the producer loads after both warpgroups freed this one's. A split item
    (KV_SPLIT) stores its partials (offsets taken here, not held through the tile loop)."""
    out_ptr, lse_ptr, maxl_ptr = _item_outputs(out_ptr, lse_ptr, maxl_ptr, w, m_blocks, num_splits, H,
                                               KV_SPLIT)
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    rows_o: gl.constexpr = gl.SliceLayout(1, o_l)
    l_mine.store(l_own)
    _pair_release(bars.index(5 + WG))
    mbarrier.wait(bars.index(6 - WG), it & 1)
    l_i = gl.convert_layout(l_own, rows_o) + l_other.load(rows_o)
    p_o, tok, hh = _pseudo_heads(mb, tok0, H, rows_o, GROUPED)
    row_ok = p_o < n_heads
    m_o = gl.convert_layout(m_i, rows_o)
    denom = _epilogue_stats(l_i, m_o, hh, row_ok, tok, lse_ptr, stride_lt, has_lse, sink_ptr, maxl_ptr, stride_mt,
                            has_sink, has_maxl, WG == 0)
    o = o / denom[:, None]
    dt: gl.constexpr = out_ptr.dtype.element_ty
    if O_VIA_SMEM:
        # Through this warpgroup's half of the Q buffer (every Q.K^T of the item has completed: each
        # warpgroup's last step waited on the other's last P), read back row-contiguous: 16-byte stores,
        # 512-byte row pieces.
        dst = q_v.index(0).slice(WG * 256, 256, dim=1)
        dst.store(o.to(dt))
        gl.thread_barrier()
        st_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
        ob = dst.load(st_l)
        p_b, tok_b, hh_b = _pseudo_heads(mb, tok0, H, gl.SliceLayout(1, st_l), GROUPED)
        cols_b = gl.arange(0, 256, layout=gl.SliceLayout(0, st_l))
        o_row = out_ptr + tok_b.to(gl.int64) * stride_ot + hh_b.to(gl.int64) * stride_oh + WG * 256
        gl.store(o_row[:, None] + cols_b[None, :], ob, mask=(p_b < n_heads)[:, None])
    else:
        cols = gl.arange(0, 256, layout=gl.SliceLayout(0, o_l))
        o_row = out_ptr + tok.to(gl.int64) * stride_ot + hh.to(gl.int64) * stride_oh + WG * 256
        gl.store(o_row[:, None] + cols[None, :], o.to(dt), mask=row_ok[:, None])
    _pair_release(q_bars.index(1))  # this warpgroup is done with Q (and the O staged through it)

@gluon.jit
def _pair_release(bar):
    """Every warp of the warpgroup is past its reads (waited wgmma / stored smem) -> one arrive."""
    gl.thread_barrier()
    mbarrier.arrive(bar, count=1)

@gluon.jit
def _pair_wg0_step(s, cols, o, m_i, l_i, i, k, q_v, q_r, ring_l, ring_h, ring_r, s_p0, s_p1, s_m0, s_m1, hb, bars,
                   rows_ptr, bits_ptr, row_stride, N, gid, n_rows, row_bit, qk_scale, GROUPED: gl.constexpr,
                   HAS_PE: gl.constexpr, NEXT: gl.constexpr):
    """Warpgroup 0, pair i of the item (the CTA's pair k): S of tile 2i is in ``s`` (computed), its column
    words in ``cols``. With NEXT, the Q.K^T of tile 2i + 2 is issued (L half) before the wait on P1.V1, so the
    two overlap, and returned computed with that tile's column words (_tile_cols says when they are loaded)."""
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_l)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_l)
    dt: gl.constexpr = ring_l.dtype
    z = ((k + N) < 0).to(gl.int32)  # an opaque 0 (module comment; k + N < 2**31: pairs and kv rows are int32 counts)
    st0 = z
    st1 = 1 - z
    s = _scaled_logits(s, cols, row_bit, qk_scale, GROUPED)
    m0 = gl.maximum(m_i, gl.max(s, axis=1))
    s_m0.store(m0)
    _pair_release(bars.index(0))  # m0 ready
    p = gl.exp2(s - m0[:, None])
    alpha = gl.exp2(m_i - m0)
    o = o * gl.convert_layout(alpha, rows_o)[:, None]
    l_i = l_i * alpha + gl.sum(p, axis=1)
    pb = _to_operand(p, dt)  # only the rounded P stays live (registers are the limit of this schedule)
    a_op = gl.convert_layout(pb, p_l)
    o = warpgroup_mma(a_op, ring_l.index(st0), o, is_async=True)
    o, a_op = warpgroup_mma_wait(num_outstanding=0, deps=(o, a_op))
    _pair_release(hb.index(4))  # L0 free
    mbarrier.wait(bars.index(1), k & 1)  # m1 ready
    m1 = s_m1.load(rows_s)
    beta = gl.exp2(m0 - m1)
    s_p0.store((pb.to(gl.float32) * beta[:, None]).to(dt))  # P0 at the common max m1, for warpgroup 1
    fence_async_shared()
    _pair_release(bars.index(2))  # P0 ready
    o = o * gl.convert_layout(beta, rows_o)[:, None]
    l_i = l_i * beta
    mbarrier.wait(bars.index(3), k & 1)  # P1 ready
    o = warpgroup_mma(s_p1, ring_l.index(st1), o, is_async=True)
    if NEXT:
        if not GROUPED:
            cols = _tile_cols(rows_ptr, bits_ptr, row_stride, N, gid, n_rows, 2 * i + 2, s_l, GROUPED)
        mbarrier.wait(hb.index(0), (k + 1) & 1)  # L0 of tile 2i + 2 landed
        fence_async_shared()
        s = _pair_qk_half(q_v, ring_l, 0, st0, z, s, False)  # the dead S as accumulator: no zeros kept live
        o = warpgroup_mma_wait(num_outstanding=1, deps=(o, ))  # P1.V1 done, Q.K^T (L) in flight
        _pair_release(bars.index(4))  # P1 buffer free
        mbarrier.arrive(hb.index(5), count=1)  # L1 free
        mbarrier.wait(hb.index(2), (k + 1) & 1)  # R0 of tile 2i + 2 landed
        fence_async_shared()
        s = _pair_qk_half(q_v, ring_h, 256, st0, z, s, True)
        if HAS_PE:
            s = _pair_qk_rope(q_r, ring_r, st0, z, s)
        if GROUPED:
            cols = _tile_cols(rows_ptr, bits_ptr, row_stride, N, gid, n_rows, 2 * i + 2, s_l, GROUPED)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    else:
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o, ))
        _pair_release(bars.index(4))  # P1 buffer free
        mbarrier.arrive(hb.index(5), count=1)  # L1 free
    return s, cols, o, m1, l_i

@gluon.jit
def _pair_item(mb, n_rows, n_heads, H):
    """A consumer warpgroup's start of a work item (m-block mb, n_rows kv rows, n_heads real pseudo-heads): (pairs
    of tiles, each S row's query bit (1 << its query in the group, 0 past the real pseudo-heads), and fresh m, l, O, S)."""
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    rows_s: gl.constexpr = gl.SliceLayout(1, s_l)
    n_pairs = gl.cdiv(n_rows, 2 * _BN)
    p_s = mb * _BH + gl.arange(0, _BH, layout=rows_s)
    row_bit = gl.where(p_s < n_heads, 1 << (p_s // H), 0)
    m_i = gl.full([_BH], _NEG, gl.float32, layout=rows_s)
    l_i = gl.zeros([_BH], gl.float32, layout=rows_s)
    o = gl.zeros([_BH, 256], gl.float32, layout=o_l)
    s = gl.zeros([_BH, _BN], gl.float32, layout=s_l)
    return n_pairs, row_bit, m_i, l_i, o, s

@gluon.jit
def _pair_wg0(q_v, q_r, ring_l, ring_h, ring_r, s_p0, s_p1, s_m0, s_m1, s_l0, s_l1, hb, bars, q_bars, rows_ptr, bits_ptr,
              nrows_ptr, gstart_ptr, glen_ptr, route_ptr, row_stride, N, H, K, m_blocks, group_heads, has_nrows,
              has_route, num_work, out_ptr, lse_ptr, stride_ot, stride_oh, stride_lt, qk_scale, has_lse, sink_ptr,
              maxl_ptr, stride_mt, has_sink, has_maxl, num_splits,
              GROUPED: gl.constexpr, HAS_PE: gl.constexpr, O_VIA_SMEM: gl.constexpr, KV_SPLIT: gl.constexpr):
    """Warpgroup 0: S of the even tiles (stage 0), O[:, 0:256]; per work item of this CTA."""
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    k = 0
    it = 0  # the items this CTA has run (items with no real pseudo-head are skipped by every partition)
    for w in range(gl.program_id(0), num_work, gl.num_programs(0)):
        gid, mb, tok0, n_rows, n_heads, col0 = _resolve_work(w, nrows_ptr, gstart_ptr, glen_ptr, route_ptr, H, K,
                                                                  m_blocks, group_heads, has_nrows, has_route,
                                                                  num_splits, GROUPED, KV_SPLIT)
        rows_w = _item_rows(rows_ptr, col0, KV_SPLIT)
        bits_w = _item_rows(bits_ptr, col0, KV_SPLIT)
        if mb * _BH < n_heads:
            n_pairs, row_bit, m_i, l_i, o, s = _pair_item(mb, n_rows, n_heads, H)
            cols = _no_cols(s_l, GROUPED)
            mbarrier.wait(q_bars.index(0), it & 1)  # Q landed
            fence_async_shared()
            if n_pairs > 0:
                z = ((k + N) < 0).to(gl.int32)
                mbarrier.wait(hb.index(0), k & 1)  # L0 of tile 0
                fence_async_shared()
                s = _pair_qk_half(q_v, ring_l, 0, z, z, s, False)
                mbarrier.wait(hb.index(2), k & 1)  # R0 of tile 0
                fence_async_shared()
                s = _pair_qk_half(q_v, ring_h, 256, z, z, s, True)
                if HAS_PE:
                    s = _pair_qk_rope(q_r, ring_r, z, z, s)
                cols = _tile_cols(rows_w, bits_w, row_stride, N, gid, n_rows, 0, s_l, GROUPED)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
            for i in range(n_pairs - 1):
                s, cols, o, m_i, l_i = _pair_wg0_step(s, cols, o, m_i, l_i, i, k + i, q_v, q_r, ring_l, ring_h,
                                                      ring_r, s_p0, s_p1, s_m0, s_m1, hb, bars, rows_w, bits_w,
                                                      row_stride, N, gid, n_rows, row_bit, qk_scale, GROUPED, HAS_PE, True)
            if n_pairs > 0:
                s, cols, o, m_i, l_i = _pair_wg0_step(s, cols, o, m_i, l_i, n_pairs - 1, k + n_pairs - 1, q_v, q_r,
                                                      ring_l, ring_h, ring_r, s_p0, s_p1, s_m0, s_m1, hb, bars,
                                                      rows_w, bits_w, row_stride, N, gid, n_rows, row_bit, qk_scale,
                                                      GROUPED, HAS_PE, False)
            _pair_epilogue(o, l_i, m_i, s_l0, s_l1, bars, it, q_v, q_bars, out_ptr, lse_ptr, mb, tok0, H,
                           n_heads, stride_ot, stride_oh, stride_lt, has_lse, sink_ptr, maxl_ptr, stride_mt, has_sink,
                           has_maxl, w, m_blocks, num_splits, 0, GROUPED, O_VIA_SMEM, KV_SPLIT)
            k += n_pairs
            it += 1

@gluon.jit
def _pair_wg1(q_v, q_r, ring_l, ring_h, ring_r, s_p0, s_p1, s_m0, s_m1, s_l0, s_l1, hb, bars, q_bars, rows_ptr, bits_ptr,
              nrows_ptr, gstart_ptr, glen_ptr, route_ptr, row_stride, N, H, K, m_blocks, group_heads, has_nrows,
              has_route, num_work, out_ptr, lse_ptr, stride_ot, stride_oh, stride_lt, qk_scale, has_lse, sink_ptr,
              maxl_ptr, stride_mt, has_sink, has_maxl, num_splits,
              GROUPED: gl.constexpr, HAS_PE: gl.constexpr, O_VIA_SMEM: gl.constexpr, KV_SPLIT: gl.constexpr):
    """Warpgroup 1: S of the odd tiles (stage 1, R half first: it is refilled first), O[:, 256:512]."""
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_l)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_l)
    dt: gl.constexpr = ring_l.dtype
    k = 0
    it = 0  # the items this CTA has run (items with no real pseudo-head are skipped by every partition)
    for w in range(gl.program_id(0), num_work, gl.num_programs(0)):
        gid, mb, tok0, n_rows, n_heads, col0 = _resolve_work(w, nrows_ptr, gstart_ptr, glen_ptr, route_ptr, H, K,
                                                                  m_blocks, group_heads, has_nrows, has_route,
                                                                  num_splits, GROUPED, KV_SPLIT)
        rows_w = _item_rows(rows_ptr, col0, KV_SPLIT)
        bits_w = _item_rows(bits_ptr, col0, KV_SPLIT)
        if mb * _BH < n_heads:
            n_pairs, row_bit, m_i, l_i, o, s = _pair_item(mb, n_rows, n_heads, H)
            mbarrier.wait(q_bars.index(0), it & 1)  # Q landed
            fence_async_shared()
            for i in range(n_pairs):
                kk = k + i
                z = ((kk + N) < 0).to(gl.int32)  # an opaque 0 (module comment)
                st0 = z
                st1 = 1 - z
                if not GROUPED:
                    cols = _tile_cols(rows_w, bits_w, row_stride, N, gid, n_rows, 2 * i + 1, s_l, GROUPED)
                mbarrier.wait(hb.index(3), kk & 1)  # R1 landed
                fence_async_shared()
                s = _pair_qk_half(q_v, ring_h, 256, st1, z, s, False)  # the dead S as accumulator: no zeros live
                if HAS_PE:
                    s = _pair_qk_rope(q_r, ring_r, st1, z, s)
                mbarrier.wait(hb.index(1), kk & 1)  # L1 landed
                fence_async_shared()
                s = _pair_qk_half(q_v, ring_l, 0, st1, z, s, True)
                if GROUPED:
                    cols = _tile_cols(rows_w, bits_w, row_stride, N, gid, n_rows, 2 * i + 1, s_l, GROUPED)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
                s = _scaled_logits(s, cols, row_bit, qk_scale, GROUPED)
                mbarrier.wait(bars.index(0), kk & 1)  # m0 ready
                m1 = gl.maximum(s_m0.load(rows_s), gl.max(s, axis=1))
                s_m1.store(m1)
                _pair_release(bars.index(1))  # m1 ready
                p = gl.exp2(s - m1[:, None])
                alpha = gl.exp2(m_i - m1)
                m_i = m1
                o = o * gl.convert_layout(alpha, rows_o)[:, None]
                pb = _to_operand(p, dt)
                a_op = gl.convert_layout(pb, p_l)
                o = warpgroup_mma(a_op, ring_h.index(st1), o, is_async=True)
                l_i = l_i * alpha + gl.sum(p, axis=1)
                mbarrier.wait(bars.index(4), (kk & 1) ^ 1)  # P1 buffer free (passes at once the first time)
                s_p1.store(pb)
                fence_async_shared()
                mbarrier.wait(bars.index(2), kk & 1)  # P0 ready
                o = warpgroup_mma(s_p0, ring_h.index(st0), o, is_async=True)
                _pair_release(bars.index(3))  # P1 ready
                o, a_op = warpgroup_mma_wait(num_outstanding=1, deps=(o, a_op))  # own P.V done
                _pair_release(hb.index(7))  # R1 free
                o = warpgroup_mma_wait(num_outstanding=0, deps=(o, ))
                _pair_release(hb.index(6))  # R0 free (V0[:, 256:512] and P0 read)
            _pair_epilogue(o, l_i, m_i, s_l1, s_l0, bars, it, q_v, q_bars, out_ptr, lse_ptr, mb, tok0, H,
                           n_heads, stride_ot, stride_oh, stride_lt, has_lse, sink_ptr, maxl_ptr, stride_mt, has_sink,
                           has_maxl, w, m_blocks, num_splits, 1, GROUPED, O_VIA_SMEM, KV_SPLIT)
            k += n_pairs
            it += 1

@gluon.jit(do_not_specialize=DO_NOT_SPECIALIZE)
def sparse_mqa_sm90_pair_kernel(
    q_ptr, kv_ptr, rows_ptr, bits_ptr, nrows_ptr, gstart_ptr, glen_ptr, route_ptr, out_ptr, lse_ptr,
    stride_qt, stride_qh, stride_kvn, row_stride, stride_ot, stride_oh, stride_lt,
    N, H, K, qk_scale, m_blocks, group_heads, has_nrows, has_route, has_lse,
    sink_ptr, maxl_ptr, stride_mt, has_sink, has_maxl, num_work, num_splits,
    GROUPED: gl.constexpr, HAS_PE: gl.constexpr, CONSUMER_REGS: gl.constexpr, O_VIA_SMEM: gl.constexpr,
    KV_SPLIT: gl.constexpr, KV_EVICT: gl.constexpr, num_warps: gl.constexpr,
):
    """The pair schedule (module comment above); same arguments and grid as ``sparse_mqa_sm90_kernel``."""
    smem_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    vec_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    dt: gl.constexpr = q_ptr.dtype.element_ty
    q_v = gl.allocate_shared_memory(dt, [1, _BH, _DV], smem_l)
    ring_l = gl.allocate_shared_memory(dt, [2, _BN, 256], smem_l)
    ring_h = gl.allocate_shared_memory(dt, [2, _BN, 256], smem_l)
    s_p1 = gl.allocate_shared_memory(dt, [_BH, _BN], smem_l)
    if HAS_PE:
        q_r = gl.allocate_shared_memory(dt, [1, _BH, _DPE], smem_l)
        ring_r = gl.allocate_shared_memory(dt, [2, _BN, _DPE], smem_l)
        s_p0 = ring_r.index(0)  # the even tile's RoPE part is dead once its S is computed
    else:  # placeholders, never read
        q_r = q_v
        ring_r = ring_l
        s_p0 = gl.allocate_shared_memory(dt, [_BH, _BN], smem_l)
    # the [64] row vectors are stored and loaded in their own row-slice layout (no convert_layout: its round trip
    # through scratch memory costs two barriers; the lanes that hold a row store the same value)
    s_m0 = gl.allocate_shared_memory(gl.float32, [_BH], vec_l)
    s_m1 = gl.allocate_shared_memory(gl.float32, [_BH], vec_l)
    s_l0 = gl.allocate_shared_memory(gl.float32, [_BH], vec_l)
    s_l1 = gl.allocate_shared_memory(gl.float32, [_BH], vec_l)
    hb = gl.allocate_shared_memory(gl.int64, [8, 1], mbarrier.MBarrierLayout())
    bars = gl.allocate_shared_memory(gl.int64, [8, 1], mbarrier.MBarrierLayout())  # power-of-two shape
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # Q landed, Q free
    for i in gl.static_range(4):
        mbarrier.init(hb.index(i), count=num_warps * 32)  # ready: every producer thread arrives
        mbarrier.init(hb.index(4 + i), count=1)  # empty: the half's last reader arrives once
    for i in gl.static_range(7):  # m0, m1, P0 ready, P1 ready, P1 free, l0, l1: one arrive each
        mbarrier.init(bars.index(i), count=1)
    mbarrier.init(q_bars.index(0), count=num_warps * 32)
    mbarrier.init(q_bars.index(1), count=2)  # both consumer warpgroups

    # The default partition (num_warps = 4) is the producer and gets the registers the consumers leave
    # (triton 3.6 fails to lower the consumer's wgmma code in the default partition of this kernel). The
    # argument tuples are written out here: a tuple held in a variable turns its constexprs into tensors.
    gl.warp_specialize([
        (_pair_producer, (q_ptr, kv_ptr, rows_ptr, nrows_ptr, gstart_ptr, glen_ptr, route_ptr, stride_qt,
                          stride_qh, stride_kvn, row_stride, N, H, K, m_blocks, group_heads, has_nrows, has_route,
                          num_work, q_v, q_r, ring_l, ring_h, ring_r, hb, q_bars, num_splits, GROUPED, HAS_PE,
                          KV_SPLIT, KV_EVICT)),
        (_pair_wg0, (q_v, q_r, ring_l, ring_h, ring_r, s_p0, s_p1, s_m0, s_m1, s_l0, s_l1, hb, bars, q_bars, rows_ptr,
                     bits_ptr, nrows_ptr, gstart_ptr, glen_ptr, route_ptr, row_stride, N, H, K, m_blocks,
                     group_heads, has_nrows, has_route, num_work, out_ptr, lse_ptr, stride_ot, stride_oh,
                     stride_lt, qk_scale, has_lse, sink_ptr, maxl_ptr, stride_mt, has_sink, has_maxl, num_splits,
                     GROUPED, HAS_PE, O_VIA_SMEM, KV_SPLIT)),
        (_pair_wg1, (q_v, q_r, ring_l, ring_h, ring_r, s_p0, s_p1, s_m0, s_m1, s_l0, s_l1, hb, bars, q_bars, rows_ptr,
                     bits_ptr, nrows_ptr, gstart_ptr, glen_ptr, route_ptr, row_stride, N, H, K, m_blocks,
                     group_heads, has_nrows, has_route, num_work, out_ptr, lse_ptr, stride_ot, stride_oh,
                     stride_lt, qk_scale, has_lse, sink_ptr, maxl_ptr, stride_mt, has_sink, has_maxl, num_splits,
                     GROUPED, HAS_PE, O_VIA_SMEM, KV_SPLIT)),
    ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])
