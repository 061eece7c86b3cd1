"""Warp-specialized Gluon kernel for sparse MQA on Hopper (sm_90): per-token and grouped tiles.

One CTA computes a tile of 64 *pseudo-heads* over a list of kv rows:

* per-token mode: pseudo-head r of m-block mb is head ``mb * 64 + r`` of token ``t``; the rows are
  ``indices[t, :topk_length[t]]`` (entries < 0 or >= N are invalid: never read, masked out);
* grouped mode: pseudo-head p = mb * 64 + r is head ``p % H`` of query ``p // H`` of the group
  (``group_start[g] + p // H``); the rows are the group's union rows, and a row counts for query i
  only where bit i of its membership word is set (``sparse_mla.union``). ``group_len[g] == 0``
  means the group runs per token and its CTAs write nothing.

Warp roles (``gl.warp_specialize``): a producer partition gathers 64-row kv tiles with 16-byte cp.async (invalid
rows predicated off, zero-filled, never read) into a shared-memory ring guarded by ready / empty mbarriers; two
consumer warpgroups run S = Q.K^T with wgmma (A = Q from shared memory, B = the tile's K^T view; the 512 NoPE and
64 RoPE columns are separate power-of-two buffers), the online softmax in base 2, and O += P.V over the first 512
columns of the same tile (each warpgroup owns 256 value columns). Two schedules (``SCHEDULES``):

* "pair" (the default, ``sparse_mqa_sm90_pair_kernel``; FlashMLA's SM90 design, read, not copied): each consumer
  warpgroup computes the whole S of its own tile (N = 64 wgmma; even tiles warpgroup 0, odd tiles warpgroup 1),
  the row max is chained 0 -> 1 through shared memory, and each multiplies its own P (registers) and the other's
  (shared memory) by its V half, so one warpgroup's softmax overlaps the other's MMAs. Tiles are held as half
  buffers (columns 0..255 and 256..575) with their own barriers, refilled as soon as their last reader is done.
* "split" (``sparse_mqa_sm90_kernel``): both warpgroups work on the same tile, S split by kv columns (N = 32), the
  row max and P exchanged by Triton's layout conversions. The only schedule with an FP8 producer.

Epilogue: O / l, LSE in natural log; a pseudo-head with no valid row gets out 0 and lse -inf; stores are bounded to
the real rows (O goes through the dead Q buffer in row-contiguous 16-byte pieces: every pair tile, split's per-token
tiles). Both kernels are
persistent (``PERSISTENT``): one CTA per SM loops over the work items (list, m-block); its producer loads each
item's Q once the consumers have freed the buffer and gathers the item's first tiles while the consumers finish the
previous one. An item whose m-block holds no real pseudo-head (a token routed away, an empty group, a short
group's second m-block) is skipped by every partition alike (it writes nothing), so the barrier phases count only
the items a CTA runs.

FP8 cache (``KV_FP8``, kv the uint8 rows [N, 656] of an ``fp8_ds_mla`` cache, bf16 q, D_qk 576): the producer
lands each row's 64 bf16 RoPE values by cp.async and dequantizes the 512 e4m3 NoPE values itself (register path:
16-byte loads, the hardware e4m3 -> f16x2 conversion, x the row's fp32 tile scale, rounded to bf16, st.shared into
the same ring), so the consumers are unchanged; ``FP8_PRODUCER_REGS`` registers per producer thread. Measured on the
H200 it is ~1.7x faster than the Triton kernel's FP8 gather but runs at ~0.8x of the split kernel on a bf16 cache
and ~0.65x of the default pair kernel there (docs/notes/fp8-cache.md: the producer's extra traffic through the SM's L1 /
shared-memory path competes with the consumers' shared-memory-bound Q.K^T).

Shared memory (bf16/fp16, D_qk 576): Q 72 KB + 2 tiles x 72 KB + P / row-stat buffers = 231,168 B (pair) or
225,332 B (split) of 232,448 (227 KB).

The kernels are written against Triton's Gluon API of the versions in ``SUPPORTED_TRITON`` (the API
moves between releases); ``sparse_mla.mqa.backends`` uses them only there, and CI compiles every
variant for sm_90 with that Triton (tests/mqa/test_gluon_compile.py). Semantics:
``sparse_mla.mqa.reference.sparse_mla_ref``.

Modules: ``gluon_api`` (the Gluon imports, or ``GLUON_IMPORT_ERROR``), ``config`` (constants, launch configuration,
knobs, the variants), ``signature`` (the 33 run-time arguments, written once), ``common`` (helpers both schedules
call), ``split`` and ``pair`` (one schedule each, with its kernel), ``l2_hints`` (FlashMLA's L2 hints on the kv
copies, which Triton 3.6 drops, restored after lowering: ``SPARSE_MLA_GLUON_KV_L2``), ``launcher`` (``launch``), ``aot``
(``compile_variant``). The kernel modules are imported only when Gluon imports.
"""

from __future__ import annotations

import triton

from .aot import compile_variant  # noqa: F401
from .config import (  # noqa: F401
    BLOCK_H,
    BLOCK_N,
    D_PE,
    D_V,
    FP8_SCHEDULES,
    LOG2E,
    SCHEDULES,
    all_variants,
    kv_split_missing,
    schedule_for,
    variant_constexprs,
)
from .gluon_api import GLUON_IMPORT_ERROR  # noqa: F401
from .launcher import launch, num_m_blocks  # noqa: F401

SUPPORTED_TRITON = ("3.6",)  # major.minor of triton whose Gluon API these kernels are written against
SUPPORTS_KV_SPLIT = True  # split-KV variants (KV_SPLIT) but where config.kv_split_missing says (sparse_mla.mqa.backends)


def triton_version_supported(version: str | None = None) -> bool:
    """Whether ``version`` (default: the installed triton's) is one the Gluon kernels are written for."""
    v = version or triton.__version__
    return any(v == s or v.startswith(s + ".") for s in SUPPORTED_TRITON)


if GLUON_IMPORT_ERROR is None:
    from .pair import sparse_mqa_sm90_pair_kernel  # noqa: F401
    from .split import sparse_mqa_sm90_kernel  # noqa: F401
