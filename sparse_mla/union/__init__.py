"""Group planning and the per-group top-k union (rows + membership words), laid out by backend.

* ``triton_tl``: group planning and the portable Triton hash-table union builder (global-memory
  atomics): the CPU-tested twin and the fallback.
* ``cuda_smem``: the CUDA C++ builder in shared memory, compiled at run time (Hopper and newer).
* ``backends``: the selection point between them.

The public inspection function is ``sparse_mla.build_group_union`` (``sparse_mla.interface``).
"""
