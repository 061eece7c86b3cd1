"""DeepSeek-V4.x-style lists: per query, the top-k of compressed rows plus a window of the most recent tokens.

DeepSeek-V4.x prefill on Hopper reaches the sparse attention op with the rows a step can read staged by the engine
in one bf16 workspace: the compressed rows of the request first, then the sliding-window rows (the last tokens'
uncompressed rows), d_qk = d_v = 512 (V = the whole row), attn_sink, and per query the top-512 (or 1024) compressed
rows plus the ``window`` (128) most recent tokens. ``window_topk_lists`` builds such lists for one request:

* compressed part: ``sparse_mla.workloads.topk.synthetic_topk`` over a compressed region of ``cached + new`` rows
  (one compressed row per token position: the index range only sets which rows exist; the union ratio of
  neighbouring queries, what the grouped kernel's speed depends on, is the overlap preset's), top ``topk`` per
  query, causal in that region;
* window part: query t at position p = cached + t takes the rows of positions max(0, p - window + 1) .. p, which
  live after the compressed region at ``num_compressed + (position - first_window_position)``.

So query t's list holds min(topk, p + 1) compressed rows, then min(window, p + 1) window rows, then -1 padding
to ``topk + window`` entries; ``topk_length[t]`` is the count of leading entries that may be valid, as engines pass
it. The two parts never share a row, so every valid row of a list is distinct.
"""

from __future__ import annotations

import torch

from .topk import OverlapModel, synthetic_topk


def window_topk_lists(cached: int, new: int, topk: int = 512, window: int = 128,
                      overlap: str | OverlapModel = "mid", *, seed: int = 0,
                      device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor, int]:
    """Lists of one request's ``new`` queries over a staged workspace of compressed + window rows.

    Args:
        cached: tokens of the request before this step (>= 0).
        new: query tokens of this step (>= 1).
        topk: compressed rows per query (512 for V4-Flash; >= 1).
        window: most recent tokens per query (128; >= 1).
        overlap: the overlap preset of the compressed part (``sparse_mla.workloads.topk.OVERLAP_PRESETS``).
        seed, device: as ``synthetic_topk`` (deterministic per seed and device type).

    Returns:
        (indices [new, topk + window] int32 rows of the workspace on ``device``, -1 = padding;
         topk_length [new] int32, the leading entries that count; num_rows: the workspace's rows,
         ``cached + new`` compressed rows followed by the window rows of this step's queries).

    Raises:
        TypeError / ValueError: as ``synthetic_topk`` for the compressed part; ``window < 1`` or ``new < 1``.
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1, got {window!r}")
    if isinstance(new, bool) or not isinstance(new, int) or new < 1:
        raise ValueError(f"new must be an int >= 1, got {new!r}")
    comp, _valid = synthetic_topk(cached, new, topk, overlap, seed=seed, device=device)
    n_comp = cached + new
    first = max(0, cached - window + 1)  # oldest position any query's window reaches
    n_win = cached + new - first
    dev = comp.device
    pos = cached + torch.arange(new, device=dev)  # [new] positions of the queries
    j = torch.arange(window, device=dev)  # newest first: position p - j
    wpos = pos[:, None] - j[None, :]
    wrows = torch.where(wpos >= 0, n_comp + (wpos - first), -1).to(torch.int32)
    k_comp = torch.clamp(pos + 1, max=topk)  # compressed rows of query t
    k_win = torch.clamp(pos + 1, max=window)
    # valid compressed entries first (synthetic_topk pads at the end), then the window rows, then -1
    out = torch.full((new, topk + window), -1, dtype=torch.int32, device=dev)
    out[:, :topk] = comp
    col = torch.arange(topk + window, device=dev)[None, :]
    src = col - k_comp[:, None]  # window slot of each column after the compressed entries
    in_win = (src >= 0) & (src < k_win[:, None])
    gathered = wrows.gather(1, src.clamp(0, window - 1))
    out = torch.where(in_win, gathered, torch.where(col < k_comp[:, None], out, -1))
    topk_length = (k_comp + k_win).to(torch.int32)
    return out, topk_length, n_comp + n_win


__all__ = ["window_topk_lists"]
