"""torch custom ops over ``sparse_mla_fwd`` and the block-table converter, for torch.compile and CUDA graphs.

Importing this module registers (the bodies import the Triton kernels lazily, on first call):

* ``torch.ops.sparse_mla.fwd(q, kv, indices, sm_scale, d_v=512, topk_length=None,
  cu_seqlens_q=None, method="auto", group_size=None, kv_format=None) -> (out, lse)``: functional; allocates out,
  lse and the grouped path's scratch per call. Works with any torch.compile backend; under
  inductor's CUDA graphs (``mode="reduce-overhead"``) the allocations come from the graph pool.
* ``torch.ops.sparse_mla.fwd_out(q, kv, indices, out, lse, workspace, sm_scale, ..., group_size=None,
  kv_format=None) -> None``:
  writes into preallocated ``out`` [T, H, d_v] and ``lse`` [T, H] fp32 (or None) using the
  workspace buffers ``workspace_buffers(ws)`` (``[]`` = allocate scratch per call). Declared as
  mutating out, lse and workspace, so torch.compile orders it correctly; with a workspace and
  outputs given a call allocates no device memory: the form for engines that capture the
  attention step in their own CUDA graph (vLLM's ``unified_attention_with_output`` pattern).
* ``torch.ops.sparse_mla.convert_req_index(req_id, block_table, topk_local, block_size,
  kv_block_stride_rows=None, num_kv_rows=None) -> (indices, valid_counts)``.

Each op has a fake (meta) implementation for shape propagation, which runs the same argument
checks as the eager path, so bad shapes raise at trace time too. Inference only: no autograd.
Semantics: ``sparse_mla.mqa.reference.sparse_mla_ref`` and
``sparse_mla.integration.block_table.convert_req_index_to_global_ref``.
"""

# No ``from __future__ import annotations`` here: torch.library infers each op's schema from the
# evaluated type annotations.
import copy
import functools

import torch
from torch import Tensor

from ..mqa.checks import validate_sparse_mla_args
from .block_table import validate_convert_args


def _tensor_fields(workspace) -> list[str]:
    """Names of a workspace's tensor attributes, sorted (the order of ``workspace_buffers``)."""
    return sorted(k for k, v in vars(workspace).items() if isinstance(v, Tensor))


def workspace_buffers(workspace) -> list[Tensor]:
    """The device buffers of a ``SparseMLAWorkspace``, in the order ``sparse_mla::fwd_out`` takes them.

    Args:
        workspace: a ``sparse_mla.SparseMLAWorkspace`` (or None, giving ``[]``).

    Returns:
        Every tensor attribute of the workspace (group_start, group_len, route,
        union_rows, ...), sorted by attribute name.
    """
    if workspace is None:
        return []
    return [getattr(workspace, name) for name in _tensor_fields(workspace)]


@functools.lru_cache(maxsize=64)
def _workspace_template(max_tokens: int, topk: int, group_size: int, key64: bool):
    """A workspace of this geometry on the meta device (no memory): its scalar fields and buffer names."""
    from ..union.workspace import SparseMLAWorkspace

    return SparseMLAWorkspace(max_tokens, topk, group_size, 2**31 - 1 if key64 else 1, torch.device("meta"))


def _workspace_from_buffers(bufs: list[Tensor], topk: int, group_size: int):
    """Rebuild a ``SparseMLAWorkspace`` around the buffers of ``workspace_buffers(ws)`` (no allocation).

    The geometry comes from the arguments (topk, group_size) and the 1-D int8 buffers (route and
    probe_route, [max_tokens] each); every buffer is then checked against a meta-device workspace of
    that geometry.

    Raises:
        ValueError: buffers that are not those of a workspace for this topk and group size.
    """
    route = [t for t in bufs if t.dtype == torch.int8 and t.dim() == 1]
    if not route or any(t.shape != route[0].shape for t in route):
        raise ValueError(f"workspace must be [] or workspace_buffers(ws) of a SparseMLAWorkspace, got {len(bufs)} tensors")
    problems = []
    for key64 in (False, True):
        template = _workspace_template(route[0].shape[0], topk, group_size, key64)
        names = _tensor_fields(template)
        if len(names) != len(bufs):
            raise ValueError(f"workspace must be [] or workspace_buffers(ws) ({len(names)} tensors), got {len(bufs)}")
        bad = []
        for name, t in zip(names, bufs):
            ref = getattr(template, name)
            same_shape = t.shape == ref.shape if ref.dim() == 1 else (t.dim() == ref.dim() and t.shape[-1] == ref.shape[-1])
            if t.dtype != ref.dtype or not same_shape:
                bad.append(f"{name}: expected {ref.dtype} {tuple(ref.shape)}, got {t.dtype} {tuple(t.shape)}")
        if not bad:
            ws = copy.copy(template)
            ws.device = route[0].device
            for name, t in zip(names, bufs):
                setattr(ws, name, t)
            return ws
        problems = bad
    raise ValueError(
        f"workspace buffers are not those of a SparseMLAWorkspace for topk {topk}, group_size {group_size}: "
        + "; ".join(problems[:3])
    )


