"""ShardQ vs TP one layer up (``sparse_mla.distributed.mla``): reduced vs absorbed exchange, chunked
pipeline, measured beside the cost model. Not wired into ``sparse-mla bench`` yet; run on W GPUs with

    torchrun --standalone --nproc-per-node 2 -m sparse_mla.bench.shardq_layer --tokens 8192,16384,32768,65536 \\
        --json out/bench_shardq_layer.json

(or call ``run_shardq_layer_bench`` on every rank). Per (model, T) it times, with per-token attention:

* ``tp``: ``tp_mla_attention`` (absorb own heads, attention of H / W heads over all rows, W_UV);
* ``shardq-absorbed`` / ``shardq-reduced`` at each ``chunks``: ``shardq_mla_attention``.

Each iteration: L2 flush (GPU), barrier, the call fills its ``timings``. Row figures are medians over
the timed iterations of the max over ranks of ``total_ms``, ``attention_ms`` and
``exposed_exchange_ms``. ``model_ms`` is the cost model's step time for the row (its measured
attention as input, the link fitted on the committed results/bench_shardq.json, the row's exchange
form and chunks), ``model_err`` = model / measured - 1. ``err_vs_tp``: relative Frobenius error of
the row's o vs the tp row's o (max over ranks); ``err_vs_ref``: vs the fp32 layer definition on
``CHECK_ROWS`` sampled rows.
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

import torch
import torch.distributed as dist

from ..workloads.models import get_model
from .check import check_tolerance
from .common import fmt, make_table, rel_err_tensor, render_text, write_json
from .shardq import (
    CHECK_ROWS,
    WARMUP_GPU,
    _check_args,
    _flush_and_barrier,
    _start_distributed,
    _timed_iterations,
    rank_meta,
)

DEFAULT_CHUNKS = (1, 2, 4)


def _reference_rows(q_nope, q_pe, w, kv, indices, valid, scale, r):
    """fp32 o [n, h, v] of the layer definition for the given rows / heads."""
    from ..mqa.reference import sparse_mla_ref

    nope = q_nope.shape[-1]
    q_abs = torch.bmm(q_nope.float().transpose(0, 1), w[:, :nope].float()).transpose(0, 1)
    if q_pe is not None:
        q_abs = torch.cat([q_abs, q_pe.float()], dim=-1)
    lat, _ = sparse_mla_ref(q_abs, kv.float(), indices, scale, d_v=r, topk_length=valid)
    return torch.bmm(lat.transpose(0, 1), w[:, nope:].float().transpose(1, 2)).transpose(0, 1)


def _bench_point(cfg, T, *, topk, overlap, trials, warmup, seed, chunks, check, device, dtype, link) -> list[dict]:
    from ..distributed import cost_model as cm
    from ..distributed.mla import shardq_mla_attention, tp_mla_attention
    from ..workloads.topk import synthetic_topk

    W, rank = dist.get_world_size(), dist.get_rank()
    H, Hl, r, nope, rope, v = (cfg.num_heads, cfg.heads_per_rank(W), cfg.kv_lora_rank, cfg.qk_nope_head_dim,
                               cfg.qk_rope_head_dim, cfg.v_head_dim)
    on_gpu = device.type == "cuda"
    indices = torch.empty(T, topk, dtype=torch.int32, device=device)
    valid = torch.empty(T, dtype=torch.int32, device=device)
    kv = torch.empty(T, r + rope, dtype=dtype, device=device)
    w = torch.empty(H, nope + v, r, dtype=dtype, device=device)
    if rank == 0:
        idx0, val0 = synthetic_topk(0, T, topk, overlap, seed=seed, device=device)
        indices.copy_(idx0)
        valid.copy_(val0)
        g = torch.Generator(device=device).manual_seed(seed + 1)
        kv.normal_(generator=g)
        w.normal_(generator=g).mul_(r**-0.5)
    for t in (indices, valid, kv, w):
        dist.broadcast(t, src=0)
    g = torch.Generator(device=device).manual_seed(seed + 100 + rank)
    q_nope = torch.randn(T, Hl, nope, generator=g, device=device, dtype=dtype)
    q_pe = torch.randn(T, Hl, rope, generator=g, device=device, dtype=dtype) if rope else None
    scale = cfg.sm_scale
    common: dict[str, Any] = dict(topk_length=valid, method="per_token")
    variants = [("tp", 1, lambda t: tp_mla_attention(q_nope, q_pe, w, kv, indices, scale, rank=rank, world_size=W,
                                                     timings=t, **common))]
    for form in ("absorbed", "reduced"):
        for n in chunks:
            variants.append((f"shardq-{form}", n, lambda t, form=form, n=n: shardq_mla_attention(
                q_nope, q_pe, w, kv, indices, scale, exchange=form, chunks=n, min_tokens=0, timings=t, **common)))
    flush, barrier = _flush_and_barrier(device, on_gpu)

    sample = ref = tp_out = None
    if check:
        sample = torch.randint(0, T, (min(CHECK_ROWS, T),), generator=torch.Generator().manual_seed(7)).to(device)
        mine = slice(rank * Hl, (rank + 1) * Hl)
        ref = _reference_rows(q_nope[sample], None if q_pe is None else q_pe[sample], w[mine], kv, indices[sample],
                              valid[sample], scale, r)
    rows = []
    for name, n, fn in variants:
        outs: list = []

        def call(timings: dict, fn=fn, outs=outs) -> None:
            outs[:] = [fn(timings)]

        recs = _timed_iterations(call, trials, warmup, flush, barrier)
        gathered: list = [None] * W
        dist.all_gather_object(gathered, recs)

        def med(key: str, gathered: list = gathered) -> float:
            return statistics.median(max(g[i][key] for g in gathered) for i in range(trials))

        row = dict(model=cfg.name, tp=W, heads=H, tokens=T, topk=topk, overlap=overlap, variant=name, chunks=n,
                   form=name.split("-")[1] if "-" in name else "none", trials=trials, warmup=warmup,
                   interpreted=not on_gpu, total_ms=med("total_ms"), attention_ms=med("attention_ms"),
                   exposed_exchange_ms=med("exposed_exchange_ms"))
        if name != "tp" and link is not None:
            p = cm.shardq_step_ms(cfg, W, T, tp_attn_ms=0.0, shardq_attn_ms=row["attention_ms"], link=link,
                                  form=row["form"], chunks=n)
            row.update(model_ms=p.shardq_ms, model_xchg_ms=p.exchange_ms, model_err=p.shardq_ms / row["total_ms"] - 1)
        o = outs[0]
        if check:
            if tp_out is None:
                tp_out = o.clone()
            stats = torch.stack([rel_err_tensor(o, tp_out), rel_err_tensor(o[sample], ref), torch.isnan(o).any().double()])
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)
            e_tp, e_ref, nan = stats.tolist()
            tol = check_tolerance(dtype)
            row.update(err_vs_tp=e_tp, err_vs_ref=e_ref, nan=bool(nan), check_ok=not nan and e_tp < tol and e_ref < tol)
        rows.append(row)
    tp_ms = rows[0]["total_ms"]
    for row in rows:
        row["speedup_vs_tp"] = tp_ms / row["total_ms"] if row["total_ms"] > 0 else float("nan")
    return rows


def run_shardq_layer_bench(models: list[tuple[str, int]], tokens: list[int], *, topk: int = 2048,
                           overlap: str = "mid", trials: int = 3, seed: int = 0,
                           chunks: tuple[int, ...] = DEFAULT_CHUNKS, check: bool = True) -> dict | None:
    """Time the layer-level ShardQ variants against TP on every rank of a torchrun job (module
    docstring). A collective: every rank calls it with the same arguments. Returns ``{"meta",
    "rows"}`` on rank 0, None elsewhere.

    Raises:
        ValueError: as ``run_shardq_bench``'s argument checks, or a chunks entry < 1.
    """
    configs = _check_args(models, tokens, topk, overlap, trials, seed, 0)
    if not chunks or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in chunks):
        raise ValueError(f"chunks must be a non-empty list of ints >= 1, got {chunks!r}")
    device, dtype = _start_distributed()
    from ..distributed import cost_model as cm

    link = cm.calibrated_links(cm.default_docs()[0])[1]  # the calibration ships as package data
    warmup = WARMUP_GPU if device.type == "cuda" else 0
    rows: list[dict] = []
    for cfg in configs:
        for T in tokens:
            rows += _bench_point(cfg, T, topk=topk, overlap=overlap, trials=trials, warmup=warmup, seed=seed,
                                 chunks=tuple(chunks), check=check, device=device, dtype=dtype, link=link)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    dist.barrier()
    if dist.get_rank() != 0:
        return None
    meta = rank_meta("shardq_layer", device, dtype, trials, models=[[c.name, dist.get_world_size()] for c in configs],
                     tokens=list(tokens), topk=topk, overlap=overlap, chunks=list(chunks), seed=seed, check=check,
                     cost_model_link=dict(name=link.name, bandwidth_gbs=link.bandwidth_gbs, latency_ms=link.latency_ms,
                                          copy_gbs=link.copy_gbs))
    return {"meta": meta, "rows": rows}


COMPACT_COLUMNS = ("model", "W", "T", "variant", "n", "total", "exposed", "vs TP", "err vs ref")  # fits 80 columns
WIDE_COLUMNS = ("model", "W", "T", "variant", "chunks", "total ms", "attn ms", "exposed x", "model ms", "err", "vs TP",
                "err vs tp", "err vs ref")


def _row_figures(r: dict) -> dict[str, str]:
    def f(key: str, spec: str) -> str:
        return fmt(r.get(key), spec)

    err_ref = f("err_vs_ref", ".1e") + ("!" if r.get("check_ok") is False else "")
    return {"model": r["model"], "W": str(r["tp"]), "T": str(r["tokens"]), "variant": r["variant"], "n": str(r["chunks"]),
            "chunks": str(r["chunks"]), "total": f("total_ms", ".3f"), "total ms": f("total_ms", ".3f"),
            "attn ms": f("attention_ms", ".3f"), "exposed": f("exposed_exchange_ms", ".3f"),
            "exposed x": f("exposed_exchange_ms", ".3f"), "model ms": f("model_ms", ".2f"), "err": f("model_err", "+.1%"),
            "vs TP": f("speedup_vs_tp", ".2f") + "x", "err vs tp": f("err_vs_tp", ".1e"), "err vs ref": err_ref}


def row_cells(rows: list[dict], wide: bool = False) -> tuple[list[str], list[list[str]]]:
    """(head, cells) of ``run_shardq_layer_bench`` rows: ``COMPACT_COLUMNS`` (model, W, T, variant, chunks n, total
    and exposed-exchange ms, speedup over TP, err vs ref with "!" after a failed check) or with ``wide``
    ``WIDE_COLUMNS`` (attention ms, the cost model's ms and its error, err vs tp as well)."""
    head = list(WIDE_COLUMNS if wide else COMPACT_COLUMNS)
    return head, [[fig[h] for h in head] for fig in map(_row_figures, rows)]


def tables(rows: list[dict], wide: bool = False) -> list:
    """The rich table of ``row_cells`` (title marked for an interpreter run)."""
    head, cells = row_cells(rows, wide)
    note = " [INTERPRETER RUN: timings not meaningful]" if any(r.get("interpreted") for r in rows) else ""
    caption = "ms per layer; exposed = exchange time not hidden behind attention" + ("" if wide else "; --wide: more")
    return [make_table("ShardQ vs TP, layer level" + note, head, cells, caption=caption, left=(0, 3),
                       failed=[r.get("check_ok") is False for r in rows])]


def format_rows(rows: list[dict], wide: bool = False, width: int | None = None) -> str:
    """``tables`` as text, ``width`` columns wide (default 80; ``wide``: as wide as the table needs)."""
    return render_text(*tables(rows, wide), width=width, wide=wide)


def main(argv: list[str] | None = None) -> None:  # pragma: no cover - torchrun entry point
    ap = argparse.ArgumentParser(description="ShardQ vs TP one layer up (run under torchrun, one rank per GPU)")
    ap.add_argument("--model", default="glm-5,deepseek-v3.2")
    ap.add_argument("--tokens", default="8192,16384,32768,65536")
    ap.add_argument("--chunks", default=",".join(map(str, DEFAULT_CHUNKS)))
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--json", default="out/bench_shardq_layer.json")
    a = ap.parse_args(argv)
    W = int(os.environ.get("WORLD_SIZE", "1"))
    models = [(get_model(m).name, W) for m in a.model.split(",")]
    doc = run_shardq_layer_bench(models, [int(t) for t in a.tokens.split(",")], topk=a.topk, trials=a.trials,
                                 chunks=tuple(int(c) for c in a.chunks.split(",")))
    if doc is not None:
        write_json(a.json, doc["meta"], doc["rows"])
        print(format_rows(doc["rows"]))
    dist.destroy_process_group()


if __name__ == "__main__":  # pragma: no cover
    main()
