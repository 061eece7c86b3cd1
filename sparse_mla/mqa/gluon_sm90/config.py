"""Compile-time constants, launch configuration and knobs of the Gluon kernels; the variants the package launches.

The knobs (``SCHEDULE``, ``ABLATE``, ``O_VIA_SMEM``, ``PERSISTENT``, ``KV_L2``, ``FP8_PRODUCER_REGS``) live only here:
the launcher and the ahead-of-time compile read them as ``config.X``, so a patch of this module applies to both."""

from __future__ import annotations

from ... import env
from . import l2_hints

LOG2E = 1.4426950408889634
BLOCK_H = 64  # pseudo-heads per CTA (wgmma M)
BLOCK_N = 64  # kv rows per tile
D_V = 512
D_PE = 64

# Launch configuration (measured on the H200: docs/notes/attention-gluon.md). Split: the default partition is the two consumer
# warpgroups (8 warps), the producer worker gets PRODUCER_REGS registers per thread. Pair: the default partition is
# the 4-warp producer, each consumer warpgroup a worker with PAIR_CONSUMER_REGS.
CONSUMER_WARPS = 8
PRODUCER_WARPS = 4
PRODUCER_REGS = 40
STAGES = 2
# "split": sparse_mqa_sm90_kernel (S split by kv columns across two warpgroups of one partition);
# "pair": sparse_mqa_sm90_pair_kernel (FlashMLA's split: a kv tile per warpgroup, ping-pong on the tensor core).
SCHEDULES = ("split", "pair")
# The schedule of bf16 / fp16 caches (SPARSE_MLA_GLUON_SCHEDULE): pair, 1.23-1.36x faster than split
# (results/gluon-v12-full.json). An fp8_ds_mla cache always runs split (``schedule_for``): only its producer dequantizes.
SCHEDULE = env.get(env.GLUON_SCHEDULE)
# Timing knob of the split schedule (bitmask: 1 no row max, 2 no P.V, 4 no row sum, 8 no Q.K^T, 16 no O rescale):
# wrong results, only for placing time inside the kernel (benchmarks/bench_gluon.py --ablate). 0 in production.
ABLATE = 0
# O stored through shared memory in 16-byte row-contiguous pieces: split, per-token tiles (results/gluon-v6.json: 413 vs
# 402 TFLOP/s at 64 heads, 423 vs 408 at 128; its grouped tiles keep the direct store, 2.11 vs 2.07 ms there); pair,
# every tile (results/probe-pair.json: grouped 1.570 vs 1.611 ms at 16 heads, 3.000 vs 3.049 at 32, 0.853 vs 0.869 at 8).
O_VIA_SMEM = env.get(env.GLUON_O_VIA_SMEM) == "1"
# Both schedules: one CTA per SM looping over the work items (the next item's first tiles land during this one's
# epilogue) instead of one CTA per item.
PERSISTENT = env.get(env.GLUON_PERSISTENT) == "1"
# L2 hints on the kv-row cp.async copies (SPARSE_MLA_GLUON_KV_L2): "evict_last" marks them (constexpr KV_EVICT =
# l2_hints.REWRITE_ID) and l2_hints rewrites them to FlashMLA's L2::cache_hint.L2::256B form under an evict_last
# policy; "off" (the default, KV_EVICT = 0) keeps plain cp.async. Not yet timed on a GPU (docs/notes/attention-gluon.md).
KV_L2_MODES = ("off", "evict_last")
KV_L2 = env.get(env.GLUON_KV_L2)
PAIR_CONSUMER_REGS = 232  # each consumer warpgroup; the producer (the default partition) gets what is left
# fp8_ds_mla cache (KV_FP8): the producer dequantizes in registers, so it gets more of them (the consumers the rest).
FP8_PRODUCER_REGS = int(env.get(env.GLUON_FP8_PRODUCER_REGS))
FP8_SCHEDULES = ("split", )  # schedules with an fp8_ds_mla variant (D_qk 576, bf16 q: its RoPE part is bf16)


