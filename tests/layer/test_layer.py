"""Layer-level DSA prefill (``sparse_mla.layer.dsa_prefill``): every path against the fp32 layer reference.

Each case builds one prefill step of a published layout (DeepSeek-V3.2, GLM-5, GLM-5.3-Flash NoPE,
full head dims, few heads for speed), several requests with cached prefixes, prompts shorter and
longer than topk, and runs every path that applies, forced, into a NaN-poisoned strided ``out``;
the result must match ``dsa_prefill_ref`` (relative Frobenius error, ``testlib.tolerances``) and leave
the padding around the view untouched. The masked-MHA kernel is also tested on its own: the packed
key masks against ``window_allowed_ref``, the attention against ``masked_attention_ref``, and tile
skipping through the kernel's debug tile counter against ``tile_occupancy``.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings

import pytest
import torch
from testlib.device import DEVICE, DTYPE, INT_MAX
from testlib.layer import CASES, Case, build, dims
from testlib.tolerances import LAYER_ROW_TOLERANCE, all_of, assert_rows_close, rel_err

from sparse_mla.layer import PathFallbackWarning, SparseMLAPrefill, dsa_prefill, dsa_prefill_ref, explain
from sparse_mla.layer import paths as layer_paths
from sparse_mla.layer.checks import validate_dsa_prefill_args
from sparse_mla.layer.problem import token_windows
from sparse_mla.layer.reference import masked_attention_ref, window_allowed_ref
from sparse_mla.workloads.models import MODELS


def poisoned_out(T: int, H: int, dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """NaN buffer [T + 1, H + 1, dv] and the strided view [T, H, dv] a call writes."""
    big = torch.full((T + 1, H + 1, dv), float("nan"), dtype=DTYPE, device=DEVICE)
    return big, big[:T, 1:]


def assert_layer_matches(o: torch.Tensor, ref: torch.Tensor, big: torch.Tensor | None = None) -> None:
    """Every (token, head) row of o within the layer's row tolerance of the fp32 reference, tokens with no
    valid entry exactly 0, no NaN, and (``big``) the padding around the written view untouched."""
    empty = ref.abs().amax(dim=(1, 2)) == 0
    assert torch.all(o[empty] == 0), "a token with no valid entry must give o = 0"
    assert_rows_close(o, ref, DTYPE, "o", LAYER_ROW_TOLERANCE)
    if big is not None:
        assert torch.isnan(big[-1]).all() and torch.isnan(big[:, 0]).all(), "wrote outside the out view"


@pytest.mark.parametrize("case,path", [pytest.param(c, p, id=f"{c.id}-{p}") for c in CASES for p in c.paths])
def test_path_matches_layer_reference(case: Case, path: str):
    kw, ref = build(case)
    T, H, dv = *kw["q_nope"].shape[:2], dims(case.model)[3]
    big, out = poisoned_out(T, H, dv)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PathFallbackWarning)
        o, decision = dsa_prefill(**kw, path=path, out=out, return_decision=True)
    assert decision.path == path and not decision.fell_back, decision.reason
    assert o.data_ptr() == out.data_ptr()
    assert_layer_matches(o, ref, big)


def test_short_cases_cover_padding_and_all_paths_agree():
    """The auto choice for a short step is dense; its result equals the forced sparse paths'."""
    kw, ref = build(CASES[0])
    o, d = dsa_prefill(**kw, return_decision=True)
    assert d.path == "dense_mha"
    assert_layer_matches(o, ref)


def test_dense_with_caller_promise_and_topk_length():
    """dense_topk=True with topk_length: whole-window lists followed by garbage past topk_length."""
    case = Case("nope-h2-dense-promise", "glm-5.3-flash", 2, (4, 0), (6, 5), 12)
    kw, ref = build(case)
    T, K = kw["indices"].shape
    lo, win = token_windows(case.new, case.cached, kw["row_offsets"], DEVICE)
    idx = torch.full((T, K), INT_MAX, dtype=torch.int32, device=DEVICE)
    for t in range(T):
        idx[t, : int(win[t])] = (lo[t] + torch.arange(int(win[t]), device=DEVICE).flip(0)).int()
    kw = {**kw, "indices": idx, "topk_length": win.int()}
    ref = dsa_prefill_ref(**kw)
    o_auto, d_auto = dsa_prefill(**kw, return_decision=True)
    assert d_auto.path != "dense_mha", "with topk_length and no promise the dense path must not be inferred"
    o, d = dsa_prefill(**kw, dense_topk=True, check=True, return_decision=True)
    assert d.path == "dense_mha"
    assert_layer_matches(o, ref)
    assert_layer_matches(o_auto, ref)


