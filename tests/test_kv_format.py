"""The FP8 ``fp8_ds_mla`` latent cache format (``sparse_mla.kv_format``): bytes, scales, round trip, validation."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from testlib.device import DEVICE, DTYPE
from testlib.fp8 import FMT, FP8, spread_kv

from sparse_mla import dsa_prefill, sparse_mla_fwd
from sparse_mla.kv_format import check_kv_format


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


