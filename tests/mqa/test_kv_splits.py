"""Split-KV (``sparse_mla_fwd(kv_splits=S)``): S programs share one list, ``split_combine`` merges their partials.

Every call writes into NaN-poisoned out= / lse= / max_logits= buffers and is compared per (token, head) row with the
fp32 reference (``sparse_mla_ref``), lse and max_logits included, on adversarial lists (-1 and out-of-range
padding, a query with no valid row, garbage past topk_length), with attn_sink, per token and grouped, D_qk 576 and
512, a bf16 / fp16 cache and the fp8_ds_mla cache (in the kernel's gather and staged). ``test_combine_really_ran``
shows that a forced S > 1 splits: the partials of a token differ per split and merge to the result. The automatic
choice (``sparse_mla.mqa.kv_splits``) is plain Python, tested here without a GPU.
"""

from __future__ import annotations

import math

import pytest
import torch
from testlib.adversarial import adversarial_indices, garbage_topk_length
from testlib.device import DEVICE, DTYPE
from testlib.fp8 import FP8, fp8_problem
from testlib.problems import assert_outside_untouched, cu_seqlens, make_problem, neighbour_rows, poisoned_views
from testlib.tolerances import assert_lse_close, assert_matches_reference

from sparse_mla import SparseMLAWorkspace, sparse_mla_fwd, sparse_mla_ref
from sparse_mla.mqa import interface, kv_splits, split_combine
from sparse_mla.mqa.kv_splits import KVSplitModel, choose_kv_splits

N_ROWS = 400


@pytest.fixture(autouse=True)
def _poisoned_partials(monkeypatch):
    """Every split call's partial buffers start NaN: a partial the kernels fail to write fails the test."""
    real = split_combine.split_partials

    def poisoned(*args, **kwargs):
        parts = real(*args, **kwargs)
        for t in (parts.out, parts.lse, parts.max_logits):
            if t is not None:
                t.fill_(float("nan"))
        return parts

    monkeypatch.setattr(interface, "split_partials", poisoned)


