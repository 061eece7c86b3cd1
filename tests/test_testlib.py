"""The suite's comparison helpers (``tests/testlib/``) catch the errors they exist for: one (token, head)
row scaled by 1.05, one lse entry off by 1e-4 relative, a NaN, a nonzero row for a query with no valid entry, an
``all`` over nothing. A check that cannot fail here would let a kernel bug through everywhere."""

from __future__ import annotations

import pytest
import torch
from testlib.tolerances import (
    LAYER_ROW_TOLERANCE,
    ROW_TOLERANCE,
    all_of,
    assert_matches_reference,
    assert_rows_close,
    assert_same_result,
)

DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]


def _result(dtype, T=6, H=16, D=512, seed=0):
    """A reference (fp32) and the same result rounded to ``dtype``; token 5 has no valid row."""
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(T, H, D, generator=g) / 8
    ref_lse = torch.randn(T, H, generator=g) * 3
    ref[5], ref_lse[5] = 0.0, float("-inf")
    return ref.to(dtype), ref_lse.clone(), ref, ref_lse


@pytest.mark.parametrize("dtype", DTYPES)
def test_rounding_alone_passes(dtype):
    out, lse, ref, ref_lse = _result(dtype)
    assert_matches_reference(out, lse, ref, ref_lse, dtype)
    assert_same_result(out, lse, out.clone(), lse.clone(), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_scaled_head_fails(dtype):
    """One token's head scaled by 1.05: a whole-tensor relative error over 6 x 16 rows is ~0.5%, under the
    old 1e-2 bf16 bound; the per-row check fails and names the row."""
    out, lse, ref, ref_lse = _result(dtype)
    out[2, 7] = (out[2, 7].float() * 1.05).to(dtype)
    with pytest.raises(AssertionError, match=r"out: row \[2, 7\] relative error"):
        assert_matches_reference(out, lse, ref, ref_lse, dtype)
    with pytest.raises(AssertionError, match=r"row \[2, 7\]"):
        assert_rows_close(out, ref, dtype, "o", LAYER_ROW_TOLERANCE)


@pytest.mark.parametrize("change, match", [
    pytest.param(lambda o, l: l.__setitem__((1, 3), l[1, 3] * (1 + 1e-4) + 2e-6), "lse: 1 entries off",
                 id="lse-relative-error-1e-4"),
    pytest.param(lambda o, l: l.__setitem__((5, 0), 0.0), "-inf exactly where", id="lse-finite-for-empty-query"),
    pytest.param(lambda o, l: l.__setitem__((0, 0), float("nan")), "NaN in lse", id="lse-nan"),
    pytest.param(lambda o, l: o.__setitem__((4, 2, 9), float("nan")), r"out: NaN .* first at \[4, 2, 9\]", id="out-nan"),
    pytest.param(lambda o, l: o.__setitem__((5, 1, 0), 1e-3), "no valid row must give out = 0", id="empty-query-nonzero"),
])
def test_other_errors_fail(change, match):
    out, lse, ref, ref_lse = _result(torch.bfloat16)
    change(out, lse)
    with pytest.raises(AssertionError, match=match):
        assert_matches_reference(out, lse, ref, ref_lse, torch.bfloat16)


def test_row_tolerances_are_a_few_unit_roundoffs():
    assert ROW_TOLERANCE[torch.bfloat16] == pytest.approx(3 * 2**-8) and ROW_TOLERANCE[torch.float16] == pytest.approx(3 * 2**-11)
    assert 1.05 - 1 > 4 * ROW_TOLERANCE[torch.bfloat16]


def test_all_of_refuses_an_empty_collection():
    assert all_of([1, True]) and not all_of([1, 0])
    with pytest.raises(AssertionError, match="empty collection: rows"):
        all_of((x for x in []), "rows")
