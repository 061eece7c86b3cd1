"""The sparse MQA attention kernel: per-token and grouped (union + membership) in one body.

A program owns a tile of BLOCK_M "pseudo-heads" of one *group* and loops over that group's
rows in BLOCK_N chunks, gathering each kv row once ([BLOCK_N, 512] NoPE part, also used as V,
plus [BLOCK_N, 64] RoPE part when D_qk = 576), with an online softmax in base 2.

* Per-token mode (GROUPED = False): the group is one query token; its pseudo-heads are its heads,
  its rows are its own ``indices[t]`` (validity computed in the kernel: >= 0, < N, before
  ``topk_length[t]``). With ``ROUTE`` given, a token whose route is 0 is left to the grouped
  launch and its program returns at once.
* Grouped mode (GROUPED = True): the group is ``group_len[g]`` consecutive query rows starting at
  ``group_start[g]``; pseudo-head p is head ``p % H`` of query ``p // H``; its rows are the
  sorted union rows of the group, and a row counts for query i only where bit i of its
  membership word is set. ``group_len[g] == 0`` means "not grouped" and the program returns.

Both modes compute exactly the per-token definition of ``sparse_mla.mqa.reference``, in the same
pass: ``lse`` and ``max_logits`` (optional [T, H] fp32 outputs) come from the online softmax's final
row max m and sum l, and an optional per-head ``attn_sink`` [H] fp32 adds exp(attn_sink[h]) to the
denominator of out (in base 2: l + exp2(attn_sink[h] * log2(e) - m)), leaving lse and max_logits as
they are. A pseudo-head with no valid row stores out 0, lse -inf, max_logits -inf.

FP8 cache (``KV_FP8``, kv given as the uint8 rows [N, 656] of an ``fp8_ds_mla`` cache,
``sparse_mla.kv_format``): each gathered row's 512 bytes are bitcast to float8e4nv and converted by the
hardware (fp8 -> fp32), multiplied by the row's fp32 scale of their 128-value tile and rounded once to q's
dtype before the dots; the 64 RoPE values are read as bf16 from the same row and converted to q's dtype. The
same numbers as ``FP8_DS_MLA.dequantize(cache, q.dtype)``, so the kernel computes the definition on the
dequantized cache. An invalid or padding slot loads zero bytes and a zero scale (value 0, masked).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kv_format import FP8_DS_MLA
from ..online_softmax import online_softmax_step

LOG2E = 1.4426950408889634
D_V = 512
D_PE = 64
# fp8_ds_mla row layout, from sparse_mla.kv_format.FP8_DS_MLA: scales at byte 512 (one fp32 per 128 values), RoPE bf16
# at 528 (constexpr objects: a jit function may read only those globals)
FP8_SCALE_OFFSET = tl.constexpr(FP8_DS_MLA.scale_offset)
FP8_ROPE_OFFSET = tl.constexpr(FP8_DS_MLA.rope_offset)
FP8_TILE = tl.constexpr(FP8_DS_MLA.tile_size)


@triton.jit
def _load_fp8_nope(kv_row, offs_v, row_ok, out_dtype: tl.constexpr, SCALE_OFFSET: tl.constexpr, TILE: tl.constexpr):
    """[BLOCK_N, 512] dequantized NoPE values of fp8_ds_mla rows (kv_row: uint8 row pointers [BLOCK_N]):
    out_dtype(fp32(e4m3) * scale[c // TILE]); 0 where row_ok is false."""
    raw = tl.load(kv_row[:, None] + offs_v[None, :], mask=row_ok[:, None], other=0)
    sc_ptr = (kv_row + SCALE_OFFSET).to(tl.pointer_type(tl.float32), bitcast=True)
    s0 = tl.load(sc_ptr, mask=row_ok, other=0.0)[:, None]
    s1 = tl.load(sc_ptr + 1, mask=row_ok, other=0.0)[:, None]
    s2 = tl.load(sc_ptr + 2, mask=row_ok, other=0.0)[:, None]
    s3 = tl.load(sc_ptr + 3, mask=row_ok, other=0.0)[:, None]
    col = offs_v[None, :]
    scale = tl.where(col < TILE, s0, tl.where(col < 2 * TILE, s1, tl.where(col < 3 * TILE, s2, s3)))
    return (raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale).to(out_dtype)


@triton.jit(do_not_specialize=["num_splits", "stride_os", "stride_ls", "stride_ms"])  # one split variant for every S
def _sparse_mqa_fwd_kernel(
    Q, KV, IDX, TOPK_LEN, ROWS, BITS, ULEN, GROUP_START, GROUP_LEN, ROUTE, OUT, LSE, SINK, MAX_LOGITS,
    stride_qt, stride_qh, stride_kvn, stride_it, stride_rg, stride_ot, stride_oh, stride_lt, stride_mt,
    N, H, K, scale_log2, num_splits, stride_os, stride_ls, stride_ms,
    GROUPED: tl.constexpr, HAS_TOPK_LEN: tl.constexpr, HAS_ROUTE: tl.constexpr,
    HAS_PE: tl.constexpr, GROUP_HEADS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_V: tl.constexpr, D_PE: tl.constexpr,
    KV_FP8: tl.constexpr = False, KV_SPLIT: tl.constexpr = False,
):
    gid = tl.program_id(0)  # token / group on grid axis 0 (up to 2**31 - 1; axis 1 stops at 65535)
    pid_m = tl.program_id(1)
    sid = tl.program_id(2)  # the split of the list (KV_SPLIT; else 0)
    if GROUPED:
        glen = tl.load(GROUP_LEN + gid)
        t0 = tl.load(GROUP_START + gid)
        n_end = tl.load(ULEN + gid)
    else:
        glen = 1
        t0 = gid
        n_end = K
        if HAS_TOPK_LEN:
            n_end = tl.minimum(tl.maximum(tl.load(TOPK_LEN + gid), 0), K)
        if HAS_ROUTE:
            glen = (tl.load(ROUTE + gid) != 0).to(tl.int32)
    n_begin = 0
    if KV_SPLIT:
        # Split sid takes columns [sid * chunk, (sid + 1) * chunk) of the list's n_end, chunk a multiple of BLOCK_N;
        # it writes a partial (out normalized by its own sum, lse, max logit) at split offset sid of OUT / LSE /
        # MAX_LOGITS, merged by sparse_mla.mqa.split_combine. A split past the list's end writes an empty partial.
        chunk = tl.cdiv(tl.cdiv(n_end, num_splits), BLOCK_N) * BLOCK_N
        n_begin = sid * chunk
        n_end = tl.minimum(n_end, n_begin + chunk)
        OUT += sid.to(tl.int64) * stride_os
        LSE += sid.to(tl.int64) * stride_ls
        if MAX_LOGITS is not None:
            MAX_LOGITS += sid.to(tl.int64) * stride_ms
    if glen > 0:
        offs_p = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        qi = offs_p // H  # query of the group owning pseudo-head p
        hh = offs_p % H
        p_ok = (offs_p < GROUP_HEADS) & (qi < glen)
        tok = (t0 + qi).to(tl.int64)
        offs_v = tl.arange(0, D_V)
        q_row = Q + tok * stride_qt + hh * stride_qh
        q_nope = tl.load(q_row[:, None] + offs_v[None, :], mask=p_ok[:, None], other=0.0)
        if HAS_PE:
            offs_pe = tl.arange(0, D_PE)
            q_pe = tl.load(q_row[:, None] + D_V + offs_pe[None, :], mask=p_ok[:, None], other=0.0)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_V], tl.float32)
        for start_n in range(n_begin, n_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            in_list = offs_n < n_end
            if GROUPED:
                rows = tl.load(ROWS + gid.to(tl.int64) * stride_rg + offs_n, mask=in_list, other=-1)
                bits = tl.load(BITS + gid.to(tl.int64) * stride_rg + offs_n, mask=in_list, other=0)
                row_ok = in_list & (rows >= 0)
                allowed = (((bits[None, :] >> qi[:, None]) & 1) != 0) & row_ok[None, :]
            else:
                rows = tl.load(IDX + gid.to(tl.int64) * stride_it + offs_n, mask=in_list, other=-1)
                row_ok = in_list & (rows >= 0) & (rows < N)
                allowed = row_ok[None, :]
            kv_row = KV + rows.to(tl.int64) * stride_kvn  # stride_kvn in elements of KV (bytes for KV_FP8)
            if KV_FP8:
                kv_nope = _load_fp8_nope(kv_row, offs_v, row_ok, Q.dtype.element_ty, FP8_SCALE_OFFSET, FP8_TILE)
            else:
                kv_nope = tl.load(kv_row[:, None] + offs_v[None, :], mask=row_ok[:, None], other=0.0)
            qk = tl.dot(q_nope, tl.trans(kv_nope))
            if HAS_PE:
                if KV_FP8:
                    pe_row = (kv_row + FP8_ROPE_OFFSET).to(tl.pointer_type(tl.bfloat16), bitcast=True)
                    kv_pe = tl.load(pe_row[:, None] + offs_pe[None, :], mask=row_ok[:, None], other=0.0)
                    kv_pe = kv_pe.to(Q.dtype.element_ty)
                else:
                    kv_pe = tl.load(kv_row[:, None] + D_V + offs_pe[None, :], mask=row_ok[:, None], other=0.0)
                qk = tl.dot(q_pe, tl.trans(kv_pe), qk)
            qk = tl.where(allowed, qk * scale_log2, float("-inf"))
            p, alpha, m_new, l_i = online_softmax_step(qk, m_i, l_i)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(kv_nope.dtype), kv_nope, acc)
            m_i = m_new

        # l_i > 0 iff the pseudo-head saw a valid row (the row holding the max contributes exp2(0) = 1).
        has_any = l_i > 0.0
        denom = tl.where(has_any, l_i, 1.0)
        if SINK is not None:
            # The sink as one more key of value 0: exp2(sink * log2 e - m) in the row's scale; -inf adds 0,
            # +inf makes the denominator inf (out 0). A row with no valid key keeps out 0 (acc is 0).
            sink = tl.load(SINK + hh, mask=p_ok, other=float("-inf"))
            denom = denom + tl.where(has_any, tl.math.exp2(sink * 1.4426950408889634 - tl.where(has_any, m_i, 0.0)), 0.0)
        out = acc / denom[:, None]
        o_row = OUT + tok * stride_ot + hh * stride_oh
        tl.store(o_row[:, None] + offs_v[None, :], out.to(OUT.dtype.element_ty), mask=p_ok[:, None])
        if LSE is not None:
            lse = tl.where(has_any, (m_i + tl.math.log2(tl.where(has_any, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
            tl.store(LSE + tok * stride_lt + hh, lse, mask=p_ok)
        if MAX_LOGITS is not None:
            # m_i is max_j(sm_scale * log2(e) * q . k_j); back to natural units.
            max_logit = tl.where(has_any, m_i / 1.4426950408889634, float("-inf"))
            tl.store(MAX_LOGITS + tok * stride_mt + hh, max_logit, mask=p_ok)


def is_fp8_rows(kv: torch.Tensor) -> bool:
    """Whether a validated ``kv`` is the uint8 byte rows of an fp8_ds_mla cache (the validation turns
    ``kv_format="fp8_ds_mla"`` into exactly that; plain rows are bf16 / fp16)."""
    return kv.dtype == torch.uint8


def block_m_for_heads(num_pseudo_heads: int) -> int:
    """Pseudo-heads per program: the MMA minimum of 16, else the next power of two, at most 64."""
    return min(64, max(16, triton.next_power_of_2(num_pseudo_heads)))


# (BLOCK_N, num_warps, num_stages) per BLOCK_M, measured on the H200 (docs/notes/attention-triton.md, benchmarks/tune_triton.py).
LAUNCH_CONFIGS: dict[int, tuple[int, int, int]] = {
    16: (64, 4, 2),
    32: (64, 4, 2),
    64: (64, 8, 2),
    128: (64, 16, 2),
}


# The same per BLOCK_M for an fp8_ds_mla cache (KV_FP8), chosen from sm_90 compiles on the CPU, timed but not compared
# with alternatives on the H200 (results/kv-fp8-gluon-fewheads.json: 15.3 / 28.8 ms per token at 16 / 32 heads against
# 4.17 / 5.84 ms on a bf16 cache; on Hopper with bf16 q the FP8 cache runs the Gluon kernel instead). Chosen from compiles
# (Triton 3.6, ptxas -v): the dequantized tile passes through registers, so at 16 / 32 pseudo-heads 8 warps and
# BLOCK_N 32 spill least (16: 0 B and 105 KB of shared memory, 2 CTAs per SM, against 136 B / 192 KB for the bf16
# config; 32: 468 B against 2.2 KB). `python -m sparse_mla.bench.kv_fp8 --sweep-configs` times the alternatives.
LAUNCH_CONFIGS_FP8: dict[int, tuple[int, int, int]] = {
    16: (32, 8, 2),
    32: (32, 8, 2),
    64: (64, 8, 2),
    128: (64, 16, 2),
}


def _launch_config(block_m: int, config: tuple[int, int, int] | None, fp8: bool = False) -> tuple[int, int, int]:
    return config or (LAUNCH_CONFIGS_FP8 if fp8 else LAUNCH_CONFIGS)[block_m]


def _split_targets(out, lse, attn_sink, max_logits, kv_split):
    """(out, lse, attn_sink, max_logits, split args, grid depth) of a launch: the caller's tensors, or with
    ``kv_split`` (``sparse_mla.mqa.split_combine.SplitPartials``) its partial buffers, no sink (the combine applies
    it once) and one grid slice per split."""
    if kv_split is None:
        return out, lse, attn_sink, max_logits, (1, 0, 0, 0), 1
    part = kv_split
    ml = part.max_logits
    args = (part.num_splits, part.out.stride(1), part.lse.stride(1), ml.stride(1) if ml is not None else 0)
    return part.out[:, 0], part.lse[:, 0], None, (ml[:, 0] if ml is not None else None), args, part.num_splits


def sparse_mqa_per_token(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
    topk_length: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor | None,
    route: torch.Tensor | None = None, config: tuple[int, int, int] | None = None, *,
    attn_sink: torch.Tensor | None = None, max_logits: torch.Tensor | None = None, kv_split=None,
) -> None:
    """Launch the per-token kernel on validated inputs (see ``sparse_mla_fwd``).

    q [T, H, D_qk], kv [N, D_qk] in q's dtype or the uint8 rows [N, 656] of an fp8_ds_mla cache (then D_qk is
    576; ``is_fp8_rows``), indices [T, K] int32, out [T, H, 512] (written),
    lse [T, H] fp32 or None, route [T] int8/int32 or None (0 = skip the token);
    config overrides (BLOCK_N, num_warps, num_stages) for tuning. attn_sink [H] fp32 contiguous
    or None; max_logits [T, H] fp32 (row stride ``max_logits.stride(0)``, heads contiguous) or
    None (written when given); semantics in the module docstring. kv_split: a
    ``sparse_mla.mqa.split_combine.SplitPartials``: S programs per (token, head block) each take 1 / S of the
    token's list and write their partials there instead of out / lse / max_logits (attn_sink is then ignored:
    ``split_combine.combine_splits`` applies it).
    """
    T, H, D = q.shape
    if T == 0:
        return
    out, lse, attn_sink, max_logits, split_args, depth = _split_targets(out, lse, attn_sink, max_logits, kv_split)
    block_m = block_m_for_heads(H)
    block_n, warps, stages = _launch_config(block_m, config, is_fp8_rows(kv))
    grid = (T, triton.cdiv(H, block_m), depth)
    dummy = indices
    _sparse_mqa_fwd_kernel[grid](
        q, kv, indices, topk_length if topk_length is not None else dummy, dummy, dummy, dummy, dummy, dummy,
        route if route is not None else dummy, out, lse, attn_sink, max_logits,
        q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), 0, out.stride(0), out.stride(1),
        lse.stride(0) if lse is not None else 0, max_logits.stride(0) if max_logits is not None else 0,
        kv.shape[0], H, indices.shape[1], sm_scale * LOG2E, *split_args,
        GROUPED=False, HAS_TOPK_LEN=topk_length is not None, HAS_ROUTE=route is not None,
        HAS_PE=D > D_V, GROUP_HEADS=H,
        BLOCK_M=block_m, BLOCK_N=block_n, D_V=D_V, D_PE=D_PE, KV_FP8=is_fp8_rows(kv), KV_SPLIT=kv_split is not None,
        num_warps=warps, num_stages=stages,
    )


def sparse_mqa_grouped(
    q: torch.Tensor, kv: torch.Tensor, sm_scale: float, group_size: int,
    union_rows: torch.Tensor, union_bits: torch.Tensor, union_len: torch.Tensor,
    group_start: torch.Tensor, group_len: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
    block_m: int | None = None, config: tuple[int, int, int] | None = None, *,
    attn_sink: torch.Tensor | None = None, max_logits: torch.Tensor | None = None, kv_split=None,
) -> None:
    """Launch the grouped kernel: one program per (pseudo-head block, group[, split]).

    union_rows / union_bits [num_groups, U] int32, union_len / group_start / group_len
    [num_groups] int32 (group_len 0 = the group is not run here). block_m: pseudo-heads per
    program (default ``block_m_for_heads``; 128 puts a whole 128-row group in one program). kv as in
    ``sparse_mqa_per_token`` (plain rows or fp8_ds_mla bytes).
    attn_sink / max_logits / kv_split as in ``sparse_mqa_per_token`` (pseudo-head p uses attn_sink[p % H]; a
    split takes 1 / S of the group's union rows).
    """
    T, H, D = q.shape
    num_groups = group_start.shape[0]
    if num_groups == 0:
        return
    out, lse, attn_sink, max_logits, split_args, depth = _split_targets(out, lse, attn_sink, max_logits, kv_split)
    pseudo = group_size * H
    block_m = block_m or block_m_for_heads(pseudo)
    block_n, warps, stages = _launch_config(block_m, config, is_fp8_rows(kv))
    grid = (num_groups, triton.cdiv(pseudo, block_m), depth)
    _sparse_mqa_fwd_kernel[grid](
        q, kv, union_rows, union_rows, union_rows, union_bits, union_len, group_start, group_len, group_len, out, lse,
        attn_sink, max_logits,
        q.stride(0), q.stride(1), kv.stride(0), 0, union_rows.stride(0), out.stride(0), out.stride(1),
        lse.stride(0) if lse is not None else 0, max_logits.stride(0) if max_logits is not None else 0,
        kv.shape[0], H, union_rows.shape[1], sm_scale * LOG2E, *split_args,
        GROUPED=True, HAS_TOPK_LEN=False, HAS_ROUTE=False,
        HAS_PE=D > D_V, GROUP_HEADS=pseudo,
        BLOCK_M=block_m, BLOCK_N=block_n, D_V=D_V, D_PE=D_PE, KV_FP8=is_fp8_rows(kv), KV_SPLIT=kv_split is not None,
        num_warps=warps, num_stages=stages,
    )


def useful_flops(num_heads: int, valid_rows: int, d_qk: int, d_v: int = D_V) -> int:
    """Useful FLOPs of per-token sparse MLA: 2 * H * K_valid * (D_qk + D_v) summed over queries."""
    return 2 * num_heads * valid_rows * (d_qk + d_v)


__all__ = ["sparse_mqa_per_token", "sparse_mqa_grouped", "block_m_for_heads", "useful_flops", "is_fp8_rows",
           "LAUNCH_CONFIGS", "LAUNCH_CONFIGS_FP8"]
