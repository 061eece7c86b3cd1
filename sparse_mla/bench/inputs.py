"""Layer inputs for one benchmark point: the keyword arguments of ``sparse_mla.layer.dsa_prefill``.

A point is one request (``cached`` positions already in the latent cache, ``new`` query tokens)
of a model layout (``sparse_mla.workloads.models.MLAConfig``) at H heads per rank. q, the cache and
kv_b_proj's weight are random (unit scale after the projection); the top-k lists come from
``sparse_mla.workloads.synthetic_batch`` (a calibrated overlap preset) or from an engine trace
(``sparse_mla.workloads.traces``). The returned dict is what ``dsa_prefill(**inputs, path=...)``
and ``dsa_prefill_ref(**inputs)`` take:

    q_nope   [T, H, qk_nope_head_dim]               dtype, device
    q_pe     [T, H, qk_rope_head_dim] or None (NoPE) dtype, device
    kv       [N, kv_lora_rank + qk_rope_head_dim]   dtype, device (latent rows, N = cached + new)
    w_kv_b   [H * (qk_nope_head_dim + v_head_dim), kv_lora_rank]  dtype, device (kv_b_proj.weight)
    indices  [T, K] int32 global rows, -1 = padding
    topk_length [T] int32 (trace inputs only: the engine's valid counts)
    cached_lens, new_lens: [1] host ints; sm_scale: the model's softmax scale
"""

from __future__ import annotations

import torch

from ..layer.checks import validate_dsa_prefill_args
from ..layer.problem import PrefillStep
from ..workloads.models import MLAConfig


def _layer_tensors(model: MLAConfig, tokens: int, kv_rows: int, heads: int, gen: torch.Generator,
                   device: torch.device, dtype: torch.dtype) -> dict:
    """q_nope, q_pe, kv, w_kv_b drawn from ``gen`` in that order; W has rows scaled by r ** -0.5 so
    that the decompressed K/V have unit scale."""
    r, dn, dr, dv = model.kv_lora_rank, model.qk_nope_head_dim, model.qk_rope_head_dim, model.v_head_dim
    return dict(
        q_nope=torch.randn(tokens, heads, dn, device=device, generator=gen).to(dtype),
        q_pe=torch.randn(tokens, heads, dr, device=device, generator=gen).to(dtype) if dr else None,
        kv=torch.randn(kv_rows, r + dr, device=device, generator=gen).to(dtype),
        w_kv_b=(torch.randn(heads * (dn + dv), r, device=device, generator=gen) * r**-0.5).to(dtype),
    )


def make_inputs(model: MLAConfig, cached: int, new: int, topk: int, heads: int, overlap: str, seed: int,
                device: torch.device, dtype: torch.dtype) -> dict:
    """Layer inputs of one request with synthetic causal top-k lists (module docstring for the keys).

    Args:
        model: the layout (dims, sm_scale).
        cached, new: positions already cached and new tokens (T = new, N = cached + new).
        topk: K, entries per list.
        heads: H, heads per rank (slice fewer later with ``slice_heads``).
        overlap: ``sparse_mla.workloads`` preset ("high", "mid", "low", "none", "random").
        seed: seeds both the top-k generator and the tensors.
        device, dtype: where and in which float dtype (bf16 / fp16) the tensors live.

    Returns:
        dict of ``dsa_prefill`` keyword arguments (no topk_length: lists are -1 padded, so a step
        whose windows all fit in K is dense-eligible).

    Raises:
        ValueError: the errors of ``synthetic_batch`` (bad preset, negative lengths, topk < 1).
    """
    from ..workloads import synthetic_batch

    g = torch.Generator(device=device).manual_seed(seed)
    batch = synthetic_batch([cached], [new], topk, overlap, seed=seed, device=device)
    return dict(
        **_layer_tensors(model, new, batch.num_kv_rows, heads, g, device, dtype),
        indices=batch.indices.contiguous(),
        cached_lens=[cached], new_lens=[new], sm_scale=model.sm_scale,
    )


def trace_inputs(model: MLAConfig, topk: torch.Tensor, valid: torch.Tensor, heads: int, seed: int,
                 device: torch.device, dtype: torch.dtype) -> dict:
    """Layer inputs with an engine's top-k lists: one request whose T new tokens are the last T
    positions of a cache of N = max(max row + 1, T) rows (cached = N - T). Entries outside a
    token's causal window are padding (the layer semantics), so a trace taken in another row
    order loses those entries.

    Args:
        topk: [T, K] int32 global rows (-1 = padding), any device.
        valid: [T] int32: only the first valid[t] entries of row t count (passed as topk_length).
        model, heads, seed, device, dtype: as ``make_inputs``.

    Returns:
        dict of ``dsa_prefill`` keyword arguments, with ``topk_length``.
    """
    cached, T = trace_shape(topk)
    g = torch.Generator(device=device).manual_seed(seed)
    return dict(
        **_layer_tensors(model, T, cached + T, heads, g, device, dtype),
        indices=topk.to(device=device, dtype=torch.int32).contiguous(),
        topk_length=valid.to(device=device, dtype=torch.int32).contiguous(),
        cached_lens=[cached], new_lens=[T], sm_scale=model.sm_scale,
    )


def trace_shape(topk: torch.Tensor) -> tuple[int, int]:
    """(cached, new) of the request ``trace_inputs`` makes of a [T, K] trace: new = T,
    cached = max(max row + 1, T) - T."""
    T = topk.shape[0]
    n_rows = max(int(topk.max().item()) + 1 if topk.numel() else 0, T)
    return n_rows - T, T


def slice_heads(inp: dict, model: MLAConfig, heads: int) -> dict:
    """The same point at the first ``heads`` heads: q_nope, q_pe [T, heads, *] and the w_kv_b rows
    of those heads (contiguous copies); the cache and the lists are shared."""
    per = model.qk_nope_head_dim + model.v_head_dim
    out = dict(inp)
    out["q_nope"] = inp["q_nope"][:, :heads].contiguous()
    out["q_pe"] = None if inp["q_pe"] is None else inp["q_pe"][:, :heads].contiguous()
    out["w_kv_b"] = inp["w_kv_b"][: heads * per].contiguous()
    return out


def sub_problem(inp: dict, lo: int, hi: int) -> dict:
    """The tokens lo .. hi-1 of a one-request point as their own step (the reference is per token):
    q_nope, q_pe, indices (and topk_length) [hi - lo, ...] views, cached_lens [cached + lo]."""
    c = inp["cached_lens"][0]
    out = {**inp, "q_nope": inp["q_nope"][lo:hi], "q_pe": None if inp["q_pe"] is None else inp["q_pe"][lo:hi],
           "indices": inp["indices"][lo:hi], "cached_lens": [c + lo], "new_lens": [hi - lo], "row_offsets": [0]}
    if inp.get("topk_length") is not None:
        out["topk_length"] = inp["topk_length"][lo:hi]
    return out


def layer_step(inp: dict) -> PrefillStep:
    """The ``PrefillStep`` ``dsa_prefill(**inp)`` decides on (validates the inputs, no sync).

    Raises:
        TypeError, ValueError: as ``sparse_mla.layer.checks.validate_dsa_prefill_args``.
    """
    return validate_dsa_prefill_args(**inp).step


__all__ = ["make_inputs", "trace_inputs", "trace_shape", "slice_heads", "sub_problem", "layer_step"]
