"""The op's public function, ``sparse_mla_fwd`` (``sparse_mla.sparse_mla_fwd``).

Layering: kernels by backend (``sparse_mla.mqa``: Triton ``triton_tl`` and Gluon ``gluon_sm90``;
``sparse_mla.union``) <- launchers that take validated tensors and workspace buffers <- one
selection point per op (``sparse_mla.mqa.backends``) <- this function, which validates (``checks``), allocates
(unless given a workspace and outputs) and picks the method (per token or grouped, ``selection``).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from ..call_cache import replayed
from ..checks import require_kernel_tensor
from ..choices import Choice, explain_lines
from ..kv_format import FP8_DS_MLA
from ..kv_staging import KV_DEQUANT_MODES, choose_kv_dequant, dequantize_rows, estimated_union_rows
from ..union import backends as union_backends
from ..union import probe as union_probe
from ..union.grouping import guard_ratio
from ..union.planning import plan_groups
from ..union.workspace import SparseMLAWorkspace, cached_workspace
from . import backends as mqa_backends
from .checks import SparseMLAProblem, check_sink_and_max_logits, validate_fwd_buffers, validate_sparse_mla_args
from .kv_splits import choose_kv_splits, num_sms, require_kv_splits
from .selection import choose_method
from .split_combine import MAX_SPLIT_PARTIAL_BYTES, combine_splits, partial_bytes, split_partials
from .triton_tl import D_V

logger = logging.getLogger("sparse_mla")


@replayed(written=("out", "lse", "max_logits"))
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
    overlap_guard: float | None = None,
    attn_sink: torch.Tensor | None = None,
    max_logits: torch.Tensor | None = None,
    kv_format: str | None = None,
    kv_dequant: str = "auto",
    kv_splits: int | None = None,
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
            queries share a tile over the union of their rows), or "auto" (default): grouped where
            ``sparse_mla.mqa.selection.GROUPING_RULES`` says it pays (G >= 2 and enough query rows; measured
            on the H200), per token elsewhere; a grouped call still runs a step whose lists barely overlap
            per token (the overlap probe, on the device) and each group whose union is too large (the
            overlap guard). ``sparse_mla.mqa.selection.explain_method`` and the debug log say what ran and why.
        cu_seqlens_q: optional [B + 1] int32 request boundaries of the T rows. Given: groups stay
            inside requests and a request's last n % G rows run per token. Absent: groups run
            token-major over all rows (ShardQ layout), the tail group is short.
        check: checked mode: raise on a valid index >= N, a repeated row in one list, a bad
            topk_length or cu_seqlens_q, a non-finite selected kv row, a NaN attn_sink (syncs the device).
        workspace: scratch for the grouped path (``SparseMLAWorkspace``); a call then allocates
            no union buffers. None: the package keeps one per (device, topk, G), grown to the largest
            step seen (``sparse_mla.union.workspace.cached_workspace``; ``clear_workspace_cache`` frees it);
            pass one for CUDA-graph capture of a step larger than any before, or for calls on several
            streams at once.
        out / lse: optional preallocated outputs, [T, H, d_v] q.dtype and [T, H] fp32.
        group_size: queries per group (default ``default_group_size(H)``, 1..16).
        overlap_guard: union rows / mean list length above which a group of a grouped call runs per token (a float
            >= 0); None (default): the default table (``sparse_mla.union.grouping.overlap_guard_ratio``);
            ``math.inf``: no guard (every union built and used). -1.0 is accepted as None (deprecated).
        attn_sink: optional [H] float32 on q's device: a per-head sink logit (natural units) added
            to the softmax denominator of out, out[t, h] *= 1 / (1 + exp(attn_sink[h] - lse[t, h]));
            -inf changes nothing, +inf gives out 0. lse and max_logits do not include it. A NaN entry
            makes that head's out NaN for every query with a valid row; check=True raises on it.
        max_logits: optional preallocated [T, H] float32 output (heads contiguous), written in the
            same pass: max over the valid rows of sm_scale * q . k (natural units), -inf for a query
            with no valid row. Not returned; read the tensor you passed.
        kv_format: None (default: kv holds latent rows in q's dtype) or "fp8_ds_mla" (FlashMLA's /
            vLLM's FP8 cache: per row 512 float8_e4m3 kv_c values, 4 float32 scales, 64 bf16 k_pe;
            ``sparse_mla.kv_format``). Explicit, never inferred from kv's dtype. Two exact routes
            (``kv_dequant``): the cache's rows dequantized to q's dtype first, then the bf16 / fp16 kernels
            ("staged"), or each gathered row dequantized in the kernel's gather ("in_kernel": on Hopper with bf16
            q by the Gluon kernel's producer warps, elsewhere by the portable Triton kernel).
        kv_dequant: the route of an FP8 cache: "auto" (default: ``sparse_mla.kv_staging.choose_kv_dequant``, the
            measured rule: staging when the cache's rows cost less to dequantize once than the rows the kernel
            gathers cost in its gather, within ``kv_staging.DEFAULT_MAX_STAGED_BYTES``), "staged" (always; the
            staged rows [N, 576] of q's dtype come from ``workspace``'s staging buffer when it holds them, else
            are allocated), or "in_kernel" (never: no staging memory). Ignored without kv_format.
        kv_splits: split-KV: S programs share one work item's list of kv rows (the top-k of a query, or a group's
            union), each writes a partial (out, lse, max logit) and one combine merges them exactly (lse-weighted;
            attn_sink applied once, after the merge; ``sparse_mla.mqa.split_combine``). None (default): S from the
            shape by ``sparse_mla.mqa.kv_splits.choose_kv_splits`` (work items against the SM count; 1 on a step
            that fills the GPU, on the CPU, and where the backend that runs has no split variant); an int in
            [1, 64] forces S (a backend without a split variant then hands the call to the Triton kernel).
            ``explain_fwd`` says which S and why. The partial buffers ([T, S, H, 512] fp32) are allocated per call.

    Conventions (this API): a query with no valid row gets out 0, lse -inf, max_logits -inf.
    ``sparse_mla.flash_mla_sparse_fwd`` is the FlashMLA-compatible call (its shapes, lse +inf there).

    Non-finite kv rows: a NaN / inf in a row query t does not select never changes out[t] / lse[t]
    with method="per_token"; a grouped call (method="grouped", or "auto" where it groups) can make the out
    of every query in the selecting query's group non-finite (docs/DESIGN.md "Non-finite kv rows"). check=True raises on a
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
            unknown method or kv_dequant, a workspace that does not fit, CPU tensors without TRITON_INTERPRET=1,
            and (check=True) bad index contents, a non-finite selected kv row or a NaN attn_sink;
            attn_sink / max_logits of the wrong shape or dtype (TypeError for the dtype); an unknown
            kv_format; with kv_format="fp8_ds_mla" a kv whose rows are not 656 bytes or not 16-byte
            aligned, or D_qk != 576 (TypeError: kv not uint8 / float8_e4m3fn; a uint8 / float8 kv of
            656-byte rows without kv_format); kv_splits not None or an int in [1, 64] (TypeError for the type).
    """
    p = validate_sparse_mla_args(
        q, kv, indices, sm_scale, d_v=d_v, topk_length=topk_length, cu_seqlens_q=cu_seqlens_q, check=check,
        kv_format=kv_format,
    )
    if kv_dequant not in KV_DEQUANT_MODES:
        raise ValueError(f"kv_dequant must be one of {KV_DEQUANT_MODES}, got {kv_dequant!r}")
    require_kv_splits(kv_splits)
    T, H, D = p.q.shape
    chosen, reason = choose_method(method, H, T, group_size)
    attn_sink = check_sink_and_max_logits(attn_sink, max_logits, T, H, q.device, check=check)
    # out / lse / workspace / flags, every one before any launch (checks.validate_fwd_buffers)
    G = validate_fwd_buffers(p, return_lse=return_lse, grouped=chosen == "grouped", group_size=group_size,
                             overlap_guard=overlap_guard, out=out, lse=lse, workspace=workspace,
                             extra_outputs={"max_logits": max_logits}, extra_inputs={"attn_sink": attn_sink})
    require_kernel_tensor("q", p.q)  # kv and out share its device and dtype
    fp8_route = _choose_fp8_route(p, kv_dequant, chosen == "grouped", G)
    S, split_reason = _choose_splits(p, chosen, G, out, kv_splits, fp8_route)  # raises before any launch
    if out is None:
        out = torch.empty(T, H, d_v, dtype=q.dtype, device=q.device)
    if lse is None and return_lse:
        lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    if fp8_route is not None:
        p, reason = _apply_fp8_route(p, fp8_route, workspace, reason)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("sparse_mla_fwd: T=%d H=%d K=%d kv_format=%s -> %s (%s); kv splits %d (%s)", T, H, p.topk,
                     kv_format, chosen, reason, S, split_reason)
    if T == 0:
        return (out, lse) if return_lse else out

    parts = split_partials(S, T, H, q.device, with_max_logits=max_logits is not None) if S > 1 else None
    extras = {"attn_sink": attn_sink, "max_logits": max_logits, "kv_split": parts}
    if chosen == "per_token":
        mqa_backends.per_token(p.q, p.kv, p.indices, p.sm_scale, p.topk_length, out, lse, **extras)
    else:
        ws = workspace or cached_workspace(T, p.topk, G, p.num_kv_rows, q.device)
        _grouped_forward(p, G, ws, out, lse, guard_ratio(overlap_guard, G), extras)
    if parts is not None:
        combine_splits(parts, out, lse, max_logits, attn_sink)
    return (out, lse) if return_lse else out


