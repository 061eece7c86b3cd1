"""What the model families of ``sparse_mla.integration.transformers`` share: the checks, the latent (absorbed) MLA
attention on ``sparse_mla_fwd`` and the conversion of an indexer's top-k under a 4D mask. No transformers import."""

from __future__ import annotations

import sys

import torch

from ...mqa.interface import sparse_mla_fwd

KV_LORA_RANK = 512  # d_v of the op: the latent c_kv (DeepseekV32 / GlmMoeDsa / Glm5Next), V4's shared K = V head
DTYPES = (torch.bfloat16, torch.float16)
STATE = "_sparse_mla_hf_state"  # the patch's state in a patched module's __dict__


def state(module: torch.nn.Module) -> dict:
    return module.__dict__[STATE]


def require_inference(hidden_states: torch.Tensor, weight: torch.Tensor) -> None:
    if torch.is_grad_enabled() and (hidden_states.requires_grad or weight.requires_grad):
        raise RuntimeError("sparse_mla's DSA attention is inference only (no backward): run the model under "
                           "torch.no_grad() / torch.inference_mode(), or undo() the patch to train")


def modeling_function(module: torch.nn.Module, name: str):
    """``name`` from the module's own modeling file (its rope function), or None."""
    return getattr(sys.modules.get(type(module).__module__), name, None)


def require_rope(name: str, module: torch.nn.Module, function: str):
    """The module's rope function ``function`` from its own modeling file.

    Raises:
        ValueError: the modeling file has none (a rope layout this integration does not replicate)."""
    rope = modeling_function(module, function)
    if rope is None:
        raise ValueError(f"{name}: {type(module).__module__} has no {function}: a rope layout this integration does not "
                         "replicate")
    return rope


def check_attrs(name: str, module: torch.nn.Module, attrs) -> None:
    missing = [a for a in attrs if not hasattr(module, a)]
    if missing:
        raise ValueError(f"{name} ({type(module).__name__}) lacks {missing}: not the transformers 5.23 layout this "
                         "integration replicates")


def check_weight(name: str, what: str, linear, shape: tuple[int, int]) -> torch.Tensor:
    """A plain bias-free linear map's weight of ``shape`` in bf16 / fp16."""
    w = getattr(linear, "weight", None)
    if not isinstance(w, torch.Tensor) or tuple(w.shape) != shape or getattr(linear, "bias", None) is not None:
        raise ValueError(f"{name}: {what} must be a plain linear map {shape[1]} -> {shape[0]} without bias (its weight is "
                         f"read directly), got {type(linear).__name__}{'' if w is None else ' ' + str(tuple(w.shape))}")
    check_dtype(name, w)
    return w


def check_dtype(name: str, w: torch.Tensor) -> None:
    if w.dtype not in DTYPES:
        raise TypeError(f"{name}: weights are {w.dtype}; the op runs bf16 or fp16 (fp16 on the CPU interpreter): "
                        "cast the model first, e.g. model.to(torch.bfloat16)")


def check_scaling(name: str, scaling) -> None:
    if not isinstance(scaling, (int, float)) or isinstance(scaling, bool) or not scaling > 0:
        raise ValueError(f"{name}: softmax scale {scaling!r} is not a positive float")


def mask_allows(attention_mask: torch.Tensor) -> torch.Tensor:
    """A transformers mask as bool (True = attend): bool as is, additive float where > the dtype's min / 2."""
    if attention_mask.dtype == torch.bool:
        return attention_mask
    return attention_mask > torch.finfo(attention_mask.dtype).min / 2


def latent_rows(topk: torch.Tensor, attention_mask: torch.Tensor, kv_len: int) -> torch.Tensor:
    """The indexer's top-k [B, S, K] (positions in the layer's T = ``kv_len`` cache rows) as this library's indices
    [B * S, K] int32 into the flattened [B * T] latent rows: position p of batch b -> b * T + p where the attention
    mask the eager path applies allows (b, s, p), else -1 (future positions, left padding, unfilled static-cache
    rows, positions outside [0, T)). ``attention_mask``: [B or 1, 1, S, T], bool (True = attend) or additive float
    (0 = attend, the dtype's min = masked)."""
    if attention_mask is None:
        raise ValueError("the DSA attention needs its 4D attention mask (the model builds one for its indexer)")
    B, S, K = topk.shape
    mask = attention_mask[:, 0]
    if mask.shape[-2:] != (S, kv_len) or mask.shape[0] not in (1, B):
        raise ValueError(f"attention mask {tuple(attention_mask.shape)} does not match the top-k {tuple(topk.shape)} "
                         f"over {kv_len} cache rows")
    allowed = mask_allows(mask)
    pos = topk.long()
    inside = (pos >= 0) & (pos < kv_len)
    ok = inside & torch.gather(allowed.expand(B, S, kv_len), 2, pos.clamp(0, kv_len - 1))
    base = torch.arange(B, device=topk.device).view(B, 1, 1) * kv_len
    return torch.where(ok, pos + base, -1).to(torch.int32).view(B * S, K)


def latent_attention(module: torch.nn.Module, q_nope: torch.Tensor, q_rot: torch.Tensor | None, c_kv: torch.Tensor,
                     k_rot: torch.Tensor | None, rows: torch.Tensor, method: str = "auto") -> torch.Tensor:
    """The absorbed MLA attention of one DSA module: q_nope [B, H, S, dn], q_rot [B, H, S, 64] (roped), the cache's
    c_kv [B, 1, T, 512] and k_rot [B, 1, T, 64], rows [B * S, K] (``latent_rows``) -> the heads' values
    [B, S, H * v_head_dim] in q's dtype, before ``o_proj``. Without rope (Glm5Next's NoPE layout: q_rot / k_rot None
    or 0 wide) the op runs on the 512-wide c_kv rows alone (D_qk 512, V = the whole row)."""
    B, H, S, dn = q_nope.shape
    T = c_kv.shape[2]
    w = module.kv_b_proj.weight.view(H, dn + module.v_head_dim, KV_LORA_RANK)
    w_uk, w_uv = w[:, :dn], w[:, dn:]
    q = torch.matmul(q_nope, w_uk.to(q_nope.dtype))  # [B, H, S, 512]
    kv = c_kv
    if q_rot is not None and q_rot.shape[-1]:
        q = torch.cat([q, q_rot.to(q.dtype)], dim=-1)
        kv = torch.cat([c_kv, k_rot.to(c_kv.dtype)], dim=-1)
    q = q.transpose(1, 2).reshape(B * S, H, q.shape[-1]).to(kv.dtype)
    kv = kv.reshape(B * T, kv.shape[-1])
    cu = torch.arange(B + 1, device=q.device, dtype=torch.int32) * S
    o = sparse_mla_fwd(q, kv, rows, float(module.scaling), cu_seqlens_q=cu, method=method)  # [B * S, H, 512]
    o = o.view(B, S, H, KV_LORA_RANK).transpose(1, 2)
    v = torch.matmul(o, w_uv.to(o.dtype).transpose(-1, -2))  # [B, H, S, v]
    return v.transpose(1, 2).reshape(B, S, H * module.v_head_dim)
