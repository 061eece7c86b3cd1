"""``sparse_mla.flash_mla_sparse_fwd`` against FlashMLA's own sparse-prefill cases (tests/testlib/flashmla_cases.py):
its correctness, feature and corner lists with its tolerances, in fp16 through the Triton interpreter at
small sizes on the CPU, and at full size in bf16 on a GPU for every attention backend
(``SPARSE_MLA_MQA_BACKEND`` = triton, gluon_sm90) and every head count 1..128; plus the attn_sink /
max_logits plumbing through ``sparse_mla_fwd`` (per token and grouped), the backend fallback while the
Gluon kernel lacks them, and the error messages of the compatible call.

GPU run: ``python3 -m pytest -q tests/mqa/test_flashmla_compat.py -m gpu``.
"""

from __future__ import annotations

import math

import pytest
import torch
from testlib.device import DEVICE, DTYPE, HAS_CUDA
from testlib.flashmla_cases import (
    CPU_CORNER,
    CPU_CORRECTNESS,
    CPU_FEATURES,
    CPU_HEADS,
    FLASHMLA_CORNER,
    FLASHMLA_CORRECTNESS,
    FLASHMLA_FEATURES,
    HEAD_SWEEP,
    TOLERANCES,
    Case,
    assert_allclose_flashmla,
    check_against_reference,
    make_inputs,
)
from testlib.grids import assert_grids_within_cuda_limits, record_launch_grids
from testlib.problems import neighbour_rows

import sparse_mla
from sparse_mla import SparseMLAWorkspace, flash_mla_sparse_fwd, flash_mla_sparse_ref, sparse_mla_fwd, sparse_mla_ref
from sparse_mla.mqa import backends, gluon_sm90, triton_tl

INF = float("inf")
needs_gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="full-size FlashMLA cases run on a CUDA GPU in bf16")]


def gpu_only(cases: list) -> list:
    """Full-size case lists are collected on GPU machines only (on the CPU: one empty-set skip, not 700)."""
    return cases if HAS_CUDA else []


def gluon_unavailable(q: torch.Tensor, kv: torch.Tensor) -> str | None:
    """Why the Gluon backend cannot run these FlashMLA-style inputs (None: it can)."""
    ok, why = backends.gluon_sm90_applies(q, kv[:, 0] if kv.dim() == 3 else kv)
    return None if ok else f"gluon_sm90 does not apply: {why}"


@pytest.fixture(params=["triton", pytest.param("gluon_sm90", marks=needs_gpu)])
def mqa_backend(request, monkeypatch) -> str:
    """Forces the attention backend (SPARSE_MLA_MQA_BACKEND); gluon_sm90 only where a GPU is."""
    monkeypatch.setenv(backends.ENV_VAR, request.param)
    return request.param


def run_case(case: Case, backend: str, dtype=DTYPE) -> None:
    if backend == "gluon_sm90":
        x = make_inputs(Case(1, 8, 8, h_q=case.h_q, d_qk=case.d_qk), DEVICE, dtype)  # layout probe only
        why = gluon_unavailable(x["q"], x["kv"])
        if why is not None:
            pytest.skip(why)
    check_against_reference(case, DEVICE, dtype)


# ------------------------------------------------------------------------------- CPU: FlashMLA's categories

@pytest.mark.parametrize("case", CPU_CORRECTNESS, ids=lambda c: c.id)
def test_correctness_cases(case):
    """FlashMLA's correctness list (regular, irregular, out-of-bounds top-k shapes; d_qk 512 / 576;
    64 / 128 heads; padded strides) at interpreter sizes."""
    check_against_reference(case, DEVICE, DTYPE)


@pytest.mark.parametrize("case", CPU_FEATURES, ids=lambda c: c.id)
def test_feature_cases(case):
    """FlashMLA's feature list: attn_sink (with +inf / -inf entries) and topk_length, each on and off."""
    check_against_reference(case, DEVICE, DTYPE)


