"""The non-finite kv row contract (docs/DESIGN.md "Non-finite kv rows"), on every path:

* per-token sparse MQA: a NaN / inf row changes only the queries that select it;
* grouped sparse MQA: also every query of the selecting query's group, never another group;
* masked MHA (layer): also every query whose key tile reads the row (any row of its request's window),
  never another request.

A query that selects a non-finite row gets a non-finite result. ``check=True`` reports such rows
(tests/mqa/test_validation.py, tests/layer/test_layer.py)."""

from __future__ import annotations

import math

import pytest
import torch
from testlib.device import DEVICE, DTYPE
from testlib.problems import cu_seqlens, make_problem, neighbour_rows
from testlib.tolerances import assert_matches_reference

from sparse_mla import SparseMLAWorkspace, sparse_mla_fwd, sparse_mla_ref

H, K, N = 16, 24, 400  # G = 8


def _poisoned(seed: int, T: int):
    """A problem, its clean kv, the row only token 0 selects (set to NaN) and a row no token selects (inf)."""
    g = torch.Generator().manual_seed(seed)
    idx = neighbour_rows(T, K, N, keep=0.6, generator=g)
    p = make_problem(T, H, K, N, indices=idx, seed=seed)
    counts = torch.bincount(p.indices.flatten().long().cpu(), minlength=N)
    only_t0 = [int(r) for r in p.indices[0].tolist() if counts[r] == 1]
    unselected = int((counts == 0).nonzero()[0, 0])
    assert only_t0, "no row selected by token 0 alone"
    clean = p.kv.clone()
    p.kv[only_t0[0], 5] = float("nan")
    p.kv[unselected, :] = float("inf")
    return p, clean


@pytest.mark.parametrize("method", ["per_token", "grouped"])
def test_nonfinite_row_stays_within_its_query_or_group(method):
    T = 2 * 8 + 3
    p, clean = _poisoned(11, T)
    kw = {}
    if method == "grouped":
        kw = dict(cu_seqlens_q=cu_seqlens([T]), workspace=SparseMLAWorkspace.for_problem(T, K, H, N, DEVICE),
                  overlap_guard=math.inf)
    out, lse = sparse_mla_fwd(p.q, p.kv, p.indices, p.sm_scale, return_lse=True, method=method, **kw)
    if method == "grouped":
        assert kw["workspace"].group_len[:2].tolist() == [8, 8], "both groups must run grouped"
    ref_out, ref_lse = sparse_mla_ref(p.q, clean, p.indices, p.sm_scale)
    assert not torch.isfinite(out[0].float()).all(), "the query that selects the NaN row must not look finite"
    first_clean = 1 if method == "per_token" else 8  # grouped: the rest of token 0's group may be NaN too
    assert_matches_reference(out[first_clean:], lse[first_clean:], ref_out[first_clean:], ref_lse[first_clean:], DTYPE)


@pytest.mark.parametrize("case, path", [
    pytest.param(3, "masked_mha", id="masked_mha"),  # deepseek H16: requests 0 + 20 new, 30 + 6 new
    pytest.param(0, "dense_mha", id="dense_mha"),  # deepseek H4: requests 0 + 9 new, 6 + 7 new
])
def test_nonfinite_row_stays_within_its_request_on_the_mha_paths(case, path):
    """The MHA paths over two requests: a NaN in request 0's window, in a row only its last token selects
    (dense: its own position; masked: plus no query selecting it at all), may reach any of request 0's
    queries, never request 1's."""
    from testlib.layer import CASES, build
    from testlib.tolerances import LAYER_ROW_TOLERANCE, assert_rows_close

    from sparse_mla.layer import dsa_prefill, dsa_prefill_ref

    kw, _ = build(CASES[case])
    kv, idx = kw["kv"].clone(), kw["indices"].clone()
    n0 = kw["new_lens"][0]
    row = kw["row_offsets"][0] + kw["cached_lens"][0] + n0 - 1  # request 0's last position
    if path == "masked_mha":
        row = 3
        idx[idx == row] = -1  # selected by no query
    kv[row, 10] = float("nan")
    o = dsa_prefill(**{**kw, "kv": kv, "indices": idx}, path=path)
    ref = dsa_prefill_ref(**{**kw, "indices": idx})  # clean kv
    assert_rows_close(o[n0:], ref[n0:], DTYPE, "request 1", LAYER_ROW_TOLERANCE)
