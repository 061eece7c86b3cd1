"""Output check of a benchmarked path: relative Frobenius error (``common.rel_err``) against the fp32 layer reference
(``sparse_mla.layer.dsa_prefill_ref``) on a few sampled chunks of tokens.

The reference is per token, so a chunk lo .. hi-1 is its own step (``inputs.sub_problem``); three
chunks of at most 16 tokens (start, middle, end of the prompt) cover the shortest and the longest
windows without an fp32 run over the whole prompt.
"""

from __future__ import annotations

import torch

from ..layer.paths import MQA_KV_LORA_RANKS, MQA_ROPE_DIMS
from ..layer.reference import dsa_prefill_ref
from .common import rel_err
from .inputs import sub_problem

Chunk = tuple[int, int, torch.Tensor]  # (lo, hi, reference o [hi - lo, H, v_head_dim] fp32)

# Relative Frobenius error a benchmarked result may have against the fp32 reference, per q / kv dtype:
# a few unit roundoffs of the dtype (u = 2^-8 bf16, 2^-11 fp16; tests/testlib/tolerances.py TOLERANCE is the same table).
CHECK_TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}


def check_tolerance(dtype: torch.dtype) -> float:
    """``CHECK_TOLERANCE`` of ``dtype``.

    Raises:
        ValueError: a dtype without a tolerance.
    """
    if dtype not in CHECK_TOLERANCE:
        raise ValueError(f"no check tolerance for dtype {dtype}; one of {list(CHECK_TOLERANCE)}")
    return CHECK_TOLERANCE[dtype]


def chunk_bounds(tokens: int, chunks: int = 3, size: int = 16) -> list[tuple[int, int]]:
    """Up to ``chunks`` distinct [lo, hi) token ranges of at most ``size`` tokens, spread from the
    first token to the last (start, middle, end for the default three)."""
    size = min(size, tokens)
    if size == 0:
        return []
    starts = [round(i * (tokens - size) / max(chunks - 1, 1)) for i in range(chunks)]
    return [(lo, lo + size) for lo in sorted(set(starts))]


def reference_chunks(inp: dict, bounds: list[tuple[int, int]]) -> list[Chunk]:
    """fp32 layer reference of each token range of a one-request point (``inputs`` dict). Uses the
    absorbed form where ``sparse_mla_ref`` takes the dims, else the MHA form."""
    r = inp["w_kv_b"].shape[1]  # kv_lora_rank (not read off kv: an FP8 cache's rows are 656 bytes)
    dr = 0 if inp["q_pe"] is None else inp["q_pe"].shape[2]
    form = "mqa" if r in MQA_KV_LORA_RANKS and dr in MQA_ROPE_DIMS else "mha"
    return [(lo, hi, dsa_prefill_ref(**sub_problem(inp, lo, hi), form=form)) for lo, hi in bounds]


def max_rel_err(out: torch.Tensor, refs: list[Chunk]) -> float:
    """Largest ``common.rel_err`` of out[lo:hi] (out: [T, H, v_head_dim]) over the reference chunks (inf where out
    has a NaN, e.g. an unwritten NaN-poisoned row; NaN for no chunks)."""
    return max((rel_err(out[lo:hi], ref) for lo, hi, ref in refs), default=float("nan"))


__all__ = ["chunk_bounds", "reference_chunks", "max_rel_err", "CHECK_TOLERANCE", "check_tolerance"]
