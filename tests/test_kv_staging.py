"""The staged route for an FP8 cache (``sparse_mla.kv_staging``, ``sparse_mla.layer.staging``): the dequantize
kernel writes exactly ``FP8_DS_MLA.dequantize``'s numbers, the rule picks a route per call, and both routes of the
op and of the layer match the fp32 reference on the dequantized cache per (token, head) row."""

from __future__ import annotations

import logging

import pytest
import torch
from testlib.device import DEVICE, DTYPE
from testlib.fp8 import FP8, fp8_problem, layer_inputs, run_fp8_checked, spread_kv
from testlib.tolerances import LAYER_ROW_TOLERANCE, assert_rows_close

from sparse_mla import dsa_prefill, dsa_prefill_ref
from sparse_mla.kv_format import FP8_DS_MLA, KV_DEQUANT_MODES
from sparse_mla.kv_staging import DEFAULT_MAX_STAGED_BYTES, STAGE_NS_PER_ROW, choose_kv_dequant, dequantize_rows


@pytest.mark.parametrize("scale_format", ["ue8m0", "fp32"])
def test_dequantize_rows_is_the_format_definition(scale_format):
    """All rows, chosen rows (repeats, any order) and a slice: bit for bit FP8_DS_MLA.dequantize in the suite's
    dtype (the interpreter rounds fp32 -> bf16 by truncation, so the CPU checks fp16; a GPU checks bf16), into a
    poisoned out= buffer with a row stride."""
    cache = FP8_DS_MLA.quantize(spread_kv(37, seed=3), scale_format=scale_format)
    ref = FP8_DS_MLA.dequantize(cache, DTYPE)
    bits = lambda x: x.view(torch.int16)  # noqa: E731
    assert torch.equal(bits(dequantize_rows(cache, DTYPE)), bits(ref))
    ids = torch.tensor([5, 0, 36, 5, 17], dtype=torch.int32, device=DEVICE)
    assert torch.equal(bits(dequantize_rows(cache, DTYPE, ids)), bits(ref[ids.long()]))
    big = torch.full((9, 600), float("nan"), dtype=DTYPE, device=DEVICE)
    got = dequantize_rows(cache, DTYPE, slice(3, 9), out=big[:6, :576])
    assert got.data_ptr() == big.data_ptr() and torch.equal(bits(got), bits(ref[3:9]))
    assert torch.isnan(big[:6, 576:]).all() and torch.isnan(big[6:]).all(), "wrote outside out="
    assert dequantize_rows(cache, DTYPE, slice(4, 4)).shape == (0, 576)


def test_dequantize_rows_rejects_bad_arguments():
    cache = FP8_DS_MLA.quantize(spread_kv(8, seed=1))
    with pytest.raises(ValueError, match="cache_rows must be uint8"):
        dequantize_rows(cache.view(torch.float8_e4m3fn).float(), DTYPE)
    with pytest.raises(ValueError, match="step 1"):
        dequantize_rows(cache, DTYPE, slice(0, 8, 2))
    with pytest.raises(ValueError, match="out must be"):
        dequantize_rows(cache, DTYPE, out=torch.empty(7, 576, dtype=DTYPE, device=DEVICE))


def test_route_rule():
    """in_kernel never stages; staged always (or raises past the allowed bytes); auto compares the staging cost of
    the staged rows with the in-kernel cost of the gathered rows, and never stages past the allowed bytes."""
    assert choose_kv_dequant("in_kernel", 10, 10**9, 1152)[0] == "in_kernel"
    assert choose_kv_dequant("staged", 10**6, 1, 1152)[0] == "staged"
    with pytest.raises(ValueError, match="max_staged_bytes"):
        choose_kv_dequant("staged", 10**6, 1, 1152, max_staged_bytes=1000)
    with pytest.raises(ValueError, match="kv_dequant must be one of"):
        choose_kv_dequant("bf16", 1, 1, 1152)
    assert choose_kv_dequant("auto", 32768, 8192 * 2048, 1152)[0] == "staged"  # a long step over a 32K cache
    assert choose_kv_dequant("auto", 10**7, 16 * 2048, 1152)[0] == "in_kernel"  # 16 tokens over 10M rows
    assert choose_kv_dequant("auto", 100, 10**9, 1152, max_staged_bytes=0)[0] == "in_kernel"
    rows = DEFAULT_MAX_STAGED_BYTES // 1152 + 1
    assert choose_kv_dequant("auto", rows, int(rows * STAGE_NS_PER_ROW * 1e3), 1152)[0] == "in_kernel"  # too big
    assert KV_DEQUANT_MODES == ("auto", "in_kernel", "staged")


