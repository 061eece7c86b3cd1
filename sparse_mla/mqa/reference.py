"""The fp32 reference of per-token sparse MLA (the MQA / absorbed form).

This is the definition every fast path reproduces (``docs/DESIGN.md``, "Ground truth"):

    valid_j         = indices[t, j] >= 0 and indices[t, j] < N and j < topk_length[t]
    s_j             = sm_scale * q[t, h] . kv[indices[t, j]]          (over all D_qk columns)
    lse[t, h]       = log(sum_{valid j} exp(s_j))                      (natural log; the sink is not in it)
    max_logits[t, h] = max_{valid j} s_j                               (natural units, before any exp)
    out[t, h]       = sum_{valid j} exp(s_j) * kv[indices[t, j], :d_v] / (exp(lse[t, h]) + exp(attn_sink[h]))

``attn_sink`` (optional, [H] fp32) adds one key with logit ``attn_sink[h]`` and value 0 to the
softmax denominator of head h (FlashMLA's attention sink): absent or -inf changes nothing, +inf
makes out 0. It changes neither lse nor max_logits.

A query with no valid index gets ``out = 0`` (whatever the sink), ``lse = -inf`` and
``max_logits = -inf``. (``sparse_mla.flash_mla_sparse_fwd`` reports lse = +inf there instead, as
FlashMLA does.) Rows a query does not select never reach its result: a NaN or inf in an
unselected kv row changes nothing.

FP8 cache (``kv_format="fp8_ds_mla"``, ``sparse_mla.kv_format``): the definition above applied to the
cache dequantized to q's dtype, ``kv = FP8_DS_MLA.dequantize(cache, q.dtype)`` (kv_c = e4m3 * scale rounded
once to q's dtype, k_pe the stored bf16 values), which is what the kernels compute with.
"""

from __future__ import annotations

import torch

from ..kv_format import KV_FORMATS
from .checks import check_attn_sink_values, validate_sparse_mla_args


def sparse_mla_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    *,
    d_v: int = 512,
    topk_length: torch.Tensor | None = None,
    return_lse: bool = True,
    method: str = "reference",
    cu_seqlens_q: torch.Tensor | None = None,
    check: bool = False,
    chunk_tokens: int = 16,
    attn_sink: torch.Tensor | None = None,
    return_max_logits: bool = False,
    kv_format: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 reference of sparse MLA prefill; same arguments as ``sparse_mla_fwd``.

    Args:
        q: [T, H, D_qk] bf16/fp16/fp32, any device; D_qk in {512, 576}.
        kv: [N, D_qk] (or paged [num_blocks, block_size, D_qk]) with q's dtype and device; or, with
            kv_format="fp8_ds_mla", the FP8 cache: uint8 / float8_e4m3fn [N, 656] (or paged), D_qk 576.
        indices: [T, K] or [T, 1, K] int32 global kv rows; < 0, >= N, or past topk_length = padding.
        sm_scale: softmax scale applied to q . k.
        d_v: value width, the first d_v columns of each kv row (512).
        topk_length: optional [T] int32, only the first topk_length[t] entries of row t count.
        return_lse, method, cu_seqlens_q: accepted for signature parity; ignored (the result
            does not depend on them). The reference always returns ``(out, lse)``.
        check: the checked mode of ``sparse_mla_fwd`` (raises ValueError): index ranges and distinctness,
            non-finite selected kv rows, a NaN attn_sink.
        chunk_tokens: tokens evaluated at once (bounds the [chunk, K, D_qk] fp32 gather).
        attn_sink: optional [H] float32 on q's device, per-head sink logit in natural units
            (-inf and +inf allowed; see the module docstring). Changes out only; a NaN entry makes
            that head's out NaN for every query with a valid index (check=True raises on it).
        return_max_logits: also return max_logits [T, H] fp32 (natural units, -inf for a query
            with no valid index).
        kv_format: None (kv holds rows in q's dtype) or "fp8_ds_mla": the definition on the cache
            dequantized to q's dtype (module docstring).

    Returns:
        out: [T, H, d_v] fp32 on q's device. lse: [T, H] fp32, natural log, -inf for a query
        with no valid index (its out row is 0). With return_max_logits: (out, lse, max_logits).

    Raises:
        TypeError, ValueError: as ``validate_sparse_mla_args``; attn_sink not a float32 [H] tensor
            on q's device.
    """
    del return_lse, method
    p = validate_sparse_mla_args(
        q, kv, indices, sm_scale, d_v=d_v, topk_length=topk_length, cu_seqlens_q=cu_seqlens_q,
        check=check, allowed_dtypes=(torch.bfloat16, torch.float16, torch.float32), kv_format=kv_format,
    )
    T, H, _ = p.q.shape
    K, N = p.topk, p.num_kv_rows
    if attn_sink is not None:
        if not isinstance(attn_sink, torch.Tensor) or attn_sink.dtype != torch.float32:
            raise TypeError(f"attn_sink must be a float32 tensor [H] = [{H}], got "
                            f"{attn_sink.dtype if isinstance(attn_sink, torch.Tensor) else type(attn_sink).__name__}")
        if attn_sink.shape != (H,) or attn_sink.device != q.device:
            raise ValueError(f"attn_sink must be [H] = [{H}] on {q.device}, got {tuple(attn_sink.shape)} on {attn_sink.device}")
        if check:
            check_attn_sink_values(attn_sink)
    kv32 = p.kv.float() if p.kv_format is None else KV_FORMATS[p.kv_format].dequantize(p.kv, q.dtype).float()
    if N == 0:  # an empty cache: every entry is padding; one zero row for the gather below, never counted
        kv32 = kv32.new_zeros(1, kv32.shape[1])
    out = torch.empty(T, H, d_v, dtype=torch.float32, device=q.device)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    max_logits = torch.empty(T, H, dtype=torch.float32, device=q.device)
    cols = torch.arange(K, device=q.device)
    for t0 in range(0, T, chunk_tokens):
        t1 = min(T, t0 + chunk_tokens)
        idx = p.indices[t0:t1].long()
        valid = (idx >= 0) & (idx < N)
        if p.topk_length is not None:
            valid &= cols[None, :] < p.topk_length[t0:t1, None].long()
        # Invalid entries gather row 0 and are then *replaced* by zeros (not multiplied by zero), so a
        # non-finite value in a row the query does not select cannot reach its scores or its output.
        rows = torch.where(valid[..., None], kv32[torch.where(valid, idx, 0)], 0.0)  # [t, K, D_qk]
        s = torch.einsum("thd,tkd->thk", p.q[t0:t1].float(), rows) * p.sm_scale
        s = s.masked_fill(~valid[:, None, :], float("-inf"))
        chunk_lse = torch.logsumexp(s, dim=-1)  # -inf where no valid entry
        norm = chunk_lse if attn_sink is None else torch.logaddexp(chunk_lse, attn_sink[None, :])
        # out 0 for a query with no valid entry (norm -inf without a sink) and under a +inf sink;
        # everything else, NaN from a selected non-finite row included, flows through exp.
        zero = norm == float("-inf")
        if attn_sink is not None:
            zero = zero | (attn_sink == float("inf"))[None, :] | (chunk_lse == float("-inf"))
        probs = torch.where(zero[..., None], 0.0, torch.exp(s - norm[..., None]))
        out[t0:t1] = torch.einsum("thk,tkd->thd", probs, rows[..., :d_v])
        lse[t0:t1] = chunk_lse
        max_logits[t0:t1] = s.amax(dim=-1)  # -inf where no valid entry
    return (out, lse, max_logits) if return_max_logits else (out, lse)
