"""DeepseekV32 (DeepSeek-V3.2) and GlmMoeDsa (GLM-5): the DSA attention forward of transformers 5.23 on
``sparse_mla_fwd`` (latent rows c_kv | k_pe, D_qk 576).

1. q, the latent c_kv (after ``kv_a_layernorm``) and k_pe come from the module's own projections and its own
   rope function (interleaved pairs written back de-interleaved), exactly as the eager forward computes them;
2. transformers' cache is updated as eager updates it: these models' caches already hold the latents (c_kv as the
   layer's keys, k_pe as its values), so the latent rows of a step are the cache's rows, [B * T, 576] per layer
   (one concatenation per layer and step; no side cache);
3. the module's indexer (or, on GLM-5's "shared" layers, the previous layer's top-k) gives [B, S, K] positions;
   an entry becomes padding (-1) where the attention mask the eager path applies forbids it (future positions of
   the early queries, left padding, positions past a static cache's fill), else the row b * T + position;
4. q_nope is absorbed through W_UK of ``kv_b_proj``, the op runs with the module's ``scaling`` (YaRN mscale
   included), and its latent output goes through W_UV, then ``o_proj``."""

from __future__ import annotations

import torch

from .common import (
    KV_LORA_RANK,
    check_attrs,
    check_scaling,
    check_weight,
    latent_attention,
    latent_rows,
    require_inference,
    require_rope,
    state,
)

ROPE_DIM = 64  # D_qk = 576
ATTRS = ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj",
         "num_heads", "qk_nope_head_dim", "qk_rope_head_dim", "qk_head_dim", "v_head_dim", "kv_lora_rank", "scaling",
         "layer_idx", "indexer")
ROPE = "apply_rotary_pos_emb_interleave"


def check(name: str, module: torch.nn.Module, family: str) -> dict:
    """Raises where the module is not the layout replicated here; returns the patch's extra state (the rope)."""
    check_attrs(name, module, ATTRS + (("skip_topk",) if family == "glm_moe_dsa" else ()))
    if module.kv_lora_rank != KV_LORA_RANK or module.qk_rope_head_dim != ROPE_DIM:
        raise ValueError(f"{name}: kv_lora_rank {module.kv_lora_rank}, qk_rope_head_dim {module.qk_rope_head_dim}; "
                         f"the op serves latent rows of {KV_LORA_RANK} + {ROPE_DIM} (D_qk 576)")
    if module.qk_head_dim != module.qk_nope_head_dim + module.qk_rope_head_dim:
        raise ValueError(f"{name}: qk_head_dim {module.qk_head_dim} != qk_nope + qk_rope")
    rows = module.num_heads * (module.qk_nope_head_dim + module.v_head_dim)
    check_weight(name, "kv_b_proj", module.kv_b_proj, (rows, KV_LORA_RANK))
    check_scaling(name, module.scaling)
    return {"rope": require_rope(name, module, ROPE)}


def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
            attention_mask: torch.Tensor, past_key_values=None, position_ids: torch.Tensor | None = None,
            prev_topk_indices: torch.Tensor | None = None, **kwargs):
    """The DSA attention forward of DeepseekV32 / GlmMoeDsa (transformers 5.23) on ``sparse_mla_fwd``: the eager
    forward up to its top-k, then ``latent_rows`` and ``latent_attention`` in place of the dense masked attention."""
    st = state(self)
    require_inference(hidden_states, self.q_a_proj.weight)
    B, S = hidden_states.shape[:-1]
    q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
    q_states = self.q_b_proj(q_resid).view(B, S, -1, self.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(q_states, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
    compressed_kv = self.kv_a_proj_with_mqa(hidden_states)
    kv_pass, k_rot = torch.split(compressed_kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
    k_pass = self.kv_a_layernorm(kv_pass).view(B, 1, S, self.kv_lora_rank)
    k_rot = k_rot.view(B, 1, S, self.qk_rope_head_dim)
    cos, sin = position_embeddings
    q_rot, k_rot = st["rope"](q_rot, k_rot, cos, sin)
    if past_key_values is not None:
        k_pass, k_rot = past_key_values.update(k_pass, k_rot, self.layer_idx)
    if attention_mask is None:
        raise ValueError("the DSA attention needs its 4D attention mask (the model builds one for its indexer)")
    if getattr(self, "indexer", None) is not None:
        topk = self.indexer(hidden_states, q_resid, position_embeddings, attention_mask[:, 0, :, :], position_ids,
                            past_key_values=past_key_values)
    elif prev_topk_indices is not None:
        topk = prev_topk_indices
    else:
        raise ValueError("Shared DSA layers require top-k indices from a previous full indexer layer.")
    rows = latent_rows(topk, attention_mask, k_pass.shape[2])
    out = self.o_proj(latent_attention(self, q_pass, q_rot, k_pass, k_rot, rows, st["method"]))
    return (out, None, topk) if st["family"] == "glm_moe_dsa" else (out, None)
