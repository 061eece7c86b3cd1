"""Per-token sparse MQA kernel (``sparse_mla_fwd(..., method="per_token")``) against ``sparse_mla_ref``.

Every call writes into NaN-poisoned out= / lse= buffers, so an element the kernel forgets fails; the
padding around the written views must stay NaN (a 16-row tile of a query with H < 16 heads must not
store into the next heads or tokens). CPU runs use fp16 through the Triton interpreter, the GPU bf16
(``testlib.device.DTYPE``), with the tolerances of ``testlib.tolerances``.
"""

from __future__ import annotations

import pytest
import torch
from testlib.adversarial import adversarial_indices, garbage_topk_length
from testlib.device import DEVICE, DTYPE, INT_MAX, INT_MIN
from testlib.grids import assert_grids_within_cuda_limits, record_launch_grids
from testlib.problems import compact_reference, make_problem, poisoned_views, run_checked
from testlib.tolerances import assert_matches_reference

from sparse_mla import sparse_mla_fwd, sparse_mla_ref

N_ROWS = 300


def _problem(T, H, K, N=N_ROWS, *, d_qk=576, seed=0, patterns=None, topk_garbage=False):
    g = torch.Generator().manual_seed(seed)
    kw = {} if patterns is None else {"patterns": patterns}
    idx = adversarial_indices(T, K, N, generator=g, **kw)
    tl_ = None
    if topk_garbage:
        idx, tl_ = garbage_topk_length(idx, N, generator=g)
    return make_problem(T, H, K, N, d_qk=d_qk, seed=seed, indices=idx, topk_length=tl_)


# (H, D_qk, K, N, return_lse). T = 5: one token of each adversarial pattern (clean, -1 at the end,
# -1 in the middle, INT_MIN / -2 / N / N+1 / INT_MAX sentinels, no valid row). K is never a multiple
# of the 64-row tile; pad_heads = 1 puts a poisoned head before the view (non-contiguous out).
CASES = [
    pytest.param(1, 576, 70, N_ROWS, True, id="H1-d576-K70"),
    pytest.param(2, 512, 70, N_ROWS, False, id="H2-d512-K70-nolse"),
    pytest.param(8, 576, 100, N_ROWS, True, id="H8-d576-K100"),
    pytest.param(16, 576, 65, N_ROWS, True, id="H16-d576-K65"),
    pytest.param(16, 512, 33, N_ROWS, False, id="H16-d512-K33-nolse"),
    pytest.param(16, 576, 70, 40, True, id="H16-d576-K70-topk-exceeds-N40"),
    pytest.param(64, 576, 70, N_ROWS, True, id="H64-d576-K70"),
    pytest.param(128, 576, 63, N_ROWS, True, id="H128-d576-K63"),
    pytest.param(128, 512, 70, N_ROWS, False, id="H128-d512-K70-nolse"),
]


@pytest.mark.parametrize("H, d_qk, K, N, return_lse", CASES)
def test_matches_reference_adversarial_padding(H, d_qk, K, N, return_lse):
    p = _problem(5, H, K, N, d_qk=d_qk, seed=H + K)
    run_checked(p, return_lse=return_lse, method="per_token", pad_tokens=2, pad_heads=1)


@pytest.mark.parametrize("H, check", [
    pytest.param(16, False, id="H16"),
    pytest.param(2, True, id="H2-checked"),
    pytest.param(128, False, id="H128"),
])
def test_topk_length_with_garbage_after_it(H, check):
    """Entries past topk_length (rows >= N, INT_MAX, repeats, unrelated valid rows) must not be read;
    the checked mode must not flag them either."""
    patterns = ("clean", "pad_middle") if check else None  # checked mode: no >= N rows inside the length
    p = _problem(5, H, 70, seed=7, patterns=patterns, topk_garbage=True)
    out, lse = run_checked(p, method="per_token", check=check)
    assert torch.isinf(lse[0]).all() and (out[0] == 0).all(), "topk_length 0 must give an empty query"


def test_topk_length_out_of_range_is_clamped():
    """Unchecked, a negative topk_length counts as 0 and one above K as K (the reference's definition)."""
    p = _problem(4, 16, 70, seed=3, patterns=("clean",))
    p.topk_length = torch.tensor([-3, 70 + 5, INT_MAX, INT_MIN], dtype=torch.int32, device=DEVICE)
    out, lse = run_checked(p, method="per_token")
    assert torch.isinf(lse[0]).all() and torch.isinf(lse[3]).all()
    assert torch.isfinite(lse[1]).all() and torch.isfinite(lse[2]).all()


