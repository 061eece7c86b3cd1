"""Tolerances per dtype and the comparisons of a result to the fp32 reference."""

from __future__ import annotations

import torch

# Relative Frobenius error allowed against the fp32 reference, per dtype (bf16 level): the whole-tensor
# figure, kept for comparisons of whole results (benchmarks, sums); kernel and path tests use the per-row
# tolerances below.
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}
# Per (token, head) output row: ||row - ref|| / ||ref||. The kernels round P and the output to the dtype
# once each (unit roundoff u = 2^-8 bf16, 2^-11 fp16), so a row's error is about one u (observed on the CPU
# suite: at most 0.87 u in fp16); 3 u here. One token's head scaled by 1.05 is 13 u over in bf16.
ROW_TOLERANCE = {torch.bfloat16: 3 * 2**-8, torch.float16: 3 * 2**-11, torch.float32: 1e-5}
# The layer's o [T, H, v_head_dim] (sparse_mla.layer): one more rounding to the dtype than the kernels (the
# MQA paths' latent before W_UV, the MHA paths' decompressed K / V): 4 u (observed: 1.2 u in fp16).
LAYER_ROW_TOLERANCE = {torch.bfloat16: 4 * 2**-8, torch.float16: 4 * 2**-11, torch.float32: 2e-5}
# Whole-tensor 1 - cosine similarity (FlashMLA's extra bound): about (row error)^2, u^2 = 1.5e-5 bf16,
# 2.4e-7 fp16 (observed: 4e-8 in fp16).
COS_DIFF_TOLERANCE = {torch.bfloat16: 2e-5, torch.float16: 1e-6, torch.float32: 1e-9}
# lse: kernel and reference read the same dtype-rounded q / kv and both sum in fp32, so lse carries only
# fp32 rounding whatever q's dtype: FlashMLA's rule, abs 1e-6 plus 2.01 / 65536 relative (the old 2e-3 /
# 1e-2 absolute was ~40-200x the largest error observed, 4.6e-5 at |lse| ~ 5; this bound is 3x it).
LSE_ABS_TOLERANCE = 1e-6
LSE_REL_TOLERANCE = 2.01 / 65536


def all_of(items, what: str = "") -> bool:
    """``all(items)`` that fails on an empty collection (an ``all`` over nothing proves nothing): use it in
    asserts over generated collections."""
    items = list(items)
    assert items, f"all() over an empty collection{': ' + what if what else ''}"
    return all(items)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ||x - ref|| / ||ref|| in fp32 (0 when both are 0)."""
    x, ref = x.float(), ref.float()
    denom = ref.norm().item()
    num = (x - ref).norm().item()
    return num / denom if denom > 0 else num


def row_rel_errors(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per row of the last dim (a (token, head) row of an out [T, H, D]): ||x - ref|| / ||ref|| in fp32,
    [*x.shape[:-1]]. A row whose reference is 0 gets its absolute error ||x|| (it must be exactly 0)."""
    x, ref = x.float(), ref.float().to(x.device)
    num = (x - ref).norm(dim=-1)
    den = ref.norm(dim=-1)
    return torch.where(den > 0, num / torch.where(den > 0, den, 1.0), num)


def cos_diff(x: torch.Tensor, ref: torch.Tensor) -> float:
    """1 - cosine similarity of the flattened tensors, as FlashMLA computes it: 1 - 2 <x, r> / (|x|^2 + |r|^2)
    in fp64 (0 for two zero tensors)."""
    a, r = x.double().flatten(), ref.double().to(x.device).flatten()
    den = (a * a + r * r).sum().item()
    return 0.0 if den == 0 else 1 - 2 * (a * r).sum().item() / den


