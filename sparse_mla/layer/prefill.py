"""The layer-level DSA prefill: one call for what an MLA layer holds during a prefill step.

``dsa_prefill`` validates, describes the step as a ``PrefillStep``, lets the dispatcher pick a path
(dense MHA, masked MHA, grouped or per-token sparse MQA; ``sparse_mla.layer.dispatch``), logs the
choice and runs it. ``SparseMLAPrefill`` is a thin ``nn.Module`` holding kv_b_proj.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from ..checks import require_bool, require_finite_float, require_int
from ..kv_format import KV_DEQUANT_MODES
from .checks import validate_dsa_prefill_args, validate_dsa_prefill_out
from .dispatch import PATHS, PathDecision, explain


def dsa_prefill(
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
    path: str | None = None,
    check: bool = False,
    out: torch.Tensor | None = None,
    return_decision: bool = False,
    kv_format: str | None = None,
    kv_dequant: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, PathDecision]:
    """DeepSeek Sparse Attention prefill of one MLA layer: per-token sparse attention over each new
    token's top-k cache rows, returned per head in the MHA form.

    Semantics: ``sparse_mla.layer.reference.dsa_prefill_ref`` (per-token sparse MLA of
    ``sparse_mla.mqa.reference.sparse_mla_ref`` through kv_b_proj; docs/DESIGN.md "The paths"). Every path
    returns that value up to bf16 rounding and fp32 summation order.

    Args:
        q_nope: [T, H, qk_nope_head_dim] bf16 or fp16 (CUDA; CPU runs the dense path, the Triton
            paths need TRITON_INTERPRET=1), last dim contiguous. The new tokens of all requests,
            request by request (T = sum(new_lens)).
        q_pe: [T, H, qk_rope_head_dim] (rope already applied), or None / [T, H, 0] for the NoPE
            layout (qk_rope_head_dim = 0).
        w_kv_b: [H * (qk_nope_head_dim + v_head_dim), kv_lora_rank], q's dtype: kv_b_proj.weight in
            DeepSeek's layout (y = kv_c @ W.T): for head h, rows h*(qk_nope+v) .. +qk_nope are W_UK[h]
            (k_nope[h] = kv_c @ W_UK[h].T) and the next v_head_dim rows are W_UV[h]
            (v[h] = kv_c @ W_UV[h].T). v_head_dim is read off this shape.
        indices: [T, K] (or [T, 1, K]) int32 global cache rows of each token's top-k; negative
            entries, entries past topk_length and entries outside the token's causal window (rows
            row_offsets[b] .. row_offsets[b] + cached_b + i) are padding. Valid rows of one token
            are distinct (the indexer's top-k guarantees it; ``check=True`` verifies).
        kv: [N, kv_lora_rank + qk_rope_head_dim] cache rows (kv_c = kv[:, :kv_lora_rank],
            k_pe = kv[:, kv_lora_rank:]), or paged [num_blocks, block_size, D] viewed flat. Or:
        kv_c: [N, kv_lora_rank] with k_pe: [N, qk_rope_head_dim] (None for NoPE). Exactly one of
            kv / kv_c. Separate buffers cost the MQA paths one [N, D] concatenation per call.
            With kv_format="fp8_ds_mla": kv is the FP8 cache, uint8 (or float8_e4m3fn) [N, 656], paged
            [num_blocks, block_size, 656] or [num_blocks, block_size, 1, 656], rows 16-byte aligned; the
            layout's kv_lora_rank 512 and qk_rope_head_dim 64 are then required (``sparse_mla.kv_format``).
        cached_lens, new_lens: [B] host ints (or CPU int tensors): per request, positions already
            cached and new tokens; the new tokens are its last new_lens[b] positions.
        row_offsets: [B] host ints: request b's position p is cache row row_offsets[b] + p
            (contiguous per request). Default: requests packed back to back from row 0.
        sm_scale: softmax scale on q . k (the model's, e.g. ``MLAConfig.sm_scale``).
        topk_length: optional [T] int32: only the first topk_length[t] entries of row t count.
        dense_topk: True if every token's list is its whole window, False if not, None to infer
            (whole window when every window <= K and no topk_length: the indexer then selects all).
        path: None / "auto", or one of "dense_mha", "masked_mha", "mqa_grouped", "mqa_per_token"
            to force it (else the SPARSE_MLA_PATH environment variable, then the automatic choice).
            A forced path that does not support the step falls back to the automatic choice with a
            ``PathFallbackWarning`` (see ``sparse_mla.layer.dispatch``).
        check: checked mode (syncs): raise on out-of-window or repeated entries, bad topk_length,
            and lists that are not whole windows when the dense path is eligible.
        out: optional preallocated o, [T, H, v_head_dim] in q's dtype on q's device, last dim
            contiguous (written and returned).
        kv_format: None (kv / kv_c / k_pe hold rows in q's dtype) or "fp8_ds_mla" (FlashMLA's / vLLM's FP8
            cache; explicit, never inferred from the dtype). Every path then computes the definition on the
            cache dequantized to q's dtype: the MHA paths dequantize the request windows' rows first; the MQA
            paths take the route ``kv_dequant`` says. The dispatcher's thresholds were measured with bf16 caches.
        kv_dequant: the MQA paths' route for an FP8 cache: "auto" (the measured rule,
            ``sparse_mla.kv_staging.choose_kv_dequant``: the windows' rows staged to q's dtype when that costs less
            than dequantizing the gathered rows in the kernel, within ``kv_staging.DEFAULT_MAX_STAGED_BYTES``),
            "staged" (``sparse_mla.layer.staging.stage_windows``: a [sum of windows, 576] buffer of q's dtype per
            call), or "in_kernel" (no staging memory: each gathered row dequantized in the kernel's gather).
        return_decision: also return the ``PathDecision`` (path, reason, supports table; its backend
            descriptions are left empty: ``explain(step)`` fills them).

    Returns:
        o: [T, H, v_head_dim] in q's dtype (0 for a token with no valid entry), or
        (o, decision) with return_decision=True.

    Non-finite cache rows: only mqa_per_token keeps a NaN / inf row to the queries that select it;
    mqa_grouped spreads it to the selecting query's group, dense_mha / masked_mha to any query of a
    request whose window holds it (docs/DESIGN.md "Non-finite kv rows"). check=True raises on one in
    any window row.

    Raises:
        TypeError, ValueError: bad arguments (``validate_dsa_prefill_args``), an unknown ``path`` or
            ``kv_dequant`` name, or no path that supports the step (e.g. a long prompt on a CPU without
            TRITON_INTERPRET=1), all before any kernel launch.
    """
    p = validate_dsa_prefill_args(
        q_nope, q_pe, w_kv_b, indices, kv=kv, kv_c=kv_c, k_pe=k_pe, cached_lens=cached_lens, new_lens=new_lens,
        row_offsets=row_offsets, sm_scale=sm_scale, topk_length=topk_length, dense_topk=dense_topk, check=check,
        kv_format=kv_format,
    )
    if kv_dequant not in KV_DEQUANT_MODES:
        raise ValueError(f"kv_dequant must be one of {KV_DEQUANT_MODES}, got {kv_dequant!r}")
    if kv_dequant != "auto":
        p = dataclasses.replace(p, kv_dequant=kv_dequant)
    T, H, _ = p.q_nope.shape
    if validate_dsa_prefill_out(p, out) is None:
        out = torch.empty((T, H, p.step.v_head_dim), dtype=p.q_nope.dtype, device=p.q_nope.device)
    require_bool("return_decision", return_decision)
    decision = explain(p.step, path, describe_backends=False, log=True)
    if T > 0:
        PATHS[decision.path].run(p, out)
    return (out, decision) if return_decision else out


class SparseMLAPrefill(nn.Module):
    """DSA prefill attention of one MLA layer, holding ``kv_b_proj`` (weight
    [num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank], DeepSeek's layout and state-dict
    key ``kv_b_proj.weight``; under TP, num_heads is the heads of this rank).

    ``forward`` is ``dsa_prefill`` with the weight, scale and a default ``path`` filled in.

    Raises:
        TypeError: a dim that is not an int, an sm_scale that is not a real number (a bool included).
        ValueError: a dim < 1 (qk_rope_head_dim may be 0), a non-finite sm_scale.
    """

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, sm_scale: float | None = None, *, path: str | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        for name, v in (("num_heads", num_heads), ("kv_lora_rank", kv_lora_rank),
                        ("qk_nope_head_dim", qk_nope_head_dim), ("v_head_dim", v_head_dim)):
            require_int(name, v, minimum=1)
        require_int("qk_rope_head_dim", qk_rope_head_dim, minimum=0)
        self.num_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.sm_scale = (require_finite_float("sm_scale", sm_scale, " (the softmax scale) or None") if sm_scale is not None
                         else (qk_nope_head_dim + qk_rope_head_dim) ** -0.5)
        self.path = path
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False,
                                   device=device, dtype=dtype)

    @classmethod
    def from_config(cls, cfg: object, *, tp_size: int = 1, **kwargs) -> SparseMLAPrefill:
        """From a model config with ``num_heads``, ``kv_lora_rank``, ``qk_nope_head_dim``,
        ``qk_rope_head_dim``, ``v_head_dim`` and optionally ``sm_scale`` (e.g.
        ``sparse_mla.workloads.models.MLAConfig``), with num_heads // tp_size heads.

        Raises:
            ValueError: tp_size does not divide num_heads.
        """
        if tp_size < 1 or cfg.num_heads % tp_size:
            raise ValueError(f"tp_size must divide num_heads = {cfg.num_heads}, got {tp_size}")
        kwargs.setdefault("sm_scale", getattr(cfg, "sm_scale", None))
        return cls(cfg.num_heads // tp_size, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                   cfg.v_head_dim, **kwargs)

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor | None, indices: torch.Tensor, **kwargs) -> torch.Tensor:
        """o [T, H, v_head_dim] = ``dsa_prefill(q_nope, q_pe, self.kv_b_proj.weight, indices, **kwargs)``
        (kwargs: kv or kv_c/k_pe, cached_lens, new_lens, ...; sm_scale and path default to the module's)."""
        kwargs.setdefault("sm_scale", self.sm_scale)
        kwargs.setdefault("path", self.path)
        return dsa_prefill(q_nope, q_pe, self.kv_b_proj.weight, indices, **kwargs)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, kv_lora_rank={self.kv_lora_rank}, qk_nope_head_dim={self.qk_nope_head_dim}, "
                f"qk_rope_head_dim={self.qk_rope_head_dim}, v_head_dim={self.v_head_dim}, sm_scale={self.sm_scale:.5g}")


__all__ = ["dsa_prefill", "SparseMLAPrefill"]