def test_reference_mha_form_equals_mqa_form():
    """The absorbed (MQA) and decompressed (MHA) forms of the reference agree in fp32."""
    for case in (CASES[6], CASES[4]):
        kw, _ = build(case)
        kw32 = {k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kw.items()}
        a = dsa_prefill_ref(**kw32, form="mqa")
        b = dsa_prefill_ref(**kw32, form="mha")
        assert rel_err(b, a) < 1e-5


def test_nope_dense_uses_no_k_concat(monkeypatch):
    """NoPE: K and V handed to SDPA are views of one decompressed buffer and Q is q_nope itself;
    with a rope part K is a fresh concatenation (the control that makes the check able to fail)."""
    seen = []

    def spy(q, k, v, **kwargs):
        seen.append((q, k, v))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)

    monkeypatch.setattr(layer_paths, "_sdpa", spy)
    kw, ref = build(CASES[2])  # NoPE
    o = dsa_prefill(**kw, path="dense_mha")
    assert_layer_matches(o, ref)
    assert seen
    for q, k, v in seen:
        same_buffer = k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
        assert same_buffer, "NoPE K must be a view of the decompressed buffer"
        assert q.untyped_storage().data_ptr() == kw["q_nope"].untyped_storage().data_ptr(), "NoPE Q must be q_nope itself"
    seen.clear()
    kw, ref = build(CASES[0])  # DeepSeek, qk_rope 64
    dsa_prefill(**kw, path="dense_mha")
    assert all_of((k.untyped_storage().data_ptr() != v.untyped_storage().data_ptr() for _, k, v in seen), "SDPA calls")
    kvd = torch.randn(5, 3, 256 + 256, dtype=DTYPE)
    assert layer_paths.mha_keys(kvd, None, 256).data_ptr() == kvd.data_ptr()


def test_forced_unsupported_path_falls_back_with_warning(caplog, monkeypatch):
    """The fallback warns, and logs at WARNING the first time its kind (forced path, source, path run) is seen, at
    DEBUG on later calls, also of other shapes (one WARNING line per kind, not one per layer call)."""
    from sparse_mla.layer import dispatch

    monkeypatch.setattr(dispatch, "_WARNED", set())
    kw, ref = build(CASES[4])  # windows > topk: dense does not apply
    shorter = build(dataclasses.replace(CASES[4], new=(CASES[4].new[0] - 1, )))[0]  # another reason text, same kind
    with caplog.at_level(logging.DEBUG, logger="sparse_mla"), pytest.warns(PathFallbackWarning, match="dense_mha"):
        o, d = dsa_prefill(**kw, path="dense_mha", return_decision=True)
        d2 = dsa_prefill(**shorter, path="dense_mha", return_decision=True)[1]
    assert d.fell_back and d.requested == "dense_mha" and d.path != "dense_mha"
    assert d2.fell_back and d2.path == d.path and d2.reason != d.reason
    fell = [r for r in caplog.records if "fell back" in r.getMessage()]
    assert [r.levelno for r in fell] == [logging.WARNING, logging.DEBUG]
    assert "further fallbacks of this kind are logged at DEBUG" in fell[0].getMessage()
    assert_layer_matches(o, ref)


def test_unknown_env_path_warns_with_the_names(monkeypatch, caplog):
    from sparse_mla.layer import dispatch

    monkeypatch.setattr(dispatch, "_WARNED", set())
    monkeypatch.setenv("SPARSE_MLA_PATH", "dense")
    kw, ref = build(CASES[1])
    with caplog.at_level(logging.WARNING, logger="sparse_mla"), pytest.warns(PathFallbackWarning, match="not a path"):
        o = dsa_prefill(**kw)
    msg = next(r.getMessage() for r in caplog.records if "not a path" in r.getMessage())
    assert "(dense_mha, " in msg and "((" not in msg
    assert_layer_matches(o, ref)


