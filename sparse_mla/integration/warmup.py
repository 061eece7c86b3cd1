"""Compile, before serving, every Triton kernel variant a configuration can use (for CUDA graphs).

Triton compiles a kernel once per *specialization*: each constexpr, whether an optional pointer is
None, the 16-byte alignment of each pointer, and for every integer argument not marked
``do_not_specialize`` its class: equal to 1, divisible by 16, or neither (triton 3.x). An engine
that captures CUDA graphs must not compile during capture or serving, so ``warmup`` runs each
variant once on small inputs, through the public entry points (so it follows kernel changes):

* ``sparse_mla_fwd`` per token, and grouped in both layouts (within requests with
  ``cu_seqlens_q``, token-major without), each with and without lse and topk_length: the
  attention kernel (per-token, per-token with a route, grouped), the union builder, the planner,
  the overlap probe (``sparse_mla.union.probe``, where a step plans enough groups);
* the grouped calls at one representative of every class of the integers that change from step
  to step: the token count T, the group count (the workspace's, or ceil(T / G)), the request
  count B and its power-of-two block (``step_shape_reps``), up to ``max_tokens`` / ``max_requests``;
* the block-table converter (``index_convert``), with and without valid counts;
* the CUDA union builder (``sparse_mla.union.cuda_smem``, one variant per device, compiled by
  NVRTC through CuPy) wherever ``sparse_mla.union.backends`` can run it.

Assumptions: q, out, lse, indices are contiguous (as the engine passes them), kv has the engine's
row stride and row-count class, and tensors passed by the engine are 16-byte aligned (whole
allocations or slices that start at a multiple of 16 bytes). ``build_group_union`` (an inspection
API, not on the step path) is not warmed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import triton

from ..checks import KERNEL_DTYPES, flatten_kv
from ..kv_format import KV_FORMATS, check_kv_format
from ..mqa import gluon_sm90, split_combine
from ..mqa import triton_tl as sparse_mqa
from ..mqa.backends import GLUON_FEW_HEADS_MAX_TOKENS
from ..mqa.checks import SUPPORTED_D_QK
from ..mqa.interface import sparse_mla_fwd
from ..union import backends as union_backends
from ..union import cuda_smem as union_cuda_smem
from ..union import planning as union_planning
from ..union import probe as union_probe
from ..union import triton_tl as union
from ..union.grouping import MAX_GROUP_SIZE, default_group_size
from ..union.workspace import SparseMLAWorkspace
from . import index_convert
from .block_table import convert_req_index_to_global


def warmed_kernels() -> dict[str, object]:
    """The Triton and Gluon kernels ``warmup`` covers, by name (JITFunction, or InterpretedFunction on CPU).
    The Gluon sm_90 kernels are listed where this Triton can define them; warmup reaches them through
    ``sparse_mla_fwd`` on a device where ``sparse_mla.mqa.backends`` selects them."""
    kernels = {
        "sparse_mqa": sparse_mqa._sparse_mqa_fwd_kernel,
        "plan_groups": union_planning._plan_groups_kernel,
        "build_union": union._build_union_kernel,
        "union_probe": union_probe._probe_decide_apply_kernel,
        "convert_req_index": index_convert._convert_req_index_kernel,
        "split_combine": split_combine._combine_splits_kernel,
    }
    if gluon_sm90.GLUON_IMPORT_ERROR is None:
        kernels["sparse_mqa_sm90"] = gluon_sm90.sparse_mqa_sm90_kernel
        kernels["sparse_mqa_sm90_pair"] = gluon_sm90.sparse_mqa_sm90_pair_kernel
    return kernels


def compiled_variant_counts() -> dict[str, int]:
    """Compiled variants held in memory per warmed kernel, summed over devices.

    Reads ``JITFunction.device_caches[device][0]`` (the per-device kernel cache dict of triton
    3.x). Under the interpreter (TRITON_INTERPRET=1) nothing compiles and every count is 0.
    """
    counts = {}
    for name, kernel in warmed_kernels().items():
        caches = getattr(kernel, "device_caches", None)
        counts[name] = 0 if caches is None else sum(len(c[0]) for c in list(caches.values()))
    counts["build_union_cuda_smem"] = union_cuda_smem.compiled_kernel_count()  # CuPy RawKernels, per device
    return counts


def _unspecialized(kernel) -> set[str]:
    """Names of the kernel's arguments marked ``do_not_specialize``."""
    params = getattr(kernel, "params", None)
    if params is not None:
        return {p.name for p in params if p.do_not_specialize}
    names = getattr(kernel, "arg_names", [])
    dns = (getattr(kernel, "kwargs", None) or {}).get("do_not_specialize") or []
    return {names[x] if isinstance(x, int) else x for x in dns}


