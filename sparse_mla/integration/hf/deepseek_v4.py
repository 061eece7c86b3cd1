"""DeepseekV4: its attention forward of transformers 5.23 on ``sparse_mla_fwd`` (D_qk 512, V = the whole row, a
per-head sink).

V4 has no latent and no ``kv_b_proj``: one shared 512-wide K = V head (rope on its last 64 dims, interleaved), whose
rows are, per batch, the layer's sliding window of raw rows (the cache's last sliding_window - 1 rows and the new
ones) followed by its compressed rows (one per compress_rate tokens; CSA layers: the lightning indexer picks
index_topk of them per query; HCA layers: all of those a query may see; sliding layers: none).

1. q (``q_b_norm`` and rope), the raw K = V rows (``kv_norm`` and rope), the cache update, the compressor and its
   indexer are the module's own calls, as in the eager forward;
2. the rows each query attends are the ones eager's mask keeps: the 4D sliding-window mask over the window rows,
   extended over the compressed rows by the compressor's block bias (CSA: the indexer's picks; HCA: the causal
   ones; where the compressor gives none, as in HCA decode, every compressed row, as eager pads with 0);
   ``v4_rows`` turns that [B, S, L] set into indices [B * S, K] into the [B * L, 512] rows (K = the largest set);
3. the op runs with the module's ``scaling`` (head_dim^-0.5) and ``attn_sink`` = the module's ``sinks`` (eager's
   softmax over [logits, sink], the sink dropped); the output's rope slice is rotated back (-sin at the query's
   position, as eager does), then the grouped ``o_a_proj`` and ``o_b_proj``."""

from __future__ import annotations

import torch

from ...mqa.interface import sparse_mla_fwd
from .common import (
    DTYPES,
    check_attrs,
    check_dtype,
    check_scaling,
    check_weight,
    mask_allows,
    require_inference,
    require_rope,
    state,
)

HEAD_DIM = 512
ATTRS = ("q_a_proj", "q_a_norm", "q_b_proj", "q_b_norm", "kv_proj", "kv_norm", "o_a_proj", "o_b_proj", "sinks",
         "compressor", "num_heads", "head_dim", "scaling", "layer_idx", "rope_layer_type", "config")
ROPE = "apply_rotary_pos_emb"


def check(name: str, module: torch.nn.Module, family: str) -> dict:
    """Raises where the module is not the layout replicated here; returns the patch's extra state (the rope)."""
    check_attrs(name, module, ATTRS)
    if module.head_dim != HEAD_DIM or getattr(module.config, "num_key_value_heads", 1) != 1:
        raise ValueError(f"{name}: head_dim {module.head_dim}, {module.config.num_key_value_heads} kv heads; the op "
                         f"serves one shared K = V head of {HEAD_DIM} (D_qk 512)")
    check_weight(name, "kv_proj", module.kv_proj, (HEAD_DIM, module.kv_proj.in_features))
    check_dtype(name, module.q_b_proj.weight)
    sinks = module.sinks
    if not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (module.num_heads,):
        raise ValueError(f"{name}: sinks must be one logit per head ({module.num_heads}), got "
                         f"{getattr(sinks, 'shape', sinks)}")
    check_scaling(name, module.scaling)
    return {"rope": require_rope(name, module, ROPE)}


