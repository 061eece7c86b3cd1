"""transformers' DSA models (DeepseekV32, GlmMoeDsa) on sparse-mla (``sparse_mla.integration.transformers``), checked
against transformers' own eager attention on tiny random models with the real head dims (testlib.hf_models).

CPU: fp16 through the Triton interpreter, eager fp32 as the reference; the cuda-bf16 variants (marked gpu) run the
same checks in bf16. Small indexers tie often, so the per-layer test feeds both sides the same top-k."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.23")

from testlib.device import DEVICE, DTYPE, HAS_CUDA, cpu_only  # noqa: E402
from testlib.hf_models import (  # noqa: E402
    attention_rows,
    capture_layer_inputs,
    cast_floats,
    logits_distance,
    tiny_config,
    tiny_models,
)
from testlib.paths import REPO  # noqa: E402
from testlib.tolerances import LAYER_ROW_TOLERANCE, row_rel_errors  # noqa: E402

from sparse_mla.integration import transformers as sparse_hf  # noqa: E402

ENVS = [
    pytest.param(("cpu", torch.float16), marks=cpu_only("fp16 through the Triton interpreter"), id="cpu-fp16"),
    pytest.param(("cuda", torch.bfloat16), id="cuda-bf16",
                 marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="bf16 kernels need a CUDA GPU")]),
]
FAMILIES = ["deepseek_v32", "glm_moe_dsa"]
SEQ = 80  # > index_topk 64: the last 16 queries' top-k drops rows; the first ones' lists hold future positions


@pytest.fixture(params=ENVS)
def env(request):
    return request.param


@contextlib.contextmanager
def patched(model, **kwargs):
    """``sparse_hf.apply(model)`` for the body, during which transformers' eager attention raises if it runs (the
    patched forward must never reach it)."""
    def refuse(*args, **kwargs):
        raise AssertionError("transformers' eager attention ran")

    with pytest.MonkeyPatch.context() as mp, sparse_hf.apply(model, **kwargs) as handle:
        for mod in FAMILIES:
            mp.setattr(f"transformers.models.{mod}.modeling_{mod}.eager_attention_forward", refuse)
        yield handle


def _ids(n: int, batch: int = 1, seed: int = 1, device="cpu") -> torch.Tensor:
    return torch.randint(1, 128, (batch, n), generator=torch.Generator().manual_seed(seed)).to(device)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_layer_matches_eager_per_row(family, env):
    """Every layer's per-(token, head) values before o_proj, fed the same inputs and the same top-k (a shared GLM-5
    layer: the previous layer's), against eager fp32: within the layer row tolerance, and no worse than twice eager's
    own error in the same dtype."""
    device, dtype = env
    ref_model, model = tiny_models(family, device, dtype)
    ids = _ids(SEQ, device=device)
    caps = capture_layer_inputs(model, input_ids=ids)
    rows = sparse_hf.latent_rows(caps[0]["topk"], caps[0]["kw"]["attention_mask"], SEQ)
    assert (rows < 0).any() and bool((rows >= 0).all(dim=1)[-1])  # future positions dropped; late rows full
    assert caps[0]["topk"].shape[-1] == 64 < SEQ  # late queries see more rows than their top-k
    for i, cap in enumerate(caps):
        attn, attn32 = model.model.layers[i].self_attn, ref_model.model.layers[i].self_attn
        assert (attn.indexer is None) == (family == "glm_moe_dsa" and i == 1)
        ref = attention_rows(attn32, cast_floats(cap["kw"], torch.float32), cap["topk"])
        eager = attention_rows(attn, cap["kw"], cap["topk"])
        with patched(model):
            ours = attention_rows(attn, cap["kw"], cap["topk"])
        err, eager_err = row_rel_errors(ours, ref), row_rel_errors(eager, ref)
        assert float(err.max()) <= LAYER_ROW_TOLERANCE[dtype], (i, float(err.max()))
        assert float(err.max()) <= 2 * float(eager_err.max()), (i, float(err.max()), float(eager_err.max()))


@pytest.mark.parametrize("family, attn", [("deepseek_v32", "eager"), ("glm_moe_dsa", "eager"), ("deepseek_v32", "sdpa")])
def test_model_logits_within_eager_error(family, attn, env):
    """The whole model's logits after apply: no further from eager fp32 than twice eager's own distance in the same
    dtype (DeepseekV32 with YaRN: the module's scaling carries mscale^2; GLM-5 with a shared indexer layer; a model
    set to sdpa, whose mask is bool rather than additive)."""
    device, dtype = env
    ref_model, model = tiny_models(family, device, dtype)
    model.set_attn_implementation(attn)
    ids = _ids(SEQ, device=device)
    with torch.no_grad():
        ref = ref_model(ids).logits
        with patched(model):
            ours = model(ids).logits
    if family == "deepseek_v32":
        layer0 = model.model.layers[0].self_attn
        assert layer0.scaling > layer0.qk_head_dim ** -0.5 * 1.1  # YaRN's mscale^2 is in the scale the op got
    with torch.no_grad():
        eager = model(ids).logits  # undone: eager again
    assert torch.isfinite(ours).all()
    assert logits_distance(ours, ref) <= 2 * logits_distance(eager, ref)


def _greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, ids.shape[1]:].tolist(), out.logits


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_eager(family, env):
    """16 greedy tokens with transformers' cache (a 60-token prompt: the decode steps cross index_topk) are eager's
    tokens. A larger init (0.2) makes the tiny model's tokens vary. Should the two ever part, it must be at a tie:
    eager fp32's logits of the two tokens closer than 4x eager's own logit error at that step. (No per-step logits
    bound here: at one step of this run eager fp16's indexer picks 2 rows other than eager fp32's and ours, a tie
    that moves eager fp16's logits by 6e-2; test_cached_prefill_chunk_and_decode bounds the logits of cached steps.)"""
    device, dtype = env
    ref_model, model = tiny_models(family, device, dtype, initializer_range=0.2)
    ids = _ids(60, seed=2, device=device)
    eager_tokens, eager_logits = _greedy(model, ids, 16)
    with patched(model):
        tokens, _ = _greedy(model, ids, 16)
    assert len(set(eager_tokens)) >= 4, eager_tokens  # not a constant sequence
    for step, (a, b) in enumerate(zip(tokens, eager_tokens)):
        if a != b:
            prefix = torch.cat([ids, torch.tensor([tokens[:step]], device=device, dtype=ids.dtype)], dim=1)
            with torch.no_grad():
                ref = ref_model(prefix).logits[0, -1]
            gap, own = float((ref[a] - ref[b]).abs()), float((eager_logits[step][0].float() - ref).abs().max())
            assert gap <= 4 * own, (step, tokens, eager_tokens, gap, own)
            break


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", FAMILIES)
def test_cached_prefill_chunk_and_decode(family, cache, env):
    """A cached prefill (50), a chunk (24: queries over cached + new rows, past index_topk) and 3 decode steps through
    transformers' DynamicCache / StaticCache: each step's logits within twice eager's own distance from eager fp32,
    and the cache holds what eager writes (the latents c_kv / k_pe and the indexer keys, bit for bit, layer 0)."""
    device, dtype = env
    ref_model, model = tiny_models(family, device, dtype)
    ids = _ids(77, device=device)
    steps = [(0, 50), (50, 74), (74, 75), (75, 76), (76, 77)]

    def run(m, patch):
        c = transformers.DynamicCache(config=m.config) if cache == "dynamic" else \
            transformers.StaticCache(config=m.config, max_cache_len=96)
        with torch.no_grad(), (patched(m) if patch else contextlib.nullcontext()):
            return [m(ids[:, a:b], past_key_values=c, use_cache=True).logits for a, b in steps], c

    ref, _ = run(ref_model, False)
    eager, eager_cache = run(model, False)
    ours, our_cache = run(model, True)
    for i, (x, e, r) in enumerate(zip(ours, eager, ref)):
        assert torch.isfinite(x).all()
        assert logits_distance(x, r) <= 2 * logits_distance(e, r) + 1e-4, i
    mine, theirs = our_cache.layers[0], eager_cache.layers[0]
    assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
    assert torch.equal(mine.indexer_keys, theirs.indexer_keys)
    assert our_cache.get_seq_length() == 77


def test_left_padding_gives_zero_not_nan(env):
    """Batch 2, the second prompt left-padded by 9 with its attention mask: padded queries (no valid row) get 0,
    never NaN; the real positions' logits are within twice eager's own distance from eager fp32; greedy decoding of
    the padded batch is eager's."""
    device, dtype = env
    ref_model, model = tiny_models("deepseek_v32", device, dtype)
    ids = _ids(SEQ, batch=2, device=device)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    ids[1, :9] = 0
    attn = model.model.layers[0].self_attn
    got = {}
    hook = attn.o_proj.register_forward_pre_hook(lambda m, args: got.update(x=args[0]))
    with torch.no_grad():
        ref = ref_model(ids, attention_mask=mask).logits
        eager = model(ids, attention_mask=mask).logits
        with patched(model):
            ours = model(ids, attention_mask=mask).logits
    hook.remove()
    assert torch.isfinite(ours).all() and torch.isfinite(got["x"]).all()
    assert bool((got["x"][1, :9] == 0).all()) and bool((got["x"][1, 9:].abs().amax(-1) > 0).all())
    valid = mask.bool()
    assert logits_distance(ours[valid], ref[valid]) <= 2 * logits_distance(eager[valid], ref[valid])
    gen = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    with torch.no_grad():
        eager_tokens = model.generate(ids, **gen)
        with patched(model):
            tokens = model.generate(ids, **gen)
    assert torch.equal(tokens, eager_tokens)


def test_shared_indexer_layers_reuse_the_previous_top_k():
    """GLM-5: a "shared" layer has no indexer; patched, it attends over the previous layer's top-k and hands it on,
    as eager does, and without one it raises eager's error."""
    _, model = tiny_models("glm_moe_dsa", DEVICE, DTYPE)
    seen = []
    hooks = [layer.self_attn.register_forward_hook(lambda m, a, out: seen.append(out[2])) for layer in model.model.layers]
    with torch.no_grad(), sparse_hf.apply(model):
        model(_ids(SEQ, device=DEVICE))
        x = torch.zeros(1, 4, 64, dtype=DTYPE, device=DEVICE)
        kw = dict(hidden_states=x, position_embeddings=model.model.rotary_emb(x, torch.arange(4, device=DEVICE)[None]),
                  attention_mask=torch.zeros(1, 1, 4, 4, dtype=DTYPE, device=DEVICE))
        with pytest.raises(ValueError, match="previous full indexer layer"):
            model.model.layers[1].self_attn(**kw)
    for h in hooks:
        h.remove()
    assert torch.equal(seen[1], seen[0]) and not torch.equal(seen[2], seen[0])


def test_undo_restores_eager():
    """undo (the handle, the context manager or ``undo(model)``) puts transformers' forward back: the same logits,
    bit for bit; applying twice leaves one patch."""
    _, model = tiny_models("deepseek_v32", "cpu", torch.float16)
    ids = _ids(20)
    with torch.no_grad():
        before = model(ids).logits
        handle = sparse_hf.apply(model)
        assert sparse_hf.is_applied(model) and len(handle.modules) == 3
        assert sparse_hf.apply(model, method="per_token").modules.keys() == handle.modules.keys()
        handle.undo()
        assert not sparse_hf.is_applied(model)
        assert all("forward" not in layer.self_attn.__dict__ for layer in model.model.layers)
        assert torch.equal(model(ids).logits, before)
        sparse_hf.apply(model)
        assert sparse_hf.undo(model) == 3 and sparse_hf.undo(model) == 0
        assert torch.equal(model(ids).logits, before)


def test_clear_errors():
    """A model or setting it cannot serve raises before anything is patched, naming why."""
    _, model = tiny_models("deepseek_v32", "cpu", torch.float16)
    with pytest.raises(TypeError, match="float32"):
        sparse_hf.apply(model.float())
    assert not sparse_hf.is_applied(model)
    model.half()
    with pytest.raises(ValueError, match="method"):
        sparse_hf.apply(model, method="dense")
    with sparse_hf.apply(model), pytest.raises(RuntimeError, match="inference only"):
        model(_ids(8))  # gradients enabled
    cfg = tiny_config("deepseek_v32", kv_lora_rank=256)
    with pytest.raises(ValueError, match="kv_lora_rank 256"):
        sparse_hf.apply(transformers.DeepseekV32ForCausalLM(cfg).half())
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)).half()
    with pytest.raises(ValueError, match="no DSA attention module.*LlamaForCausalLM"):
        sparse_hf.apply(llama)
    v4 = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(
        vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=64,
        q_lora_rank=16, intermediate_size=32, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2))
    with pytest.raises(NotImplementedError, match="DeepseekV4"):
        sparse_hf.apply(v4.half())
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel

    g5 = Glm5NextTextModel(transformers.Glm5NextTextConfig(
        vocab_size=64, pad_token_id=0, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=16, intermediate_size=32, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        layer_types=["linear_attention", "indexed_attention"]))
    with pytest.raises(NotImplementedError, match="Glm5Next"):
        sparse_hf.apply(g5.half())