def test_env_var_forces_path_and_one_log_line(monkeypatch, caplog):
    kw, ref = build(CASES[1])
    monkeypatch.setenv("SPARSE_MLA_PATH", "mqa_per_token")
    with caplog.at_level(logging.DEBUG, logger="sparse_mla"):
        o, d = dsa_prefill(**kw, return_decision=True)
    assert d.path == "mqa_per_token" and "SPARSE_MLA_PATH" in d.reason
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("dsa_prefill:")]
    assert len(lines) == 1 and "path=mqa_per_token" in lines[0] and "SPARSE_MLA_PATH" in lines[0]
    assert_layer_matches(o, ref)
    o2, d2 = dsa_prefill(**kw, path="dense_mha", return_decision=True)  # the argument wins over the environment
    assert d2.path == "dense_mha"


def test_kv_forms_agree():
    """kv rows, adjacent kv_c / k_pe views (no copy) and separate buffers give the same o."""
    kw = dict(build(CASES[1])[0])
    kv = kw.pop("kv")
    r = 512
    p = validate_dsa_prefill_args(**{k: kw[k] for k in ("q_nope", "q_pe", "w_kv_b", "indices")}, kv_c=kv[:, :r],
                                  k_pe=kv[:, r:], cached_lens=kw["cached_lens"], new_lens=kw["new_lens"],
                                  sm_scale=kw["sm_scale"])
    assert p.kv_rows is not None and p.kv_rows.data_ptr() == kv.data_ptr() and p.kv_rows.shape == kv.shape
    a = dsa_prefill(**kw, kv=kv, path="mqa_per_token")
    c = dsa_prefill(**kw, kv_c=kv[:, :r].clone(), k_pe=kv[:, r:].clone(), path="mqa_per_token")  # copied into rows
    paged = dsa_prefill(**kw, kv=kv[: kv.shape[0] // 4 * 4].view(-1, 4, kv.shape[1]), path="dense_mha")
    assert torch.equal(a, c)
    ref = build(CASES[1])[1]
    assert_layer_matches(a, ref)  # equal to each other, and to the reference (not only to each other)
    assert_layer_matches(paged, ref)


def test_empty_step_and_decode_like_step():
    kw, _ = build(CASES[1])
    empty = {**kw, "q_nope": kw["q_nope"][:0], "q_pe": kw["q_pe"][:0], "indices": kw["indices"][:0],
             "cached_lens": [5], "new_lens": [0], "row_offsets": [0]}
    o = dsa_prefill(**empty)
    assert o.shape == (0, 2, 256)
    # one new token per request after a cached prefix (the bottom-right causal corner of SDPA)
    case = Case("deepseek-h2-decode-like", "deepseek-v3.2", 2, (11, 20), (1, 1), 24)
    kw, ref = build(case)
    for path in ("dense_mha", "mqa_per_token"):
        assert_layer_matches(dsa_prefill(**kw, path=path), ref)


def test_module_matches_function():
    m = SparseMLAPrefill.from_config(MODELS["glm-5"], tp_size=32, dtype=DTYPE, device=DEVICE)
    assert m.num_heads == 2 and "kv_b_proj.weight" in m.state_dict()
    assert m.sm_scale == pytest.approx(MODELS["glm-5"].sm_scale)
    kw, ref = build(CASES[1])
    with torch.no_grad():
        m.kv_b_proj.weight.copy_(kw["w_kv_b"])
    args = {k: v for k, v in kw.items() if k not in ("q_nope", "q_pe", "w_kv_b", "indices", "sm_scale")}
    with torch.no_grad():
        o = m(kw["q_nope"], kw["q_pe"], kw["indices"], **args)
    assert_layer_matches(o, ref)
    with pytest.raises(ValueError, match="tp_size"):
        SparseMLAPrefill.from_config(MODELS["glm-5"], tp_size=3)
    with pytest.raises(TypeError, match="sm_scale must be a finite float .*got bool"):
        SparseMLAPrefill(2, 512, 192, 64, 256, sm_scale=True)
    with pytest.raises(TypeError, match="num_heads must be an int, got float"):
        SparseMLAPrefill(2.0, 512, 192, 64, 256)
    with pytest.raises(ValueError, match="qk_rope_head_dim must be an int in \\[0, inf\\], got -1"):
        SparseMLAPrefill(2, 512, 192, -1, 256)


def _mutate(kw: dict, **changes) -> dict:
    return {**kw, **changes}


BAD_INPUTS = [
    ("q_nope fp32", lambda kw: _mutate(kw, q_nope=kw["q_nope"].float()), TypeError, "q_nope must have dtype"),
    ("q_nope 2-D", lambda kw: _mutate(kw, q_nope=kw["q_nope"][:, 0]), ValueError, "q_nope must be"),
    ("q_pe heads", lambda kw: _mutate(kw, q_pe=kw["q_pe"][:, :1]), ValueError, "q_pe must be"),
    ("q_pe dtype", lambda kw: _mutate(kw, q_pe=kw["q_pe"].float()), TypeError, "q_pe must have the dtype"),
    ("w rows", lambda kw: _mutate(kw, w_kv_b=kw["w_kv_b"][:-1]), ValueError, "w_kv_b"),
    ("kv and kv_c", lambda kw: _mutate(kw, kv_c=kw["kv"][:, :512]), ValueError, "exactly one of kv"),
    ("kv width", lambda kw: _mutate(kw, kv=kw["kv"][:, :512]), ValueError, "kv must be"),
    ("indices int64", lambda kw: _mutate(kw, indices=kw["indices"].long()), TypeError, "indices must be int32"),
    ("indices tokens", lambda kw: _mutate(kw, indices=kw["indices"][1:]), ValueError, "indices must be"),
    ("topk_length int64", lambda kw: _mutate(kw, topk_length=torch.zeros(kw["q_nope"].shape[0], dtype=torch.int64)),
     TypeError, "topk_length"),
    ("new_lens sum", lambda kw: _mutate(kw, new_lens=[1, 1]), ValueError, "add up to T"),
    ("lengths count", lambda kw: _mutate(kw, cached_lens=[0]), ValueError, "cached_lens and new_lens"),
    ("negative length", lambda kw: _mutate(kw, cached_lens=[-1, 6]), ValueError, "cached_lens"),
    ("float length", lambda kw: _mutate(kw, cached_lens=[0.0, 6]), TypeError, "cached_lens"),
    ("window past N", lambda kw: _mutate(kw, row_offsets=[0, kw["kv"].shape[0] - 3]), ValueError, "exceed"),
    ("sm_scale nan", lambda kw: _mutate(kw, sm_scale=float("nan")), ValueError, "sm_scale"),
    ("unknown path", lambda kw: _mutate(kw, path="flash"), ValueError, "path must be"),
    ("out shape", lambda kw: _mutate(kw, out=torch.empty(1, 1, 1, dtype=DTYPE)), ValueError, "out must be"),
    ("out dtype", lambda kw: _mutate(kw, out=torch.empty_like(kw["q_nope"], dtype=torch.float32)), TypeError,
     r"out must be \[T, H, v_head_dim\] = \[16, 4, 128\] .*got dtype torch.float32"),
    ("out expanded", lambda kw: _mutate(kw, out=torch.empty_like(kw["q_nope"][:1]).expand_as(kw["q_nope"])), ValueError,
     "out must be .*its own memory"),
    ("out is q_nope", lambda kw: _mutate(kw, out=kw["q_nope"]), ValueError, "out shares memory with q_nope"),
    ("out not a tensor", lambda kw: _mutate(kw, out=[0.0]), TypeError, "out must be a torch.Tensor"),
    ("topk_length shape", lambda kw: _mutate(kw, topk_length=torch.zeros(kw["q_nope"].shape[0] + 1, dtype=torch.int32)),
     ValueError, r"topk_length must be \[T\] = \[16\].*got shape \[17\]"),
    ("kv neither", lambda kw: _mutate(kw, kv=None), ValueError, "exactly one of kv .*got neither"),
    ("sm_scale bool", lambda kw: _mutate(kw, sm_scale=True), TypeError, "sm_scale must be a finite float.*got bool"),
    ("sm_scale tensor", lambda kw: _mutate(kw, sm_scale=torch.tensor(0.1)), TypeError, "sm_scale must be a finite float"),
    ("check int", lambda kw: _mutate(kw, check=1), TypeError, "check must be a bool"),
    ("return_decision str", lambda kw: _mutate(kw, return_decision="yes"), TypeError, "return_decision must be a bool"),
]


@pytest.mark.parametrize("name,mutate,exc,match", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_raises_before_launch(name, mutate, exc, match):
    kw, _ = build(CASES[0])
    with pytest.raises(exc, match=match):
        dsa_prefill(**mutate(kw))


def test_check_mode_contents():
    kw, _ = build(CASES[6])  # adversarial: counted out-of-window junk is padding, but the checked mode raises on it
    with pytest.raises(ValueError, match="outside the causal window"):
        dsa_prefill(**kw, path="mqa_per_token", check=True)
    kw, _ = build(CASES[4])
    validate_dsa_prefill_args(**kw, check=True)  # a clean step passes
    bad = kw["indices"].clone()
    bad[0, 5] = kw["row_offsets"][0] + kw["cached_lens"][0] + 1  # a row in the future of token 0
    with pytest.raises(ValueError, match="outside the causal window"):
        dsa_prefill(**{**kw, "indices": bad}, check=True)
    kw, _ = build(CASES[0])
    dup = kw["indices"].clone()
    valid = (dup[3] >= 0).nonzero()[:, 0]
    dup[3, valid[1]] = dup[3, valid[0]]
    with pytest.raises(ValueError, match="more than once"):
        dsa_prefill(**{**kw, "indices": dup}, check=True)
    short = kw["indices"].clone()
    short[3, valid[0]] = -1  # a dense-eligible step whose list misses one row
    with pytest.raises(ValueError, match="dense-eligible"):
        dsa_prefill(**{**kw, "indices": short}, check=True)
    p = validate_dsa_prefill_args(**{**kw, "indices": short}, dense_topk=False, check=True)
    assert explain(p.step).path != "dense_mha"


def test_check_mode_reports_nonfinite_cache_rows():
    """check=True names a NaN / inf cache row inside a request's window, selected or not (the MHA paths read
    the whole window: docs/DESIGN.md "Non-finite kv rows"), and accepts one outside every window."""
    kw, _ = build(CASES[4])  # one request, 40 cached + 24 new, rows 0..63; rows 64..66 outside
    idx = kw["indices"].clone()
    row = int(idx[3][idx[3] >= 0][0])
    kv = kw["kv"].clone()
    kv[row, 3] = float("nan")
    with pytest.raises(ValueError, match=rf"cache rows \[{row}\] .* row {row} is selected by indices\[\d+, \d+\]"):
        dsa_prefill(**{**kw, "kv": kv}, check=True)
    kv = kw["kv"].clone()
    idx[idx == 63] = -1  # row 63 (the last token's own position) selected by no query
    kv[63, 520] = float("inf")  # in the k_pe part (columns 512 .. 575)
    with pytest.raises(ValueError, match=r"cache rows \[63\] .* selected by no query, but inside a request window"):
        dsa_prefill(**{**kw, "kv": kv, "indices": idx}, check=True)
    kv = kw["kv"].clone()
    kv[64:] = float("nan")  # outside every window: never read by any path
    validate_dsa_prefill_args(**{**kw, "kv": kv}, check=True)


# ---------------------------------------------------------------------------------------------
# The masked MHA kernel on its own
# ---------------------------------------------------------------------------------------------


def _concentrated_case() -> tuple[dict, torch.Tensor]:
    """One request, 160 cached + 48 new, each token keeps the sink rows 0..1 and its 10 latest rows:
    most key tiles of a block hold no allowed key."""
    case = Case("deepseek-h2-concentrated", "deepseek-v3.2", 2, (160,), (48,), 12)
    kw, _ = build(case)
    T, K = kw["indices"].shape
    idx = torch.full((T, K), -1, dtype=torch.int32)
    for t in range(T):
        p = 160 + t
        idx[t] = torch.tensor([0, 1, *range(p - 9, p + 1)], dtype=torch.int32)[torch.randperm(K)]
    kw = {**kw, "indices": idx.to(DEVICE)}
    return kw, dsa_prefill_ref(**kw)


def test_key_bitmask_matches_reference():
    from sparse_mla.layer.masked_mha import build_key_bitmask, plan_masked_mha, unpack_key_bitmask

    for case in (CASES[6], CASES[3]):
        kw, _ = build(case)
        p = validate_dsa_prefill_args(**kw)
        rows, starts = layer_paths.window_rows(p)
        plan = plan_masked_mha(p.step.cached_lens, p.step.new_lens, p.row_offsets, starts, 16, DEVICE)
        words = build_key_bitmask(p.indices, p.topk_length, plan)
        got = unpack_key_bitmask(words, plan)
        lo, win = token_windows(p.step.new_lens, p.step.cached_lens, p.row_offsets, DEVICE)
        want = window_allowed_ref(p.indices, p.topk_length, lo, win, got.shape[1])
        assert torch.equal(got, want)
        assert got.sum() > 0


def test_masked_kernel_skips_empty_tiles():
    from sparse_mla.layer.masked_mha import build_key_bitmask, masked_mha_fwd, plan_masked_mha, tile_occupancy

    kw, ref = _concentrated_case()
    p = validate_dsa_prefill_args(**kw)
    H, dn = p.step.num_heads, p.step.qk_nope_head_dim
    rows, starts = layer_paths.window_rows(p)
    kvd = layer_paths.decompress(p, rows)
    plan = plan_masked_mha(p.step.cached_lens, p.step.new_lens, p.row_offsets, starts, 16, DEVICE)
    words = build_key_bitmask(p.indices, p.topk_length, plan)
    occupied, walked = tile_occupancy(words, plan, 32)
    assert occupied.sum() < walked.sum() / 2, "the concentrated pattern must leave most tiles empty"
    counts = torch.full((plan.num_blocks, H), -1, dtype=torch.int32, device=DEVICE)
    big, out = poisoned_out(*p.q_nope.shape[:2], p.step.v_head_dim)
    masked_mha_fwd(p.q_nope, p.q_pe, kvd[..., :dn], p.k_pe, kvd[..., dn:], words, plan, p.sm_scale, out,
                   block_n=32, tile_counts=counts)
    assert torch.equal(counts.cpu(), occupied[:, None].expand(-1, H).int()), "kernel must compute exactly the occupied tiles"
    assert_layer_matches(out, ref, big)
    # against plain masked attention over the same decompressed K/V
    lo, win = token_windows(p.step.new_lens, p.step.cached_lens, p.row_offsets, DEVICE)
    allowed = window_allowed_ref(p.indices, None, lo, win, kvd.shape[0])
    k = layer_paths.mha_keys(kvd, p.k_pe[rows], dn)
    want = masked_attention_ref(layer_paths.mha_queries(p), k, kvd[..., dn:], allowed, p.sm_scale)
    assert_rows_close(out, want, DTYPE, "masked MHA vs masked_attention_ref")
    # and through the layer path object with small tiles
    o2 = torch.empty_like(out)
    counts2 = torch.zeros_like(counts)
    layer_paths.MaskedMHA(block_m=16, block_n=32).run(p, o2, tile_counts=counts2)
    assert torch.equal(counts2, counts) and torch.equal(o2, out)


def test_host_copies_refuse_cuda_graph_capture(monkeypatch):
    """A pinned non-blocking copy captured into a CUDA graph would replay stale host data: refused
    with a message pointing at the capturable entry point (checked before touching CUDA)."""
    from sparse_mla.layer.host import to_device_async

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="cannot be captured"):
        to_device_async(torch.arange(4), "cuda")
    assert torch.equal(to_device_async(torch.arange(4), "cpu"), torch.arange(4))  # CPU: a plain copy
