"""Warp-specialized Gluon kernel for sparse MQA on Hopper (sm_90): per-token and grouped tiles.

One CTA computes a tile of 64 *pseudo-heads* over a list of kv rows:

* per-token mode: pseudo-head r of m-block mb is head ``mb * 64 + r`` of token ``t``; the rows are
  ``indices[t, :topk_length[t]]`` (entries < 0 or >= N are invalid: never read, masked out);
* grouped mode: pseudo-head p = mb * 64 + r is head ``p % H`` of query ``p // H`` of the group
  (``group_start[g] + p // H``); the rows are the group's union rows, and a row counts for query i
  only where bit i of its membership word is set (``sparse_mla.union``). ``group_len[g] == 0``
  means the group runs per token and its CTAs write nothing.

Warp roles (``gl.warp_specialize``): a producer partition gathers 64-row kv tiles with 16-byte cp.async (invalid
rows predicated off, zero-filled, never read) into a shared-memory ring guarded by ready / empty mbarriers; two
consumer warpgroups run S = Q.K^T with wgmma (A = Q from shared memory, B = the tile's K^T view; the 512 NoPE and
64 RoPE columns are separate power-of-two buffers), the online softmax in base 2, and O += P.V over the first 512
columns of the same tile (each warpgroup owns 256 value columns). Two schedules (``SCHEDULES``):

* "pair" (the default, ``sparse_mqa_sm90_pair_kernel``; FlashMLA's SM90 design, read, not copied): each consumer
  warpgroup computes the whole S of its own tile (N = 64 wgmma; even tiles warpgroup 0, odd tiles warpgroup 1),
  the row max is chained 0 -> 1 through shared memory, and each multiplies its own P (registers) and the other's
  (shared memory) by its V half, so one warpgroup's softmax overlaps the other's MMAs. Tiles are held as half
  buffers (columns 0..255 and 256..575) with their own barriers, refilled as soon as their last reader is done.
* "split" (``sparse_mqa_sm90_kernel``): both warpgroups work on the same tile, S split by kv columns (N = 32), the
  row max and P exchanged by Triton's layout conversions. The only schedule with an FP8 producer.

Epilogue: O / l, LSE in natural log; a pseudo-head with no valid row gets out 0 and lse -inf; stores are bounded to
the real rows (O goes through the dead Q buffer in row-contiguous 16-byte pieces: every pair tile, split's per-token
tiles). Both kernels are
persistent (``PERSISTENT``): one CTA per SM loops over the work items (list, m-block); its producer loads each
item's Q once the consumers have freed the buffer and gathers the item's first tiles while the consumers finish the
previous one. An item whose m-block holds no real pseudo-head (a token routed away, an empty group, a short
group's second m-block) is skipped by every partition alike (it writes nothing), so the barrier phases count only
the items a CTA runs.

FP8 cache (``KV_FP8``, kv the uint8 rows [N, 656] of an ``fp8_ds_mla`` cache, bf16 q, D_qk 576): the producer
lands each row's 64 bf16 RoPE values by cp.async and dequantizes the 512 e4m3 NoPE values itself (register path:
16-byte loads, the hardware e4m3 -> f16x2 conversion, x the row's fp32 tile scale, rounded to bf16, st.shared into
the same ring), so the consumers are unchanged; ``FP8_PRODUCER_REGS`` registers per producer thread. Measured on the
H200 it is ~1.7x faster than the Triton kernel's FP8 gather but runs at ~0.8x of the split kernel on a bf16 cache
and ~0.65x of the default pair kernel there (NOTES-GPU.md: the producer's extra traffic through the SM's L1 /
shared-memory path competes with the consumers' shared-memory-bound Q.K^T).

Shared memory (bf16/fp16, D_qk 576): Q 72 KB + 2 tiles x 72 KB + P / row-stat buffers = 231,168 B (pair) or
225,332 B (split) of 232,448 (227 KB).

The kernels are written against Triton's Gluon API of the versions in ``SUPPORTED_TRITON`` (the API
moves between releases); ``sparse_mla.mqa.backends`` uses them only there, and CI compiles every
variant for sm_90 with that Triton (tests/test_gluon_compile.py). Semantics:
``sparse_mla.mqa.reference.sparse_mla_ref``.
"""

from __future__ import annotations

import triton

from .. import env
from ..kv_format import FP8_DS_MLA

SUPPORTED_TRITON = ("3.6",)  # major.minor of triton whose Gluon API these kernels are written against
SUPPORTS_SINK = True  # attn_sink / max_logits computed in the kernel (sparse_mla.mqa.backends reads this)

LOG2E = 1.4426950408889634
BLOCK_H = 64  # pseudo-heads per CTA (wgmma M)
BLOCK_N = 64  # kv rows per tile
D_V = 512
D_PE = 64

try:  # the import itself may fail on Triton versions without (this) Gluon
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    GLUON_IMPORT_ERROR: str | None = None
except Exception as exc:  # pragma: no cover - depends on the installed triton
    GLUON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"


def triton_version_supported(version: str | None = None) -> bool:
    """Whether ``version`` (default: the installed triton's) is one the Gluon kernels are written for."""
    v = version or triton.__version__
    return any(v == s or v.startswith(s + ".") for s in SUPPORTED_TRITON)


