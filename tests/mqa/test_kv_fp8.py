"""The sparse MQA kernels on the FP8 ``fp8_ds_mla`` latent cache (``sparse_mla.kv_format``): the backend selection,
the kernels per token and grouped (Triton interpreter on the CPU, compiled on a GPU), the Gluon sm_90 kernel's FP8
producer, and the sm_90 compile of the FP8 kernel variants (tests/test_kv_format.py: the format;
tests/layer/test_layer_fp8.py: the layer paths; tests/bench/test_kv_fp8_bench.py: the benches).

The semantics under test: every path computes the fp32 reference on the cache dequantized to q's dtype
(``sparse_mla_ref(..., kv_format="fp8_ds_mla")`` == ``sparse_mla_ref`` on ``FP8_DS_MLA.dequantize(cache,
q.dtype)``), with the same per-row tolerances as a bf16 / fp16 cache. Test caches have per-tile magnitudes
spread over four decades, so a kernel that applied a wrong tile's scale (or read k_pe at a wrong offset) would
be off by orders of magnitude, far outside the tolerances.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from testlib.adversarial import garbage_topk_length
from testlib.device import DEVICE, DTYPE
from testlib.fp8 import FMT, FP8, fp8_problem, layer_inputs, run_fp8_checked, spread_kv
from testlib.problems import cu_seqlens, neighbour_rows, poisoned_out
from testlib.sm90 import hinted_kernels, run_sm90_compile
from testlib.tolerances import (
    all_of,
    assert_matches_reference,
    assert_same_result,
)

from sparse_mla import call_cache, dsa_prefill, sparse_mla_fwd, sparse_mla_ref
from sparse_mla.layer.checks import validate_dsa_prefill_args

# ---------------------------------------------------------------------------------------------------------------
# Backend selection (plain Python)


def _fp8_selection_inputs(dtype=torch.bfloat16, d_qk=576):
    q = torch.zeros(4, 64, d_qk, dtype=dtype)
    return q, FMT.as_rows(torch.zeros(32, 656, dtype=torch.uint8))


def test_fp8_cache_selects_gluon_with_bf16_q_on_hopper(hopper, monkeypatch):
    from sparse_mla.mqa import backends, gluon_sm90

    q, rows = _fp8_selection_inputs()
    assert backends.fp8_kv_reason(q.dtype, q.shape[-1]) is None
    assert backends.gluon_sm90_applies(q, rows)[0]
    name, why = backends.choose_backend(q, rows)
    assert name == "gluon_sm90", why
    assert backends.choose_backend(q[:, :16], rows, pseudo_heads=128)[0] == "gluon_sm90"  # grouped tile
    # few heads on many tokens: the Triton kernel's small tiles win on a bf16 cache (split schedule), not on an FP8 one
    monkeypatch.setattr(gluon_sm90.config, "SCHEDULE", "split")
    q16 = torch.zeros(backends.GLUON_FEW_HEADS_MAX_TOKENS + 1, 16, 576, dtype=torch.bfloat16)
    assert backends.choose_backend(q16, rows)[0] == "gluon_sm90"
    assert backends.choose_backend(q16, torch.zeros(100, 576, dtype=torch.bfloat16))[0] == "triton"


@pytest.mark.parametrize("schedule", ["pair", "split"])
def test_fp8_cache_runs_the_split_schedule_whatever_the_bf16_schedule(hopper, monkeypatch, schedule):
    """SPARSE_MLA_GLUON_SCHEDULE picks the schedule of bf16 / fp16 caches; an FP8 cache runs split (the schedule with
    a dequantizing producer) either way, and its variant is one the package compiles."""
    from sparse_mla.mqa import backends, gluon_sm90

    monkeypatch.setattr(gluon_sm90.config, "SCHEDULE", schedule)
    q, rows = _fp8_selection_inputs()
    assert backends.choose_backend(q, rows)[0] == "gluon_sm90"
    assert gluon_sm90.schedule_for(True) == "split" and gluon_sm90.schedule_for(False) == schedule
    assert gluon_sm90.variant_constexprs(False, True, kv_fp8=True)["KV_FP8"]
    assert (False, True, "bf16", gluon_sm90.schedule_for(True), True, False) in gluon_sm90.all_variants()
    assert (False, True, "bf16", gluon_sm90.schedule_for(True), True, True) in gluon_sm90.all_variants()


@pytest.mark.parametrize("case, match", [
    pytest.param("fp16", "takes bf16 q", id="fp16-q"),
    pytest.param("d512", "rows are 576 wide", id="d_qk-512"),
])
def test_fp8_cache_falls_back_to_triton_with_the_reason(hopper, monkeypatch, case, match):
    """fp16 q or a D_qk other than 576 with an FP8 cache: auto runs Triton and says why, a forced gluon_sm90 raises
    the same reason (before any launch)."""
    from sparse_mla.mqa import backends

    q, rows = _fp8_selection_inputs(torch.float16 if case == "fp16" else torch.bfloat16, 512 if case == "d512" else 576)
    ok, why = backends.gluon_sm90_applies(q, rows)
    assert not ok and match in why
    name, why = backends.choose_backend(q, rows)
    assert name == "triton" and match in why
    monkeypatch.setenv(backends.ENV_VAR, "gluon_sm90")
    with pytest.raises(ValueError, match=match):
        backends.choose_backend(q, rows)


def test_flashmla_compat_call_points_an_fp8_cache_to_sparse_mla_fwd():
    """flash_mla_sparse_fwd keeps FlashMLA's signature (no kv_format): an FP8 cache gets an error naming the call that
    takes it, before any launch."""
    from sparse_mla import flash_mla_sparse_fwd

    q, cache, idx = fp8_problem(2, 16, 8, 40, seed=3)
    for kv in (cache[:, None], cache.view(torch.float8_e4m3fn)[:, None]):
        with pytest.raises(TypeError, match=r"sparse_mla_fwd\(.*kv_format='fp8_ds_mla'\)"):
            flash_mla_sparse_fwd(q, kv, idx[:, None], 0.1)


def test_fp8_kernel_variants_refuse_what_they_cannot_run():
    from sparse_mla.mqa import gluon_sm90

    with pytest.raises(ValueError, match="576"):
        gluon_sm90.variant_constexprs(False, False, "split", kv_fp8=True)
    with pytest.raises(ValueError, match="pair schedule"):
        gluon_sm90.variant_constexprs(False, True, "pair", kv_fp8=True)
    assert gluon_sm90.variant_constexprs(True, True, "split", kv_fp8=True)["KV_FP8"]


def test_fp8_cache_on_this_machine_and_forced_gluon(monkeypatch):
    """Off Hopper (CPU here) the device reason comes first, and forcing gluon_sm90 raises it."""
    from sparse_mla.mqa import backends

    q = torch.zeros(4, 64, 576, dtype=DTYPE, device=DEVICE)
    rows = FMT.as_rows(torch.zeros(32, 656, dtype=torch.uint8, device=DEVICE))
    dev_ok, dev_why = backends.gluon_sm90_device_applies(q.device, q.dtype)
    if not dev_ok:
        assert backends.gluon_sm90_applies(q, rows) == (False, dev_why)
        monkeypatch.setenv(backends.ENV_VAR, "gluon_sm90")
        with pytest.raises(ValueError, match="does not apply"):
            sparse_mla_fwd(q[:1, :16], rows, torch.zeros(1, 4, dtype=torch.int32, device=DEVICE), 0.1, kv_format=FP8)
    monkeypatch.setenv(backends.ENV_VAR, "triton")
    assert backends.choose_backend(q, rows)[0] == "triton"


def test_explain_names_the_fp8_attention_backend(hopper):
    from sparse_mla.layer import PrefillStep, explain

    d = explain(PrefillStep(16, 512, 128, 64, 128, 64, (100,), (20,), kv_format=FP8))
    assert d.attention_backend.startswith("attention backend: gluon_sm90 (")
    assert "fp8_ds_mla cache dequantized by the producer" in d.attention_backend
    assert "dequantized by the producer" not in explain(PrefillStep(16, 512, 128, 64, 128, 64, (100,), (20,))).attention_backend
    with pytest.raises(ValueError, match="kv_format"):
        PrefillStep(16, 512, 128, 64, 128, 64, (100,), (20,), kv_format="int8")


# ---------------------------------------------------------------------------------------------------------------
# The kernels (Triton interpreter on the CPU)

# (H, K, N, T, scale_format, extras): T tokens cycle the adversarial patterns (clean, -1 at the end, -1 in the
# middle, INT_MIN / -2 / N / N+1 / INT_MAX sentinels, no valid row); "tl" adds topk_length with garbage after it,
# "sink" attn_sink and max_logits.
PER_TOKEN = [
    pytest.param(1, 70, 200, 5, "ue8m0", (), id="H1-K70"),
    pytest.param(16, 65, 200, 7, "ue8m0", ("tl",), id="H16-K65-topk_length-T7"),
    pytest.param(16, 33, 90, 5, "fp32", ("sink",), id="H16-K33-fp32-scales-sink"),
    pytest.param(64, 70, 200, 5, "ue8m0", (), id="H64-K70"),
    pytest.param(128, 40, 60, 3, "ue8m0", ("tl",), id="H128-K40-topk_length"),
]


@pytest.mark.parametrize("H, K, N, T, scale_format, extras", PER_TOKEN)
def test_per_token_fp8_matches_reference_on_dequantized_cache(H, K, N, T, scale_format, extras):
    q, cache, idx = fp8_problem(T, H, K, N, seed=H + K, scale_format=scale_format)
    tl_ = None
    if "tl" in extras:
        idx, tl_ = garbage_topk_length(idx.cpu(), N, generator=torch.Generator().manual_seed(2))
        idx, tl_ = idx.to(DEVICE), tl_.to(DEVICE)
    sink = torch.linspace(-2, 2, H, device=DEVICE) if "sink" in extras else None
    max_logits = torch.full((T, H), float("nan"), device=DEVICE) if "sink" in extras else None
    sm_scale = 576**-0.5
    out, lse, ref_out, ref_lse = run_fp8_checked(q, cache, idx, sm_scale, topk_length=tl_, attn_sink=sink,
                                                 max_logits=max_logits, method="per_token")
    # the definition: the reference on the FP8 cache is the reference on the cache dequantized to q's dtype
    plain = sparse_mla_ref(q, FMT.dequantize(cache, DTYPE), idx, sm_scale, topk_length=tl_, attn_sink=sink,
                           return_max_logits=True)
    assert torch.equal(plain[0], ref_out) and torch.equal(plain[1], ref_lse)
    if max_logits is not None:
        assert torch.equal(torch.isinf(max_logits), torch.isinf(plain[2])) and not max_logits.isnan().any()
        fin = torch.isfinite(plain[2])
        assert torch.allclose(max_logits[fin], plain[2][fin], rtol=2**-15, atol=1e-5)
    if T > 4:
        assert torch.isinf(lse[4]).all() and (out[4] == 0).all()  # token 4: no valid row (all-invalid pattern)


def test_grouped_fp8_matches_reference_and_per_token(union_backend):
    """Several requests (groups stay inside them; a request's last n % G tokens run per token), neighbour
    overlap, padding, a short topk_length and an empty query; odd T."""
    H, K, N, lens = 16, 48, 160, [5, 11, 7]
    T = sum(lens)
    g = torch.Generator().manual_seed(11)
    idx = neighbour_rows(T, K, N, 0.7, generator=g)
    idx[3, 40:] = -1
    idx[9, ::5] = -1
    idx[14] = -1
    tl_ = torch.full((T,), K, dtype=torch.int32)
    tl_[20] = 9
    q, cache, idx = fp8_problem(T, H, K, N, seed=12, indices=idx)
    tl_ = tl_.to(DEVICE)
    cu = cu_seqlens(lens)
    out_g, lse_g, _, ref_lse = run_fp8_checked(q, cache, idx, 0.06, topk_length=tl_, method="grouped", cu_seqlens_q=cu,
                                               overlap_guard=math.inf)
    out_t, lse_t = poisoned_out(T, H)
    sparse_mla_fwd(q, cache, idx, 0.06, topk_length=tl_, method="per_token", out=out_t, lse=lse_t, kv_format=FP8)
    assert_same_result(out_g, lse_g, out_t, lse_t, DTYPE)
    assert torch.isinf(ref_lse[14]).all() and (out_g[14] == 0).all()


def test_nonfinite_scale_reaches_only_the_selecting_query_and_check_names_it():
    H, K, N, T = 16, 24, 64, 4
    idx = torch.stack([torch.randperm(N - 1, generator=torch.Generator().manual_seed(t))[:K] for t in range(T)])
    idx[0, 3] = N - 1  # only token 0 selects the last row
    q, cache, idx = fp8_problem(T, H, K, N, seed=21, indices=idx.to(torch.int32))
    FMT.scales(cache)[N - 1, 2] = float("nan")
    out, lse = poisoned_out(T, H)
    sparse_mla_fwd(q, cache, idx, 0.07, out=out, lse=lse, method="per_token", kv_format=FP8)
    assert not torch.isfinite(out[0]).all()
    ref_out, ref_lse = sparse_mla_ref(q[1:], cache, idx[1:], 0.07, kv_format=FP8)
    assert_matches_reference(out[1:], lse[1:], ref_out, ref_lse, DTYPE)
    with pytest.raises(ValueError, match=rf"kv rows \[{N - 1}\] hold NaN or inf .* indices\[0, 3\]"):
        sparse_mla_fwd(q, cache, idx, 0.07, kv_format=FP8, check=True)


def _overflowing_fp16_row(N: int, row: int, *, seed: int) -> torch.Tensor:
    """An FP8 cache [N, 656] quantized from finite fp16 rows, row ``row`` holding 65504 (the largest fp16): its
    tile scale is 256 and the value's e4m3 code 256, so it dequantizes to 65536, inf in fp16 and finite in bf16 /
    fp32."""
    kv = (torch.randn(N, 576, generator=torch.Generator().manual_seed(seed)) / 4).half()
    kv[row, 5] = 65504.0
    cache = FMT.quantize(kv.to(DEVICE))
    assert FMT.scales(cache)[row, 0].item() == 256.0 and torch.isinf(FMT.dequantize(cache, torch.float16)[row, 5])
    return cache


def test_check_reads_an_fp8_cache_in_q_dtype():
    """check=True looks at the selected rows as the kernel and the reference dequantize them, in q's dtype: a row
    that overflows in fp16 makes the fp16 result NaN for the query selecting it, so check=True must name it with
    fp16 q, and accept it with bf16 / fp32 q (finite there)."""
    T, H, K, N = 2, 16, 8, 16
    cache = _overflowing_fp16_row(N, 3, seed=22)
    idx = torch.arange(T * K, dtype=torch.int32, device=DEVICE).reshape(T, K)  # disjoint: only token 0 selects row 3
    q = torch.randn(T, H, 576, generator=torch.Generator().manual_seed(23)).half().to(DEVICE)
    ref_out, _ = sparse_mla_ref(q, cache, idx, 0.05, kv_format=FP8)
    assert not torch.isfinite(ref_out[0]).all() and torch.isfinite(ref_out[1]).all()  # what an unchecked fp16 call gives
    match = r"kv rows \[3\] hold NaN or inf .*indices\[0, 3\]"
    for method in ("per_token", "grouped"):
        with pytest.raises(ValueError, match=match):
            sparse_mla_fwd(q, cache, idx, 0.05, kv_format=FP8, method=method, check=True)
    with pytest.raises(ValueError, match=match):
        sparse_mla_ref(q, cache, idx, 0.05, kv_format=FP8, check=True)
    for dtype in (torch.bfloat16, torch.float32):
        out, lse = sparse_mla_ref(q.to(dtype), cache, idx, 0.05, kv_format=FP8, check=True)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all(), dtype


def test_dsa_prefill_check_reads_an_fp8_cache_in_q_dtype():
    """The layer's check=True on an FP8 cache: a window row that overflows in fp16 is named with fp16 q and
    accepted with bf16 q (the paths dequantize to q's dtype)."""
    inp = layer_inputs(34)
    inp["kv"] = _overflowing_fp16_row(40, 24, seed=35)  # row 24: inside request 0's window
    for name in ("q_nope", "q_pe", "w_kv_b"):
        inp[name] = inp[name].half()
    with pytest.raises(ValueError, match=r"cache rows \[24\]"):
        dsa_prefill(**inp, check=True)
    bf16 = {**inp, **{name: inp[name].to(torch.bfloat16) for name in ("q_nope", "q_pe", "w_kv_b")}}
    validate_dsa_prefill_args(**bf16, check=True)


def test_interpreter_and_hardware_convert_every_finite_e4m3_code():
    """The kernels convert fp8 with Triton's float8e4nv cast (hardware cvt on sm_89+). Every one of the 254 finite
    codes converts exactly, here too; the two NaN codes give NaN on a GPU, but +-480 under the Triton 3.x
    interpreter (a known interpreter deviation: only a NaN cache byte sees it, which vLLM's writer stores for a
    NaN latent value under a finite tile scale; FlashMLA's quantizer and FP8_DS_MLA.quantize give the tile a NaN
    scale instead)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _convert(X, Y, S):
        offs = tl.arange(0, 256)
        v = tl.load(X + offs).to(tl.float8e4nv, bitcast=True).to(tl.float32) * tl.load(S)
        tl.store(Y + offs, v.to(Y.dtype.element_ty))

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(DEVICE)
    y = torch.empty(256, dtype=DTYPE, device=DEVICE)
    _convert[(1,)](codes, y, torch.tensor([0.25], device=DEVICE))
    want = (codes.view(torch.float8_e4m3fn).float() * 0.25).to(DTYPE)
    nan_codes = torch.isnan(want)
    assert int(nan_codes.sum()) == 2 and torch.equal(y[~nan_codes], want[~nan_codes])
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert all_of(v != v or abs(v) == 120.0 for v in y[nan_codes].tolist())  # NaN, or 480 * 0.25
    else:
        assert torch.isnan(y[nan_codes]).all()


# ---------------------------------------------------------------------------------------------------------------
# The Gluon sm_90 kernel's FP8 producer (GPU): held to the reference on the dequantized cache and to the Triton twin


def _gluon_fp8_applies() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    from sparse_mla.mqa import backends

    q = torch.empty(1, 1, 576, dtype=torch.bfloat16, device="cuda")
    return backends.gluon_sm90_applies(q, torch.empty(1, 656, dtype=torch.uint8, device="cuda"))


_GLUON_FP8 = _gluon_fp8_applies()
requires_gluon_fp8 = pytest.mark.skipif(not _GLUON_FP8[0], reason=f"gluon_sm90 FP8 does not apply: {_GLUON_FP8[1]}")


@pytest.fixture
def gluon_launches(monkeypatch) -> list:
    """The kv dtype of every ``gluon_sm90.launch`` while the test runs (the launches still happen)."""
    from sparse_mla.mqa import gluon_sm90

    launches = []
    real_launch = gluon_sm90.launch

    def counting_launch(q, kv, *args, **kwargs):
        launches.append(kv.dtype)
        return real_launch(q, kv, *args, **kwargs)

    monkeypatch.setattr(gluon_sm90, "launch", counting_launch)
    return launches


def _fp8_backend_pair(monkeypatch, q, cache, idx, sm_scale, topk_length=None, **kw):
    """The call through gluon_sm90 (checked against the reference into poisoned views) and through triton."""
    from sparse_mla.mqa import backends

    monkeypatch.setenv(backends.ENV_VAR, "gluon_sm90")
    out_g, lse_g, ref_out, ref_lse = run_fp8_checked(q, cache, idx, sm_scale, topk_length=topk_length, pad_tokens=2,
                                                     **kw)
    monkeypatch.setenv(backends.ENV_VAR, "triton")
    out_t, lse_t = poisoned_out(*q.shape[:2])
    sparse_mla_fwd(q, cache, idx, sm_scale, topk_length=topk_length, out=out_t, lse=lse_t, kv_format=FP8, **kw)
    assert_same_result(out_g, lse_g, out_t, lse_t, DTYPE)
    return out_g, lse_g, ref_out, ref_lse


@pytest.mark.parametrize("H, K, N, T, scale_format, topk_len", [
    pytest.param(64, 70, 200, 7, "ue8m0", False, id="H64-K70-T7"),
    pytest.param(128, 2048, 5000, 5, "fp32", True, id="H128-K2048-fp32-scales-topk_length"),
    pytest.param(32, 257, 3000, 9, "ue8m0", True, id="H32-K257-topk_length"),
    pytest.param(16, 130, 400, 6, "ue8m0", False, id="H16-K130"),
])
@pytest.mark.gpu
@requires_gluon_fp8
def test_gluon_fp8_per_token_matches_reference_and_twin(monkeypatch, H, K, N, T, scale_format, topk_len):
    q, cache, idx = fp8_problem(T, H, K, N, seed=3 * H + K, scale_format=scale_format)
    tl_ = None
    if topk_len:
        idx, tl_ = garbage_topk_length(idx.cpu(), N, generator=torch.Generator().manual_seed(H))
        idx, tl_ = idx.to(DEVICE), tl_.to(DEVICE)
    out, lse, _, ref_lse = _fp8_backend_pair(monkeypatch, q, cache, idx, 576**-0.5, topk_length=tl_,
                                             method="per_token")
    empty = torch.isinf(ref_lse)
    assert (out[empty] == 0).all() and torch.isinf(lse[empty]).all()


@pytest.mark.parametrize("H, lens", [
    pytest.param(16, [5, 11, 7], id="H16-G8-3-requests"),
    pytest.param(8, [33, 16], id="H8-G16"),
    pytest.param(32, [9], id="H32-G4-odd"),
])
@pytest.mark.gpu
@requires_gluon_fp8
def test_gluon_fp8_grouped_matches_reference_and_twin(monkeypatch, H, lens):
    K, N = 100, 420
    T = sum(lens)
    g = torch.Generator().manual_seed(H + T)
    idx = neighbour_rows(T, K, N, 0.7, generator=g)
    idx[1, 60:] = -1
    idx[T - 1] = -1  # a query with no valid row
    q, cache, idx = fp8_problem(T, H, K, N, seed=H, indices=idx)
    _, _, _, ref_lse = _fp8_backend_pair(monkeypatch, q, cache, idx, 0.05, method="grouped", cu_seqlens_q=cu_seqlens(lens),
                                         overlap_guard=math.inf)
    assert torch.isinf(ref_lse[T - 1]).all()


@pytest.mark.gpu
@requires_gluon_fp8
@pytest.mark.parametrize("method", ["per_token", "grouped"])
def test_gluon_fp8_persistent_ctas_walk_many_items(monkeypatch, gluon_launches, method):
    """Three persistent CTAs for dozens of work items (the ring's phases carried across items, the next item's first
    tiles and Q loaded during the previous item), with tile counts from 0 to 5 per list (topk_length)."""
    from sparse_mla.mqa import gluon_sm90

    H, K, N, T = 64, 300, 2000, 37
    q, cache, idx = fp8_problem(T, H, K, N, seed=77)
    g = torch.Generator().manual_seed(78)
    tl_ = torch.randint(0, K + 1, (T,), generator=g).to(torch.int32)
    tl_[::7] = 0
    tl_ = tl_.to(DEVICE)
    monkeypatch.setitem(gluon_sm90.launcher._NUM_SMS, str(q.device), 3)
    kw = dict(method=method) | ({"cu_seqlens_q": cu_seqlens([20, 17]), "overlap_guard": math.inf} if method == "grouped"
                                 else {})
    _fp8_backend_pair(monkeypatch, q, cache, idx, 0.04, topk_length=tl_, **kw)
    assert torch.uint8 in gluon_launches, "the Gluon FP8 variant did not run"


@pytest.mark.gpu
@requires_gluon_fp8
def test_gluon_fp8_kv_l2_hints_change_no_bit(monkeypatch, gluon_launches):
    """SPARSE_MLA_GLUON_KV_L2=evict_last (the RoPE copies of the FP8 producer hinted, ``gluon_sm90.l2_hints``): bit-identical
    to plain cp.async, and both match the reference and the Triton twin."""
    from sparse_mla.mqa import gluon_sm90

    H, K, N, T = 64, 130, 700, 9
    q, cache, idx = fp8_problem(T, H, K, N, seed=91)
    outs = []
    for mode in gluon_sm90.config.KV_L2_MODES:
        monkeypatch.setattr(gluon_sm90.config, "KV_L2", mode)
        call_cache.invalidate()  # a knob changed at run time: no replay of the other mode's launches
        out, lse, _, _ = _fp8_backend_pair(monkeypatch, q, cache, idx, 576**-0.5, method="per_token")
        outs.append((out.clone(), lse.clone()))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert torch.uint8 in gluon_launches, "the Gluon FP8 variant did not run"
    assert hinted_kernels(gluon_sm90.schedule_for(True)) > 0, "no kernel with the L2-hinted copies was compiled"


@pytest.mark.gpu
@requires_gluon_fp8
def test_gluon_fp8_warmup_then_steps_compile_nothing_and_graph_replays(gluon_launches):
    """warmup(kv_format="fp8_ds_mla") compiles the Gluon FP8 variants a step uses (per token and grouped, other token
    counts after it compile nothing), and a captured per-token call replays with new q equal to eager."""
    from sparse_mla import SparseMLAWorkspace
    from sparse_mla.integration.warmup import compiled_variant_counts, warmup

    H, K, N, T_MAX = 64, 96, 500, 64
    cache = FMT.quantize(spread_kv(N, seed=8))
    ws = SparseMLAWorkspace(T_MAX, K, 128 // H, N, DEVICE)
    warmup(H, 576, K, DTYPE, DEVICE, T_MAX, kv=cache, workspace=ws, converter=False, kv_format=FP8)
    torch.cuda.synchronize()
    before = compiled_variant_counts()
    for T in (5, 33, 64):
        q, _, idx = fp8_problem(T, H, K, N, seed=T)
        for method in ("per_token", "grouped"):
            sparse_mla_fwd(q, cache, idx, 0.05, method=method, return_lse=True, kv_format=FP8,
                           **({"workspace": ws} if method == "grouped" else {}))
    torch.cuda.synchronize()
    after = compiled_variant_counts()
    assert after == before, {k: (before.get(k), v) for k, v in after.items() if before.get(k) != v}
    assert gluon_launches.count(torch.uint8) >= 6, "the steps did not run the Gluon FP8 variant"

    q, _, idx = fp8_problem(17, H, K, N, seed=9)
    out, lse = poisoned_out(17, H)
    sparse_mla_fwd(q, cache, idx, 0.05, out=out, lse=lse, kv_format=FP8)  # eager once (compiled already)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sparse_mla_fwd(q, cache, idx, 0.05, out=out, lse=lse, kv_format=FP8)
    q.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(q))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    out_e, lse_e = poisoned_out(17, H)
    sparse_mla_fwd(q, cache, idx, 0.05, out=out_e, lse=lse_e, kv_format=FP8)
    assert torch.equal(out, out_e) and torch.equal(lse, lse_e)


# ---------------------------------------------------------------------------------------------------------------
# The FP8 variants compile for sm_90 (Triton's front end, LLVM and ptxas on the CPU, as tests/mqa/test_gluon_compile.py)

SMEM_LIMIT = 227 * 1024

_COMPILE = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sparse_mla.mqa import triton_tl as t
k = t._sparse_mqa_fwd_kernel
names = k.arg_names
rows = []
for block_m, grouped, split in ((16, False, False), (64, False, False), (64, True, False), (16, False, True), (64, True, True)):
    bn, warps, stages = t.LAUNCH_CONFIGS_FP8[block_m]
    cx = dict(GROUPED=grouped, HAS_TOPK_LEN=not grouped, HAS_ROUTE=False, HAS_PE=True, GROUP_HEADS=128 if grouped else block_m,
              BLOCK_M=block_m, BLOCK_N=bn, D_V=512, D_PE=64, KV_FP8=True, SINK=None, MAX_LOGITS=None, KV_SPLIT=split)
    ptr = dict(Q="*bf16", KV="*u8", OUT="*bf16", LSE="*fp32")
    ints = {"N", "H", "K", "num_splits"} | {n for n in names if n.startswith("stride")}
    sig = {n: "constexpr" if n in cx else ptr.get(n, "i32" if n in ints else "fp32" if n == "scale_log2" else "*i32")
           for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ("Q", "KV", "IDX", "OUT", "stride_kvn", "stride_qt")}
    ck = triton.compile(ASTSource(k, sig, constexprs=cx, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": warps, "num_stages": stages})
    ptx = ck.asm["ptx"]
    rows.append(dict(block_m=block_m, grouped=grouped, split=split, shared=ck.metadata.shared, triton=triton.__version__,
                     cvt=sorted(set(re.findall(r"cvt\.[a-z0-9.]*e4m3[a-z0-9.]*", ptx))),
                     mma=sorted(set(re.findall(r"(?:wgmma\.mma_async|mma\.sync)\.[a-z0-9.]*bf16", ptx)))))
print(json.dumps(rows))
"""


def test_fp8_variants_compile_for_sm90_with_the_hardware_conversion():
    """The FP8 gather compiles for sm_90 with the Triton the GPU runs (the Gluon kernels' pinned version), within
    the H100 / H200 shared memory, converting with the e4m3 -> f16x2 cvt instruction (no software decode) and
    multiplying in bf16 tensor-core MMAs; the split-KV variants (KV_SPLIT) as well."""
    rows = run_sm90_compile(_COMPILE, "the FP8 kernel variants")
    assert len(rows) == 5
    for row in rows:
        assert row["cvt"] == ["cvt.rn.f16x2.e4m3x2"], row
        assert row["mma"] and 0 < row["shared"] <= SMEM_LIMIT, row