def test_latent_rows_follow_the_mask():
    """latent_rows: bool and additive masks, batch offsets b * T, out-of-range positions, a fully masked query."""
    topk = torch.tensor([[[0, 1, 2]], [[2, 0, 5]]], dtype=torch.int32)  # [B=2, S=1, K=3], T = 3
    allowed = torch.tensor([[[[True, True, False]]], [[[False, True, True]]]])
    expect = torch.tensor([[0, 1, -1], [5, -1, -1]], dtype=torch.int32)
    assert torch.equal(sparse_hf.latent_rows(topk, allowed, 3), expect)
    additive = torch.zeros(2, 1, 1, 3, dtype=torch.float16).masked_fill(~allowed, torch.finfo(torch.float16).min)
    assert torch.equal(sparse_hf.latent_rows(topk, additive, 3), expect)
    assert bool((sparse_hf.latent_rows(topk, torch.zeros_like(allowed), 3) == -1).all())
    with pytest.raises(ValueError, match="does not match"):
        sparse_hf.latent_rows(topk, allowed, 4)


def test_import_does_not_import_transformers():
    """The module imports transformers on first use only (the core install has no transformers)."""
    code = "import sys, sparse_mla.integration.transformers; assert 'transformers' not in sys.modules, 'imported'"
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
