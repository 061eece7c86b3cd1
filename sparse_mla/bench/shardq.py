"""ShardQ vs plain tensor parallelism for sparse MLA prefill, on the ranks of a torchrun job.

``run_shardq_bench`` runs on every rank of an already running ``torchrun`` job (NCCL, one GPU per
rank; or gloo on CPUs with the Triton interpreter, a smoke test whose times mean nothing). For each
model layout (``sparse_mla.workloads.models``: heads, D_qk, d_v, sm_scale) and prompt length T
(pure prefill: one request, T new tokens, cache = the prompt, causal top-k) it times, on W ranks:

* ``tp/per_token``, ``tp/grouped``: ``tp_sparse_mla_fwd``, each rank its H / W heads of every
  token (grouped with G = 128 // (H / W));
* ``shardq/per_token``, ``shardq/grouped``: ``shardq_sparse_mla_fwd``, each rank all H heads of a
  zigzag slice of the tokens (grouped with G = 128 // H, only where G >= 2: not for 128 heads).

Every iteration zeroes a 256 MiB buffer (L2 flush, GPU only) and passes a barrier, then the variant
fills its ``timings`` (CUDA events on GPU, host clock on CPU): exchange of q, attention, exchange of
out, total. Reported, medians over the timed iterations (``trials``, after ``WARMUP_GPU`` warm-up
iterations on a GPU, none under the interpreter): ``total_ms`` (max over ranks), ``attn_ms`` (max
over ranks) and ``attn_imbalance`` (max / min), ``xchg_q_ms`` (max over ranks) and ``xchg_out_ms``
(min over ranks: the rank that finished its attention last waits least, so its figure is closest to
the pure transfer + copies). ``tflops`` = useful FLOPs of the whole layer (``FLOPS_FORMULA``) /
``total_ms``. ``union_g`` = union ratio (union rows / mean valid rows) of token-major groups of G
queries among the last ``UNION_TAIL_ROWS`` rows (``sparse_mla.workloads.stats.union_ratio``).

Inputs: top-k lists from ``sparse_mla.workloads.synthetic_topk`` (calibrated ``overlap`` preset),
generated on rank 0 and broadcast, as are the latent cache; q per rank = its own random head shard.
With ``check``, each variant's output (after its last iteration) is compared with ``tp/per_token``
(relative Frobenius error over all rows, max over ranks) and with the fp32 ``sparse_mla_ref`` on
``CHECK_ROWS`` sampled rows.

NVLink multicast stays off: NCCL_NVLS_ENABLE=0 is set before NCCL starts.
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .. import env
from ..workloads.models import MLAConfig, get_model
from ..workloads.stats import union_ratio
from ..workloads.topk import resolve_overlap
from .check import CHECK_TOLERANCE, check_tolerance
from .common import command_line, fmt, make_table, markdown_cells, print_tables, rel_err_tensor, run_meta, tflops

VARIANTS = ("tp/per_token", "tp/grouped", "shardq/per_token", "shardq/grouped")
WARMUP_GPU = 2  # untimed iterations per variant on a GPU (Triton compilation, autotuning)
FLUSH_BYTES = 256 * 2**20  # L2 flush before every iteration (H200 L2: 60 MiB)
CHECK_ROWS = 64  # rows compared with the fp32 reference
CHECK_LIMIT = CHECK_TOLERANCE[torch.bfloat16]  # bf16; the bench's check_ok uses its dtype's (check.check_tolerance)
UNION_TAIL_ROWS = 4096
FLOPS_FORMULA = "2 * H * sum_t K_valid(t) * (D_qk + d_v): all H heads, all T tokens, per-token FLOPs"
# What the row keys mean (copied into the JSON's meta, so the file explains itself).
FIELD_NOTES = {
    "row": "model, tp (= W ranks), heads (H, all ranks), heads_per_rank (H / W), d_qk, d_v, tokens (T, pure prefill), "
           "topk, overlap, variant (path/method), path (tp or shardq), method (per_token or grouped), group_size (G), "
           "trials, warmup, interpreted, times, tflops, useful_tflop, union_g, checks",
    "times": "ms, medians over the timed iterations: total_ms (max over ranks; total_ms_min / total_ms_max: spread over "
             "iterations), attn_ms (max over ranks), attn_imbalance (max / min over ranks), xchg_q_ms (max over ranks), "
             "xchg_out_ms (min over ranks), per_rank_attn_ms",
    "tflops": "useful TFLOP/s of the whole layer = " + FLOPS_FORMULA + " / total_ms; useful_tflop = those FLOPs / 1e12",
    "union_g": "union rows / mean valid rows of token-major groups of G queries, last 4096 rows (1.0 for per_token)",
    "checks": "err_vs_tp: relative Frobenius error vs tp/per_token over all rows; err_vs_ref: vs the fp32 sparse_mla_ref "
              "on 64 sampled rows; max over ranks; nan: any NaN in out; check_ok: no NaN and both errors < check_limit",
}


# ---------------------------------------------------------------------------------------------
# Validation and set-up (before any launch or communication)
# ---------------------------------------------------------------------------------------------


def _check_int(name: str, v: object, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    return v


def _job_world_size() -> int:
    """W of the running job: the initialised default group, else torchrun's WORLD_SIZE."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    if "WORLD_SIZE" not in os.environ:
        raise RuntimeError("run_shardq_bench runs on every rank of a torchrun job (WORLD_SIZE is not set), e.g. "
                           "torchrun --standalone --nproc-per-node 2 -m sparse_mla bench --tp 2")
    return int(os.environ["WORLD_SIZE"])


