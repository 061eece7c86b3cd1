"""ShardQ: token-sharded sparse MLA prefill across the ranks of a tensor-parallel group.

Under tensor parallelism (TP, W ranks) rank s holds heads ``[s * H / W, (s + 1) * H / W)`` of every
token (the usual column-parallel split of q_b_proj / W_UK). Sparse MLA at few heads per rank is
bound by gathering each query's top-k latent rows, which only H / W heads then share. ShardQ
(docs/DESIGN.md "ShardQ") regroups the work so each rank runs *all* H heads of a slice of the tokens:

1. split the step's real token rows into 2W chunks, rank r takes chunks r and 2W - 1 - r
   (``zigzag.zigzag_chunks``, balanced causal work);
2. all-to-all q: head-sharded [T, H / W, D_qk] on every rank -> token-sharded [T_r, H, D_qk];
3. ``sparse_mla_fwd`` on the rank's rows with all heads (token-major groups, cu_seqlens_q=None,
   G = 128 // H); the latent cache and the full top-k [T, K] are identical on every rank, so
   each rank slices its own rows of ``indices`` / ``topk_length`` (no exchange needed);
4. all-to-all the output (and lse) back: [T_r, H, D_v] -> head-sharded [T, H / W, D_v].

The result equals per-token sparse MLA of the rank's heads over all rows (``sparse_mla_ref``),
exactly as the plain TP path (``tp_sparse_mla_fwd``) computes it; only fp32 summation order
can differ between kernel methods.

Communication is ``torch.distributed.all_to_all_single`` with uneven splits, on NCCL (CUDA) and
gloo (CPU; checked on torch 2.13: gloo's all_to_all_single takes uneven split sizes and fp16 /
bf16 / fp32 tensors). The layout copies around it (rank-ordered send buffer, head
interleave after receive) are counted in the exchange time of ``timings``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..checks import KERNEL_DTYPES, check_tensor, require_bool, require_disjoint
from ..mqa.checks import validate_sparse_mla_args
from ..mqa.selection import METHODS
from .zigzag import zigzag_chunks

logger = logging.getLogger("sparse_mla")

# Published break-even of ShardQ over plain TP: about 1024 tokens per step (docs/DESIGN.md "ShardQ").
DEFAULT_MIN_TOKENS = 1024

AttnFn = Callable[..., Any]


class _Stopwatch:
    """Marks on the current CUDA stream (CUDA events) or host clocks (CPU); read once at the end."""

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.enabled = enabled
        self.cuda = enabled and device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if not self.enabled:
            return
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def intervals_ms(self) -> list[float]:
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]


def _default_attn_fn() -> AttnFn:
    # Imported on first use so that importing sparse_mla.distributed does not decorate the
    # Triton kernels (TRITON_INTERPRET must be set before that on CPU).
    from ..mqa.interface import sparse_mla_fwd

    return sparse_mla_fwd


def _check_common(q_local, kv, indices, sm_scale, topk_length, d_v, num_real_tokens, attn_fn, out, lse, return_lse,
                  method):
    """Validation shared by both paths; runs on every rank before any communication or launch,
    so that bad input raises on all ranks at the same point instead of hanging a collective."""
    allowed = KERNEL_DTYPES if attn_fn is None else (*KERNEL_DTYPES, torch.float32)
    p = validate_sparse_mla_args(q_local, kv, indices, sm_scale, d_v=d_v, topk_length=topk_length,
                                 allowed_dtypes=allowed)
    T, H_local, _ = p.q.shape
    if num_real_tokens is None:
        n_real = T
    else:
        if isinstance(num_real_tokens, bool) or not isinstance(num_real_tokens, int):
            raise TypeError(f"num_real_tokens must be a Python int (host-side count of real rows) or None, "
                            f"got {type(num_real_tokens).__name__}")
        if not 0 <= num_real_tokens <= T:
            raise ValueError(f"num_real_tokens must be in [0, T = {T}] (rows of q_local), got {num_real_tokens}")
        n_real = num_real_tokens
    if attn_fn is not None and not callable(attn_fn):
        raise TypeError(f"attn_fn must be callable like sparse_mla_fwd, got {type(attn_fn).__name__}")
    if attn_fn is None:  # else the attention would raise only after the q exchange
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS} (sparse_mla_fwd's), got {method!r}")
    require_bool("return_lse", return_lse)
    if out is not None:
        check_tensor("out", out, dims="[T, H / W, d_v]", shape=(T, H_local, p.d_v), dtype=p.q.dtype, device=p.q.device,
                     layout="contiguous", writable=True)
    if lse is not None:
        if not return_lse:
            raise ValueError("lse= was given but return_lse=False")
        check_tensor("lse", lse, dims="[T, H / W]", shape=(T, H_local), dtype=torch.float32, device=p.q.device,
                     layout="contiguous", writable=True)
    require_disjoint({"out": out, "lse": lse}, {"q_local": p.q, "kv": p.kv, "indices": p.indices,
                                                "topk_length": p.topk_length})
    return p, n_real


def _call_attn(attn_fn: AttnFn, q, kv, indices, sm_scale, d_v, topk_length, return_lse, method, out, lse) -> None:
    """Run the attention into ``out`` / ``lse`` (passed as ``out=`` / ``lse=``, as sparse_mla_fwd
    takes them); a function that returns other tensors is copied from."""
    res = attn_fn(q, kv, indices, sm_scale, d_v=d_v, topk_length=topk_length, return_lse=return_lse, method=method,
                  out=out, lse=lse)
    o, l = res if return_lse else (res, None)
    if o is not out:
        out.copy_(o)
    if return_lse and l is not lse:
        lse.copy_(l)


def _alloc_outputs(T, H_local, d_v, q, return_lse, out, lse):
    if out is None:
        out = torch.empty(T, H_local, d_v, dtype=q.dtype, device=q.device)
    if return_lse and lse is None:
        lse = torch.empty(T, H_local, dtype=torch.float32, device=q.device)
    return out, lse


def _fill_padding(out, lse, n_real):
    out[n_real:].zero_()
    if lse is not None:
        lse[n_real:].fill_(float("-inf"))


def _finish(out, lse, return_lse):
    return (out, lse) if return_lse else out


def _tp_forward(p, n_real, attn_fn, method, return_lse, out, lse, watch):
    """Each rank: its own head shard of the first n_real rows; padding rows 0 / -inf."""
    T, H_local, _ = p.q.shape
    out, lse = _alloc_outputs(T, H_local, p.d_v, p.q, return_lse, out, lse)
    watch.mark()
    if n_real > 0:
        tl = p.topk_length[:n_real] if p.topk_length is not None else None
        _call_attn(attn_fn, p.q[:n_real], p.kv, p.indices[:n_real], p.sm_scale, p.d_v, tl, return_lse, method,
                   out[:n_real], lse[:n_real] if return_lse else None)
    _fill_padding(out, lse, n_real)
    watch.mark()
    return out, lse


def tp_sparse_mla_fwd(
    q_local: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    *,
    d_v: int = 512,
    topk_length: torch.Tensor | None = None,
    return_lse: bool = False,
    method: str = "auto",
    num_real_tokens: int | None = None,
    attn_fn: AttnFn | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    timings: dict | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain tensor-parallel sparse MLA: this rank's head shard of every token, no communication.

    The baseline of ShardQ (and its path below ``min_tokens``). Semantics: ``sparse_mla_ref`` on
    the rank's heads; rows >= ``num_real_tokens`` are not computed.

    Args:
        q_local: [T, H / W, D_qk] bf16/fp16 (fp32 only with a custom ``attn_fn``), CUDA (or CPU under
            TRITON_INTERPRET=1); this rank's heads of every row, last dim contiguous.
        kv: [N, D_qk] or paged [num_blocks, block_size, D_qk], q's dtype and device.
        indices: [T, K] or [T, 1, K] int32 global rows (< 0, >= N, past topk_length: padding).
        sm_scale: softmax scale on q . k.
        d_v: value width (512, kv_lora_rank).
        topk_length: optional [T] int32 valid prefix length of each row of ``indices``.
        return_lse: also return lse [T, H / W] fp32 (natural log).
        method: passed to ``attn_fn`` ("auto", "per_token", "grouped" for ``sparse_mla_fwd``).
        num_real_tokens: Python int in [0, T]; rows at and after it are CUDA-graph padding:
            not computed, out = 0, lse = -inf. None = all T rows are real.
        attn_fn: the attention, called as ``attn_fn(q, kv, indices, sm_scale, d_v=, topk_length=,
            return_lse=, method=, out=, lse=)`` with preallocated out [n, H / W, d_v] / lse [n, H / W]
            (None without return_lse) to write, returning out (or (out, lse)); returned tensors
            other than those buffers are copied into them. Default ``sparse_mla_fwd``.
        out / lse: optional preallocated contiguous outputs [T, H / W, d_v] (q's dtype) / [T, H / W] fp32.
        timings: optional dict, filled with ``attention_ms`` and ``total_ms`` (CUDA-event ms on
            CUDA, which synchronizes at the end; host ms on CPU), ``exchange_q_ms`` /
            ``exchange_out_ms`` = 0.0 and ``path`` = "tp".

    Returns:
        out [T, H / W, d_v] in q's dtype, or (out, lse) with return_lse=True.

    Raises:
        TypeError / ValueError: as ``sparse_mla_fwd`` (``validate_sparse_mla_args``), plus a bad
            ``num_real_tokens``, ``out`` or ``lse``.
    """
    p, n_real = _check_common(q_local, kv, indices, sm_scale, topk_length, d_v, num_real_tokens, attn_fn,
                              out, lse, return_lse, method)
    watch = _Stopwatch(p.q.device, timings is not None)
    out, lse = _tp_forward(p, n_real, attn_fn or _default_attn_fn(), method, return_lse, out, lse, watch)
    if timings is not None:
        (attn_ms,) = watch.intervals_ms()
        timings.update(path="tp", exchange_q_ms=0.0, attention_ms=attn_ms, exchange_out_ms=0.0, total_ms=attn_ms)
    return _finish(out, lse, return_lse)


