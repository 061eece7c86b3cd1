"""Input checks shared by the reference and every kernel launcher.

Every check runs before any kernel launch and raises a ``TypeError`` (wrong type or dtype) or
``ValueError`` (wrong shape, device, layout or value) whose message names the argument and what
was expected. Checks that need the tensor contents (and therefore a device sync) run only in the
checked mode (``check=True``).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from . import env
from .kv_format import KV_FORMATS, check_kv_format, looks_like_fp8_ds_mla

SUPPORTED_D_QK = (512, 576)
SUPPORTED_D_V = (512,)
KERNEL_DTYPES = (torch.bfloat16, torch.float16)


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


def _require_tensor(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _require_int32(name: str, x: torch.Tensor, shape_doc: str) -> None:
    if x.dtype != torch.int32:
        raise TypeError(f"{name} must be int32 {shape_doc}, got dtype {x.dtype}")


def _require_same_device(name: str, x: torch.Tensor, ref: torch.Tensor) -> None:
    if x.device != ref.device:
        raise ValueError(f"{name} is on {x.device} but q is on {ref.device}; all tensors must share one device")


def describe(x: object) -> str:
    """What an argument is, for error messages: a tensor's dtype, shape, device and strides, else its
    type and value."""
    if isinstance(x, torch.Tensor):
        return f"{str(x.dtype).replace('torch.', '')} {list(x.shape)} on {x.device} with strides {tuple(x.stride())}"
    return f"{type(x).__name__} {x!r}"


def require_bool(name: str, x: object) -> bool:
    """``x`` itself if it is a bool; a TypeError naming ``name`` otherwise (0 / 1, None or a string are not
    silently read as a truth value)."""
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be a bool (True or False), got {describe(x)}")
    return x


def require_int(name: str, x: object, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``x`` as an int: an integer (Python or NumPy), not a bool and not a float (8.0 is refused, not
    truncated). Raises TypeError for the type, ValueError for a value outside [minimum, maximum]."""
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {describe(x)}")
    v = int(x)
    if (minimum is not None and v < minimum) or (maximum is not None and v > maximum):
        lo = "-inf" if minimum is None else minimum
        hi = "inf" if maximum is None else maximum
        raise ValueError(f"{name} must be an int in [{lo}, {hi}], got {v}")
    return v


