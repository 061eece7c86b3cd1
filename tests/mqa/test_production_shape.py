"""The production shape on the CPU: top-k K = 2048 (DeepSeek-V3.2 / GLM-5) through the union builder and
the grouped path, G = 8 (16 heads per rank), with padding, a short group and per-token remainders. The
other CPU tests use K <= 100 for the interpreter's sake; these make sure nothing depends on a small K
(hash-table size, probe chunks, tile loops over a union of ~2.5K rows)."""

from __future__ import annotations

import math

import torch
from testlib.adversarial import adversarial_indices
from testlib.device import DEVICE
from testlib.problems import cu_seqlens, make_problem, neighbour_rows, run_checked
from testlib.tolerances import all_of
from testlib.union import check_union

from sparse_mla import SparseMLAWorkspace

K, G, H = 2048, 8, 16  # 3-4 s each under the interpreter: not marked slow


def _lists(T: int, N: int, seed: int) -> torch.Tensor:
    """[T, K] neighbour lists (each keeps 80% of its predecessor's rows: union ~1.2-2 lists per group of 8),
    every fifth token padded at the end, one with sentinels, one with no valid row."""
    g = torch.Generator().manual_seed(seed)
    base = neighbour_rows(T, K, N, keep=0.8, generator=g)
    return adversarial_indices(T, K, N, base=base, generator=g,
                               patterns=("clean", "clean", "pad_end", "clean", "sentinels", "clean", "all_invalid"))


def test_union_at_k2048():
    """build_group_union over two full groups and a short one, against Python sets."""
    N = 20000
    idx = _lists(2 * G + 3, N, seed=1)
    expected = check_union(idx, G, num_kv_rows=N)
    sizes = [len(rows) for rows, _ in expected]
    assert 1.1 * K < sizes[0] < 3 * K, sizes  # a real union: more than one list, far less than G lists


def test_grouped_path_at_k2048():
    """sparse_mla_fwd(method="grouped") inside two requests (11 and 9 tokens: one group each plus per-token
    remainders), no overlap guard, against the fp32 reference, with every group run grouped."""
    N = 12000
    lengths = [11, 9]
    T = sum(lengths)
    p = make_problem(T, H, K, N, indices=_lists(T, N, seed=2), seed=2)
    ws = SparseMLAWorkspace.for_problem(T, K, H, N, DEVICE)
    run_checked(p, method="grouped", cu_seqlens_q=cu_seqlens(lengths), workspace=ws, overlap_guard=math.inf,
                pad_tokens=G, pad_heads=1)
    assert ws.group_start[:2].tolist() == [0, 11] and ws.group_len[:2].tolist() == [G, G]
    assert ws.route[:T].tolist() == [0] * 8 + [1] * 3 + [0] * 8 + [1]
    union = ws.union_len[:2].tolist()
    assert all_of(1.1 * K < u < 3 * K for u in union), union
