"""transformers' DSA models on this library's sparse MQA: ``apply(model)`` / ``undo(model)`` (the ``hf`` extra).

``apply`` replaces, in place, the forward of every DSA attention module of a loaded DeepseekV32 (DeepSeek-V3.2) or
GlmMoeDsa (GLM-5) model of transformers >= 5.23 with one that runs the absorbed (latent) form on ``sparse_mla_fwd``:

1. q, the latent c_kv (after ``kv_a_layernorm``) and k_pe come from the module's own projections and its own
   rope function (interleaved pairs written back de-interleaved), exactly as the eager forward computes them;
2. transformers' cache is updated as eager updates it: these models' caches already hold the latents (c_kv as the
   layer's keys, k_pe as its values), so the latent rows of a step are the cache's rows, [B * T, 576] per layer
   (one concatenation per layer and step; no side cache);
3. the module's indexer (or, on GLM-5's "shared" layers, the previous layer's top-k) gives [B, S, K] positions;
   an entry becomes padding (-1) where the attention mask the eager path applies forbids it (future positions of
   the early queries, left padding, positions past a static cache's fill), else the row b * T + position;
4. q_nope is absorbed through W_UK of ``kv_b_proj``, the op runs with the module's ``scaling`` (YaRN mscale
   included), and its latent output goes through W_UV, then ``o_proj``.

A query with no valid row gets 0 (eager's softmax over a fully masked row is not 0: left-padding rows differ).
Inference only (the op has no backward): a call that would need gradients raises. The semantics, each with the
test that holds it: docs/integration.md, "transformers". transformers is imported here only, lazily.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field

import torch

from ..mqa.interface import sparse_mla_fwd

# model family (config.model_type) -> its DSA attention class
SUPPORTED = {"deepseek_v32": "DeepseekV32Attention", "glm_moe_dsa": "GlmMoeDsaAttention"}
NOT_IMPLEMENTED = {
    "glm5_next": ("Glm5NextTextAttention", "Glm5Next (the NoPE layout: D_qk 512, a pooled indexer padded with -1)"),
    "deepseek_v4": ("DeepseekV4Attention", "DeepseekV4 (one shared K = V head, sliding window + compressed rows, "
                                           "per-head sink; no kv_b_proj)"),
}
KV_LORA_RANK = 512  # d_v of the op: the latent c_kv
ROPE_DIM = 64  # D_qk = 576
DTYPES = (torch.bfloat16, torch.float16)
MIN_TRANSFORMERS = (5, 23)
_STATE = "_sparse_mla_hf_state"
_ATTRS = ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj",
          "num_heads", "qk_nope_head_dim", "qk_rope_head_dim", "qk_head_dim", "v_head_dim", "kv_lora_rank", "scaling",
          "layer_idx")


@dataclass
class Patched:
    """What ``apply`` did: the patched attention modules (name -> module); ``undo()`` restores their forwards
    (also a context manager: ``with apply(model): ...``)."""

    model: torch.nn.Module
    family: str
    modules: dict[str, torch.nn.Module] = field(default_factory=dict)

    def undo(self) -> None:
        for module in self.modules.values():
            _restore(module)

    def __enter__(self) -> Patched:
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


def apply(model: torch.nn.Module, *, method: str = "auto") -> Patched:
    """Run the DSA attention of a DeepseekV32 / GlmMoeDsa model (or any module holding their attention modules) on
    ``sparse_mla_fwd``, in place; ``method`` goes to the op ("auto", "per_token", "grouped").

    Raises (nothing patched then): ValueError for a model with no DSA attention module, a layout the op cannot
    serve (kv_lora_rank != 512, qk_rope_head_dim != 64, a module without the expected projections, rope or
    indexer) or transformers older than 5.23; NotImplementedError for Glm5Next and DeepseekV4 (not supported yet);
    TypeError for weights other than bf16 / fp16. Applying twice leaves one patch."""
    import transformers

    version = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
    if version < MIN_TRANSFORMERS:
        raise ValueError(f"sparse_mla.integration.transformers needs transformers >= 5.23, found {transformers.__version__}")
    if method not in ("auto", "per_token", "grouped"):
        raise ValueError(f"method must be 'auto', 'per_token' or 'grouped', got {method!r}")
    family, found = _find_attention(model)
    for name, module in found.items():
        _check_module(name, module, family)
    patched = Patched(model, family)
    for name, module in found.items():
        _patch(module, family, method)
        patched.modules[name] = module
    return patched


def undo(model: torch.nn.Module) -> int:
    """Restore every attention forward ``apply`` replaced in ``model``; returns how many."""
    n = 0
    for module in model.modules():
        if _STATE in module.__dict__:
            _restore(module)
            n += 1
    return n


def is_applied(model: torch.nn.Module) -> bool:
    """Whether some attention module of ``model`` runs on this library."""
    return any(_STATE in m.__dict__ for m in model.modules())


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
    allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    pos = topk.long()
    inside = (pos >= 0) & (pos < kv_len)
    ok = inside & torch.gather(allowed.expand(B, S, kv_len), 2, pos.clamp(0, kv_len - 1))
    base = torch.arange(B, device=topk.device).view(B, 1, 1) * kv_len
    return torch.where(ok, pos + base, -1).to(torch.int32).view(B * S, K)


def latent_attention(module: torch.nn.Module, q_nope: torch.Tensor, q_rot: torch.Tensor, c_kv: torch.Tensor,
                     k_rot: torch.Tensor, rows: torch.Tensor, method: str = "auto") -> torch.Tensor:
    """The absorbed MLA attention of one DSA module: q_nope [B, H, S, dn], q_rot [B, H, S, 64] (roped), the cache's
    c_kv [B, 1, T, 512] and k_rot [B, 1, T, 64], rows [B * S, K] (``latent_rows``) -> the heads' values
    [B, S, H * v_head_dim] in q's dtype, before ``o_proj``."""
    B, H, S, dn = q_nope.shape
    T = c_kv.shape[2]
    w = module.kv_b_proj.weight.view(H, dn + module.v_head_dim, KV_LORA_RANK)
    w_uk, w_uv = w[:, :dn], w[:, dn:]
    q_lat = torch.matmul(q_nope, w_uk.to(q_nope.dtype))  # [B, H, S, 512]
    q = torch.cat([q_lat, q_rot], dim=-1).transpose(1, 2).reshape(B * S, H, KV_LORA_RANK + ROPE_DIM)
    kv = torch.cat([c_kv, k_rot.to(c_kv.dtype)], dim=-1).reshape(B * T, KV_LORA_RANK + ROPE_DIM)
    q = q.to(kv.dtype)
    cu = torch.arange(B + 1, device=q.device, dtype=torch.int32) * S
    o = sparse_mla_fwd(q, kv, rows, float(module.scaling), cu_seqlens_q=cu, method=method)  # [B * S, H, 512]
    o = o.view(B, S, H, KV_LORA_RANK).transpose(1, 2)
    v = torch.matmul(o, w_uv.to(o.dtype).transpose(-1, -2))  # [B, H, S, v]
    return v.transpose(1, 2).reshape(B, S, H * module.v_head_dim)