@pytest.mark.parametrize("case", CPU_CORNER, ids=lambda c: c.id)
def test_corner_cases(case):
    """FlashMLA's corner list: rows with no valid index (out 0, lse +inf, max_logits -inf whatever the
    sink), and topk far above s_kv (whole tiles without a valid entry)."""
    out, max_logits, lse = check_against_reference(case, DEVICE, DTYPE)
    if case.all_invalid:
        empty = lse == INF
        assert empty.any(), "the case must contain a row with no valid index"
        assert torch.all(out[empty] == 0) and torch.all(max_logits[empty] == -INF)


@pytest.mark.parametrize("case", CPU_HEADS, ids=lambda c: c.id)
def test_any_head_count(case):
    """Head counts FlashMLA refuses (it takes 64 or 128), with sink, topk_length and empty rows."""
    check_against_reference(case, DEVICE, DTYPE)


def test_many_tokens_grid(monkeypatch):
    """FlashMLA's s_q = 70000 case: the launch grid keeps the token count on the axis without the 65535
    limit (recorded, not run, on the CPU; test_many_tokens_gpu runs it). Two heads: the head axis of the
    grid is at most 2 blocks for any h_q <= 128, and 70000 x 128 heads of out would not fit in CPU memory. The
    portable kernel per token (the grid it sizes from T; the Gluon kernel's is persistent), and the grouped call the
    default makes at 2 heads within the limits too."""
    from sparse_mla.mqa import selection

    monkeypatch.setenv(backends.ENV_VAR, "triton")
    monkeypatch.setattr(selection, "GROUPING_RULES", (selection.GroupingRule(128, selection.NEVER), ))
    grids = record_launch_grids(monkeypatch)
    q = torch.zeros(1, 1, 576, dtype=DTYPE, device=DEVICE).expand(70000, 2, 576)
    kv = torch.zeros(256, 1, 576, dtype=DTYPE, device=DEVICE)
    idx = torch.zeros(70000, 1, 256, dtype=torch.int32, device=DEVICE)
    lens = torch.full((70000,), 256, dtype=torch.int32, device=DEVICE)
    flash_mla_sparse_fwd(q, kv, idx, 0.5, attn_sink=torch.zeros(2, device=DEVICE), topk_length=lens)
    assert_grids_within_cuda_limits(grids)
    assert any(grid[0] == 70000 for _, grid in grids)
    grids.clear()
    monkeypatch.setattr(selection, "GROUPING_RULES", (selection.GroupingRule(128, 1), ))
    flash_mla_sparse_fwd(q, kv, idx, 0.5, attn_sink=torch.zeros(2, device=DEVICE), topk_length=lens)
    assert_grids_within_cuda_limits(grids)
    assert any("union" in name for name, _ in grids), grids  # the Triton builder or the CUDA one (sparse_mla_union_smem)


# ------------------------------------------------------------------------------- conventions and semantics

def test_same_kernel_result_as_sparse_mla_fwd():
    """The compatible call is sparse_mla_fwd plus conventions: out and max_logits identical, lse identical
    except -inf (this API) -> +inf (FlashMLA's) for a query with no valid index."""
    case = Case(6, 150, 64, h_q=16, d_qk=576, attn_sink=True, topk_length=True, all_invalid=True, seed=3)
    x = make_inputs(case, DEVICE, DTYPE)
    out, max_logits, lse = flash_mla_sparse_fwd(**x)
    m2 = torch.full_like(max_logits, float("nan"))
    out2, lse2 = sparse_mla_fwd(x["q"], x["kv"][:, 0], x["indices"], 0.5, topk_length=x["topk_length"],
                                attn_sink=x["attn_sink"], max_logits=m2, return_lse=True)
    assert torch.equal(out, out2) and torch.equal(max_logits, m2)
    empty = lse2 == -INF
    assert empty.any() and torch.equal(lse == INF, empty) and torch.equal(lse[~empty], lse2[~empty])


