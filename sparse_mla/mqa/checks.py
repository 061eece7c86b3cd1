"""The checks of the sparse MQA op: ``sparse_mla_fwd`` / ``sparse_mla_ref`` arguments (``SparseMLAProblem``), the
checked mode's look at their contents, attn_sink / max_logits, and the buffers and options of ``sparse_mla_fwd``.
Every check runs before any kernel launch (``sparse_mla.checks`` has the generic ones and the error conventions).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from ..checks import (
    KERNEL_DTYPES,
    _require_int32,
    _require_same_device,
    _require_tensor,
    check_selected_rows_finite,
    check_tensor,
    counted_entries,
    describe,
    flatten_kv,
    has_self_overlap,
    require_bool,
    require_disjoint,
    require_distinct_rows,
    require_finite_float,
    require_int,
)
from ..kv_format import check_kv_format, kv_rows_of_format, looks_like_fp8_ds_mla
from ..union.grouping import MAX_GROUP_SIZE, default_group_size

SUPPORTED_D_QK = (512, 576)
SUPPORTED_D_V = (512,)


@dataclass(frozen=True)
class SparseMLAProblem:
    """Normalized arguments of one sparse MLA call (shapes read off the validated tensors)."""

    q: torch.Tensor  # [T, H, D_qk]
    kv: torch.Tensor  # [N, D_qk]
    indices: torch.Tensor  # [T, K] int32
    topk_length: torch.Tensor | None  # [T] int32
    cu_seqlens_q: torch.Tensor | None  # [B + 1] int32
    sm_scale: float
    d_v: int
    kv_format: str | None = None  # None: kv rows in q's dtype; "fp8_ds_mla": kv is uint8 [N, 656] (sparse_mla.kv_format)

    @property
    def num_tokens(self) -> int:
        return self.q.shape[0]

    @property
    def num_heads(self) -> int:
        return self.q.shape[1]

    @property
    def d_qk(self) -> int:
        return self.q.shape[2]

    @property
    def topk(self) -> int:
        return self.indices.shape[1]

    @property
    def num_kv_rows(self) -> int:
        return self.kv.shape[0]


def validate_sparse_mla_args(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    *,
    d_v: int = 512,
    topk_length: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    check: bool = False,
    allowed_dtypes: tuple[torch.dtype, ...] = KERNEL_DTYPES,
    kv_format: str | None = None,
) -> SparseMLAProblem:
    """Check the arguments of ``sparse_mla_fwd`` / ``sparse_mla_ref`` and normalize them.

    See ``sparse_mla.sparse_mla_fwd`` for the meaning of each argument. With ``kv_format="fp8_ds_mla"``
    the problem's ``kv`` is the cache's uint8 rows [N, 656] (``sparse_mla.kv_format.FP8DSMLAFormat.as_rows``).

    Raises:
        TypeError: a non-tensor argument, a dtype outside ``allowed_dtypes`` for q/kv,
            q and kv of different dtypes, non-int32 indices / topk_length / cu_seqlens_q; an
            sm_scale that is not a real number (a bool, a string, a tensor), a d_v that is not an
            int, a check that is not a bool; a kv_format that is not None or a string; with
            kv_format="fp8_ds_mla" a kv that is not uint8 / float8_e4m3fn.
        ValueError: shape mismatches, D_qk not in {512, 576}, d_v not 512, a last dim that is
            not contiguous, tensors on different devices, a non-finite sm_scale, an unknown
            kv_format; with kv_format="fp8_ds_mla" a kv whose rows are not 656 bytes or not 16-byte
            aligned, or a q with D_qk other than 576; with
            ``check=True`` also out-of-range or duplicate valid indices, a topk_length outside
            [0, K], cu_seqlens_q that do not run from 0 to T non-decreasing, and a NaN / inf in a
            kv row that some query selects (``check_contents``).
    """
    q = _require_tensor("q", q)
    kv = _require_tensor("kv", kv)
    indices = _require_tensor("indices", indices)
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, D_qk], got shape {tuple(q.shape)}")
    if q.dtype not in allowed_dtypes:
        raise TypeError(f"q must have dtype in {allowed_dtypes}, got {q.dtype}")
    T, H, D = q.shape
    if H < 1:
        raise ValueError(f"q must have at least one head, got shape {tuple(q.shape)}")
    if D not in SUPPORTED_D_QK:
        raise ValueError(
            f"q: D_qk (last dim) must be one of {SUPPORTED_D_QK} (kv_lora_rank 512 + qk_rope_head_dim 64, "
            f"or 512 for the NoPE layout), got {D}"
        )
    if q.stride(-1) != 1:
        raise ValueError(f"q must be contiguous in its last dim (stride 1), got strides {q.stride()}")
    kv_format = check_kv_format(kv_format)
    if kv_format is not None:
        kv = kv_rows_of_format(kv, kv_format, D, "q: D_qk (last dim)")
        _require_same_device("kv", kv, q)
    else:
        if looks_like_fp8_ds_mla(kv):
            raise TypeError(f"kv is {kv.dtype} {list(kv.shape)}: an FP8 cache of 656-byte rows? pass "
                            "kv_format='fp8_ds_mla' (sparse_mla.kv_format); without it kv must be latent rows in q's "
                            f"dtype ({q.dtype})")
        kv = flatten_kv(kv)
        _require_same_device("kv", kv, q)
        if kv.dtype != q.dtype:
            raise TypeError(f"kv must have the dtype of q ({q.dtype}), got {kv.dtype}")
        if kv.shape[1] != D:
            raise ValueError(f"kv must be [N, D_qk] with D_qk = {D} (the last dim of q), got shape {tuple(kv.shape)}")
        if kv.stride(-1) != 1:
            raise ValueError(f"kv must be contiguous in its last dim (stride 1), got strides {kv.stride()}")
    if require_int("d_v", d_v) not in SUPPORTED_D_V:
        raise ValueError(f"d_v must be one of {SUPPORTED_D_V} (kv_lora_rank; V is the first d_v columns of kv), got {d_v}")
    d_v = int(d_v)

    _require_same_device("indices", indices, q)
    _require_int32("indices", indices, "[T, K] or [T, 1, K]")
    if indices.dim() == 3:
        if indices.shape[1] != 1:
            raise ValueError(f"indices given as [T, 1, K] (FlashMLA layout) need size 1 in dim 1, got {tuple(indices.shape)}")
        indices = indices[:, 0, :]
    if indices.dim() != 2 or indices.shape[0] != T:
        raise ValueError(f"indices must be [T, K] or [T, 1, K] with T = {T} (the tokens of q), got shape {tuple(indices.shape)}")
    if indices.shape[1] < 1:
        raise ValueError(f"indices must have K >= 1 entries per token, got shape {tuple(indices.shape)}")
    if indices.stride(-1) != 1:
        raise ValueError(f"indices must be contiguous in its last dim, got strides {indices.stride()}")

    if topk_length is not None:
        topk_length = _require_tensor("topk_length", topk_length)
        _require_same_device("topk_length", topk_length, q)
        _require_int32("topk_length", topk_length, "[T]")
        if topk_length.shape != (T,):
            raise ValueError(f"topk_length must be [T] = [{T}], got shape {tuple(topk_length.shape)}")
        topk_length = topk_length.contiguous()
    if cu_seqlens_q is not None:
        cu_seqlens_q = _require_tensor("cu_seqlens_q", cu_seqlens_q)
        _require_same_device("cu_seqlens_q", cu_seqlens_q, q)
        _require_int32("cu_seqlens_q", cu_seqlens_q, "[B + 1]")
        if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] < 2:
            raise ValueError(f"cu_seqlens_q must be [B + 1] with B >= 1 requests, got shape {tuple(cu_seqlens_q.shape)}")
        cu_seqlens_q = cu_seqlens_q.contiguous()

    sm_scale = require_finite_float("sm_scale", sm_scale, " (the softmax scale)")
    require_bool("check", check)

    problem = SparseMLAProblem(q, kv, indices, topk_length, cu_seqlens_q, sm_scale, d_v, kv_format)
    if check:
        check_contents(problem)
    return problem


def check_contents(p: SparseMLAProblem) -> None:
    """The checked mode: reads tensor contents (syncs the device).

    Raises:
        ValueError: a valid (non-negative) index >= N, duplicate valid rows in one query's list,
            topk_length outside [0, K], cu_seqlens_q not running from 0 to T non-decreasing, or a
            NaN / inf in a kv row that some query selects (``check_selected_rows_finite``; an FP8
            cache's rows as they dequantize to q's dtype).
    """
    T, N = p.num_tokens, p.num_kv_rows
    idx = p.indices
    counted = counted_entries(idx, p.topk_length)
    oob = counted & (idx >= N)
    if bool(oob.any()):
        t, j = (int(v) for v in oob.nonzero()[0])
        raise ValueError(f"indices[{t}, {j}] = {int(idx[t, j])} is out of range for kv with N = {N} rows (check=True)")
    valid = counted & (idx >= 0)
    require_distinct_rows(idx, valid)
    if p.cu_seqlens_q is not None:
        cu = p.cu_seqlens_q
        if int(cu[0]) != 0 or int(cu[-1]) != T or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"cu_seqlens_q must run from 0 to T = {T}, non-decreasing; got {cu.tolist()}")
    check_selected_rows_finite(p.kv, idx, valid, kv_format=p.kv_format, dtype=p.q.dtype)


def check_attn_sink_values(attn_sink: torch.Tensor) -> None:
    """The checked mode's look at an ``attn_sink`` [H] float32 (syncs the device): a NaN sink logit makes its
    head's out NaN for every query with a valid row, so it is refused; -inf (no sink) and +inf (out 0) are
    defined (``sparse_mla.mqa.reference``).

    Raises:
        ValueError: naming the first NaN head.
    """
    nan = torch.isnan(attn_sink)
    if bool(nan.any()):
        h = int(nan.nonzero()[0, 0])
        raise ValueError(f"attn_sink[{h}] is NaN ({int(nan.sum())} NaN heads): out of head {h} would be NaN for every "
                         "query with a valid row; a sink logit must be a number, -inf (no sink) or +inf (out 0) (check=True)")


def check_sink_and_max_logits(attn_sink: torch.Tensor | None, max_logits: torch.Tensor | None, T: int, H: int,
                              device: torch.device, *, check: bool = False) -> torch.Tensor | None:
    """Check ``attn_sink`` ([H] float32) and ``max_logits`` ([T, H] float32, heads contiguous) on ``device``;
    returns attn_sink made contiguous (the kernels index it by head). ``check``: also read attn_sink's values
    (``check_attn_sink_values``; syncs the device).

    Raises:
        TypeError: not a tensor, or not float32. ValueError: wrong shape, device or layout; with check, a NaN
            attn_sink entry.
    """
    for name, x, shape in (("attn_sink", attn_sink, (H,)), ("max_logits", max_logits, (T, H))):
        if x is None:
            continue
        dims = "[H]" if name == "attn_sink" else "[T, H]"
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a float32 tensor {dims}, got {type(x).__name__}")
        if x.dtype != torch.float32:
            raise TypeError(f"{name} must be float32 {dims}, got dtype {x.dtype}")
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must be {dims} = {list(shape)}, got shape {tuple(x.shape)}")
        if x.device != device:
            raise ValueError(f"{name} is on {x.device} but q is on {device}; all tensors must share one device")
    if max_logits is not None and H > 1 and max_logits.stride(1) != 1:
        raise ValueError(f"max_logits must have contiguous heads (stride 1 along dim 1), got strides {max_logits.stride()}")
    if check and attn_sink is not None:
        check_attn_sink_values(attn_sink)
    return None if attn_sink is None else attn_sink.contiguous()


def validate_fwd_buffers(
    p: SparseMLAProblem,
    *,
    return_lse: bool,
    grouped: bool,
    group_size: int | None,
    overlap_guard: float | None,
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    workspace: object | None,
    extra_outputs: dict[str, torch.Tensor | None] | None = None,
    extra_inputs: dict[str, torch.Tensor | None] | None = None,
) -> int:
    """The options and buffers of ``sparse_mla_fwd`` beyond ``validate_sparse_mla_args``, checked before
    any launch: types of the flags and numbers, ``out`` / ``lse`` (shape, dtype, device, layout, no
    overlap with themselves, each other or the inputs) and the workspace (type, device, fit).

    Args:
        p: the validated problem. grouped: whether the grouped method runs (group_size and the
            workspace's fit matter only then). extra_outputs / extra_inputs: other buffers the
            kernels write / read, already checked for shape and dtype (e.g. max_logits / attn_sink):
            an output must not overlap itself or any other buffer. The rest: as ``sparse_mla_fwd``.

    Returns:
        G, the group size the call uses (``group_size`` or ``default_group_size(H)``).

    Raises:
        TypeError: a non-bool return_lse, a non-int group_size, a non-number overlap_guard, a
            non-tensor / wrong-dtype out or lse, a workspace that is not a ``SparseMLAWorkspace``.
        ValueError: group_size out of range, a negative or NaN overlap_guard (-1.0 is accepted: the default), out /
            lse of the wrong shape, device or layout or overlapping, a workspace on another device or too small.
    """
    from ..union.workspace import SparseMLAWorkspace  # on first use: it imports the union's kernel modules

    T, H, _ = p.q.shape
    dev = p.q.device
    require_bool("return_lse", return_lse)
    if group_size is not None:
        require_int("group_size", group_size, minimum=1, maximum=MAX_GROUP_SIZE)
    G = int(group_size) if group_size is not None else default_group_size(H)
    if grouped and not (G == 1 or G * H <= 128):
        raise ValueError(f"group_size must be in [1, {MAX_GROUP_SIZE}] with group_size * H <= 128 (one 128-row tile), "
                         f"got {G} with H = {H}")
    if overlap_guard is not None and not (not isinstance(overlap_guard, bool) and overlap_guard == -1.0):
        what = " >= 0 (union rows per mean list), math.inf (no guard) or None (the default table)"
        if isinstance(overlap_guard, bool) or not isinstance(overlap_guard, numbers.Real):
            require_finite_float("overlap_guard", overlap_guard, what)  # raises TypeError
        g = float(overlap_guard)
        if math.isnan(g) or g < 0:
            raise ValueError(f"overlap_guard must be{what}, got {g}")
    if out is not None:
        check_tensor("out", out, dims="[T, H, d_v]", shape=(T, H, p.d_v), dtype=p.q.dtype, device=dev,
                     layout="last_dim", writable=True)
    if lse is not None:
        check_tensor("lse", lse, dims="[T, H]", shape=(T, H), dtype=torch.float32, device=dev, layout="contiguous",
                     writable=True)
    for name, x in (extra_outputs or {}).items():
        if x is not None and has_self_overlap(x):
            raise ValueError(f"{name} must have every element its own memory (a buffer the kernel writes); got strides "
                             f"{tuple(x.stride())} for shape {list(x.shape)} (an expanded or overlapping view)")
    require_disjoint({"out": out, "lse": lse, **(extra_outputs or {})},
                     {"q": p.q, "kv": p.kv, "indices": p.indices, "topk_length": p.topk_length,
                      "cu_seqlens_q": p.cu_seqlens_q, **(extra_inputs or {})})
    if workspace is not None:
        if not isinstance(workspace, SparseMLAWorkspace):
            raise TypeError(f"workspace must be a SparseMLAWorkspace or None, got {describe(workspace)}")
        if workspace.route.device != dev:
            raise ValueError(f"workspace must be on q's device {dev}, got a workspace on {workspace.route.device}")
        if grouped:
            ok, why = workspace.fits(T, p.topk, G, p.num_kv_rows)
            if not ok:
                raise ValueError(f"workspace does not fit this call: {why} (SparseMLAWorkspace.for_problem sizes one)")
    return G
