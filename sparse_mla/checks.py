"""Generic input checks: argument types, tensors (dtype, shape, device, layout, overlap), the kernels' device,
kv rows, and non-finite rows (shared by every op's checks: ``sparse_mla.mqa.checks``, ``sparse_mla.layer.checks``,
``sparse_mla.union.interface``, the integration and distributed entry points).

Every check runs before any kernel launch and raises a ``TypeError`` (wrong type or dtype) or
``ValueError`` (wrong shape, device, layout or value) whose message names the argument and what
was expected. Checks that need the tensor contents (and therefore a device sync) run only in the
checked mode (``check=True``).
"""

from __future__ import annotations

import math
import numbers

import torch

from . import env
from .kv_format import KV_FORMATS

KERNEL_DTYPES = (torch.bfloat16, torch.float16)


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
    if not outs:
        return
    spans = {}
    for n, t in (*outs, *((n, t) for n, t in inputs.items() if t is not None)):
        spans[n] = _span_or_none(t)
    names = list(spans)
    for i, (a, ta) in enumerate(outs):
        sa = spans[a]
        if sa is None:
            continue
        for b in names[i + 1:]:
            sb = spans[b]
            if sb is not None and sa[0] == sb[0] and sa[1] < sb[2] and sb[1] < sa[2]:
                tb = outputs.get(b, inputs.get(b))
                raise ValueError(f"{a} shares memory with {b}: a buffer the kernel writes must not overlap its other "
                                 f"outputs or inputs ({a}: {describe(ta)}; {b}: {describe(tb)})")


def _span_or_none(x: torch.Tensor) -> tuple[tuple, int, int] | None:
    """((device, storage address), first byte, end byte) of ``x``, or None for an empty / storage-less tensor."""
    if x.numel() == 0 or x.device.type == "meta":
        return None
    try:
        p, s, e = _byte_span(x)
    except (RuntimeError, NotImplementedError):  # FakeTensor / functional tensors carry no storage address
        return None
    return (str(x.device), p), s, e


def require_kernel_tensor(name: str, x: torch.Tensor) -> None:
    """Check that the Triton kernels can read ``x``: on a CUDA device, or on the CPU under
    TRITON_INTERPRET=1 (Triton's interpreter), and not bfloat16 under the interpreter, whose bf16
    ``tl.dot`` gives wrong results without an error (off by ~1e9 on a 16x32 @ 32x16 product).
    The one check in front of every kernel entry point (``sparse_mla_fwd``, ``build_group_union``,
    ``layer.masked_mha.masked_mha_fwd``); runs before any launch.

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




def require_distinct_rows(indices: torch.Tensor, valid: torch.Tensor) -> None:
    """Checked mode: raise ValueError naming the first query whose valid entries (``valid`` [T, K] bool) of
    ``indices`` [T, K] list one row twice. Reads device data (syncs)."""
    K = indices.shape[1]
    keyed = torch.where(valid, indices.long(), -1 - torch.arange(K, device=indices.device, dtype=torch.long)[None, :])
    s, _ = keyed.sort(dim=1)
    dup = (s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)
    if bool(dup.any()):
        t, j = (int(v) for v in dup.nonzero()[0])
        raise ValueError(f"indices[{t}] lists row {int(s[t, j + 1])} more than once; top-k rows of one query must be "
                         "distinct (check=True)")