def assert_rows_close(x: torch.Tensor, ref: torch.Tensor, dtype, what: str = "out", row_tolerance=None) -> None:
    """Every (token, head) row of ``x`` [..., D] within ``ROW_TOLERANCE[dtype]`` (or ``row_tolerance[dtype]``)
    relative error of its reference row (a row whose reference is 0 must be exactly 0), no NaN, and the whole tensor's cosine
    difference within ``COS_DIFF_TOLERANCE[dtype]``. The message names the worst row and the whole-tensor
    relative error (an extra figure, not the criterion)."""
    assert x.shape == ref.shape, f"{what}: shape {tuple(x.shape)} != reference {tuple(ref.shape)}"
    nan = torch.isnan(x)
    if nan.any():
        raise AssertionError(f"{what}: NaN at {int(nan.sum())} elements, first at {nan.nonzero()[0].tolist()} "
                             "(an unwritten or NaN-producing element)")
    if x.numel() == 0:
        return
    errs = row_rel_errors(x, ref)
    zero_ref = ref.float().to(x.device).norm(dim=-1) == 0
    if (zero_ref & (errs > 0)).any():
        where = (zero_ref & (errs > 0)).nonzero()[0].tolist()
        raise AssertionError(f"{what}: row {where} must be exactly 0 (no valid entry), got norm {errs[tuple(where)].item():.3e}")
    worst = errs.argmax()
    pos = [int(i) for i in torch.unravel_index(worst, errs.shape)]
    tol = (row_tolerance or ROW_TOLERANCE)[dtype]
    assert errs.max().item() < tol, (f"{what}: row {pos} relative error {errs.max().item():.2e} >= {tol:.1e} "
                                     f"({int((errs >= tol).sum())} rows over; whole tensor {rel_err(x, ref):.2e})")
    cd = cos_diff(x, ref)
    assert abs(cd) <= COS_DIFF_TOLERANCE[dtype], f"{what}: cosine difference {cd:.2e} > {COS_DIFF_TOLERANCE[dtype]:.0e}"


def assert_lse_close(lse: torch.Tensor, ref_lse: torch.Tensor, what: str = "lse") -> None:
    """lse -inf exactly where the reference is, no NaN, and each finite entry within
    ``LSE_ABS_TOLERANCE + LSE_REL_TOLERANCE * |ref|`` (dtype-independent: see LSE_REL_TOLERANCE)."""
    ref_lse = ref_lse.to(lse.device)
    assert not torch.isnan(lse).any(), f"NaN in {what}"
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty), f"{what} must be -inf exactly where the query has no valid row"
    assert torch.all(lse[empty] < 0), f"{what}: +inf where the reference is -inf"
    fin = ~empty
    if fin.any():
        diff = (lse[fin] - ref_lse[fin]).abs()
        bound = LSE_ABS_TOLERANCE + LSE_REL_TOLERANCE * ref_lse[fin].abs()
        over = diff > bound
        assert not over.any(), (f"{what}: {int(over.sum())} entries off by more than {LSE_ABS_TOLERANCE:g} + "
                                f"{LSE_REL_TOLERANCE:g} |lse|; worst abs error {diff.max().item():.2e}")


def assert_matches_reference(out, lse, ref_out, ref_lse, dtype) -> None:
    """out: every (token, head) row within the dtype's row tolerance (``assert_rows_close``), rows of
    queries with no valid row exactly 0, no NaN; lse (when given): ``assert_lse_close``."""
    empty = torch.isinf(ref_lse).to(out.device)
    assert torch.all(out[empty] == 0), "a query with no valid row must give out = 0"
    assert_rows_close(out, ref_out, dtype, "out")
    if lse is not None:
        assert_lse_close(lse, ref_lse)


def assert_same_result(out, lse, out2, lse2, dtype) -> None:
    """Two kernels on one input (e.g. grouped vs per-token): every (token, head) row of out within the
    row tolerance of the other's, lse -inf at the same places and within the lse tolerance elsewhere.
    (Each kernel rounds once to the dtype, so the two may differ by up to twice one's error: the row
    tolerance is already 2x the observed single-kernel error.)"""
    assert not torch.isnan(out2).any(), "NaN in the second result"
    assert_rows_close(out, out2, dtype, "out vs the other kernel")
    if lse is not None and lse2 is not None:
        assert_lse_close(lse, lse2, "lse vs the other kernel")
