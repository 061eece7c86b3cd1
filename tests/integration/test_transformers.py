"""transformers' DSA models (DeepseekV32, GlmMoeDsa, Glm5Next, DeepseekV4) on sparse-mla
(``sparse_mla.integration.transformers``), checked against transformers' own eager attention on tiny random models
with the real head dims (testlib.hf_models).

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
    attention_modules,
    attention_rows,
    capture_layer_inputs,
    cast_floats,
    indexer,
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
FAMILIES = ["deepseek_v32", "glm_moe_dsa", "glm5_next", "deepseek_v4"]
# > index_topk (64; Glm5Next: 32 in 2 pools + a tail): the late queries' top-k drops rows; the first ones' lists hold
# future positions (V32 / GLM-5) or -1 (Glm5Next); DeepseekV4: > its 32-row window, 20 CSA rows (8 picked), 5 HCA rows
SEQ = 80


@pytest.fixture(params=ENVS)
def env(request):
    return request.param


@contextlib.contextmanager
def patched(model, **kwargs):
    """``sparse_hf.apply(model)`` for the body, during which transformers' attention functions (eager and any other
    implementation of the attention interface) raise if they run (the patched forward must never reach them)."""
    def refuse(*args, **kwargs):
        raise AssertionError("transformers' eager attention ran")

    class Refused:
        def get_interface(self, *args, **kwargs):
            raise AssertionError("transformers' attention interface was asked for an attention function")

    with pytest.MonkeyPatch.context() as mp, sparse_hf.apply(model, **kwargs) as handle:
        for mod in FAMILIES:
            mp.setattr(f"transformers.models.{mod}.modeling_{mod}.eager_attention_forward", refuse)
            mp.setattr(f"transformers.models.{mod}.modeling_{mod}.ALL_ATTENTION_FUNCTIONS", Refused())
        yield handle


def _ids(n: int, batch: int = 1, seed: int = 1, device="cpu") -> torch.Tensor:
    return torch.randint(1, 128, (batch, n), generator=torch.Generator().manual_seed(seed)).to(device)


def _check_top_k(family: str, caps: list[dict], device) -> None:
    """What the first indexed layer's top-k holds, and that its conversion keeps what eager's mask keeps."""
    if family in ("deepseek_v32", "glm_moe_dsa"):
        rows = sparse_hf.latent_rows(caps[0]["topk"], caps[0]["kw"]["attention_mask"], SEQ)
        assert (rows < 0).any() and bool((rows >= 0).all(dim=1)[-1])  # future positions dropped; late rows full
        assert caps[0]["topk"].shape[-1] == 64 < SEQ  # late queries see more rows than their top-k
    elif family == "glm5_next":
        topk = caps[0]["topk"]
        assert topk.shape[-1] == 32 + 16 - 1  # index_topk + index_kpool - 1, -1 padded
        rows = sparse_hf.topk_rows(topk, SEQ, caps[0]["kw"]["attention_mask"])
        counts = (rows >= 0).sum(1)
        assert int(counts[0]) == 1 and int(counts[-1]) == 32 < SEQ  # the first query: its tail; the last: 2 pools
        own = (rows.cpu().long() == torch.arange(SEQ).view(-1, 1)).any(1)
        assert not bool(own.all()) or device == "cuda"  # a query's own token is not always in its list (fp16 picks)
    else:  # DeepseekV4: CSA layer 0's indexer picks 8 of the compressed rows a query may see, -1 for the early ones
        topk = caps[0]["topk"]
        assert topk.shape[-1] == 8 and bool((topk[0, :35] < 0).any()) and bool((topk[0, 35:] >= 0).all())


@pytest.mark.parametrize("family", FAMILIES)
def test_each_layer_matches_eager_per_row(family, env):
    """Every layer's per-(token, head) values before the output projection, fed the same inputs and the same top-k (a
    shared GLM-5 / Glm5Next layer: the previous layer's), against eager fp32: within the layer row tolerance, and no
    worse than twice eager's own error in the same dtype. DeepseekV4: its sliding, CSA and HCA layers, values after
    the rope slice is rotated back, sinks drawn from N(0, 1) (a dropped sink moves the rows by 2e-2, median)."""
    device, dtype = env
    ref_model, model = tiny_models(family, device, dtype)
    ids = _ids(SEQ, device=device)
    caps = capture_layer_inputs(model, input_ids=ids)
    _check_top_k(family, caps, device)
    attns, attns32 = attention_modules(model), attention_modules(ref_model)
    for i, cap in enumerate(caps):
        attn, attn32 = attns[i], attns32[i]
        if family in ("glm_moe_dsa", "glm5_next"):
            assert (indexer(attn) is None) == (i == 1)  # the shared layer
        ref = attention_rows(attn32, cast_floats(cap["kw"], torch.float32), cap["topk"])
        eager = attention_rows(attn, cap["kw"], cap["topk"])
        with patched(model):
            ours = attention_rows(attn, cap["kw"], cap["topk"])
        err, eager_err = row_rel_errors(ours, ref), row_rel_errors(eager, ref)
        assert float(err.max()) <= LAYER_ROW_TOLERANCE[dtype], (i, float(err.max()))
        assert float(err.max()) <= 2 * float(eager_err.max()), (i, float(err.max()), float(eager_err.max()))


@pytest.mark.parametrize("family, attn", [("deepseek_v32", "eager"), ("glm_moe_dsa", "eager"), ("deepseek_v32", "sdpa"),
                                          ("glm5_next", "eager"), ("deepseek_v4", "eager")])
def test_model_logits_within_eager_error(family, attn, env):
    """The whole model's logits after apply: no further from eager fp32 than twice eager's own distance in the same
    dtype (DeepseekV32 with YaRN: the module's scaling carries mscale^2; GLM-5 with a shared indexer layer; a model
    set to sdpa, whose mask is bool rather than additive; Glm5Next with its linear-attention, full and shared layers;
    DeepseekV4 with its sliding, CSA and HCA layers)."""
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
    tokens. A larger init (0.2; DeepseekV4: 0.5, its tokens repeat at 0.2) makes the tiny model's tokens vary. Should
    the two ever part, it must be at a tie: eager fp32's logits of the two tokens closer than 4x eager's own logit
    error at that step. (No per-step logits bound here: at one step of the DeepseekV32 run eager fp16's indexer picks
    2 rows other than eager fp32's and ours, a tie that moves eager fp16's logits by 6e-2;
    test_cached_prefill_chunk_and_decode bounds the logits of cached steps.)"""
    device, dtype = env
    ref_model, model = tiny_models(family, device, dtype, initializer_range=0.5 if family == "deepseek_v4" else 0.2)
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


