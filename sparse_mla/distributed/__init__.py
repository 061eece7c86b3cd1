"""Multi-GPU sparse MLA: ShardQ (token-sharded prefill across tensor-parallel ranks).

* ``shardq_sparse_mla_fwd``: head-sharded q in, head-sharded out; each rank computes all heads of
  a zigzag slice of the rows in between (all-to-all over torch.distributed).
* ``tp_sparse_mla_fwd``: the plain tensor-parallel baseline (each rank its heads of every row).
* ``shardq_mla_attention`` / ``tp_mla_attention``: the same one layer up (q_nope / q_pe in, o after
  W_UV out), with the reduced exchange (q before absorption, o after W_UV) or the absorbed one,
  and an optional chunked exchange / attention pipeline (``mla.py``).
* ``cost_model``: predicted ShardQ vs TP step time (exchange bytes, link, overlap), validated on
  the committed 2-GPU run, with W = 4 / 8 projections (``python -m sparse_mla.distributed.cost_model``).
* ``zigzag_chunks`` / ``zigzag_partition`` / ``zigzag_inverse``: the causal-balanced row split.

Importing this package does not import the Triton kernels (they load on the first call).
"""

from .mla import shardq_mla_attention, tp_mla_attention
from .shardq import DEFAULT_MIN_TOKENS, shardq_sparse_mla_fwd, tp_sparse_mla_fwd
from .zigzag import zigzag_chunks, zigzag_inverse, zigzag_partition

__all__ = [
    "shardq_sparse_mla_fwd",
    "tp_sparse_mla_fwd",
    "shardq_mla_attention",
    "tp_mla_attention",
    "DEFAULT_MIN_TOKENS",
    "zigzag_chunks",
    "zigzag_partition",
    "zigzag_inverse",
]