def test_sink_infinities_exact():
    """+inf sink: out exactly 0 for that head on every token; -inf sink: out bitwise the no-sink out;
    neither changes lse or max_logits."""
    case = Case(4, 150, 64, h_q=4, d_qk=512)
    x = make_inputs(case, DEVICE, DTYPE)
    base = flash_mla_sparse_fwd(**x)
    sink = torch.tensor([INF, -INF, -INF, INF], device=DEVICE)
    out, max_logits, lse = flash_mla_sparse_fwd(**{**x, "attn_sink": sink})
    assert torch.all(out[:, [0, 3]] == 0)
    assert torch.equal(out[:, [1, 2]], base[0][:, [1, 2]])
    assert torch.equal(max_logits, base[1]) and torch.equal(lse, base[2])


def test_dominant_finite_sink():
    """Finite sinks around each row's lse (sink weight 10-90%, where FlashMLA's random sinks are ~1%):
    out scaled by exp(lse) / (exp(lse) + exp(sink)), FlashMLA's tolerances."""
    case = Case(4, 150, 64, h_q=8, d_qk=576)
    x = make_inputs(case, DEVICE, DTYPE)
    _, _, ref_lse = flash_mla_sparse_ref(**x)
    sink = ref_lse.mean(dim=0) + torch.linspace(-2, 2, 8, device=DEVICE)
    x["attn_sink"] = sink
    out, max_logits, lse = flash_mla_sparse_fwd(**x)
    ref_out, ref_max, ref_lse = flash_mla_sparse_ref(**x)
    assert_allclose_flashmla("out", out, ref_out, **TOLERANCES["out"])
    weight = 1 / (1 + torch.exp(sink[None, :] - ref_lse))
    assert weight.min() < 0.2 and weight.max() > 0.8, "the sinks must matter"


def test_max_logits_natural_units_and_scale_sign():
    """max_logits is max_j sm_scale * q . k_j in natural units, for a negative sm_scale too (the max of the
    scaled logits, not the scaled max)."""
    case = Case(3, 95, 64, h_q=16, d_qk=576)
    x = make_inputs(case, DEVICE, DTYPE)
    x["sm_scale"] = -0.3
    _, max_logits, _ = flash_mla_sparse_fwd(**x)
    q, kv, idx = x["q"].float(), x["kv"][:, 0].float(), x["indices"][:, 0].long()
    for t in range(case.s_q):
        rows = idx[t][(idx[t] >= 0) & (idx[t] < case.s_kv)]
        expect = (-0.3 * q[t] @ kv[rows].T).amax(dim=-1)
        assert_allclose_flashmla("max_logits", max_logits[t], expect, **TOLERANCES["max_logits"])


def test_empty_problem():
    q = torch.zeros(0, 4, 512, dtype=DTYPE, device=DEVICE)
    kv = torch.zeros(8, 1, 512, dtype=DTYPE, device=DEVICE)
    idx = torch.zeros(0, 1, 16, dtype=torch.int32, device=DEVICE)
    out, max_logits, lse = flash_mla_sparse_fwd(q, kv, idx, 0.5)
    assert out.shape == (0, 4, 512) and max_logits.shape == lse.shape == (0, 4)


