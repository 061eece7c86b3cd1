"""The staged route for an FP8 cache: dequantize the rows a step can read into a workspace of q's dtype, then run
the bf16 / fp16 kernels on it; and the measured rule that chooses it over dequantizing in the kernel's gather.

Both routes compute the same numbers: ``dequantize_rows`` writes exactly ``FP8_DS_MLA.dequantize(cache, dtype)``
(kv_c = dtype(fp32(e4m3) * scale), one rounding; k_pe = dtype(bf16)), which is also what the kernels' in-gather
dequantization reads, so the result is the definition on the dequantized cache either way
(``sparse_mla.mqa.reference``). Which rows are staged is the caller's: the op stages the whole cache it is given
(indices unchanged), the layer each request's window (indices moved to the window rows).

``choose_kv_dequant`` (plain Python, CPU-tested) is the one rule: stage when the staging's cost (rows staged)
is below the in-kernel dequantization's extra cost (rows the attention gathers), and the staged rows fit the
memory the caller allows (``max_staged_bytes``; 0 = never stage). Its constants are H200 measurements:
docs/notes/default-call.md, results/op-final.json.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .choices import Choice
from .kv_format import FP8_DS_MLA, KV_DEQUANT_MODES
from .launch_cache import LaunchCache

# H200, bf16 q, D_qk 576: dequantizing in the gather adds about 0.16 ns per gathered row on the per-token path (6.45
# vs 3.87 ms for 8192 x 2048 rows at 16 heads; results/fp8-route-probe.json) and 0.38 ns per union row on the grouped
# one; the staged route adds STAGE_FIXED_NS plus STAGE_NS_PER_ROW per staged row to the bf16 call (results/op-a1.json:
# +0.03 ms for 24.6K rows at 8K tokens, +0.125 ms for 33K rows at 256 tokens, where the in-kernel route added 0.016 ms).
INKERNEL_NS_PER_GATHERED_ROW = 0.16
STAGE_NS_PER_ROW = 1.5
STAGE_FIXED_NS = 40_000
# Rows a grouped call gathers, as a multiple of its queries' list rows over G: the estimate of the FP8 route and of the
# split count (the "mid" lists' union ratio at G = 8, results/history/op-recon-7c35494.json).
GROUPED_UNION_RATIO_ESTIMATE = 1.4
# Staging allocates [rows, 576] of q's dtype per call unless the caller passes a buffer; above this it never stages.
DEFAULT_MAX_STAGED_BYTES = 4 * 2**30


def estimated_union_rows(list_rows: int, group_size: int) -> int:
    """Rows the attention gathers for lists holding ``list_rows`` valid entries in all: ``list_rows`` per token
    (``group_size`` 1), about ``list_rows / G * GROUPED_UNION_RATIO_ESTIMATE`` union rows grouped."""
    return list_rows if group_size <= 1 else int(list_rows / group_size * GROUPED_UNION_RATIO_ESTIMATE)


def choose_kv_dequant(mode: str, staged_rows: int, list_rows: int, row_bytes: int,
                      max_staged_bytes: int | None = None, *, group_size: int = 1) -> Choice:
    """``Choice("staged" | "in_kernel", reason)`` for an FP8 cache: the one rule of the op and the layer.

    Args:
        mode: "auto" (the rule), "in_kernel" (never stage: no workspace memory), "staged" (always, if it fits).
        staged_rows: rows the staged route dequantizes (the cache given to the op; the windows in the layer).
        list_rows: valid entries of every query's list (what the attention gathers per token).
        row_bytes: bytes of one staged row (576 x q's element size).
        max_staged_bytes: the memory the caller allows for the staged rows (None: ``DEFAULT_MAX_STAGED_BYTES``).
        group_size: queries per group of a grouped call (1: per token); grouped, the kernel gathers
            ``estimated_union_rows(list_rows, group_size)``.

    Raises:
        ValueError: an unknown mode; mode "staged" when the rows exceed ``max_staged_bytes``.
    """
    if mode not in KV_DEQUANT_MODES:
        raise ValueError(f"kv_dequant must be one of {KV_DEQUANT_MODES}, got {mode!r}")
    limit = DEFAULT_MAX_STAGED_BYTES if max_staged_bytes is None else max_staged_bytes
    nbytes = staged_rows * row_bytes
    if mode == "in_kernel":
        return Choice("in_kernel", "kv_dequant='in_kernel'")
    fits = nbytes <= limit
    if mode == "staged":
        if not fits:
            raise ValueError(f"kv_dequant='staged' needs {nbytes} bytes for {staged_rows} staged rows, more than the "
                             f"{limit} allowed (max_staged_bytes)")
        return Choice("staged", "kv_dequant='staged'")
    if not fits:
        return Choice("in_kernel", f"{staged_rows} staged rows ({nbytes / 2**20:.0f} MiB) exceed the "
                                   f"{limit / 2**20:.0f} MiB allowed")
    gathered_rows = estimated_union_rows(list_rows, group_size)
    stage_ns = STAGE_FIXED_NS + staged_rows * STAGE_NS_PER_ROW
    extra_ns = gathered_rows * INKERNEL_NS_PER_GATHERED_ROW
    if stage_ns <= extra_ns:
        return Choice("staged", f"staging {staged_rows} rows (~{stage_ns / 1e3:.0f} us) costs less than dequantizing "
                                f"{gathered_rows} gathered rows in the kernel (~{extra_ns / 1e3:.0f} us)")
    return Choice("in_kernel", f"dequantizing {gathered_rows} gathered rows in the kernel (~{extra_ns / 1e3:.0f} us) "
                               f"costs less than staging {staged_rows} rows (~{stage_ns / 1e3:.0f} us)")


@triton.jit(do_not_specialize=["n_rows", "stride_src", "stride_dst"])
def _dequant_rows_kernel(src, row_ids, n_rows, dst, stride_src, stride_dst, HAS_IDS: tl.constexpr,
                         BLOCK_R: tl.constexpr, NOPE: tl.constexpr, TILE: tl.constexpr, ROPE: tl.constexpr,
                         SCALE_OFFSET: tl.constexpr, ROPE_OFFSET: tl.constexpr):
    """Rows r0 .. r0 + BLOCK_R - 1 of the output: dst[r] = dequantized src row (row_ids[r] if HAS_IDS else r)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = r < n_rows
    if HAS_IDS:
        srow = tl.load(row_ids + r, mask=ok, other=0).to(tl.int64)
    else:
        srow = r.to(tl.int64)
    base = src + srow * stride_src  # uint8 row pointers [BLOCK_R]
    out = dst + r.to(tl.int64) * stride_dst
    cols = tl.arange(0, TILE)
    for t in tl.static_range(NOPE // TILE):
        raw = tl.load(base[:, None] + t * TILE + cols[None, :], mask=ok[:, None], other=0)
        sc = tl.load((base + SCALE_OFFSET + 4 * t).to(tl.pointer_type(tl.float32), bitcast=True), mask=ok, other=0.0)
        v = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc[:, None]
        tl.store(out[:, None] + t * TILE + cols[None, :], v.to(dst.dtype.element_ty), mask=ok[:, None])
    pc = tl.arange(0, ROPE)
    pe = tl.load((base + ROPE_OFFSET).to(tl.pointer_type(tl.bfloat16), bitcast=True)[:, None] + pc[None, :],
                 mask=ok[:, None], other=0.0)
    tl.store(out[:, None] + NOPE + pc[None, :], pe.to(dst.dtype.element_ty), mask=ok[:, None])


def dequantize_rows(cache_rows: torch.Tensor, dtype: torch.dtype, rows: torch.Tensor | slice | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """The staged rows: ``FP8_DS_MLA.dequantize(cache_rows[rows], dtype)`` in one kernel.

    Args:
        cache_rows: uint8 [N, 656] rows of an fp8_ds_mla cache (validated: ``FP8_DS_MLA.as_rows``), CUDA or CPU
            under TRITON_INTERPRET=1.
        dtype: bf16 or fp16 (q's dtype).
        rows: None (every row), a slice of rows, or a 1-D int tensor of row ids in [0, N) on the cache's device.
        out: optional [L, 576] ``dtype`` destination (row stride free, last dim contiguous).

    Returns:
        [L, 576] ``dtype``, L = the rows selected.

    Raises:
        ValueError: cache_rows not uint8 [N, 656]; out of another shape / dtype / device; a non-unit slice step.
    """
    fmt = FP8_DS_MLA
    if cache_rows.dtype != torch.uint8 or cache_rows.dim() != 2 or cache_rows.shape[1] != fmt.row_bytes:
        raise ValueError(f"cache_rows must be uint8 [N, {fmt.row_bytes}], got {cache_rows.dtype} {tuple(cache_rows.shape)}")
    ids = None
    src = cache_rows
    if isinstance(rows, slice):
        start, stop, step = rows.indices(cache_rows.shape[0])
        if step != 1:
            raise ValueError(f"rows as a slice must have step 1, got {step}")
        src = cache_rows[start:stop]
    elif rows is not None:
        ids = rows.to(torch.int32) if rows.dtype != torch.int32 else rows
    n = src.shape[0] if ids is None else ids.shape[0]
    if out is None:
        out = torch.empty(n, fmt.d_qk, dtype=dtype, device=cache_rows.device)
    elif out.shape != (n, fmt.d_qk) or out.dtype != dtype or out.device != cache_rows.device or out.stride(1) != 1:
        raise ValueError(f"out must be [{n}, {fmt.d_qk}] {dtype} on {cache_rows.device} with contiguous rows, got "
                         f"{out.dtype} {tuple(out.shape)} strides {out.stride()} on {out.device}")
    if n == 0:
        return out
    BLOCK_R = 8
    _DEQUANT((dtype, ids is not None), (triton.cdiv(n, BLOCK_R), ),
             (src, ids if ids is not None else src, n, out, src.stride(0), out.stride(0)),
             dict(HAS_IDS=ids is not None, BLOCK_R=BLOCK_R, NOPE=fmt.kv_lora_rank, TILE=fmt.tile_size,
                  ROPE=fmt.qk_rope_head_dim, SCALE_OFFSET=fmt.scale_offset, ROPE_OFFSET=fmt.rope_offset),
             dict(num_warps=4))
    return out


# The key: the destination dtype and HAS_IDS (which also fixes row_ids' dtype); the integers are not specialized;
# the pointers' alignment joins the key.
_DEQUANT = LaunchCache(namespace=globals(), name="_dequant_rows_kernel", align=(0, 1, 3))


__all__ = ["KV_DEQUANT_MODES", "GROUPED_UNION_RATIO_ESTIMATE", "INKERNEL_NS_PER_GATHERED_ROW", "STAGE_NS_PER_ROW",
           "STAGE_FIXED_NS", "DEFAULT_MAX_STAGED_BYTES", "choose_kv_dequant", "dequantize_rows", "estimated_union_rows"]
