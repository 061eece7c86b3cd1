"""From an engine's request-level view to ``sparse_mla_fwd``'s global rows: paged caches and block tables.

Engines (vLLM, SGLang) hold the latent cache in pages and the indexer's top-k as request-local
positions. Two steps make that a ``sparse_mla_fwd`` call:

1. ``paged_kv_as_rows``: view the paged cache ``[num_blocks, block_size, D_qk]`` as rows
   ``[N, D_qk]`` of its underlying storage, also when the block stride is larger than
   ``block_size * D_qk`` (other layers' pages in between, e.g. a cross-layer page layout
   ``[num_blocks, num_layers, block_size, D_qk]`` indexed at one layer). Row ``r`` of the view is
   ``kv_cache.storage[storage_offset + r * row_stride : ... + D_qk]``; physical block ``b`` starts
   at row ``b * rows_per_block_stride`` with ``rows_per_block_stride = kv_cache.stride(0) /
   kv_cache.stride(1)``. The rows between two blocks belong to other layers; the conversion never
   produces them.
2. ``convert_req_index_to_global``: map each request-local position to the global row
   ``block_table[req_id[t], pos // block_size] * rows_per_block_stride + pos % block_size``.

Then ``sparse_mla_fwd(q, rows, global_indices, sm_scale, cu_seqlens_q=...)``.

FP8 cache (vLLM's ``fp8_ds_mla``: uint8 [num_blocks, block_size, 656]; FlashMLA's float8_e4m3fn
[num_blocks, block_size, 1, 656]): ``paged_kv_as_rows(kv_cache, kv_format="fp8_ds_mla")`` gives its uint8 byte
rows [N, 656] the same way, the indices convert as for any cache, and ``sparse_mla_fwd(q, rows, indices,
sm_scale, kv_format="fp8_ds_mla")`` reads them (``sparse_mla.kv_format``).

CUDA-graph padding (a step padded to a captured token count): give the padded token rows
``req_id = -1``; their converted indices are all -1 (and their valid count 0), so
``sparse_mla_fwd`` writes ``out = 0`` and ``lse = -inf`` for them. A dummy request whose
block-table row is all -1 has the same effect. Cover the padded rows in ``cu_seqlens_q`` too (its
last entry must be the padded T: a trailing dummy request, or the last request extended).
"""

from __future__ import annotations

import torch

from .. import env
from ..checks import check_tensor, require_bool, require_disjoint, require_int
from ..kv_format import KV_FORMATS, check_kv_format

INT32_MAX = 2**31 - 1


