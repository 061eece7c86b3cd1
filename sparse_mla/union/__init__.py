"""The per-group top-k union of the grouped path (rows + membership words), laid out by job and backend.

* ``grouping``: how queries are grouped (``default_group_size``, ``MAX_GROUP_SIZE``) and the per-group
  overlap guard (``overlap_guard_ratio``); plain Python.
* ``planning``: ``plan_groups``, the Triton group planner (which rows form each group, which run per token).
* ``triton_tl``: the portable Triton hash-table union builder (global-memory atomics): the CPU-tested
  twin and the fallback.
* ``cuda_smem``: the CUDA C++ builder in shared memory, compiled at run time (Hopper and newer).
* ``backends``: the selection point between the two builders.
* ``probe``: the overlap probe that skips the build of a step whose groups would all fall back.
* ``workspace``: ``SparseMLAWorkspace``, the grouped path's preallocated scratch.
* ``interface``: ``build_group_union`` / ``GroupUnion``, the public inspection function
  (``sparse_mla.build_group_union``).
"""