def _check_args(models, tokens, topk, overlap, trials, seed, min_tokens) -> list[MLAConfig]:
    """The model configs of ``models``, every argument checked (ValueError naming it)."""
    if not isinstance(models, (list, tuple)) or not models:
        raise ValueError(f"models must be a non-empty list of (model name, tp) pairs, got {models!r}")
    if not isinstance(tokens, (list, tuple)) or not tokens:
        raise ValueError(f"tokens must be a non-empty list of prompt lengths, got {tokens!r}")
    _check_int("topk", topk, 1)
    _check_int("trials", trials, 1)
    _check_int("seed", seed, 0)
    _check_int("min_tokens", min_tokens, 0)
    for i, T in enumerate(tokens):
        _check_int(f"tokens[{i}]", T, 1)
        if T < min_tokens:
            raise ValueError(f"tokens[{i}] = {T} < min_tokens = {min_tokens}: shardq_sparse_mla_fwd would run plain TP "
                             "there (lower min_tokens to time ShardQ on short prompts)")
    if not isinstance(overlap, str):
        raise ValueError(f"overlap must be a preset name of sparse_mla.workloads.OVERLAP_PRESETS, got {overlap!r}")
    resolve_overlap(overlap)  # ValueError naming the presets
    W = _job_world_size()
    if W < 2:
        raise ValueError(f"the ShardQ benchmark needs a world size >= 2 (torchrun --nproc-per-node), got {W}")
    configs = []
    for i, pair in enumerate(models):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValueError(f"models[{i}] must be a (model name, tp) pair, got {pair!r}")
        name, tp = pair
        cfg = get_model(name)  # ValueError listing the known models
        _check_int(f"models[{i}] tp", tp, 1)
        if tp != W:
            raise ValueError(f"models[{i}] = {pair!r}: tp must equal the job's world size W = {W} "
                             f"(one rank per TP shard; launch torchrun --nproc-per-node {tp})")
        cfg.heads_per_rank(tp)  # ValueError: heads not divisible by tp
        configs.append(cfg)
    return configs


def _require_interpreter() -> None:
    """CPU ranks run the kernels through the Triton interpreter: TRITON_INTERPRET=1, set here unless
    the kernels were already imported without it (Triton reads it when a kernel is defined)."""
    if "TRITON_INTERPRET" not in os.environ and not env.kernels_imported():
        os.environ["TRITON_INTERPRET"] = "1"
    if not env.interpreted():
        raise RuntimeError("CPU ranks need the Triton interpreter: set TRITON_INTERPRET=1 before sparse_mla's kernels "
                           "are imported")


def _start_distributed() -> tuple[torch.device, torch.dtype]:
    """Initialise the default process group if needed; (device, dtype) of this rank.

    CUDA available: NCCL, device cuda:LOCAL_RANK, bf16. Else gloo on the CPU, fp16 through the Triton
    interpreter (its bf16 dot is wrong). A group the caller initialised decides by its backend.
    """
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # before any NCCL communicator exists (NVLink multicast off)
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
        else:
            _require_interpreter()
            dist.init_process_group("gloo")
    if "nccl" in str(dist.get_backend()):
        if "LOCAL_RANK" in os.environ:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        return torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    _require_interpreter()
    return torch.device("cpu"), torch.float16


