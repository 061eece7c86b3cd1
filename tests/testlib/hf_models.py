"""Tiny transformers DSA models (DeepseekV32, GlmMoeDsa, Glm5Next, DeepseekV4) with the real attention head dims, and
the probes that run one attention layer on captured inputs with the indexer's top-k fixed
(tests/integration/test_transformers.py).

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
# Glm5Next (GLM-5.3-Flash), the NoPE layout: kv_lora_rank 512, qk_nope 256, qk_rope 0, v 256 (D_qk 512), 16 heads;
# index_topk 32 in pools of 16 keys (2 pools + the incomplete tail pool, 47 entries: at 64, 80-token prompts of these
# seeds always picked each query's own pool); a linear-attention (KDA) layer, then a full and a shared indexer layer;
# dense MLPs. Its vision tower is one tiny block (text-only prompts never run it).
GLM5_NEXT_TEXT = dict(vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                      num_hidden_layers=3, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512,
                      q_lora_rank=32, qk_rope_head_dim=0, qk_nope_head_dim=256, v_head_dim=256, index_topk=32,
                      index_kpool=16, index_head_dim=64, index_n_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                      mlp_layer_types=["dense"] * 3, layer_types=["linear_attention", "indexed_attention",
                                                               "indexed_attention"],
                      indexer_types=["full", "full", "shared"], linear_num_heads=2, linear_head_dim=32,
                      max_position_embeddings=4096, pad_token_id=0, eos_token_id=None, bos_token_id=None)
GLM5_NEXT_VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64,
                        projection_intermediate_size=32)
# DeepseekV4: one shared K = V head of 512 (rope on its last 64), 16 heads, sink per head; a CSA layer (compress 4,
# index_topk 8 of the compressed rows; first, so that its cache state is compared bit for bit), an HCA layer
# (compress 16 here, 128 in the model) and a sliding layer; a 32-row window; hash-routed MoE only (routing by token
# id: no router to flip in fp16).
DEEPSEEK_V4 = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=16, num_key_value_heads=1,
                   head_dim=512, q_lora_rank=32, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                   layer_types=["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"],
                   compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
                   mlp_layer_types=["hash_moe"] * 3, sliding_window=32, o_groups=4, o_lora_rank=16, index_n_heads=4,
                   index_head_dim=64, index_topk=8, max_position_embeddings=4096, pad_token_id=0, eos_token_id=None,
                   bos_token_id=None)
MODEL_CLASSES = {**{f: cls for f, (_, cls, _) in FAMILIES.items()},
                 "glm5_next": "Glm5NextForConditionalGeneration", "deepseek_v4": "DeepseekV4ForCausalLM"}


def tiny_config(family: str, **overrides):
    if family == "glm5_next":
        config = transformers.Glm5NextConfig(text_config={**GLM5_NEXT_TEXT, **overrides},
                                             vision_config=GLM5_NEXT_VISION)
    elif family == "deepseek_v4":
        config = transformers.DeepseekV4Config(**{**DEEPSEEK_V4, **overrides})
    else:
        config_cls, _, extra = FAMILIES[family]
        config = getattr(transformers, config_cls)(**{**HEAD_DIMS, **TINY, **extra, **overrides})
    config._attn_implementation = "eager"
    return config


def tiny_models(family: str, device, dtype, seed: int = 0, **overrides):
    """(fp32 model, the same weights in ``dtype``), eval mode, on ``device``. DeepseekV4's sinks (0 at init) are
    drawn from N(0, 1), so that they count."""
    torch.manual_seed(seed)
    model_cls = getattr(transformers, MODEL_CLASSES[family])
    ref = model_cls(tiny_config(family, **overrides)).eval().to(device)
    if family == "deepseek_v4":
        with torch.no_grad():
            for attn in attention_modules(ref):
                attn.sinks.normal_()
    return ref, copy.deepcopy(ref).to(dtype)


def decoder_layers(model):
    inner = model.model
    return getattr(inner, "language_model", inner).layers


def attention_modules(model) -> list:
    """The DSA attention modules, in layer order (Glm5Next's linear-attention layers left out)."""
    return [layer.self_attn for layer in decoder_layers(model)
            if type(layer.self_attn).__name__ in ("DeepseekV32Attention", "GlmMoeDsaAttention", "Glm5NextTextAttention",
                                                  "DeepseekV4Attention")]


def indexer(attn):
    """The module whose output is the layer's top-k: the DSA indexer, V4's CSA indexer (inside the compressor), or
    None (a shared layer, V4's sliding and HCA layers)."""
    if hasattr(attn, "indexer"):
        return attn.indexer
    return getattr(getattr(attn, "compressor", None), "indexer", None)


def capture_layer_inputs(model, **inputs) -> list[dict]:
    """One eager run: per DSA attention module (``attention_modules``), its call kwargs and the top-k it used (its
    indexer's output, or the previous layer's on a shared layer; None without one)."""
    attns = attention_modules(model)
    caps: list[dict] = [{} for _ in attns]
    hooks = []
    for i, attn in enumerate(attns):
        hooks.append(attn.register_forward_pre_hook(
            lambda m, args, kw, i=i: caps[i].update(kw={**dict(zip(["hidden_states"], args)), **kw}), with_kwargs=True))
        if indexer(attn) is not None:
            hooks.append(indexer(attn).register_forward_hook(lambda m, args, out, i=i: caps[i].update(topk=out)))
    try:
        with torch.no_grad():
            model(**inputs, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    for cap in caps:
        cap["kw"].pop("past_key_values", None)
        if "topk" not in cap:
            cap["topk"] = cap["kw"].get("prev_topk_indices")
    return caps


def cast_floats(kw: dict, dtype, device=None) -> dict:
    """The kwargs with every floating tensor (and tuple or dict of tensors) cast to ``dtype``."""
    def cast(v):
        if isinstance(v, torch.Tensor):
            return v.to(device=device or v.device, dtype=dtype if v.is_floating_point() else v.dtype)
        if isinstance(v, tuple):
            return tuple(cast(x) for x in v)
        if isinstance(v, dict):
            return {k: cast(x) for k, x in v.items()}
        return v
    return {k: cast(v) for k, v in kw.items()}


def attention_rows(attn, kw: dict, topk: torch.Tensor | None) -> torch.Tensor:
    """The attention module's per-head values before its output projection, [B, S, H, v_head_dim] (V4: after the
    rope slice is rotated back, before ``o_a_proj``), for the captured kwargs with its indexer (if any) returning
    ``topk``: both sides of a comparison then see the same top-k."""
    got = {}
    proj = attn.o_proj if hasattr(attn, "o_proj") else attn.o_a_proj
    hook = proj.register_forward_pre_hook(lambda m, args: got.update(x=args[0]))
    idx = indexer(attn)
    if idx is not None:
        idx.forward = lambda *a, **k: topk
    try:
        with torch.no_grad():
            attn(**kw)
    finally:
        hook.remove()
        if idx is not None:
            del idx.forward
    x = got["x"]
    return x.reshape(*x.shape[:2], attn.num_heads, getattr(attn, "v_head_dim", getattr(attn, "head_dim", None)))


def logits_distance(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.float(), ref.float()
    return float((x - ref).norm() / ref.norm())
