"""The four execution paths of the layer-level DSA prefill (docs/DESIGN.md "The paths").

Each path is an object with a ``name``, ``supports(step) -> (ok, reason)`` (plain Python on a
``PrefillStep``: can it compute this step exactly, within its memory caps) and
``run(problem, out) -> out`` on a validated ``DSAPrefillProblem``, writing o [T, H, v_head_dim] into
``out`` (q's dtype). All four return the
value of ``sparse_mla.layer.reference.dsa_prefill_ref`` up to bf16 rounding:

* ``dense_mha``: every top-k list is the whole causal window, so the step is causal MHA over the
  decompressed K/V (``torch.nn.functional.scaled_dot_product_attention``, bottom-right causal for
  cached prefixes). No K concatenation when qk_rope is 0: K is a view of the decompressed buffer.
* ``masked_mha``: causal MHA over the decompressed K/V with each query's top-k as a key mask
  (``sparse_mla.layer.masked_mha``), skipping key tiles no query of a block may see.
* ``mqa_grouped`` / ``mqa_per_token``: absorb q_nope through W_UK, ``sparse_mla_fwd`` over the
  latent rows (method "grouped" / "per_token", groups inside requests), then W_UV.

FP8 cache (``kv_format="fp8_ds_mla"``, ``sparse_mla.kv_format``): the MQA paths hand the cache bytes to
``sparse_mla_fwd`` (the kernel dequantizes each gathered row); the MHA paths dequantize the rows of the
request windows to q's dtype first (``DSAPrefillProblem.latent_rows``: one [L, 576] temporary in q's dtype
beside the decompressed K/V) and the masked kernel reads k_pe as the cache's bf16 bytes (converted to q's
dtype if that is not bf16). All read the same dequantized values, so all reproduce ``dsa_prefill_ref`` on
that cache.

Kernel modules are imported on first use, so that importing the layer (and testing the dispatcher)
never decorates a Triton kernel.
"""

from __future__ import annotations

import itertools
import logging

import torch
import torch.nn.functional as F

from ..union.grouping import default_group_size
from .host import to_device_async
from .problem import DSAPrefillProblem, PrefillStep, restrict_to_windows, token_windows, window_rows

logger = logging.getLogger("sparse_mla")

MQA_KV_LORA_RANKS = (512,)  # the sparse MQA kernels' D_V
MQA_ROPE_DIMS = (0, 64)  # D_qk 512 or 576
MASKED_MHA_MAX_HEAD_DIM = 512  # qk_nope + qk_rope and v_head_dim, register budget of one tile
# Memory caps of the MHA paths (bytes of scratch they allocate per call).
MHA_MAX_DECOMPRESSED_BYTES = 16 * 2**30  # decompressed K/V, sum(cached + new) * H * (qk_nope + v) * 2
MASKED_MHA_MAX_MASK_BYTES = 2 * 2**30  # packed masks, sum over requests of new * ceil(window / 32) * 4

KERNELS_UNAVAILABLE = ("Triton kernels need CUDA, or fp16 CPU tensors with TRITON_INTERPRET=1 "
                       "(the interpreter computes bf16 dots wrongly)")

# F.scaled_dot_product_attention through a module attribute, so tests can observe its arguments.
_sdpa = F.scaled_dot_product_attention


def decompressed_bytes(step: PrefillStep) -> int:
    """Bytes of the decompressed K/V buffer of the MHA paths (2-byte dtype)."""
    return sum(step.windows) * step.num_heads * (step.qk_nope_head_dim + step.v_head_dim) * 2


