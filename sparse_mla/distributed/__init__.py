"""Multi-GPU sparse MLA: ShardQ (token-sharded prefill across tensor-parallel ranks).

* ``shardq_sparse_mla_fwd``: head-sharded q in, head-sharded out; each rank computes all heads of
  a zigzag slice of the rows in between (all-to-all over torch.distributed).
* ``tp_sparse_mla_fwd``: the plain tensor-parallel baseline (each rank its heads of every row).
* ``zigzag_chunks`` / ``zigzag_partition`` / ``zigzag_inverse``: the causal-balanced row split.

Importing this package does not import the Triton kernels (they load on the first call).
"""

from .shardq import DEFAULT_MIN_TOKENS, shardq_sparse_mla_fwd, tp_sparse_mla_fwd
from .zigzag import zigzag_chunks, zigzag_inverse, zigzag_partition

__all__ = [
    "shardq_sparse_mla_fwd",
    "tp_sparse_mla_fwd",
    "DEFAULT_MIN_TOKENS",
    "zigzag_chunks",
    "zigzag_partition",
    "zigzag_inverse",
]