if GLUON_IMPORT_ERROR is None:
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
        return gid, mb, tok0, n_rows, n_heads

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
    def _gather_tile(kv_ptr, rows_ptr, row_stride, stride_kvn, N, gid, n_rows, j, c, ring_v, ring_r, ready, empty,
                     HAS_PE: gl.constexpr, STAGES: gl.constexpr):
        """Tile j of list ``gid`` into stage c % STAGES (c: the CTA's running tile count, for the phase)."""
        blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        cv = gl.arange(0, _DV, layout=gl.SliceLayout(0, blk))
        cr = gl.arange(0, _DPE, layout=gl.SliceLayout(0, blk))
        st = c % STAGES
        idx = _tile_rows(rows_ptr, row_stride, gid, n_rows, j, gl.SliceLayout(1, blk))  # before the wait: latency hidden
        ok = (idx >= 0) & (idx < N)
        base = kv_ptr + gl.where(ok, idx, 0).to(gl.int64)[:, None] * stride_kvn
        mbarrier.wait(empty.index(st), ((c // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
        async_copy.async_copy_global_to_shared(ring_v.index(st), base + cv[None, :], mask=ok[:, None])
        if HAS_PE:
            async_copy.async_copy_global_to_shared(ring_r.index(st), base + _DV + cr[None, :], mask=ok[:, None])
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
                          empty, STAGES: gl.constexpr):
        """Tiles j0 .. j1 - 1 of list ``gid`` from an fp8_ds_mla cache into the ring (tile j in stage
        (c0 + j - j0) % STAGES). Cache rows (``sparse_mla.kv_format``): 512 e4m3 NoPE values, 4 fp32 scales at
        byte 512, 64 bf16 RoPE values at byte 528; stride_kvn in bytes. The RoPE part lands by cp.async; the NoPE
        part takes the register path (ld.global -> e4m3 -> fp32 x scale -> q's dtype -> st.shared) in 64-column
        steps with the loads two steps ahead (a tile's first two steps load before its stage is free), and each
        tile's row ids load one tile ahead (the data loads never wait on an index load).
        One arrive on ``ready`` (count 1) per tile once every producer thread's stores are fenced for wgmma and
        its copies have landed."""
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
            async_copy.async_copy_global_to_shared(ring_r.index(st), rope[:, None] + cols[None, :], mask=ok[:, None])
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
                       ring_v, ring_r, ready, empty, q_bars, GROUPED: gl.constexpr, HAS_PE: gl.constexpr,
                       STAGES: gl.constexpr, KV_FP8: gl.constexpr):
        """Persistent producer: per work item, the first STAGES tiles (they may land while the consumers finish the
        previous item), then Q (once the consumers freed it: q_bars[1]; landed: q_bars[0]), then the other tiles."""
        c = 0
        it = 0  # the items this CTA has run (items with no real pseudo-head are skipped by every partition)
        for w in range(gl.program_id(0), num_work, gl.num_programs(0)):
            gid, mb, tok0, n_rows, n_heads = _resolve_item(w, nrows_ptr, gstart_ptr, glen_ptr, route_ptr, H, K,
                                                           m_blocks, group_heads, has_nrows, has_route, GROUPED)
            if mb * _BH < n_heads:
                n_tiles = gl.cdiv(n_rows, _BN)
                n_pre = gl.minimum(n_tiles, STAGES)
                if KV_FP8:
                    _gather_tiles_fp8(kv_ptr, rows_ptr, row_stride, stride_kvn, N, gid, n_rows, 0, n_pre, c, ring_v, ring_r,
                                      ready, empty, STAGES)
                else:
                    for j in range(n_pre):
                        _gather_tile(kv_ptr, rows_ptr, row_stride, stride_kvn, N, gid, n_rows, j, c + j, ring_v, ring_r,
                                     ready, empty, HAS_PE, STAGES)
                mbarrier.wait(q_bars.index(1), (it & 1) ^ 1)  # Q buffer free (a fresh barrier passes parity 1)
                _issue_q(q_ptr, q_v, q_r, stride_qt, stride_qh, mb, tok0, H, n_heads, GROUPED, HAS_PE)
                async_copy.mbarrier_arrive(q_bars.index(0), increment_count=False)
                if KV_FP8:
                    _gather_tiles_fp8(kv_ptr, rows_ptr, row_stride, stride_kvn, N, gid, n_rows, n_pre, n_tiles, c + n_pre,
                                      ring_v, ring_r, ready, empty, STAGES)
                else:
                    for j in range(n_pre, n_tiles):
                        _gather_tile(kv_ptr, rows_ptr, row_stride, stride_kvn, N, gid, n_rows, j, c + j, ring_v, ring_r,
                                     ready, empty, HAS_PE, STAGES)
                c += n_tiles
                it += 1

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

    @gluon.jit
    def _consumer(q_v, q_r, ring_v, ring_r, ready, empty, rows_ptr, bits_ptr, row_stride, N, gid, n_rows, n_tiles,
                  mb, tok0, H, n_heads, out_ptr, lse_ptr, stride_ot, stride_oh, stride_lt, qk_scale, has_lse,
                  sink_ptr, maxl_ptr, stride_mt, has_sink, has_maxl,
                  GROUPED: gl.constexpr, HAS_PE: gl.constexpr, STAGES: gl.constexpr, ABLATE: gl.constexpr,
                  O_VIA_SMEM: gl.constexpr, c0):
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
        # epilogue: pseudo-head p -> (token, head); rows past the real pseudo-heads are never stored
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
            gl.store(o_row[:, None] + cols[None, :], o.to(dt), mask=row_ok[:, None])

    @gluon.jit
    def _consumer_loop(q_v, q_r, ring_v, ring_r, ready, empty, q_bars, rows_ptr, bits_ptr, nrows_ptr, gstart_ptr,
                       glen_ptr, route_ptr, row_stride, N, H, K, m_blocks, group_heads, has_nrows, has_route, num_work,
                       out_ptr, lse_ptr, stride_ot, stride_oh, stride_lt, qk_scale, has_lse, sink_ptr, maxl_ptr,
                       stride_mt, has_sink, has_maxl, GROUPED: gl.constexpr, HAS_PE: gl.constexpr,
                       STAGES: gl.constexpr, ABLATE: gl.constexpr, O_VIA_SMEM: gl.constexpr):
        """Persistent consumers: per work item, wait for its Q, run the tiles, store, then free the Q buffer."""
        c = 0
        it = 0  # the items this CTA has run (items with no real pseudo-head are skipped by every partition)
        for w in range(gl.program_id(0), num_work, gl.num_programs(0)):
            gid, mb, tok0, n_rows, n_heads = _resolve_item(w, nrows_ptr, gstart_ptr, glen_ptr, route_ptr, H, K,
                                                           m_blocks, group_heads, has_nrows, has_route, GROUPED)
            if mb * _BH < n_heads:
                n_tiles = gl.cdiv(n_rows, _BN)
                mbarrier.wait(q_bars.index(0), it & 1)  # Q landed
                fence_async_shared()
                _consumer(q_v, q_r, ring_v, ring_r, ready, empty, rows_ptr, bits_ptr, row_stride, N, gid, n_rows, n_tiles,
                          mb, tok0, H, n_heads, out_ptr, lse_ptr, stride_ot, stride_oh, stride_lt, qk_scale, has_lse,
                          sink_ptr, maxl_ptr, stride_mt, has_sink, has_maxl, GROUPED, HAS_PE, STAGES, ABLATE, O_VIA_SMEM,
                          c)
                gl.thread_barrier()  # every consumer warp is done with Q (and the O staged through it) ...
                mbarrier.arrive(q_bars.index(1), count=1)  # ... before one thread frees it
                c += n_tiles
                it += 1

    # Integers that change between calls, index-side pointers and lse's row stride are not specialized, so the
    # compiled variants are exactly those of ``variant_constexprs`` (q, kv, out and their strides must be
    # 16-byte aligned: ``sparse_mla.mqa.backends`` checks it, and cp.async needs it).
    @gluon.jit(do_not_specialize=["rows_ptr", "bits_ptr", "nrows_ptr", "gstart_ptr", "glen_ptr", "route_ptr",
                                  "lse_ptr", "row_stride", "stride_lt", "N", "H", "K", "m_blocks", "group_heads",
                                  "has_nrows", "has_route", "has_lse", "sink_ptr", "maxl_ptr", "stride_mt",
                                  "has_sink", "has_maxl", "num_work"])
    def sparse_mqa_sm90_kernel(
        q_ptr, kv_ptr, rows_ptr, bits_ptr, nrows_ptr, gstart_ptr, glen_ptr, route_ptr, out_ptr, lse_ptr,
        stride_qt, stride_qh, stride_kvn, row_stride, stride_ot, stride_oh, stride_lt,
        N, H, K, qk_scale, m_blocks, group_heads, has_nrows, has_route, has_lse,
        sink_ptr, maxl_ptr, stride_mt, has_sink, has_maxl, num_work,
        GROUPED: gl.constexpr, HAS_PE: gl.constexpr, STAGES: gl.constexpr,
        PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr, ABLATE: gl.constexpr, O_VIA_SMEM: gl.constexpr,
        KV_FP8: gl.constexpr, num_warps: gl.constexpr,
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
                              maxl_ptr, stride_mt, has_sink, has_maxl, GROUPED, HAS_PE, STAGES, ABLATE, O_VIA_SMEM)),
            (_producer_loop, (q_ptr, kv_ptr, rows_ptr, nrows_ptr, gstart_ptr, glen_ptr, route_ptr, stride_qt, stride_qh,
                              stride_kvn, row_stride, N, H, K, m_blocks, group_heads, has_nrows, has_route, num_work,
                              q_v, q_r, ring_v, ring_r, ready, empty, q_bars, GROUPED, HAS_PE, STAGES, KV_FP8)),
        ], [PRODUCER_WARPS], [PRODUCER_REGS])


    # ------------------------------------------------------------------ "pair" schedule (FlashMLA's SM90 split)
    # Two 4-warp consumer partitions, each computing the full S of its own kv tile (warpgroup 0: even tiles in
    # stage 0, warpgroup 1: odd tiles in stage 1; N = 64 wgmma) and owning half of O's value columns
    # (wg 0: 0..255, wg 1: 256..511). Per pair of tiles: wg 0 publishes its running max m0, wg 1 takes
    # m1 = max(m0, its row max) and publishes it; each multiplies its own P (registers) by its V half, then the
    # other's P (shared memory, at the common max m1) by its V half. The tensor core alternates between the
    # warpgroups: wg 0's softmax overlaps wg 1's Q.K^T, wg 1's softmax overlaps wg 0's first P.V.
    _NEG: gl.constexpr = gl.constexpr(-1.0e30)  # finite "no row yet" max: no inf - inf, no 0 * inf

    @gluon.jit
    def _vec_store(smem, x):
        """Store a [64] row vector (any layout) to shared memory through a plain 1-D layout."""
        smem.store(gl.convert_layout(x, gl.BlockedLayout([1], [32], [gl.num_warps()], [0])))

    @gluon.jit
    def _vec_load(smem, layout: gl.constexpr):
        return gl.convert_layout(smem.load(gl.BlockedLayout([1], [32], [gl.num_warps()], [0])), layout)

    @gluon.jit
    def _tile_cols(rows_ptr, bits_ptr, row_stride, N, gid, n_rows, j, s_l: gl.constexpr, GROUPED: gl.constexpr):
        """Per kv column of tile j: the membership word (grouped) or 1 / 0 for a valid / invalid row (per token).
        Loaded before the tile's wait (latency hidden); ``_tile_allowed`` expands it after the Q.K^T."""
        pos = j * _BN + gl.arange(0, _BN, layout=gl.SliceLayout(0, s_l))
        in_list = pos < n_rows
        if GROUPED:
            return gl.load(bits_ptr + gid.to(gl.int64) * row_stride + pos, mask=in_list, other=0)
        else:
            idx = gl.load(rows_ptr + gid.to(gl.int64) * row_stride + pos, mask=in_list, other=-1)
            return ((idx >= 0) & (idx < N)).to(gl.int32)

    @gluon.jit
    def _tile_allowed(cols, qi):
        """[64, 64] bool: which (pseudo-head, kv row) pairs count (qi = the row's query in the group, -1 = none)."""
        return (((cols[None, :] >> gl.maximum(qi, 0)[:, None]) & 1) != 0) & (qi >= 0)[:, None]

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
                     HAS_PE: gl.constexpr):
        """Tiles 2i, 2i + 1 of list ``gid`` (the CTA's pair k) as half tiles, in the order the consumers free them:
        L0, R1, R0, L1."""
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
        async_copy.async_copy_global_to_shared(ring_l.index(0), base0 + ch[None, :], mask=ok0[:, None])
        async_copy.mbarrier_arrive(hb.index(0), increment_count=False)
        mbarrier.wait(hb.index(7), ph)  # R1 free
        async_copy.async_copy_global_to_shared(ring_h.index(1), base1 + 256 + ch[None, :], mask=ok1[:, None])
        if HAS_PE:
            async_copy.async_copy_global_to_shared(ring_r.index(1), base1 + _DV + cr[None, :], mask=ok1[:, None])
        async_copy.mbarrier_arrive(hb.index(3), increment_count=False)
        mbarrier.wait(hb.index(6), ph)  # R0 free
        async_copy.async_copy_global_to_shared(ring_h.index(0), base0 + 256 + ch[None, :], mask=ok0[:, None])
        if HAS_PE:
            async_copy.async_copy_global_to_shared(ring_r.index(0), base0 + _DV + cr[None, :], mask=ok0[:, None])
        async_copy.mbarrier_arrive(hb.index(2), increment_count=False)
        mbarrier.wait(hb.index(5), ph)  # L1 free
        async_copy.async_copy_global_to_shared(ring_l.index(1), base1 + ch[None, :], mask=ok1[:, None])
        async_copy.mbarrier_arrive(hb.index(1), increment_count=False)

    @gluon.jit
    def _pair_producer(q_ptr, kv_ptr, rows_ptr, nrows_ptr, gstart_ptr, glen_ptr, route_ptr, stride_qt, stride_qh,
                       stride_kvn, row_stride, N, H, K, m_blocks, group_heads, has_nrows, has_route, num_work, q_v, q_r,
                       ring_l, ring_h, ring_r, hb, q_bars, GROUPED: gl.constexpr, HAS_PE: gl.constexpr):
        """Persistent producer: per work item, its first pair of tiles (they may land while the consumers finish
        the previous item), then Q (once both consumers freed it: q_bars[1]; landed: q_bars[0]), then the rest."""
        k = 0
        it = 0  # the items this CTA has run (items with no real pseudo-head are skipped by every partition)
        for w in range(gl.program_id(0), num_work, gl.num_programs(0)):
            gid, mb, tok0, n_rows, n_heads = _resolve_item(w, nrows_ptr, gstart_ptr, glen_ptr, route_ptr, H, K,
                                                           m_blocks, group_heads, has_nrows, has_route, GROUPED)
            if mb * _BH < n_heads:
                n_pairs = gl.cdiv(n_rows, 2 * _BN)
                if n_pairs > 0:
                    _pair_gather(kv_ptr, rows_ptr, row_stride, stride_kvn, N, gid, n_rows, 0, k, ring_l, ring_h, ring_r,
                                 hb, HAS_PE)
                mbarrier.wait(q_bars.index(1), (it & 1) ^ 1)  # Q buffer free (a fresh barrier passes parity 1)
                _issue_q(q_ptr, q_v.index(0), q_r.index(0), stride_qt, stride_qh, mb, tok0, H, n_heads, GROUPED, HAS_PE)
                async_copy.mbarrier_arrive(q_bars.index(0), increment_count=False)
                for i in range(1, n_pairs):
                    _pair_gather(kv_ptr, rows_ptr, row_stride, stride_kvn, N, gid, n_rows, i, k + i, ring_l, ring_h,
                                 ring_r, hb, HAS_PE)
                k += n_pairs
                it += 1

    @gluon.jit
    def _pair_epilogue(o, l_own, m_i, l_mine, l_other, bars, it, q_v, q_bars, out_ptr, lse_ptr, mb, tok0, H, n_heads,
                       stride_ot, stride_oh, stride_lt, has_lse, sink_ptr, maxl_ptr, stride_mt, has_sink, has_maxl,
                       WG: gl.constexpr, GROUPED: gl.constexpr, O_VIA_SMEM: gl.constexpr):
        """Exchange the partial row sums (bars[5 + WG]: this warpgroup's are in l_mine), normalise its 256 columns of
        O, store them (warpgroup 0 also lse), then free Q. l_mine is rewritten only after the other warpgroup read
        it: the next item starts with its Q, which the producer loads after both warpgroups freed this one's."""
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
        rows_o: gl.constexpr = gl.SliceLayout(1, o_l)
        _vec_store(l_mine, l_own)
        _pair_release(bars.index(5 + WG))
        mbarrier.wait(bars.index(6 - WG), it & 1)
        l_i = gl.convert_layout(l_own, rows_o) + _vec_load(l_other, rows_o)
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
                       rows_ptr, bits_ptr, row_stride, N, gid, n_rows, qi, qk_scale, GROUPED: gl.constexpr,
                       HAS_PE: gl.constexpr, NEXT: gl.constexpr):
        """Warpgroup 0, pair i of the item (the CTA's pair k): S of tile 2i is in ``s`` (computed), its column
        words in ``cols``. With NEXT, the Q.K^T of tile 2i + 2 is issued (L half) before the wait on P1.V1, so the
        two overlap, and returned computed with that tile's column words (loaded before the waits)."""
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
        p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
        rows_s: gl.constexpr = gl.SliceLayout(1, s_l)
        rows_o: gl.constexpr = gl.SliceLayout(1, o_l)
        dt: gl.constexpr = ring_l.dtype
        z = ((k + N) < 0).to(gl.int32)  # an opaque 0 (module comment; k + N < 2**31: pairs and kv rows are int32 counts)
        st0 = z
        st1 = 1 - z
        s = gl.where(_tile_allowed(cols, qi), s * qk_scale, float("-inf"))
        m0 = gl.maximum(m_i, gl.max(s, axis=1))
        _vec_store(s_m0, m0)
        _pair_release(bars.index(0))  # m0 ready
        p = gl.exp2(s - m0[:, None])
        alpha = gl.exp2(m_i - m0)
        o = o * gl.convert_layout(alpha, rows_o)[:, None]
        l_i = l_i * alpha + gl.sum(p, axis=1)
        pb = p.to(dt)  # only the rounded P stays live (registers are the limit of this schedule)
        a_op = gl.convert_layout(pb, p_l)
        o = warpgroup_mma(a_op, ring_l.index(st0), o, is_async=True)
        o, a_op = warpgroup_mma_wait(num_outstanding=0, deps=(o, a_op))
        _pair_release(hb.index(4))  # L0 free
        mbarrier.wait(bars.index(1), k & 1)  # m1 ready
        m1 = _vec_load(s_m1, rows_s)
        beta = gl.exp2(m0 - m1)
        s_p0.store((pb.to(gl.float32) * beta[:, None]).to(dt))  # P0 at the common max m1, for warpgroup 1
        fence_async_shared()
        _pair_release(bars.index(2))  # P0 ready
        o = o * gl.convert_layout(beta, rows_o)[:, None]
        l_i = l_i * beta
        mbarrier.wait(bars.index(3), k & 1)  # P1 ready
        o = warpgroup_mma(s_p1, ring_l.index(st1), o, is_async=True)
        if NEXT:
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
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        else:
            o = warpgroup_mma_wait(num_outstanding=0, deps=(o, ))
            _pair_release(bars.index(4))  # P1 buffer free
            mbarrier.arrive(hb.index(5), count=1)  # L1 free
        return s, cols, o, m1, l_i

    @gluon.jit
    def _pair_item(mb, n_rows, n_heads, H):
        """A consumer warpgroup's start of a work item (m-block mb, n_rows kv rows, n_heads real pseudo-heads): (pairs
        of tiles, each S row's query in the group (-1 past the real pseudo-heads), and fresh m, l, O, S)."""
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
        rows_s: gl.constexpr = gl.SliceLayout(1, s_l)
        n_pairs = gl.cdiv(n_rows, 2 * _BN)
        p_s = mb * _BH + gl.arange(0, _BH, layout=rows_s)
        qi = gl.where(p_s < n_heads, p_s // H, -1)
        m_i = gl.full([_BH], _NEG, gl.float32, layout=rows_s)
        l_i = gl.zeros([_BH], gl.float32, layout=rows_s)
        o = gl.zeros([_BH, 256], gl.float32, layout=o_l)
        s = gl.zeros([_BH, _BN], gl.float32, layout=s_l)
        return n_pairs, qi, m_i, l_i, o, s

    @gluon.jit
    def _pair_wg0(q_v, q_r, ring_l, ring_h, ring_r, s_p0, s_p1, s_m0, s_m1, s_l0, s_l1, hb, bars, q_bars, rows_ptr, bits_ptr,
                  nrows_ptr, gstart_ptr, glen_ptr, route_ptr, row_stride, N, H, K, m_blocks, group_heads, has_nrows,
                  has_route, num_work, out_ptr, lse_ptr, stride_ot, stride_oh, stride_lt, qk_scale, has_lse, sink_ptr,
                  maxl_ptr, stride_mt, has_sink, has_maxl, GROUPED: gl.constexpr, HAS_PE: gl.constexpr,
                  O_VIA_SMEM: gl.constexpr):
        """Warpgroup 0: S of the even tiles (stage 0), O[:, 0:256]; per work item of this CTA."""
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        k = 0
        it = 0  # the items this CTA has run (items with no real pseudo-head are skipped by every partition)
        for w in range(gl.program_id(0), num_work, gl.num_programs(0)):
            gid, mb, tok0, n_rows, n_heads = _resolve_item(w, nrows_ptr, gstart_ptr, glen_ptr, route_ptr, H, K,
                                                           m_blocks, group_heads, has_nrows, has_route, GROUPED)
            if mb * _BH < n_heads:
                n_pairs, qi, m_i, l_i, o, s = _pair_item(mb, n_rows, n_heads, H)
                cols = _tile_cols(rows_ptr, bits_ptr, row_stride, N, gid, n_rows, 0, s_l, GROUPED)
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
                    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
                for i in range(n_pairs - 1):
                    s, cols, o, m_i, l_i = _pair_wg0_step(s, cols, o, m_i, l_i, i, k + i, q_v, q_r, ring_l, ring_h,
                                                          ring_r, s_p0, s_p1, s_m0, s_m1, hb, bars, rows_ptr, bits_ptr,
                                                          row_stride, N, gid, n_rows, qi, qk_scale, GROUPED, HAS_PE, True)
                if n_pairs > 0:
                    s, cols, o, m_i, l_i = _pair_wg0_step(s, cols, o, m_i, l_i, n_pairs - 1, k + n_pairs - 1, q_v, q_r,
                                                          ring_l, ring_h, ring_r, s_p0, s_p1, s_m0, s_m1, hb, bars,
                                                          rows_ptr, bits_ptr, row_stride, N, gid, n_rows, qi, qk_scale,
                                                          GROUPED, HAS_PE, False)
                _pair_epilogue(o, l_i, m_i, s_l0, s_l1, bars, it, q_v, q_bars, out_ptr, lse_ptr, mb, tok0, H,
                               n_heads, stride_ot, stride_oh, stride_lt, has_lse, sink_ptr, maxl_ptr, stride_mt, has_sink,
                               has_maxl, 0, GROUPED, O_VIA_SMEM)
                k += n_pairs
                it += 1

    @gluon.jit
    def _pair_wg1(q_v, q_r, ring_l, ring_h, ring_r, s_p0, s_p1, s_m0, s_m1, s_l0, s_l1, hb, bars, q_bars, rows_ptr, bits_ptr,
                  nrows_ptr, gstart_ptr, glen_ptr, route_ptr, row_stride, N, H, K, m_blocks, group_heads, has_nrows,
                  has_route, num_work, out_ptr, lse_ptr, stride_ot, stride_oh, stride_lt, qk_scale, has_lse, sink_ptr,
                  maxl_ptr, stride_mt, has_sink, has_maxl, GROUPED: gl.constexpr, HAS_PE: gl.constexpr,
                  O_VIA_SMEM: gl.constexpr):
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
            gid, mb, tok0, n_rows, n_heads = _resolve_item(w, nrows_ptr, gstart_ptr, glen_ptr, route_ptr, H, K,
                                                           m_blocks, group_heads, has_nrows, has_route, GROUPED)
            if mb * _BH < n_heads:
                n_pairs, qi, m_i, l_i, o, s = _pair_item(mb, n_rows, n_heads, H)
                mbarrier.wait(q_bars.index(0), it & 1)  # Q landed
                fence_async_shared()
                for i in range(n_pairs):
                    kk = k + i
                    z = ((kk + N) < 0).to(gl.int32)  # an opaque 0 (module comment)
                    st0 = z
                    st1 = 1 - z
                    cols = _tile_cols(rows_ptr, bits_ptr, row_stride, N, gid, n_rows, 2 * i + 1, s_l, GROUPED)
                    mbarrier.wait(hb.index(3), kk & 1)  # R1 landed
                    fence_async_shared()
                    s = _pair_qk_half(q_v, ring_h, 256, st1, z, s, False)  # the dead S as accumulator: no zeros live
                    if HAS_PE:
                        s = _pair_qk_rope(q_r, ring_r, st1, z, s)
                    mbarrier.wait(hb.index(1), kk & 1)  # L1 landed
                    fence_async_shared()
                    s = _pair_qk_half(q_v, ring_l, 0, st1, z, s, True)
                    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
                    s = gl.where(_tile_allowed(cols, qi), s * qk_scale, float("-inf"))
                    mbarrier.wait(bars.index(0), kk & 1)  # m0 ready
                    m1 = gl.maximum(_vec_load(s_m0, rows_s), gl.max(s, axis=1))
                    _vec_store(s_m1, m1)
                    _pair_release(bars.index(1))  # m1 ready
                    p = gl.exp2(s - m1[:, None])
                    alpha = gl.exp2(m_i - m1)
                    m_i = m1
                    o = o * gl.convert_layout(alpha, rows_o)[:, None]
                    pb = p.to(dt)
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
                               has_maxl, 1, GROUPED, O_VIA_SMEM)
                k += n_pairs
                it += 1

    @gluon.jit(do_not_specialize=["rows_ptr", "bits_ptr", "nrows_ptr", "gstart_ptr", "glen_ptr", "route_ptr",
                                  "lse_ptr", "row_stride", "stride_lt", "N", "H", "K", "m_blocks", "group_heads",
                                  "has_nrows", "has_route", "has_lse", "sink_ptr", "maxl_ptr", "stride_mt",
                                  "has_sink", "has_maxl", "num_work"])
    def sparse_mqa_sm90_pair_kernel(
        q_ptr, kv_ptr, rows_ptr, bits_ptr, nrows_ptr, gstart_ptr, glen_ptr, route_ptr, out_ptr, lse_ptr,
        stride_qt, stride_qh, stride_kvn, row_stride, stride_ot, stride_oh, stride_lt,
        N, H, K, qk_scale, m_blocks, group_heads, has_nrows, has_route, has_lse,
        sink_ptr, maxl_ptr, stride_mt, has_sink, has_maxl, num_work,
        GROUPED: gl.constexpr, HAS_PE: gl.constexpr, CONSUMER_REGS: gl.constexpr, O_VIA_SMEM: gl.constexpr,
        num_warps: gl.constexpr,
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
                              num_work, q_v, q_r, ring_l, ring_h, ring_r, hb, q_bars, GROUPED, HAS_PE)),
            (_pair_wg0, (q_v, q_r, ring_l, ring_h, ring_r, s_p0, s_p1, s_m0, s_m1, s_l0, s_l1, hb, bars, q_bars, rows_ptr,
                         bits_ptr, nrows_ptr, gstart_ptr, glen_ptr, route_ptr, row_stride, N, H, K, m_blocks,
                         group_heads, has_nrows, has_route, num_work, out_ptr, lse_ptr, stride_ot, stride_oh,
                         stride_lt, qk_scale, has_lse, sink_ptr, maxl_ptr, stride_mt, has_sink, has_maxl, GROUPED,
                         HAS_PE, O_VIA_SMEM)),
            (_pair_wg1, (q_v, q_r, ring_l, ring_h, ring_r, s_p0, s_p1, s_m0, s_m1, s_l0, s_l1, hb, bars, q_bars, rows_ptr,
                         bits_ptr, nrows_ptr, gstart_ptr, glen_ptr, route_ptr, row_stride, N, H, K, m_blocks,
                         group_heads, has_nrows, has_route, num_work, out_ptr, lse_ptr, stride_ot, stride_oh,
                         stride_lt, qk_scale, has_lse, sink_ptr, maxl_ptr, stride_mt, has_sink, has_maxl, GROUPED,
                         HAS_PE, O_VIA_SMEM)),
        ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


