"""Kernel-level union figures of a step: the union ratio the grouped kernel sees and the time of
building the unions (group plan + the union builder ``sparse_mla.union.backends`` selects: the CUDA
shared-memory one where it runs, else the Triton hash table), as the grouped path forms them
(G = ``default_group_size(H)`` = 128 // H queries, groups inside the request).
"""

from __future__ import annotations

import torch

from ..checks import counted_entries
from ..layer.problem import restrict_to_windows, token_windows
from ..union import backends as union_backends
from ..union.grouping import default_group_size
from ..union.planning import plan_groups
from ..union.workspace import SparseMLAWorkspace
from .timing import time_trials


def union_stats(inputs: dict, heads: int, *, on_gpu: bool, trials: int) -> dict:
    """Union ratio and union build time of a one-request point.

    Args:
        inputs: ``dsa_prefill`` keyword arguments (``sparse_mla.bench.inputs``): indices [T, K]
            int32, optional topk_length [T] int32, kv [N, D], cached_lens / new_lens [1].
        heads: H, heads per rank (sets G).
        on_gpu, trials: as ``timing.time_trials``.

    Returns:
        {"group_size": G, "union_ratio": mean union rows per full group / mean valid rows per query
        of those groups (NaN when T < G), "union_build": ``time_trials`` dict (ms),
        "union_backend": the builder that ran}.
    """
    idx = inputs["indices"]
    dev = idx.device
    T, K = idx.shape
    N = inputs["kv"].shape[0]
    tl = inputs.get("topk_length")
    lo, win = token_windows(inputs["new_lens"], inputs["cached_lens"], [0], dev)
    idx = restrict_to_windows(idx, lo, win)
    valid = ((idx >= 0) & counted_entries(idx, tl)).sum(1)
    G = default_group_size(heads)
    ws = SparseMLAWorkspace(T, K, G, N, dev)
    cu = torch.tensor([0, T], dtype=torch.int32, device=dev)

    def build() -> None:
        plan_groups(T, G, cu, ws.group_start, ws.group_len, ws.route[:T])
        union_backends.build_union(idx, tl, N, G, ws.group_start, ws.group_len, ws.route[:T], ws, ws.union_rows,
                                   ws.union_bits, ws.union_len, guard_ratio=None)

    build()
    # guard_ratio=None: "auto" picks the CUDA builder only where its table holds all G * K entries, so no
    # union overflows; a forced SPARSE_MLA_UNION_BACKEND=cuda_smem may overflow some (union_len -1):
    # the ratio then counts the other groups
    backend = union_backends.choose_union_backend(dev, G, K).name
    n_groups = T // G
    if n_groups:
        ul = ws.union_len[:n_groups]
        kept = (ul >= 0).repeat_interleave(G)
        union_rows = ul[ul >= 0].double().mean().item()
        ratio = union_rows / valid[: n_groups * G][kept].double().mean().item()
    else:
        ratio = float("nan")
    return {"group_size": G, "union_ratio": ratio, "union_build": time_trials(build, on_gpu=on_gpu, trials=trials),
            "union_backend": backend}


__all__ = ["union_stats"]
