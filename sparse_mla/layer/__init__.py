"""Layer-level DSA prefill: dense MHA, masked MHA, grouped and per-token sparse MQA behind one call.

* ``dsa_prefill`` / ``SparseMLAPrefill``: the entry point (``prefill.py``).
* ``choose_path``, ``explain``, ``PATHS``, ``THRESHOLDS``: the dispatcher (``dispatch.py``).
* ``PrefillStep``: the plain-Python step description the dispatcher decides on (``problem.py``).
* ``dsa_prefill_ref``: the fp32 reference every path reproduces (``reference.py``).

Importing this package decorates no Triton kernel (kernel modules load on first use).
"""

from .dispatch import PATH_NAMES, PATHS, THRESHOLDS, PathDecision, PathFallbackWarning, choose_path, explain
from .prefill import SparseMLAPrefill, dsa_prefill
from .problem import PrefillStep
from .reference import dsa_prefill_ref

__all__ = [
    "dsa_prefill", "SparseMLAPrefill", "dsa_prefill_ref", "PrefillStep", "choose_path", "explain", "PATHS",
    "PATH_NAMES", "THRESHOLDS", "PathDecision", "PathFallbackWarning",
]
