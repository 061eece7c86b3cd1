"""ShardQ at the MLA-layer level: q_nope / q_pe in, o after W_UV out, with a choice of what travels.

``shardq_sparse_mla_fwd`` exchanges the absorbed query (kv_lora_rank + qk_rope = 576 wide) and the
latent output (kv_lora_rank = 512 wide). One layer up, with the rank's q_nope / q_pe and kv_b_proj,
the exchange can carry fewer bytes (``exchange="reduced"``):

* q before absorption: concat(q_nope, q_pe), qk_nope + qk_rope wide (192 DeepSeek-V3.2, 256 GLM-5);
* o after W_UV: v_head_dim wide (128 / 256).

The receiving rank absorbs all H heads of its rows (q_nope @ W_UK) and applies W_UV to them, so it
needs every head's kv_b_proj slice: (W - 1) / W of [H, qk_nope + v_head_dim, kv_lora_rank] more
than TP holds, per layer (DeepSeek-V3.2 bf16 at W = 8: 28 MiB per layer, 1.67 GiB over 61 layers;
GLM-5 at W = 4: 21 MiB per layer; ``cost_model.extra_weight_bytes``). The FLOPs of the absorption
and of W_UV are those of TP (the rank does all H heads of T / W rows instead of H / W heads of T rows).
``exchange="absorbed"`` keeps today's exchange (absorb and W_UV on the rank's own heads, only TP's
weight slice needed).

``chunks`` > 1 pipelines exchange and attention: every rank's zigzag rows are cut into ``chunks``
pieces; the q all-to-all of piece k + 1 and the o all-to-all of piece k are issued asynchronously
(``torch.distributed`` async ops: NCCL runs them on its own stream) while piece k's attention runs.
The result is the same as ``chunks=1`` (each row's computation does not depend on the chunking).

Semantics (both forms, any chunks): per-token sparse MLA of the rank's heads, lifted through
kv_b_proj (``sparse_mla.layer.reference``): o[t, h] = sparse_mla(concat(q_nope[t, h] @ W_UK[h],
q_pe[t, h]), kv, indices[t]) @ W_UV[h].T; ``tp_mla_attention`` is the plain TP baseline of it.
The indices are used as given (no causal-window restriction; pass the layer's window-restricted
lists). No lse is returned at this level.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .shardq import DEFAULT_MIN_TOKENS, AttnFn, _call_attn, _check_common, _default_attn_fn, _Stopwatch
from .zigzag import zigzag_partition

EXCHANGES = ("reduced", "absorbed")


def _check_layer_args(q_nope, q_pe, w_kv_b, kv, world_size: int, exchange: str, chunks: int):
    """Shapes of the layer tensors; returns (T, H_l, nope, rope, r, v, H_w)."""
    for name, t in (("q_nope", q_nope), ("w_kv_b", w_kv_b), ("kv", kv)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be an int >= 1, got {chunks!r}")
    if q_nope.dim() != 3:
        raise ValueError(f"q_nope must be [T, H / W, qk_nope], got shape {tuple(q_nope.shape)}")
    T, H_l, nope = q_nope.shape
    rope = 0
    if q_pe is not None:
        if not isinstance(q_pe, torch.Tensor):
            raise TypeError(f"q_pe must be a torch.Tensor or None, got {type(q_pe).__name__}")
        if q_pe.dim() != 3 or q_pe.shape[:2] != (T, H_l):
            raise ValueError(f"q_pe must be [T, H / W, qk_rope] = [{T}, {H_l}, *], got shape {tuple(q_pe.shape)}")
        if q_pe.dtype != q_nope.dtype or q_pe.device != q_nope.device:
            raise TypeError(f"q_pe must have q_nope's dtype and device ({q_nope.dtype}, {q_nope.device}), got "
                            f"{q_pe.dtype}, {q_pe.device}")
        rope = q_pe.shape[2]
    if w_kv_b.dim() != 3:
        raise ValueError(f"w_kv_b must be kv_b_proj.weight viewed as [heads, qk_nope + v_head_dim, kv_lora_rank], got "
                         f"shape {tuple(w_kv_b.shape)}")
    H_w, nv, r = w_kv_b.shape
    if w_kv_b.dtype != q_nope.dtype or w_kv_b.device != q_nope.device:
        raise TypeError(f"w_kv_b must have q_nope's dtype and device ({q_nope.dtype}, {q_nope.device}), got "
                        f"{w_kv_b.dtype}, {w_kv_b.device}")
    v = nv - nope
    if v < 1:
        raise ValueError(f"w_kv_b dim 1 ({nv}) must be qk_nope ({nope}) + v_head_dim (>= 1)")
    if kv.dim() < 2 or kv.shape[-1] != r + rope:
        raise ValueError(f"kv rows must be kv_lora_rank + qk_rope = {r} + {rope} wide, got shape {tuple(kv.shape)}")
    H = H_l * world_size
    if exchange == "reduced" and H_w != H:
        raise ValueError(f"exchange='reduced' needs every head's kv_b_proj on every rank: w_kv_b must have H = {H} "
                         f"heads, got {H_w} (use exchange='absorbed' with this rank's {H_l} heads)")
    if H_w not in (H, H_l):
        raise ValueError(f"w_kv_b must hold all H = {H} heads or this rank's H / W = {H_l}, got {H_w}")
    return T, H_l, nope, rope, r, v, H_w


def _absorb(q_nope: torch.Tensor, q_pe: torch.Tensor | None, w_uk: torch.Tensor, r: int) -> torch.Tensor:
    """concat(q_nope[t, h] @ W_UK[h], q_pe[t, h]): [T, h, r + rope] in q's dtype (``absorb_queries``)."""
    T, h, _ = q_nope.shape
    rope = 0 if q_pe is None else q_pe.shape[2]
    q = torch.empty(T, h, r + rope, dtype=q_nope.dtype, device=q_nope.device)
    q[:, :, :r] = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
    if q_pe is not None:
        q[:, :, r:] = q_pe
    return q


