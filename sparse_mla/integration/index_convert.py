"""Request-local top-k positions -> global latent-cache rows (the block-table conversion).

One program per query-token row ``t``; it loops over the row's K entries in BLOCK_K chunks:

    pos    = topk_local[t, j]                        (request-local position, -1 = padding)
    req    = req_id[t]                               (request of token t; -1 = a padded token row)
    blk    = block_table[req, pos // BLOCK_SIZE]     (physical block; negative = not allocated)
    out    = blk * rows_per_block_stride + pos % BLOCK_SIZE

and writes -1 wherever the position is negative, the request id is outside [0, num_reqs),
``pos // BLOCK_SIZE >= max_blocks``, the table entry is negative, or the row is not below
``num_kv_rows`` (which is at most 2**31 - 1, so every written row fits int32). Optionally it stores
the number of non -1 outputs of the row (computed in the program, no atomics, so the count buffer
needs no zeroing and the result is deterministic).

Integer arguments that change from step to step (token rows, requests, table width, K) are marked
``do_not_specialize`` so a new batch shape never compiles a new variant (see
``sparse_mla.integration.warmup``). Semantics: ``sparse_mla.integration.block_table.convert_req_index_to_global_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=[
    "stride_req", "stride_bt0", "stride_bt1", "stride_tk0", "stride_tk1", "stride_out0", "stride_out1", "stride_cnt",
    "num_reqs", "max_blocks", "K", "rows_per_block_stride", "num_kv_rows",
])
def _convert_req_index_kernel(
    REQ_ID, BLOCK_TABLE, TOPK, OUT, COUNTS,
    stride_req, stride_bt0, stride_bt1, stride_tk0, stride_tk1, stride_out0, stride_out1, stride_cnt,
    num_reqs, max_blocks, K, rows_per_block_stride, num_kv_rows,
    BLOCK_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, HAS_COUNTS: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    req = tl.zeros([BLOCK_K], tl.int32) + tl.load(REQ_ID + t * stride_req)  # as a vector: the interpreter rejects scalar & vector masks
    req_ok = (req >= 0) & (req < num_reqs)
    bt_row = BLOCK_TABLE + tl.where(req_ok, req, 0).to(tl.int64) * stride_bt0
    count = tl.zeros([BLOCK_K], tl.int32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        in_row = offs < K
        pos = tl.load(TOPK + t * stride_tk0 + offs.to(tl.int64) * stride_tk1, mask=in_row, other=-1)
        pos_ok = in_row & (pos >= 0) & req_ok
        pos_c = tl.where(pos_ok, pos, 0)  # non-negative: // and % are floor division here
        blk_idx = pos_c // BLOCK_SIZE
        ok = pos_ok & (blk_idx < max_blocks)
        blk = tl.load(bt_row + blk_idx.to(tl.int64) * stride_bt1, mask=ok, other=-1)
        ok = ok & (blk >= 0)
        row = blk.to(tl.int64) * rows_per_block_stride + (pos_c % BLOCK_SIZE)
        ok = ok & (row < num_kv_rows)
        tl.store(OUT + t * stride_out0 + offs.to(tl.int64) * stride_out1,
                 tl.where(ok, row, -1).to(tl.int32), mask=in_row)
        count += ok.to(tl.int32)
    if HAS_COUNTS:
        tl.store(COUNTS + t * stride_cnt, tl.sum(count, 0))


def block_k_for_topk(topk: int) -> int:
    """Entries per loop step: the next power of two of K, at most 1024."""
    return min(1024, triton.next_power_of_2(max(topk, 1)))


def convert_req_index(
    req_id: torch.Tensor, block_table: torch.Tensor, topk_local: torch.Tensor, out: torch.Tensor,
    counts: torch.Tensor | None, block_size: int, rows_per_block_stride: int, num_kv_rows: int,
) -> None:
    """Launch the conversion on validated tensors (``convert_req_index_to_global`` checks them).

    req_id [T] int32, block_table [B, max_blocks] int32, topk_local [T, K] int32, out [T, K] int32
    (written), counts [T] int32 or None (written), all on one device; any strides (a stride-0
    ``req_id`` reads one id for every row). The outputs must not overlap themselves or the inputs
    (``convert_req_index_to_global`` refuses such views).
    """
    T, K = topk_local.shape
    if T == 0:
        return
    B, max_blocks = block_table.shape
    block_k = block_k_for_topk(K)
    _convert_req_index_kernel[(T,)](
        req_id, block_table, topk_local, out, counts,
        req_id.stride(0), block_table.stride(0), block_table.stride(1), topk_local.stride(0), topk_local.stride(1),
        out.stride(0), out.stride(1), counts.stride(0) if counts is not None else 0,
        B, max_blocks, K, rows_per_block_stride, num_kv_rows,
        BLOCK_SIZE=block_size, BLOCK_K=block_k, HAS_COUNTS=counts is not None,
        num_warps=4 if block_k >= 512 else 2,
    )


__all__ = ["convert_req_index", "block_k_for_topk"]
