"""Glm5Next (GLM-5.3-Flash, the NoPE layout): its DSA attention forward of transformers 5.23 on ``sparse_mla_fwd``
with latent rows of D_qk 512 (qk_nope 256, qk_rope 0, v 256; V = the whole 512-wide c_kv row).

1. q and the latent c_kv (after ``kv_a_layernorm``) come from the module's own projections, no rope (the model passes
   ``position_embeddings=None``); the cache is updated as eager updates it (c_kv as the layer's keys, a 0-wide k_pe
   as its values), so the latent rows of a step are the cache's rows, [B * T, 512];
2. the module's pooled indexer (or, on a "shared" layer, the previous layer's top-k) gives [B, S, index_topk +
   index_kpool - 1] positions: whole pools of index_kpool keys plus the query's incomplete tail pool, -1 padded (a
   query's own token is in it only when its pool is picked or is the tail). It already drops future positions, keys
   of padding and padded queries; ``topk_rows`` keeps exactly what eager's mask keeps: 0 <= p < T, a position listed
   twice counts once (eager scatters the list into a [B, S, T] mask), and a query the 2D padding mask drops keeps none;
3. q is absorbed through W_UK of ``kv_b_proj`` (q_nope 256 -> 512), the op runs with the module's ``scaling``
   (qk_head_dim^-0.5) and its output goes through W_UV, then ``o_proj``."""

from __future__ import annotations

import torch

from .common import KV_LORA_RANK, check_attrs, check_scaling, check_weight, latent_attention, require_inference, state

ATTRS = ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj",
         "num_heads", "qk_nope_head_dim", "qk_rope_head_dim", "qk_head_dim", "v_head_dim", "kv_lora_rank", "scaling",
         "layer_idx", "indexer", "next_skip_topk")


def check(name: str, module: torch.nn.Module, family: str) -> dict:
    """Raises where the module is not the NoPE layout replicated here."""
    check_attrs(name, module, ATTRS)
    if module.kv_lora_rank != KV_LORA_RANK or module.qk_rope_head_dim != 0:
        raise ValueError(f"{name}: kv_lora_rank {module.kv_lora_rank}, qk_rope_head_dim {module.qk_rope_head_dim}; "
                         f"Glm5Next's NoPE layout is served on latent rows of {KV_LORA_RANK} (D_qk 512, no rope)")
    if module.qk_head_dim != module.qk_nope_head_dim:
        raise ValueError(f"{name}: qk_head_dim {module.qk_head_dim} != qk_nope_head_dim {module.qk_nope_head_dim}")
    rows = module.num_heads * (module.qk_nope_head_dim + module.v_head_dim)
    check_weight(name, "kv_b_proj", module.kv_b_proj, (rows, KV_LORA_RANK))
    check_scaling(name, module.scaling)
    return {}


def topk_rows(topk: torch.Tensor, kv_len: int, query_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Glm5Next's top-k [B, S, K] (positions in the layer's T = ``kv_len`` cache rows, -1 = padding) as this library's
    indices [B * S, K] int32 into the flattened [B * T] latent rows: position p of batch b -> b * T + p for
    0 <= p < T, as eager's mask reads the list; -1 elsewhere, for a repeat of a position already listed (eager's mask
    is a set) and for every entry of a query that ``query_mask`` ([B, S] bool, the model's 2D padding mask) drops.
    Each list comes back sorted, its valid rows first."""
    B, S, K = topk.shape
    pos = topk.long()
    ok = (pos >= 0) & (pos < kv_len)
    if query_mask is not None:
        if query_mask.shape != (B, S):
            raise ValueError(f"padding mask {tuple(query_mask.shape)} does not match the top-k {tuple(topk.shape)}")
        ok &= query_mask.bool()[:, :, None]
    base = torch.arange(B, device=topk.device).view(B, 1, 1) * kv_len
    rows = torch.where(ok, pos + base, -1).view(B * S, K).sort(dim=-1, descending=True).values
    repeat = (rows[:, 1:] == rows[:, :-1]) & (rows[:, 1:] >= 0)
    rows[:, 1:] = rows[:, 1:].masked_fill(repeat, -1)
    return rows.sort(dim=-1, descending=True).values.to(torch.int32)


def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, past_key_values=None,
            prev_topk_indices: torch.Tensor | None = None, **kwargs):
    """Glm5NextTextAttention's forward (transformers 5.23) on ``sparse_mla_fwd``: the eager forward up to its top-k,
    then ``topk_rows`` and ``latent_attention`` (D_qk 512) in place of the dense masked attention."""
    st = state(self)
    require_inference(hidden_states, self.q_a_proj.weight)
    B, S = hidden_states.shape[:-1]
    q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
    q_states = self.q_b_proj(q_resid).view(B, S, -1, self.qk_head_dim).transpose(1, 2)
    compressed_kv = self.kv_a_proj_with_mqa(hidden_states)
    kv_pass, k_rot = torch.split(compressed_kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
    k_pass = self.kv_a_layernorm(kv_pass).view(B, 1, S, self.kv_lora_rank)
    k_rot = k_rot.view(B, 1, S, self.qk_rope_head_dim)
    if past_key_values is not None:
        k_pass, k_rot = past_key_values.update(k_pass, k_rot, self.layer_idx)
    if self.indexer is not None:
        topk = self.indexer(hidden_states=hidden_states, q_resid=q_resid, attention_mask=attention_mask,
                            past_key_values=past_key_values)
    elif prev_topk_indices is not None:
        topk = prev_topk_indices
    else:
        raise ValueError("Shared DSA layers require top-k indices from a previous full indexer layer.")
    query_mask = attention_mask if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 else None
    rows = topk_rows(topk, k_pass.shape[2], query_mask)
    out = self.o_proj(latent_attention(self, q_states, None, k_pass, None, rows, st["method"]))
    return out, None, topk if self.next_skip_topk else None