def _same_cache(family: str, mine, theirs) -> None:
    """The first attention layer's cache (its inputs are eager's: Glm5Next's layer 0 is linear attention) holds what
    eager writes, bit for bit: the latents c_kv / k_pe (Glm5Next: a 0-wide k_pe) and the indexer keys; DeepseekV4's
    CSA layer: the window rows and the compressor's and indexer's compressed rows."""
    i = 1 if family == "glm5_next" else 0
    a, b = mine.layers[i], theirs.layers[i]
    assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    if family == "deepseek_v4":
        for name in ("compressor", "indexer"):
            assert a.compressed_kv[name].shape[1] == 77 // 4 and torch.equal(a.compressed_kv[name], b.compressed_kv[name])
    else:
        assert torch.equal(a.indexer_keys, b.indexer_keys)
    assert a.get_seq_length() == b.get_seq_length() == 77


@pytest.mark.parametrize("family, cache", [(f, c) for f in FAMILIES for c in ("dynamic", "static")
                                           if (f, c) != ("deepseek_v4", "static")])
def test_cached_prefill_chunk_and_decode(family, cache, env):
    """A cached prefill (50), a chunk (24: queries over cached + new rows, past index_topk; DeepseekV4: past its
    32-row window, over compressed rows of both calls) and 3 decode steps (V4: the first closes a CSA window) through
    transformers' DynamicCache / StaticCache (V4: dynamic only, its compressor states need its own cache layers):
    each step's logits within twice eager's own distance from eager fp32, and the cache holds what eager writes
    (``_same_cache``)."""
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
    _same_cache(family, our_cache, eager_cache)


