"""The FP8 ``fp8_ds_mla`` latent cache (``sparse_mla.kv_format``): the format (bytes, scales, round trip,
validation), the sparse MQA kernels reading it (per token and grouped, Triton interpreter on the CPU, compiled
on a GPU), the layer paths and the block-table path on it, the backend selection, the sm_90 compile of the FP8
kernel variants, and the bench's ``--kv-dtype fp8``.

The semantics under test: every path computes the fp32 reference on the cache dequantized to q's dtype
(``sparse_mla_ref(..., kv_format="fp8_ds_mla")`` == ``sparse_mla_ref`` on ``FP8_DS_MLA.dequantize(cache,
q.dtype)``), with the same per-row tolerances as a bf16 / fp16 cache. Test caches have per-tile magnitudes
spread over four decades, so a kernel that applied a wrong tile's scale (or read k_pe at a wrong offset) would
be off by orders of magnitude, far outside the tolerances.
"""

from __future__ import annotations

import json
import math
import os
import struct

import pytest
import torch
from lib import (
    DEVICE,
    DTYPE,
    LAYER_ROW_TOLERANCE,
    adversarial_indices,
    all_of,
    assert_matches_reference,
    assert_outside_untouched,
    assert_rows_close,
    assert_same_result,
    cu_seqlens,
    garbage_topk_length,
    neighbour_rows,
    poisoned_out,
    poisoned_views,
    run_sm90_compile,
)

from sparse_mla import dsa_prefill, dsa_prefill_ref, sparse_mla_fwd, sparse_mla_ref
from sparse_mla.kv_format import FP8_DS_MLA, check_kv_format
from sparse_mla.layer.config import validate_dsa_prefill_args

FMT = FP8_DS_MLA
FP8 = "fp8_ds_mla"