@pytest.mark.parametrize("method, guard", [("grouped", math.inf), ("grouped", 1.2), ("per_token", None)])
def test_sparse_mla_fwd_sink_and_max_logits(method, guard):
    """attn_sink / max_logits through sparse_mla_fwd into NaN-poisoned out / lse / max_logits, grouped (every
    group on the union tile, or most sent per token by a tight overlap guard) and per token; this API's
    conventions (lse -inf for a query with no valid row)."""
    T, H, K, N = 20, 16, 64, 160
    g = torch.Generator().manual_seed(7)
    idx = neighbour_rows(T, K, N, keep=0.8, generator=g)
    idx[1:8] = idx[0]  # group 0 (G = 8) shares one list: kept on the union tile by the 1.2 guard; the rest not
    idx[5] = -1  # a query with no valid row
    idx[9, ::3] = N + 3
    q = (torch.randn(T, H, 576, generator=g) / 10).to(DTYPE).to(DEVICE)
    kv = (torch.randn(N, 576, generator=g) / 10).to(DTYPE).to(DEVICE)
    idx = idx.to(DEVICE)
    sink = torch.randn(H, generator=g).to(DEVICE)
    sink[:2] = torch.tensor([INF, -INF])
    out = torch.full((T, H, 512), float("nan"), dtype=DTYPE, device=DEVICE)
    lse = torch.full((T, H), float("nan"), device=DEVICE)
    max_logits = torch.full((T, H), float("nan"), device=DEVICE)
    ws = SparseMLAWorkspace.for_problem(T, K, H, N, DEVICE)
    sparse_mla_fwd(q, kv, idx, 0.5, method=method, overlap_guard=guard, attn_sink=sink, max_logits=max_logits,
                   out=out, lse=lse, return_lse=True, workspace=ws)
    if method == "grouped":  # route 0: the token ran on a union tile; otherwise per token
        ran_grouped = (ws.route[:T] == 0).cpu()
        assert ran_grouped[:8].all() and (ran_grouped[8:].all() if guard == math.inf else not ran_grouped[8:].any())
    ref_out, ref_lse, ref_max = sparse_mla_ref(q, kv, idx, 0.5, attn_sink=sink, return_max_logits=True)
    assert ref_lse[5].eq(-INF).all() and ref_max[5].eq(-INF).all()
    assert_allclose_flashmla("out", out, ref_out, **TOLERANCES["out"])
    assert_allclose_flashmla("lse", lse, ref_lse, **TOLERANCES["lse"])
    assert_allclose_flashmla("max_logits", max_logits, ref_max, **TOLERANCES["max_logits"])


# ------------------------------------------------------------------------------- errors name the argument

def _good():
    return make_inputs(Case(2, 40, 16, h_q=4, d_qk=512, attn_sink=True, topk_length=True), DEVICE, DTYPE)


@pytest.mark.parametrize("change, exc, words", [
    (lambda x: {"kv": x["kv"][:, 0]}, ValueError, ["kv", "[s_kv, h_kv = 1, d_qk]"]),
    (lambda x: {"kv": x["kv"].expand(-1, 2, -1)}, ValueError, ["kv", "h_kv = 1"]),
    (lambda x: {"indices": x["indices"][:, 0]}, ValueError, ["indices", "[s_q, h_kv = 1, topk]"]),
    (lambda x: {"indices": x["indices"][:1]}, ValueError, ["indices", "s_q = 2"]),
    (lambda x: {"indices": x["indices"].long()}, TypeError, ["indices", "int32"]),
    (lambda x: {"q": x["q"][0]}, ValueError, ["q", "[s_q, h_q, d_qk]"]),
    (lambda x: {"q": x["q"].float()}, TypeError, ["q", "dtype"]),
    (lambda x: {"kv": x["kv"].float()}, TypeError, ["kv", "dtype"]),
    (lambda x: {"kv": "kv"}, TypeError, ["kv", "str"]),
    (lambda x: {"attn_sink": x["attn_sink"].half()}, TypeError, ["attn_sink", "float32"]),
    (lambda x: {"attn_sink": x["attn_sink"][:3]}, ValueError, ["attn_sink", "[4]"]),
    (lambda x: {"attn_sink": [0.0] * 4}, TypeError, ["attn_sink", "list"]),
    (lambda x: {"topk_length": x["topk_length"][:1]}, ValueError, ["topk_length", "[2]"]),
    (lambda x: {"topk_length": x["topk_length"].long()}, TypeError, ["topk_length", "int32"]),
    (lambda x: {"d_v": 256}, ValueError, ["d_v", "512"]),
    (lambda x: {"sm_scale": float("nan")}, ValueError, ["sm_scale"]),
], ids=lambda v: v if isinstance(v, str) else None)
def test_errors_name_the_argument(change, exc, words):
    x = _good()
    x.update(change(x))
    with pytest.raises(exc) as err:
        flash_mla_sparse_fwd(**x)
    for w in words:
        assert w in str(err.value), f"{w!r} not in: {err.value}"


