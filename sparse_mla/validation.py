"""Input checks shared by the reference and every kernel launcher.

Every check runs before any kernel launch and raises a ``TypeError`` (wrong type or dtype) or
``ValueError`` (wrong shape, device, layout or value) whose message names the argument and what
was expected. Checks that need the tensor contents (and therefore a device sync) run only in the
checked mode (``check=True``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

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
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
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
) -> SparseMLAProblem:
    """Check the arguments of ``sparse_mla_fwd`` / ``sparse_mla_ref`` and normalize them.

    See ``sparse_mla.sparse_mla_fwd`` for the meaning of each argument.

    Raises:
        TypeError: a non-tensor argument, a dtype outside ``allowed_dtypes`` for q/kv,
            q and kv of different dtypes, non-int32 indices / topk_length / cu_seqlens_q.
        ValueError: shape mismatches, D_qk not in {512, 576}, d_v not 512, a last dim that is
            not contiguous, tensors on different devices, a non-finite sm_scale; with
            ``check=True`` also out-of-range or duplicate valid indices, a topk_length outside
            [0, K], and cu_seqlens_q that do not run from 0 to T non-decreasing.
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
    kv = flatten_kv(kv)
    _require_same_device("kv", kv, q)
    if kv.dtype != q.dtype:
        raise TypeError(f"kv must have the dtype of q ({q.dtype}), got {kv.dtype}")
    if kv.shape[1] != D:
        raise ValueError(f"kv must be [N, D_qk] with D_qk = {D} (the last dim of q), got shape {tuple(kv.shape)}")
    if kv.stride(-1) != 1:
        raise ValueError(f"kv must be contiguous in its last dim (stride 1), got strides {kv.stride()}")
    if d_v not in SUPPORTED_D_V:
        raise ValueError(f"d_v must be one of {SUPPORTED_D_V} (kv_lora_rank; V is the first d_v columns of kv), got {d_v}")

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

    if not isinstance(sm_scale, (int, float)) or not (float(sm_scale) == float(sm_scale)) or abs(float(sm_scale)) == float("inf"):
        raise ValueError(f"sm_scale must be a finite float (the softmax scale), got {sm_scale!r}")

    problem = SparseMLAProblem(q, kv, indices, topk_length, cu_seqlens_q, float(sm_scale), d_v)
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
            topk_length outside [0, K], or cu_seqlens_q not running from 0 to T non-decreasing.
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
        t = int(dup.nonzero()[0, 0])
        raise ValueError(f"indices[{t}] lists a valid row more than once; top-k rows of one query must be distinct (check=True)")
    if p.cu_seqlens_q is not None:
        cu = p.cu_seqlens_q
        if int(cu[0]) != 0 or int(cu[-1]) != T or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"cu_seqlens_q must run from 0 to T = {T}, non-decreasing; got {cu.tolist()}")
