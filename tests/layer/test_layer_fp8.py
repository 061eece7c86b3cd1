"""The layer paths and the block-table path on an FP8 ``fp8_ds_mla`` cache: each against the layer reference on
the cache dequantized to q's dtype (tests/mqa/test_kv_fp8.py holds the kernels on it)."""

from __future__ import annotations

import pytest
import torch
from testlib.device import DEVICE, DTYPE
from testlib.fp8 import FMT, FP8, fp8_problem, layer_inputs, spread_kv
from testlib.problems import poisoned_out
from testlib.tolerances import (
    LAYER_ROW_TOLERANCE,
    assert_matches_reference,
    assert_rows_close,
)

from sparse_mla import dsa_prefill, dsa_prefill_ref, sparse_mla_fwd, sparse_mla_ref


@pytest.mark.parametrize("path, paged", [
    pytest.param("masked_mha", False, id="masked_mha"),
    pytest.param("mqa_grouped", True, id="mqa_grouped-paged"),
    pytest.param("mqa_per_token", False, id="mqa_per_token"),
])
def test_dsa_prefill_fp8_paths_match_layer_reference(path, paged):
    inp = layer_inputs(31, paged=paged)
    ref = dsa_prefill_ref(**inp)
    assert torch.allclose(ref, dsa_prefill_ref(**inp, form="mha"), rtol=1e-4, atol=1e-5)
    plain = {**inp, "kv": FMT.dequantize(inp["kv"], DTYPE).reshape(-1, 576), "kv_format": None}
    assert torch.equal(ref, dsa_prefill_ref(**plain))  # the definition: the dequantized cache
    out = torch.full((11, 16, 32), float("nan"), dtype=DTYPE, device=DEVICE)
    o, d = dsa_prefill(**inp, path=path, out=out, return_decision=True)
    assert d.path == path and o is out
    assert_rows_close(out, ref, DTYPE, f"{path} o", LAYER_ROW_TOLERANCE)


def test_dsa_prefill_fp8_dense_path_matches_layer_reference():
    inp = layer_inputs(32)
    inp.update(cached_lens=[0, 0], new_lens=[6, 5])
    idx = torch.full((11, 16), -1, dtype=torch.int32)
    for t, (o, i) in enumerate([(0, i) for i in range(6)] + [(30, i) for i in range(5)]):
        idx[t, : i + 1] = torch.randperm(i + 1) + o  # whole windows: dense-eligible
    inp["indices"] = idx.to(DEVICE)
    out, d = dsa_prefill(**inp, return_decision=True)
    assert d.path == "dense_mha"
    assert_rows_close(out, dsa_prefill_ref(**inp), DTYPE, "dense_mha o", LAYER_ROW_TOLERANCE)


def test_dsa_prefill_fp8_check_flags_a_nonfinite_window_row():
    inp = layer_inputs(33)
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


