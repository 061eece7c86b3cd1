"""Workloads: model dimensions, synthetic top-k lists with calibrated overlap, engine trace files,
and union-ratio statistics. Plain torch, no Triton (usable on any device without the interpreter).

* ``MLAConfig``, ``MODELS``, ``get_model``: published attention dimensions of DSA models.
* ``synthetic_topk``, ``synthetic_batch``, ``OverlapModel``, ``OVERLAP_PRESETS``,
  ``local_to_global``: causal synthetic top-k lists whose union ratio is set by a preset.
* ``TopkTrace``, ``load_trace``, ``save_trace``: per-layer top-k trace files (.pt, .safetensors).
* ``union_ratio``, ``topk_stats``, ``topk_stats_table``: union ratio of groups of G queries.
"""

from .models import MODELS, MLAConfig, get_model
from .stats import TOPK_STATS_COLUMNS, UnionStats, topk_stats, topk_stats_table, union_ratio
from .topk import (
    OVERLAP_PRESETS,
    OverlapModel,
    SyntheticBatch,
    local_to_global,
    resolve_overlap,
    synthetic_batch,
    synthetic_topk,
)
from .traces import TopkTrace, check_trace, load_trace, save_trace

__all__ = [
    "MLAConfig", "MODELS", "get_model",
    "OverlapModel", "OVERLAP_PRESETS", "resolve_overlap", "synthetic_topk", "synthetic_batch", "SyntheticBatch",
    "local_to_global",
    "TopkTrace", "check_trace", "load_trace", "save_trace",
    "UnionStats", "union_ratio", "topk_stats", "topk_stats_table", "TOPK_STATS_COLUMNS",
]