def paged_kv_as_rows(kv_cache: torch.Tensor, *, kv_format: str | None = None) -> tuple[torch.Tensor, int]:
    """View a paged latent cache as rows of its storage, for ``sparse_mla_fwd``'s ``kv`` [N, D_qk].

    Args:
        kv_cache: [num_blocks, block_size, D_qk] any dtype and device, last dim contiguous
            (stride 1); the block stride ``stride(0)`` must be a multiple of the row stride
            ``stride(1)`` and at least ``block_size * stride(1)`` (blocks do not overlap). Block
            strides larger than ``block_size * D_qk`` (other layers' pages in between) are fine.
            With kv_format="fp8_ds_mla": the FP8 cache, uint8 or float8_e4m3fn [num_blocks, block_size,
            656] (or FlashMLA's [num_blocks, block_size, 1, 656]), rows 16-byte aligned
            (``sparse_mla.kv_format.FP8DSMLAFormat.check``).
        kv_format: None (rows of latent values, any dtype) or "fp8_ds_mla".

    Returns:
        rows: [N, D_qk] view (no copy) of the same storage with strides ``(stride(1), 1)``, where
            N = (num_blocks - 1) * rows_per_block_stride + block_size; row
            ``b * rows_per_block_stride + i`` is ``kv_cache[b, i]``. For an FP8 cache: its uint8 bytes
            [N, 656], to pass with ``kv_format="fp8_ds_mla"``.
        rows_per_block_stride: ``stride(0) // stride(1)``, the value to pass as
            ``kv_block_stride_rows`` to ``convert_req_index_to_global``.

    Raises:
        TypeError: kv_cache is not a tensor; an FP8 cache of another dtype; a kv_format that is neither
            None nor a string.
        ValueError: kv_cache is not 3-D (FP8: 3-D or [num_blocks, block_size, 1, 656]), has no blocks, a
            last dim that is not contiguous, or a block stride that is not a multiple of the row stride /
            smaller than a block; an unknown kv_format; an FP8 cache whose rows are not 656 bytes or not
            16-byte aligned.
    """
    if check_kv_format(kv_format) is not None:
        kv_cache = KV_FORMATS[kv_format].check(kv_cache, "kv_cache")
        if kv_cache.dim() == 4:
            if kv_cache.shape[2] != 1:
                raise ValueError(f"kv_cache given as [num_blocks, block_size, h_k, 656] (FlashMLA's layout) needs h_k = 1, "
                                 f"got shape {tuple(kv_cache.shape)}")
            kv_cache = kv_cache[:, :, 0]
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"kv_cache must be a torch.Tensor, got {type(kv_cache).__name__}")
    if kv_cache.dim() != 3:
        raise ValueError(f"kv_cache must be [num_blocks, block_size, D_qk], got shape {tuple(kv_cache.shape)}")
    num_blocks, block_size, d = kv_cache.shape
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"kv_cache must have num_blocks >= 1 and block_size >= 1, got shape {tuple(kv_cache.shape)}")
    s_block, s_row, s_col = kv_cache.stride()
    if s_col != 1:
        raise ValueError(f"kv_cache must be contiguous in its last dim (stride 1), got strides {kv_cache.stride()}")
    if s_row < d or s_block % s_row != 0 or s_block < block_size * s_row:
        raise ValueError(
            f"kv_cache: block stride {s_block} must be a multiple of the row stride {s_row} (>= D_qk = {d}) and "
            f">= block_size * row stride = {block_size * s_row}; got strides {kv_cache.stride()}"
        )
    rows_per_block_stride = s_block // s_row
    n = (num_blocks - 1) * rows_per_block_stride + block_size
    rows = torch.as_strided(kv_cache, (n, d), (s_row, 1), kv_cache.storage_offset())
    return rows, rows_per_block_stride


def _check_int32(name: str, x: object, shape_doc: str) -> torch.Tensor:
    return check_tensor(name, x, dims=shape_doc, dtype=torch.int32)


def validate_convert_args(
    req_id: torch.Tensor, block_table: torch.Tensor, topk_local: torch.Tensor, block_size: int,
    kv_block_stride_rows: int | None, num_kv_rows: int | None,
) -> tuple[int, int]:
    """Check the arguments of ``convert_req_index_to_global`` (no device sync). Every tensor may have
    any strides (the kernel reads through them, a stride-0 ``req_id`` included).

    Returns:
        (rows_per_block_stride, num_kv_rows bound) as used by the kernel.

    Raises:
        TypeError, ValueError: as ``convert_req_index_to_global``.
    """
    req_id = _check_int32("req_id", req_id, "[T]")
    block_table = _check_int32("block_table", block_table, "[B, max_blocks]")
    topk_local = _check_int32("topk_local", topk_local, "[T, K]")
    if req_id.dim() != 1:
        raise ValueError(f"req_id must be [T] (one request id per token row), got shape {list(req_id.shape)}")
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be [B, max_blocks], got shape {list(block_table.shape)}")
    if topk_local.dim() != 2:
        raise ValueError(f"topk_local must be [T, K], got shape {list(topk_local.shape)}")
    if topk_local.shape[0] != req_id.shape[0]:
        raise ValueError(
            f"topk_local has {topk_local.shape[0]} token rows but req_id has {req_id.shape[0]}: they must match "
            "(pass the req_id slice of the same tokens, e.g. the decode-only or prefill-only part of the batch)"
        )
    if topk_local.shape[1] < 1:
        raise ValueError(f"topk_local must have K >= 1 entries per row, got shape {list(topk_local.shape)}")
    for name, t in (("req_id", req_id), ("block_table", block_table)):
        if t.device != topk_local.device:
            raise ValueError(f"{name} is on {t.device} but topk_local is on {topk_local.device}; all must share one device")
    block_size = require_int("block_size", block_size, minimum=1)
    if kv_block_stride_rows is None:
        stride_rows = block_size
    else:
        stride_rows = require_int("kv_block_stride_rows", kv_block_stride_rows, minimum=1)
        if stride_rows < block_size:
            raise ValueError(f"kv_block_stride_rows ({stride_rows}) must be >= block_size ({block_size}): blocks would overlap")
    if num_kv_rows is None:
        bound = INT32_MAX
    else:
        bound = min(require_int("num_kv_rows", num_kv_rows, minimum=1), INT32_MAX)
    return stride_rows, bound


