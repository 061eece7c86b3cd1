"""``sparse_mla.flash_mla_with_kvcache`` / ``get_mla_metadata``: FlashMLA's sparse decode call as a drop-in
(deepseek-ai/FlashMLA 9241ae3 ``flash_mla/flash_mla_interface.py``, ``tests/test_flash_mla_sparse_decoding.py``).

Every call writes into NaN-poisoned outputs (the module's allocation helper is patched) and is compared per
(token, head) row with the fp32 reference ``flash_mla_with_kvcache_ref``, which is itself held to an independent
gather written here from FlashMLA's ``ref_sparse_attn_decode`` (cache rows addressed as k_cache[block, offset]).
Cases: a bf16 / fp16 cache (d 576 and 512) and the FP8 ``fp8_ds_mla`` cache, b 1 / 3 / 5, s_q 1..4, h_q 1 / 16 / 64,
odd page sizes and padded block strides, unused cache rows NaN, -1 and out-of-range padding, topk_length per
request (0 included), a request with no valid index, attn_sink with +-inf; forced split-KV; FlashMLA's own
correctness and corner lists scaled down; the metadata object; errors raised before any launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from testlib.device import DEVICE, DTYPE, INT_MAX, INT_MIN
from testlib.flashmla_cases import assert_allclose_flashmla
from testlib.fp8 import FMT, spread_kv
from testlib.tolerances import assert_lse_close, assert_rows_close

import sparse_mla
from sparse_mla import flash_mla_with_kvcache, flash_mla_with_kvcache_ref, get_mla_metadata
from sparse_mla.mqa import flashmla_decode, interface, split_combine

INF = float("inf")
NAN_BYTE = 0xFF  # an FP8 cache row of 0xFF bytes: NaN e4m3 values, NaN fp32 scales, NaN bf16 rope


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    """Every output the call allocates starts NaN: an element it forgets to write fails the comparison."""
    def nan_empty(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    monkeypatch.setattr(flashmla_decode, "_empty", nan_empty)


@dataclass(frozen=True)
class Case:
    b: int
    s_q: int
    h_q: int
    topk: int
    page: int  # page_block_size
    blocks: int  # num_blocks
    d: int = 576
    fp8: bool = False
    lens: bool = True  # topk_length per request (0 for request 0 when b > 1)
    sink: bool = True  # attn_sink with -inf / +inf heads
    pad_block: int = 0  # extra rows between blocks (block stride > page * row)
    empty_request: bool = False  # the last request selects no valid row
    seed: int = 0
    scale: float | None = None
    flashmla_data: bool = False  # FlashMLA's distribution (q in [-1, 1], kv randn / 10 in [-1, 1]), else spread FP8 tiles

    @property
    def id(self) -> str:
        return (f"b{self.b}-sq{self.s_q}-h{self.h_q}-k{self.topk}-p{self.page}x{self.blocks}-d{self.d}"
                f"{'-fp8' if self.fp8 else ''}{'-lens' if self.lens else ''}{'-sink' if self.sink else ''}"
                f"{f'-padblk{self.pad_block}' if self.pad_block else ''}{'-empty' if self.empty_request else ''}")


def make_inputs(c: Case) -> dict:
    """FlashMLA's test data, small: each request reads a causal window of its own logical positions (a random
    permutation, -1 past the window), mapped through its own random block table to physical rows; rows no request
    can see are NaN; sentinels (INT_MIN, -2, num_rows, INT_MAX) at a few positions; topk_length ~ U[0, topk]."""
    g = torch.Generator().manual_seed(c.seed)
    n_rows = c.blocks * c.page
    lim = 1 if c.flashmla_data else 2
    q = torch.randn(c.b, c.s_q, c.h_q, c.d, generator=g).clamp(-lim, lim)
    if c.fp8:
        kv = (torch.randn(n_rows, 576, generator=g) / 10).clamp(-1, 1) if c.flashmla_data else \
            spread_kv(n_rows, seed=c.seed, device="cpu")
        cache = FMT.quantize(kv).view(c.blocks, c.page, 1, FMT.row_bytes)
        width, fill = FMT.row_bytes, NAN_BYTE
    else:
        cache = (torch.randn(c.blocks, c.page, 1, c.d, generator=g) / (10 if c.flashmla_data else 2)).to(DTYPE)
        width, fill = c.d, float("nan")
    seen = torch.zeros(n_rows, dtype=torch.bool)
    per_req = c.blocks // c.b
    idx = torch.full((c.b, c.s_q, c.topk), -1, dtype=torch.int32)
    for i in range(c.b):
        table = torch.randperm(c.blocks, generator=g)[:per_req]  # request i's pages (may be shared: fine)
        seqlen = int(torch.randint(max(1, per_req * c.page // 2), per_req * c.page + 1, (1,), generator=g))
        for t in range(c.s_q):
            window = seqlen - (c.s_q - 1 - t)  # MTP: token t sees the prefix up to itself
            pos = torch.randperm(window, generator=g)[:c.topk]
            phys = table[pos // c.page] * c.page + pos % c.page
            idx[i, t, :pos.numel()] = phys.to(torch.int32)
            seen[phys] = True
    sentinels = torch.tensor([INT_MIN, -2, n_rows, INT_MAX], dtype=torch.int32)
    where = torch.randint(0, c.topk, (c.b, c.s_q, 4), generator=g)
    idx.scatter_(2, where, sentinels.expand(c.b, c.s_q, 4).contiguous())
    if c.empty_request:
        idx[-1] = sentinels.repeat(c.topk // 4 + 1)[:c.topk]
    flat = cache.view(n_rows, 1, width)
    flat[~seen] = fill
    if c.pad_block:  # the same rows in blocks farther apart: block stride (page + pad) rows
        big = torch.full((c.blocks, c.page + c.pad_block, 1, width), fill, dtype=cache.dtype)
        big[:, :c.page] = cache
        cache = big[:, :c.page]
    lens = None
    if c.lens:
        lens = torch.randint(0, c.topk + 1, (c.b,), generator=g, dtype=torch.int32)
        lens[0] = 0 if c.b > 1 else c.topk
    sink = None
    if c.sink:
        sink = torch.randn(c.h_q, generator=g)
        if c.h_q >= 3:
            sink[0], sink[-1] = INF, -INF
    dev = lambda x: None if x is None else x.to(DEVICE)  # noqa: E731
    return dict(q=q.to(DTYPE).to(DEVICE), k_cache=dev(cache), block_table=None, cache_seqlens=None, head_dim_v=512,
                softmax_scale=c.scale, is_fp8_kvcache=c.fp8, indices=dev(idx), attn_sink=dev(sink),
                topk_length=dev(lens))


def independent_ref(x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's ``ref_sparse_attn_decode`` in fp32, written apart from the package: rows gathered as
    k_cache[block, offset] of the (dequantized) cache, invalid entries (-1, out of range, past topk_length) masked."""
    q, k, idx = x["q"].float(), x["k_cache"], x["indices"].long()
    b, s_q, h_q, d = q.shape
    nb, bs = k.shape[:2]
    kv = FMT.dequantize(k, x["q"].dtype) if x["is_fp8_kvcache"] else k
    kv = kv[:, :, 0].float()
    valid = (idx >= 0) & (idx < nb * bs)
    if x["topk_length"] is not None:
        valid &= torch.arange(idx.shape[-1], device=idx.device) < x["topk_length"].long()[:, None, None]
    safe = torch.where(valid, idx, 0)
    rows = torch.where(valid[..., None], kv[safe // bs, safe % bs], 0.0)  # [b, s_q, topk, d]
    scale = x["softmax_scale"] if x["softmax_scale"] is not None else d ** -0.5
    s = torch.einsum("bthd,btkd->bthk", q, rows) * scale
    s = s.masked_fill(~valid[:, :, None, :], -INF)
    lse = torch.logsumexp(s, dim=-1)  # [b, s_q, h_q]
    p = torch.where(lse[..., None] == -INF, 0.0, torch.exp(s - lse[..., None]))
    out = torch.einsum("bthk,btkd->bthd", p, rows[..., :512])
    if x["attn_sink"] is not None:
        out = out / (1 + torch.exp(x["attn_sink"] - lse))[..., None]
    out = torch.where(lse[..., None] == -INF, 0.0, out)
    return out, lse.masked_fill(lse == -INF, INF).transpose(1, 2)


def assert_decode_matches(out, lse, ref_out, ref_lse, dtype) -> None:
    """out per (token, head) row within the dtype's row tolerance (rows of empty queries exactly 0); lse +inf exactly
    where the reference is, within the lse tolerance elsewhere."""
    assert torch.equal(lse == INF, ref_lse == INF), "lse must be +inf exactly where the query has no valid index"
    assert not (lse == -INF).any() and not lse.isnan().any()
    assert_rows_close(out, ref_out, dtype, "out")
    assert_lse_close(lse.masked_fill(lse == INF, -INF), ref_lse.masked_fill(ref_lse == INF, -INF))


def run_case(c: Case, **kwargs):
    x = make_inputs(c)
    meta, none = get_mla_metadata()
    assert none is None
    out, lse = flash_mla_with_kvcache(**x, tile_scheduler_metadata=meta, **kwargs)
    assert out.shape == (c.b, c.s_q, c.h_q, 512) and out.dtype == DTYPE and out.is_contiguous()
    assert lse.shape == (c.b, c.h_q, c.s_q) and lse.dtype == torch.float32
    assert lse.stride() == (c.s_q * c.h_q, 1, c.h_q), "lse: a transposed view of a contiguous [b, s_q, h_q]"
    ref_out, ref_lse = flash_mla_with_kvcache_ref(**x)
    assert_decode_matches(out, lse, ref_out, ref_lse, DTYPE)
    assert meta.have_initialized and meta.config.b == c.b and meta.config.is_fp8 == c.fp8
    return x, out, lse, ref_out, ref_lse


CASES = [
    Case(1, 1, 64, 200, 61, 8),
    Case(3, 2, 16, 128, 16, 24, pad_block=5),
    Case(5, 4, 1, 64, 16, 20, d=512),
    Case(3, 3, 64, 150, 61, 9, d=512, empty_request=True, pad_block=3),
    Case(3, 2, 16, 150, 61, 9, fp8=True, empty_request=True),
    Case(5, 1, 64, 64, 16, 20, fp8=True, pad_block=2, scale=576**-0.55),
    Case(1, 4, 1, 100, 16, 12, fp8=True, lens=False),
    Case(3, 1, 16, 200, 16, 30, lens=False, sink=False, empty_request=True),
]


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_matches_reference(c):
    x, out, lse, ref_out, ref_lse = run_case(c)
    ind_out, ind_lse = independent_ref(x)
    assert_allclose_flashmla("reference out", ref_out, ind_out, abs_tol=1e-5, rel_tol=1e-4)
    assert_allclose_flashmla("reference lse", ref_lse, ind_lse, abs_tol=1e-5, rel_tol=1e-6)
    if c.empty_request:
        assert (out[-1] == 0).all() and (lse[-1] == INF).all()
    if c.lens and c.b > 1:  # request 0 has topk_length 0
        assert (out[0] == 0).all() and (lse[0] == INF).all()
    if c.sink and c.h_q >= 3:  # head 0: sink +inf -> out 0, lse untouched
        assert (out[:, :, 0] == 0).all()
        assert torch.equal(torch.isfinite(lse[:, 0]), torch.isfinite(ref_lse[:, 0]))


@pytest.mark.parametrize("fp8", [False, True], ids=["cache16", "fp8"])
def test_forced_kv_splits(fp8, monkeypatch):
    """kv_splits=3 really splits (the combine runs once, over 3 partials) and gives the reference's result."""
    calls = []
    real = split_combine.combine_splits

    def spy(parts, *args):
        calls.append((parts.num_splits, parts.lse.numel(), torch.isfinite(parts.lse).sum().item()))
        real(parts, *args)

    monkeypatch.setattr(interface, "combine_splits", spy)
    c = Case(3, 2, 16, 200, 16, 24, fp8=fp8, empty_request=True)
    run_case(c, kv_splits=3)
    assert len(calls) == 1, "the combine must run once"
    S, n, finite = calls[0]
    assert S == 3 and n == 3 * c.b * c.s_q * c.h_q and finite > 0


def test_default_splits_on_cpu(monkeypatch):
    monkeypatch.setattr(interface, "combine_splits", lambda *a: pytest.fail("S = 1 on the CPU: no combine"))
    run_case(Case(1, 2, 16, 64, 16, 8))


def test_sink_infinities_exact():
    """-inf sink: out bitwise the no-sink out; +inf: out 0; lse the same in all three."""
    c = Case(3, 2, 4, 64, 16, 12, sink=False)
    x = make_inputs(c)
    base_out, base_lse = flash_mla_with_kvcache(**x, tile_scheduler_metadata=None)
    x["attn_sink"] = torch.tensor([-INF, INF, -INF, INF], device=DEVICE)
    out, lse = flash_mla_with_kvcache(**x, tile_scheduler_metadata=None)
    assert torch.equal(out[:, :, [0, 2]], base_out[:, :, [0, 2]]) and (out[:, :, [1, 3]] == 0).all()
    assert torch.equal(lse, base_lse)


def test_same_result_as_sparse_mla_fwd():
    """The drop-in is sparse_mla_fwd on the flattened rows plus FlashMLA's conventions (lse +inf, transposed)."""
    c = Case(3, 2, 16, 128, 16, 12, empty_request=True)
    x = make_inputs(c)
    out, lse = flash_mla_with_kvcache(**x, tile_scheduler_metadata=None)
    T = c.b * c.s_q
    lens = x["topk_length"].repeat_interleave(c.s_q)
    out2, lse2 = sparse_mla.sparse_mla_fwd(x["q"].reshape(T, c.h_q, 576), x["k_cache"][:, :, 0],
                                           x["indices"].reshape(T, -1), 576**-0.5, topk_length=lens,
                                           attn_sink=x["attn_sink"], return_lse=True, method="per_token")
    assert torch.equal(out.reshape(T, c.h_q, 512), out2)
    lse2 = lse2.masked_fill(lse2 == -INF, INF).view(c.b, c.s_q, c.h_q).transpose(1, 2)
    assert torch.equal(lse, lse2)


# FlashMLA's sparse-decode lists (tests/test_flash_mla_sparse_decoding.py), scaled down: (s_k, topk, page) from its
# correctness list {(512, 64, 2), (512, 64, 69), (1024, 576, 61)} and corner list {(512, 64, 61), (650, 576, 53)} over
# b 4, s_q 1 / 3, h_q 64, sink always on; d 576 on the FP8 cache (V3.2), d 512 on a bf16 cache with topk_length
# (FlashMLA's MODEL1 FP8 layout is not served); sm_scale d ** -0.55 as there.
FLASHMLA_SHAPES = [(64, 64, 2), (128, 64, 69), (192, 96, 61), (170, 96, 53)]
FLASHMLA_CASES = [
    Case(4, s_q, 64, topk, page, -(-s_k * 4 // page), d=d, fp8=d == 576, lens=d == 512, seed=i,
         scale=d ** -0.55, empty_request=s_k == 170, flashmla_data=True)
    for i, (s_k, topk, page) in enumerate(FLASHMLA_SHAPES) for s_q in (1, 3) for d in (576, 512)
]


@pytest.mark.parametrize("c", FLASHMLA_CASES, ids=lambda c: c.id)
def test_flashmla_lists(c):
    """FlashMLA's comparison rule and tolerances (out abs 1e-3 / rel 2.01/128 / cos 5e-6; lse abs 1e-6 / rel
    8.01/65536) on top of the per-row check."""
    _, out, lse, ref_out, ref_lse = run_case(c)
    assert_allclose_flashmla("out", out, ref_out, abs_tol=1e-3, rel_tol=2.01 / 128, cos_diff_tol=5e-6)
    assert_allclose_flashmla("lse", lse, ref_lse, abs_tol=1e-6, rel_tol=8.01 / 65536)


# ------------------------------------------------------------------------------- the metadata object

def test_metadata_records_and_holds_the_shape():
    meta, _ = get_mla_metadata(torch.zeros(3), 1, num_heads_k=1)  # arguments ignored, as FlashMLA's
    assert not meta.have_initialized
    c = Case(3, 1, 16, 64, 16, 12)
    x = make_inputs(c)
    flash_mla_with_kvcache(**x, tile_scheduler_metadata=meta)
    cfg = meta.config
    assert (cfg.b, cfg.s_q, cfg.h_q, cfg.page_block_size, cfg.d, cfg.is_fp8, cfg.topk) == (3, 1, 16, 16, 576, False, 64)
    x2 = make_inputs(Case(3, 1, 16, 64, 16, 12, seed=5))  # new values, same shape: fine
    flash_mla_with_kvcache(**x2, tile_scheduler_metadata=meta)
    assert meta.config == cfg
    x3 = make_inputs(Case(2, 1, 16, 64, 16, 12))
    with pytest.raises(ValueError, match=r"tile_scheduler_metadata.*b 3 -> 2"):
        flash_mla_with_kvcache(**x3, tile_scheduler_metadata=meta)
    flash_mla_with_kvcache(**x3, tile_scheduler_metadata=get_mla_metadata()[0])  # a new object per shape
    flash_mla_with_kvcache(**x3, tile_scheduler_metadata=None)  # None: no check


def test_metadata_not_recorded_by_a_failed_call():
    meta, _ = get_mla_metadata()
    x = make_inputs(Case(1, 1, 4, 64, 16, 4))
    with pytest.raises(ValueError):
        flash_mla_with_kvcache(**{**x, "head_dim_v": 256}, tile_scheduler_metadata=meta)
    assert not meta.have_initialized


# ------------------------------------------------------------------------------- errors before any launch

def _bad_fp8_d512(x):
    q = x["q"][..., :512].contiguous()
    return {"q": q, "is_fp8_kvcache": True}


def _model1_cache(x):
    return {"q": x["q"][..., :512].contiguous(), "is_fp8_kvcache": True,
            "k_cache": torch.zeros(4, 16, 1, 584, dtype=torch.uint8, device=DEVICE)}


BAD = [
    ("indices_none", lambda x: {"indices": None}, ValueError, ["indices=None", "sparse mode"]),
    ("causal", lambda x: {"causal": True}, ValueError, ["causal"]),
    ("num_splits", lambda x: {"num_splits": 2}, ValueError, ["num_splits", "FlashMLA also requires None"]),
    ("extra_k_cache", lambda x: {"extra_k_cache": x["k_cache"]}, ValueError, ["extra_k_cache", "not supported yet"]),
    ("extra_indices", lambda x: {"extra_indices_in_kvcache": x["indices"]}, ValueError, ["extra_indices_in_kvcache"]),
    ("extra_topk_length", lambda x: {"extra_topk_length": x["topk_length"]}, ValueError, ["extra_topk_length"]),
    ("head_dim_v", lambda x: {"head_dim_v": 256}, ValueError, ["head_dim_v", "512"]),
    ("h_k", lambda x: {"k_cache": x["k_cache"].expand(-1, -1, 2, -1)}, ValueError, ["k_cache", "h_k = 1"]),
    ("k_cache_3d", lambda x: {"k_cache": x["k_cache"][:, :, 0]}, ValueError, ["k_cache", "[num_blocks"]),
    ("indices_int64", lambda x: {"indices": x["indices"].long()}, TypeError, ["indices", "int32"]),
    ("indices_2d", lambda x: {"indices": x["indices"][:, 0]}, ValueError, ["indices", "[b, s_q, topk]"]),
    ("topk_length_shape", lambda x: {"topk_length": x["topk_length"][:1]}, ValueError, ["topk_length", "[b]"]),
    ("topk_length_dtype", lambda x: {"topk_length": x["topk_length"].long()}, TypeError, ["topk_length", "int32"]),
    ("attn_sink_shape", lambda x: {"attn_sink": x["attn_sink"][:3]}, ValueError, ["attn_sink", "[h_q]"]),
    ("attn_sink_dtype", lambda x: {"attn_sink": x["attn_sink"].half()}, TypeError, ["attn_sink", "float32"]),
    ("fp8_d512", _bad_fp8_d512, ValueError, ["MODEL1", "bf16 cache"]),
    ("fp8_model1_rows", _model1_cache, ValueError, ["MODEL1", "584"]),
    ("fp8_flag_missing", lambda x: {"k_cache": torch.zeros(4, 16, 1, 656, dtype=torch.uint8, device=DEVICE)},
     TypeError, ["k_cache", "is_fp8_kvcache=True"]),
    ("cache_dtype", lambda x: {"k_cache": x["k_cache"].float()}, TypeError, ["k_cache", "dtype"]),
    ("cache_width", lambda x: {"k_cache": x["k_cache"][..., :512]}, ValueError, ["k_cache", "576"]),
    ("q_3d", lambda x: {"q": x["q"][0]}, ValueError, ["q", "[b, s_q, h_q, d]"]),
    ("q_float32", lambda x: {"q": x["q"].float()}, TypeError, ["q"]),
    ("q_d", lambda x: {"q": x["q"][..., :256].contiguous()}, ValueError, ["q", "d"]),
    ("scale_nan", lambda x: {"softmax_scale": float("nan")}, ValueError, ["softmax_scale"]),
    ("kv_splits", lambda x: {"kv_splits": 0}, ValueError, ["kv_splits"]),
    ("meta_type", lambda x: {"tile_scheduler_metadata": object()}, TypeError, ["tile_scheduler_metadata"]),
    ("block_stride", lambda x: {"k_cache": torch.zeros(64 * 577, dtype=DTYPE, device=DEVICE)
                                .as_strided((4, 16, 1, 576), (16 * 576 + 1, 576, 576, 1))}, ValueError,
     ["k_cache", "block stride"]),
]


@pytest.mark.parametrize("change, exc, words", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_raises_before_any_launch(change, exc, words, monkeypatch):
    def no_launch(*a, **k):
        pytest.fail("validation must come before any launch")
    monkeypatch.setattr(flashmla_decode, "sparse_mla_fwd", no_launch)
    monkeypatch.setattr(flashmla_decode, "_lse_flashmla_convention", no_launch)
    monkeypatch.setattr(flashmla_decode, "_flat_indices", no_launch)
    x = make_inputs(Case(2, 2, 4, 64, 16, 4))
    x["tile_scheduler_metadata"] = None
    x.update(change(x))
    with pytest.raises(exc) as err:
        flash_mla_with_kvcache(**x)
    for w in words:
        assert w in str(err.value), f"{w!r} not in: {err.value}"


def test_reference_refuses_the_same():
    x = make_inputs(Case(2, 2, 4, 64, 16, 4))
    with pytest.raises(ValueError, match="extra_k_cache"):
        flash_mla_with_kvcache_ref(**x, extra_k_cache=x["k_cache"])
    with pytest.raises(ValueError, match="indices=None"):
        flash_mla_with_kvcache_ref(**{**x, "indices": None})


def test_positional_call_as_flashmla_tests_make_it():
    """tests/test_flash_mla_sparse_decoding.py's call, positionally (extra cache None)."""
    x = make_inputs(Case(2, 3, 16, 64, 16, 8, fp8=True))
    meta, _ = get_mla_metadata()
    out, lse = flash_mla_with_kvcache(x["q"], x["k_cache"], None, None, 512, meta, None, 576**-0.55, False, True,
                                      x["indices"], x["attn_sink"], None, None, x["topk_length"], None)
    ref_out, ref_lse = flash_mla_with_kvcache_ref(**{**x, "softmax_scale": 576**-0.55})
    assert_decode_matches(out, lse, ref_out, ref_lse, DTYPE)


def test_top_level_exports():
    for name in ("get_mla_metadata", "flash_mla_with_kvcache", "flash_mla_with_kvcache_ref"):
        assert name in dir(sparse_mla) and getattr(sparse_mla, name) is getattr(flashmla_decode, name)