# Launch configuration (measured on the H200: NOTES-GPU.md). Split: the default partition is the two consumer
# warpgroups (8 warps), the producer worker gets PRODUCER_REGS registers per thread. Pair: the default partition is
# the 4-warp producer, each consumer warpgroup a worker with PAIR_CONSUMER_REGS.
CONSUMER_WARPS = 8
PRODUCER_WARPS = 4
PRODUCER_REGS = 40
STAGES = 2
# "split": sparse_mqa_sm90_kernel (S split by kv columns across two warpgroups of one partition);
# "pair": sparse_mqa_sm90_pair_kernel (FlashMLA's split: a kv tile per warpgroup, ping-pong on the tensor core).
SCHEDULES = ("split", "pair")
# The schedule of bf16 / fp16 caches: pair measured 1.23-1.36x faster than split (results/gluon-v12-full.json; NOTES-GPU.md,
# session 7). An fp8_ds_mla cache always runs split (``schedule_for``): only its producer dequantizes.
SCHEDULE = env.get(env.GLUON_SCHEDULE)
# Timing knob of the split schedule (bitmask: 1 no row max, 2 no P.V, 4 no row sum, 8 no Q.K^T, 16 no O rescale):
# wrong results, only for placing time inside the kernel (scripts/bench_gluon.py --ablate). 0 in production.
ABLATE = 0
# O stored through shared memory in 16-byte row-contiguous pieces: split, per-token tiles (results/gluon-v6.json: 413 vs
# 402 TFLOP/s at 64 heads, 423 vs 408 at 128; its grouped tiles keep the direct store, 2.11 vs 2.07 ms there); pair,
# every tile (results/probe-pair.json: grouped 1.570 vs 1.611 ms at 16 heads, 3.000 vs 3.049 at 32, 0.853 vs 0.869 at 8).
O_VIA_SMEM = env.get(env.GLUON_O_VIA_SMEM) == "1"
# Both schedules: one CTA per SM looping over the work items (the next item's first tiles land during this one's
# epilogue) instead of one CTA per item.
PERSISTENT = env.get(env.GLUON_PERSISTENT) == "1"
PAIR_CONSUMER_REGS = 232  # each consumer warpgroup; the producer (the default partition) gets what is left
# fp8_ds_mla cache (KV_FP8): the producer dequantizes in registers, so it gets more of them (the consumers the rest).
FP8_PRODUCER_REGS = int(env.get(env.GLUON_FP8_PRODUCER_REGS))
FP8_SCHEDULES = ("split", )  # schedules with an fp8_ds_mla variant (D_qk 576, bf16 q: its RoPE part is bf16)