@torch.library.custom_op("sparse_mla::fwd", mutates_args=())
def fwd(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    sm_scale: float,
    d_v: int = 512,
    topk_length: Tensor | None = None,
    cu_seqlens_q: Tensor | None = None,
    method: str = "auto",
    group_size: int | None = None,
    kv_format: str | None = None,
) -> tuple[Tensor, Tensor]:
    """``sparse_mla_fwd(..., return_lse=True)`` as a custom op: returns new (out [T, H, d_v], lse [T, H] fp32)."""
    from ..mqa.interface import sparse_mla_fwd

    out, lse = sparse_mla_fwd(q, kv, indices, sm_scale, d_v=d_v, topk_length=topk_length, return_lse=True,
                              method=method, cu_seqlens_q=cu_seqlens_q, group_size=group_size, kv_format=kv_format)
    return out, lse


@fwd.register_fake
def _fwd_fake(q, kv, indices, sm_scale, d_v=512, topk_length=None, cu_seqlens_q=None, method="auto", group_size=None,
              kv_format=None):
    p = validate_sparse_mla_args(q, kv, indices, sm_scale, d_v=d_v, topk_length=topk_length, cu_seqlens_q=cu_seqlens_q,
                                 kv_format=kv_format)
    T, H, _ = p.q.shape
    return q.new_empty(T, H, d_v), q.new_empty(T, H, dtype=torch.float32)


@torch.library.custom_op("sparse_mla::fwd_out", mutates_args=("out", "lse", "workspace"))
def fwd_out(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    out: Tensor,
    lse: Tensor | None,
    workspace: list[Tensor],
    sm_scale: float,
    d_v: int = 512,
    topk_length: Tensor | None = None,
    cu_seqlens_q: Tensor | None = None,
    method: str = "auto",
    group_size: int | None = None,
    kv_format: str | None = None,
) -> None:
    """``sparse_mla_fwd(..., out=out, lse=lse, workspace=ws)`` as a mutating custom op.

    ``workspace`` is ``workspace_buffers(ws)`` or ``[]`` (scratch allocated per call);
    ``group_size`` must be the workspace's (default ``default_group_size(H)``, as in ``sparse_mla_fwd``).
    """
    from ..mqa.interface import sparse_mla_fwd
    from ..union.grouping import default_group_size

    ws = None
    if workspace:
        G = group_size if group_size is not None else default_group_size(q.shape[1])
        ws = _workspace_from_buffers(workspace, indices.shape[-1], G)
    sparse_mla_fwd(q, kv, indices, sm_scale, d_v=d_v, topk_length=topk_length, method=method,
                   cu_seqlens_q=cu_seqlens_q, workspace=ws, out=out, lse=lse, group_size=group_size, kv_format=kv_format)


@fwd_out.register_fake
def _fwd_out_fake(q, kv, indices, out, lse, workspace, sm_scale, d_v=512, topk_length=None, cu_seqlens_q=None, method="auto",
                  group_size=None, kv_format=None):
    validate_sparse_mla_args(q, kv, indices, sm_scale, d_v=d_v, topk_length=topk_length, cu_seqlens_q=cu_seqlens_q,
                             kv_format=kv_format)
    return None


@torch.library.custom_op("sparse_mla::convert_req_index", mutates_args=())
def convert_req_index(
    req_id: Tensor,
    block_table: Tensor,
    topk_local: Tensor,
    block_size: int,
    kv_block_stride_rows: int | None = None,
    num_kv_rows: int | None = None,
) -> tuple[Tensor, Tensor]:
    """``convert_req_index_to_global(..., return_valid_counts=True)``: (indices [T, K] int32, valid_counts [T] int32)."""
    from .block_table import convert_req_index_to_global

    out, counts = convert_req_index_to_global(req_id, block_table, topk_local, block_size,
                                              kv_block_stride_rows=kv_block_stride_rows, num_kv_rows=num_kv_rows,
                                              return_valid_counts=True)
    return out, counts


@convert_req_index.register_fake
def _convert_req_index_fake(req_id, block_table, topk_local, block_size, kv_block_stride_rows=None, num_kv_rows=None):
    validate_convert_args(req_id, block_table, topk_local, block_size, kv_block_stride_rows, num_kv_rows)
    T, K = topk_local.shape
    return topk_local.new_empty(T, K), topk_local.new_empty(T)


def register_ops() -> None:
    """Make sure the ``torch.ops.sparse_mla`` ops are registered (importing this module does it)."""


__all__ = ["fwd", "fwd_out", "convert_req_index", "workspace_buffers", "register_ops"]
