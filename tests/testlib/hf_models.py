"""Tiny transformers DSA models (DeepseekV32, GlmMoeDsa) with the real attention head dims, and the probes that run
one attention layer on captured inputs with the indexer's top-k fixed (tests/integration/test_transformers.py).

Import after ``pytest.importorskip("transformers")``: transformers is imported here at module level."""

from __future__ import annotations

import copy

import torch
import transformers

# The real head dims (kv_lora_rank 512, qk_rope 64, qk_nope 128, v 128, 16 heads, index_topk 64), tiny elsewhere.
# first_k_dense_replace = num_hidden_layers: dense MLPs only. An MoE router is a discrete choice that an fp16
# rounding difference flips for a token now and then (seen: one token's logits off by 2.6e-2 at init 0.1), which
# would make whole-model comparisons measure the router instead of the attention.
HEAD_DIMS = dict(num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=32, qk_rope_head_dim=64,
                 qk_nope_head_dim=128, v_head_dim=128, index_topk=64, index_head_dim=64, index_n_heads=4)
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=3,
            first_k_dense_replace=3, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
            max_position_embeddings=4096, eos_token_id=None, pad_token_id=0, bos_token_id=None)
# DeepSeek-V3.2's YaRN (factor 40 there): the module's scaling is 192^-0.5 * mscale^2
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
FAMILIES = {
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", {"rope_parameters": YARN}),
    # GLM-5: layer 1 reuses layer 0's top-k, layer 2 runs its own indexer
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", {"indexer_types": ["full", "shared", "full"]}),
}


def tiny_config(family: str, **overrides):
    config_cls, _, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**HEAD_DIMS, **TINY, **extra, **overrides})
    config._attn_implementation = "eager"
    return config


def tiny_models(family: str, device, dtype, seed: int = 0, **overrides):
    """(fp32 model, the same weights in ``dtype``), eval mode, on ``device``."""
    torch.manual_seed(seed)
    model_cls = getattr(transformers, FAMILIES[family][1])
    ref = model_cls(tiny_config(family, **overrides)).eval().to(device)
    return ref, copy.deepcopy(ref).to(dtype)


def capture_layer_inputs(model, **inputs) -> list[dict]:
    """One eager run: per layer, the attention module's call kwargs and the top-k it used (its indexer's output,
    or the previous layer's on a shared layer)."""
    layers = model.model.layers
    caps: list[dict] = [{} for _ in layers]
    hooks = []
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        hooks.append(attn.register_forward_pre_hook(
            lambda m, args, kw, i=i: caps[i].update(kw=dict(kw)), with_kwargs=True))
        if attn.indexer is not None:
            hooks.append(attn.indexer.register_forward_hook(lambda m, args, out, i=i: caps[i].update(topk=out)))
    try:
        with torch.no_grad():
            model(**inputs, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    for cap in caps:
        cap["kw"].pop("past_key_values", None)
        if "topk" not in cap:
            cap["topk"] = cap["kw"]["prev_topk_indices"]
    return caps


def cast_floats(kw: dict, dtype, device=None) -> dict:
    """The kwargs with every floating tensor (and tuple of tensors) cast to ``dtype``."""
    def cast(v):
        if isinstance(v, torch.Tensor):
            return v.to(device=device or v.device, dtype=dtype if v.is_floating_point() else v.dtype)
        if isinstance(v, tuple):
            return tuple(cast(x) for x in v)
        return v
    return {k: cast(v) for k, v in kw.items()}


def attention_rows(attn, kw: dict, topk: torch.Tensor) -> torch.Tensor:
    """The attention module's per-head values before o_proj, [B, S, H, v_head_dim], for the captured kwargs with
    its indexer (if any) returning ``topk``: both sides of a comparison then see the same top-k."""
    got = {}
    hook = attn.o_proj.register_forward_pre_hook(lambda m, args: got.update(x=args[0]))
    if attn.indexer is not None:
        attn.indexer.forward = lambda *a, **k: topk
    try:
        with torch.no_grad():
            attn(**kw)
    finally:
        hook.remove()
        if attn.indexer is not None:
            del attn.indexer.forward
    x = got["x"]
    return x.view(*x.shape[:2], attn.num_heads, attn.v_head_dim)


def logits_distance(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.float(), ref.float()
    return float((x - ref).norm() / ref.norm())