def schedule_for(kv_fp8: bool) -> str:
    """The schedule a launch runs: ``SCHEDULE`` on a bf16 / fp16 cache, the FP8 schedule on an fp8_ds_mla one."""
    if not kv_fp8:
        return SCHEDULE
    return SCHEDULE if SCHEDULE in FP8_SCHEDULES else FP8_SCHEDULES[0]


def _kernel_for(schedule: str):
    if schedule not in SCHEDULES:
        raise ValueError(f"SPARSE_MLA_GLUON_SCHEDULE must be one of {SCHEDULES}, got {schedule!r}")
    return sparse_mqa_sm90_kernel if schedule == "split" else sparse_mqa_sm90_pair_kernel


def variant_constexprs(grouped: bool, has_pe: bool, schedule: str | None = None, kv_fp8: bool = False) -> dict:
    """The compile-time parameters of one kernel variant (everything else is a run-time argument, so the
    package launches 2 modes x 2 D_qk x 2 dtypes = 8 variants per schedule, plus the split schedule's 2 modes
    on an fp8_ds_mla cache with bf16 q; each compiled for sm_90 in CI)."""
    if kv_fp8 and not has_pe:
        raise ValueError("an fp8_ds_mla variant needs D_qk 576 (has_pe): the format's rows are 576 wide")
    if (schedule or schedule_for(kv_fp8)) == "split":
        return dict(GROUPED=grouped, HAS_PE=has_pe, STAGES=STAGES, PRODUCER_WARPS=PRODUCER_WARPS,
                    PRODUCER_REGS=FP8_PRODUCER_REGS if kv_fp8 else PRODUCER_REGS, ABLATE=ABLATE,
                    O_VIA_SMEM=O_VIA_SMEM and not grouped, KV_FP8=kv_fp8, num_warps=CONSUMER_WARPS)
    if kv_fp8:
        raise ValueError("the pair schedule has no fp8_ds_mla variant (FP8_SCHEDULES)")
    return dict(GROUPED=grouped, HAS_PE=has_pe, CONSUMER_REGS=PAIR_CONSUMER_REGS, O_VIA_SMEM=O_VIA_SMEM, num_warps=4)


