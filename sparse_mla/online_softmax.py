"""The online-softmax update of the portable Triton attention kernels (``sparse_mla.mqa.triton_tl`` and
``sparse_mla.layer.masked_mha``), written once.

Base 2: logits arrive already multiplied by ``sm_scale * log2(e)``, masked entries as -inf. A row that has seen
no valid key keeps max -inf; its exponentials are taken against 0 so that no (-inf) - (-inf) appears, which keeps
its P and l at exactly 0 (out 0, lse -inf in the callers' epilogues).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def online_softmax_step(qk, m_i, l_i):
    """One kv tile of the online softmax.

    Args:
        qk: [BLOCK_M, BLOCK_N] fp32 logits in base-2 units (-inf where masked).
        m_i, l_i: [BLOCK_M] fp32 running max (base 2, -inf before any valid key) and running sum.

    Returns:
        (p, alpha, m_new, l_new): p = exp2(qk - m) [BLOCK_M, BLOCK_N], alpha = exp2(m_i - m) [BLOCK_M] (the factor
        the accumulator is rescaled by), the new running max and sum; m is m_new, or 0 where m_new is -inf.
    """
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(qk - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)