@pytest.mark.parametrize("method", ["per_token", "grouped"])
@pytest.mark.parametrize("kv_dequant", ["staged", "in_kernel", "auto"])
def test_op_routes_match_the_reference(method, kv_dequant, caplog):
    """sparse_mla_fwd on an FP8 cache (adversarial lists, topk_length, a sink) by each route: every (token, head)
    row matches the reference on the dequantized cache; the debug line names the route taken."""
    caplog.set_level(logging.DEBUG, logger="sparse_mla")
    T, H, K, N = 11, 16, 24, 70
    q, cache, idx = fp8_problem(T, H, K, N, seed=7, scale_format="fp32")
    lens = torch.randint(0, K + 1, (T,), generator=torch.Generator().manual_seed(2)).to(torch.int32).to(DEVICE)
    sink = torch.randn(H, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    # sm_scale 0.01: the spread cache's large scores would push a one-row query's sunk out below fp16's range
    run_fp8_checked(q, cache, idx, 0.01, topk_length=lens, attn_sink=sink, method=method, kv_dequant=kv_dequant)
    lines = [r.getMessage() for r in caplog.records if "sparse_mla_fwd" in r.getMessage()]
    want = {"staged": "staged to", "in_kernel": "dequantized in the gather"}
    assert lines and all(want.get(kv_dequant, "FP8") in m for m in lines), lines


def test_op_staged_route_uses_the_workspace_buffer():
    """With a workspace whose max_kv_rows hold the cache, the staged rows come from its staging buffer (allocated
    once, reused by the next call)."""
    from sparse_mla import SparseMLAWorkspace

    T, H, K, N = 9, 16, 20, 50
    q, cache, idx = fp8_problem(T, H, K, N, seed=11)
    ws = SparseMLAWorkspace.for_problem(T, K, H, N, DEVICE)
    run_fp8_checked(q, cache, idx, 0.1, method="grouped", workspace=ws, kv_dequant="staged")
    buf = ws.staging_buffer(N, DTYPE)
    run_fp8_checked(q, cache, idx, 0.1, method="grouped", workspace=ws, kv_dequant="staged")
    assert ws.staging_buffer(N, DTYPE).data_ptr() == buf.data_ptr()
    assert ws.staging_buffer(N + 1, DTYPE) is None  # more rows than max_kv_rows: the call allocates


def test_op_rejects_an_unknown_route():
    from sparse_mla import sparse_mla_fwd

    q, cache, idx = fp8_problem(4, 16, 8, 20, seed=1)
    with pytest.raises(ValueError, match="kv_dequant must be one of"):
        sparse_mla_fwd(q, cache, idx, 0.1, kv_format=FP8, kv_dequant="bf16")


@pytest.mark.parametrize("path", ["mqa_per_token", "mqa_grouped"])
@pytest.mark.parametrize("kv_dequant", ["staged", "in_kernel"])
@pytest.mark.parametrize("paged", [False, True])
def test_layer_routes_match_the_reference(path, kv_dequant, paged):
    """dsa_prefill on an FP8 cache, two requests whose windows are not adjacent (rows 26..29 in no window), both MQA
    paths by each route: every (token, head) row matches dsa_prefill_ref on the dequantized cache."""
    inp = layer_inputs(5, paged=paged)
    out = dsa_prefill(**inp, path=path, kv_dequant=kv_dequant)
    ref = dsa_prefill_ref(**inp)
    assert_rows_close(out, ref, DTYPE, f"{path} {kv_dequant}", LAYER_ROW_TOLERANCE)


def test_layer_rejects_an_unknown_route():
    with pytest.raises(ValueError, match="kv_dequant must be one of"):
        dsa_prefill(**layer_inputs(1), kv_dequant="never")


def test_layer_stage_windows_packs_adjacent_windows_as_one_slice():
    """Adjacent windows (the default packed layout) stage as one contiguous slice of rows, non-adjacent ones
    by row ids; both give each valid index its window row."""
    from sparse_mla.layer.checks import validate_dsa_prefill_args
    from sparse_mla.layer.staging import stage_windows

    inp = layer_inputs(2)
    p = validate_dsa_prefill_args(**{k: v for k, v in inp.items()})
    s = stage_windows(p)
    assert s.kv_format is None and s.kv_rows.shape == (sum(p.step.windows), 576)
    assert s.row_offsets == (0, 26)
    ref = FP8_DS_MLA.dequantize(FP8_DS_MLA.as_rows(inp["kv"]), DTYPE)
    rows = torch.cat([ref[0:26], ref[30:35]])
    assert torch.equal(s.kv_rows.view(torch.int16), rows.view(torch.int16))
    valid = p.indices >= 0
    moved = torch.where(p.indices >= 30, p.indices - 4, p.indices)
    assert torch.equal(torch.where(valid, s.indices, -1), torch.where(valid, moved, -1))


@pytest.mark.parametrize("row0", [0, 5])
@pytest.mark.parametrize("path", ["mqa_per_token", "mqa_grouped"])
def test_layer_staged_route_on_adjacent_windows(row0, path):
    """The packed layout (each window right after the previous one, from row 0 or later): one staged slice, the
    indices shifted (not remapped); every (token, head) row matches dsa_prefill_ref, out-of-window entries ignored."""
    inp = layer_inputs(9)
    idx = inp["indices"]
    inp["indices"] = torch.where(idx >= 30, idx - 30 + 26 + row0, torch.where(idx >= 0, idx + row0, idx))
    inp["row_offsets"] = [row0, row0 + 26]
    inp["indices"][0, -1] = row0 + 30  # a future row of request 0 (outside its window): padding
    out = dsa_prefill(**inp, path=path, kv_dequant="staged")
    assert_rows_close(out, dsa_prefill_ref(**inp), DTYPE, f"{path} row0 {row0}", LAYER_ROW_TOLERANCE)
