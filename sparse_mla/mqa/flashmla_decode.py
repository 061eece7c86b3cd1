"""FlashMLA-compatible sparse decode: ``get_mla_metadata`` and ``flash_mla_with_kvcache``, a drop-in for FlashMLA's
sparse decode call (deepseek-ai/FlashMLA 9241ae3, ``flash_mla/flash_mla_interface.py``; its test
``tests/test_flash_mla_sparse_decoding.py`` defines the semantics this module reproduces).

Same call, same shapes, same outputs and conventions, so an engine swaps one import:

    # from flash_mla import get_mla_metadata, flash_mla_with_kvcache
    from sparse_mla import get_mla_metadata, flash_mla_with_kvcache
    meta, _ = get_mla_metadata()
    out, lse = flash_mla_with_kvcache(q, k_cache, None, None, 512, meta, softmax_scale=scale, is_fp8_kvcache=True,
                                      indices=indices, attn_sink=sink, topk_length=lens)

The call flattens the [b, s_q] queries to rows and runs ``sparse_mla.sparse_mla_fwd`` on the paged cache (backend
chosen by ``sparse_mla.mqa.backends``, split-KV count by ``sparse_mla.mqa.kv_splits``). The semantics are
``sparse_mla.mqa.reference`` with FlashMLA's conventions: lse +inf (not -inf) for a query with no valid index, lse
returned as a transposed [b, h_q, s_q] view. It differs from FlashMLA where FlashMLA refuses: any h_q >= 1 (FlashMLA:
64 or 128), a bf16 / fp16 cache as well as the FP8 one, topk not a multiple of 64, topk_length with d_qk 576, fp16 q,
a CPU run through Triton's interpreter. Not served (ValueError): the dense mode (indices=None), the second cache
(extra_k_cache, DeepSeek-V4) and FlashMLA's MODEL1 FP8 layout (d_qk 512, 584-byte rows).
``flash_mla_with_kvcache_ref`` is the fp32 reference of the call. FP8 rows: FlashMLA multiplies a value by its tile's
scale in bf16, this package in fp32 and rounds once (``sparse_mla.kv_format``): the same numbers for power-of-two
(ue8m0) scales, which FlashMLA's tests and vLLM's fp8_ds_mla cache use; other scales may differ by one bf16 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..checks import KERNEL_DTYPES, check_tensor, require_bool, require_finite_float, require_int, require_kernel_tensor
from ..kv_format import FP8_DS_MLA, FP8_DS_MLA_NAME
from ..union.grouping import default_group_size
from .checks import SUPPORTED_D_QK
from .flashmla_compat import _lse_flashmla_convention
from .interface import sparse_mla_fwd
from .kv_splits import require_kv_splits
from .reference import sparse_mla_ref

D_V = 512  # head_dim_v: the first 512 columns of a cache row (kv_lora_rank)
MODEL1_ROW_BYTES = 584  # FlashMLA's MODEL1 FP8 layout (d_qk 512): not served
FP8_CACHE_DTYPES = (torch.uint8, torch.float8_e4m3fn, torch.int8)
_INT32_MAX = 2**31 - 1
_CU_SEQLENS: dict[tuple[int, int, str], torch.Tensor] = {}


@dataclass(frozen=True)
class DecodeConfig:
    """The shape of one decode call, fixed for the life of a ``SparseMLADecodeMeta`` (FlashMLA's ``Config``)."""

    b: int
    s_q: int
    h_q: int
    page_block_size: int
    d: int
    is_fp8: bool
    topk: int
    dtype: torch.dtype


@dataclass
class SparseMLADecodeMeta:
    """What ``get_mla_metadata`` returns: FlashMLA's ``FlashMLASchedMeta`` role. FlashMLA computes its tile schedule
    on first use and asserts that later calls keep the shape; this package needs no schedule (the split count comes
    from the shape, ``sparse_mla.mqa.kv_splits``), so the object only records the first call's ``DecodeConfig`` and
    holds later calls to it: one object per layer shape, as with FlashMLA."""

    config: DecodeConfig | None = None

    @property
    def have_initialized(self) -> bool:
        """Whether a call has recorded its config (FlashMLA's field of that name)."""
        return self.config is not None


def get_mla_metadata(*args, **kwargs) -> tuple[SparseMLADecodeMeta, None]:
    """FlashMLA's ``get_mla_metadata``: ignores its arguments (kept by FlashMLA for backward compatibility) and
    returns ``(SparseMLADecodeMeta(), None)``, filled by the first ``flash_mla_with_kvcache`` call that uses it."""
    del args, kwargs
    return SparseMLADecodeMeta(), None


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output allocation of ``flash_mla_with_kvcache`` (one place, so tests can poison them)."""
    return torch.empty(shape, dtype=dtype, device=device)


@dataclass(frozen=True)
class _Call:
    """A validated call: the config, the cache as rows and the normalized scalars."""

    config: DecodeConfig
    rows: torch.Tensor  # [N, d] (bf16 / fp16 cache) or uint8 [N, 656] (fp8_ds_mla)
    rows_per_block: int | None  # None: row = indices entry; else the entry is remapped (padded blocks)
    num_blocks: int
    scale: float


def _refuse_unserved(indices, causal, num_splits, extra_k_cache, extra_indices_in_kvcache, extra_topk_length) -> None:
    """FlashMLA's modes this call does not serve, refused first (ValueError, before any launch)."""
    extra = {"extra_k_cache": extra_k_cache, "extra_indices_in_kvcache": extra_indices_in_kvcache,
             "extra_topk_length": extra_topk_length}
    given = [n for n, x in extra.items() if x is not None]
    if given:
        raise ValueError(f"{', '.join(given)}: the second KV cache (DeepSeek-V4's extra_k_cache with its own indices and "
                         "lengths) is not supported yet; pass None (one cache per call)")
    if indices is None:
        raise ValueError("indices=None is FlashMLA's dense decode (block_table / cache_seqlens); only the sparse mode is "
                         "served here: pass indices [b, s_q, topk] int32 of physical rows (block * page_block_size + "
                         "offset)")
    if require_bool("causal", causal):
        raise ValueError("causal=True: the sparse mode requires causal=False, as FlashMLA's does (the indices say which "
                         "rows each query sees)")
    if num_splits is not None:
        raise ValueError(f"num_splits must be None (FlashMLA also requires None; the split-KV count is chosen by "
                         f"sparse_mla_fwd's kv_splits rule, or forced with kv_splits=), got {num_splits!r}")


def _cache_rows(k3: torch.Tensor, name: str = "k_cache") -> tuple[torch.Tensor, int | None]:
    """A paged cache [num_blocks, page_block_size, width] as rows of its storage [N, width] (a view) and the rows per
    block stride when the blocks are farther apart than page_block_size rows (None: an index is its row).

    Raises:
        ValueError: overlapping rows, or a block stride that is not a multiple of the row stride or smaller than a block.
    """
    nb, bs, w = k3.shape
    s0, s1 = k3.stride(0), k3.stride(1)
    if nb <= 1 or bs <= 1 or s0 == bs * s1:
        if bs <= 1:
            return k3[:, 0] if bs == 1 else k3.reshape(0, w), None
        if nb == 0:
            return k3.reshape(0, w), None
        if s1 < w:
            raise ValueError(f"{name}: rows overlap (stride(1) = {s1} < the row width {w})")
        return k3.as_strided((nb * bs, w), (s1, 1)), None
    if s1 < w or s0 % s1 or s0 < bs * s1:
        raise ValueError(f"{name}: the block stride stride(0) = {s0} must be a multiple of the row stride stride(1) = "
                         f"{s1} (>= the row width {w}) and at least page_block_size * stride(1) = {bs * s1}")
    rpb = s0 // s1
    n = (nb - 1) * rpb + bs
    if n > _INT32_MAX:
        raise ValueError(f"{name}: its blocks span {n} rows of stride(1) elements, past int32 row indices")
    return k3.as_strided((n, w), (s1, 1)), rpb


def _validate(q, k_cache, head_dim_v, tile_scheduler_metadata, softmax_scale, is_fp8_kvcache, indices, attn_sink,
              topk_length, *, q_dtypes=KERNEL_DTYPES) -> _Call:
    """Every argument of the sparse mode checked before any launch; raises as ``flash_mla_with_kvcache`` says."""
    if tile_scheduler_metadata is not None and not isinstance(tile_scheduler_metadata, SparseMLADecodeMeta):
        raise TypeError("tile_scheduler_metadata must be what sparse_mla.get_mla_metadata() returns (a "
                        f"SparseMLADecodeMeta) or None, got {type(tile_scheduler_metadata).__name__}")
    fp8 = require_bool("is_fp8_kvcache", is_fp8_kvcache)
    if require_int("head_dim_v", head_dim_v) != D_V:
        raise ValueError(f"head_dim_v must be {D_V} (kv_lora_rank: V is the first 512 columns of a cache row), got "
                         f"{head_dim_v}")
    q = check_tensor("q", q, dims="[b, s_q, h_q, d]", dtype=q_dtypes, layout="last_dim")
    if q.dim() != 4 or q.shape[2] < 1:
        raise ValueError(f"q must be [b, s_q, h_q, d] with h_q >= 1, got shape {list(q.shape)}")
    b, s_q, h_q, d = q.shape
    if d not in SUPPORTED_D_QK:
        raise ValueError(f"q: d (last dim) must be one of {SUPPORTED_D_QK} (576: kv_lora_rank 512 + rope 64; 512), got {d}")
    dev = q.device
    k = check_tensor("k_cache", k_cache, dims="[num_blocks, page_block_size, h_k = 1, row]", device=dev,
                     layout="last_dim")
    if k.dim() != 4 or k.shape[2] != 1:
        raise ValueError(f"k_cache must be [num_blocks, page_block_size, h_k = 1, row] (MQA: one latent head, h_k = 1), "
                         f"got shape {list(k.shape)}")
    width = k.shape[3]
    if fp8:
        if d == 512 or width == MODEL1_ROW_BYTES:
            raise ValueError(f"is_fp8_kvcache=True with d = {d}, k_cache rows of {width} bytes: FlashMLA's MODEL1 FP8 "
                             f"layout (d 512, {MODEL1_ROW_BYTES}-byte rows) is not supported; use a bf16 cache "
                             f"(is_fp8_kvcache=False) or the {FP8_DS_MLA.row_bytes}-byte fp8_ds_mla layout with d = 576")
        if k.dtype not in FP8_CACHE_DTYPES:
            raise TypeError(f"k_cache with is_fp8_kvcache=True must be uint8 / float8_e4m3fn / int8 bytes, got {k.dtype}")
        k = FP8_DS_MLA.check(k.view(torch.uint8), "k_cache")  # 656-byte rows, 16-byte aligned
    else:
        if k.dtype in FP8_CACHE_DTYPES:
            raise TypeError(f"k_cache is {k.dtype} {list(k.shape)}: an FP8 cache? pass is_fp8_kvcache=True; without it "
                            f"k_cache holds latent rows in q's dtype ({q.dtype})")
        if k.dtype != q.dtype:
            raise TypeError(f"k_cache must have q's dtype ({q.dtype}) with is_fp8_kvcache=False, got {k.dtype}")
        if width != d:
            raise ValueError(f"k_cache rows must be d = {d} wide (q's last dim), got shape {list(k.shape)}")
    rows, rpb = _cache_rows(k[:, :, 0])
    idx = check_tensor("indices", indices, dims="[b, s_q, topk]", dtype=torch.int32, device=dev, layout="last_dim")
    if idx.dim() != 3 or tuple(idx.shape[:2]) != (b, s_q) or idx.shape[2] < 1:
        raise ValueError(f"indices must be [b, s_q, topk] = [{b}, {s_q}, topk >= 1] int32, got shape {list(idx.shape)}")
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dims="[b]", shape=(b,), dtype=torch.int32, device=dev)
    if attn_sink is not None:
        check_tensor("attn_sink", attn_sink, dims="[h_q]", shape=(h_q,), dtype=torch.float32, device=dev)
    scale = d ** -0.5 if softmax_scale is None else require_finite_float("softmax_scale", softmax_scale)
    cfg = DecodeConfig(b, s_q, h_q, k.shape[1], d, fp8, idx.shape[2], q.dtype)
    meta = tile_scheduler_metadata
    if meta is not None and meta.config is not None and meta.config != cfg:
        diff = ", ".join(f"{f.name} {getattr(meta.config, f.name)} -> {getattr(cfg, f.name)}" for f in fields(cfg)
                         if getattr(meta.config, f.name) != getattr(cfg, f.name))
        raise ValueError(f"tile_scheduler_metadata was first used with another shape ({diff}); as with FlashMLA, use one "
                         "get_mla_metadata() object per layer shape")
    return _Call(cfg, rows, rpb, k.shape[0], scale)


