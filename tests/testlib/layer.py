"""Layer-level DSA prefill cases (model layouts, request mixes, padded and adversarial index lists) and their
inputs, for the layer tests and the non-finite tests of its MHA paths."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from sparse_mla.layer import dsa_prefill_ref
from sparse_mla.workloads.models import MODELS
from testlib.device import DEVICE, DTYPE, INT_MAX, INT_MIN

ALL_PATHS = ("dense_mha", "masked_mha", "mqa_grouped", "mqa_per_token")
SPARSE_PATHS = ("masked_mha", "mqa_grouped", "mqa_per_token")


@dataclass(frozen=True)
class Case:
    id: str
    model: str
    heads: int
    cached: tuple[int, ...]
    new: tuple[int, ...]
    topk: int
    adversarial: bool = False  # sentinels / out-of-window rows in the padding, topk_length, gaps between requests
    separate_kv: bool = False  # kv_c and k_pe as two buffers (not views of one row tensor)
    paths: tuple[str, ...] = ALL_PATHS


CASES = [
    # every window <= topk: the dense path applies (top-k lists are whole prefixes)
    Case("deepseek-h4-short-cached", "deepseek-v3.2", 4, (0, 6), (9, 7), 24),
    Case("glm5-h2-short-cached", "glm-5", 2, (5, 0), (10, 1), 16),
    Case("nope-h8-short", "glm-5.3-flash", 8, (0, 0, 3), (5, 6, 4), 16),
    # windows > topk: sparse paths only
    Case("deepseek-h16-long-cached", "deepseek-v3.2", 16, (0, 30), (20, 6), 16, paths=SPARSE_PATHS),
    Case("glm5-h4-long-cached", "glm-5", 4, (40,), (24,), 32, paths=SPARSE_PATHS),
    Case("nope-h2-long-cached", "glm-5.3-flash", 2, (0, 50), (40, 8), 48, paths=SPARSE_PATHS),
    # adversarial: sentinels (-1, INT_MIN, N, INT_MAX), rows of other requests and future rows,
    # topk_length (0 for some tokens), requests placed out of order with gaps, separate kv buffers
    Case("deepseek-h2-adversarial", "deepseek-v3.2", 2, (12, 0, 25), (9, 14, 5), 16, adversarial=True,
         separate_kv=True, paths=SPARSE_PATHS),
    Case("nope-h4-adversarial", "glm-5.3-flash", 4, (30, 3), (10, 12), 24, adversarial=True, paths=SPARSE_PATHS),
]


def dims(model: str) -> tuple[int, int, int, int]:
    m = MODELS[model]
    return m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim


@functools.cache
def build(case: Case, seed: int = 0) -> tuple[dict, torch.Tensor]:
    """dsa_prefill kwargs for ``case`` and the fp32 reference output."""
    g = torch.Generator().manual_seed(seed)
    r, dn, dr, dv = dims(case.model)
    H, K = case.heads, case.topk
    T = sum(case.new)
    windows = [c + n for c, n in zip(case.cached, case.new)]
    if case.adversarial:  # requests in reverse order, 7 free rows between them and before the first
        offsets, acc = [0] * len(windows), 7
        for b in reversed(range(len(windows))):
            offsets[b] = acc
            acc += windows[b] + 7
        N = acc
    else:
        offsets = [sum(windows[:b]) for b in range(len(windows))]
        N = sum(windows) + 3
    q_nope = torch.randn(T, H, dn, generator=g)
    q_pe = torch.randn(T, H, dr, generator=g) if dr else None
    kv = torch.randn(N, r + dr, generator=g)
    w = torch.randn(H * (dn + dv), r, generator=g) * r**-0.5
    idx = torch.full((T, K), -1, dtype=torch.int32)
    topk_length = torch.full((T,), K, dtype=torch.int32) if case.adversarial else None
    t = 0
    for b, (c, n) in enumerate(zip(case.cached, case.new)):
        for i in range(n):
            win = c + i + 1
            take = min(K, win)
            row = torch.full((K,), -1, dtype=torch.int64)
            row[:take] = offsets[b] + torch.randperm(win, generator=g)[:take]
            if case.adversarial:
                future = offsets[b] + win + torch.arange(K)  # rows after the token's position
                other = offsets[(b + 1) % len(windows)] + torch.arange(K)  # another request's rows
                junk = torch.stack([torch.full((K,), v) for v in (INT_MIN, INT_MAX, N, -7)] + [future, other], 1)
                pick = torch.randint(0, junk.shape[1], (K,), generator=g)
                pad = junk[torch.arange(K), pick]
                row[take:] = pad[take:]
                length = take if t % 5 else int(torch.randint(0, take + 1, (1,), generator=g))
                if t % 3 == 1:
                    length = K  # the junk padding counts: it must be ignored as out-of-window / out-of-range
                if t % 7 == 3:
                    length = 0  # a token with no valid entry: o = 0
                topk_length[t] = length
                row[length:] = torch.where(torch.arange(K)[length:] % 2 == 0, row[length:], pad[length:])
                perm = torch.randperm(length, generator=g)
                row[:length] = row[:length][perm]  # counted junk mixed in with the valid rows
            else:
                row = row[torch.randperm(K, generator=g)]  # padding anywhere in the list
            idx[t] = row.clamp(INT_MIN, INT_MAX).to(torch.int32)
            t += 1
    to = lambda x: None if x is None else x.to(DTYPE).to(DEVICE)  # noqa: E731
    kw = dict(q_nope=to(q_nope), q_pe=to(q_pe), w_kv_b=to(w), indices=idx.to(DEVICE), cached_lens=list(case.cached),
              new_lens=list(case.new), row_offsets=offsets, sm_scale=(dn + dr) ** -0.5,
              topk_length=None if topk_length is None else topk_length.to(DEVICE))
    kv = to(kv)
    if case.separate_kv:
        kw.update(kv_c=kv[:, :r].clone(), k_pe=kv[:, r:].clone() if dr else None)
    else:
        kw.update(kv=kv)
    ref = dsa_prefill_ref(**kw)
    return kw, ref