@pytest.mark.parametrize("family", ["deepseek_v32", "glm5_next", "deepseek_v4"])
def test_left_padding_gives_zero_not_nan(family, env):
    """Batch 2, the second prompt left-padded by 9 with its attention mask: padded queries (no valid row) get 0,
    never NaN (DeepseekV4: in its sliding layer; in CSA / HCA layers a padded query may see compressed rows of
    padding, as in eager); the real positions' logits are within twice eager's own distance from eager fp32; greedy
    decoding of the padded batch is eager's."""
    device, dtype = env
    ref_model, model = tiny_models(family, device, dtype)
    ids = _ids(SEQ, batch=2, device=device)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    ids[1, :9] = 0
    attn = attention_modules(model)[-1 if family == "deepseek_v4" else 0]
    got = {}
    proj = attn.o_proj if hasattr(attn, "o_proj") else attn.o_a_proj
    hook = proj.register_forward_pre_hook(lambda m, args: got.update(x=args[0]))
    with torch.no_grad():
        ref = ref_model(ids, attention_mask=mask).logits
        eager = model(ids, attention_mask=mask).logits
        with patched(model):
            ours = model(ids, attention_mask=mask).logits
    hook.remove()
    assert torch.isfinite(ours).all() and torch.isfinite(got["x"]).all()
    assert bool((got["x"][1, :9] == 0).all()) and bool((got["x"][1, 9:].flatten(1).abs().amax(-1) > 0).all())
    valid = mask.bool()
    assert logits_distance(ours[valid], ref[valid]) <= 2 * logits_distance(eager[valid], ref[valid])
    gen = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    with torch.no_grad():
        eager_tokens = model.generate(ids, **gen)
        with patched(model):
            tokens = model.generate(ids, **gen)
    assert torch.equal(tokens, eager_tokens)


@pytest.mark.parametrize("family", ["glm_moe_dsa", "glm5_next"])
def test_shared_indexer_layers_reuse_the_previous_top_k(family):
    """GLM-5 / Glm5Next: a "shared" layer has no indexer; patched, it attends over the previous layer's top-k (handed
    on as eager hands it on: GLM-5 returns every layer's top-k, Glm5Next only a layer whose next one is shared), and
    without one it raises eager's error."""
    _, model = tiny_models(family, DEVICE, DTYPE)
    attns = attention_modules(model)
    seen, given = [], []
    hooks = [a.register_forward_hook(lambda m, a, out: seen.append(out[2])) for a in attns]
    hooks += [a.register_forward_pre_hook(lambda m, a, kw: given.append(kw.get("prev_topk_indices")), with_kwargs=True)
              for a in attns]
    first = attns[0].indexer
    hooks.append(first.register_forward_hook(lambda m, a, out: given.append(out)))
    with torch.no_grad(), sparse_hf.apply(model):
        model(_ids(SEQ, device=DEVICE))
        x = torch.zeros(1, 4, 64, dtype=DTYPE, device=DEVICE)
        if family == "glm_moe_dsa":
            kw = dict(hidden_states=x, position_embeddings=model.model.rotary_emb(x, torch.arange(4, device=DEVICE)[None]),
                      attention_mask=torch.zeros(1, 1, 4, 4, dtype=DTYPE, device=DEVICE))
        else:
            kw = dict(hidden_states=x, attention_mask=torch.ones(1, 4, dtype=torch.bool, device=DEVICE))
        with pytest.raises(ValueError, match="previous full indexer layer"):
            attns[1](**kw)
    for h in hooks:
        h.remove()
    assert attns[1].indexer is None and attns[0].indexer is not None
    if family == "glm_moe_dsa":  # layers 0 (full), 1 (shared), 2 (full)
        assert torch.equal(seen[1], seen[0]) and not torch.equal(seen[2], seen[0])
    else:  # Glm5Next: layer 0 is linear attention, then 1 (full, handing on) and 2 (shared); given: layer 1's
        # prev_topk (None), its indexer's output, layer 2's prev_topk
        assert given[0] is None and torch.equal(seen[0], given[1]) and torch.equal(given[2], given[1])
        assert seen[1] is None


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
    with pytest.raises(ValueError, match="head_dim 64, 4 kv heads"):
        sparse_hf.apply(v4.half())
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel

    g5 = Glm5NextTextModel(transformers.Glm5NextTextConfig(
        vocab_size=64, pad_token_id=0, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=16, intermediate_size=32, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        layer_types=["linear_attention", "indexed_attention"], kv_lora_rank=256))
    with pytest.raises(ValueError, match="kv_lora_rank 256.*NoPE"):
        sparse_hf.apply(g5.half())
    assert not sparse_hf.is_applied(g5) and not sparse_hf.is_applied(v4)


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