def shardq_sparse_mla_fwd(
    q_local: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    *,
    group: dist.ProcessGroup | None = None,
    d_v: int = 512,
    topk_length: torch.Tensor | None = None,
    return_lse: bool = False,
    method: str = "auto",
    min_tokens: int = DEFAULT_MIN_TOKENS,
    num_real_tokens: int | None = None,
    attn_fn: AttnFn | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    timings: dict | None = None,
    info: dict | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA prefill with ShardQ: each rank computes all heads of a zigzag slice of the rows.

    Takes and returns the TP head-sharded layout, so it drops in where ``tp_sparse_mla_fwd`` (each
    rank ``sparse_mla_fwd`` on its heads) would run, and returns the same result (semantics:
    ``sparse_mla_ref`` on this rank's heads; docs/DESIGN.md "ShardQ"). A collective: every rank of
    ``group`` must call it with the same T, K, D_qk, H / W, num_real_tokens, min_tokens,
    return_lse, method and presence of topk_length (the split sizes are computed on the host from
    them; a mismatch fails or hangs in the all-to-all). ``kv``, ``indices`` and ``topk_length``
    must hold the same values on every rank (the latent cache and the indexer's top-k are
    replicated under TP).

    Steps: zigzag split of the first ``num_real_tokens`` rows (``zigzag.zigzag_chunks``; padding
    rows take no part, so they neither unbalance nor break the split); all-to-all of q
    ([T, H / W, D_qk] -> [T_r, H, D_qk], head h = s * H / W + h_s from rank s); ``attn_fn`` on the
    rank's rows with all heads (token-major groups, so a group may span requests and the junction
    of the rank's two chunks: each query keeps its own indices row, so the output is unchanged);
    all-to-all of out (and lse) back. Below ``min_tokens`` real rows, or with W = 1, it runs
    ``tp_sparse_mla_fwd`` instead (no communication) and logs the choice at DEBUG level on logger
    "sparse_mla" (and in ``info``).

    Args:
        q_local: [T, H / W, D_qk] bf16/fp16 (fp32 only with a custom ``attn_fn``), CUDA for NCCL
            (or CPU for gloo, under TRITON_INTERPRET=1 with the Triton kernels); this rank's heads
            of every row, last dim contiguous.
        kv: [N, D_qk] or paged [num_blocks, block_size, D_qk] latent cache, q's dtype and device,
            identical on every rank. V is its first d_v columns.
        indices: [T, K] or [T, 1, K] int32 global rows, identical on every rank; entries < 0, >= N
            or past topk_length are padding.
        sm_scale: softmax scale on q . k.
        group: the TP process group (default: the default group). Rank order = head-shard order.
        d_v: value width (512, kv_lora_rank).
        topk_length: optional [T] int32, identical on every rank.
        return_lse: also return lse [T, H / W] fp32 (natural log; -inf for no valid row / padding).
        method: passed to ``attn_fn``: "auto", "per_token" or "grouped" for ``sparse_mla_fwd``.
        min_tokens: below this many real rows run plain TP (published break-even ~1024).
        num_real_tokens: Python int in [0, T]: rows >= it are CUDA-graph padding, not exchanged,
            not computed, out = 0 and lse = -inf there. None = all rows are real.
        attn_fn: the attention, called as ``attn_fn(q, kv, indices, sm_scale, d_v=, topk_length=,
            return_lse=, method=, out=, lse=)`` with the rank's rows, all heads, and preallocated
            out [T_r, H, d_v] / lse [T_r, H] (None without return_lse) to write; returns out (or
            (out, lse)); returned tensors other than those buffers are copied into them. Default
            ``sparse_mla.sparse_mla_fwd``. Not called for a rank that holds no rows.
        out / lse: optional preallocated contiguous outputs [T, H / W, d_v] (q's dtype) and
            [T, H / W] fp32; every element is written.
        timings: optional dict, filled with ``exchange_q_ms`` (send-buffer copy + all-to-all +
            head interleave), ``attention_ms``, ``exchange_out_ms`` (copies + all-to-all(s) +
            scatter to token order), ``total_ms`` and ``path``. CUDA-event ms on CUDA (one
            synchronize at the end), host ms on CPU. Exchange times include waiting for the
            slowest rank to reach the collective.
        info: optional dict, filled with ``path`` ("shardq" or "tp"), ``reason``, ``world_size``,
            ``rank``, ``num_real_tokens``, ``rank_rows`` (T_r) and ``chunks`` (this rank's two
            (start, length) row ranges; empty on the TP path).

    Returns:
        out [T, H / W, d_v] in q's dtype (this rank's head shard, token order), or (out, lse).

    Raises:
        TypeError / ValueError: as ``sparse_mla_fwd`` for q_local / kv / indices / topk_length /
            sm_scale / d_v, and for a bad num_real_tokens, min_tokens, out or lse; all before any
            communication. RuntimeError: torch.distributed is not initialized.
    """
    p, n_real = _check_common(q_local, kv, indices, sm_scale, topk_length, d_v, num_real_tokens, attn_fn,
                              out, lse, return_lse, method)
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int):
        raise TypeError(f"min_tokens must be a Python int, got {type(min_tokens).__name__}")
    if min_tokens < 0:
        raise ValueError(f"min_tokens must be >= 0, got {min_tokens}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("shardq_sparse_mla_fwd needs an initialized torch.distributed process group "
                           "(tp_sparse_mla_fwd runs without one)")
    W = dist.get_world_size(group)
    rank = dist.get_rank(group)
    attn_fn = attn_fn or _default_attn_fn()
    T, H_local, D = p.q.shape
    H = H_local * W
    if W == 1:
        path, reason = "tp", "world size 1: every rank already holds all heads"
    elif n_real == 0:
        path, reason = "tp", "no real rows"
    elif n_real < min_tokens:
        path, reason = "tp", f"{n_real} real rows < min_tokens = {min_tokens}"
    else:
        path, reason = "shardq", f"{n_real} real rows >= min_tokens = {min_tokens}, W = {W}, H = {H}"
    chunks = zigzag_chunks(n_real, W)
    rows = [a[1] + b[1] for a, b in chunks]
    logger.debug("shardq_sparse_mla_fwd: rank %d/%d T=%d real=%d H=%d -> %s (%s)", rank, W, T, n_real, H, path, reason)
    if info is not None:
        info.update(path=path, reason=reason, world_size=W, rank=rank, num_real_tokens=n_real,
                    rank_rows=rows[rank] if path == "shardq" else n_real,
                    chunks=list(chunks[rank]) if path == "shardq" else [])
    watch = _Stopwatch(p.q.device, timings is not None)

    if path == "tp":
        out, lse = _tp_forward(p, n_real, attn_fn, method, return_lse, out, lse, watch)
        if timings is not None:
            (attn_ms,) = watch.intervals_ms()
            timings.update(path="tp", exchange_q_ms=0.0, attention_ms=attn_ms, exchange_out_ms=0.0, total_ms=attn_ms)
        return _finish(out, lse, return_lse)

    out, lse = _alloc_outputs(T, H_local, p.d_v, p.q, return_lse, out, lse)
    (sa, la), (sb, lb) = chunks[rank]
    T_r = rows[rank]
    dev = p.q.device

    # 1. q: send rank s's rows of my heads to rank s, in rank order (zigzag order of the rows).
    watch.mark()
    send_q = torch.cat([p.q[s:s + n] for pair in chunks for s, n in pair])  # [n_real, H_local, D]
    recv_q = torch.empty(W * T_r, H_local, D, dtype=p.q.dtype, device=dev)
    dist.all_to_all_single(recv_q, send_q, output_split_sizes=[T_r] * W, input_split_sizes=rows, group=group)
    # [W (source rank = head block), T_r, H_local, D] -> [T_r, H, D], head = s * H_local + h.
    q_r = recv_q.view(W, T_r, H_local, D).transpose(0, 1).reshape(T_r, H, D)
    watch.mark()

    # 2. attention on my rows, all heads (indices / topk_length are replicated: slice my rows).
    o_r = torch.empty(T_r, H, p.d_v, dtype=p.q.dtype, device=dev)
    l_r = torch.empty(T_r, H, dtype=torch.float32, device=dev) if return_lse else None
    if T_r > 0:
        idx_r = torch.cat([p.indices[sa:sa + la], p.indices[sb:sb + lb]])
        tl_r = None if p.topk_length is None else torch.cat([p.topk_length[sa:sa + la], p.topk_length[sb:sb + lb]])
        _call_attn(attn_fn, q_r, p.kv, idx_r, p.sm_scale, p.d_v, tl_r, return_lse, method, o_r, l_r)
    watch.mark()

    # 3. out (and lse): head block s of my rows goes back to rank s; I receive my heads of every
    # rank's rows in rank order, i.e. the rows in zigzag order.
    send_o = o_r.view(T_r, W, H_local, p.d_v).transpose(0, 1).contiguous()
    recv_o = torch.empty(n_real, H_local, p.d_v, dtype=p.q.dtype, device=dev)
    dist.all_to_all_single(recv_o, send_o.view(W * T_r, H_local, p.d_v), output_split_sizes=rows,
                           input_split_sizes=[T_r] * W, group=group)
    if return_lse:
        send_l = l_r.view(T_r, W, H_local).transpose(0, 1).contiguous()
        recv_l = torch.empty(n_real, H_local, dtype=torch.float32, device=dev)
        dist.all_to_all_single(recv_l, send_l.view(W * T_r, H_local), output_split_sizes=rows,
                               input_split_sizes=[T_r] * W, group=group)
    # Zigzag order -> token order: rows arrive as rank 0's two chunks, rank 1's, ...; the chunks
    # are contiguous row ranges, so token order is the chunks sorted by start (one cat kernel).
    pieces, offset = [], 0
    for pair in chunks:
        for s, n in pair:
            pieces.append((s, offset, n))
            offset += n
    pieces.sort()
    torch.cat([recv_o[o:o + n] for _, o, n in pieces], out=out[:n_real])
    if return_lse:
        torch.cat([recv_l[o:o + n] for _, o, n in pieces], out=lse[:n_real])
    _fill_padding(out, lse, n_real)
    watch.mark()

    if timings is not None:
        xq, attn, xo = watch.intervals_ms()
        timings.update(path="shardq", exchange_q_ms=xq, attention_ms=attn, exchange_out_ms=xo, total_ms=xq + attn + xo)
    return _finish(out, lse, return_lse)


__all__ = ["shardq_sparse_mla_fwd", "tp_sparse_mla_fwd", "DEFAULT_MIN_TOKENS"]