def _flat_indices(indices: torch.Tensor, c: _Call) -> torch.Tensor:
    """indices [b, s_q, topk] as rows [b * s_q, topk] of ``c.rows``: a view, or (blocks farther apart than a page)
    block * rows_per_block + offset, with every invalid entry (< 0 or >= num_blocks * page_block_size) -1."""
    cfg = c.config
    flat = indices.reshape(cfg.b * cfg.s_q, cfg.topk)
    if c.rows_per_block is None:
        return flat
    i = flat.long()
    blk = torch.div(i, cfg.page_block_size, rounding_mode="floor")
    row = blk * c.rows_per_block + (i - blk * cfg.page_block_size)
    valid = (i >= 0) & (i < c.num_blocks * cfg.page_block_size)
    return torch.where(valid, row, -1).to(torch.int32)


def _flat_lengths(topk_length: torch.Tensor | None, s_q: int) -> torch.Tensor | None:
    """topk_length [b] (one per request) as one per query row [b * s_q]."""
    if topk_length is None or s_q == 1:
        return topk_length
    return topk_length.repeat_interleave(s_q)


def _cu_seqlens(b: int, s_q: int, device: torch.device) -> torch.Tensor:
    """[0, s_q, 2 s_q, ..., b s_q] int32 on ``device``, kept per (b, s_q, device) (never dropped: a captured CUDA graph
    may hold it); made without caching during a capture, whose kernels do not run until replay."""
    key = (b, s_q, str(device))
    cu = _CU_SEQLENS.get(key)
    if cu is None:
        cu = torch.arange(0, (b + 1) * s_q, s_q, dtype=torch.int32, device=device) if s_q else \
            torch.zeros(b + 1, dtype=torch.int32, device=device)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _CU_SEQLENS[key] = cu
    return cu


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    head_dim_v: int,
    tile_scheduler_metadata: SparseMLADecodeMeta | None,
    num_splits: None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices_in_kvcache: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    *,
    kv_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode with FlashMLA's signature and conventions: query (i, t) of request i attends to the cache
    rows ``indices[i, t, :topk_length[i]]``.

    Semantics: ``flash_mla_with_kvcache_ref`` (= ``sparse_mla.mqa.reference.sparse_mla_ref`` on the [b * s_q] query
    rows, lse +inf for a query with no valid index); FlashMLA 9241ae3 ``flash_mla/flash_mla_interface.py`` and
    ``tests/test_flash_mla_sparse_decoding.py`` (its ``ref_sparse_attn_decode``). Every backend returns that result
    up to bf16 rounding and fp32 summation order.

    Args:
        q: [b, s_q, h_q, d] bf16 (fp16 also accepted), CUDA (or CPU fp16 under TRITON_INTERPRET=1); d = 576
            (kv_lora_rank 512 + rope 64) or 512. Any h_q >= 1 (FlashMLA: 64 or 128). Last dim contiguous.
        k_cache: the paged cache [num_blocks, page_block_size, h_k = 1, row] on q's device, last dim contiguous, any
            page_block_size; the block stride stride(0) is free (a multiple of stride(1), at least one block). With
            is_fp8_kvcache=False: q's dtype, row = d. With is_fp8_kvcache=True: the ``fp8_ds_mla`` layout (FlashMLA's
            V3.2 FP8 layout, ``sparse_mla.kv_format``), uint8 / float8_e4m3fn / int8, row = 656 bytes, 16-byte
            aligned rows, d = 576. V is the first 512 columns of each (dequantized) row.
        block_table, cache_seqlens: unused in the sparse mode (FlashMLA ignores them there too); any value.
        head_dim_v: 512 only.
        tile_scheduler_metadata: the object ``get_mla_metadata()`` returned (its first call records the shape; a
            later call with another shape raises, as FlashMLA asserts), or None (no check).
        num_splits: None only (FlashMLA asserts the same).
        softmax_scale: the scale multiplying q . k (a finite float); None: d ** -0.5 (d = q.shape[-1]).
        causal: False only in the sparse mode.
        is_fp8_kvcache: whether k_cache is the FP8 ``fp8_ds_mla`` cache (see k_cache).
        indices: [b, s_q, topk] int32 on q's device, last dim contiguous, any topk >= 1: flat physical rows
            block * page_block_size + offset (the block table already applied). An entry < 0 or >= num_blocks *
            page_block_size (-1, INT_MIN, INT_MAX, ...) is padding: never read, contributes nothing (FlashMLA reads
            any entry but -1). The valid entries of one list should be distinct (each counts as often as it appears).
        attn_sink: optional [h_q] float32 on q's device, a per-head sink logit in natural units:
            out *= 1 / (1 + exp(attn_sink[h] - lse)); -inf has no effect, +inf makes out 0. lse excludes it.
        extra_k_cache, extra_indices_in_kvcache, extra_topk_length: DeepSeek-V4's second cache: must be None.
        topk_length: optional [b] int32 on q's device, one per request shared by its s_q rows: only
            indices[i, t, :topk_length[i]] count (clamped to [0, topk]; 0 allowed); later entries are never read.
        kv_splits: this package's split-KV count (``sparse_mla_fwd``'s kv_splits): None (default: from the shape,
            ``sparse_mla.mqa.kv_splits``) or an int in [1, 64] forcing it.

    Method: ``sparse_mla_fwd`` on the b * s_q query rows with ``cu_seqlens_q`` = [0, s_q, ..., b s_q]; per token
    unless a request's s_q rows fill a group (s_q >= 128 // h_q), then ``method="auto"``. lse -> FlashMLA's +inf in
    one launch.

    Returns:
        (out, lse):
        out: [b, s_q, h_q, 512] in q's dtype, contiguous; 0 for a query with no valid index, whatever the sink.
        lse: [b, h_q, s_q] float32, a transposed view of a contiguous [b, s_q, h_q] (strides (s_q h_q, 1, h_q), as
            FlashMLA returns it): log(sum over valid j of exp(softmax_scale * q . k_j)), natural log, sink not
            included; +inf for a query with no valid index.

    Raises:
        TypeError: a non-tensor argument; q not bf16 / fp16; k_cache not q's dtype (or not uint8 / float8_e4m3fn /
            int8 with is_fp8_kvcache=True, or such bytes without it); indices / topk_length not int32; attn_sink not
            float32; a non-bool causal / is_fp8_kvcache; a non-int head_dim_v or kv_splits; a tile_scheduler_metadata
            that is not a ``SparseMLADecodeMeta``; bf16 under TRITON_INTERPRET=1.
        ValueError: the unserved modes (indices None, causal True, num_splits not None, any extra_* given, the MODEL1
            FP8 layout: is_fp8_kvcache with d 512 or 584-byte rows); q not [b, s_q, h_q, d] with d 512 / 576;
            k_cache not [num_blocks, page_block_size, 1, row] (h_k != 1) or rows of the wrong width or layout;
            indices not [b, s_q, topk]; topk_length not [b]; attn_sink not [h_q]; head_dim_v != 512; tensors on
            different devices; a non-contiguous last dim; a non-finite softmax_scale; kv_splits outside [1, 64];
            a metadata object first used with another shape; CPU tensors without TRITON_INTERPRET=1.
    """
    del block_table, cache_seqlens
    _refuse_unserved(indices, causal, num_splits, extra_k_cache, extra_indices_in_kvcache, extra_topk_length)
    c = _validate(q, k_cache, head_dim_v, tile_scheduler_metadata, softmax_scale, is_fp8_kvcache, indices, attn_sink,
                  topk_length)
    require_kv_splits(kv_splits)
    require_kernel_tensor("q", q)
    cfg = c.config
    T = cfg.b * cfg.s_q
    out = _empty((cfg.b, cfg.s_q, cfg.h_q, D_V), q.dtype, q.device)
    lse = _empty((cfg.b, cfg.s_q, cfg.h_q), torch.float32, q.device)
    method = "per_token" if cfg.s_q < default_group_size(cfg.h_q) else "auto"
    sparse_mla_fwd(q.reshape(T, cfg.h_q, cfg.d), c.rows, _flat_indices(indices, c), c.scale,
                   topk_length=_flat_lengths(topk_length, cfg.s_q), return_lse=True, method=method,
                   cu_seqlens_q=_cu_seqlens(cfg.b, cfg.s_q, q.device), out=out.view(T, cfg.h_q, D_V),
                   lse=lse.view(T, cfg.h_q), attn_sink=attn_sink, kv_format=FP8_DS_MLA_NAME if cfg.is_fp8 else None,
                   kv_splits=kv_splits)
    _lse_flashmla_convention(lse)  # FlashMLA: +inf for a query with no valid index
    if tile_scheduler_metadata is not None and tile_scheduler_metadata.config is None:
        tile_scheduler_metadata.config = cfg
    return out, lse.transpose(1, 2)


def flash_mla_with_kvcache_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    head_dim_v: int,
    tile_scheduler_metadata: SparseMLADecodeMeta | None = None,
    num_splits: None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices_in_kvcache: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 reference of ``flash_mla_with_kvcache`` (same arguments and checks; q and a non-FP8 cache may also be
    fp32, any device; tile_scheduler_metadata is checked against but never filled). ``sparse_mla_ref`` on the
    [b * s_q] query rows, as FlashMLA's ``ref_sparse_attn_decode``: an FP8 cache is dequantized to q's dtype first.

    Returns:
        (out [b, s_q, h_q, 512] float32, lse [b, h_q, s_q] float32 view as ``flash_mla_with_kvcache``'s), with its
        conventions (out 0 and lse +inf for a query with no valid index).

    Raises:
        TypeError, ValueError: as ``flash_mla_with_kvcache`` (the device and interpreter checks aside).
    """
    del block_table, cache_seqlens
    _refuse_unserved(indices, causal, num_splits, extra_k_cache, extra_indices_in_kvcache, extra_topk_length)
    c = _validate(q, k_cache, head_dim_v, tile_scheduler_metadata, softmax_scale, is_fp8_kvcache, indices, attn_sink,
                  topk_length, q_dtypes=(*KERNEL_DTYPES, torch.float32))
    cfg = c.config
    T = cfg.b * cfg.s_q
    out, lse = sparse_mla_ref(q.reshape(T, cfg.h_q, cfg.d), c.rows, _flat_indices(indices, c), c.scale, d_v=D_V,
                              topk_length=_flat_lengths(topk_length, cfg.s_q), attn_sink=attn_sink,
                              kv_format=FP8_DS_MLA_NAME if cfg.is_fp8 else None)
    lse = lse.masked_fill(lse == -float("inf"), float("inf")).view(cfg.b, cfg.s_q, cfg.h_q)
    return out.view(cfg.b, cfg.s_q, cfg.h_q, D_V), lse.transpose(1, 2)


__all__ = ["DecodeConfig", "SparseMLADecodeMeta", "get_mla_metadata", "flash_mla_with_kvcache",
           "flash_mla_with_kvcache_ref", "D_V", "MODEL1_ROW_BYTES"]