def _int_class(value: int) -> str:
    """Triton's specialization class of an integer argument."""
    return "1" if value == 1 else ("16" if value % 16 == 0 else "other")


def step_shape_reps(group_size: int, max_tokens: int, max_requests: int) -> list[tuple[int, int | None]]:
    """One (T, B) per specialization class of the integers a grouped step passes to its kernels.

    B None = token-major layout (no cu_seqlens_q). The classes (``_int_class``) are those of T,
    of the group count ceil(T / G) (the groups a step plans, with or without a workspace), of B, and B's
    power of two (the planner's block); plus one step per layout that runs the overlap probe. Conservative:
    every class is covered whether or not a kernel specializes on it. Classes repeat with period
    16 * G in T, so T up to 32 * G + 16 and every B up to ``max_requests`` cover all steps.
    """
    G = group_size
    t_max = min(max_tokens, 32 * G + 16)
    reps: dict[tuple, tuple[int, int | None]] = {}
    for T in range(1, t_max + 1):
        reps.setdefault(("token_major", _int_class(T), _int_class(triton.cdiv(T, G))), (T, None))
    t_keys: dict[tuple, int] = {}
    for T in range(1, t_max + 1):
        n_groups = triton.cdiv(T, G)  # the groups a step plans, with or without cu_seqlens_q
        t_keys.setdefault((_int_class(T), _int_class(n_groups)), T)
    b_keys: dict[tuple, int] = {}
    for B in range(1, max_requests + 1):
        b_keys.setdefault((_int_class(B), triton.next_power_of_2(B)), B)
    for tk, T in t_keys.items():
        for bk, B in b_keys.items():
            reps.setdefault(("requests", *tk, *bk), (T, B))
    # a step of PROBE_MIN_GROUPS groups runs the overlap probe (the planner's probe variant, the decision kernel)
    T_probe = union_probe.PROBE_MIN_GROUPS * G
    if T_probe <= max_tokens:
        reps.setdefault(("probe", "token_major"), (T_probe, None))
        for bk, B in b_keys.items():
            reps.setdefault(("probe", *bk), (T_probe, B))
    return list(reps.values())


@dataclass
class WarmupReport:
    """What ``warmup`` ran: wall seconds, entry-point calls (``sparse_mla_fwd`` and converter), new
    compiled variants per kernel (all 0 under the interpreter, or when everything was already compiled)."""

    seconds: float
    calls: int
    new_variants: dict[str, int] = field(default_factory=dict)


def _tiny_kv(num_kv_rows: int, d_qk: int, row_stride: int, dtype, device) -> torch.Tensor:
    """kv rows whose count has the specialization class of num_kv_rows (a small stand-in)."""
    n = num_kv_rows if num_kv_rows <= 256 else (256 if num_kv_rows % 16 == 0 else 257)
    base = torch.randn(n, row_stride, device=device).to(dtype)
    return base[:, :d_qk]