def _choose_splits(p: SparseMLAProblem, chosen: str, G: int, out: torch.Tensor | None, kv_splits: int | None,
                   fp8_route: Choice | None) -> Choice:
    """``Choice(S, reason)`` of a validated call: ``choose_kv_splits`` on its work items (per token: T lists of H heads;
    grouped: T / G lists of G * H pseudo-heads over ``estimated_union_rows(G * K, G)`` union rows). Raises before
    any launch where a forced S > 1 cannot run: the forced Gluon backend has no split variant for the launch, or the
    partials would pass ``MAX_SPLIT_PARTIAL_BYTES``."""
    T, H = p.num_tokens, p.num_heads
    if T == 0:
        return Choice(1, "no query row")
    grouped = chosen == "grouped"
    if grouped:
        lists, pseudo, rows = -(-T // G), G * H, estimated_union_rows(G * p.topk, G)
    else:
        lists, pseudo, rows = T, H, p.topk
    kv_fp8 = fp8_route is not None and fp8_route.name == "in_kernel"
    backend, _ = mqa_backends.choose_backend(p.q, p.kv, out, pseudo_heads=pseudo)
    missing = mqa_backends.kv_split_missing(backend, grouped=grouped, kv_fp8=kv_fp8)
    S, why = choose_kv_splits(kv_splits, num_lists=lists, pseudo_heads=pseudo, rows_per_list=rows,
                              sms=num_sms(p.q.device), split_capable=missing is None)
    if S > 1:
        need = partial_bytes(S, T, H)
        if need > MAX_SPLIT_PARTIAL_BYTES:
            if kv_splits is not None:
                raise ValueError(f"kv_splits={kv_splits} needs {need / 2**30:.1f} GiB of fp32 partials for T = {T}, "
                                 f"H = {H} (at most {MAX_SPLIT_PARTIAL_BYTES / 2**30:.0f} GiB): split fewer ways")
            return Choice(1, f"{why}, but its partials would take {need / 2**30:.1f} GiB")
        mqa_backends.require_kv_split_runs(grouped=grouped, kv_fp8=kv_fp8)
        if grouped:  # the request tails of a grouped call run the per-token kernel
            mqa_backends.require_kv_split_runs(grouped=False, kv_fp8=kv_fp8)
    return Choice(S, why)


def explain_fwd(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float = 1.0, *,
                method: str = "auto", group_size: int | None = None, kv_splits: int | None = None,
                kv_format: str | None = None, kv_dequant: str = "auto",
                cu_seqlens_q: torch.Tensor | None = None, overlap_guard: float | None = None) -> str:
    """What ``sparse_mla_fwd`` runs for these tensors and options: one line per choice it makes, ``label: name
    (reason)``, in the order and with the labels of ``sparse_mla.choices.DECISIONS`` (method, FP8 route, kv splits,
    attention backend of the main launch; grouped: union builder and overlap guard). The same functions decide as in
    the call; nothing is launched.

    Raises: what ``sparse_mla_fwd`` raises for these arguments before its first launch."""
    p = validate_sparse_mla_args(q, kv, indices, sm_scale, cu_seqlens_q=cu_seqlens_q, kv_format=kv_format)
    if kv_dequant not in KV_DEQUANT_MODES:
        raise ValueError(f"kv_dequant must be one of {KV_DEQUANT_MODES}, got {kv_dequant!r}")
    require_kv_splits(kv_splits)
    T, H, _ = p.q.shape
    decided = {"method": choose_method(method, H, T, group_size)}
    grouped = decided["method"].name == "grouped"
    G = validate_fwd_buffers(p, return_lse=False, grouped=grouped, group_size=group_size, overlap_guard=overlap_guard,
                             out=None, lse=None, workspace=None)
    G = G if grouped else 1
    fp8_route = _choose_fp8_route(p, kv_dequant, grouped, G)
    if fp8_route is not None:
        decided["FP8 cache"] = fp8_route
    decided["kv splits"] = _choose_splits(p, decided["method"].name, G, None, kv_splits, fp8_route)
    name, why = mqa_backends.launch_backend(p.q, p.kv, G * H, grouped=grouped, kv_split=decided["kv splits"].name > 1,
                                            kv_fp8=fp8_route is not None and fp8_route.name == "in_kernel")
    decided["attention backend"] = Choice(name, f"{why}; {G * H} pseudo-heads per tile")
    if grouped:
        ratio = guard_ratio(overlap_guard, G)
        try:
            decided["union builder"] = union_backends.choose_union_backend(p.q.device, G, p.topk, guard_ratio=ratio)
        except ValueError as exc:
            decided["union builder"] = Choice("error", str(exc))
        if ratio is None:
            decided["overlap guard"] = Choice("off", "overlap_guard=math.inf: every union built and used")
        else:
            source = "the default table" if overlap_guard is None or overlap_guard == -1.0 else \
                f"overlap_guard={overlap_guard:g}"
            decided["overlap guard"] = Choice(f"{ratio:g} x the mean list", f"{source} for G = {G}: a group with a "
                                              "larger union runs per token, on the device")
    return "\n".join(explain_lines(decided))


def _choose_fp8_route(p: SparseMLAProblem, mode: str, grouped: bool, G: int) -> Choice | None:
    """``choose_kv_dequant`` on a call's FP8 cache (the cache's rows staged, its lists' rows gathered); None without
    one."""
    if p.kv_format is None:
        return None
    return choose_kv_dequant(mode, p.num_kv_rows, p.num_tokens * p.topk, FP8_DS_MLA.d_qk * p.q.element_size(),
                             group_size=G if grouped else 1)


def _apply_fp8_route(p: SparseMLAProblem, route: Choice, workspace, reason: str):
    """The problem on the staged rows (kv_format None) or unchanged (in-kernel dequantization), and the reason."""
    name, why = route
    if name == "in_kernel":
        return p, f"{reason}; FP8 dequantized in the gather: {why}"
    N = p.num_kv_rows
    buf = workspace.staging_buffer(N, p.q.dtype) if workspace is not None else None
    rows = dequantize_rows(p.kv, p.q.dtype, out=buf)
    return dataclasses.replace(p, kv=rows, kv_format=None), f"{reason}; FP8 cache staged to {p.q.dtype}: {why}"


def _grouped_forward(p, G: int, ws: SparseMLAWorkspace, out: torch.Tensor, lse: torch.Tensor | None,
                     guard: float | None, extras: dict) -> None:
    """Plan groups (and the probe's sample of them, in the same launch), probe their overlap
    (``sparse_mla.union.probe``: a step whose probed groups would mostly fall back skips the build), build unions,
    run the grouped kernel, then the per-token kernel on the rest."""
    T = p.num_tokens
    n_groups = min(ws.max_groups, -(-T // G))
    gs, gl, ul = ws.group_start[:n_groups], ws.group_len[:n_groups], ws.union_len[:n_groups]
    route = ws.route[:T]
    planned = union_probe.probe_buffers(n_groups, ws, guard)
    plan_groups(T, G, p.cu_seqlens_q, gs, gl, route, planned, union_probe.PROBE_STRIDE)
    if planned is not None:
        union_probe.probe_and_skip(p.indices, p.topk_length, p.num_kv_rows, G, gs, gl, route, ws, guard, planned)
    union_backends.build_union(p.indices, p.topk_length, p.num_kv_rows, G, gs, gl, route, ws, ws.union_rows,
                               ws.union_bits, ul, guard_ratio=guard)
    mqa_backends.grouped(p.q, p.kv, p.sm_scale, G, ws.union_rows, ws.union_bits, ul, gs, gl, out, lse, **extras)
    mqa_backends.per_token(p.q, p.kv, p.indices, p.sm_scale, p.topk_length, out, lse, route=route, **extras)


__all__ = ["sparse_mla_fwd", "explain_fwd", "D_V"]