_PLACEHOLDERS: dict = {}


def _placeholders(device):
    """One-element fp32 and int8 tensors per device, passed for absent optional pointers (never read)."""
    key = str(device)
    if key not in _PLACEHOLDERS:
        import torch

        _PLACEHOLDERS[key] = (torch.zeros(1, dtype=torch.float32, device=device),
                              torch.zeros(1, dtype=torch.int8, device=device))
    return _PLACEHOLDERS[key]


_NUM_SMS: dict = {}


def _num_sms(device) -> int:
    key = str(device)
    if key not in _NUM_SMS:
        import torch

        _NUM_SMS[key] = torch.cuda.get_device_properties(device).multi_processor_count
    return _NUM_SMS[key]


def num_m_blocks(num_pseudo_heads: int) -> int:
    """CTAs per list: 64 pseudo-heads each."""
    return triton.cdiv(num_pseudo_heads, BLOCK_H)


def launch(q, kv, rows, bits, nrows, group_start, group_len, route, out, lse, sm_scale: float, *,
           grouped: bool, num_lists: int, group_heads: int, attn_sink=None, max_logits=None) -> None:
    """Launch on validated CUDA tensors (``sparse_mla.mqa.backends`` checks that this kernel applies).

    q [T, H, D_qk], kv [N, D_qk] (row stride ``kv.stride(0)``), out [T, H, 512], lse [T, H] fp32 or None.
    Per-token (grouped=False): rows = indices [T, K] int32, nrows = topk_length [T] or None, route [T]
    int8 or None (0 = skip), num_lists = T, group_heads = H. Grouped: rows / bits = union rows and
    membership words [num_groups, U] int32, nrows = union_len, group_start / group_len [num_groups],
    num_lists = num_groups, group_heads = G * H (<= 128). attn_sink [H] fp32 contiguous or None (adds
    exp(attn_sink[h]) to out's denominator), max_logits [T, H] fp32 (heads contiguous) or None (written):
    the semantics of ``sparse_mla.mqa.triton_tl``.
    """
    import torch

    T, H, D = q.shape
    kv_fp8 = kv.dtype == torch.uint8
    if kv_fp8 and (q.dtype != torch.bfloat16 or D != FP8_DS_MLA.d_qk):
        raise ValueError(f"an fp8_ds_mla cache needs bf16 q with D_qk {FP8_DS_MLA.d_qk}, got {q.dtype}, {D}")
    if num_lists == 0:
        return
    m_blocks = num_m_blocks(group_heads)
    num_work = num_lists * m_blocks
    dummy = rows  # an int32 placeholder for absent int32 inputs
    f32, i8 = _placeholders(q.device)  # typed placeholders keep the argument types, hence the compiled variant, fixed
    grid = min(num_work, _num_sms(q.device)) if PERSISTENT else num_work
    schedule = schedule_for(kv_fp8)
    _kernel_for(schedule)[(grid, )](
        q, kv, rows, bits if bits is not None else dummy, nrows if nrows is not None else dummy,
        group_start if group_start is not None else dummy, group_len if group_len is not None else dummy,
        route if route is not None else i8, out, lse if lse is not None else f32,
        q.stride(0), q.stride(1), kv.stride(0), rows.stride(0), out.stride(0), out.stride(1),
        lse.stride(0) if lse is not None else 0,
        kv.shape[0], H, rows.shape[1], sm_scale * LOG2E, m_blocks, group_heads,
        int(nrows is not None), int(route is not None), int(lse is not None),
        attn_sink if attn_sink is not None else f32, max_logits if max_logits is not None else f32,
        max_logits.stride(0) if max_logits is not None else 0, int(attn_sink is not None), int(max_logits is not None),
        num_work, **variant_constexprs(grouped, D > D_V, schedule, kv_fp8),
    )