def schedule_for(kv_fp8: bool) -> str:
    """The schedule a launch runs: ``SCHEDULE`` on a bf16 / fp16 cache, the FP8 schedule on an fp8_ds_mla one."""
    if not kv_fp8:
        return SCHEDULE
    return SCHEDULE if SCHEDULE in FP8_SCHEDULES else FP8_SCHEDULES[0]




def kv_split_missing(grouped: bool, kv_fp8: bool) -> str | None:
    """Why there is no split-KV variant for such a launch, or None. Grouped tiles on an fp8_ds_mla cache have none:
    its consumers, whose registers the dequantizing producer shares, reload a value in every tile (the sm_90 compile's
    SASS, tests/mqa/test_gluon_compile.py); those calls run the Triton kernel's split variant."""
    if grouped and kv_fp8:
        return "grouped tiles on an fp8_ds_mla cache have no Gluon split-KV variant (its consumers would spill per tile)"
    return None


def variant_constexprs(grouped: bool, has_pe: bool, schedule: str | None = None, kv_fp8: bool = False,
                       kv_split: bool = False) -> dict:
    """The compile-time parameters of one kernel variant (everything else is a run-time argument, so the
    package launches 2 modes x 2 D_qk x 2 dtypes = 8 variants per schedule, plus the split schedule's 2 modes
    on an fp8_ds_mla cache with bf16 q, each with and without split-KV (``KV_SPLIT``: the item's partials go to fp32
    buffers, ``sparse_mla.mqa.split_combine``, stored directly); each compiled for sm_90 in CI)."""
    if kv_fp8 and not has_pe:
        raise ValueError("an fp8_ds_mla variant needs D_qk 576 (has_pe): the format's rows are 576 wide")
    if kv_split and kv_split_missing(grouped, kv_fp8):
        raise ValueError(kv_split_missing(grouped, kv_fp8))
    if KV_L2 not in KV_L2_MODES:
        raise ValueError(f"SPARSE_MLA_GLUON_KV_L2 must be one of {KV_L2_MODES}, got {KV_L2!r}")
    kv_evict = l2_hints.REWRITE_ID if KV_L2 == "evict_last" else 0
    if (schedule or schedule_for(kv_fp8)) == "split":
        return dict(GROUPED=grouped, HAS_PE=has_pe, STAGES=STAGES, PRODUCER_WARPS=PRODUCER_WARPS,
                    PRODUCER_REGS=FP8_PRODUCER_REGS if kv_fp8 else PRODUCER_REGS, ABLATE=ABLATE,
                    O_VIA_SMEM=O_VIA_SMEM and not grouped and not kv_split, KV_FP8=kv_fp8, KV_SPLIT=kv_split,
                    KV_EVICT=kv_evict, num_warps=CONSUMER_WARPS)
    if kv_fp8:
        raise ValueError("the pair schedule has no fp8_ds_mla variant (FP8_SCHEDULES)")
    return dict(GROUPED=grouped, HAS_PE=has_pe, CONSUMER_REGS=PAIR_CONSUMER_REGS, O_VIA_SMEM=O_VIA_SMEM and not kv_split,
                KV_SPLIT=kv_split, KV_EVICT=kv_evict, num_warps=4)


def all_variants() -> list[tuple[bool, bool, str, str, bool, bool]]:
    """(grouped, has_pe, dtype, schedule, kv_fp8, kv_split) of every variant the package can launch."""
    plain = [(g, pe, dt, sc, False, sp) for sc in SCHEDULES for g in (False, True) for pe in (False, True)
             for dt in ("bf16", "fp16") for sp in (False, True)]
    fp8 = [(g, True, "bf16", sc, True, sp) for sc in FP8_SCHEDULES for g in (False, True) for sp in (False, True)]
    return plain + [v for v in fp8 if not (v[5] and kv_split_missing(v[0], True))]