@pytest.mark.parametrize("H", [pytest.param(16, id="H16"), pytest.param(128, id="H128")])
def test_queries_with_no_valid_row(H):
    """Every query empty (all padding, or topk_length 0 over valid rows): out exactly 0, lse -inf, no NaN."""
    T, K = 4, 40
    idx = torch.tensor([-1, INT_MIN, N_ROWS, INT_MAX], dtype=torch.int32).repeat(T, K // 4)
    idx[2:] = torch.arange(K, dtype=torch.int32)  # valid rows ...
    # ... but tokens 2, 3 have topk_length 0; tokens 0, 1 hold only padding
    p = make_problem(T, H, K, N_ROWS, indices=idx, topk_length=torch.tensor([K, 3, 0, 0], dtype=torch.int32))
    out, lse = run_checked(p, method="per_token", pad_heads=1)
    assert (out == 0).all() and (lse == float("-inf")).all()


@pytest.mark.parametrize("H", [pytest.param(1, id="H1"), pytest.param(128, id="H128")])
def test_single_query(H):
    p = _problem(1, H, 70, seed=11)
    run_checked(p, method="per_token", pad_tokens=1)


def test_zero_tokens():
    p = make_problem(0, 16, 8, N_ROWS, indices=torch.zeros(0, 8, dtype=torch.int32))
    out, lse = sparse_mla_fwd(p.q, p.kv, p.indices, p.sm_scale, return_lse=True, method="per_token")
    assert out.shape == (0, 16, 512) and lse.shape == (0, 16)


@pytest.mark.parametrize("sm_scale", [
    pytest.param(1.0, id="sharp-1.0"),
    pytest.param(-0.3, id="negative"),
    pytest.param(0.0, id="zero-uniform"),
])
def test_softmax_scale(sm_scale):
    """A sharp softmax (logits up to ~80: needs the running max), a negative scale, and 0 (plain mean)."""
    p = _problem(5, 16, 70, seed=5)
    p.sm_scale = sm_scale
    run_checked(p, method="per_token")


def test_allocates_outputs_when_not_given():
    p = _problem(5, 8, 70, seed=2)
    out, lse = sparse_mla_fwd(p.q, p.kv, p.indices, p.sm_scale, return_lse=True, method="per_token")
    assert out.dtype == p.q.dtype and out.shape == (5, 8, 512) and lse.dtype == torch.float32 and lse.shape == (5, 8)
    ref_out, ref_lse = sparse_mla_ref(p.q, p.kv, p.indices, p.sm_scale)
    assert_matches_reference(out, lse, ref_out, ref_lse, DTYPE)
    out_only = sparse_mla_fwd(p.q, p.kv, p.indices, p.sm_scale, method="per_token")
    assert isinstance(out_only, torch.Tensor) and torch.equal(out_only, out)


def _strided_inputs(layout: str, T: int, H: int, K: int, N: int, seed: int):
    """The same problem with one tensor in a non-contiguous (but last-dim contiguous) layout."""
    p = _problem(T, H, K, N, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    if layout == "q-head-slice":  # q is heads 2..2+H of a [T, H + 3, D] tensor
        big = torch.randn(T, H + 3, 576, generator=g).to(DTYPE).to(DEVICE)
        big[:, 2:2 + H] = p.q
        p.q = big[:, 2:2 + H]
    elif layout == "q-head-major":  # q stored as [H, T, D]: token stride D, head stride T * D
        p.q = p.q.transpose(0, 1).contiguous().transpose(0, 1)
    elif layout == "kv-row-stride":  # kv rows are the first 576 columns of 640-wide rows
        big = torch.randn(N, 640, generator=g).to(DTYPE).to(DEVICE)
        big[:, :576] = p.kv
        p.kv = big[:, :576]
    elif layout == "indices-T1K":  # FlashMLA's [T, 1, K]
        p.indices = p.indices[:, None, :]
    elif layout == "indices-row-stride":  # indices are the first K columns of [T, K + 7]
        big = torch.full((T, K + 7), 5, dtype=torch.int32, device=DEVICE)
        big[:, :K] = p.indices
        p.indices = big[:, :K]
    else:
        raise ValueError(layout)
    assert layout == "indices-T1K" or not (p.q.is_contiguous() and p.kv.is_contiguous() and p.indices.is_contiguous())
    return p


@pytest.mark.parametrize("layout", ["q-head-slice", "q-head-major", "kv-row-stride", "indices-T1K", "indices-row-stride"])
def test_non_contiguous_inputs(layout):
    p = _strided_inputs(layout, 5, 8, 70, N_ROWS, seed=13)
    run_checked(p, method="per_token")


@pytest.mark.parametrize("block_range", [pytest.param((0, 10), id="whole-pool"), pytest.param((3, 9), id="pool-slice")])
def test_paged_kv(block_range):
    """kv as [num_blocks, block_size, D_qk] (the rows of block b are b * block_size + i), also a slice of
    a larger pool."""
    b0, b1 = block_range
    bs, T, H, K = 16, 5, 16, 50
    g = torch.Generator().manual_seed(17)
    pool = torch.randn(10, bs, 576, generator=g).to(DTYPE).to(DEVICE)
    kv = pool[b0:b1]
    N = (b1 - b0) * bs
    idx = adversarial_indices(T, K, N, generator=g)
    p = make_problem(T, H, K, N, indices=idx, seed=17)
    p.kv = kv
    out, lse = run_checked(p, method="per_token")
    # the reference above flattens the pages itself; hold the result to an explicit row copy too
    ref_out, ref_lse = sparse_mla_ref(p.q, kv.reshape(N, 576).clone(), p.indices, p.sm_scale)
    assert_matches_reference(out, lse, ref_out, ref_lse, DTYPE)


@pytest.mark.parametrize("H", [pytest.param(1, id="H1"), pytest.param(5, id="H5"), pytest.param(8, id="H8")])
def test_neighbour_tokens_untouched(H):
    """A call on tokens 2..4 writing into rows 2..4 of a poisoned [7, H, 512] buffer leaves rows 0, 1, 5, 6
    (and their lse) NaN: the 16-row tile of a query with H < 16 heads stores only its own H rows."""
    T = 7
    full = _problem(T, H, 70, seed=H)
    out_big, lse_big, _, _ = poisoned_views(T, H)
    out, lse = sparse_mla_fwd(full.q[2:5], full.kv, full.indices[2:5], full.sm_scale, return_lse=True,
                              method="per_token", out=out_big[2:5], lse=lse_big[2:5])
    assert torch.isnan(out_big[[0, 1, 5, 6]]).all() and torch.isnan(lse_big[[0, 1, 5, 6]]).all()
    ref_out, ref_lse = sparse_mla_ref(full.q[2:5], full.kv, full.indices[2:5], full.sm_scale)
    assert_matches_reference(out, lse, ref_out, ref_lse, DTYPE)


needs_gpu = pytest.mark.skipif(DEVICE.type != "cuda", reason="sizes past CUDA grid / int32 limits need a GPU")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("T", [pytest.param(65535, id="T65535"), pytest.param(65536 + 5, id="T65541-past-grid-y-limit")])
def test_many_tokens(T):
    """More query tokens than a CUDA grid's y dimension holds (65535): every token must be computed."""
    H, K, N = 16, 32, 4096
    g = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(T, H, 576, device=DEVICE, generator=g).to(DTYPE)
    kv = torch.randn(N, 576, device=DEVICE, generator=g).to(DTYPE)
    idx = torch.randint(0, N, (T, K), device=DEVICE, generator=g, dtype=torch.int32)
    idx = torch.sort(idx, dim=1).values
    idx[:, 1:][idx[:, 1:] == idx[:, :-1]] = -1  # distinct rows per token
    out_big, lse_big, out, lse = poisoned_views(T, H, pad_tokens=1)
    sparse_mla_fwd(q, kv, idx, 576**-0.5, return_lse=True, method="per_token", out=out, lse=lse)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "some tokens were not computed"
    assert torch.isnan(out_big[T:]).all()
    for sl in (slice(0, 8), slice(T - 8, T)):
        ref_out, ref_lse = sparse_mla_ref(q[sl], kv, idx[sl], 576**-0.5)
        assert_matches_reference(out[sl], lse[sl], ref_out, ref_lse, DTYPE)


@pytest.mark.gpu
@needs_gpu
def test_kv_offsets_past_int32():
    """kv with more than 2**31 elements (N * 576): rows near the end must be addressed with int64 offsets."""
    N, T, H, K = 2**22 + 1000, 4, 16, 64  # (N - 1) * 576 > 2**31
    g = torch.Generator(device=DEVICE).manual_seed(1)
    kv = torch.empty(N, 576, device=DEVICE, dtype=DTYPE).normal_(generator=g)
    q = torch.randn(T, H, 576, device=DEVICE, generator=g).to(DTYPE)
    idx = (N - 1 - torch.stack([torch.randperm(4 * K, device=DEVICE, generator=g)[:K] for _ in range(T)])).to(torch.int32)
    idx[:, ::3] = 1000 * torch.arange((K + 2) // 3, device=DEVICE, dtype=torch.int32) + 7  # low rows too (distinct)
    out, lse = sparse_mla_fwd(q, kv, idx, 576**-0.5, return_lse=True, method="per_token")
    ref_out, ref_lse = compact_reference(q, kv, idx, 576**-0.5)
    assert_matches_reference(out, lse, ref_out, ref_lse, DTYPE)


@pytest.mark.parametrize("T", [pytest.param(65535, id="T65535"), pytest.param(65536 + 5, id="T65541")])
def test_launch_grid_within_cuda_limits(T, monkeypatch):
    """The grid a T-token call launches must fit CUDA's limits (y and z <= 65535) for any T: checked on
    the CPU by recording the launch instead of running it (test_many_tokens runs it on a GPU)."""
    grids = record_launch_grids(monkeypatch)
    q = torch.zeros(T, 2, 512, dtype=DTYPE, device=DEVICE)
    kv = torch.zeros(8, 512, dtype=DTYPE, device=DEVICE)
    idx = torch.zeros(T, 1, dtype=torch.int32, device=DEVICE)
    sparse_mla_fwd(q, kv, idx, 1.0, method="per_token")
    assert_grids_within_cuda_limits(grids)