# ---------------------------------------------------------------- ahead-of-time compile (no GPU needed)
# Argument types of sparse_mqa_sm90_kernel in order, for triton.compile (pointers by dtype).
_ARG_TYPES = (("q_ptr", "*{dt}"), ("kv_ptr", "*{dt}"), ("rows_ptr", "*i32"), ("bits_ptr", "*i32"),
              ("nrows_ptr", "*i32"), ("gstart_ptr", "*i32"), ("glen_ptr", "*i32"), ("route_ptr", "*i8"),
              ("out_ptr", "*{dt}"), ("lse_ptr", "*fp32"), ("stride_qt", "i32"), ("stride_qh", "i32"),
              ("stride_kvn", "i32"), ("row_stride", "i32"), ("stride_ot", "i32"), ("stride_oh", "i32"),
              ("stride_lt", "i32"), ("N", "i32"), ("H", "i32"), ("K", "i32"), ("qk_scale", "fp32"),
              ("m_blocks", "i32"), ("group_heads", "i32"), ("has_nrows", "i32"), ("has_route", "i32"),
              ("has_lse", "i32"), ("sink_ptr", "*fp32"), ("maxl_ptr", "*fp32"), ("stride_mt", "i32"),
              ("has_sink", "i32"), ("has_maxl", "i32"), ("num_work", "i32"))