def warmup(
    num_heads: int,
    d_qk: int,
    topk: int,
    dtype: torch.dtype,
    device: torch.device | str,
    max_tokens: int,
    *,
    max_requests: int = 1,
    num_kv_rows: int | None = None,
    kv: torch.Tensor | None = None,
    kv_row_stride: int | None = None,
    workspace: SparseMLAWorkspace | None = None,
    group_size: int | None = None,
    overlap_guard: float | None = None,
    block_size: int = 64,
    return_lse: tuple[bool, ...] = (False, True),
    topk_length: tuple[bool, ...] = (False, True),
    attn_sink: tuple[bool, ...] = (False,),
    max_logits: tuple[bool, ...] = (False,),
    converter: bool = True,
    kv_format: str | None = None,
) -> WarmupReport:
    """Run every kernel variant a configuration can use once, on tiny inputs (compiles them on GPU).

    Call it once per (layer config, dtype, device) at start-up, before capturing CUDA graphs; a
    later ``sparse_mla_fwd`` / ``convert_req_index_to_global`` step with these settings, at most
    ``max_tokens`` rows and ``max_requests`` requests, then compiles nothing (tested on GPU by
    ``tests/integration/test_gpu_integration.py`` with ``compiled_variant_counts``).

    Args:
        num_heads: H, query heads per rank (sets the group size G = 128 // H unless group_size).
        d_qk: 576 or 512 (NoPE).
        topk: K, indices per query row.
        dtype: torch.bfloat16 or torch.float16 (q and kv).
        device: the CUDA device (or "cpu" under TRITON_INTERPRET=1, where nothing compiles).
        max_tokens: most query rows of a step (the workspace's max_tokens when one is given).
        max_requests: most requests (B of cu_seqlens_q) of a step.
        num_kv_rows: N of the engine's kv rows (``paged_kv_as_rows``); needed unless kv is given.
        kv: optional engine kv rows [N, D_qk] (or paged cache); warmup reads a few rows of it.
        kv_row_stride: row stride of the engine's kv in elements (default d_qk); ignored with kv.
        workspace: the engine's ``SparseMLAWorkspace``, if its steps pass one (recommended).
        group_size: G override, as passed to ``sparse_mla_fwd``.
        overlap_guard: as passed to ``sparse_mla_fwd``.
        block_size: the cache block size for the converter.
        return_lse, topk_length: which lse / topk_length modes the engine uses (default both).
        attn_sink, max_logits: whether the engine passes ``attn_sink`` / ``max_logits`` (as
            ``flash_mla_sparse_fwd`` does: pass (True,)); default (False,). Each True adds the Triton
            kernel's variants with that pointer (the Gluon kernel takes both as run-time arguments, with
            typed placeholders when absent, so its variant does not change).
        converter: also warm the block-table converter.
        kv_format: the engine's cache format, as passed to ``sparse_mla_fwd``: None, or "fp8_ds_mla" (then
            d_qk must be 576, and kv, if given, is the FP8 cache; its variants are the Gluon kernel's FP8 ones
            where ``sparse_mla.mqa.backends`` picks it, else the Triton kernel's).

    Returns:
        WarmupReport(seconds, calls, new_variants).

    Raises:
        TypeError: dtype not bf16/fp16.
        ValueError: d_qk not in {512, 576}, non-positive sizes, neither kv nor num_kv_rows, a
            workspace that does not fit (topk, group size), a bad group size, or a device the
            kernels cannot run on (as ``sparse_mla_fwd``); an unknown kv_format, or with "fp8_ds_mla" a
            d_qk other than 576 or a kv the format refuses (``sparse_mla.kv_format``).
    """
    t_start = time.perf_counter()
    if dtype not in KERNEL_DTYPES:
        raise TypeError(f"dtype must be one of {KERNEL_DTYPES}, got {dtype}")
    if d_qk not in SUPPORTED_D_QK:
        raise ValueError(f"d_qk must be one of {SUPPORTED_D_QK}, got {d_qk}")
    for name, v in (("num_heads", num_heads), ("topk", topk), ("max_tokens", max_tokens), ("max_requests", max_requests),
                    ("block_size", block_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" means the current device: compare as cuda:N
        device = torch.device("cuda", torch.cuda.current_device())
    fmt = None if check_kv_format(kv_format) is None else KV_FORMATS[kv_format]
    if fmt is not None and d_qk != fmt.d_qk:
        raise ValueError(f"d_qk must be {fmt.d_qk} with kv_format={kv_format!r}, got {d_qk}")
    if fmt is not None and kv is not None:
        kv = fmt.as_rows(kv, "kv")
        if kv.device != device:
            raise ValueError(f"kv must be on {device}, got {kv.device}")
        num_kv_rows = kv.shape[0]
    elif fmt is not None:
        if num_kv_rows is None or num_kv_rows < 1:
            raise ValueError(f"pass kv (the engine's FP8 cache) or num_kv_rows >= 1, got num_kv_rows={num_kv_rows!r}")
        kv = fmt.quantize(_tiny_kv(num_kv_rows, d_qk, d_qk, torch.float32, device))
    elif kv is not None:
        kv = flatten_kv(kv)
        if kv.shape[1] != d_qk or kv.dtype != dtype or kv.device != device:
            raise ValueError(f"kv must be [N, {d_qk}] {dtype} on {device}, got {tuple(kv.shape)} {kv.dtype} on {kv.device}")
        num_kv_rows = kv.shape[0]
    elif num_kv_rows is None or num_kv_rows < 1:
        raise ValueError(f"pass kv (the engine's kv rows) or num_kv_rows >= 1, got num_kv_rows={num_kv_rows!r}")
    else:
        kv = _tiny_kv(num_kv_rows, d_qk, kv_row_stride or d_qk, dtype, device)
    G = group_size if group_size is not None else default_group_size(num_heads)
    if not (1 <= G <= MAX_GROUP_SIZE and (G == 1 or G * num_heads <= 128)):
        raise ValueError(f"group_size must be in [1, {MAX_GROUP_SIZE}] with group_size * H <= 128, got {G} (H = {num_heads})")
    if workspace is not None:
        ok, why = workspace.fits(1, topk, G, num_kv_rows)
        if not ok:
            raise ValueError(f"workspace does not fit this configuration: {why}")
    before = compiled_variant_counts()
    union_backends.warmup(device)  # the CUDA union builder (NVRTC through CuPy), where it can run
    calls = 0
    gen = torch.Generator(device="cpu").manual_seed(0)
    scale = d_qk**-0.5
    cap = workspace.max_tokens if workspace is not None else max_tokens
    reps = step_shape_reps(G, cap, max_requests)
    # per-token launches: a short step, and one past the token count above which few-head steps switch from
    # the Gluon to the Triton kernel on the split schedule (sparse_mla.mqa.backends.triton_small_tiles_win), so that
    # whichever kernels the selection takes are compiled
    big = {t for t in (GLUON_FEW_HEADS_MAX_TOKENS + 1, GLUON_FEW_HEADS_MAX_TOKENS + 16) if t <= cap}  # both 16-classes
    per_token_T = sorted({min(2, cap)} | big)
    t_big = max([T for T, _ in reps] + per_token_T)
    n_small = kv.shape[0]
    q_all = torch.randn(t_big, num_heads, d_qk, generator=gen).to(dtype).to(device)
    cols = torch.arange(topk, dtype=torch.int32)
    idx_all = torch.where(cols < n_small, cols, -1)[None, :].expand(t_big, topk).contiguous().to(device)
    tl_all = torch.full((t_big,), topk, dtype=torch.int32, device=device)
    modes = [(lse_, tl_, sink_, ml_) for lse_ in return_lse for tl_ in topk_length for sink_ in attn_sink
             for ml_ in max_logits]
    sink_all = torch.zeros(num_heads, dtype=torch.float32, device=device)
    ml_all = torch.empty(t_big, num_heads, dtype=torch.float32, device=device)

    def extras(T: int, with_tl: bool, with_sink: bool, with_ml: bool) -> dict:
        return dict(topk_length=tl_all[:T] if with_tl else None, attn_sink=sink_all if with_sink else None,
                    max_logits=ml_all[:T] if with_ml else None)

    for T in per_token_T:
        for with_lse, with_tl, with_sink, with_ml in modes:
            sparse_mla_fwd(q_all[:T], kv, idx_all[:T], scale, method="per_token", return_lse=with_lse,
                           kv_format=kv_format, **extras(T, with_tl, with_sink, with_ml))
            calls += 1
    # split-KV launches (few-token steps: sparse_mla.mqa.kv_splits) and their combine, per token and grouped (the
    # kernels take S at run time: one variant serves every S). Grouped on an FP8 cache: the staged route (the
    # automatic choice does not split grouped tiles that dequantize in the gather: backends.kv_split_missing)
    T = min(2, cap)
    for method in ("per_token", "grouped"):
        route = "staged" if method == "grouped" and kv_format is not None else "auto"
        for with_lse, with_tl, with_sink, with_ml in modes:
            sparse_mla_fwd(q_all[:T], kv, idx_all[:T], scale, method=method, return_lse=with_lse, kv_format=kv_format,
                           kv_dequant=route, kv_splits=2, workspace=workspace if method == "grouped" else None,
                           group_size=G if method == "grouped" else None,
                           **extras(T, with_tl, with_sink, with_ml))
            calls += 1
    # grouped steps past that token count too: their per-token pass (route) switches kernel the same way
    reps = reps + [(T, None) for T in per_token_T if T > GLUON_FEW_HEADS_MAX_TOKENS]
    for T, B in reps:
        cu = None
        if B is not None:
            cu = torch.div(torch.arange(B + 1) * T, B, rounding_mode="floor").to(torch.int32).to(device)
        for with_lse, with_tl, with_sink, with_ml in modes:
            sparse_mla_fwd(q_all[:T], kv, idx_all[:T], scale, method="grouped", cu_seqlens_q=cu, workspace=workspace,
                           group_size=G, overlap_guard=overlap_guard, return_lse=with_lse, kv_format=kv_format,
                           **extras(T, with_tl, with_sink, with_ml))
            calls += 1

    if converter:
        req_id = torch.tensor([0, -1], dtype=torch.int32, device=device)
        block_table = torch.tensor([[0, 1]], dtype=torch.int32, device=device)
        local = torch.arange(2 * topk, dtype=torch.int32).reshape(2, topk).remainder(2 * block_size).to(device)
        out_idx = torch.empty(2, topk, dtype=torch.int32, device=device)
        for counts in (False, True):
            convert_req_index_to_global(req_id, block_table, local, block_size, out=out_idx, return_valid_counts=counts)
            calls += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    after = compiled_variant_counts()
    return WarmupReport(time.perf_counter() - t_start, calls, {k: after[k] - before[k] for k in after})


__all__ = ["warmup", "WarmupReport", "compiled_variant_counts", "warmed_kernels", "step_shape_reps"]