def v4_rows(attention_mask: torch.Tensor | None, block_bias: torch.Tensor | None, batch: int, seq: int, window: int,
            kv_len: int, device=None) -> torch.Tensor:
    """The rows eager's mask lets each query see, as indices [B * S, K] int32 into the flattened [B * L] rows
    (L = ``kv_len``: ``window`` raw rows, then the compressed ones), ascending, -1 padded, K = the largest count.
    ``attention_mask``: [B or 1, 1, S, window] (or already L wide), bool or additive float; None: eager masks
    nothing. ``block_bias``: [B, 1, S, L - window], 0 = visible, -inf = not; None: every compressed row visible
    (eager pads the mask with 0)."""
    if attention_mask is None:
        allowed = torch.ones(batch, seq, kv_len, dtype=torch.bool, device=device)
    else:
        mask = mask_allows(attention_mask[:, 0])
        if mask.shape[-2] != seq or mask.shape[0] not in (1, batch) or mask.shape[-1] not in (window, kv_len):
            raise ValueError(f"attention mask {tuple(attention_mask.shape)} does not match {seq} queries over "
                             f"{window} window rows ({kv_len} with the compressed ones)")
        mask = mask.expand(batch, seq, mask.shape[-1])
        if mask.shape[-1] < kv_len:
            extra = torch.ones(batch, seq, kv_len - window, dtype=torch.bool, device=mask.device) \
                if block_bias is None else block_bias[:, 0].expand(batch, seq, kv_len - window) == 0
            mask = torch.cat([mask, extra], dim=-1)
        allowed = mask
    k = max(int(allowed.sum(-1).max()), 1) if allowed.numel() else 1
    pos = (~allowed).to(torch.uint8).sort(dim=-1, stable=True).indices[..., :k]  # the allowed rows first, ascending
    ok = torch.gather(allowed, 2, pos)
    base = torch.arange(batch, device=allowed.device).view(batch, 1, 1) * kv_len
    return torch.where(ok, pos + base, -1).to(torch.int32).view(batch * seq, k)


def forward(self, hidden_states: torch.Tensor, position_embeddings, position_ids: torch.Tensor,
            attention_mask: torch.Tensor | None, past_key_values=None, **kwargs):
    """DeepseekV4Attention's forward (transformers 5.23) on ``sparse_mla_fwd``: the eager forward up to its rows and
    mask, then ``v4_rows`` and the op (with the sink) in place of the dense masked attention."""
    st = state(self)
    require_inference(hidden_states, self.q_a_proj.weight)
    rope = st["rope"]
    B, S = hidden_states.shape[:-1]
    cos, sin = position_embeddings[self.rope_layer_type]
    q_residual = self.q_a_norm(self.q_a_proj(hidden_states))
    q = self.q_b_norm(self.q_b_proj(q_residual).view(B, S, -1, self.head_dim).transpose(1, 2))
    q = rope(q, cos, sin)
    kv = self.kv_norm(self.kv_proj(hidden_states)).view(B, S, -1, self.head_dim).transpose(1, 2)
    kv = rope(kv, cos, sin)
    if past_key_values is not None:  # the sliding window, K = V
        kv = past_key_values.update(kv, kv, self.layer_idx)[0]
    window = kv.shape[2]
    block_bias = None
    if self.compressor is not None:  # compressed rows (CSA or HCA)
        compressed_kv, block_bias = self.compressor(hidden_states, q_residual, position_ids, past_key_values,
                                                    self.layer_idx)
        kv = torch.cat([kv, compressed_kv.to(kv.dtype)], dim=2)
    if kv.dtype not in DTYPES:
        raise TypeError(f"DeepseekV4 attention rows are {kv.dtype}; the op runs bf16 or fp16")
    L = kv.shape[2]
    rows = v4_rows(attention_mask, block_bias, B, S, window, L, kv.device)
    cu = torch.arange(B + 1, device=q.device, dtype=torch.int32) * S
    o = sparse_mla_fwd(q.transpose(1, 2).reshape(B * S, self.num_heads, self.head_dim).to(kv.dtype),
                       kv.reshape(B * L, self.head_dim), rows, float(self.scaling), d_v=self.head_dim,
                       cu_seqlens_q=cu, method=st["method"], attn_sink=self.sinks.detach().float())
    o = rope(o.view(B, S, self.num_heads, self.head_dim).transpose(1, 2), cos, -sin).transpose(1, 2)
    grouped = self.o_a_proj(o.reshape(B, S, self.config.o_groups, -1)).flatten(2)
    return self.o_b_proj(grouped), None