# Specialized 16-divisible at launch (checked by the backend selection): q, kv, out and their strides.
_ALIGNED = ("q_ptr", "kv_ptr", "out_ptr", "stride_qt", "stride_qh", "stride_kvn", "stride_ot", "stride_oh")


def all_variants() -> list[tuple[bool, bool, str, str, bool]]:
    """(grouped, has_pe, dtype, schedule, kv_fp8) of every variant the package can launch."""
    plain = [(g, pe, dt, sc, False) for sc in SCHEDULES for g in (False, True) for pe in (False, True)
             for dt in ("bf16", "fp16")]
    return plain + [(g, True, "bf16", sc, True) for sc in FP8_SCHEDULES for g in (False, True)]


def compile_variant(grouped: bool, has_pe: bool, dtype: str, schedule: str, kv_fp8: bool = False, arch: int = 90):
    """Compile one variant for ``sm_<arch>`` without a GPU (Triton's front end, LLVM and ptxas run on
    the CPU); returns the CompiledKernel (``.metadata.shared`` bytes, ``.n_regs`` / ``.n_spills``
    where the backend fills them, ``.asm["ptx"]``). Raises whatever Triton raises on an API drift or a
    resource overflow."""
    if GLUON_IMPORT_ERROR is not None:
        raise RuntimeError(f"Gluon is not importable: {GLUON_IMPORT_ERROR}")
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    names = [n for n, _ in _ARG_TYPES]
    signature = {n: t.format(dt=dtype) for n, t in _ARG_TYPES}
    if kv_fp8:
        signature["kv_ptr"] = "*u8"  # the cache's byte rows
    cx = variant_constexprs(grouped, has_pe, schedule, kv_fp8)
    signature.update({k: "constexpr" for k in cx})
    attrs = {(names.index(n), ): [["tt.divisibility", 16]] for n in _ALIGNED}
    src = GluonASTSource(_kernel_for(schedule), signature, constexprs=cx, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": cx["num_warps"]})
