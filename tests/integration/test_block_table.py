"""Block-table conversion (request-local top-k -> global rows) and strided paged caches.

The Triton converter is compared with the torch reference ``convert_req_index_to_global_ref`` and,
independently of both formulas, with the meaning of a row: the converted row of the flat cache view
holds the same latent vector as the request's own contiguous copy at the local position.
End to end: converted indices + a strided paged cache into ``sparse_mla_fwd`` equal the fp32
reference on per-request contiguous copies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from testlib.device import DEVICE, DTYPE, INT_MAX, INT_MIN
from testlib.problems import poisoned_out
from testlib.tolerances import assert_matches_reference

from sparse_mla import SparseMLAWorkspace, sparse_mla_fwd, sparse_mla_ref
from sparse_mla.integration.block_table import (
    convert_req_index_to_global,
    convert_req_index_to_global_ref,
    paged_kv_as_rows,
)

D_QK = 576


@dataclass
class PagedBatch:
    kv_cache: torch.Tensor  # [num_blocks, block_size, D] view, block stride num_layers * block_size * D
    rows: torch.Tensor  # [N, D] paged_kv_as_rows view
    rows_per_block_stride: int
    block_table: torch.Tensor  # [B, max_blocks] int32, -1 = unallocated
    ctx_lens: list[int]  # tokens in the cache per request
    req_id: torch.Tensor  # [T] int32
    topk_local: torch.Tensor  # [T, K] int32
    block_size: int

    def request_kv(self, r: int) -> torch.Tensor:
        """The request's cache as one contiguous [ctx_len, D] copy (what a non-paged engine holds)."""
        n = self.ctx_lens[r]
        nb = -(-n // self.block_size)
        blocks = self.block_table[r, :nb].long()
        return self.kv_cache[blocks].reshape(nb * self.block_size, -1)[:n].contiguous()


def make_paged_batch(ctx_lens, new_lens, block_size, K, *, num_layers=1, layer=0, spare_blocks=2, extra_table_cols=1,
                     d=D_QK, seed=0) -> PagedBatch:
    """Requests with ``ctx_lens`` cached tokens (the last ``new_lens`` are this step's queries), pages in a
    cross-layer cache [num_blocks, num_layers, block_size, d] viewed at ``layer``, blocks shuffled."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in ctx_lens]
    num_blocks = sum(need) + spare_blocks
    storage = torch.randn(num_blocks, num_layers, block_size, d, generator=g).to(DTYPE).to(DEVICE)
    kv_cache = storage[:, layer]
    rows, stride_rows = paged_kv_as_rows(kv_cache)
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = max(need) + extra_table_cols
    table = torch.full((len(ctx_lens), max_blocks), -1, dtype=torch.int32)
    used = 0
    for r, nb in enumerate(need):
        table[r, :nb] = perm[used:used + nb].to(torch.int32)
        used += nb
    req_ids, topk = [], []
    for r, (n, new) in enumerate(zip(ctx_lens, new_lens)):
        for i in range(new):
            visible = n - new + i + 1  # causal: the query at position n - new + i sees 0 .. itself
            row = torch.full((K,), -1, dtype=torch.int32)
            take = min(K, visible)
            row[:take] = torch.randperm(visible, generator=g)[:take].to(torch.int32)
            row = row[torch.randperm(K, generator=g)]  # -1 padding anywhere in the row
            topk.append(row)
            req_ids.append(r)
    return PagedBatch(kv_cache, rows, stride_rows, table.to(DEVICE), list(ctx_lens),
                      torch.tensor(req_ids, dtype=torch.int32, device=DEVICE), torch.stack(topk).to(DEVICE), block_size)


def check_against_reference(b: PagedBatch, **kw) -> torch.Tensor:
    out, counts = convert_req_index_to_global(b.req_id, b.block_table, b.topk_local, b.block_size,
                                              kv_block_stride_rows=b.rows_per_block_stride, return_valid_counts=True, **kw)
    ref, ref_counts = convert_req_index_to_global_ref(b.req_id, b.block_table, b.topk_local, b.block_size,
                                                      kv_block_stride_rows=b.rows_per_block_stride, **kw)
    assert out.dtype == torch.int32 and counts.dtype == torch.int32
    assert torch.equal(out, ref), f"{(out != ref).sum().item()} entries differ from the reference"
    assert torch.equal(counts, ref_counts)
    assert torch.equal(counts, (out >= 0).sum(1, dtype=torch.int32))
    return out


def check_row_meaning(b: PagedBatch, out: torch.Tensor) -> None:
    """Independent of the formula: valid local positions map to rows holding the request's vector there."""
    for t in range(out.shape[0]):
        r = int(b.req_id[t])
        pos = b.topk_local[t]
        valid = (pos >= 0) & (pos < b.ctx_lens[r])
        assert torch.equal(out[t] >= 0, valid), f"token {t}: -1 exactly where the local position is padding"
        if valid.any():
            assert torch.equal(b.rows[out[t][valid].long()], b.request_kv(r)[pos[valid].long()]), f"token {t}: wrong rows"


CASES = [
    # id, ctx_lens, new_lens, block_size, K, num_layers
    ("bs16", [37, 90, 16], [3, 4, 1], 16, 48, 1),
    ("bs64", [130, 64, 7], [2, 3, 1], 64, 64, 1),
    ("block-stride-gt-block-size", [50, 100], [3, 2], 16, 40, 3),
    ("topk-not-multiple-of-128", [200], [3], 16, 100, 1),
    ("last-block-positions", [63, 65, 128], [1, 1, 1], 64, 96, 2),
    ("more-than-64-blocks", [16 * 70 + 5], [2], 16, 96, 1),
]


@pytest.mark.parametrize("ctx_lens,new_lens,block_size,K,num_layers", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_convert_matches_reference(ctx_lens, new_lens, block_size, K, num_layers):
    b = make_paged_batch(ctx_lens, new_lens, block_size, K, num_layers=num_layers, layer=num_layers - 1)
    # force the last position of each request into its list (the tail of the last block)
    for t in range(b.topk_local.shape[0]):
        last = b.ctx_lens[int(b.req_id[t])] - 1
        if not (b.topk_local[t] == last).any():
            b.topk_local[t, 0] = last
    out = check_against_reference(b)
    check_row_meaning(b, out)
    assert b.rows_per_block_stride == num_layers * block_size


def test_convert_adversarial_entries_and_padded_rows():
    """Sentinels, positions past the table or past an unallocated block, and CUDA-graph padding rows."""
    b = make_paged_batch([40, 20], [2, 2], 16, 8, spare_blocks=1, extra_table_cols=2)
    tk = b.topk_local.clone()
    bs, max_blocks = b.block_size, b.block_table.shape[1]
    tk[0, :8] = torch.tensor([INT_MIN, -1, -7, INT_MAX, max_blocks * bs, max_blocks * bs - 1, 0, 39], dtype=torch.int32)
    tk[2, :4] = torch.tensor([20, 31, 32, 3], dtype=torch.int32)  # request 1 (20 tokens, 2 blocks)
    table = b.block_table.clone()
    table[1, 1] = -1  # an unallocated block in the middle of request 1's table
    # padded token rows: req_id -1, an id past B, and a dummy request whose table row is all -1
    dummy_table = torch.cat([table, torch.full((1, max_blocks), -1, dtype=torch.int32, device=DEVICE)])
    req_id = torch.cat([b.req_id, torch.tensor([-1, 3, INT_MIN, 2], dtype=torch.int32, device=DEVICE)])
    pad_rows = torch.arange(4 * 8, dtype=torch.int32, device=DEVICE).reshape(4, 8)  # plausible positions
    tk = torch.cat([tk, pad_rows])
    out, counts = convert_req_index_to_global(req_id, dummy_table, tk, bs, return_valid_counts=True)
    ref, ref_counts = convert_req_index_to_global_ref(req_id, dummy_table, tk, bs)
    assert torch.equal(out, ref) and torch.equal(counts, ref_counts)
    row0, row1 = table[0].tolist(), table[1].tolist()
    assert out[0].tolist() == [-1, -1, -1, -1, -1, -1, row0[0] * bs, row0[2] * bs + 7]
    # 20 and 31 fall in request 1's block 1, made unallocated; 32 in block 2 (never allocated); 3 in block 0
    assert out[2, :4].tolist() == [-1, -1, -1, row1[0] * bs + 3]
    assert torch.all(out[-4:] == -1) and torch.all(counts[-4:] == 0), "padded token rows must convert to all -1"


def test_convert_strided_inputs_and_out():
    """A transposed topk_local, a column slice of a wider (persistent) block table, a preallocated out."""
    b = make_paged_batch([70, 33, 5], [2, 2, 1], 16, 24, num_layers=2)
    wide = torch.full((5, 40), 123456, dtype=torch.int32, device=DEVICE)
    wide[: b.block_table.shape[0], : b.block_table.shape[1]] = b.block_table
    table_view = wide[: b.block_table.shape[0], : b.block_table.shape[1] + 3]  # row stride 40, extra -1s replaced
    table_view[:, b.block_table.shape[1]:] = -1
    tk_t = b.topk_local.t().contiguous().t()  # same values, strides (1, T)
    assert tk_t.stride(1) != 1
    out = torch.full_like(b.topk_local, 777777)
    counts = torch.full_like(b.req_id, 777777)
    res = convert_req_index_to_global(b.req_id, table_view, tk_t, b.block_size,
                                      kv_block_stride_rows=b.rows_per_block_stride, out=out, valid_counts=counts)
    assert res.data_ptr() == out.data_ptr()
    ref, ref_counts = convert_req_index_to_global_ref(b.req_id, b.block_table, b.topk_local, b.block_size,
                                                      kv_block_stride_rows=b.rows_per_block_stride)
    assert torch.equal(out, ref) and torch.equal(counts, ref_counts)
    check_row_meaning(b, out)


STRIDE_LAYOUTS = ["req_id-strided", "req_id-expanded", "valid_counts-strided", "everything-strided"]


@pytest.mark.parametrize("layout", STRIDE_LAYOUTS)
def test_convert_honours_req_id_and_valid_counts_strides(layout):
    """req_id as a strided view (other requests' ids in the gaps), as a stride-0 expanded view of one id
    (the storage after it holds another id), and valid_counts as a strided view: the kernel must read and
    write through the strides, and leave the gaps of valid_counts alone."""
    if layout == "req_id-expanded":  # every token of request 1
        b = make_paged_batch([20, 90], [0, 6], 16, 24)
    else:
        b = make_paged_batch([37, 90, 16], [3, 4, 1], 16, 24)
    T, B = b.req_id.shape[0], b.block_table.shape[0]
    req_id, counts_big = b.req_id, None
    if layout in ("req_id-strided", "everything-strided"):
        big = ((b.req_id[:, None] + torch.arange(1, 4, device=DEVICE, dtype=torch.int32)) % B).to(torch.int32)
        big[:, 1] = b.req_id  # neighbours: valid ids of other requests
        req_id = big[:, 1]
        assert req_id.stride() == (3,)
    elif layout == "req_id-expanded":
        storage = torch.tensor([1] + [0] * (T + 4), dtype=torch.int32, device=DEVICE)  # request 0 right after it
        req_id = storage[:1].expand(T)
        assert req_id.stride() == (0,) and torch.equal(req_id, b.req_id)
    counts = None
    if layout in ("valid_counts-strided", "everything-strided"):
        counts_big = torch.full((T, 2), 777777, dtype=torch.int32, device=DEVICE)
        counts = counts_big[:, 0]
    topk = b.topk_local if layout != "everything-strided" else b.topk_local.t().contiguous().t()
    out, got_counts = convert_req_index_to_global(req_id, b.block_table, topk, b.block_size,
                                                  kv_block_stride_rows=b.rows_per_block_stride,
                                                  return_valid_counts=True, valid_counts=counts)
    ref, ref_counts = convert_req_index_to_global_ref(b.req_id, b.block_table, b.topk_local, b.block_size,
                                                      kv_block_stride_rows=b.rows_per_block_stride)
    assert torch.equal(out, ref), f"{(out != ref).sum().item()} entries differ (req_id read without its stride?)"
    assert torch.equal(got_counts, ref_counts)
    check_row_meaning(b, out)
    if counts_big is not None:
        assert got_counts.data_ptr() == counts.data_ptr()
        assert torch.all(counts_big[:, 1] == 777777), "valid_counts written into the gaps of its strided view"


def test_convert_refuses_overlapping_outputs():
    """Buffers the kernel writes: every element its own memory, no overlap with each other or an input."""
    req_id, table, topk = _args()
    T, K = topk.shape
    cases = [
        ({"out": torch.empty(1, K, dtype=torch.int32, device=DEVICE).expand(T, K)}, "out must be"),
        ({"valid_counts": torch.empty(1, dtype=torch.int32, device=DEVICE).expand(T)}, "valid_counts must be"),
        ({"out": topk}, "out shares memory with topk_local"),
        ({"out": (buf := torch.empty(T, K + 1, dtype=torch.int32, device=DEVICE))[:, :K], "valid_counts": buf[:, K]},
         "out shares memory with valid_counts"),
        ({"valid_counts": req_id}, "valid_counts shares memory with req_id"),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            convert_req_index_to_global(req_id, table, topk, 16, **kw)


def test_convert_num_kv_rows_bound_and_empty():
    b = make_paged_batch([48], [2], 16, 16, spare_blocks=0)
    bound = int(b.rows.shape[0]) - 16  # the last physical block's rows are out of range
    out = convert_req_index_to_global(b.req_id, b.block_table, b.topk_local, 16, num_kv_rows=bound)
    ref, _ = convert_req_index_to_global_ref(b.req_id, b.block_table, b.topk_local, 16, num_kv_rows=bound)
    assert torch.equal(out, ref)
    assert out.max().item() < bound and (out == -1).sum() > (b.topk_local == -1).sum()
    empty = convert_req_index_to_global(b.req_id[:0], b.block_table, b.topk_local[:0], 16)
    assert empty.shape == (0, 16)


def _args():
    req_id = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    table = torch.zeros(2, 3, dtype=torch.int32, device=DEVICE)
    topk = torch.zeros(4, 8, dtype=torch.int32, device=DEVICE)
    return req_id, table, topk


ERRORS = [
    # id, mutate(args) -> (req_id, table, topk, kwargs), exception, message
    ("rows-mismatch-full-batch-req-id", lambda r, t, k: (torch.zeros(9, dtype=torch.int32, device=DEVICE), t, k, {}),
     ValueError, "token rows"),
    ("rows-mismatch-short-req-id", lambda r, t, k: (r[:2], t, k, {}), ValueError, "token rows"),
    ("req-id-int64", lambda r, t, k: (r.long(), t, k, {}), TypeError, r"req_id must be \[T\] int32.*got dtype torch.int64"),
    ("req-id-2d", lambda r, t, k: (r[:, None], t, k, {}), ValueError, r"req_id must be \[T\]"),
    ("req-id-not-tensor", lambda r, t, k: ([0, 0, 0, 0], t, k, {}), TypeError, "req_id must be a torch.Tensor"),
    ("block-table-int64", lambda r, t, k: (r, t.long(), k, {}), TypeError, "block_table must be .* int32.*got dtype"),
    ("block-table-1d", lambda r, t, k: (r, t[0], k, {}), ValueError, "block_table must be"),
    ("topk-3d", lambda r, t, k: (r, t, k[:, None], {}), ValueError, "topk_local must be"),
    ("block-size-0", lambda r, t, k: (r, t, k, {"block_size": 0}), ValueError, "block_size"),
    ("block-size-float", lambda r, t, k: (r, t, k, {"block_size": 16.0}), TypeError, "block_size must be an int, got float"),
    ("block-size-bool", lambda r, t, k: (r, t, k, {"block_size": True}), TypeError, "block_size must be an int, got bool"),
    ("num-kv-rows-float", lambda r, t, k: (r, t, k, {"num_kv_rows": 1e6}), TypeError, "num_kv_rows must be an int"),
    ("stride-lt-block-size", lambda r, t, k: (r, t, k, {"kv_block_stride_rows": 8}), ValueError, "kv_block_stride_rows"),
    ("out-wrong-shape", lambda r, t, k: (r, t, k, {"out": torch.empty(4, 7, dtype=torch.int32, device=DEVICE)}),
     ValueError, "out must be"),
    ("out-int64", lambda r, t, k: (r, t, k, {"out": torch.empty(4, 8, dtype=torch.int64, device=DEVICE)}),
     TypeError, r"out must be \[T, K\] = \[4, 8\] int32.*got dtype torch.int64"),
    ("out-other-device", lambda r, t, k: (r, t, k, {"out": torch.empty(4, 8, dtype=torch.int32, device="meta")}),
     ValueError, "out must be .* on .*got a tensor on meta"),
    ("return-valid-counts-int", lambda r, t, k: (r, t, k, {"return_valid_counts": 1}), TypeError,
     "return_valid_counts must be a bool"),
    ("valid-counts-wrong-shape", lambda r, t, k: (r, t, k, {"valid_counts": torch.empty(3, dtype=torch.int32, device=DEVICE)}),
     ValueError, "valid_counts must be"),
]


@pytest.mark.parametrize("mutate,exc,msg", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_convert_rejects_bad_input(mutate, exc, msg):
    req_id, table, topk, kw = mutate(*_args())
    bs = kw.pop("block_size", 16)
    with pytest.raises(exc, match=msg):
        convert_req_index_to_global(req_id, table, topk, bs, **kw)
    if not {"out", "valid_counts", "return_valid_counts"} & kw.keys():  # the reference checks the same arguments
        # (it has no outputs)
        with pytest.raises(exc, match=msg):
            convert_req_index_to_global_ref(req_id, table, topk, bs, **kw)


def test_paged_kv_as_rows_views_and_errors():
    storage = torch.randn(5, 3, 16, 64)
    cache = storage[:, 1]  # block stride 3 * 16 * 64
    rows, stride_rows = paged_kv_as_rows(cache)
    assert stride_rows == 48 and rows.shape == (4 * 48 + 16, 64) and rows.data_ptr() == cache.data_ptr()
    for blk in range(5):
        assert torch.equal(rows[blk * 48: blk * 48 + 16], cache[blk])
    padded = torch.randn(4, 16, 80)[:, :, :64]  # rows padded to 80 elements (row stride 80)
    rows_p, s_p = paged_kv_as_rows(padded)
    assert s_p == 16 and rows_p.stride() == (80, 1) and torch.equal(rows_p[16:32], padded[1])
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        paged_kv_as_rows(torch.randn(4, 16, 64).transpose(1, 2))
    with pytest.raises(ValueError, match="multiple of the row stride"):
        paged_kv_as_rows(torch.randn(4 * 16 * 64 + 100).as_strided((4, 16, 64), (16 * 64 + 3, 64, 1)))
    with pytest.raises(ValueError, match=r"\[num_blocks, block_size, D_qk\]"):
        paged_kv_as_rows(torch.randn(16, 64))
    with pytest.raises(TypeError):
        paged_kv_as_rows([1, 2])


@pytest.mark.parametrize("method", ["per_token", "grouped"])
def test_end_to_end_strided_paged_cache_matches_contiguous_reference(method):
    """Converter + strided paged cache + sparse_mla_fwd == fp32 reference on per-request contiguous copies,
    with CUDA-graph padding rows (req_id -1, covered by a dummy request in cu_seqlens_q) giving out 0 / lse -inf."""
    H, K, bs = 32, 40, 16
    ctx_lens, new_lens = [45, 70, 9], [1, 6, 3]
    b = make_paged_batch(ctx_lens, new_lens, bs, K, num_layers=3, layer=1, seed=3)
    n_real, n_pad = b.req_id.shape[0], 2
    T = n_real + n_pad
    g = torch.Generator().manual_seed(4)
    q = torch.randn(T, H, D_QK, generator=g).to(DTYPE).to(DEVICE)
    req_id = torch.cat([b.req_id, torch.full((n_pad,), -1, dtype=torch.int32, device=DEVICE)])
    topk_local = torch.cat([b.topk_local, torch.randint(0, 9, (n_pad, K), generator=g, dtype=torch.int32).to(DEVICE)])
    indices, counts = convert_req_index_to_global(req_id, b.block_table, topk_local, bs,
                                                  kv_block_stride_rows=b.rows_per_block_stride, return_valid_counts=True)
    cu = torch.tensor([0, 1, 7, 10, T], dtype=torch.int32, device=DEVICE)  # requests + a dummy padding request
    out, lse = poisoned_out(T, H)
    ws = SparseMLAWorkspace.for_problem(T, K, H, b.rows.shape[0], DEVICE)
    sparse_mla_fwd(q, b.rows, indices, D_QK**-0.5, method=method, cu_seqlens_q=cu, workspace=ws, out=out, lse=lse,
                   overlap_guard=math.inf, check=True)
    ref_out = torch.zeros(T, H, 512, device=DEVICE)
    ref_lse = torch.full((T, H), float("-inf"), device=DEVICE)
    for r in range(len(ctx_lens)):
        a, e = int(cu[r]), int(cu[r + 1])
        o_r, l_r = sparse_mla_ref(q[a:e], b.request_kv(r), b.topk_local[a:e], D_QK**-0.5)
        ref_out[a:e], ref_lse[a:e] = o_r, l_r
    assert_matches_reference(out, lse, ref_out, ref_lse, DTYPE)
    assert torch.all(out[n_real:] == 0) and torch.all(lse[n_real:] == float("-inf"))
    assert torch.all(counts[n_real:] == 0) and torch.equal(counts[:n_real], (b.topk_local >= 0).sum(1, dtype=torch.int32))