def spread_kv(N: int, *, seed: int, dtype=torch.float32, device=DEVICE) -> torch.Tensor:
    """[N, 576] latent rows whose four 128-value tiles have magnitudes ~1e-2, 1e-1, 1, 10 (permuted per row),
    so the four scales of a row differ by up to 1000x; k_pe ~ 1."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, 576, generator=g)
    mags = torch.tensor([1e-2, 1e-1, 1.0, 10.0])
    perm = torch.stack([torch.randperm(4, generator=g) for _ in range(N)])
    x[:, :512] *= mags[perm].repeat_interleave(128, dim=1)
    return x.to(dtype).to(device)


def fp8_problem(T: int, H: int, K: int, N: int, *, seed: int, indices=None, scale_format="ue8m0"):
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(T, H, 576, generator=g).to(DTYPE).to(DEVICE)
    cache = FMT.quantize(spread_kv(N, seed=seed), scale_format=scale_format)
    if indices is None:
        indices = adversarial_indices(T, K, N, generator=g)
    return q, cache, indices.to(DEVICE)


def run_fp8_checked(q, cache, indices, sm_scale, *, topk_length=None, attn_sink=None, pad_tokens=1, pad_heads=1,
                    **kwargs):
    """``sparse_mla_fwd(kv_format="fp8_ds_mla")`` into NaN-poisoned views, compared per (token, head) row to the
    fp32 reference on the dequantized cache; the poisoned padding around the views must stay NaN."""
    T, H, _ = q.shape
    out_big, lse_big, out, lse = poisoned_views(T, H, pad_tokens=pad_tokens, pad_heads=pad_heads)
    sparse_mla_fwd(q, cache, indices, sm_scale, topk_length=topk_length, return_lse=True, out=out, lse=lse,
                   kv_format=FP8, attn_sink=attn_sink, **kwargs)
    ref_out, ref_lse = sparse_mla_ref(q, cache, indices, sm_scale, topk_length=topk_length, attn_sink=attn_sink,
                                      kv_format=FP8)
    assert_matches_reference(out, lse, ref_out, ref_lse, DTYPE)
    assert_outside_untouched(out_big, lse_big, T, pad_heads)
    return out, lse, ref_out, ref_lse


# ---------------------------------------------------------------------------------------------------------------
# The format


def test_layout_constants_match_the_kernel():
    from sparse_mla.mqa import triton_tl

    assert (FMT.row_bytes, FMT.scale_offset, FMT.rope_offset) == (656, 512, 528)
    assert FMT.kv_lora_rank + 4 * FMT.num_tiles + 2 * FMT.qk_rope_head_dim == FMT.row_bytes
    assert (triton_tl.FP8_SCALE_OFFSET.value, triton_tl.FP8_ROPE_OFFSET.value, triton_tl.FP8_TILE.value) == (
        FMT.scale_offset, FMT.rope_offset, FMT.tile_size)
    assert (triton_tl.D_V, triton_tl.D_PE) == (FMT.kv_lora_rank, FMT.qk_rope_head_dim)


def test_quantize_writes_the_published_byte_layout():
    """Exact bytes of one row: OCP E4M3 codes (bias 7), little-endian fp32 scales, bf16 k_pe verbatim."""
    kv = torch.zeros(1, 576)
    kv[0, 0], kv[0, 1], kv[0, 2], kv[0, 3] = 448.0, -1.0, 2.0**-9, 96.0  # tile 0: amax 448 -> scale 1
    kv[0, 128], kv[0, 129] = 1.0, -0.5  # tile 1: amax 1 -> 1/448 -> ue8m0 2**-8; codes of 256 and -128
    kv[0, 256] = 3.0  # tile 2: 3 / 448 -> 2**-7; 3 * 128 = 384
    # tile 3: all zero -> FlashMLA's clamp 1e-4 -> 2**-13
    kv[0, 512:] = torch.linspace(-2, 2, 64)
    b = FMT.quantize(kv)
    assert b.dtype == torch.uint8 and b.shape == (1, 656)
    codes = b[0, :512].tolist()
    assert codes[:4] == [0x7E, 0xB8, 0x01, 0x6C], [hex(c) for c in codes[:4]]  # 448, -1, 2**-9 (subnormal), 96
    assert codes[128:130] == [0x78, 0xF0]  # 256 = 2**8: exponent 15 -> 0 1111 000; -128: 1 1110 000
    assert codes[256] == 0x7C and set(codes[384:512]) == {0}  # 384 = 1.5 * 2**8
    scales = struct.unpack("<4f", bytes(b[0, 512:528].tolist()))
    assert scales == (1.0, 2.0**-8, 2.0**-7, 2.0**-13)
    assert bytes(b[0, 528:].tolist()) == kv[0, 512:].to(torch.bfloat16).contiguous().view(torch.uint8).numpy().tobytes()
    # vLLM's scale rule: amax / 448 as fp32, FLT_MIN for a zero tile
    s32 = struct.unpack("<4f", bytes(FMT.quantize(kv, scale_format="fp32")[0, 512:528].tolist()))
    want = [struct.unpack("<f", struct.pack("<f", v / 448.0))[0] for v in (448.0, 1.0, 3.0)]
    assert list(s32[:3]) == want and s32[3] == torch.finfo(torch.float32).tiny


def test_ue8m0_scale_is_the_next_power_of_two():
    g = torch.Generator().manual_seed(0)
    amax = torch.cat([torch.exp(torch.empty(200).uniform_(-14, 9, generator=g)),
                      448.0 * 2.0 ** torch.arange(-12, 6, dtype=torch.float32),  # exact powers: no round-up
                      torch.tensor([0.0, 1e-4 * 448, 1e-4 * 448 * 0.5])])
    kv = torch.zeros(amax.numel(), 576)
    kv[:, 5] = amax  # one value per row sets the tile's amax
    scales = FMT.scales(FMT.quantize(kv))[:, 0].double()
    want = torch.tensor([2.0 ** math.ceil(math.log2(max(a / 448.0, 1e-4))) for a in amax.double().tolist()],
                        dtype=torch.float64)
    assert torch.equal(scales, want)


@pytest.mark.parametrize("scale_format", ["ue8m0", "fp32"])
def test_round_trip_error_within_half_an_e4m3_step(scale_format):
    """|kv / scale - e4m3| <= half the E4M3 spacing at that magnitude, for every value (normal and subnormal
    codes, zeros, tiles across six decades); k_pe round-trips exactly through bf16."""
    kv = spread_kv(64, seed=3, device="cpu")
    kv[:8, :512] *= 1e-3  # small tiles: the ue8m0 clamp at 1e-4 leaves codes in the subnormal range
    kv[8, :128] = 0.0
    b = FMT.quantize(kv, scale_format=scale_format)
    scale = FMT.scales(b).double().repeat_interleave(128, dim=1)
    v = kv[:, :512].double() / scale
    code = FMT.nope(b).double()
    exp = torch.floor(torch.log2(v.abs().clamp_min(2.0**-30))).clamp_min(-6)
    half_step = 2.0 ** (exp - 4)
    assert torch.all((v - code).abs() <= half_step), float(((v - code).abs() / half_step).max())
    assert code.abs().max() <= 448 and (code.abs() > 224).any()  # the full range is used
    deq = FMT.dequantize(b, torch.float32)
    assert torch.equal(deq[:, 512:], kv[:, 512:].to(torch.bfloat16).float())
    assert torch.equal(deq[:, :512].double(), (code * scale).float().double())  # one rounding, of the product
    rel = ((deq[:, :512] - kv[:, :512]).norm(dim=1) / kv[:, :512].norm(dim=1)).max()
    assert rel < 2.0**-4, rel


def test_dequantize_dtypes():
    """ue8m0 scales: e4m3 * 2**k is exact in bf16 (same values in bf16 and fp32); fp32 scales: the bf16 result
    is the fp32 product rounded once."""
    kv = spread_kv(32, seed=5, device="cpu")
    b = FMT.quantize(kv)
    assert torch.equal(FMT.dequantize(b, torch.bfloat16).float(), FMT.dequantize(b, torch.float32))
    b32 = FMT.quantize(kv, scale_format="fp32")
    assert torch.equal(FMT.dequantize(b32, torch.bfloat16), FMT.dequantize(b32, torch.float32).to(torch.bfloat16))
    rows = torch.tensor([31, 0, 7, 7])
    assert torch.equal(FMT.dequantize(b, torch.float16, rows=rows), FMT.dequantize(b, torch.float16)[rows])


def test_nonfinite_values_poison_their_tile_only():
    kv = spread_kv(4, seed=6, device="cpu")
    kv[1, 130] = float("nan")
    kv[2, 300] = float("inf")
    deq = FMT.dequantize(FMT.quantize(kv), torch.float32)
    assert torch.isnan(deq[1, 128:256]).all() and torch.isnan(deq[2, 256:384]).all()
    finite = torch.ones_like(deq, dtype=torch.bool)
    finite[1, 128:256] = False
    finite[2, 256:384] = False
    assert torch.isfinite(deq[finite]).all()


def test_storage_dtypes_and_paged_shapes_view_the_same_rows():
    kv = spread_kv(48, seed=7, device="cpu")
    b = FMT.quantize(kv)
    want = FMT.dequantize(b, torch.float32)
    flashmla = b.view(torch.float8_e4m3fn).view(3, 16, 1, 656)  # FlashMLA's dtype and [blocks, block_size, 1, 656]
    for cache in (b, b.view(3, 16, 656), flashmla, b.view(torch.float8_e4m3fn)):
        rows = FMT.as_rows(cache)
        assert rows.dtype == torch.uint8 and rows.shape == (48, 656) and rows.data_ptr() == b.data_ptr()
        assert torch.equal(FMT.dequantize(cache, torch.float32).reshape(48, 576), want)
    slots = torch.zeros(4, 656, dtype=torch.uint8)
    assert FMT.quantize(kv[:2], out=slots[1:3]) is not None
    assert torch.equal(slots[1:3], b[:2]) and not slots[0].any() and not slots[3].any()


def _misaligned():
    raw = torch.zeros(4 * 656 + 16, dtype=torch.uint8)
    return raw[8:8 + 4 * 656].view(4, 656)


BAD_FORMAT = [
    pytest.param(lambda: FMT.as_rows(torch.zeros(4, 656, dtype=torch.float16)), TypeError, "uint8 or float8_e4m3fn",
                 id="dtype"),
    pytest.param(lambda: FMT.as_rows(torch.zeros(4, 576, dtype=torch.uint8)), ValueError, "656 bytes", id="row-size"),
    pytest.param(lambda: FMT.as_rows(_misaligned()), ValueError, "16-byte boundary", id="base-misaligned"),
    pytest.param(lambda: FMT.as_rows(torch.zeros(4 * 664, dtype=torch.uint8).as_strided((4, 656), (660, 1))),
                 ValueError, "stride 660", id="row-stride"),
    pytest.param(lambda: FMT.as_rows(torch.zeros(656, 4, dtype=torch.uint8).t()), ValueError, "contiguous", id="last-dim"),
    pytest.param(lambda: FMT.as_rows(torch.zeros(2, 4, 2, 656, dtype=torch.uint8)), ValueError, "h_k = 1", id="h_k"),
    pytest.param(lambda: FMT.as_rows(torch.zeros(3, 8, 656, dtype=torch.uint8)[:, :4]), ValueError, "block stride",
                 id="paged-gap"),
    pytest.param(lambda: FMT.quantize(torch.zeros(2, 512)), ValueError, "576", id="quantize-width"),
    pytest.param(lambda: FMT.quantize(torch.zeros(2, 576), scale_format="e8m0"), ValueError, "scale_format",
                 id="quantize-scale-format"),
    pytest.param(lambda: check_kv_format("fp8"), ValueError, "fp8_ds_mla", id="unknown-format"),
    pytest.param(lambda: check_kv_format(True), TypeError, "kv_format", id="format-type"),
]


@pytest.mark.parametrize("fn, exc, match", BAD_FORMAT)
def test_format_refuses_bad_tensors(fn, exc, match):
    with pytest.raises(exc, match=match):
        fn()


def _bad_call(kind: str):
    q = torch.randn(2, 4, 576).to(DTYPE).to(DEVICE)
    cache = FMT.quantize(spread_kv(8, seed=1))
    idx = torch.zeros(2, 4, dtype=torch.int32, device=DEVICE)
    if kind == "no-format":
        return lambda: sparse_mla_fwd(q, cache, idx, 0.1)
    if kind == "nope-d512":
        return lambda: sparse_mla_fwd(q[..., :512].contiguous(), cache, idx, 0.1, kv_format=FP8)
    if kind == "row-size":
        return lambda: sparse_mla_fwd(q, cache[:, :576], idx, 0.1, kv_format=FP8)
    if kind == "kv-dtype":
        return lambda: sparse_mla_fwd(q, cache.to(DTYPE), idx, 0.1, kv_format=FP8)
    if kind == "format-name":
        return lambda: sparse_mla_fwd(q, cache, idx, 0.1, kv_format="fp8_e4m3")
    if kind == "layer-kv_c":
        w = torch.randn(4 * 64, 512).to(DTYPE).to(DEVICE)
        return lambda: dsa_prefill(q[:, :, :32], q[:, :, :64], w, idx, kv_c=cache, cached_lens=[6], new_lens=[2],
                                   sm_scale=0.1, kv_format=FP8)
    if kind == "layer-rank":
        w = torch.randn(4 * 64, 448).to(DTYPE).to(DEVICE)  # kv_lora_rank 448 + rope 128 = 576, not the format's split
        return lambda: dsa_prefill(q[:, :, :32], torch.randn(2, 4, 128).to(DTYPE).to(DEVICE), w, idx, kv=cache,
                                   cached_lens=[6], new_lens=[2], sm_scale=0.1, kv_format=FP8)
    raise AssertionError(kind)


@pytest.mark.parametrize("kind, exc, match", [
    pytest.param("no-format", TypeError, "pass kv_format='fp8_ds_mla'", id="uint8-kv-without-kv_format"),
    pytest.param("nope-d512", ValueError, "D_qk .* must be 576", id="d_qk-512"),
    pytest.param("row-size", ValueError, "656 bytes", id="row-size"),
    pytest.param("kv-dtype", TypeError, "uint8 or float8_e4m3fn", id="kv-dtype"),
    pytest.param("format-name", ValueError, "kv_format must be None .*'fp8_ds_mla'", id="format-name"),
    pytest.param("layer-kv_c", ValueError, "pass the cache whole as kv", id="layer-kv_c"),
    pytest.param("layer-rank", ValueError, "kv_lora_rank = 512", id="layer-rank"),
])
def test_bad_fp8_calls_raise_before_any_launch(kind, exc, match, monkeypatch):
    from sparse_mla.mqa import backends

    def launched(*a, **k):
        raise AssertionError("a kernel was launched before the argument check")

    for name in ("per_token", "grouped"):
        monkeypatch.setattr(backends, name, launched)
    with pytest.raises(exc, match=match):
        _bad_call(kind)()


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
    name, why = backends.select_backend(q, rows)
    assert name == "gluon_sm90", why
    assert backends.select_backend(q[:, :16], rows, pseudo_heads=128)[0] == "gluon_sm90"  # grouped tile
    # few heads on many tokens: the Triton kernel's small tiles win on a bf16 cache (split schedule), not on an FP8 one
    monkeypatch.setattr(gluon_sm90, "SCHEDULE", "split")
    q16 = torch.zeros(backends.GLUON_FEW_HEADS_MAX_TOKENS + 1, 16, 576, dtype=torch.bfloat16)
    assert backends.select_backend(q16, rows)[0] == "gluon_sm90"
    assert backends.select_backend(q16, torch.zeros(100, 576, dtype=torch.bfloat16))[0] == "triton"


@pytest.mark.parametrize("schedule", ["pair", "split"])
def test_fp8_cache_runs_the_split_schedule_whatever_the_bf16_schedule(hopper, monkeypatch, schedule):
    """SPARSE_MLA_GLUON_SCHEDULE picks the schedule of bf16 / fp16 caches; an FP8 cache runs split (the schedule with
    a dequantizing producer) either way, and its variant is one the package compiles."""
    from sparse_mla.mqa import backends, gluon_sm90

    monkeypatch.setattr(gluon_sm90, "SCHEDULE", schedule)
    q, rows = _fp8_selection_inputs()
    assert backends.select_backend(q, rows)[0] == "gluon_sm90"
    assert gluon_sm90.schedule_for(True) == "split" and gluon_sm90.schedule_for(False) == schedule
    assert gluon_sm90.variant_constexprs(False, True, kv_fp8=True)["KV_FP8"]
    assert (False, True, "bf16", gluon_sm90.schedule_for(True), True) in gluon_sm90.all_variants()


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
    name, why = backends.select_backend(q, rows)
    assert name == "triton" and match in why
    monkeypatch.setenv(backends.ENV_VAR, "gluon_sm90")
    with pytest.raises(ValueError, match=match):
        backends.select_backend(q, rows)


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
    assert backends.select_backend(q, rows)[0] == "triton"


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
                                               overlap_guard=None)
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
    inp = _layer_inputs(34)
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
                                         overlap_guard=None)
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
    monkeypatch.setitem(gluon_sm90._NUM_SMS, str(q.device), 3)
    kw = dict(method=method) | ({"cu_seqlens_q": cu_seqlens([20, 17]), "overlap_guard": None} if method == "grouped"
                                 else {})
    _fp8_backend_pair(monkeypatch, q, cache, idx, 0.04, topk_length=tl_, **kw)
    assert torch.uint8 in gluon_launches, "the Gluon FP8 variant did not run"


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
# The layer and the block-table path


def _layer_inputs(seed: int, *, paged: bool = False):
    """Two requests (20 cached + 6 new at rows 0.., 0 cached + 5 new at rows 30..; rows 26..29 belong to no
    window), K = 16 (the first request's windows exceed it), H 16, qk_nope = v = 32."""
    g = torch.Generator().manual_seed(seed)
    H, dn, dv, K, N = 16, 32, 32, 16, 40
    cached, new, offs = [20, 0], [6, 5], [0, 30]
    T = sum(new)
    idx = torch.full((T, K), -1, dtype=torch.int32)
    t = 0
    for b in range(2):
        for i in range(new[b]):
            win = cached[b] + i + 1
            sel = torch.randperm(win, generator=g)[:min(K, win)] + offs[b]
            idx[t, :sel.numel()] = sel.to(torch.int32)
            t += 1
    cache = FMT.quantize(spread_kv(N, seed=seed))
    return dict(q_nope=torch.randn(T, H, dn, generator=g).to(DTYPE).to(DEVICE),
                q_pe=torch.randn(T, H, 64, generator=g).to(DTYPE).to(DEVICE),
                w_kv_b=(torch.randn(H * (dn + dv), 512, generator=g) / 512**0.5).to(DTYPE).to(DEVICE),
                indices=idx.to(DEVICE), kv=cache.view(5, 8, 656) if paged else cache, cached_lens=cached,
                new_lens=new, row_offsets=offs, sm_scale=0.1, kv_format=FP8)


@pytest.mark.parametrize("path, paged", [
    pytest.param("masked_mha", False, id="masked_mha"),
    pytest.param("mqa_grouped", True, id="mqa_grouped-paged"),
    pytest.param("mqa_per_token", False, id="mqa_per_token"),
])
def test_dsa_prefill_fp8_paths_match_layer_reference(path, paged):
    inp = _layer_inputs(31, paged=paged)
    ref = dsa_prefill_ref(**inp)
    assert torch.allclose(ref, dsa_prefill_ref(**inp, form="mha"), rtol=1e-4, atol=1e-5)
    plain = {**inp, "kv": FMT.dequantize(inp["kv"], DTYPE).reshape(-1, 576), "kv_format": None}
    assert torch.equal(ref, dsa_prefill_ref(**plain))  # the definition: the dequantized cache
    out = torch.full((11, 16, 32), float("nan"), dtype=DTYPE, device=DEVICE)
    o, d = dsa_prefill(**inp, path=path, out=out, return_decision=True)
    assert d.path == path and o is out
    assert_rows_close(out, ref, DTYPE, f"{path} o", LAYER_ROW_TOLERANCE)


def test_dsa_prefill_fp8_dense_path_matches_layer_reference():
    inp = _layer_inputs(32)
    inp.update(cached_lens=[0, 0], new_lens=[6, 5])
    idx = torch.full((11, 16), -1, dtype=torch.int32)
    for t, (o, i) in enumerate([(0, i) for i in range(6)] + [(30, i) for i in range(5)]):
        idx[t, : i + 1] = torch.randperm(i + 1) + o  # whole windows: dense-eligible
    inp["indices"] = idx.to(DEVICE)
    out, d = dsa_prefill(**inp, return_decision=True)
    assert d.path == "dense_mha"
    assert_rows_close(out, dsa_prefill_ref(**inp), DTYPE, "dense_mha o", LAYER_ROW_TOLERANCE)


def test_dsa_prefill_fp8_check_flags_a_nonfinite_window_row():
    inp = _layer_inputs(33)
    FMT.scales(inp["kv"])[24, 0] = float("inf")  # inside request 0's window; selected or not, the MHA paths read it
    with pytest.raises(ValueError, match=r"cache rows \[24\]"):
        dsa_prefill(**inp, check=True)
    FMT.scales(inp["kv"])[24, 0] = 1.0
    FMT.scales(inp["kv"])[27, 1] = float("nan")  # row 27 is in no window: never read, never flagged
    dsa_prefill(**inp, check=True, path="mqa_per_token")


def test_block_table_path_on_a_strided_paged_fp8_cache():
    """FlashMLA's test layout (blocks one row apart: block stride (block_size + 1) * 656, float8_e4m3fn
    [num_blocks, block_size, 1, 656]) through paged_kv_as_rows + convert_req_index_to_global + sparse_mla_fwd,
    against the reference on each request's logical rows."""
    from sparse_mla.integration import convert_req_index_to_global, paged_kv_as_rows

    H, K, bs, nb = 16, 24, 8, 9
    g = torch.Generator().manual_seed(41)
    storage = torch.zeros(nb, bs + 1, 656, dtype=torch.uint8, device=DEVICE)
    cache = storage.view(torch.float8_e4m3fn)[:, :bs].unsqueeze(2)  # [nb, bs, 1, 656]
    logical = [spread_kv(30, seed=42), spread_kv(20, seed=43)]  # two requests' token rows
    table = torch.tensor([[7, 2, 5, 0], [4, 8, 1, -1]], dtype=torch.int32)
    for r, kv in enumerate(logical):
        for p in range(kv.shape[0]):
            FMT.quantize(kv[p:p + 1], out=cache[table[r, p // bs], p % bs])
    rows, stride_rows = paged_kv_as_rows(cache, kv_format=FP8)
    assert stride_rows == bs + 1 and rows.dtype == torch.uint8 and rows.shape == ((nb - 1) * (bs + 1) + bs, 656)
    req_id = torch.tensor([0, 0, 0, 1, 1], dtype=torch.int32, device=DEVICE)
    local = torch.full((5, K), -1, dtype=torch.int32)
    for t, r in enumerate(req_id.tolist()):
        n = min(K, 30 if r == 0 else 20)  # request 1 has 20 < K positions: -1 after them
        local[t, :n] = torch.randperm(30 if r == 0 else 20, generator=g)[:n].to(torch.int32)
    local[1, 20:] = -1
    idx = convert_req_index_to_global(req_id, table.to(DEVICE), local.to(DEVICE), bs, kv_block_stride_rows=stride_rows)
    q = torch.randn(5, H, 576, generator=g).to(DTYPE).to(DEVICE)
    out, lse = poisoned_out(5, H)
    sparse_mla_fwd(q, rows, idx, 0.05, out=out, lse=lse, kv_format=FP8, check=True)
    for r, (a, e) in enumerate([(0, 3), (3, 5)]):
        ref_out, ref_lse = sparse_mla_ref(q[a:e], FMT.quantize(logical[r]), local[a:e].to(DEVICE), 0.05, kv_format=FP8)
        assert_matches_reference(out[a:e], lse[a:e], ref_out, ref_lse, DTYPE)
    with pytest.raises(TypeError, match="uint8 or float8_e4m3fn"):
        paged_kv_as_rows(torch.zeros(2, 4, 656, dtype=DTYPE), kv_format=FP8)


def test_custom_op_and_warmup_take_the_fp8_cache():
    from sparse_mla.integration import ops
    from sparse_mla.integration.warmup import warmup

    q, cache, idx = fp8_problem(3, 16, 16, 40, seed=51)
    out, lse = torch.ops.sparse_mla.fwd(q, cache, idx, 0.1, method="per_token", kv_format=FP8)
    ref_out, ref_lse = sparse_mla_ref(q, cache, idx, 0.1, kv_format=FP8)
    assert_matches_reference(out, lse, ref_out, ref_lse, DTYPE)
    ops._fwd_fake(q, cache, idx, 0.1, kv_format=FP8)  # the fake runs the same checks
    with pytest.raises(TypeError, match="kv_format='fp8_ds_mla'"):
        ops._fwd_fake(q, cache, idx, 0.1)
    rep = warmup(16, 576, 16, DTYPE, DEVICE, 2, num_kv_rows=40, return_lse=(True,), topk_length=(False,),
                 converter=False, kv_format=FP8)
    assert rep.calls >= 2
    with pytest.raises(ValueError, match="d_qk must be 576"):
        warmup(16, 512, 16, DTYPE, DEVICE, 2, num_kv_rows=40, kv_format=FP8)


# ---------------------------------------------------------------------------------------------------------------
# The FP8 variants compile for sm_90 (Triton's front end, LLVM and ptxas on the CPU, as tests/test_gluon_compile.py)

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
for block_m, grouped in ((16, False), (64, False), (64, True)):
    bn, warps, stages = t.LAUNCH_CONFIGS_FP8[block_m]
    cx = dict(GROUPED=grouped, HAS_TOPK_LEN=not grouped, HAS_ROUTE=False, HAS_PE=True, GROUP_HEADS=128 if grouped else block_m,
              BLOCK_M=block_m, BLOCK_N=bn, D_V=512, D_PE=64, KV_FP8=True, SINK=None, MAX_LOGITS=None)
    ptr = dict(Q="*bf16", KV="*u8", OUT="*bf16", LSE="*fp32")
    ints = {"N", "H", "K"} | {n for n in names if n.startswith("stride")}
    sig = {n: "constexpr" if n in cx else ptr.get(n, "i32" if n in ints else "fp32" if n == "scale_log2" else "*i32")
           for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ("Q", "KV", "IDX", "OUT", "stride_kvn", "stride_qt")}
    ck = triton.compile(ASTSource(k, sig, constexprs=cx, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": warps, "num_stages": stages})
    ptx = ck.asm["ptx"]
    rows.append(dict(block_m=block_m, grouped=grouped, shared=ck.metadata.shared, triton=triton.__version__,
                     cvt=sorted(set(re.findall(r"cvt\.[a-z0-9.]*e4m3[a-z0-9.]*", ptx))),
                     mma=sorted(set(re.findall(r"(?:wgmma\.mma_async|mma\.sync)\.[a-z0-9.]*bf16", ptx)))))
print(json.dumps(rows))
"""


def test_fp8_variants_compile_for_sm90_with_the_hardware_conversion():
    """The FP8 gather compiles for sm_90 with the Triton the GPU runs (the Gluon kernels' pinned version), within
    the H100 / H200 shared memory, converting with the e4m3 -> f16x2 cvt instruction (no software decode) and
    multiplying in bf16 tensor-core MMAs."""
    rows = run_sm90_compile(_COMPILE, "the FP8 kernel variants")
    assert len(rows) == 3
    for row in rows:
        assert row["cvt"] == ["cvt.rn.f16x2.e4m3x2"], row
        assert row["mma"] and 0 < row["shared"] <= SMEM_LIMIT, row


# ---------------------------------------------------------------------------------------------------------------
# The bench


def test_bench_kv_dtype_fp8(tmp_path):
    """`sparse-mla bench --kv-dtype fp8` on one tiny scenario: every supported path checked against the reference
    on the dequantized cache, compared to the unquantized one (a larger error: the quantization's), the
    dequantize-then-bf16 baseline among the paths, the report's extra columns."""
    from typer.testing import CliRunner

    from sparse_mla.bench.baselines import DEQUANT_NAME, PATH_COLUMNS
    from sparse_mla.cli import app

    runner = CliRunner()
    out = tmp_path / "b.json"
    res = runner.invoke(app, ["bench", "--dims", "16,512,32,64,32", "--tokens", "12", "--cached", "24", "--topk", "16",
                              "--kv-dtype", "fp8", "--json", str(out), "--plot", ""])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["meta"]["kv_format"] == FP8
    (row,) = data["results"]
    assert row["kv_format"] == FP8 and row["failures"] == [] and row["pad64_baseline"].startswith("dequant+")
    assert set(row["paths"]) == {*PATH_COLUMNS, DEQUANT_NAME}
    timed = [name for name, rec in row["paths"].items() if rec["supported"]]
    assert DEQUANT_NAME in timed and "mqa_per_token" in timed and "mqa_grouped" in timed
    for name in timed:
        rec = row["paths"][name]
        assert rec["check_ok"] and rec["rel_err"] < row["check_tol"], (name, rec["rel_err"])
        assert rec["rel_err_vs_bf16_cache"] > 5 * rec["rel_err"], (name, rec)  # the cache's own quantization error
    assert row["max_rel_err_vs_bf16_cache"] == max(row["paths"][n]["rel_err_vs_bf16_cache"] for n in timed)
    rep = runner.invoke(app, ["report", "--markdown", str(out)])
    assert rep.exit_code == 0 and "kv cache fp8_ds_mla" in rep.output and f"{DEQUANT_NAME} ms" in rep.output


def test_kernel_bench_module_smoke(tmp_path):
    """`python -m sparse_mla.bench.kv_fp8` (the GPU A/B of bf16 vs FP8 caches) runs on the CPU on tiny sizes and
    checks every variant."""
    from sparse_mla.bench import kv_fp8

    out = tmp_path / "k.json"
    rows = kv_fp8.main(["--heads", "16", "--grouped-heads", "16", "--tokens", "9", "--topk", "16", "--rows", "64",
                        "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["rows"] == rows and {r["case"] for r in rows} == {"per_token H16", "grouped H16 G8"}
    variants = {r["variant"] for r in rows}
    assert {"bf16", "bf16 triton", "fp8", "dequant+bf16"} <= variants
    for r in rows:
        assert r["check_ok"], r
        if r["variant"].startswith(("fp8", "dequant")):
            assert r["max_row_err_vs_bf16_cache"] > r["max_row_err"], r


def test_kernel_bench_variants_filter(tmp_path, capsys):
    """`--variants` keeps only the named rows; an unknown name is refused with the list of rows."""
    from sparse_mla.bench import kv_fp8

    out = tmp_path / "k.json"
    rows = kv_fp8.main(["--heads", "16", "--grouped-heads", "", "--tokens", "5", "--topk", "8", "--rows", "32",
                        "--variants", "bf16,fp8", "--json", str(out)])
    assert [r["variant"] for r in rows] == ["bf16", "fp8"] and all(r["check_ok"] for r in rows)
    with pytest.raises(SystemExit):
        kv_fp8.main(["--variants", "bf16,fp9", "--json", str(out)])
    assert "unknown ['fp9']" in capsys.readouterr().err