def mask_bytes(step: PrefillStep) -> int:
    """Bytes of the packed per-query key masks of the masked MHA path."""
    return sum(n * -(-(c + n) // 32) * 4 for c, n in zip(step.cached_lens, step.new_lens))


def _too_big(what: str, nbytes: int, cap: int) -> str:
    return f"{what} {nbytes / 2**30:.1f} GiB > cap {cap / 2**30:.0f} GiB"


def decompress(p: DSAPrefillProblem, rows: torch.Tensor | slice,
               kv_c: torch.Tensor | None = None) -> torch.Tensor:
    """[L, H, qk_nope + v] in q's dtype: kv_c[rows] @ kv_b_proj.weight.T, per head k_nope then v.
    ``kv_c``: those rows when the caller has them already (an FP8 cache's dequantized rows).

    k_nope = result[..., :qk_nope] and v = result[..., qk_nope:] are views (no copy)."""
    H, d, r = p.w_kv_b.shape
    if kv_c is None:
        kv_c, _ = p.latent_rows(rows)
    return (kv_c @ p.w_kv_b.reshape(H * d, r).t()).view(kv_c.shape[0], H, d)


def mha_keys(kvd: torch.Tensor, k_pe_rows: torch.Tensor | None, qk_nope: int) -> torch.Tensor:
    """K of the MHA form, [L, H, qk_nope + qk_rope]: concat(k_nope, k_pe broadcast over heads), or,
    with no rope part, the k_nope view of ``kvd`` itself (no copy)."""
    k_nope = kvd[..., :qk_nope]
    if k_pe_rows is None:
        return k_nope
    L, H, _ = kvd.shape
    return torch.cat([k_nope, k_pe_rows[:, None, :].expand(L, H, k_pe_rows.shape[1])], dim=-1)


def mha_queries(p: DSAPrefillProblem) -> torch.Tensor:
    """Q of the MHA form, [T, H, qk_nope + qk_rope]; q_nope itself when there is no rope part."""
    return p.q_nope if p.q_pe is None else torch.cat([p.q_nope, p.q_pe], dim=-1)


class DenseMHA:
    """Causal MHA over decompressed K/V, when every top-k list is the request's whole prefix."""

    name = "dense_mha"

    def supports(self, step: PrefillStep) -> tuple[bool, str]:
        ok, why = step.dense_eligible
        if not ok:
            return False, why
        if decompressed_bytes(step) > MHA_MAX_DECOMPRESSED_BYTES:
            return False, _too_big("decompressed K/V", decompressed_bytes(step), MHA_MAX_DECOMPRESSED_BYTES)
        return True, why

    def run(self, p: DSAPrefillProblem, out: torch.Tensor) -> torch.Tensor:
        """Write o [T, H, v_head_dim] into ``out``; one SDPA call per request with new tokens."""
        from torch.nn.attention.bias import causal_lower_right

        dn = p.step.qk_nope_head_dim
        rows, starts = window_rows(p)
        kv_c, k_pe = p.latent_rows(rows)
        kvd = decompress(p, rows, kv_c)
        k = mha_keys(kvd, k_pe, dn)
        v = kvd[..., dn:]
        q = mha_queries(p)
        t0 = 0
        for b, (c, n) in enumerate(zip(p.step.cached_lens, p.step.new_lens)):
            if n == 0:
                continue
            L = c + n
            kb = k[starts[b]: starts[b] + L].transpose(0, 1).unsqueeze(0)  # [1, H, L, D_qk]
            vb = v[starts[b]: starts[b] + L].transpose(0, 1).unsqueeze(0)
            qb = q[t0: t0 + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D_qk]
            if c == 0:
                ob = _sdpa(qb, kb, vb, is_causal=True, scale=p.sm_scale)
            else:  # query i sees keys 0 .. c + i: causal aligned to the bottom-right corner
                ob = _sdpa(qb, kb, vb, attn_mask=causal_lower_right(n, L), scale=p.sm_scale)
            out[t0: t0 + n] = ob[0].transpose(0, 1)
            t0 += n
        return out


class MaskedMHA:
    """Causal MHA over decompressed K/V with each query's top-k as a key mask (Triton)."""

    name = "masked_mha"

    def __init__(self, block_m: int | None = None, block_n: int | None = None) -> None:
        self.block_m = block_m
        self.block_n = block_n

    def supports(self, step: PrefillStep) -> tuple[bool, str]:
        if not step.kernels_available:
            return False, KERNELS_UNAVAILABLE
        if step.mha_qk_head_dim > MASKED_MHA_MAX_HEAD_DIM or step.v_head_dim > MASKED_MHA_MAX_HEAD_DIM:
            return False, f"head dims {step.mha_qk_head_dim}/{step.v_head_dim} > {MASKED_MHA_MAX_HEAD_DIM}"
        if decompressed_bytes(step) > MHA_MAX_DECOMPRESSED_BYTES:
            return False, _too_big("decompressed K/V", decompressed_bytes(step), MHA_MAX_DECOMPRESSED_BYTES)
        if mask_bytes(step) > MASKED_MHA_MAX_MASK_BYTES:
            return False, _too_big("key masks", mask_bytes(step), MASKED_MHA_MAX_MASK_BYTES)
        return True, "decompressed K/V with top-k key masks"

    def run(self, p: DSAPrefillProblem, out: torch.Tensor, tile_counts: torch.Tensor | None = None) -> torch.Tensor:
        """Write o [T, H, v_head_dim] into ``out``; ``tile_counts`` ([n_blocks, H] int32, debug) receives
        the key tiles each program computed (``masked_mha.masked_mha_fwd``)."""
        from .masked_mha import build_key_bitmask, default_config, masked_mha_fwd, plan_masked_mha

        dn, dv = p.step.qk_nope_head_dim, p.step.v_head_dim
        rows, starts = window_rows(p)
        kvd = decompress(p, rows)
        bm, bn, _, _ = default_config(p.step.mha_qk_head_dim, dv, p.q_nope.device.type)
        plan = plan_masked_mha(p.step.cached_lens, p.step.new_lens, p.row_offsets, starts, self.block_m or bm,
                               p.q_nope.device)
        words = build_key_bitmask(p.indices, p.topk_length, plan)
        return masked_mha_fwd(p.q_nope, p.q_pe, kvd[..., :dn], p.k_pe_rows(), kvd[..., dn:], words, plan, p.sm_scale, out,
                              block_n=self.block_n or bn, tile_counts=tile_counts)


class SparseMQA:
    """Absorbed (MQA) form: q_nope @ W_UK, ``sparse_mla_fwd`` over latent rows, then @ W_UV^T."""

    def __init__(self, method: str) -> None:
        self.method = method
        self.name = f"mqa_{method}"

    def supports(self, step: PrefillStep) -> tuple[bool, str]:
        if not step.kernels_available:
            return False, KERNELS_UNAVAILABLE
        if step.kv_lora_rank not in MQA_KV_LORA_RANKS or step.qk_rope_head_dim not in MQA_ROPE_DIMS:
            return False, (f"the sparse MQA kernels take kv_lora_rank in {MQA_KV_LORA_RANKS} and qk_rope in "
                           f"{MQA_ROPE_DIMS}, got {step.kv_lora_rank} and {step.qk_rope_head_dim}")
        if self.method == "grouped" and step.num_heads > 64:
            return False, f"H = {step.num_heads} > 64 heads: a 128-row tile holds one query (G = 1), nothing to group"
        extra = " (groups of 128 // H queries share a union)" if self.method == "grouped" else ""
        return True, "sparse MQA over latent rows" + extra

    def run(self, p: DSAPrefillProblem, out: torch.Tensor) -> torch.Tensor:
        """Write o [T, H, v_head_dim] into ``out``: q_nope @ W_UK -> sparse_mla_fwd -> @ W_UV^T, with
        out-of-window entries turned into padding first (the layer semantics)."""
        return absorbed_mqa(p, out, self.method)


def absorb_queries(p: DSAPrefillProblem, q_heads: int | None = None) -> torch.Tensor:
    """The absorbed query, [T, q_heads, kv_lora_rank + qk_rope] in q_nope's dtype on its device:
    concat(q_nope[t, h] @ W_UK[h], q_pe[t, h]) for the H real heads, zeros for heads H .. q_heads - 1
    (padding for a kernel with a head minimum). ``q_heads`` defaults to H.

    Raises:
        ValueError: q_heads < H.
    """
    T, H, _ = p.q_nope.shape
    q_heads = H if q_heads is None else q_heads
    if q_heads < H:
        raise ValueError(f"q_heads must be >= H = {H}, got {q_heads}")
    r, dr = p.step.kv_lora_rank, p.step.qk_rope_head_dim
    alloc = torch.zeros if q_heads > H else torch.empty
    q = alloc(T, q_heads, r + dr, dtype=p.q_nope.dtype, device=p.q_nope.device)
    q[:, :H, :r] = torch.bmm(p.q_nope.transpose(0, 1), p.w_uk).transpose(0, 1)
    if p.q_pe is not None:
        q[:, :H, r:] = p.q_pe
    return q


def absorbed_mqa(p: DSAPrefillProblem, out: torch.Tensor, method: str, q_heads: int | None = None,
                 attention=None) -> torch.Tensor:
    """The absorbed (MQA) form of the step, written into ``out`` [T, H, v_head_dim] (q's dtype):
    ``absorb_queries`` -> ``sparse_mla_fwd(method=method)`` over the latent rows [N, r + qk_rope]
    (entries outside each token's causal window turned into padding, groups inside requests) ->
    latent of the H real heads @ W_UV^T.

    Args:
        p: the validated problem (kv_lora_rank and qk_rope the MQA kernels take).
        out: o [T, H, v_head_dim], written and returned.
        method: ``sparse_mla_fwd``'s "per_token" or "grouped".
        q_heads: heads of the query handed to the kernel, zero-padded beyond H (default H): the
            64-head minimum of FlashMLA's sparse prefill, which engines pad to on Hopper (the
            benchmark's baseline, ``sparse_mla.bench.baselines``).
        attention: the latent attention call, ``sparse_mla_fwd``'s signature (default ``sparse_mla_fwd``;
            the benchmark passes FlashMLA's kernel behind an adapter when it is installed). It receives
            ``kv_format=`` and ``kv_dequant="in_kernel"`` only for an FP8 cache on the in-kernel route (then the
            rows are the cache's bytes).
    """
    from ..mqa.interface import sparse_mla_fwd

    attention = attention or sparse_mla_fwd

    H = p.q_nope.shape[1]
    r, dr = p.step.kv_lora_rank, p.step.qk_rope_head_dim
    dev = p.q_nope.device
    fmt = {}
    if p.kv_format is not None:
        from ..kv_format import FP8_DS_MLA
        from ..kv_staging import choose_kv_dequant  # decorates the staging kernel: on first use
        from .staging import fp8_route_rows, stage_windows

        G = default_group_size(H) if method == "grouped" else 1
        staged, listed = fp8_route_rows(p)
        route, why = choose_kv_dequant(p.kv_dequant, staged, listed, FP8_DS_MLA.d_qk * p.q_nope.element_size(),
                                       group_size=G)
        logger.debug("dsa_prefill: FP8 cache, %s route (%s)", route, why)
        if route == "staged":
            p = stage_windows(p)
        else:
            fmt = {"kv_format": p.kv_format, "kv_dequant": "in_kernel"}
    q = absorb_queries(p, q_heads)
    kv_rows = p.kv_rows
    if kv_rows is None:
        logger.debug("dsa_prefill: kv_c and k_pe are separate buffers; copying them into one [N, %d] row tensor", r + dr)
        kv_rows = torch.cat([p.kv_c, p.k_pe], dim=-1)
    lo, win = token_windows(p.step.new_lens, p.step.cached_lens, p.row_offsets, dev)
    idx = restrict_to_windows(p.indices, lo, win)
    # one request: no cu_seqlens_q (groups cannot cross a boundary that is not there; saves a host copy)
    cu = (to_device_async(torch.tensor([0, *itertools.accumulate(p.step.new_lens)], dtype=torch.int32), dev)
          if len(p.step.new_lens) > 1 else None)
    latent = attention(q, kv_rows, idx, p.sm_scale, d_v=r, topk_length=p.topk_length, method=method, cu_seqlens_q=cu,
                       **fmt)
    out.copy_(torch.bmm(latent[:, :H].transpose(0, 1), p.w_uv.transpose(1, 2)).transpose(0, 1))
    return out


__all__ = ["DenseMHA", "MaskedMHA", "SparseMQA", "absorb_queries", "absorbed_mqa", "decompress", "mha_keys", "mha_queries",
           "window_rows", "decompressed_bytes", "mask_bytes"]
