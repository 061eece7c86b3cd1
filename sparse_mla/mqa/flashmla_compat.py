"""FlashMLA-compatible sparse prefill: ``flash_mla_sparse_fwd``, a drop-in for
``flash_mla.flash_mla_sparse_fwd`` (deepseek-ai/FlashMLA, ``flash_mla/flash_mla_interface.py``).

Same call, same shapes, same outputs and conventions, so an engine swaps one import:

    # from flash_mla import flash_mla_sparse_fwd
    from sparse_mla import flash_mla_sparse_fwd
    out, max_logits, lse = flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=sink, topk_length=lens)

It runs the package's own sparse MQA kernels (``sparse_mla.sparse_mla_fwd``, backend chosen by
``sparse_mla.mqa.backends``) and differs from FlashMLA only where FlashMLA refuses: any head count
h_q >= 1 (FlashMLA: 64 or 128), fp16 as well as bf16, and a CPU run through Triton's interpreter.
The semantics are ``sparse_mla.mqa.reference`` with one convention changed: lse is +inf (not
-inf) for a query with no valid index. ``flash_mla_sparse_ref`` is the fp32 reference of this call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..call_cache import replayed
from ..kv_format import looks_like_fp8_ds_mla
from ..launch_cache import LaunchCache
from .interface import sparse_mla_fwd
from .reference import sparse_mla_ref

_INF = float("inf")


@triton.jit(do_not_specialize=["n"])
def _lse_empty_to_pos_inf_kernel(LSE, n, BLOCK: tl.constexpr):
    """lse[i] = +inf where lse[i] = -inf (FlashMLA's convention for a query with no valid index), in place."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(LSE + offs, mask=m, other=0.0)
    tl.store(LSE + offs, tl.where(x == float("-inf"), float("inf"), x), mask=m)


_LSE_FIX = LaunchCache(namespace=globals(), name="_lse_empty_to_pos_inf_kernel", align=(0, ))
_LSE_BLOCK = 1024


def _lse_flashmla_convention(lse: torch.Tensor) -> None:
    """In place on the contiguous fp32 lse ``sparse_mla_fwd`` allocated: -inf -> +inf, one launch."""
    n = lse.numel()
    if n:
        _LSE_FIX((), (triton.cdiv(n, _LSE_BLOCK), ), (lse, n), dict(BLOCK=_LSE_BLOCK))


def _flashmla_layout(q: object, kv: object, indices: object) -> torch.Tensor:
    """Check FlashMLA's 3-D kv / indices layout (h_kv = 1) and return kv as rows [s_kv, d_qk] (row stride kept).
    Dtypes, devices, d_qk, strides and everything else are checked by ``validate_sparse_mla_args``.

    Raises:
        TypeError: kv or indices not a tensor, or kv an fp8_ds_mla cache (656-byte rows). ValueError: kv not
            [s_kv, 1, d_qk], indices not [s_q, 1, topk].
    """
    for name, x in (("q", q), ("kv", kv), ("indices", indices)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if kv.dim() != 3 or kv.shape[1] != 1:
        raise ValueError(f"kv must be [s_kv, h_kv = 1, d_qk] (FlashMLA layout; sparse_mla_fwd takes [N, d_qk] rows), "
                         f"got shape {tuple(kv.shape)}")
    if looks_like_fp8_ds_mla(kv):
        raise TypeError(f"kv is {kv.dtype} {list(kv.shape)}: an FP8 cache of 656-byte rows? flash_mla_sparse_fwd takes "
                        "bf16 / fp16 latent rows, as FlashMLA's does; for an fp8_ds_mla cache call "
                        "sparse_mla.sparse_mla_fwd(q, kv_rows, indices[:, 0], sm_scale, kv_format='fp8_ds_mla')")
    if indices.dim() != 3 or indices.shape[1] != 1:
        raise ValueError(f"indices must be [s_q, h_kv = 1, topk] int32 (FlashMLA layout), got shape {tuple(indices.shape)}")
    if q.dim() == 3 and indices.shape[0] != q.shape[0]:
        raise ValueError(f"indices must be [s_q, 1, topk] with s_q = {q.shape[0]} (the tokens of q), "
                         f"got shape {tuple(indices.shape)}")
    return kv[:, 0]


@replayed(written=("out", ))
def flash_mla_sparse_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse MLA prefill with FlashMLA's signature and conventions: each query attends to its own top-k kv rows.

    Semantics: ``flash_mla_sparse_ref`` (= ``sparse_mla.mqa.reference.sparse_mla_ref`` with lse +inf
    for a query with no valid index); every backend returns that result up to bf16 rounding and fp32
    summation order.

    Args:
        q: [s_q, h_q, d_qk] bf16 (fp16 also accepted), CUDA (or CPU fp16 under TRITON_INTERPRET=1);
            d_qk = 576 (kv_lora_rank 512 + rope 64) or 512. Any h_q >= 1. Last dim contiguous; token
            and head strides free (padded rows work).
        kv: [s_kv, h_kv = 1, d_qk], q's dtype and device, last dim contiguous, any row stride. V is
            the first d_v columns of each row.
        indices: [s_q, 1, topk] int32, last dim contiguous, any token stride. An entry < 0 or >= s_kv
            (-1, INT_MIN, s_kv, INT_MAX, ...) is invalid: never read, contributes nothing. The valid
            entries of one row should be distinct (each is counted as often as it appears).
        sm_scale: softmax scale multiplying q . k (a finite float).
        d_v: value width; 512 only.
        attn_sink: optional [h_q] float32 on q's device: per-head sink logit, natural units. out is
            multiplied by exp(lse) / (exp(lse) + exp(attn_sink[h])); -inf has no effect, +inf makes
            out 0. Does not change lse or max_logits. A NaN entry makes that head's out NaN for every
            query with a valid index; this call does not read the values (FlashMLA's signature has no
            checked mode): ``sparse_mla_fwd(..., check=True)`` raises on it.
        topk_length: optional [s_q] int32: only indices[t, 0, :topk_length[t]] count (clamped to
            [0, topk]); later entries are never read.
        out: optional preallocated [s_q, h_q, d_v] output in q's dtype, last dim contiguous (FlashMLA's last
            Hopper release, commit ba89a346, added it); written and returned as the first output.

    Method: what ``sparse_mla_fwd(method="auto")`` runs (``sparse_mla.mqa.selection``): at few heads per rank
    and enough tokens G = 128 // h_q consecutive queries share a tile over the union of their top-k lists
    (token-major: groups may span requests, each query keeps its own rows), elsewhere per token; both compute the
    definition above. A non-finite kv row that one query selects can make the out of its whole group non-finite
    (docs/DESIGN.md "Non-finite kv rows").

    Returns:
        (out, max_logits, lse):
        out: [s_q, h_q, d_v] in q's dtype (bf16 for FlashMLA's inputs); 0 for a query with no valid
            index, whatever the sink.
        max_logits: [s_q, h_q] float32, max over valid j of sm_scale * q . k_j (natural units, not
            log2); -inf for a query with no valid index.
        lse: [s_q, h_q] float32, log(sum over valid j of exp(sm_scale * q . k_j)), natural log, sink
            not included; +inf for a query with no valid index (FlashMLA's convention).

    Differences from ``sparse_mla_fwd`` (the package's own API): kv and indices carry FlashMLA's
    h_kv = 1 dim (sparse_mla_fwd takes kv as [N, d_qk] rows or a paged cache, indices as [T, K]);
    all three outputs are always returned (out in ``out`` when given, the others freshly allocated); lse is
    +inf, not -inf, for a query
    with no valid index (out 0 and max_logits -inf in both). Against FlashMLA itself: any h_q >= 1
    (FlashMLA: 64 or 128), fp16 accepted, the backend is picked by ``sparse_mla.mqa.backends``.

    Raises:
        TypeError: a non-tensor argument, wrong dtypes (q / kv bf16 or fp16, indices / topk_length
            int32, attn_sink float32), bf16 under TRITON_INTERPRET=1.
        ValueError: kv not [s_kv, 1, d_qk], indices not [s_q, 1, topk], d_qk not 512 / 576, d_v not
            512, attn_sink not [h_q], topk_length not [s_q], a non-contiguous last dim, tensors on
            different devices, a non-finite sm_scale, CPU tensors without TRITON_INTERPRET=1; out of another
            shape, device or layout, or overlapping an input (TypeError: another dtype).
    """
    rows = _flashmla_layout(q, kv, indices)
    if q.dim() != 3:
        raise ValueError(f"q must be [s_q, h_q, d_qk], got shape {tuple(q.shape)}")
    max_logits = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    out, lse = sparse_mla_fwd(q, rows, indices, sm_scale, d_v=d_v, topk_length=topk_length, return_lse=True,
                              attn_sink=attn_sink, max_logits=max_logits, out=out)
    _lse_flashmla_convention(lse)  # FlashMLA: +inf for a query with no valid index
    return out, max_logits, lse


def flash_mla_sparse_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 reference of ``flash_mla_sparse_fwd`` (same arguments; q / kv may also be fp32, any device).

    Returns:
        (out [s_q, h_q, d_v], max_logits [s_q, h_q], lse [s_q, h_q]), all float32, with
        ``flash_mla_sparse_fwd``'s conventions (lse +inf, max_logits -inf, out 0 for a query with no
        valid index).
    """
    rows = _flashmla_layout(q, kv, indices)
    out, lse, max_logits = sparse_mla_ref(q, rows, indices, sm_scale, d_v=d_v, topk_length=topk_length,
                                          attn_sink=attn_sink, return_max_logits=True)
    lse.masked_fill_(lse == -_INF, _INF)
    return out, max_logits, lse


__all__ = ["flash_mla_sparse_fwd", "flash_mla_sparse_ref"]