def _dsa_forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                 attention_mask: torch.Tensor, past_key_values=None, position_ids: torch.Tensor | None = None,
                 prev_topk_indices: torch.Tensor | None = None, **kwargs):
    """The DSA attention forward of DeepseekV32 / GlmMoeDsa (transformers 5.23) on ``sparse_mla_fwd``: the eager
    forward up to its top-k, then ``latent_rows`` and ``latent_attention`` in place of the dense masked attention."""
    state = self.__dict__[_STATE]
    if torch.is_grad_enabled() and (hidden_states.requires_grad or self.q_a_proj.weight.requires_grad):
        raise RuntimeError("sparse_mla's DSA attention is inference only (no backward): run the model under "
                           "torch.no_grad() / torch.inference_mode(), or undo() the patch to train")
    B, S = hidden_states.shape[:-1]
    q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
    q_states = self.q_b_proj(q_resid).view(B, S, -1, self.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(q_states, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
    compressed_kv = self.kv_a_proj_with_mqa(hidden_states)
    kv_pass, k_rot = torch.split(compressed_kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
    k_pass = self.kv_a_layernorm(kv_pass).view(B, 1, S, self.kv_lora_rank)
    k_rot = k_rot.view(B, 1, S, self.qk_rope_head_dim)
    cos, sin = position_embeddings
    q_rot, k_rot = state["rope"](q_rot, k_rot, cos, sin)
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
    out = self.o_proj(latent_attention(self, q_pass, q_rot, k_pass, k_rot, rows, state["method"]))
    return (out, None, topk) if state["family"] == "glm_moe_dsa" else (out, None)


def _find_attention(model: torch.nn.Module) -> tuple[str, dict[str, torch.nn.Module]]:
    wanted = {cls: fam for fam, cls in SUPPORTED.items()}
    later = {cls: (fam, why) for fam, (cls, why) in NOT_IMPLEMENTED.items()}
    found: dict[str, torch.nn.Module] = {}
    families = set()
    for name, module in model.named_modules():
        cls = type(module).__name__
        if cls in later and type(module).__module__.startswith("transformers."):
            raise NotImplementedError(f"sparse_mla.integration.transformers does not serve {later[cls][1]} yet: "
                                      f"{name} is a {cls}; supported: DeepseekV32, GlmMoeDsa")
        if cls in wanted and type(module).__module__.startswith("transformers."):
            found[name] = module
            families.add(wanted[cls])
    if not found:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        raise ValueError(f"no DSA attention module to serve in {type(model).__name__} (model_type {model_type!r}): "
                         f"sparse_mla.integration.transformers serves DeepseekV32 and GlmMoeDsa models")
    if len(families) > 1:
        raise ValueError(f"one model family at a time, found {sorted(families)}")
    return families.pop(), found


def _check_module(name: str, module: torch.nn.Module, family: str) -> None:
    missing = [a for a in _ATTRS if not hasattr(module, a)]
    if family == "glm_moe_dsa" and not hasattr(module, "skip_topk"):
        missing.append("skip_topk")
    if not hasattr(module, "indexer"):
        missing.append("indexer")
    if missing:
        raise ValueError(f"{name} ({type(module).__name__}) lacks {missing}: not the transformers 5.23 layout this "
                         "integration replicates")
    if module.kv_lora_rank != KV_LORA_RANK or module.qk_rope_head_dim != ROPE_DIM:
        raise ValueError(f"{name}: kv_lora_rank {module.kv_lora_rank}, qk_rope_head_dim {module.qk_rope_head_dim}; "
                         f"the op serves latent rows of {KV_LORA_RANK} + {ROPE_DIM} (D_qk 576)")
    if module.qk_head_dim != module.qk_nope_head_dim + module.qk_rope_head_dim:
        raise ValueError(f"{name}: qk_head_dim {module.qk_head_dim} != qk_nope + qk_rope")
    w = getattr(module.kv_b_proj, "weight", None)
    rows = module.num_heads * (module.qk_nope_head_dim + module.v_head_dim)
    if not isinstance(w, torch.Tensor) or tuple(w.shape) != (rows, KV_LORA_RANK) or \
            getattr(module.kv_b_proj, "bias", None) is not None:
        raise ValueError(f"{name}: kv_b_proj must be a plain linear map {KV_LORA_RANK} -> {rows} without bias (W_UK / "
                         f"W_UV are read from its weight), got {type(module.kv_b_proj).__name__}"
                         f"{'' if w is None else ' ' + str(tuple(w.shape))}")
    if w.dtype not in DTYPES:
        raise TypeError(f"{name}: weights are {w.dtype}; the op runs bf16 or fp16 (fp16 on the CPU interpreter): "
                        "cast the model first, e.g. model.to(torch.bfloat16)")
    scaling = module.scaling
    if not isinstance(scaling, (int, float)) or isinstance(scaling, bool) or not scaling > 0:
        raise ValueError(f"{name}: softmax scale {scaling!r} is not a positive float")
    if _rope(module) is None:
        raise ValueError(f"{name}: {type(module).__module__} has no apply_rotary_pos_emb_interleave: a rope layout "
                         "this integration does not replicate")


def _rope(module: torch.nn.Module):
    return getattr(sys.modules.get(type(module).__module__), "apply_rotary_pos_emb_interleave", None)


def _patch(module: torch.nn.Module, family: str, method: str) -> None:
    if _STATE in module.__dict__:
        module.__dict__[_STATE]["method"] = method
        return
    # accelerate's hooks wrap an instance-level forward around `_old_forward`: replace the wrapped one
    attr = "_old_forward" if hasattr(module, "_hf_hook") and "_old_forward" in module.__dict__ else "forward"
    module.__dict__[_STATE] = {"family": family, "method": method, "rope": _rope(module), "attr": attr,
                               "saved": module.__dict__.get(attr)}
    setattr(module, attr, types.MethodType(_dsa_forward, module))


def _restore(module: torch.nn.Module) -> None:
    state = module.__dict__.pop(_STATE, None)
    if state is None:
        return
    if state["saved"] is None:
        module.__dict__.pop(state["attr"], None)
    else:
        setattr(module, state["attr"], state["saved"])


__all__ = ["apply", "undo", "is_applied", "Patched", "latent_rows", "latent_attention", "SUPPORTED", "NOT_IMPLEMENTED"]
