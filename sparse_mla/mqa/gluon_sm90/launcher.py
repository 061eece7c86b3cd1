"""Launch of the Gluon kernels on validated CUDA tensors.

Each launch goes through a ``LaunchCache`` (``sparse_mla.launch_cache``) keyed by the schedule, the dtypes and the
variant's constexprs: the backend selection admits only 16-byte aligned q / kv / out with 16-divisible strides
(``sparse_mla.mqa.backends.gluon_sm90_applies``), the only arguments the kernels specialize on, and every other
argument is a run-time value (``signature.KERNEL_ARGS``), so that key names the compiled variant.
"""

from __future__ import annotations

import triton

from ...kv_format import FP8_DS_MLA
from ...launch_cache import LaunchCache
from . import config, l2_hints
from .config import BLOCK_H, D_V, LOG2E, SCHEDULES
from .gluon_api import GLUON_IMPORT_ERROR

if GLUON_IMPORT_ERROR is None:
    from .pair import sparse_mqa_sm90_pair_kernel
    from .signature import check_kernel
    from .split import sparse_mqa_sm90_kernel

    check_kernel(sparse_mqa_sm90_kernel)
    check_kernel(sparse_mqa_sm90_pair_kernel)


def _kernel_for(schedule: str):
    if schedule not in SCHEDULES:
        raise ValueError(f"SPARSE_MLA_GLUON_SCHEDULE must be one of {SCHEDULES}, got {schedule!r}")
    return sparse_mqa_sm90_kernel if schedule == "split" else sparse_mqa_sm90_pair_kernel


_LAUNCHERS: dict = {}
_N_ARG = 17  # kv rows N: the one run-time integer that can pass int32 (a cache of 2**31 rows)


def _launcher_for(schedule: str) -> LaunchCache:
    kernel = _kernel_for(schedule)
    lc = _LAUNCHERS.get(schedule)
    if lc is None or lc.fn is not kernel:  # tests swap the kernel objects
        lc = _LAUNCHERS[schedule] = LaunchCache(kernel, wide=(_N_ARG, ))
    return lc



_PLACEHOLDERS: dict = {}


def _placeholders(device):
    """One-element fp32 and int8 tensors per device, passed for absent optional pointers (never read)."""
    key = str(device)
    if key not in _PLACEHOLDERS:
        import torch

        _PLACEHOLDERS[key] = (torch.zeros(1, dtype=torch.float32, device=device),
                              torch.zeros(1, dtype=torch.int8, device=device))
    return _PLACEHOLDERS[key]


_NUM_SMS: dict = {}


def _num_sms(device) -> int:
    key = str(device)
    if key not in _NUM_SMS:
        import torch

        _NUM_SMS[key] = torch.cuda.get_device_properties(device).multi_processor_count
    return _NUM_SMS[key]


def num_m_blocks(num_pseudo_heads: int) -> int:
    """CTAs per list: 64 pseudo-heads each."""
    return triton.cdiv(num_pseudo_heads, BLOCK_H)


def launch(q, kv, rows, bits, nrows, group_start, group_len, route, out, lse, sm_scale: float, *,
           grouped: bool, num_lists: int, group_heads: int, attn_sink=None, max_logits=None, kv_split=None) -> None:
    """Launch on validated CUDA tensors (``sparse_mla.mqa.backends`` checks that this kernel applies).

    q [T, H, D_qk], kv [N, D_qk] (row stride ``kv.stride(0)``), out [T, H, 512], lse [T, H] fp32 or None.
    Per-token (grouped=False): rows = indices [T, K] int32, nrows = topk_length [T] or None, route [T]
    int8 or None (0 = skip), num_lists = T, group_heads = H. Grouped: rows / bits = union rows and
    membership words [num_groups, U] int32, nrows = union_len, group_start / group_len [num_groups],
    num_lists = num_groups, group_heads = G * H (<= 128). attn_sink [H] fp32 contiguous or None (adds
    exp(attn_sink[h]) to out's denominator), max_logits [T, H] fp32 (heads contiguous) or None (written):
    the semantics of ``sparse_mla.mqa.triton_tl``. kv_split: a ``sparse_mla.mqa.split_combine.SplitPartials`` or
    None: with it, S CTAs' work items share each list (1 / S of its rows each) and write their partials there instead
    of out / lse / max_logits (attn_sink is then left to ``split_combine.combine_splits``).
    """
    import torch

    T, H, D = q.shape
    kv_fp8 = kv.dtype == torch.uint8
    if kv_fp8 and (q.dtype != torch.bfloat16 or D != FP8_DS_MLA.d_qk):
        raise ValueError(f"an fp8_ds_mla cache needs bf16 q with D_qk {FP8_DS_MLA.d_qk}, got {q.dtype}, {D}")
    if num_lists == 0:
        return
    m_blocks = num_m_blocks(group_heads)
    S = 1
    if kv_split is not None:  # contiguous [T, S, H, ...] partials: the kernel derives a split's offset from H
        S, ml = kv_split.num_splits, kv_split.max_logits
        out, lse, attn_sink = kv_split.out[:, 0], kv_split.lse[:, 0], None
        max_logits = ml[:, 0] if ml is not None else None
    num_work = num_lists * m_blocks * S
    dummy = rows  # an int32 placeholder for absent int32 inputs
    f32, i8 = _placeholders(q.device)  # typed placeholders keep the argument types, hence the compiled variant, fixed
    grid = min(num_work, _num_sms(q.device)) if config.PERSISTENT else num_work
    schedule = config.schedule_for(kv_fp8)
    cx = config.variant_constexprs(grouped, D > D_V, schedule, kv_fp8, kv_split is not None)
    options = {"num_warps": cx.pop("num_warps")}
    key = (schedule, q.dtype, kv.dtype, options["num_warps"], *cx.values())
    if cx["KV_EVICT"]:  # a marked variant compiles with the L2 hints (its first launch compiles it)
        l2_hints.install()
    _launcher_for(schedule)(key, (grid, ), (
        q, kv, rows, bits if bits is not None else dummy, nrows if nrows is not None else dummy,
        group_start if group_start is not None else dummy, group_len if group_len is not None else dummy,
        route if route is not None else i8, out, lse if lse is not None else f32,
        q.stride(0), q.stride(1), kv.stride(0), rows.stride(0), out.stride(0), out.stride(1),
        lse.stride(0) if lse is not None else 0,
        kv.shape[0], H, rows.shape[1], sm_scale * LOG2E, m_blocks, group_heads,
        int(nrows is not None), int(route is not None), int(lse is not None),
        attn_sink if attn_sink is not None else f32, max_logits if max_logits is not None else f32,
        max_logits.stride(0) if max_logits is not None else 0, int(attn_sink is not None), int(max_logits is not None),
        num_work, S), cx, options)