# ---------------------------------------------------------------------------------------------
# Timing and figures
# ---------------------------------------------------------------------------------------------


def _flush_and_barrier(device: torch.device, on_gpu: bool) -> tuple[Callable[[], object], Callable[[], None]]:
    """(flush, barrier) for ``_timed_iterations``: an L2 flush (zeroing FLUSH_BYTES on a GPU) and a barrier
    across the ranks that also waits for this rank's device work."""
    flush_buf = torch.empty(FLUSH_BYTES if on_gpu else 1, dtype=torch.uint8, device=device)

    def barrier() -> None:
        dist.barrier()
        if on_gpu:
            torch.cuda.synchronize(device)

    return flush_buf.zero_, barrier


def _timed_iterations(fn: Callable[[dict], None], trials: int, warmup: int, flush: Callable[[], None],
                      barrier: Callable[[], None]) -> list[dict]:
    """This rank's ``timings`` dicts of the ``trials`` iterations after ``warmup`` untimed ones."""
    recs = []
    for i in range(warmup + trials):
        flush()
        barrier()
        timings: dict = {}
        fn(timings)
        if i >= warmup:
            recs.append(timings)
    return recs


def _cross_rank_medians(all_ranks: list[list[dict]]) -> dict:
    """all_ranks[r][i]: rank r's timings of iteration i -> medians over i of cross-rank figures (ms)."""
    n_iter = len(all_ranks[0])

    def col(key: str, red) -> list[float]:
        return [red(r[i][key] for r in all_ranks) for i in range(n_iter)]

    attn_max, attn_min = col("attention_ms", max), col("attention_ms", min)
    total = col("total_ms", max)
    return {
        "total_ms": statistics.median(total),
        "total_ms_min": min(total),
        "total_ms_max": max(total),
        "attn_ms": statistics.median(attn_max),
        "attn_imbalance": statistics.median(a / b if b > 0 else float("nan") for a, b in zip(attn_max, attn_min)),
        "xchg_q_ms": statistics.median(col("exchange_q_ms", max)),
        "xchg_out_ms": statistics.median(col("exchange_out_ms", min)),
        "per_rank_attn_ms": [statistics.median(r[i]["attention_ms"] for i in range(n_iter)) for r in all_ranks],
    }


def _union_tail(indices: torch.Tensor, valid: torch.Tensor, G: int) -> float:
    """Union ratio of groups of G among the last UNION_TAIL_ROWS rows (1.0 for G = 1)."""
    if G < 2:
        return 1.0
    T = indices.shape[0]
    s = max(0, T - UNION_TAIL_ROWS)
    s += (T - s) % G  # complete groups ending at the last row
    return union_ratio(indices[s:], valid[s:], G).ratio_mean


# ---------------------------------------------------------------------------------------------
# One (model, T) point
# ---------------------------------------------------------------------------------------------


