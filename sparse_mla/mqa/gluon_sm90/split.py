"""The "split" schedule: both consumer warpgroups on one tile (S split by kv columns); the FP8 producer."""

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


@gluon.jit
def _gather_tile(kv_ptr, rows_ptr, row_stride, stride_kvn, N, gid, n_rows, j, c, ring_v, ring_r, ready, empty,
                 HAS_PE: gl.constexpr, STAGES: gl.constexpr, KV_EVICT: gl.constexpr):
    """Tile j of list ``gid`` into stage c % STAGES (c: the CTA's running tile count, for the phase). KV_EVICT: nonzero
    marks the copies for the L2 hint (``common._kv_policy``, ``l2_hints``)."""
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    cv = gl.arange(0, _DV, layout=gl.SliceLayout(0, blk))
    cr = gl.arange(0, _DPE, layout=gl.SliceLayout(0, blk))
    st = c % STAGES
    idx = _tile_rows(rows_ptr, row_stride, gid, n_rows, j, gl.SliceLayout(1, blk))  # before the wait: latency hidden
    ok = (idx >= 0) & (idx < N)
    base = kv_ptr + gl.where(ok, idx, 0).to(gl.int64)[:, None] * stride_kvn
    mbarrier.wait(empty.index(st), ((c // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
    async_copy.async_copy_global_to_shared(ring_v.index(st), base + cv[None, :], mask=ok[:, None],
                                           eviction_policy=_kv_policy(KV_EVICT))
    if HAS_PE:
        async_copy.async_copy_global_to_shared(ring_r.index(st), base + _DV + cr[None, :], mask=ok[:, None],
                                               eviction_policy=_kv_policy(KV_EVICT))
    async_copy.mbarrier_arrive(ready.index(st), increment_count=False)

_FP8_CW = gl.constexpr(64)  # NoPE columns per register-path step (4 threads x 16 B per row)

@gluon.jit
def _fp8_chunk(row, ok, cols, k: gl.constexpr):
    """NoPE columns [64k, 64k + 64) of the tile's fp8_ds_mla rows (uint8, 16 B per thread) and their fp32
    scale (invalid rows: 0 and 0, so the stored values are finite zeros)."""
    x = gl.load(row[:, None] + (k * _FP8_CW + cols)[None, :], mask=ok[:, None], other=0)
    scale = (row + (_FP8_SCALES + 4 * ((k * _FP8_CW) // _FP8_TILE))).to(gl.pointer_type(gl.float32), bitcast=True)
    return x, gl.load(scale, mask=ok, other=0.0)

@gluon.jit
def _fp8_store(dst, x, sc, k: gl.constexpr):
    """Dequantize a chunk (e4m3 -> fp32 x scale -> dst's dtype) into columns [64k, 64k + 64) of dst."""
    v = x.to(gl.float8e4nv, bitcast=True).to(gl.float32) * sc[:, None]
    dst.slice(k * _FP8_CW, _FP8_CW, dim=1).store(v.to(dst.dtype))

@gluon.jit
def _fp8_rows(kv_ptr, rows_ptr, row_stride, stride_kvn, N, gid, n_rows, j, layout: gl.constexpr):
    """Byte pointers of tile j's fp8_ds_mla rows and their validity (positions past the list: invalid)."""
    idx = _tile_rows(rows_ptr, row_stride, gid, n_rows, j, layout)
    ok = (idx >= 0) & (idx < N)
    return kv_ptr + gl.where(ok, idx, 0).to(gl.int64) * stride_kvn, ok

@gluon.jit
def _gather_tiles_fp8(kv_ptr, rows_ptr, row_stride, stride_kvn, N, gid, n_rows, j0, j1, c0, ring_v, ring_r, ready,
                      empty, STAGES: gl.constexpr, KV_EVICT: gl.constexpr):
    """Tiles j0 .. j1 - 1 of list ``gid`` from an fp8_ds_mla cache into the ring (tile j in stage
    (c0 + j - j0) % STAGES). Cache rows (``sparse_mla.kv_format``): 512 e4m3 NoPE values, 4 fp32 scales at
    byte 512, 64 bf16 RoPE values at byte 528; stride_kvn in bytes. The RoPE part lands by cp.async; the NoPE
    part takes the register path (ld.global -> e4m3 -> fp32 x scale -> q's dtype -> st.shared) in 64-column
    steps with the loads two steps ahead (a tile's first two steps load before its stage is free), and each
    tile's row ids load one tile ahead (the data loads never wait on an index load).
    One arrive on ``ready`` (count 1) per tile once every producer thread's stores are fenced for wgmma and
    its copies have landed. KV_EVICT: marks the RoPE copies (as ``_gather_tile``'s)."""
    blk8: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [gl.num_warps(), 1], [1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, blk8)
    n_steps: gl.constexpr = _DV // _FP8_CW
    cols = gl.arange(0, _FP8_CW, layout=gl.SliceLayout(0, blk8))
    row, ok = _fp8_rows(kv_ptr, rows_ptr, row_stride, stride_kvn, N, gid, n_rows, j0, rows_l)
    for j in range(j0, j1):
        st = (c0 + j - j0) % STAGES
        x0, s0 = _fp8_chunk(row, ok, cols, 0)  # in flight during the wait
        x1, s1 = _fp8_chunk(row, ok, cols, 1)
        row_n, ok_n = _fp8_rows(kv_ptr, rows_ptr, row_stride, stride_kvn, N, gid, n_rows, j + 1, rows_l)
        mbarrier.wait(empty.index(st), (((c0 + j - j0) // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
        rope = (row + _FP8_ROPE).to(gl.pointer_type(gl.bfloat16), bitcast=True)  # 2 x 16 B per thread
        async_copy.async_copy_global_to_shared(ring_r.index(st), rope[:, None] + cols[None, :], mask=ok[:, None],
                                               eviction_policy=_kv_policy(KV_EVICT))
        async_copy.commit_group()
        dst = ring_v.index(st)
        for k in gl.static_range(0, n_steps, 2):
            if k + 2 < n_steps:
                x2, s2 = _fp8_chunk(row, ok, cols, k + 2)
            _fp8_store(dst, x0, s0, k)
            if k + 3 < n_steps:
                x3, s3 = _fp8_chunk(row, ok, cols, k + 3)
            _fp8_store(dst, x1, s1, k + 1)
            if k + 2 < n_steps:
                x0 = x2
                s0 = s2
                x1 = x3
                s1 = s3
        fence_async_shared()  # st.shared (generic proxy) -> wgmma reads (async proxy)
        async_copy.wait_group(0)
        gl.thread_barrier()  # every producer thread's stores and copies are done ...
        mbarrier.arrive(ready.index(st), count=1)  # ... before one thread marks the stage ready
        row = row_n
        ok = ok_n

@gluon.jit
def _producer_loop(q_ptr, kv_ptr, rows_ptr, nrows_ptr, gstart_ptr, glen_ptr, route_ptr, stride_qt, stride_qh,
                   stride_kvn, row_stride, N, H, K, m_blocks, group_heads, has_nrows, has_route, num_work, q_v, q_r,
                   ring_v, ring_r, ready, empty, q_bars, num_splits, GROUPED: gl.constexpr, HAS_PE: gl.constexpr,
                   STAGES: gl.constexpr, KV_FP8: gl.constexpr, KV_SPLIT: gl.constexpr, KV_EVICT: gl.constexpr):
    """Persistent producer: per work item, the first STAGES tiles (they may land while the consumers finish the
    previous item), then Q (once the consumers freed it: q_bars[1]; landed: q_bars[0]), then the other tiles."""
    c = 0
    it = 0  # the items this CTA has run (items with no real pseudo-head are skipped by every partition)
    for w in range(gl.program_id(0), num_work, gl.num_programs(0)):
        gid, mb, tok0, n_rows, n_heads, col0 = _resolve_work(w, nrows_ptr, gstart_ptr, glen_ptr, route_ptr, H, K,
                                                                  m_blocks, group_heads, has_nrows, has_route,
                                                                  num_splits, GROUPED, KV_SPLIT)
        rows_w = _item_rows(rows_ptr, col0, KV_SPLIT)
        if mb * _BH < n_heads:
            n_tiles = gl.cdiv(n_rows, _BN)
            n_pre = gl.minimum(n_tiles, STAGES)
            if KV_FP8:
                _gather_tiles_fp8(kv_ptr, rows_w, row_stride, stride_kvn, N, gid, n_rows, 0, n_pre, c, ring_v, ring_r,
                                  ready, empty, STAGES, KV_EVICT)
            else:
                for j in range(n_pre):
                    _gather_tile(kv_ptr, rows_w, row_stride, stride_kvn, N, gid, n_rows, j, c + j, ring_v, ring_r,
                                 ready, empty, HAS_PE, STAGES, KV_EVICT)
            mbarrier.wait(q_bars.index(1), (it & 1) ^ 1)  # Q buffer free (a fresh barrier passes parity 1)
            _issue_q(q_ptr, q_v, q_r, stride_qt, stride_qh, mb, tok0, H, n_heads, GROUPED, HAS_PE)
            async_copy.mbarrier_arrive(q_bars.index(0), increment_count=False)
            if KV_FP8:
                _gather_tiles_fp8(kv_ptr, rows_w, row_stride, stride_kvn, N, gid, n_rows, n_pre, n_tiles, c + n_pre,
                                  ring_v, ring_r, ready, empty, STAGES, KV_EVICT)
            else:
                for j in range(n_pre, n_tiles):
                    _gather_tile(kv_ptr, rows_w, row_stride, stride_kvn, N, gid, n_rows, j, c + j, ring_v, ring_r,
                                 ready, empty, HAS_PE, STAGES, KV_EVICT)
            c += n_tiles
            it += 1


@gluon.jit
def _consumer(q_v, q_r, ring_v, ring_r, ready, empty, rows_ptr, bits_ptr, row_stride, N, gid, n_rows, n_tiles,
              mb, tok0, H, n_heads, out_ptr, lse_ptr, stride_ot, stride_oh, stride_lt, qk_scale, has_lse,
              sink_ptr, maxl_ptr, stride_mt, has_sink, has_maxl,
              GROUPED: gl.constexpr, HAS_PE: gl.constexpr, STAGES: gl.constexpr, ABLATE: gl.constexpr,
              O_VIA_SMEM: gl.constexpr, c0, w, m_blocks, num_splits,
              KV_SPLIT: gl.constexpr):
    """Two warpgroups side by side (warps_per_cta [4, 2]): warpgroup w computes S[:, 32w:32w+32] and
    owns O[:, 256w:256w+256]; Triton exchanges the row max and P across them through shared memory."""
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_l)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_l)
    dt: gl.constexpr = ring_v.dtype
    kpos = gl.arange(0, _BN, layout=gl.SliceLayout(0, s_l))
    p_s = mb * _BH + gl.arange(0, _BH, layout=rows_s)  # pseudo-head of each S row
    qi_s = gl.where(p_s < n_heads, p_s // H, -1)  # its query within the group (grouped mode), -1 past the real rows
    list_base = rows_ptr + gid.to(gl.int64) * row_stride
    bits_base = bits_ptr + gid.to(gl.int64) * row_stride
    m_i = gl.full([_BH], float("-inf"), gl.float32, layout=rows_s)
    l_acc = gl.zeros([_BH, _BN], gl.float32, layout=s_l)
    o = gl.zeros([_BH, _DV], gl.float32, layout=o_l)
    s0 = gl.zeros([_BH, _BN], gl.float32, layout=s_l)
    for j in range(n_tiles):
        st = (c0 + j) % STAGES
        pos = j * _BN + kpos
        in_list = pos < n_rows
        if GROUPED:  # issued before the wait: latency hidden by it
            bits = gl.load(bits_base + pos, mask=in_list, other=0)
            allowed = (((bits[None, :] >> gl.maximum(qi_s, 0)[:, None]) & 1) != 0) & (qi_s >= 0)[:, None]
        else:
            idx = gl.load(list_base + pos, mask=in_list, other=-1)
            allowed = ((idx >= 0) & (idx < N))[None, :]
        mbarrier.wait(ready.index(st), ((c0 + j) // STAGES) & 1)
        fence_async_shared()  # cp.async writes (generic proxy) -> wgmma reads (async proxy)
        if ABLATE & 8:  # timing knob: no Q.K^T
            s = s0
        else:
            s = warpgroup_mma(q_v, ring_v.index(st).permute((1, 0)), s0, use_acc=False, is_async=True)
            if HAS_PE:
                s = warpgroup_mma(q_r, ring_r.index(st).permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        s = gl.where(allowed, s * qk_scale, float("-inf"))  # scale first: sm_scale may be 0 or negative
        if ABLATE & 1:  # timing knob: no row max (no cross-warpgroup exchange)
            m_new = m_i
        else:
            m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # no valid row yet: avoid (-inf) - (-inf)
        p = gl.exp2(s - m_use[:, None])
        alpha_s = gl.exp2(m_i - m_use)
        alpha = gl.convert_layout(alpha_s, rows_o)
        m_i = m_new
        a_op = gl.convert_layout(p.to(dt), p_l)
        if not (ABLATE & 4):  # timing knob 4: no row sum
            # fp32 P summed per thread (as FlashMLA and the Triton twin sum it), reduced across the
            # warpgroups once, after the loop
            l_acc = l_acc * alpha_s[:, None] + p
        if not (ABLATE & 16):  # timing knob 16: no O rescale
            o = o * alpha[:, None]
        if not (ABLATE & 2):  # timing knob 2: no P.V
            o = warpgroup_mma(a_op, ring_v.index(st), o, is_async=True)
            o, a_op = warpgroup_mma_wait(num_outstanding=0, deps=(o, a_op))
        gl.thread_barrier()  # every consumer warp is done reading stage st ...
        mbarrier.arrive(empty.index(st), count=1)  # ... before one thread releases it
    # epilogue: pseudo-head p -> (token, head); rows past the real pseudo-heads are never stored; a split item's
    # outputs are its partials (offsets taken here, not held through the tile loop)
    out_ptr, lse_ptr, maxl_ptr = _item_outputs(out_ptr, lse_ptr, maxl_ptr, w, m_blocks, num_splits, H,
                                               KV_SPLIT)
    l_i = gl.convert_layout(gl.sum(l_acc, axis=1), rows_o)
    p_o, tok, hh = _pseudo_heads(mb, tok0, H, rows_o, GROUPED)
    row_ok = p_o < n_heads
    m_o = gl.convert_layout(m_i, rows_o)
    denom = _epilogue_stats(l_i, m_o, hh, row_ok, tok, lse_ptr, stride_lt, has_lse, sink_ptr, maxl_ptr, stride_mt,
                            has_sink, has_maxl)
    o = o / denom[:, None]
    if O_VIA_SMEM:
        # Through the Q buffer (every Q.K^T of the item has completed: the loop waited on each) into a
        # row-contiguous layout: 16-byte stores per thread, whole 1 KB rows per head (the MMA layout
        # writes 4 bytes per row per thread, half of each 32-byte sector).
        q_v.store(o.to(dt))
        gl.thread_barrier()
        st_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        ob = q_v.load(st_l)
        p_b, tok_b, hh_b = _pseudo_heads(mb, tok0, H, gl.SliceLayout(1, st_l), GROUPED)
        cols_b = gl.arange(0, _DV, layout=gl.SliceLayout(0, st_l))
        o_row = out_ptr + tok_b.to(gl.int64) * stride_ot + hh_b.to(gl.int64) * stride_oh
        gl.store(o_row[:, None] + cols_b[None, :], ob, mask=(p_b < n_heads)[:, None])
    else:
        cols = gl.arange(0, _DV, layout=gl.SliceLayout(0, o_l))
        o_row = out_ptr + tok.to(gl.int64) * stride_ot + hh.to(gl.int64) * stride_oh
        gl.store(o_row[:, None] + cols[None, :], o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])

@gluon.jit
def _consumer_loop(q_v, q_r, ring_v, ring_r, ready, empty, q_bars, rows_ptr, bits_ptr, nrows_ptr, gstart_ptr,
                   glen_ptr, route_ptr, row_stride, N, H, K, m_blocks, group_heads, has_nrows, has_route, num_work,
                   out_ptr, lse_ptr, stride_ot, stride_oh, stride_lt, qk_scale, has_lse, sink_ptr, maxl_ptr,
                   stride_mt, has_sink, has_maxl, num_splits,
                   GROUPED: gl.constexpr, HAS_PE: gl.constexpr, STAGES: gl.constexpr, ABLATE: gl.constexpr,
                   O_VIA_SMEM: gl.constexpr, KV_SPLIT: gl.constexpr):
    """Persistent consumers: per work item, wait for its Q, run the tiles, store, then free the Q buffer."""
    c = 0
    it = 0  # the items this CTA has run (items with no real pseudo-head are skipped by every partition)
    for w in range(gl.program_id(0), num_work, gl.num_programs(0)):
        gid, mb, tok0, n_rows, n_heads, col0 = _resolve_work(w, nrows_ptr, gstart_ptr, glen_ptr, route_ptr, H, K,
                                                                  m_blocks, group_heads, has_nrows, has_route,
                                                                  num_splits, GROUPED, KV_SPLIT)
        rows_w = _item_rows(rows_ptr, col0, KV_SPLIT)
        bits_w = _item_rows(bits_ptr, col0, KV_SPLIT)
        if mb * _BH < n_heads:
            n_tiles = gl.cdiv(n_rows, _BN)
            mbarrier.wait(q_bars.index(0), it & 1)  # Q landed
            fence_async_shared()
            _consumer(q_v, q_r, ring_v, ring_r, ready, empty, rows_w, bits_w, row_stride, N, gid, n_rows, n_tiles,
                      mb, tok0, H, n_heads, out_ptr, lse_ptr, stride_ot, stride_oh, stride_lt, qk_scale, has_lse,
                      sink_ptr, maxl_ptr, stride_mt, has_sink, has_maxl, GROUPED, HAS_PE, STAGES, ABLATE, O_VIA_SMEM,
                      c, w, m_blocks, num_splits, KV_SPLIT)
            gl.thread_barrier()  # every consumer warp is done with Q (and the O staged through it) ...
            mbarrier.arrive(q_bars.index(1), count=1)  # ... before one thread frees it
            c += n_tiles
            it += 1

# Integers that change between calls, index-side pointers and lse's row stride are not specialized, so the
# compiled variants are exactly those of ``variant_constexprs`` (q, kv, out and their strides must be
# 16-byte aligned: ``sparse_mla.mqa.backends`` checks it, and cp.async needs it).
@gluon.jit(do_not_specialize=DO_NOT_SPECIALIZE)
def sparse_mqa_sm90_kernel(
    q_ptr, kv_ptr, rows_ptr, bits_ptr, nrows_ptr, gstart_ptr, glen_ptr, route_ptr, out_ptr, lse_ptr,
    stride_qt, stride_qh, stride_kvn, row_stride, stride_ot, stride_oh, stride_lt,
    N, H, K, qk_scale, m_blocks, group_heads, has_nrows, has_route, has_lse,
    sink_ptr, maxl_ptr, stride_mt, has_sink, has_maxl, num_work, num_splits,
    GROUPED: gl.constexpr, HAS_PE: gl.constexpr, STAGES: gl.constexpr,
    PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr, ABLATE: gl.constexpr, O_VIA_SMEM: gl.constexpr,
    KV_FP8: gl.constexpr, KV_SPLIT: gl.constexpr, KV_EVICT: gl.constexpr, num_warps: gl.constexpr,
):
    """Work items (list, m-block) w = 0 .. num_work - 1, the m-blocks of a list adjacent (they share its rows
    in L2); CTA p takes w = p, p + grid, ... (persistent when the grid is smaller than num_work: the next item's
    first tiles are gathered while this one finishes).

    Per-token: list = token, rows = indices [T, K] (row_stride), nrows = topk_length [T] or K,
    route [T] (0 = another launch computes the token). Grouped: list = group, rows / bits = union rows
    and membership words [num_groups, U], nrows = union_len, gstart / glen = group_start / group_len.
    """
    smem_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    dt: gl.constexpr = q_ptr.dtype.element_ty
    q_v = gl.allocate_shared_memory(dt, [_BH, _DV], smem_l)
    ring_v = gl.allocate_shared_memory(dt, [STAGES, _BN, _DV], smem_l)
    if HAS_PE:
        q_r = gl.allocate_shared_memory(dt, [_BH, _DPE], smem_l)
        ring_r = gl.allocate_shared_memory(dt, [STAGES, _BN, _DPE], smem_l)
    else:  # placeholders, never read
        q_r = q_v
        ring_r = ring_v
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # Q landed, Q free
    for i in gl.static_range(STAGES):
        if KV_FP8:
            mbarrier.init(ready.index(i), count=1)  # one arrive after the producer's barrier
        else:
            mbarrier.init(ready.index(i), count=PRODUCER_WARPS * 32)  # every producer thread arrives
        mbarrier.init(empty.index(i), count=1)  # one arrive by the consumer partition
    mbarrier.init(q_bars.index(0), count=PRODUCER_WARPS * 32)
    mbarrier.init(q_bars.index(1), count=1)

    gl.warp_specialize([
        (_consumer_loop, (q_v, q_r, ring_v, ring_r, ready, empty, q_bars, rows_ptr, bits_ptr, nrows_ptr, gstart_ptr,
                          glen_ptr, route_ptr, row_stride, N, H, K, m_blocks, group_heads, has_nrows, has_route,
                          num_work, out_ptr, lse_ptr, stride_ot, stride_oh, stride_lt, qk_scale, has_lse, sink_ptr,
                          maxl_ptr, stride_mt, has_sink, has_maxl, num_splits,
                          GROUPED, HAS_PE, STAGES, ABLATE, O_VIA_SMEM, KV_SPLIT)),
        (_producer_loop, (q_ptr, kv_ptr, rows_ptr, nrows_ptr, gstart_ptr, glen_ptr, route_ptr, stride_qt, stride_qh,
                          stride_kvn, row_stride, N, H, K, m_blocks, group_heads, has_nrows, has_route, num_work,
                          q_v, q_r, ring_v, ring_r, ready, empty, q_bars, num_splits, GROUPED, HAS_PE, STAGES,
                          KV_FP8, KV_SPLIT, KV_EVICT)),
    ], [PRODUCER_WARPS], [PRODUCER_REGS])
