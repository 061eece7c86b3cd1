"""The checks of the layer-level DSA prefill: ``dsa_prefill`` / ``dsa_prefill_ref`` arguments (normalized into a
``DSAPrefillProblem``), the checked mode's look at their contents (causal windows, repeats, non-finite cache rows)
and ``dsa_prefill``'s ``out``. Every check runs before any kernel launch (``sparse_mla.checks`` has the generic ones).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..checks import (
    KERNEL_DTYPES,
    NONFINITE_CONTRACT,
    check_tensor,
    counted_entries,
    flatten_kv,
    nonfinite_rows,
    require_bool,
    require_disjoint,
    require_distinct_rows,
    require_finite_float,
)
from ..kv_format import KV_FORMATS, check_kv_format, kv_rows_of_format
from .problem import DSAPrefillProblem, PrefillStep, _lengths, kernels_available, token_windows, window_row_ids


def _tensor(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _same(name: str, x: torch.Tensor, ref: torch.Tensor) -> None:
    if x.device != ref.device:
        raise ValueError(f"{name} is on {x.device} but q_nope is on {ref.device}; all tensors must share one device")
    if x.dtype != ref.dtype:
        raise TypeError(f"{name} must have the dtype of q_nope ({ref.dtype}), got {x.dtype}")


def _joint_rows(kv_c: torch.Tensor, k_pe: torch.Tensor | None) -> torch.Tensor | None:
    """kv_c [N, r] and k_pe [N, rope] as one [N, r + rope] view when they are adjacent columns of one
    buffer (kv_c = kv[:, :r], k_pe = kv[:, r:]); kv_c itself when there is no rope part; else None."""
    if k_pe is None:
        return kv_c
    N, r = kv_c.shape
    if (k_pe.stride(0) == kv_c.stride(0) and kv_c.stride(1) == 1 and k_pe.stride(1) == 1
            and k_pe.untyped_storage().data_ptr() == kv_c.untyped_storage().data_ptr()
            and k_pe.storage_offset() == kv_c.storage_offset() + r):
        return kv_c.as_strided((N, r + k_pe.shape[1]), (kv_c.stride(0), 1))
    return None


def validate_dsa_prefill_args(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor | None,
    w_kv_b: torch.Tensor,
    indices: torch.Tensor,
    *,
    kv: torch.Tensor | None = None,
    kv_c: torch.Tensor | None = None,
    k_pe: torch.Tensor | None = None,
    cached_lens: Sequence[int] | torch.Tensor,
    new_lens: Sequence[int] | torch.Tensor,
    row_offsets: Sequence[int] | torch.Tensor | None = None,
    sm_scale: float,
    topk_length: torch.Tensor | None = None,
    dense_topk: bool | None = None,
    check: bool = False,
    allowed_dtypes: tuple[torch.dtype, ...] = KERNEL_DTYPES,
    kv_format: str | None = None,
) -> DSAPrefillProblem:
    """Check the arguments of ``dsa_prefill`` / ``dsa_prefill_ref`` and normalize them.

    See ``sparse_mla.layer.dsa_prefill`` for the meaning of each argument.

    Raises:
        TypeError: a non-tensor where a tensor is expected, a dtype outside ``allowed_dtypes`` or
            different from q_nope's, non-int32 indices / topk_length, non-int lengths; a kv_format that is
            neither None nor a string, an FP8 cache that is not uint8 / float8_e4m3fn.
        ValueError: shape, device or layout mismatches (named), both or neither of kv / kv_c, an unknown
            kv_format, kv_c / k_pe with kv_format (the FP8 cache comes whole, as kv), an FP8 cache whose rows
            are not 656 bytes or not 16-byte aligned, or dims other than its kv_lora_rank 512 / qk_rope 64,
            lengths that do not add up to T, a request window past the end of the cache, a
            non-finite sm_scale; with ``check=True`` also: topk_length outside [0, K], a valid entry
            outside its query's causal window, a repeated row in one list, and (when the dense
            path would be eligible) a list that is not the whole window.
    """
    q_nope = _tensor("q_nope", q_nope)
    if q_nope.dim() != 3 or q_nope.shape[1] < 1 or q_nope.shape[2] < 1:
        raise ValueError(f"q_nope must be [T, H, qk_nope_head_dim] with H, qk_nope_head_dim >= 1, got {tuple(q_nope.shape)}")
    if q_nope.dtype not in allowed_dtypes:
        raise TypeError(f"q_nope must have dtype in {allowed_dtypes}, got {q_nope.dtype}")
    if q_nope.stride(-1) != 1:
        raise ValueError(f"q_nope must be contiguous in its last dim, got strides {q_nope.stride()}")
    T, H, d_nope = q_nope.shape
    d_rope = 0
    if q_pe is not None:
        q_pe = _tensor("q_pe", q_pe)
        _same("q_pe", q_pe, q_nope)
        if q_pe.dim() != 3 or q_pe.shape[:2] != (T, H):
            raise ValueError(f"q_pe must be [T, H, qk_rope_head_dim] = [{T}, {H}, *] or None, got shape {tuple(q_pe.shape)}")
        d_rope = q_pe.shape[2]
        if d_rope == 0:
            q_pe = None
        elif q_pe.stride(-1) != 1:
            raise ValueError(f"q_pe must be contiguous in its last dim, got strides {q_pe.stride()}")

    w_kv_b = _tensor("w_kv_b", w_kv_b)
    _same("w_kv_b", w_kv_b, q_nope)
    if w_kv_b.dim() != 2 or w_kv_b.shape[0] % H or w_kv_b.shape[0] // H <= d_nope:
        raise ValueError(
            f"w_kv_b (kv_b_proj.weight) must be [H * (qk_nope_head_dim + v_head_dim), kv_lora_rank] with "
            f"H = {H}, qk_nope_head_dim = {d_nope} and v_head_dim >= 1, got shape {tuple(w_kv_b.shape)}"
        )
    r = w_kv_b.shape[1]
    d_v = w_kv_b.shape[0] // H - d_nope
    w3 = w_kv_b.reshape(H, d_nope + d_v, r)

    kv_format = check_kv_format(kv_format)
    if (kv is None) == (kv_c is None):
        raise ValueError("pass exactly one of kv ([N, kv_lora_rank + qk_rope_head_dim] rows) or kv_c ([N, kv_lora_rank]; k_pe), "
                         f"got {'both' if kv is not None else 'neither'}")
    if kv_format is not None:
        if kv is None or k_pe is not None:
            raise ValueError(f"kv_format={kv_format!r}: pass the cache whole as kv (its rows hold kv_c and k_pe), not "
                             "kv_c / k_pe")
        fmt = KV_FORMATS[kv_format]
        kv_rows = kv_rows_of_format(kv, kv_format, r + d_rope, "kv_lora_rank + qk_rope_head_dim (w_kv_b's columns + "
                                    "q_pe's last dim)")
        if kv_rows.device != q_nope.device:
            raise ValueError(f"kv is on {kv_rows.device} but q_nope is on {q_nope.device}; all tensors must share one device")
        if r != fmt.kv_lora_rank:
            raise ValueError(f"w_kv_b (kv_b_proj.weight) must have kv_lora_rank = {fmt.kv_lora_rank} columns with "
                             f"kv_format={kv_format!r}, got {r}")
        kv_c = k_pe = None
    elif kv is not None:
        kv = flatten_kv(_tensor("kv", kv))
        _same("kv", kv, q_nope)
        if k_pe is not None:
            raise ValueError("k_pe must be None when kv holds whole rows (k_pe = kv[:, kv_lora_rank:])")
        if kv.shape[1] != r + d_rope or kv.stride(-1) != 1:
            raise ValueError(
                f"kv must be [N, kv_lora_rank + qk_rope_head_dim] = [N, {r + d_rope}] with a contiguous last dim, "
                f"got shape {tuple(kv.shape)} strides {kv.stride()}"
            )
        kv_rows = kv
        kv_c = kv[:, :r]
        k_pe = kv[:, r:] if d_rope else None
    else:
        kv_c = flatten_kv(_tensor("kv_c", kv_c))
        _same("kv_c", kv_c, q_nope)
        if kv_c.shape[1] != r or kv_c.stride(-1) != 1:
            raise ValueError(f"kv_c must be [N, kv_lora_rank] = [N, {r}] with a contiguous last dim, got shape "
                             f"{tuple(kv_c.shape)} strides {kv_c.stride()}")
        if d_rope:
            if k_pe is None:
                raise ValueError(f"k_pe [N, {d_rope}] is required when q_pe has qk_rope_head_dim = {d_rope}")
            k_pe = flatten_kv(_tensor("k_pe", k_pe))
            _same("k_pe", k_pe, q_nope)
            if k_pe.shape != (kv_c.shape[0], d_rope) or k_pe.stride(-1) != 1:
                raise ValueError(f"k_pe must be [N, qk_rope_head_dim] = [{kv_c.shape[0]}, {d_rope}] with a contiguous last dim, "
                                 f"got shape {tuple(k_pe.shape)} strides {k_pe.stride()}")
        elif k_pe is not None and k_pe.numel() != 0:
            raise ValueError(f"k_pe given with {k_pe.shape[-1]} columns but q_pe has qk_rope_head_dim = 0")
        else:
            k_pe = None
        kv_rows = _joint_rows(kv_c, k_pe)
    N = (kv_c if kv_c is not None else kv_rows).shape[0]

    indices = _tensor("indices", indices)
    if indices.device != q_nope.device:
        raise ValueError(f"indices is on {indices.device} but q_nope is on {q_nope.device}")
    if indices.dtype != torch.int32:
        raise TypeError(f"indices must be int32 [T, K] or [T, 1, K] (global kv rows, -1 = padding), got {indices.dtype}")
    if indices.dim() == 3 and indices.shape[1] == 1:
        indices = indices[:, 0]
    if indices.dim() != 2 or indices.shape[0] != T or indices.shape[1] < 1:
        raise ValueError(f"indices must be [T, K] or [T, 1, K] with T = {T} and K >= 1, got shape {tuple(indices.shape)}")
    indices = indices.contiguous()
    K = indices.shape[1]
    if topk_length is not None:
        topk_length = check_tensor("topk_length", topk_length, dims="[T]", shape=(T,), dtype=torch.int32,
                                   device=q_nope.device).contiguous()

    sm_scale = require_finite_float("sm_scale", sm_scale, " (the softmax scale)")
    require_bool("check", check)

    cached = _lengths("cached_lens", cached_lens)
    new = _lengths("new_lens", new_lens)
    if len(cached) != len(new) or not new:
        raise ValueError(f"cached_lens and new_lens must both have B >= 1 entries, got {len(cached)} and {len(new)}")
    if sum(new) != T:
        raise ValueError(f"new_lens must add up to T = {T} (the rows of q_nope), got sum {sum(new)}")
    if row_offsets is None:
        offs, acc = [], 0
        for c, n in zip(cached, new):
            offs.append(acc)
            acc += c + n
        row_offsets = tuple(offs)
    else:
        row_offsets = _lengths("row_offsets", row_offsets)
        if len(row_offsets) != len(new):
            raise ValueError(f"row_offsets must have B = {len(new)} entries, got {len(row_offsets)}")
    for b, (o, c, n) in enumerate(zip(row_offsets, cached, new)):
        if o + c + n > N:
            raise ValueError(f"request {b}: rows row_offsets + cached + new = {o} + {c} + {n} exceed the cache's N = {N} rows")

    step = PrefillStep(H, r, d_nope, d_rope, d_v, K, cached, new, dense_topk=dense_topk,
                       has_topk_length=topk_length is not None, kernels_available=kernels_available(q_nope.device, q_nope.dtype),
                       kv_format=kv_format)
    p = DSAPrefillProblem(q_nope, q_pe, w3, kv_c, k_pe, kv_rows, indices, topk_length, sm_scale, row_offsets, step,
                          kv_format)
    if check:
        check_layer_contents(p)
    return p


def check_layer_contents(p: DSAPrefillProblem) -> None:
    """The checked mode (syncs the device).

    Raises:
        ValueError: topk_length outside [0, K]; a counted entry >= 0 outside its query's causal
            window; a row listed twice for one query; a list that is not the whole window when the
            step is dense-eligible (``PrefillStep.dense_eligible``); a NaN / inf in a cache row
            (kv_c or k_pe) inside a request's window (``check_window_rows_finite``).
    """
    idx = p.indices
    T, K = idx.shape
    if T == 0:
        return
    counted = counted_entries(idx, p.topk_length)
    lo, win = token_windows(p.step.new_lens, p.step.cached_lens, p.row_offsets, idx.device)
    rel = idx.long() - lo[:, None]
    inside = (rel >= 0) & (rel < win[:, None])
    outside = counted & (idx >= 0) & ~inside
    if bool(outside.any()):
        t, j = (int(v) for v in outside.nonzero()[0])
        raise ValueError(f"indices[{t}, {j}] = {int(idx[t, j])} is outside the causal window of token {t} "
                         f"(rows {int(lo[t])} .. {int(lo[t] + win[t] - 1)}) (check=True)")
    valid = counted & inside
    require_distinct_rows(idx, valid)
    dense, _ = p.step.dense_eligible
    if dense:
        short = valid.sum(1) != win
        if bool(short.any()):
            t = int(short.nonzero()[0, 0])
            raise ValueError(f"token {t}: its top-k list holds {int(valid[t].sum())} of the {int(win[t])} rows of its window, "
                             "but the step is dense-eligible (pass dense_topk=False if the lists may be partial) (check=True)")
    check_window_rows_finite(p, idx, valid)


def check_window_rows_finite(p: DSAPrefillProblem, indices: torch.Tensor, selected: torch.Tensor) -> None:
    """Raise when a cache row inside a request's window holds a NaN or an inf (syncs the device).

    The window, not only the selected rows: the dense and masked MHA paths read every row of it, so
    an unselected non-finite row there still reaches the output of other queries (docs/DESIGN.md
    "Non-finite kv rows").

    Args:
        indices, selected: [T, K] int32 rows and the [T, K] bool entries that count (in-window).

    Raises:
        ValueError: naming the first such rows (up to 8), whether a query selects the first one (and
            which entry), and what it does to each path's result.
    """
    rows = window_row_ids(p)
    if rows.numel() == 0:
        return
    if p.kv_format is not None:  # the FP8 cache's rows as the paths dequantize them, to q's dtype (kv_c and k_pe)
        bad = nonfinite_rows(p.kv_rows, rows, kv_format=p.kv_format, dtype=p.q_nope.dtype)
    else:
        bad = nonfinite_rows(p.kv_c, rows)
    if p.k_pe is not None:
        bad = torch.unique(torch.cat([bad, nonfinite_rows(p.k_pe, rows)]))
    if bad.numel() == 0:
        return
    first = bad[:8].tolist()
    more = f" and {bad.numel() - 8} more" if bad.numel() > 8 else ""
    hit = (selected & (indices.long() == bad[0])).nonzero()
    who = (f"selected by indices[{int(hit[0, 0])}, {int(hit[0, 1])}]" if hit.shape[0] else
           "selected by no query, but inside a request window, which the MHA paths read whole")
    raise ValueError(f"cache rows {first}{more} (kv_c / k_pe) hold NaN or inf values; row {first[0]} is {who} "
                     f"({NONFINITE_CONTRACT}) (check=True)")


def validate_dsa_prefill_out(p: DSAPrefillProblem, out: object) -> torch.Tensor | None:
    """``dsa_prefill``'s ``out``: None, or [T, H, v_head_dim] in q_nope's dtype on its device, last dim
    contiguous, its own memory and not overlapping an input.

    Raises:
        TypeError: not a tensor, or another dtype. ValueError: another shape, device or layout, or overlap.
    """
    if out is None:
        return None
    T, H, _ = p.q_nope.shape
    check_tensor("out", out, dims="[T, H, v_head_dim]", shape=(T, H, p.step.v_head_dim), dtype=p.q_nope.dtype,
                 device=p.q_nope.device, layout="last_dim", writable=True)
    require_disjoint({"out": out}, {"q_nope": p.q_nope, "q_pe": p.q_pe, "w_kv_b": p.w_kv_b, "kv_c": p.kv_c,
                                    "k_pe": p.k_pe, "kv": p.kv_rows, "indices": p.indices, "topk_length": p.topk_length})
    return out