def _up(latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """latent[t, h] @ W_UV[h].T: [T, h, r] -> [T, h, v]."""
    return torch.bmm(latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


def _local_heads(w_kv_b: torch.Tensor, H_l: int, rank: int) -> torch.Tensor:
    return w_kv_b if w_kv_b.shape[0] == H_l else w_kv_b[rank * H_l:(rank + 1) * H_l]


def _latent_attention(attn_fn, q_abs, kv, indices, topk_length, sm_scale, r, method) -> torch.Tensor:
    lat = torch.empty(q_abs.shape[0], q_abs.shape[1], r, dtype=q_abs.dtype, device=q_abs.device)
    if q_abs.shape[0] > 0:
        _call_attn(attn_fn, q_abs, kv, indices, sm_scale, r, topk_length, False, method, lat, None)
    return lat


def tp_mla_attention(q_nope, q_pe, w_kv_b, kv, indices, sm_scale, *, rank: int = 0, world_size: int = 1,
                     topk_length=None, method: str = "auto", num_real_tokens: int | None = None,
                     attn_fn: AttnFn | None = None, timings: dict | None = None) -> torch.Tensor:
    """Plain TP baseline of ``shardq_mla_attention``: this rank's heads of every row, no communication.

    Args: as ``shardq_mla_attention``; ``rank`` / ``world_size`` pick this rank's heads of a w_kv_b
    that holds all of them (ignored when it holds H / W). Returns o [T, H / W, v_head_dim], rows >=
    num_real_tokens zero.
    """
    T, H_l, nope, rope, r, v, _ = _check_layer_args(q_nope, q_pe, w_kv_b, kv, world_size, "absorbed", 1)
    probe = q_nope.new_empty(1, 1, r + rope).expand(T, H_l, r + rope)
    p, n_real = _check_common(probe, kv, indices, sm_scale, topk_length, r, num_real_tokens, attn_fn, None, None,
                              False, method)
    attn_fn = attn_fn or _default_attn_fn()
    w = _local_heads(w_kv_b, H_l, rank)
    watch = _Stopwatch(q_nope.device, timings is not None)
    watch.mark()
    o = torch.zeros(T, H_l, v, dtype=q_nope.dtype, device=q_nope.device)
    q_abs = _absorb(q_nope[:n_real], None if q_pe is None else q_pe[:n_real], w[:, :nope], r)
    tl = None if p.topk_length is None else p.topk_length[:n_real]
    o[:n_real] = _up(_latent_attention(attn_fn, q_abs, p.kv, p.indices[:n_real], tl, p.sm_scale, r, method),
                     w[:, nope:])
    watch.mark()
    if timings is not None:
        (ms,) = watch.intervals_ms()
        timings.update(path="tp", exchange="none", chunks=1, attention_ms=ms, exposed_exchange_ms=0.0, total_ms=ms)
    return o


def shardq_mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor | None,
    w_kv_b: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    *,
    group: dist.ProcessGroup | None = None,
    exchange: str = "reduced",
    chunks: int = 1,
    topk_length: torch.Tensor | None = None,
    method: str = "auto",
    min_tokens: int = DEFAULT_MIN_TOKENS,
    num_real_tokens: int | None = None,
    attn_fn: AttnFn | None = None,
    timings: dict | None = None,
    info: dict | None = None,
) -> torch.Tensor:
    """ShardQ sparse MLA of one layer, head-sharded q_nope / q_pe in, head-sharded o out (module docstring).

    A collective over ``group`` (every rank: same T, H / W, dims, exchange, chunks, min_tokens,
    num_real_tokens, method, presence of q_pe / topk_length; kv, indices and topk_length identical).

    Args:
        q_nope: [T, H / W, qk_nope] bf16 / fp16, this rank's heads of every row.
        q_pe: [T, H / W, qk_rope] (rope applied) or None for a NoPE layout.
        w_kv_b: kv_b_proj.weight viewed as [heads, qk_nope + v_head_dim, kv_lora_rank] (W_UK =
            [:, :qk_nope], W_UV = [:, qk_nope:]): all H heads (needed by exchange="reduced"), or this
            rank's H / W heads (exchange="absorbed" only; rank s holds heads s * H / W ...).
        kv: [N, kv_lora_rank + qk_rope] latent rows (or paged), identical on every rank.
        indices: [T, K] int32 global rows (padding < 0 / >= N / past topk_length), identical on every rank.
        sm_scale: the model's softmax scale.
        group: the TP group (default group if None).
        exchange: "reduced" (q before absorption, o after W_UV) or "absorbed" (q 576 wide, o 512 wide).
        chunks: pieces of every rank's rows for the exchange / attention pipeline (1 = no overlap).
        topk_length, method, min_tokens, num_real_tokens, attn_fn: as ``shardq_sparse_mla_fwd``
            (attn_fn is called without lse).
        timings: optional dict: ``total_ms``, ``attention_ms`` (absorb + attention + W_UV, all
            pieces), ``exposed_exchange_ms`` (= total - attention: exchange time and layout copies
            not hidden behind compute),
            ``path``, ``exchange``, ``chunks``; CUDA events on CUDA, host clock on CPU.
        info: optional dict: ``path``, ``reason``, ``world_size``, ``rank``, ``rank_rows``,
            ``exchange``, ``chunks``, ``q_width`` / ``o_width`` (elements per token per head sent).

    Returns:
        o [T, H / W, v_head_dim] in q's dtype; rows >= num_real_tokens are 0.

    Raises:
        TypeError / ValueError: bad arguments (before any communication); RuntimeError: no process group.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("shardq_mla_attention needs an initialized torch.distributed process group "
                           "(tp_mla_attention runs without one)")
    W, rank = dist.get_world_size(group), dist.get_rank(group)
    T, H_l, nope, rope, r, v, H_w = _check_layer_args(q_nope, q_pe, w_kv_b, kv, W, exchange, chunks)
    probe = q_nope.new_empty(1, 1, r + rope).expand(T, H_l, r + rope)
    p, n_real = _check_common(probe, kv, indices, sm_scale, topk_length, r, num_real_tokens, attn_fn, None, None,
                              False, method)
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
        raise ValueError(f"min_tokens must be an int >= 0, got {min_tokens!r}")
    H = H_l * W
    if W == 1 or n_real == 0 or n_real < min_tokens:
        reason = ("world size 1" if W == 1 else "no real rows" if n_real == 0
                  else f"{n_real} real rows < min_tokens = {min_tokens}")
        if info is not None:
            info.update(path="tp", reason=reason, world_size=W, rank=rank, rank_rows=n_real, exchange="none",
                        chunks=1, q_width=0, o_width=0)
        return tp_mla_attention(q_nope, q_pe, w_kv_b, kv, indices, sm_scale, rank=rank, world_size=W,
                                topk_length=topk_length, method=method, num_real_tokens=num_real_tokens,
                                attn_fn=attn_fn, timings=timings)
    attn_fn = attn_fn or _default_attn_fn()
    dev, dtype = q_nope.device, q_nope.dtype
    w_local = _local_heads(w_kv_b, H_l, rank)
    watch = _Stopwatch(dev, timings is not None)
    watch.mark()

    if exchange == "reduced":
        x_local = q_nope[:n_real] if q_pe is None else torch.cat([q_nope[:n_real], q_pe[:n_real]], dim=-1)
        w_uk, w_uv = w_kv_b[:, :nope], w_kv_b[:, nope:]
        d_out = v

        def compute(x_r: torch.Tensor, idx: torch.Tensor, tl: torch.Tensor | None) -> torch.Tensor:
            q_abs = _absorb(x_r[..., :nope], None if q_pe is None else x_r[..., nope:], w_uk, r)
            return _up(_latent_attention(attn_fn, q_abs, p.kv, idx, tl, p.sm_scale, r, method), w_uv)
    else:
        x_local = _absorb(q_nope[:n_real], None if q_pe is None else q_pe[:n_real], w_local[:, :nope], r)
        d_out = r

        def compute(x_r: torch.Tensor, idx: torch.Tensor, tl: torch.Tensor | None) -> torch.Tensor:
            return _latent_attention(attn_fn, x_r, p.kv, idx, tl, p.sm_scale, r, method)

    watch.mark()
    recv_rows = _pipelined_exchange(x_local, n_real, W, rank, H, d_out, chunks, group, compute, p, watch)
    watch.mark()
    o = torch.zeros(T, H_l, v, dtype=dtype, device=dev)
    o[:n_real] = recv_rows if exchange == "reduced" else _up(recv_rows, w_local[:, nope:])
    watch.mark()
    parts = zigzag_partition(n_real, W)
    if info is not None:
        info.update(path="shardq", reason=f"{n_real} real rows >= min_tokens = {min_tokens}, W = {W}, H = {H}",
                    world_size=W, rank=rank, rank_rows=parts[rank].numel(), exchange=exchange, chunks=chunks,
                    q_width=x_local.shape[-1], o_width=d_out)
    if timings is not None:
        # Intervals: pre-step (absorbed: local absorb; reduced: q_nope | q_pe copy), then per piece
        # (exchange wait, compute), then the output wait + reorder, then the post-step (absorbed:
        # local W_UV; reduced: copy into o).
        iv = watch.intervals_ms()
        total = sum(iv)
        attn = sum(iv[2:-2:2]) + (iv[0] + iv[-1] if exchange == "absorbed" else 0.0)
        timings.update(path="shardq", exchange=exchange, chunks=chunks, attention_ms=attn,
                       exposed_exchange_ms=total - attn, total_ms=total)
    return o


def _pipelined_exchange(x_local: torch.Tensor, n_real: int, W: int, rank: int, H: int, d_out: int, chunks: int,
                        group, compute, p: Any, watch: _Stopwatch) -> torch.Tensor:
    """The exchange / compute pipeline: returns this rank's heads of ``compute``'s output for the
    rows 0 .. n_real - 1 in token order, [n_real, H / W, d_out].

    Piece k of rank s = rows ``parts[s][k * T_s // chunks : (k + 1) * T_s // chunks]`` of its zigzag
    rows. Stage k: all-to-all of q rows of every rank's piece k (async), compute on my piece k with
    all heads, all-to-all of its output back (async); the q exchange of piece k + 1 is issued before
    piece k's compute. Marks on ``watch``: before and after each piece's compute.
    """
    dev = x_local.device
    _, H_l, D = x_local.shape
    parts = [t.to(dev) for t in zigzag_partition(n_real, W)]
    pieces = [[pt[k * pt.numel() // chunks:(k + 1) * pt.numel() // chunks] for k in range(chunks)] for pt in parts]
    send_rows = [torch.cat([pieces[s][k] for s in range(W)]) for k in range(chunks)]  # token rows, rank order
    in_sizes = [[pieces[s][k].numel() for s in range(W)] for k in range(chunks)]

    def start_q(k: int):
        t = pieces[rank][k].numel()
        send = x_local.index_select(0, send_rows[k])
        recv = torch.empty(W * t, H_l, D, dtype=x_local.dtype, device=dev)
        work = dist.all_to_all_single(recv, send, output_split_sizes=[t] * W, input_split_sizes=in_sizes[k],
                                      group=group, async_op=True)
        return work, recv, send

    out = torch.empty(n_real, H_l, d_out, dtype=x_local.dtype, device=dev)
    pending_q = start_q(0)
    pending_o = []
    for k in range(chunks):
        work, recv, _send = pending_q
        work.wait()
        if k + 1 < chunks:
            pending_q = start_q(k + 1)
        t = pieces[rank][k].numel()
        watch.mark()
        x_r = recv.view(W, t, H_l, D).transpose(0, 1).reshape(t, H_l * W, D)  # head = s * H_l + h
        mine = pieces[rank][k]
        idx = p.indices.index_select(0, mine)
        tl = None if p.topk_length is None else p.topk_length.index_select(0, mine)
        o_r = compute(x_r, idx, tl) if t > 0 else torch.empty(0, H, d_out, dtype=x_local.dtype, device=dev)
        send_o = o_r.reshape(t, W, H_l, d_out).transpose(0, 1).contiguous().view(W * t, H_l, d_out)
        watch.mark()
        recv_o = torch.empty(send_rows[k].numel(), H_l, d_out, dtype=x_local.dtype, device=dev)
        work_o = dist.all_to_all_single(recv_o, send_o, output_split_sizes=in_sizes[k], input_split_sizes=[t] * W,
                                        group=group, async_op=True)
        pending_o.append((work_o, recv_o, send_o, k))
    for work_o, recv_o, _send_o, k in pending_o:
        work_o.wait()
        out.index_copy_(0, send_rows[k], recv_o)
    return out


__all__ = ["shardq_mla_attention", "tp_mla_attention", "EXCHANGES"]