def _bench_point(cfg: MLAConfig, T: int, *, topk: int, overlap: str, trials: int, warmup: int, seed: int,
                 check: bool, min_tokens: int, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Every variant at one (model, T) on this rank; returns the rows (the same on every rank)."""
    from ..distributed import shardq_sparse_mla_fwd, tp_sparse_mla_fwd
    from ..mqa.interface import sparse_mla_fwd
    from ..mqa.reference import sparse_mla_ref
    from ..union.grouping import default_group_size
    from ..union.workspace import SparseMLAWorkspace
    from ..workloads.topk import synthetic_topk

    W, rank = dist.get_world_size(), dist.get_rank()
    H, D, d_v, K, scale = cfg.num_heads, cfg.d_qk, cfg.d_v, topk, cfg.sm_scale
    Hl = cfg.heads_per_rank(W)
    on_gpu = device.type == "cuda"
    # Same top-k and cache on every rank (made on rank 0, broadcast); q per rank = its head shard.
    indices = torch.empty(T, K, dtype=torch.int32, device=device)
    valid = torch.empty(T, dtype=torch.int32, device=device)
    kv = torch.empty(T, D, dtype=dtype, device=device)  # [N = T, D_qk]: the cache is the prompt
    if rank == 0:
        idx0, val0 = synthetic_topk(0, T, K, overlap, seed=seed, device=device)
        indices.copy_(idx0)
        valid.copy_(val0)
        del idx0, val0
        kv.normal_(generator=torch.Generator(device=device).manual_seed(seed + 1))
    for t in (indices, valid, kv):
        dist.broadcast(t, src=0)
    q_local = torch.randn(T, Hl, D, generator=torch.Generator(device=device).manual_seed(seed + 100 + rank),
                          device=device, dtype=dtype)  # [T, H / W, D_qk]
    flops = 2 * H * int(valid.long().sum()) * (D + d_v)
    G_tp, G_sq = default_group_size(Hl), default_group_size(H)
    max_rank_rows = -(-T // (2 * W)) * 2  # two zigzag chunks of at most ceil(T / 2W) rows
    out = torch.empty(T, Hl, d_v, dtype=dtype, device=device)
    common: dict[str, Any] = dict(d_v=d_v, topk_length=valid, out=out)
    sq = dict(min_tokens=min_tokens, **common)
    variants: dict[str, tuple[Callable, int, bool]] = {  # name -> (function, G, returns info)
        "tp/per_token": (functools.partial(tp_sparse_mla_fwd, method="per_token", **common), 1, False),
        "shardq/per_token": (functools.partial(shardq_sparse_mla_fwd, method="per_token", **sq), 1, True),
    }
    if G_tp >= 2:  # grouped attention with a workspace sized for the rows it gets (no allocation per call)
        grouped = functools.partial(sparse_mla_fwd, workspace=SparseMLAWorkspace(T, K, G_tp, T, device))
        variants["tp/grouped"] = (functools.partial(tp_sparse_mla_fwd, method="grouped", attn_fn=grouped, **common),
                                  G_tp, False)
    if G_sq >= 2:
        grouped = functools.partial(sparse_mla_fwd, workspace=SparseMLAWorkspace(max_rank_rows, K, G_sq, T, device))
        variants["shardq/grouped"] = (functools.partial(shardq_sparse_mla_fwd, method="grouped", attn_fn=grouped, **sq),
                                      G_sq, True)

    flush, barrier = _flush_and_barrier(device, on_gpu)

    baseline = sample = ref = None
    if check:
        sample = torch.randint(0, T, (min(CHECK_ROWS, T),), generator=torch.Generator().manual_seed(7)).to(device)
        ref, _ = sparse_mla_ref(q_local[sample], kv, indices[sample], scale, d_v=d_v, topk_length=valid[sample])
    rows = []
    for name in VARIANTS:
        if name not in variants:
            continue
        fn, G, has_info = variants[name]
        info: dict = {}
        extra = {"info": info} if has_info else {}

        def call(timings: dict, fn=fn, extra=extra) -> None:
            fn(q_local, kv, indices, scale, timings=timings, **extra)

        out.fill_(float("nan"))
        recs = _timed_iterations(call, trials, warmup, flush, barrier)
        if has_info and info.get("path") != "shardq":
            raise RuntimeError(f"{name}: expected the ShardQ path, got {info}")
        gathered: list = [None] * W
        dist.all_gather_object(gathered, recs)
        row = dict(model=cfg.name, tp=W, heads=H, heads_per_rank=Hl, d_qk=D, d_v=d_v, tokens=T, topk=K,
                   overlap=overlap, variant=name, path=name.split("/")[0], method=name.split("/")[1], group_size=G,
                   trials=trials, warmup=warmup, interpreted=not on_gpu, **_cross_rank_medians(gathered))
        row["tflops"] = tflops(flops, row["total_ms"])
        row["useful_tflop"] = flops / 1e12
        row["union_g"] = _union_tail(indices, valid, G)
        if check:
            if baseline is None:  # tp/per_token runs first
                baseline = out.clone()
            stats = torch.stack([rel_err_tensor(out, baseline), rel_err_tensor(out[sample], ref),
                                 torch.isnan(out).any().double()])
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)
            err_tp, err_ref, nan = stats.tolist()
            row.update(err_vs_tp=err_tp, err_vs_ref=err_ref, nan=bool(nan),
                       check_ok=not nan and err_tp < check_tolerance(dtype) and err_ref < check_tolerance(dtype))
        rows.append(row)
    return rows


def shardq_summary(results: list[dict]) -> list[dict]:
    """Per (model, tp, tokens): the best TP and the best ShardQ variant by ``total_ms`` and
    ``speedup`` = TP best total / ShardQ best total (> 1: ShardQ is faster)."""
    best: dict[tuple, dict] = {}
    for r in results:
        key = (r["model"], r["tp"], r["tokens"], r["path"])
        if key not in best or r["total_ms"] < best[key]["total_ms"]:
            best[key] = r
    summary = []
    for (model, tp, T, path), sq in sorted(best.items()):
        tp_row = best.get((model, tp, T, "tp"))
        if path != "shardq" or tp_row is None:
            continue
        summary.append(dict(model=model, tp=tp, tokens=T, tp_best_variant=tp_row["variant"],
                            tp_best_ms=tp_row["total_ms"], shardq_best_variant=sq["variant"], shardq_best_ms=sq["total_ms"],
                            speedup=tp_row["total_ms"] / sq["total_ms"] if sq["total_ms"] > 0 else float("nan")))
    return summary


# ---------------------------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------------------------


def run_shardq_bench(
    models: list[tuple[str, int]],
    tokens: list[int],
    *,
    topk: int,
    overlap: str,
    trials: int,
    seed: int,
    check: bool = True,
    min_tokens: int = 1024,
) -> dict | None:
    """Time ShardQ against plain TP on every rank of a running torchrun job (module docstring).

    A collective: every rank calls it with the same arguments. Initialises the default process
    group when it is not (NCCL with ``torch.cuda.set_device(LOCAL_RANK)`` when CUDA is available,
    else gloo on the CPU with the Triton interpreter), after setting NCCL_NVLS_ENABLE=0. Device
    tensors per rank and point: q [T, H / W, D_qk], out [T, H / W, d_v] (bf16 on CUDA, fp16 under
    the interpreter), kv [T, D_qk], indices [T, topk] int32; everything is freed between points.

    Args:
        models: (model name of ``sparse_mla.workloads.MODELS``, tp) pairs; tp must equal W, the
            job's world size (>= 2), and divide the model's heads.
        tokens: prompt lengths T (pure prefill), each >= max(1, min_tokens).
        topk: K, the indexer's list width (2048 for the DSA models).
        overlap: preset of ``sparse_mla.workloads.OVERLAP_PRESETS`` for the synthetic top-k.
        trials: timed iterations per variant (after ``WARMUP_GPU`` warm-up ones on a GPU).
        seed: seed of the top-k lists, the cache and q (q: seed + 100 + rank).
        check: compare every variant with tp/per_token and the fp32 reference (``err_vs_tp``,
            ``err_vs_ref``, ``nan``, ``check_ok`` in the rows).
        min_tokens: passed to ``shardq_sparse_mla_fwd`` (it runs plain TP below it).

    Returns:
        On rank 0 ``{"meta": provenance (command, argv, git revision: env GIT_REV first, GPU,
        date, torch / triton versions, world_size, backend, dtype, nccl_nvls_enable, topk source,
        flops formula, arguments), "rows": one row per (model, T, variant) with times in ms,
        ``tflops`` in TFLOP/s, ``union_g``, errors, "summary": ``shardq_summary(rows)``}`` (``common.write_json`` writes it);
        None on the other ranks.

    Raises:
        ValueError: a bad argument (named), a tp other than W, W < 2; on every rank, before any
            kernel launch or communication. RuntimeError: not under torchrun (no WORLD_SIZE and no
            process group), or no GPU and the interpreter not enabled; or a ShardQ variant that
            did not take the ShardQ path.
    """
    configs = _check_args(models, tokens, topk, overlap, trials, seed, min_tokens)
    device, dtype = _start_distributed()
    W, rank = dist.get_world_size(), dist.get_rank()
    warmup = WARMUP_GPU if device.type == "cuda" else 0
    rows: list[dict] = []
    for cfg in configs:
        for T in tokens:
            rows += _bench_point(cfg, T, topk=topk, overlap=overlap, trials=trials, warmup=warmup, seed=seed,
                                 check=check, min_tokens=min_tokens, device=device, dtype=dtype)
            if device.type == "cuda":  # the point's tensors are gone: give their memory back
                torch.cuda.empty_cache()
    dist.barrier()
    if rank != 0:
        return None
    meta = rank_meta("shardq", device, dtype, trials,
                     topk_source=f"sparse_mla.workloads.synthetic_topk(cached=0, new=T, topk={topk}, overlap={overlap!r}, "
                                 f"seed={seed})",
                     flops_formula=FLOPS_FORMULA, fields=FIELD_NOTES, models=[[c.name, W] for c in configs],
                     tokens=list(tokens), topk=topk, overlap=overlap, warmup=warmup, seed=seed, check=check,
                     check_limit=check_tolerance(dtype), min_tokens=min_tokens)
    return {"meta": meta, "rows": rows, "summary": shardq_summary(rows)}


def rank_meta(kind: str, device: torch.device, dtype: torch.dtype, trials: int, **extra: object) -> dict:
    """The ``meta`` of a torchrun bench (``common.run_meta``): the launch command, the GPU, the timing method of
    ``_timed_iterations``, ``timings_meaningful``, ``trials``, argv, world size, process-group backend, dtype,
    NCCL_NVLS_ENABLE, then ``extra``."""
    on_gpu = device.type == "cuda"
    timing = (f"per iteration: 256 MiB L2 flush, barrier, CUDA events inside the call; {WARMUP_GPU} warm-up + "
              f"{trials} timed iterations, median; total/attn max over ranks, xchg_out min over ranks"
              if on_gpu else "host clock under TRITON_INTERPRET=1: not a performance number")
    return run_meta(kind, command=command_line(), timing=timing, device=device, timings_meaningful=on_gpu, trials=trials,
                    argv=list(sys.argv), world_size=dist.get_world_size(), backend=str(dist.get_backend()),
                    dtype=str(dtype), nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"), **extra)


def shardq_cells(results: list[dict], wide: bool = False) -> tuple[list[str], list[list[str]]]:
    """(head, cells) of the rows of ``run_shardq_bench``. Compact (fits 80 columns): model, W, T, variant, total /
    attention / exchange (q + out) ms, err vs ref ("!" after a failed check). ``wide``: G, the two exchanges apart,
    the attention imbalance, TFLOP/s, union ratio and err vs tp as well."""
    def fail(r: dict) -> str:
        return ("!" if r.get("check_ok") is False else "") + (" NaN" if r.get("nan") else "")

    if not wide:
        head = ["model", "W", "T", "variant", "total", "attn", "xchg", "err vs ref"]
        cells = [[r["model"], str(r["tp"]), str(r["tokens"]), r["variant"], fmt(r["total_ms"], ".3f"),
                  fmt(r["attn_ms"], ".3f"), fmt(r["xchg_q_ms"] + r["xchg_out_ms"], ".3f"),
                  fmt(r.get("err_vs_ref"), ".1e") + fail(r)] for r in results]
        return head, cells
    head = ["model", "W", "T", "variant", "G", "total ms", "attn ms", "imbal", "xchg q ms", "xchg out ms", "TFLOP/s",
            "union_g", "err vs tp", "err vs ref"]
    cells = [[r["model"], str(r["tp"]), str(r["tokens"]), r["variant"], str(r["group_size"]), fmt(r["total_ms"], ".3f"),
              fmt(r["attn_ms"], ".3f"), fmt(r["attn_imbalance"], ".2f"), fmt(r["xchg_q_ms"], ".3f"),
              fmt(r["xchg_out_ms"], ".3f"), fmt(r["tflops"], ".1f"), fmt(r["union_g"], ".2f"),
              fmt(r.get("err_vs_tp"), ".1e"), fmt(r.get("err_vs_ref"), ".1e") + fail(r)] for r in results]
    return head, cells


def summary_cells(results: list[dict]) -> tuple[list[str], list[list[str]]]:
    """(head, cells) of ``shardq_summary``: per (model, W, T) the best TP and ShardQ variants, their total ms and
    the speedup (fits 80 columns)."""
    head = ["model", "W", "T", "best TP", "ms", "best ShardQ", "ms ", "speedup"]
    cells = [[s["model"], str(s["tp"]), str(s["tokens"]), s["tp_best_variant"], fmt(s["tp_best_ms"], ".3f"),
              s["shardq_best_variant"], fmt(s["shardq_best_ms"], ".3f"), fmt(s["speedup"], ".2f") + "x"]
             for s in shardq_summary(results)]
    return head, cells


def cost_model_cells(modelled: list[dict], wide: bool = False) -> tuple[list[str], list[list[str]]]:
    """(head, cells) of ``cost_model.model_vs_measured`` rows. Compact (fits 80 columns): model, W, T, variant, total
    ms measured / modelled / error, speedup measured / modelled. ``wide``: the exchange's three figures as well."""
    xchg = ["xchg ms", "model", "err"] if wide else []
    head = ["model", "W", "T", "variant", *xchg, "total ms", "model ", "err ", "speedup", "model  "]
    cells = []
    for m in modelled:
        x = [fmt(m["measured_xchg_ms"], ".2f"), fmt(m["model_xchg_ms"], ".2f"), f"{m['xchg_err']:+.1%}"] if wide else []
        cells.append([m["model"], str(m["tp"]), str(m["tokens"]), m["variant"], *x, fmt(m["measured_total_ms"], ".2f"),
                      fmt(m["model_total_ms"], ".2f"), f"{m['total_err']:+.1%}", fmt(m["measured_speedup"], ".2f"),
                      fmt(m["model_speedup"], ".2f")])
    return head, cells


def shardq_tables(results: list[dict], wide: bool = False) -> list:
    """The rich tables of a ``run_shardq_bench`` run: its rows (``shardq_cells``), the ShardQ-over-TP speedups
    (``summary_cells``) and, for a GPU run, the cost model beside the measurement (``cost_model_cells``)."""
    from ..distributed.cost_model import model_vs_measured

    interpreted = any(r.get("interpreted") for r in results)
    note = " [INTERPRETER: timings not meaningful]" if interpreted else ""
    head, cells = shardq_cells(results, wide)
    if wide:
        title, caption = "ShardQ vs TP: ms per layer (total, attention, exchanges), useful TFLOP/s", None
    else:
        title = "ShardQ vs TP: ms per layer"
        caption = "total / attn / xchg: ms per layer (xchg = q + out exchange); ! = failed check; --wide: more"
    tables = [make_table(title + note, head, cells, caption=caption, left=(0, 3),
                         failed=[r.get("check_ok") is False for r in results])]
    head, cells = summary_cells(results)
    tables.append(make_table("ShardQ speedup over TP (best total ms of each)" + note, head, cells, left=(0, 3, 5)))
    modelled, link_note = model_vs_measured(results)
    if modelled:
        head, cells = cost_model_cells(modelled, wide)
        tables.append(make_table(f"Cost model beside the measurement ({link_note})", head, cells, left=(0, 3)))
    return tables


def print_shardq_table(results: list[dict], width: int | None = None, wide: bool = False) -> None:
    """Print the tables of ``shardq_tables`` (compact: each fits 80 columns; ``wide``: every figure) on a console
    ``width`` columns wide (``common.print_tables``: by default the terminal's)."""
    print_tables(*shardq_tables(results, wide), width=width, wide=wide)


def markdown_shardq(results: list[dict]) -> str:
    """The wide table of ``shardq_cells`` and the summary as markdown tables."""
    return "\n\n".join(markdown_cells(*cells) for cells in (shardq_cells(results, wide=True), summary_cells(results)))


def plot_shardq(path: str, results: list[dict]) -> None:
    """PNG (matplotlib, Agg) of total ms per variant vs prompt length T, one panel per (model, W):
    solid = total, dashed (same colour) = its exchange part (xchg_q_ms + xchg_out_ms; ShardQ only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["model"], r["tp"]) for r in results})
    fig, axes = plt.subplots(1, max(1, len(keys)), figsize=(6 * max(1, len(keys)), 4.5), squeeze=False)
    interpreted = any(r.get("interpreted") for r in results)
    for ax, (model, W) in zip(axes[0], keys):
        pts = sorted((r for r in results if r["model"] == model and r["tp"] == W), key=lambda r: r["tokens"])
        for i, name in enumerate(VARIANTS):
            sel = [r for r in pts if r["variant"] == name]
            if not sel:
                continue
            xs = [r["tokens"] for r in sel]
            color = f"C{i}"
            ax.plot(xs, [r["total_ms"] for r in sel], marker="o", color=color, label=f"{name} total")
            if name.startswith("shardq"):
                ax.plot(xs, [r["xchg_q_ms"] + r["xchg_out_ms"] for r in sel], marker="x", linestyle="--", color=color,
                        label=f"{name} exchange")
        heads = pts[0]["heads"] if pts else "?"
        ax.set_title(f"{model}, W = {W} ranks ({heads} heads, TP: {pts[0]['heads_per_rank'] if pts else '?'} per rank)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens T (pure prefill)")
        ax.set_ylabel("ms per layer" + (" (interpreter, not meaningful)" if interpreted else ""))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["run_shardq_bench", "print_shardq_table", "shardq_tables", "markdown_shardq", "plot_shardq", "shardq_summary",
           "VARIANTS"]