@pytest.mark.parametrize("bad, exc, words", [
    (lambda T, H: torch.empty(T, H, dtype=torch.float16), TypeError, ["max_logits", "float32"]),
    (lambda T, H: torch.empty(T, H + 1), ValueError, ["max_logits", "[T, H]"]),
    (lambda T, H: torch.empty(H, T).T, ValueError, ["max_logits", "contiguous heads"]),
])
def test_max_logits_buffer_checked(bad, exc, words):
    x = _good()
    T, H = x["q"].shape[:2]
    with pytest.raises(exc) as err:
        sparse_mla_fwd(x["q"], x["kv"][:, 0], x["indices"], 0.5, max_logits=bad(T, H).to(DEVICE))
    assert all(w in str(err.value) for w in words), str(err.value)


def test_top_level_export():
    assert "flash_mla_sparse_fwd" in dir(sparse_mla) and sparse_mla.flash_mla_sparse_fwd is flash_mla_sparse_fwd


# ------------------------------------------------------------------------------- backend selection (plain Python)

@pytest.fixture
def hopper(hopper, monkeypatch):
    """conftest's pretend Hopper, recording launches instead of running them."""
    calls = []
    monkeypatch.setattr(gluon_sm90, "launch", lambda *a, **k: calls.append(("gluon_sm90", k)))
    monkeypatch.setattr(triton_tl, "sparse_mqa_per_token", lambda *a, **k: calls.append(("triton", k)))
    monkeypatch.setattr(triton_tl, "sparse_mqa_grouped", lambda *a, **k: calls.append(("triton", k)))
    return calls


def _launch_both(H=64):
    q, kv = torch.zeros(4, H, 576, dtype=torch.bfloat16), torch.zeros(100, 576, dtype=torch.bfloat16)
    idx, out = torch.zeros(4, 8, dtype=torch.int32), torch.zeros(4, H, 512, dtype=torch.bfloat16)
    sink, ml = torch.zeros(H), torch.zeros(4, H)
    a = backends.per_token(q, kv, idx, 0.1, None, out, None, attn_sink=sink, max_logits=ml)
    z = torch.zeros(1, dtype=torch.int32)
    b = backends.grouped(q, kv, 0.1, 2, idx[:1], idx[:1], z, z, z, out, None, attn_sink=sink, max_logits=ml)
    return a, b


def test_gluon_gets_sink_kwargs(hopper):
    """The Gluon kernel computes attn_sink / max_logits itself: the launch hands them over, no fallback."""
    assert _launch_both() == ("gluon_sm90", "gluon_sm90")
    assert all(name == "gluon_sm90" and k["attn_sink"] is not None and k["max_logits"] is not None for name, k in hopper)


# ------------------------------------------------------------------------------- GPU: FlashMLA's lists, full size

# FlashMLA's test lists by name (a failing id names its list), full size on the GPU.
GPU_LISTS = (("correctness", FLASHMLA_CORRECTNESS), ("features", FLASHMLA_FEATURES), ("corner", FLASHMLA_CORNER),
             ("head_sweep", HEAD_SWEEP))


@pytest.mark.parametrize("case", [pytest.param(c, id=f"{name}-{c.id}") for name, cases in GPU_LISTS
                                  for c in gpu_only(cases)])
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="full-size FlashMLA cases run on a CUDA GPU in bf16")
def test_flashmla_lists_gpu(case, mqa_backend):
    run_case(case, mqa_backend)