def _require_kernel_device(x: torch.Tensor) -> None:
    if x.device.type == "cuda" or (x.device.type == "cpu" and env.interpreted()):
        return
    raise ValueError(
        f"topk_local is on {x.device}: the Triton converter needs a CUDA device, or CPU tensors with "
        "TRITON_INTERPRET=1 set before sparse_mla's kernels are imported; convert_req_index_to_global_ref runs anywhere"
    )


def convert_req_index_to_global(
    req_id: torch.Tensor,
    block_table: torch.Tensor,
    topk_local: torch.Tensor,
    block_size: int,
    *,
    kv_block_stride_rows: int | None = None,
    num_kv_rows: int | None = None,
    out: torch.Tensor | None = None,
    return_valid_counts: bool = False,
    valid_counts: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Map request-local top-k positions to global latent-cache rows through a block table (Triton).

    ``out[t, j] = block_table[req_id[t], p // block_size] * kv_block_stride_rows + p % block_size``
    with ``p = topk_local[t, j]``; ``out[t, j] = -1`` where p < 0, ``req_id[t]`` is outside
    [0, B) (a padded token row; -1 is the documented padding value), ``p // block_size >=
    max_blocks``, the table entry is negative (an unallocated block), or the row is not below
    ``num_kv_rows``. The same mapping as vLLM's ``triton_convert_req_index_to_global_index``, plus
    the block stride. Semantics: ``convert_req_index_to_global_ref``. Allocation-free (CUDA-graph
    safe) when ``out`` is given, and ``valid_counts`` too if the counts are wanted.

    Args:
        req_id: [T] int32, the request (block-table row) of each token row; same device as
            topk_local, any stride (a stride-0 expanded view gives every row one request). Any value
            outside [0, B) marks a padded row (all outputs -1).
        block_table: [B, max_blocks] int32 physical block ids per request; negative = none. Any strides.
        topk_local: [T, K] int32 request-local positions (0-based within the request), -1 = padding.
            CUDA (or CPU under TRITON_INTERPRET=1). Any strides.
        block_size: tokens per cache block (e.g. 64), a positive int.
        kv_block_stride_rows: rows of the flat row view between the starts of two consecutive
            physical blocks (``paged_kv_as_rows``'s second result); default ``block_size`` (a
            contiguous paged cache). Must be >= block_size.
        num_kv_rows: optional N of the row view; rows >= N become -1 (default: 2**31 - 1, so the
            int32 output never overflows).
        out: optional [T, K] int32 output on topk_local's device (any strides, but no two elements
            sharing memory, and not overlapping an input or valid_counts); allocated when None.
        return_valid_counts: also return ``valid_counts`` [T] int32, the number of non -1 entries
            of each output row (vLLM's meaning). It equals ``sparse_mla_fwd``'s ``topk_length`` only
            when each row's valid entries come first (the usual indexer layout); passing it as
            topk_length otherwise drops valid entries, so pass ``topk_length=None`` then.
        valid_counts: optional preallocated [T] int32 for the counts (any stride, its own memory;
            written whenever given; allocated when None and return_valid_counts).

    Returns:
        out [T, K] int32 global rows (-1 = padding), or (out, valid_counts) with return_valid_counts.

    Raises:
        TypeError: a non-tensor or non-int32 req_id / block_table / topk_local / out / valid_counts;
            block_size / kv_block_stride_rows / num_kv_rows that are not ints (a bool or a float is
            refused); a non-bool return_valid_counts.
        ValueError: req_id not [T], block_table not 2-D, topk_local not [T, K], a token-row count of
            topk_local that differs from req_id's, tensors on different devices, block_size /
            kv_block_stride_rows / num_kv_rows < 1, kv_block_stride_rows < block_size, a wrong out /
            valid_counts shape or device, an out / valid_counts whose elements share memory (an
            expanded view) or that overlaps an input or the other output, or a device the kernel
            cannot run on. All before any launch.
    """
    stride_rows, bound = validate_convert_args(req_id, block_table, topk_local, block_size, kv_block_stride_rows, num_kv_rows)
    require_bool("return_valid_counts", return_valid_counts)
    T, K = topk_local.shape
    dev = topk_local.device
    if out is not None:
        check_tensor("out", out, dims="[T, K]", shape=(T, K), dtype=torch.int32, device=dev, writable=True)
    if valid_counts is not None:
        check_tensor("valid_counts", valid_counts, dims="[T]", shape=(T,), dtype=torch.int32, device=dev, writable=True)
    require_disjoint({"out": out, "valid_counts": valid_counts},
                     {"req_id": req_id, "block_table": block_table, "topk_local": topk_local})
    _require_kernel_device(topk_local)
    if out is None:
        out = torch.empty(T, K, dtype=torch.int32, device=dev)
    counts = valid_counts
    if counts is None and return_valid_counts:
        counts = torch.empty(T, dtype=torch.int32, device=dev)
    from .index_convert import convert_req_index

    convert_req_index(req_id, block_table, topk_local, out, counts, block_size, stride_rows, bound)
    return (out, counts) if return_valid_counts else out


def convert_req_index_to_global_ref(
    req_id: torch.Tensor,
    block_table: torch.Tensor,
    topk_local: torch.Tensor,
    block_size: int,
    *,
    kv_block_stride_rows: int | None = None,
    num_kv_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference of ``convert_req_index_to_global`` (any device, int64 arithmetic).

    Same arguments and rules as ``convert_req_index_to_global``.

    Returns:
        (out [T, K] int32 global rows with -1 for padding, valid_counts [T] int32 non -1 entries per row).

    Raises:
        TypeError, ValueError: as ``convert_req_index_to_global`` (no device restriction).
    """
    stride_rows, bound = validate_convert_args(req_id, block_table, topk_local, block_size, kv_block_stride_rows, num_kv_rows)
    B, max_blocks = block_table.shape
    pos = topk_local.long()
    req = req_id.long()[:, None].expand_as(pos)
    blk_idx = torch.div(pos.clamp(min=0), block_size, rounding_mode="floor")
    ok = (pos >= 0) & (req >= 0) & (req < B) & (blk_idx < max_blocks)
    if B > 0 and max_blocks > 0:
        blk = block_table.long()[torch.where(ok, req, 0), torch.where(ok, blk_idx, 0)]
    else:
        blk = torch.full_like(pos, -1)
    ok &= blk >= 0
    row = blk * stride_rows + pos.clamp(min=0) % block_size
    ok &= row < bound
    out = torch.where(ok, row, -1).to(torch.int32)
    return out, ok.sum(dim=1, dtype=torch.int32)


__all__ = [
    "paged_kv_as_rows",
    "convert_req_index_to_global",
    "convert_req_index_to_global_ref",
    "validate_convert_args",
]