def require_finite_float(name: str, x: object, what: str = "") -> float:
    """``x`` as a float: a real Python / NumPy number, not a bool (True would silently be 1.0) and not a
    tensor (reading one syncs the device). Raises TypeError for the type, ValueError when not finite."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        hint = " (pass a Python float; a tensor would need a device sync)" if isinstance(x, torch.Tensor) else ""
        raise TypeError(f"{name} must be a finite float{what}, got {describe(x)}{hint}")
    v = float(x)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be a finite float{what}, got {v!r}")
    return v


def has_self_overlap(x: torch.Tensor) -> bool:
    """True when two elements of ``x`` may share memory (a stride-0 / expanded view, or strides that
    interleave): a sufficient test, so a layout it cannot prove free of overlap counts as overlapping."""
    extent = 1  # elements spanned by the dims checked so far
    for stride, size in sorted((st, sz) for st, sz in zip(x.stride(), x.shape) if sz > 1):
        if stride < extent:
            return True
        extent += stride * (size - 1)
    return False


def _byte_span(x: torch.Tensor) -> tuple[int, int, int]:
    """(storage address, first byte, one past the last byte) of the memory ``x`` can touch."""
    start = x.storage_offset() * x.element_size()
    last = sum((sz - 1) * st for sz, st in zip(x.shape, x.stride())) if x.numel() else -1
    return x.untyped_storage().data_ptr(), start, start + (last + 1) * x.element_size()


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory ranges of ``a`` and ``b`` intersect (same storage; conservative for
    interleaved views). False for tensors without storage (meta, fake) and for empty ones."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device or a.device.type == "meta":
        return False
    try:
        pa, sa, ea = _byte_span(a)
        pb, sb, eb = _byte_span(b)
    except (RuntimeError, NotImplementedError):  # FakeTensor / functional tensors carry no storage address
        return False
    return pa == pb and sa < eb and sb < ea


LAYOUTS = {
    "any": "any strides",
    "last_dim": "last dim contiguous (stride 1)",
    "contiguous": "contiguous",
}


def check_tensor(name: str, x: object, *, dims: str, shape: tuple[int, ...] | None = None,
                 dtype: torch.dtype | tuple[torch.dtype, ...] | None = None, device: torch.device | None = None,
                 layout: str = "any", writable: bool = False) -> torch.Tensor:
    """One argument checked in full, before any launch: a tensor, of ``dtype`` (one of them, for a
    tuple), ``shape`` (None: any), on ``device`` (None: any), with ``layout`` ("any", "last_dim",
    "contiguous"), and, for a buffer a kernel writes (``writable``), no two elements sharing memory.
    Every message names the argument, says what was expected (``dims`` is the symbolic shape, e.g.
    "[T, H, d_v]") and what was found.

    Raises:
        TypeError: not a tensor, or another dtype.
        ValueError: another shape, device or layout, or an overlapping buffer.
    """
    want_dtype = "" if dtype is None else (
        " " + "/".join(str(d).replace("torch.", "") for d in dtype) if isinstance(dtype, tuple)
        else " " + str(dtype).replace("torch.", ""))
    want_shape = dims if shape is None else f"{dims} = {list(shape)}"
    where = "" if device is None else f" on {device}"
    expected = f"{want_shape}{want_dtype}{where}, {LAYOUTS[layout]}"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {expected}; got {describe(x)}")
    if dtype is not None and x.dtype not in (dtype if isinstance(dtype, tuple) else (dtype,)):
        raise TypeError(f"{name} must be {expected}; got dtype {x.dtype}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must be {expected}; got shape {list(x.shape)}")
    if device is not None and x.device != device:
        raise ValueError(f"{name} must be {expected}; got a tensor on {x.device} (all tensors must share one device)")
    if layout == "last_dim" and x.dim() and x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"{name} must be {expected}; got strides {tuple(x.stride())}")
    if layout == "contiguous" and not x.is_contiguous():
        raise ValueError(f"{name} must be {expected}; got strides {tuple(x.stride())}")
    if writable and has_self_overlap(x):
        raise ValueError(f"{name} must be {expected}, and every element its own memory (a buffer the kernel "
                         f"writes); got strides {tuple(x.stride())} for shape {list(x.shape)} (an expanded or "
                         "overlapping view)")
    return x


def require_disjoint(outputs: dict[str, torch.Tensor | None], inputs: dict[str, torch.Tensor | None]) -> None:
    """Buffers a kernel writes must not share memory with each other or with its inputs.

    Raises:
        ValueError: naming the two arguments.
    """
    outs = [(n, t) for n, t in outputs.items() if t is not None]
    ins = [(n, t) for n, t in inputs.items() if t is not None]
    for i, (a, ta) in enumerate(outs):
        for b, tb in outs[i + 1:] + ins:
            if shares_memory(ta, tb):
                raise ValueError(f"{a} shares memory with {b}: a buffer the kernel writes must not overlap its other "
                                 f"outputs or inputs ({a}: {describe(ta)}; {b}: {describe(tb)})")


def require_kernel_tensor(name: str, x: torch.Tensor) -> None:
    """Check that the Triton kernels can read ``x``: on a CUDA device, or on the CPU under
    TRITON_INTERPRET=1 (Triton's interpreter), and not bfloat16 under the interpreter, whose bf16
    ``tl.dot`` gives wrong results without an error (off by ~1e9 on a 16x32 @ 32x16 product).
    The one check in front of every kernel entry point (``sparse_mla_fwd``, ``build_group_union``,
    ``kernels.masked_mha.masked_mha_fwd``); runs before any launch.

    Raises:
        ValueError: ``x`` on neither CUDA nor the CPU with TRITON_INTERPRET=1.
        TypeError: ``x`` bfloat16 on the CPU, or on CUDA with TRITON_INTERPRET=1.
    """
    interpreted = env.interpreted()
    if x.device.type not in ("cpu", "cuda") or (x.device.type == "cpu" and not interpreted):
        raise ValueError(
            f"{name} is on {x.device}: the Triton kernels need a CUDA device, or CPU tensors with TRITON_INTERPRET=1 "
            "set before sparse_mla is imported; the plain-PyTorch references run on any device"
        )
    if x.dtype == torch.bfloat16 and (x.device.type == "cpu" or interpreted):
        where = "on the CPU" if x.device.type == "cpu" else f"on {x.device}"
        raise TypeError(
            f"{name} is bfloat16 {where}: under TRITON_INTERPRET=1 Triton's interpreter computes bf16 tl.dot "
            "wrongly; use float16 on the CPU, or a CUDA device without TRITON_INTERPRET=1"
        )


def flatten_kv(kv: torch.Tensor) -> torch.Tensor:
    """View a latent cache as rows: [N, D_qk] stays, a paged [num_blocks, block_size, D_qk] becomes
    [num_blocks * block_size, D_qk] when the block stride allows a flat view.

    Raises:
        ValueError: kv is not 2-D or 3-D, or a paged cache whose block stride is not
            block_size * row stride (other layers' pages in between); pass a block_table-converted
            index into the underlying storage instead (see ``sparse_mla.integration``).
    """
    if kv.dim() == 2:
        return kv
    if kv.dim() == 3:
        nb, bs, d = kv.shape
        if kv.stride(0) != bs * kv.stride(1):
            raise ValueError(
                f"kv: a paged cache [num_blocks, block_size, D_qk] must have block stride "
                f"block_size * row stride = {bs * kv.stride(1)} to be viewed as rows, got {kv.stride(0)}"
            )
        return kv.as_strided((nb * bs, d), (kv.stride(1), kv.stride(2)))
    raise ValueError(f"kv must be [N, D_qk] or [num_blocks, block_size, D_qk], got shape {tuple(kv.shape)}")


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


def counted_entries(indices: torch.Tensor, topk_length: torch.Tensor | None) -> torch.Tensor:
    """[T, K] bool: the entries before topk_length[t] (all when None). Syncs the device.

    Raises:
        ValueError: a topk_length outside [0, K].
    """
    K = indices.shape[1]
    if topk_length is None:
        return torch.ones_like(indices, dtype=torch.bool)
    bad = (topk_length < 0) | (topk_length > K)
    if bool(bad.any()):
        t = int(bad.nonzero()[0, 0])
        raise ValueError(f"topk_length[{t}] = {int(topk_length[t])} is outside [0, K = {K}]")
    return torch.arange(K, device=indices.device)[None, :] < topk_length[:, None]


def check_contents(p: SparseMLAProblem) -> None:
    """The checked mode: reads tensor contents (syncs the device).

    Raises:
        ValueError: a valid (non-negative) index >= N, duplicate valid rows in one query's list,
            topk_length outside [0, K], cu_seqlens_q not running from 0 to T non-decreasing, or a
            NaN / inf in a kv row that some query selects (``check_selected_rows_finite``; an FP8
            cache's rows as they dequantize to q's dtype).
    """
    T, K, N = p.num_tokens, p.topk, p.num_kv_rows
    idx = p.indices
    counted = counted_entries(idx, p.topk_length)
    oob = counted & (idx >= N)
    if bool(oob.any()):
        t, j = (int(v) for v in oob.nonzero()[0])
        raise ValueError(f"indices[{t}, {j}] = {int(idx[t, j])} is out of range for kv with N = {N} rows (check=True)")
    valid = counted & (idx >= 0)
    keyed = torch.where(valid, idx.long(), -1 - torch.arange(K, device=idx.device, dtype=torch.long)[None, :])
    s, _ = keyed.sort(dim=1)
    dup = (s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)
    if bool(dup.any()):
        t, j = (int(v) for v in dup.nonzero()[0])
        raise ValueError(f"indices[{t}] lists row {int(s[t, j + 1])} more than once; top-k rows of one query must be "
                         "distinct (check=True)")
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


def kv_rows_of_format(kv: object, kv_format: str, d_qk: int, d_qk_name: str, name: str = "kv") -> torch.Tensor:
    """A cache of ``kv_format`` (not None) checked and viewed as its byte rows [N, row_bytes]
    (``sparse_mla.kv_format``), for a problem whose D_qk (``d_qk``, named ``d_qk_name`` in messages) must be
    the format's.

    Raises:
        TypeError, ValueError: as ``FP8DSMLAFormat.as_rows``; ValueError when d_qk is not the format's D_qk.
    """
    fmt = KV_FORMATS[kv_format]
    rows = fmt.as_rows(kv, name)
    if d_qk != fmt.d_qk:
        raise ValueError(f"{d_qk_name} must be {fmt.d_qk} (kv_lora_rank {fmt.kv_lora_rank} + qk_rope_head_dim "
                         f"{fmt.qk_rope_head_dim}) with kv_format={kv_format!r}, got {d_qk}")
    return rows


NONFINITE_CONTRACT = ('docs/DESIGN.md "Non-finite kv rows": a query that selects such a row gets a non-finite out / '
                      "lse; on the grouped path every query of its group gets a non-finite out, on the dense / masked MHA "
                      "paths any query of its request")


def nonfinite_rows(kv: torch.Tensor, rows: torch.Tensor, chunk: int = 4096, *, kv_format: str | None = None,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """The entries of ``rows`` (1-D int64 row ids of ``kv`` [N, D]) whose row holds a NaN or an inf,
    ascending; reads ``chunk`` rows at a time (no full-size temporary). With a ``kv_format`` (kv its byte
    rows), the rows as they dequantize to ``dtype`` (``sparse_mla.kv_format``), which must be q's dtype: the
    kernels and references dequantize to it, and a product that is finite in fp32 can overflow there (e4m3
    256 times scale 256 is 65536, inf in fp16)."""
    fmt = None if kv_format is None else KV_FORMATS[kv_format]
    if fmt is not None and dtype is None:
        raise ValueError("nonfinite_rows: a kv_format needs the dtype its rows dequantize to (q's dtype)")
    bad = []
    for r0 in range(0, rows.numel(), chunk):
        r = rows[r0:r0 + chunk]
        vals = kv[r] if fmt is None else fmt.dequantize(kv, dtype, rows=r)
        bad.append(r[~torch.isfinite(vals).all(dim=1)])
    return torch.cat(bad) if bad else rows[:0]


def check_selected_rows_finite(kv: torch.Tensor, indices: torch.Tensor, selected: torch.Tensor,
                               what: str = "check=True", *, kv_format: str | None = None,
                               dtype: torch.dtype | None = None) -> None:
    """Raise when a kv row that some query selects holds a NaN or an inf (syncs the device).

    Args:
        kv: [N, D] rows (the byte rows of a ``kv_format`` cache: checked as they dequantize to ``dtype``,
            q's dtype, the one the kernels compute in).
        indices: [T, K] int32 rows. selected: [T, K] bool, the entries that count
            (valid: counted, >= 0 and < N).

    Raises:
        ValueError: naming the first such rows (up to 8), the first entry that selects one, and
            what the non-finite row does to the result on each path.
    """
    if indices.numel() == 0:
        return
    rows = torch.unique(indices[selected].long())
    bad = nonfinite_rows(kv, rows, kv_format=kv_format, dtype=dtype)
    if bad.numel() == 0:
        return
    first = bad[:8].tolist()
    more = f" and {bad.numel() - 8} more" if bad.numel() > 8 else ""
    t, j = (int(v) for v in (selected & (indices.long() == bad[0])).nonzero()[0])
    raise ValueError(
        f"kv rows {first}{more} hold NaN or inf values and are selected by some query (first: indices[{t}, {j}] = "
        f"{first[0]}); the output of a query that selects such a row is not finite ({NONFINITE_CONTRACT}) ({what})"
    )


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
        ValueError: group_size out of range, a negative or non-finite overlap_guard, out / lse of the
            wrong shape, device or layout or overlapping, a workspace on another device or too small.
    """
    from .union.grouping import MAX_GROUP_SIZE, default_group_size
    from .union.workspace import SparseMLAWorkspace

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
        g = require_finite_float("overlap_guard", overlap_guard, " >= 0 (union rows per mean list), -1 or None")
        if g < 0:
            raise ValueError(f"overlap_guard must be >= 0 (union rows per mean list), -1 (the default table) or None "
                             f"(no guard), got {g}")
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


def validate_group_union_args(indices: object, group_size: object, topk_length: object, num_kv_rows: object,
                              max_group_size: int) -> tuple[torch.Tensor, int, torch.Tensor | None, int]:
    """The arguments of ``build_group_union``, checked before any launch.

    Returns:
        (indices [T, K] view, G, topk_length contiguous or None, N bound: num_kv_rows or 2**31 - 1).

    Raises:
        TypeError: a non-tensor or non-int32 indices / topk_length, a group_size or num_kv_rows that is
            not an int (a bool or a float is refused).
        ValueError: indices not [T, K] / [T, 1, K] with K >= 1, group_size outside [1, max_group_size],
            topk_length not [T] on indices' device, num_kv_rows < 1.
    """
    indices = check_tensor("indices", indices, dims="[T, K] or [T, 1, K]", dtype=torch.int32)
    if indices.dim() == 3 and indices.shape[1] == 1:
        indices = indices[:, 0]
    if indices.dim() != 2 or indices.shape[1] < 1:
        raise ValueError(f"indices must be [T, K] or [T, 1, K] with K >= 1, got shape {list(indices.shape)}")
    G = require_int("group_size", group_size, minimum=1, maximum=max_group_size)
    T = indices.shape[0]
    if topk_length is not None:
        topk_length = check_tensor("topk_length", topk_length, dims="[T]", shape=(T,), dtype=torch.int32,
                                   device=indices.device).contiguous()
    N = 2**31 - 1 if num_kv_rows is None else require_int("num_kv_rows", num_kv_rows, minimum=1)
    return indices, G, topk_length, N