def _sink(H: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(H, generator=g)
    s[0], s[-1] = float("-inf"), float("inf")  # -inf changes nothing; +inf gives out 0 (H >= 2)
    return s.to(DEVICE)


def run_split_checked(q, kv, indices, sm_scale, *, topk_length=None, attn_sink=None, kv_format=None, **kwargs):
    """``sparse_mla_fwd`` into NaN-poisoned out / lse / max_logits views, compared per row with the reference."""
    T, H, _ = q.shape
    out_big, lse_big, out, lse = poisoned_views(T, H, pad_tokens=1, pad_heads=1, dtype=q.dtype)
    ml = torch.full((T, H), float("nan"), dtype=torch.float32, device=DEVICE)
    sparse_mla_fwd(q, kv, indices, sm_scale, topk_length=topk_length, return_lse=True, out=out, lse=lse,
                   attn_sink=attn_sink, max_logits=ml, kv_format=kv_format, **kwargs)
    ref_out, ref_lse, ref_ml = sparse_mla_ref(q, kv, indices, sm_scale, topk_length=topk_length, attn_sink=attn_sink,
                                              kv_format=kv_format, return_max_logits=True)
    assert_matches_reference(out, lse, ref_out, ref_lse, q.dtype)
    assert_lse_close(ml, ref_ml, "max_logits")
    assert_outside_untouched(out_big, lse_big, T, 1)
    return out, lse, ml


@pytest.mark.parametrize("S", [1, 2, 3, 8])
@pytest.mark.parametrize("H, d_qk", [pytest.param(16, 576, id="H16-d576"), pytest.param(3, 512, id="H3-d512")])
def test_per_token_splits(S, H, d_qk):
    T, K = 5, 200  # one token per adversarial pattern; K not a multiple of the 64-row tile
    g = torch.Generator().manual_seed(S * 7 + H)
    idx, tlen = garbage_topk_length(adversarial_indices(T, K, N_ROWS, generator=g), N_ROWS, generator=g)
    p = make_problem(T, H, K, N_ROWS, d_qk=d_qk, seed=S + H, indices=idx, topk_length=tlen)
    run_split_checked(p.q, p.kv, p.indices, p.sm_scale, topk_length=p.topk_length, attn_sink=_sink(H, S),
                      method="per_token", kv_splits=S)


@pytest.mark.parametrize("S", [1, 2, 3, 8])
def test_grouped_splits_several_requests(S, monkeypatch):
    """Grouped tiles over unions (G = 4 at H = 16), requests of 5, 0 (no new token) and 4 rows, no overlap guard: the
    grouped launch (two groups) and the per-token launch (request 1's tail) both write partials, one combine merges
    them."""
    from sparse_mla.mqa import backends

    seen = {}

    def spying(name):
        real = getattr(backends, name)

        def spy(*a, **k):
            seen[name] = k.get("kv_split")
            return real(*a, **k)
        return spy

    for name in ("grouped", "per_token"):
        monkeypatch.setattr(backends, name, spying(name))
    H, K, T = 16, 96, 9
    g = torch.Generator().manual_seed(S)
    idx = adversarial_indices(T, K, N_ROWS, generator=g, base=neighbour_rows(T, K, N_ROWS, 0.7, generator=g))
    p = make_problem(T, H, K, N_ROWS, seed=S, indices=idx)
    ws = SparseMLAWorkspace.for_problem(T, K, H, N_ROWS, DEVICE, group_size=4)
    run_split_checked(p.q, p.kv, p.indices, p.sm_scale, attn_sink=_sink(H, S), method="grouped", kv_splits=S,
                      cu_seqlens_q=cu_seqlens([5, 0, 4]), group_size=4, overlap_guard=math.inf, workspace=ws)
    assert ws.group_len[:3].tolist() == [4, 4, 0], "two groups ran grouped"
    assert ws.route[:T].tolist().count(1) == 1, "one request tail ran per token"
    assert set(seen) == {"grouped", "per_token"}
    assert all((v is not None) == (S > 1) for v in seen.values()), "both launches write partials when S > 1"


def test_splits_with_no_valid_row():
    """Every valid row in the first 64 columns: splits 2.. see none (empty partials); token 1 has none at all."""
    T, H, K = 3, 8, 256
    idx = torch.full((T, K), -1, dtype=torch.int32)
    idx[0, :50] = torch.randperm(N_ROWS, generator=torch.Generator().manual_seed(1))[:50].int()
    idx[2, 200:] = torch.arange(56, dtype=torch.int32)  # only the last split has rows
    p = make_problem(T, H, K, N_ROWS, seed=4, indices=idx)
    out, lse, ml = run_split_checked(p.q, p.kv, p.indices, p.sm_scale, attn_sink=_sink(H, 9), method="per_token",
                                     kv_splits=4)
    assert (out[1] == 0).all() and torch.isneginf(lse[1]).all() and torch.isneginf(ml[1]).all()


@pytest.mark.parametrize("route", ["in_kernel", "staged"])
@pytest.mark.parametrize("method", ["per_token", "grouped"])
def test_fp8_cache_splits(route, method):
    T, H, K, N = 6, 16, 128, 300
    q, cache, idx = fp8_problem(T, H, K, N, seed=3)
    run_split_checked(q, cache, idx, 576**-0.5, kv_format=FP8, kv_dequant=route, method=method, kv_splits=3,
                      attn_sink=_sink(H, 2))


def test_zero_tokens_with_splits():
    p = make_problem(0, 16, 8, N_ROWS, indices=torch.zeros(0, 8, dtype=torch.int32))
    out, lse = sparse_mla_fwd(p.q, p.kv, p.indices, p.sm_scale, return_lse=True, kv_splits=4)
    assert out.shape == (0, 16, 512) and lse.shape == (0, 16)


def test_combine_really_ran(monkeypatch):
    """A forced S = 3 launches the split kernel and the combine once: each split of a token holds a partial of its
    own rows (finite lse, different per split, each below the total), and the result is their exact merge."""
    seen = []
    real = split_combine.combine_splits

    def spy(parts, out, lse, max_logits, attn_sink):
        seen.append((parts.lse.clone(), parts.out.clone()))
        real(parts, out, lse, max_logits, attn_sink)

    monkeypatch.setattr(interface, "combine_splits", spy)
    p = make_problem(2, 4, 192, N_ROWS, seed=8)
    out, lse = sparse_mla_fwd(p.q, p.kv, p.indices, p.sm_scale, return_lse=True, method="per_token", kv_splits=3)
    assert len(seen) == 1, "the combine must run once"
    part_lse, part_out = seen[0]
    assert part_lse.shape == (2, 3, 4) and torch.isfinite(part_lse).all(), "every split of a full list has rows"
    assert (part_lse < lse.unsqueeze(1)).all(), "a split's lse covers only part of the rows"
    assert not torch.equal(part_lse[:, 0], part_lse[:, 1]) and not torch.equal(part_out[:, 0], part_out[:, 1])
    merged = torch.logsumexp(part_lse, dim=1)
    assert torch.allclose(merged, lse, atol=1e-5, rtol=0)
    w = torch.exp(part_lse - lse.unsqueeze(1)).unsqueeze(-1)
    assert torch.allclose((w * part_out).sum(1), out.float(), atol=2e-3, rtol=1e-2)


def test_unsplit_call_launches_no_combine(monkeypatch):
    monkeypatch.setattr(interface, "combine_splits", lambda *a: pytest.fail("S = 1 must not combine"))
    p = make_problem(2, 4, 64, N_ROWS, seed=8)
    run_split_checked(p.q, p.kv, p.indices, p.sm_scale, method="per_token", kv_splits=1)


@pytest.mark.parametrize("bad, exc", [(0, ValueError), (65, ValueError), (-1, ValueError), (2.0, TypeError),
                                      (True, TypeError), ("4", TypeError)])
def test_bad_kv_splits_raise_before_launch(bad, exc, monkeypatch):
    monkeypatch.setattr(interface, "combine_splits", lambda *a: pytest.fail("no launch on bad input"))
    p = make_problem(2, 4, 64, N_ROWS, seed=8)
    with pytest.raises(exc, match="kv_splits"):
        sparse_mla_fwd(p.q, p.kv, p.indices, p.sm_scale, kv_splits=bad)


# ---------------------------------------------------------------------------------------------------------------
# The automatic choice (plain Python)


@pytest.mark.parametrize("T, H, K, expect", [
    (1, 16, 2048, 8),     # one work item: bounded by 2048 rows / 256
    (4, 128, 2048, 8),    # 8 items (2 tiles each): 132 // 8 = 16, rows bound 8
    (64, 16, 2048, 2),    # 64 items: 132 // 64 = 2
    (128, 16, 2048, 1),   # fills the SMs
    (1, 16, 300, 1),      # too few rows for two splits of 256
    (1, 64, 100000, 16),  # max_splits
])
def test_choice_per_token(T, H, K, expect):
    S, why = choose_kv_splits(None, num_lists=T, pseudo_heads=H, rows_per_list=K, sms=132)
    assert S == expect, why
    assert why


def test_choice_forced_and_incapable():
    assert choose_kv_splits(5, num_lists=1000, pseudo_heads=128, rows_per_list=10, sms=132)[0] == 5
    S, why = choose_kv_splits(None, num_lists=1, pseudo_heads=16, rows_per_list=2048, sms=132, split_capable=False)
    assert S == 1 and "no split-KV variant" in why
    S, why = choose_kv_splits(None, num_lists=1, pseudo_heads=16, rows_per_list=2048, sms=1)
    assert S == 1 and "not a GPU" in why
    model = KVSplitModel(min_rows_per_split=64, max_splits=4)
    assert choose_kv_splits(None, num_lists=1, pseudo_heads=16, rows_per_list=2048, sms=132, model=model)[0] == 4


def test_choice_shape_only_and_visible(monkeypatch):
    """The op's choice follows from shapes (no device data) and explain_fwd reports it; on the CPU it is 1."""
    p = make_problem(1, 16, 64, N_ROWS, seed=8)
    text = interface.explain_fwd(p.q, p.kv, p.indices, kv_splits=None)
    assert "kv splits: 1 (not a GPU" in text
    assert "kv splits: 3 (kv_splits=3 forced)" in interface.explain_fwd(p.q, p.kv, p.indices, kv_splits=3)
    monkeypatch.setattr(kv_splits, "num_sms", lambda device: 132)
    monkeypatch.setattr(interface, "num_sms", lambda device: 132)
    text = interface.explain_fwd(p.q, p.kv, p.indices)
    assert "kv splits: 1 (64 rows per list" in text
    q = torch.zeros(1, 16, 576, dtype=DTYPE, device=DEVICE)
    idx = torch.zeros(1, 2048, dtype=torch.int32, device=DEVICE)
    assert "kv splits: 8 (" in interface.explain_fwd(q, p.kv, idx)


@pytest.mark.gpu
def test_cuda_graph_capture_of_a_split_call():
    """A split call captured in a CUDA graph replays on new inputs of the same shapes (fixed partial buffers)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    p = make_problem(4, 16, 512, 4096, seed=5)
    out = torch.empty(4, 16, 512, dtype=p.q.dtype, device=DEVICE)
    lse = torch.empty(4, 16, dtype=torch.float32, device=DEVICE)
    sparse_mla_fwd(p.q, p.kv, p.indices, p.sm_scale, out=out, lse=lse, return_lse=True, kv_splits=4)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sparse_mla_fwd(p.q, p.kv, p.indices, p.sm_scale, out=out, lse=lse, return_lse=True, kv_splits=4)
    p.q.copy_(torch.randn_like(p.q))
    graph.replay()
    torch.cuda.synchronize()
    ref_out, ref_lse = sparse_mla_ref(p.q, p.kv, p.indices, p.sm_scale)
    assert_matches_reference(out, lse, ref_out, ref_lse, DTYPE)


# ---------------------------------------------------------------------------------------------------------------
# On Hopper (the selection's Hopper branches as plain Python: the ``hopper`` fixture)


def _bf16_tensors(T: int, H: int, K: int):
    q = torch.zeros(T, H, 576, dtype=torch.bfloat16)
    return q, torch.zeros(4096, 576, dtype=torch.bfloat16), torch.zeros(T, K, dtype=torch.int32)


def test_hopper_auto_splits_a_decode_step_on_the_gluon_kernel(hopper, monkeypatch):
    """On an H200-sized GPU a 1-token step over 2048 rows splits 8 ways and the Gluon kernel's split variant runs it;
    a step that fills the SMs does not split."""
    from sparse_mla.mqa import backends

    monkeypatch.setattr(interface, "num_sms", lambda device: 132)
    q, kv, idx = _bf16_tensors(1, 16, 2048)
    text = interface.explain_fwd(q, kv, idx, 0.1)
    assert "kv splits: 8 (" in text and "attention backend: gluon_sm90" in text, text
    assert backends.kv_split_missing("gluon_sm90", grouped=False, kv_fp8=False) is None
    assert backends.kv_split_missing("gluon_sm90", grouped=True, kv_fp8=False) is None
    q, kv, idx = _bf16_tensors(512, 16, 2048)
    assert "kv splits: 1 (512 work items fill the 132 SMs)" in interface.explain_fwd(q, kv, idx, 0.1)


def test_hopper_fp8_grouped_splits_run_the_triton_kernel(hopper, monkeypatch):
    """Grouped tiles on an FP8 cache have no Gluon split variant: the automatic choice does not split them there, a
    forced split hands the launch to the Triton kernel, and forcing the Gluon backend raises with the reason."""
    from sparse_mla.mqa import backends, gluon_sm90

    why = backends.kv_split_missing("gluon_sm90", grouped=True, kv_fp8=True)
    assert why and "fp8_ds_mla" in why
    assert all(not (v[0] and v[4] and v[5]) for v in gluon_sm90.all_variants())
    with pytest.raises(ValueError, match="fp8_ds_mla"):
        gluon_sm90.variant_constexprs(True, True, "split", kv_fp8=True, kv_split=True)
    kv = torch.zeros(64, 656, dtype=torch.uint8)
    parts = split_combine.split_partials(2, 1, 16, torch.device("cpu"), with_max_logits=False)
    assert backends._split_fallback("gluon_sm90", "x", parts, kv, True) == ("triton", why)
    assert backends._split_fallback("gluon_sm90", "x", parts, kv, False) == ("gluon_sm90", "x")
    q, idx = torch.zeros(8, 16, 576, dtype=torch.bfloat16), torch.zeros(8, 64, dtype=torch.int32)
    text = interface.explain_fwd(q, kv, idx, 0.1, method="grouped", kv_format=FP8, kv_dequant="in_kernel", kv_splits=2)
    assert "attention backend: triton (grouped tiles on an fp8_ds_mla cache" in text, text
    monkeypatch.setenv(backends.ENV_VAR, "gluon_sm90")
    with pytest.raises(ValueError, match="fp8_ds_mla"):
        backends._split_fallback("gluon_sm90", "x", parts, kv, True)
    # the call's own decision raises before any launch (explain_fwd runs the same decision, launching nothing)
    with pytest.raises(ValueError, match="gluon_sm90 but grouped tiles on an fp8_ds_mla cache"):
        interface.explain_fwd(q, kv, idx, 0.1, method="grouped", kv_format=FP8, kv_dequant="in_kernel", kv_splits=2)


def test_forced_split_partials_have_a_memory_limit(monkeypatch):
    """A forced S whose fp32 partials would pass MAX_SPLIT_PARTIAL_BYTES raises; the automatic choice does not split."""
    monkeypatch.setattr(interface, "MAX_SPLIT_PARTIAL_BYTES", 1000)
    monkeypatch.setattr(interface, "num_sms", lambda device: 132)
    p = make_problem(1, 16, 2048, N_ROWS, seed=3, indices=torch.zeros(1, 2048, dtype=torch.int32))
    with pytest.raises(ValueError, match="kv_splits=4 needs"):
        sparse_mla_fwd(p.q, p.kv, p.indices, p.sm_scale, kv_splits=4)
    text = interface.explain_fwd(p.q, p.kv, p.indices)
    assert "kv splits: 1 (" in text and "GiB" in text


def test_fit_recovers_the_model_that_generated_the_times():
    """Times built so that splitting pays until each split keeps 512 rows and the SMs are filled once: the fit picks
    a model whose choices are the best measured ones (mean slowdown 1), and refuses points without S = 1."""
    from sparse_mla.mqa.kv_splits import fit_kv_split_model

    def ms(lists, rows, s):  # one wave of 132 SMs: per split ~rows / s, a fixed 2 us per split launch and combine
        waves = -(-lists * s // 132)
        return waves * (rows / s) * 0.001 + (0.002 * s if rows / s < 512 else 0.0)

    pts = [dict(num_lists=n, pseudo_heads=64, rows_per_list=k, times={s: ms(n, k, s) for s in (1, 2, 4, 8, 16)})
           for n in (1, 4, 16, 64, 256) for k in (2048, 8192)]
    model, slowdown = fit_kv_split_model(pts, 132)
    assert slowdown == pytest.approx(1.0, abs=0.02), (model, slowdown)
    with pytest.raises(ValueError, match="S = 1"):
        fit_kv_split_model([dict(num_lists=1, pseudo_heads=16, rows_per_list=2048, times={2: 1.0})], 132)
    with pytest.raises(ValueError, match="at least one"):
        fit_kv_split_model([], 132)