def test_topk_rows_keep_what_the_glm5_next_mask_keeps():
    """topk_rows (Glm5Next): -1 padding and out-of-range positions dropped, a repeated position kept once (eager's
    mask is a set), batch offsets b * T, a query the 2D padding mask drops keeps nothing; valid rows first."""
    topk = torch.tensor([[[3, -1, 0, 3], [1, 7, -1, -1]], [[2, 2, 0, -1], [0, 1, 2, 3]]], dtype=torch.int32)  # T = 4
    got = sparse_hf.topk_rows(topk, 4)
    expect = [[3, 0], [1], [6, 4], [7, 6, 5, 4]]
    assert [sorted((r[r >= 0]).tolist(), reverse=True) for r in got] == expect
    assert all(bool((r[:len(e)] >= 0).all()) and bool((r[len(e):] == -1).all()) for r, e in zip(got, expect))
    keep = torch.tensor([[True, False], [True, True]])
    assert bool((sparse_hf.topk_rows(topk, 4, keep)[1] == -1).all())
    with pytest.raises(ValueError, match="does not match"):
        sparse_hf.topk_rows(topk, 4, keep[:, :1])


def test_v4_rows_follow_the_window_mask_and_the_block_bias():
    """v4_rows (DeepseekV4): the window rows the 4D mask allows, then the compressed rows the block bias leaves at 0
    (all of them without one, as eager pads with 0), as indices into the [B * L] rows, ascending, -1 padded to the
    largest count; no mask: every row (eager masks nothing)."""
    window = torch.tensor([[[[True, True, False], [False, True, True]]]])  # [1, 1, S=2, 3]
    additive = torch.zeros(1, 1, 2, 3).masked_fill(~window, torch.finfo(torch.float32).min)
    bias = torch.tensor([[[[0.0, float("-inf")], [float("-inf"), float("-inf")]]]]).expand(2, 1, 2, 2)  # B = 2, C = 2
    got = sparse_hf.v4_rows(additive, bias, 2, 2, 3, 5)
    assert got.tolist() == [[0, 1, 3], [1, 2, -1], [5, 6, 8], [6, 7, -1]]
    assert torch.equal(sparse_hf.v4_rows(window, bias, 2, 2, 3, 5), got)  # a bool mask reads the same
    assert sparse_hf.v4_rows(window, None, 1, 2, 3, 5).tolist() == [[0, 1, 3, 4], [1, 2, 3, 4]]
    assert sparse_hf.v4_rows(None, None, 1, 1, 3, 5).tolist() == [[0, 1, 2, 3, 4]]
    assert sparse_hf.v4_rows(torch.zeros_like(window), None, 1, 2, 3, 3).tolist() == [[-1], [-1]]
    with pytest.raises(ValueError, match="does not match"):
        sparse_hf.v4_rows(window, None, 1, 2, 4, 5)


def test_import_does_not_import_transformers():
    """The module imports transformers on first use only (the core install has no transformers)."""
    code = "import sys, sparse_mla.integration.transformers; assert 'transformers' not in sys.modules, 'imported'"
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


def test_apply_without_transformers_names_the_extra(monkeypatch):
    """Without transformers installed, apply() raises ImportError naming the ``hf`` extra (nothing patched)."""
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    with pytest.raises(ImportError, match=r"sparse-mla\[hf\]"):
        sparse_hf.apply(torch.nn.Linear(2, 2))