@pytest.mark.parametrize("h_q, d_qk", [(128, 576), (128, 512), (64, 576), (64, 512), (16, 576)])
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="70000 tokens run on a CUDA GPU")
def test_many_tokens_gpu(h_q, d_qk, mqa_backend):
    """FlashMLA's s_q = 70000 case (attn_sink, topk_length), run for real; FlashMLA checks nothing there,
    this checks 192 sampled rows (first, last, spread) against the reference with its tolerances."""
    case = Case(70000, 256, 256, h_q=h_q, d_qk=d_qk, attn_sink=True, topk_length=True)
    x = make_inputs(case, DEVICE, torch.bfloat16)
    if mqa_backend == "gluon_sm90" and (why := gluon_unavailable(x["q"], x["kv"])) is not None:
        pytest.skip(why)
    out, max_logits, lse = flash_mla_sparse_fwd(**x)
    rows = torch.cat([torch.arange(64), torch.arange(70000 - 64, 70000), torch.linspace(64, 69935, 64).long()]).to(DEVICE)
    sub = {**x, "q": x["q"][rows], "indices": x["indices"][rows], "topk_length": x["topk_length"][rows]}
    ref_out, ref_max, ref_lse = flash_mla_sparse_ref(**sub)
    assert_allclose_flashmla("out", out[rows], ref_out, **TOLERANCES["out"])
    assert_allclose_flashmla("max_logits", max_logits[rows], ref_max, **TOLERANCES["max_logits"])
    assert_allclose_flashmla("lse", lse[rows], ref_lse, **TOLERANCES["lse"])
    assert not out.isnan().any() and not max_logits.isnan().any() and not lse.isnan().any()


@pytest.mark.parametrize("H", [8, 16, 32, 64])
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="bf16 grouped kernels on a CUDA GPU")
def test_grouped_sink_gpu(H, mqa_backend):
    """Grouped attention (union tile of G = 128 // H queries) with attn_sink and max_logits, bf16, FlashMLA's
    tolerances; a query with no valid row and +-inf sinks included."""
    T, K, N = 512, 2048, 8192
    g = torch.Generator().manual_seed(H)
    idx = neighbour_rows(T, K, N, keep=0.85, generator=g)
    idx[17] = -1
    q = (torch.randn(T, H, 576, generator=g) / 10).to(torch.bfloat16).to(DEVICE)
    kv = (torch.randn(N, 576, generator=g) / 10).to(torch.bfloat16).to(DEVICE)
    if mqa_backend == "gluon_sm90" and (why := gluon_unavailable(q, kv)) is not None:
        pytest.skip(why)
    idx = idx.to(DEVICE)
    sink = torch.randn(H, generator=g).to(DEVICE)
    sink[:2] = torch.tensor([INF, -INF])
    max_logits = torch.full((T, H), float("nan"), device=DEVICE)
    out, lse = sparse_mla_fwd(q, kv, idx, 0.5, method="grouped", overlap_guard=math.inf, attn_sink=sink,
                              max_logits=max_logits, return_lse=True)
    ref_out, ref_lse, ref_max = sparse_mla_ref(q, kv, idx, 0.5, attn_sink=sink, return_max_logits=True)
    assert_allclose_flashmla("out", out, ref_out, **TOLERANCES["out"])
    assert_allclose_flashmla("lse", lse, ref_lse, **TOLERANCES["lse"])
    assert_allclose_flashmla("max_logits", max_logits, ref_max, **TOLERANCES["max_logits"])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need a GPU")
def test_cuda_graph_capture_gpu(mqa_backend):
    """flash_mla_sparse_fwd captured in a CUDA graph (outputs from the graph's pool, no host sync) and
    replayed on new inputs gives the eager result."""
    case = Case(62, 592, 128, h_q=64, d_qk=576, attn_sink=True, topk_length=True, all_invalid=True)
    x = make_inputs(case, DEVICE, torch.bfloat16)
    if mqa_backend == "gluon_sm90" and (why := gluon_unavailable(x["q"], x["kv"])) is not None:
        pytest.skip(why)
    flash_mla_sparse_fwd(**x)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = flash_mla_sparse_fwd(**x)
    y = make_inputs(Case(62, 592, 128, h_q=64, d_qk=576, attn_sink=True, topk_length=True, all_invalid=True, seed=9),
                    DEVICE, torch.bfloat16)
    for name in ("q", "kv", "indices", "attn_sink", "topk_length"):
        x[name].copy_(y[name])
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, flash_mla_sparse_fwd(**y)):
        assert torch.equal(got, want)
