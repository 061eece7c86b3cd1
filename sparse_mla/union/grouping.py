"""How the grouped path groups queries: the group size and the per-group overlap guard (plain Python).

``default_group_size`` is G, the queries that share one 128-pseudo-head tile; ``overlap_guard_ratio`` is the
per-group fallback the union builders apply: a group whose union holds too many rows runs per token;
``guard_ratio`` maps ``sparse_mla_fwd``'s ``overlap_guard`` onto it. Importing
this module decorates no kernel (``sparse_mla.union.backends`` and the layer's ``explain`` use it as plain Python).
"""

from __future__ import annotations

import math
import warnings

MAX_GROUP_SIZE = 16  # queries per group at most (``default_group_size`` caps G here)

# Overlap guard: a group whose union holds more than GUARD_FRACTION_OF_G * G times its mean valid list length
# runs per token. The break-even at 16 heads, G = 8 (the Gluon grouped tile against the per-token kernel) is 3.8
# of 8 lists (results/bench-none.json); as a fraction of G it carries over to other G. GUARD_MIN_LISTS is the
# floor, the guard at G = 2 (64 heads, whose per-token tiles are already full).
GUARD_FRACTION_OF_G = 3.8 / 8
GUARD_MIN_LISTS = 1.45


def default_group_size(num_heads: int) -> int:
    """G = 128 // H queries per 128-pseudo-head tile, capped at 16 (the union sort width)."""
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")
    return max(1, min(16, 128 // num_heads))


def overlap_guard_ratio(group_size: int) -> float:
    """Union rows / mean valid rows per query above which a group runs per token
    (``GUARD_FRACTION_OF_G * group_size``, at least ``GUARD_MIN_LISTS``)."""
    return max(GUARD_FRACTION_OF_G * group_size, GUARD_MIN_LISTS)


def _caller_stacklevel() -> int:
    """The ``stacklevel`` that points a warning raised in the caller of this function at the first frame outside
    the package (the user's call; wrappers such as ``call_cache.replayed`` in between vary)."""
    import os
    import sys

    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(pkg):
        frame, level = frame.f_back, level + 1
    return level


def guard_ratio(overlap_guard: float | None, group_size: int) -> float | None:
    """The ratio the union builders apply (None: no guard) for ``sparse_mla_fwd``'s ``overlap_guard``: None ->
    ``overlap_guard_ratio(group_size)``; ``math.inf`` -> None (every union built and used); a float >= 0 -> itself;
    -1.0 (the former default) -> as None, with a ``DeprecationWarning``. ``overlap_guard`` is validated by
    ``sparse_mla.mqa.checks.validate_fwd_buffers``."""
    if overlap_guard is not None and not isinstance(overlap_guard, bool) and overlap_guard == -1.0:
        warnings.warn("overlap_guard=-1.0 is deprecated: None (the default) selects the default table",
                      DeprecationWarning, stacklevel=_caller_stacklevel())
        overlap_guard = None
    if overlap_guard is None:
        return overlap_guard_ratio(group_size)
    return None if math.isinf(overlap_guard) else float(overlap_guard)
