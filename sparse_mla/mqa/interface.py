"""The op's public function, ``sparse_mla_fwd`` (``sparse_mla.sparse_mla_fwd``).

Layering: kernels by backend (``sparse_mla.mqa``: Triton ``triton_tl`` and Gluon ``gluon_sm90``;
``sparse_mla.union``) <- launchers that take validated tensors and workspace buffers <- one
selection point per op (``sparse_mla.mqa.backends``) <- this function, which validates (``checks``), allocates
(unless given a workspace and outputs) and picks the method (per token or grouped, ``selection``).
"""

from __future__ import annotations

import logging

import torch

from ..checks import require_kernel_tensor
from ..union import backends as union_backends
from ..union import probe as union_probe
from ..union.grouping import overlap_guard_ratio
from ..union.planning import plan_groups
from ..union.workspace import SparseMLAWorkspace
from . import backends as mqa_backends
from .checks import check_sink_and_max_logits, validate_fwd_buffers, validate_sparse_mla_args
from .selection import resolve_method
from .triton_tl import D_V

logger = logging.getLogger("sparse_mla")


def sparse_mla_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    *,
    d_v: int = 512,
    topk_length: torch.Tensor | None = None,
    return_lse: bool = False,
    method: str = "auto",
    cu_seqlens_q: torch.Tensor | None = None,
    check: bool = False,
    workspace: SparseMLAWorkspace | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    group_size: int | None = None,
    overlap_guard: float | None = -1.0,
    attn_sink: torch.Tensor | None = None,
    max_logits: torch.Tensor | None = None,
    kv_format: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA prefill (MQA / absorbed form): each query attends to its own top-k kv rows.

    Semantics: ``sparse_mla.mqa.reference.sparse_mla_ref`` (docs/DESIGN.md "Ground truth"); every method
    returns that result up to bf16 rounding and fp32 summation order. With an FP8 cache
    (``kv_format="fp8_ds_mla"``): the same definition on the cache dequantized to q's dtype
    (``sparse_mla.kv_format``), which the kernel computes in its gather.

    Args:
        q: [T, H, D_qk] bf16 or fp16, CUDA (or CPU under TRITON_INTERPRET=1), last dim contiguous;
            D_qk = 576 (kv_lora_rank 512 + qk_rope_head_dim 64) or 512 (NoPE). Any H >= 1.
        kv: [N, D_qk] latent cache rows, or paged [num_blocks, block_size, D_qk] with block stride
            block_size * D_qk; q's dtype and device. V is the first d_v columns of each row. With
            kv_format="fp8_ds_mla": the FP8 cache, uint8 (or float8_e4m3fn) [N, 656], paged
            [num_blocks, block_size, 656] or [num_blocks, block_size, 1, 656], rows 16-byte aligned
            (``sparse_mla.kv_format.FP8_DS_MLA``), and D_qk must be 576.
        indices: [T, K] or [T, 1, K] int32 global rows; entries < 0 or >= N are padding (never read).
        sm_scale: softmax scale multiplying q . k.
        d_v: value width (512 = kv_lora_rank).
        topk_length: optional [T] int32; only the first topk_length[t] entries of row t count.
        return_lse: also return lse [T, H] fp32 (natural log; -inf for a query with no valid row).
        method: "per_token" (one query's heads per tile), "grouped" (G = 128 // H consecutive
            queries share a tile over the union of their rows), or "auto": what
            ``selection.resolve_method`` picks. With the shipped table (``selection.AUTO_GROUPS =
            False``: the grouped step, union build included, measured slower than per token on the
            H200) "auto" always runs per token and only method="grouped" groups; with the switch
            on it would group when G >= 2 and T >= G. The measured choice between per-token and
            grouped MQA (and masked / dense MHA) lives in the layer's dispatcher,
            ``sparse_mla.layer.dispatch`` (its ``THRESHOLDS``), which calls this function with an
            explicit method.
        cu_seqlens_q: optional [B + 1] int32 request boundaries of the T rows. Given: groups stay
            inside requests and a request's last n % G rows run per token. Absent: groups run
            token-major over all rows (ShardQ layout), the tail group is short.
        check: checked mode: raise on a valid index >= N, a repeated row in one list, a bad
            topk_length or cu_seqlens_q, a non-finite selected kv row, a NaN attn_sink (syncs the device).
        workspace: scratch for the grouped path (``SparseMLAWorkspace``); a call then allocates
            no union buffers. Allocated per call when None.
        out / lse: optional preallocated outputs, [T, H, d_v] q.dtype and [T, H] fp32.
        group_size: queries per group (default ``default_group_size(H)``, 1..16).
        overlap_guard: union rows / mean list length above which a group runs per token;
            -1 = the default table (``sparse_mla.union.grouping.overlap_guard_ratio``), None = no guard.
        attn_sink: optional [H] float32 on q's device: a per-head sink logit (natural units) added
            to the softmax denominator of out, out[t, h] *= 1 / (1 + exp(attn_sink[h] - lse[t, h]));
            -inf changes nothing, +inf gives out 0. lse and max_logits do not include it. A NaN entry
            makes that head's out NaN for every query with a valid row; check=True raises on it.
        max_logits: optional preallocated [T, H] float32 output (heads contiguous), written in the
            same pass: max over the valid rows of sm_scale * q . k (natural units), -inf for a query
            with no valid row. Not returned; read the tensor you passed.
        kv_format: None (default: kv holds latent rows in q's dtype) or "fp8_ds_mla" (FlashMLA's /
            vLLM's FP8 cache: per row 512 float8_e4m3 kv_c values, 4 float32 scales, 64 bf16 k_pe;
            ``sparse_mla.kv_format``). Explicit, never inferred from kv's dtype. Each gathered row is dequantized
            in the kernel: on Hopper with bf16 q by the Gluon kernel's producer warps, elsewhere (fp16 q, other
            GPUs, the interpreter) by the portable Triton kernel (``sparse_mla.mqa.backends``).

    Conventions (this API): a query with no valid row gets out 0, lse -inf, max_logits -inf.
    ``sparse_mla.flash_mla_sparse_fwd`` is the FlashMLA-compatible call (its shapes, lse +inf there).

    Non-finite kv rows: a NaN / inf in a row query t does not select never changes out[t] / lse[t]
    with method="per_token"; method="grouped" can make the out of every query in the selecting
    query's group non-finite (docs/DESIGN.md "Non-finite kv rows"). check=True raises on a
    non-finite value in any selected row (for an FP8 cache: in the row dequantized to q's dtype, as
    the kernel computes it: a NaN or inf scale, or a product past the dtype's range, e.g. 65536 in fp16).

    Backends: the attention runs the Gluon sm_90 kernel or the portable Triton one, chosen by
    ``sparse_mla.mqa.backends`` (``SPARSE_MLA_MQA_BACKEND`` forces one); the union builder is chosen
    by ``sparse_mla.union.backends``. All compute this same definition.

    Returns:
        out [T, H, d_v] in q's dtype, or (out, lse) with return_lse=True.

    Raises:
        TypeError: wrong type or dtype of an argument (q/kv bf16 or fp16; indices, topk_length,
            cu_seqlens_q int32; out / lse of the wrong dtype); bf16 q / kv under TRITON_INTERPRET=1 (the interpreter's bf16
            tl.dot is wrong: use fp16 on the CPU).
        ValueError: shape / device / layout mismatches, D_qk not in {512, 576}, d_v != 512, an
            unknown method, a workspace that does not fit, CPU tensors without TRITON_INTERPRET=1,
            and (check=True) bad index contents, a non-finite selected kv row or a NaN attn_sink;
            attn_sink / max_logits of the wrong shape or dtype (TypeError for the dtype); an unknown
            kv_format; with kv_format="fp8_ds_mla" a kv whose rows are not 656 bytes or not 16-byte
            aligned, or D_qk != 576 (TypeError: kv not uint8 / float8_e4m3fn; a uint8 / float8 kv of
            656-byte rows without kv_format).
    """
    p = validate_sparse_mla_args(
        q, kv, indices, sm_scale, d_v=d_v, topk_length=topk_length, cu_seqlens_q=cu_seqlens_q, check=check,
        kv_format=kv_format,
    )
    T, H, D = p.q.shape
    chosen, reason = resolve_method(method, H, T)
    attn_sink = check_sink_and_max_logits(attn_sink, max_logits, T, H, q.device, check=check)
    # out / lse / workspace / flags, every one before any launch (checks.validate_fwd_buffers)
    G = validate_fwd_buffers(p, return_lse=return_lse, grouped=chosen == "grouped", group_size=group_size,
                             overlap_guard=overlap_guard, out=out, lse=lse, workspace=workspace,
                             extra_outputs={"max_logits": max_logits}, extra_inputs={"attn_sink": attn_sink})
    if out is None:
        out = torch.empty(T, H, d_v, dtype=q.dtype, device=q.device)
    if lse is None and return_lse:
        lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    require_kernel_tensor("q", p.q)  # kv and out share its device and dtype
    logger.debug("sparse_mla_fwd: T=%d H=%d K=%d kv_format=%s -> %s (%s)", T, H, p.topk, p.kv_format, chosen, reason)
    if T == 0:
        return (out, lse) if return_lse else out

    extras = {"attn_sink": attn_sink, "max_logits": max_logits}
    if chosen == "per_token":
        mqa_backends.per_token(p.q, p.kv, p.indices, p.sm_scale, p.topk_length, out, lse, **extras)
    else:
        ws = workspace or SparseMLAWorkspace(T, p.topk, G, p.num_kv_rows, q.device)
        ok, why = ws.fits(T, p.topk, G, p.num_kv_rows)
        if not ok:
            raise ValueError(f"workspace does not fit this call: {why}")
        guard = overlap_guard_ratio(G) if overlap_guard == -1.0 else overlap_guard
        _grouped_forward(p, G, ws, out, lse, guard, extras)
    return (out, lse) if return_lse else out


def _grouped_forward(p, G: int, ws: SparseMLAWorkspace, out: torch.Tensor, lse: torch.Tensor | None,
                     guard: float | None, extras: dict) -> None:
    """Plan groups, probe their overlap (``sparse_mla.union.probe``: a step whose probed groups would all
    fall back skips the build), build unions, run the grouped kernel, then the per-token kernel on the rest."""
    T = p.num_tokens
    n_groups = ws.max_groups if p.cu_seqlens_q is not None else -(-T // G)
    gs, gl, ul = ws.group_start[:n_groups], ws.group_len[:n_groups], ws.union_len[:n_groups]
    route = ws.route[:T]
    plan_groups(T, G, p.cu_seqlens_q, gs, gl, route)
    union_probe.probe_and_skip(p.indices, p.topk_length, p.num_kv_rows, G, gs, gl, route, ws, guard)
    union_backends.build_union(p.indices, p.topk_length, p.num_kv_rows, G, gs, gl, route, ws, ws.union_rows,
                               ws.union_bits, ul, guard_ratio=guard)
    mqa_backends.grouped(p.q, p.kv, p.sm_scale, G, ws.union_rows, ws.union_bits, ul, gs, gl, out, lse, **extras)
    mqa_backends.per_token(p.q, p.kv, p.indices, p.sm_scale, p.topk_length, out, lse, route=route, **extras)


__all__ = ["sparse_mla_fwd", "D_V"]
