"""Cost model of ShardQ vs plain tensor parallelism (TP) for one sparse MLA prefill layer.

Plain Python (no torch, no GPU): predicts the step time of ``shardq_sparse_mla_fwd`` and of
``tp_sparse_mla_fwd`` on W ranks from

* per-rank attention times (inputs: measured on one GPU for the per-rank problem of W ranks:
  TP = H / W heads of all T tokens, ShardQ = all H heads of T / W tokens);
* the bytes of the two all-to-alls, computed from the layout (``exchange_bytes``): q width and o
  width per token per head, element size, W, the zigzag split of the T real rows;
* a link (``Link``): per-GPU bandwidth per direction, a latency per all-to-all, and the bandwidth
  of the layout copies around each all-to-all (send-buffer build, head interleave / token reorder
  after receive: read + write through HBM).

Exchange forms (``exchange_widths``):

* ``"absorbed"`` (what ``shardq_sparse_mla_fwd`` sends): q in the absorbed form, kv_lora_rank +
  qk_rope wide (576), o in the latent form, kv_lora_rank wide (512);
* ``"reduced"`` (``shardq_mla_attention(exchange="reduced")``): q before absorption, qk_nope +
  qk_rope wide (192 DeepSeek-V3.2, 256 GLM-5), o after W_UV, v_head_dim wide (128 / 256); costs
  every head's kv_b_proj on every rank (``extra_weight_bytes``).

Step time, one layer (``shardq_step_ms``):

* no overlap: ``x_q + max_r attn_r + x_o`` (the all-to-alls are collectives: every rank waits
  for the slowest rank's attention before the output exchange completes);
* chunked pipeline of n chunks (exchange of chunk i + 1 and output of chunk i - 1 on the link
  while chunk i runs its attention): fill + steady state + drain =
  ``q_c + a_c + o_c + (n - 1) * max(a_c, q_c + o_c)`` with ``q_c = x_q / n`` (+ one latency per
  chunk), ``a_c = attn / n`` and ``o_c = x_o / n`` (+ one latency per chunk). The layout copies
  are counted on the link side (they would run on the communication stream); contention of those
  copies with the attention for HBM bandwidth is not modelled.

The TP step is ``max_r`` of the TP per-rank attention times (no communication in this layer).

Validation and projection (``validate`` / ``projection_table``) read the committed measurements
(results/bench_shardq.json: 2 H200s; results/bench.json: one H200, 16 heads per rank), shipped with the
package as the rows the model reads (``data/``: ``calibration_docs``, loaded by ``default_docs``);
``python -m sparse_mla.distributed.cost_model`` prints both tables. Nothing in this module was
measured: the W = 4 / 8 rows are projections.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from importlib import resources

from ..workloads.models import MLAConfig, get_model
from .zigzag import zigzag_chunks

FORMS = ("absorbed", "reduced")

# Published figures (not measured here).
# NVIDIA H200 SXM datasheet: "NVLink 900 GB/s" per GPU (18 NVLink 4 links, aggregate of both
# directions) -> 450 GB/s per direction; HBM3e 4.8 TB/s.
H200_NVLINK_GBS_PER_DIRECTION = 450.0
H200_HBM_GBS = 4800.0
# Layout copies reach a fraction of HBM peak (read + write streams); assumed, not measured.
COPY_EFFICIENCY = 0.8
# kv_b_proj layers of the published configs (num_hidden_layers; every layer is an MLA layer).
NUM_LAYERS = {"deepseek-v3.2": 61}


@dataclass(frozen=True)
class Link:
    """The interconnect seen by one rank in an all-to-all.

    Attributes:
        name: what it is (and where the figure comes from).
        bandwidth_gbs: GB/s (1e9 B/s) a GPU sends (and receives) per direction.
        latency_ms: fixed cost of one all-to-all (launch, handshake), ms.
        copy_gbs: GB/s of the layout copies around an all-to-all (HBM read + write traffic).
    """

    name: str
    bandwidth_gbs: float
    latency_ms: float
    copy_gbs: float = H200_HBM_GBS * COPY_EFFICIENCY

    def __post_init__(self) -> None:
        for f in ("bandwidth_gbs", "copy_gbs"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0 or not math.isfinite(v):
                raise ValueError(f"Link.{f} must be a finite number > 0, got {v!r}")
        if not isinstance(self.latency_ms, (int, float)) or isinstance(self.latency_ms, bool) or self.latency_ms < 0:
            raise ValueError(f"Link.latency_ms must be a number >= 0, got {self.latency_ms!r}")


NVLINK_H200_PEAK = Link("H200 NVLink 4, published 900 GB/s bidirectional (450 GB/s per direction), no latency",
                        H200_NVLINK_GBS_PER_DIRECTION, 0.0)


@dataclass(frozen=True)
class ExchangeBytes:
    """Bytes of one all-to-all as seen by the busiest rank.

    Attributes:
        link: bytes the rank sends to other ranks (= bytes it receives, up to the +-2 rows of the
            zigzag split): per direction over its link.
        copy: HBM bytes of the layout copies (read + write of the send buffer build and of the
            reorder after receive).
    """

    link: int
    copy: int


def _pos_int(name: str, v: object, lo: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    return v


def exchange_widths(cfg: MLAConfig, form: str) -> tuple[int, int]:
    """(q width, o width) per token per head of the exchange ``form`` ("absorbed" / "reduced")."""
    if form == "absorbed":
        return cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank
    if form == "reduced":
        return cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    raise ValueError(f"form must be one of {FORMS}, got {form!r}")


def exchange_bytes(width: int, heads: int, world_size: int, tokens: int, elem_bytes: int) -> ExchangeBytes:
    """Bytes of one all-to-all of a [T, H / W, width] head-sharded tensor <-> [T_r, H, width] rows.

    Args:
        width: elements per token per head (q width or o width; 1 with elem_bytes 4 for lse).
        heads: H, all ranks together (divisible by W).
        world_size: W.
        tokens: T real rows of the step (zigzag-split, ``zigzag_chunks``).
        elem_bytes: bytes per element (2 for bf16 / fp16).

    Returns:
        ``ExchangeBytes`` of the rank that sends the most: link = (T - T_r) * H / W * width * e
        (the rank keeps its own rows), copy = 4 * T * H / W * width * e (read + write of the whole
        send buffer, read + write of the whole receive buffer; the rank's own rows included, since
        the implementation copies them too).
    """
    for name, v, lo in (("width", width, 1), ("heads", heads, 1), ("world_size", world_size, 1),
                        ("tokens", tokens, 0), ("elem_bytes", elem_bytes, 1)):
        _pos_int(name, v, lo)
    if heads % world_size:
        raise ValueError(f"heads = {heads} is not divisible by world_size = {world_size}")
    per_row = heads // world_size * width * elem_bytes
    rows = [a[1] + b[1] for a, b in zigzag_chunks(tokens, world_size)]
    return ExchangeBytes(link=max(tokens - r for r in rows) * per_row if world_size > 1 else 0,
                         copy=4 * tokens * per_row if world_size > 1 else 0)


def exchange_ms(nbytes: ExchangeBytes, link: Link) -> float:
    """Time of one all-to-all and its layout copies: latency + link / bandwidth + copy / copy_gbs (ms)."""
    if nbytes.link == 0 and nbytes.copy == 0:
        return 0.0
    return link.latency_ms + nbytes.link / (link.bandwidth_gbs * 1e6) + nbytes.copy / (link.copy_gbs * 1e6)


@dataclass(frozen=True)
class Prediction:
    """Modelled times of one layer, ms; ``speedup`` = tp_ms / shardq_ms (> 1: ShardQ faster)."""

    tp_ms: float
    shardq_ms: float
    xchg_q_ms: float
    attn_ms: float
    xchg_out_ms: float
    chunks: int
    q_bytes: ExchangeBytes
    o_bytes: ExchangeBytes

    @property
    def speedup(self) -> float:
        return self.tp_ms / self.shardq_ms if self.shardq_ms > 0 else float("nan")

    @property
    def exchange_ms(self) -> float:
        return self.xchg_q_ms + self.xchg_out_ms


def _attn_max(name: str, attn: float | Sequence[float]) -> float:
    vals = [attn] if isinstance(attn, (int, float)) and not isinstance(attn, bool) else list(attn)
    if not vals or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 for v in vals):
        raise ValueError(f"{name} must be a time >= 0 ms or a non-empty list of them (one per rank), got {attn!r}")
    return float(max(vals))


def pipelined_ms(xq_ms: float, attn_ms: float, xo_ms: float, chunks: int, latency_ms: float = 0.0) -> float:
    """Step time when the step's rows run in ``chunks`` pieces, the link carrying chunk i + 1's q and
    chunk i - 1's o while chunk i's attention runs (module docstring): fill + steady + drain.

    ``xq_ms`` / ``xo_ms`` are the unchunked exchange times including one ``latency_ms`` each; each
    chunk pays the latency again. chunks = 1 gives ``xq + attn + xo``.
    """
    n = _pos_int("chunks", chunks)
    q_c = (xq_ms - latency_ms) / n + latency_ms if xq_ms > 0 else 0.0
    o_c = (xo_ms - latency_ms) / n + latency_ms if xo_ms > 0 else 0.0
    a_c = attn_ms / n
    return q_c + a_c + o_c + (n - 1) * max(a_c, q_c + o_c)


def shardq_step_ms(cfg: MLAConfig, world_size: int, tokens: int, *, tp_attn_ms: float | Sequence[float],
                   shardq_attn_ms: float | Sequence[float], link: Link, form: str = "absorbed", elem_bytes: int = 2,
                   return_lse: bool = False, chunks: int = 1) -> Prediction:
    """Modelled TP and ShardQ step times of one layer.

    Args:
        cfg: the model layout (heads, widths).
        world_size: W ranks (divides cfg.num_heads).
        tokens: T real rows of the step.
        tp_attn_ms: TP per-rank attention time(s), ms (H / W heads of all T rows); max taken.
        shardq_attn_ms: ShardQ per-rank attention time(s), ms (all H heads of the rank's T / W
            rows); max taken (a collective waits for the slowest rank).
        link: the interconnect (``Link``).
        form: "absorbed" (today's exchange) or "reduced" (``exchange_widths``).
        elem_bytes: bytes per q / o element (2: bf16).
        return_lse: the lse [T_r, H] fp32 travels back too (a third all-to-all).
        chunks: 1 = no overlap; n > 1 = chunked pipeline (``pipelined_ms``).

    Returns:
        ``Prediction``.
    """
    W = _pos_int("world_size", world_size)
    qw, ow = exchange_widths(cfg, form)
    qb = exchange_bytes(qw, cfg.num_heads, W, tokens, elem_bytes)
    ob = exchange_bytes(ow, cfg.num_heads, W, tokens, elem_bytes)
    xq, xo = exchange_ms(qb, link), exchange_ms(ob, link)
    if return_lse:
        lb = exchange_bytes(1, cfg.num_heads, W, tokens, 4)
        xo += exchange_ms(lb, link)
        ob = ExchangeBytes(ob.link + lb.link, ob.copy + lb.copy)
    tp = _attn_max("tp_attn_ms", tp_attn_ms)
    attn = _attn_max("shardq_attn_ms", shardq_attn_ms)
    total = pipelined_ms(xq, attn, xo, chunks, link.latency_ms)
    return Prediction(tp_ms=tp, shardq_ms=total, xchg_q_ms=xq, attn_ms=attn, xchg_out_ms=xo, chunks=chunks,
                      q_bytes=qb, o_bytes=ob)


def extra_weight_bytes(cfg: MLAConfig, world_size: int, elem_bytes: int = 2) -> int:
    """Extra memory per rank and per layer of the reduced exchange: the kv_b_proj rows of the other
    ranks' heads, (W - 1) / W of [H * (qk_nope + v_head_dim), kv_lora_rank]."""
    W = _pos_int("world_size", world_size)
    if cfg.num_heads % W:
        raise ValueError(f"num_heads = {cfg.num_heads} is not divisible by world_size = {W}")
    full = cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) * cfg.kv_lora_rank * elem_bytes
    return full // W * (W - 1)


# ---------------------------------------------------------------------------------------------
# Calibration against the committed 2-GPU run, and validation
# ---------------------------------------------------------------------------------------------


def _row_exchanges(row: dict) -> list[tuple[ExchangeBytes, float]]:
    """(bytes, measured ms) of a ShardQ row's two exchanges (absorbed form: what it measured)."""
    cfg = get_model(row["model"])
    W, T = row["tp"], row["tokens"]
    if (row["d_qk"], row["d_v"]) != exchange_widths(cfg, "absorbed"):
        raise ValueError(f"row of {row['model']}: d_qk / d_v {row['d_qk']} / {row['d_v']} are not the absorbed widths "
                         f"{exchange_widths(cfg, 'absorbed')}")
    e = 2  # bf16 on the GPU runs
    return [(exchange_bytes(row["d_qk"], row["heads"], W, T, e), row["xchg_q_ms"]),
            (exchange_bytes(row["d_v"], row["heads"], W, T, e), row["xchg_out_ms"])]


def fit_link(rows: list[dict], copy_gbs: float = H200_HBM_GBS * COPY_EFFICIENCY, name: str = "fitted") -> Link:
    """Least-squares fit of bandwidth and latency to the measured exchange times of ShardQ rows
    (``xchg_q_ms`` and ``xchg_out_ms``), the copy time at ``copy_gbs`` subtracted first.

    At a fixed W the link bytes and the copy bytes are proportional, so a 2-GPU run cannot separate
    the link bandwidth from the copy bandwidth: ``copy_gbs`` is an assumption (HBM peak x
    COPY_EFFICIENCY) and the fitted bandwidth absorbs its error.
    """
    xs, ys = [], []
    for r in rows:
        if r.get("path") != "shardq":
            continue
        for nb, ms in _row_exchanges(r):
            xs.append(nb.link / 1e6)  # MB -> ms at 1 GB/s = 1e6 B/ms
            ys.append(ms - nb.copy / (copy_gbs * 1e6))
    if len(xs) < 2:
        raise ValueError("fit_link needs at least one ShardQ row (two exchanges)")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx  # ms per MB = 1 / (GB/s)
    lat = max(0.0, my - slope * mx)
    return Link(name, 1.0 / slope, lat, copy_gbs)


def _rows(doc: dict) -> list[dict]:
    """A bench JSON's rows: ``rows`` (``sparse_mla.bench.common.write_json``), or ``results`` in the runs written before
    it and in this package's calibration data."""
    return doc["rows"] if "rows" in doc else doc["results"]


def best_tp_ms(results: list[dict]) -> dict[tuple[str, int, int], float]:
    """(model, W, T) -> the best TP variant's measured total_ms."""
    best: dict[tuple[str, int, int], float] = {}
    for r in results:
        if r["path"] == "tp":
            k = (r["model"], r["tp"], r["tokens"])
            best[k] = min(best.get(k, math.inf), r["total_ms"])
    return best


def validate(doc: dict, link: Link, rows_filter=None) -> list[dict]:
    """Model vs measurement for every ShardQ row of a ``run_shardq_bench`` JSON.

    Inputs taken from the measurement: the per-rank attention times of the ShardQ row itself
    (``per_rank_attn_ms``, measured inside the 2-GPU run) and the best TP variant's total (TP has
    no exchange, so its total is its per-rank attention time). Modelled: both exchanges, the
    ShardQ total and the speedup. Errors are (model - measured) / measured.
    """
    tp = best_tp_ms(_rows(doc))
    out = []
    for r in _rows(doc):
        if r["path"] != "shardq" or (rows_filter and not rows_filter(r)):
            continue
        cfg = get_model(r["model"])
        p = shardq_step_ms(cfg, r["tp"], r["tokens"], tp_attn_ms=tp[(r["model"], r["tp"], r["tokens"])],
                           shardq_attn_ms=r["per_rank_attn_ms"], link=link, form="absorbed")
        meas_x = r["xchg_q_ms"] + r["xchg_out_ms"]
        meas_speedup = tp[(r["model"], r["tp"], r["tokens"])] / r["total_ms"]
        out.append(dict(model=r["model"], tp=r["tp"], tokens=r["tokens"], variant=r["variant"],
                        measured_xchg_ms=meas_x, model_xchg_ms=p.exchange_ms, xchg_err=p.exchange_ms / meas_x - 1,
                        measured_total_ms=r["total_ms"], model_total_ms=p.shardq_ms,
                        total_err=p.shardq_ms / r["total_ms"] - 1, measured_speedup=meas_speedup,
                        model_speedup=p.speedup, speedup_err=p.speedup / meas_speedup - 1))
    return out


# ---------------------------------------------------------------------------------------------
# Projection to W = 4 / 8 on NVLink H200s
# ---------------------------------------------------------------------------------------------

# Single-GPU TP inputs available in the committed results (results/bench.json: one H200, rev
# 0a5b4ae, 16 heads per rank; the projection of docs/shardq.md used rev 52e9d42): glm-5 at W = 4, deepseek-v3.2 at W = 8.
PROJECTION_POINTS = (("glm-5", 4), ("deepseek-v3.2", 8))
# The TP baseline's paths: the absorbed (MQA) kernels, as in the 2-GPU run's tp/per_token and tp/grouped
# variants (ShardQ runs those kernels too; the layer's dense / masked MHA paths are left out on both sides).
TP_PATHS = ("mqa_per_token", "mqa_grouped")


def shardq_attn_rate(shardq_doc: dict, model: str) -> tuple[float, str]:
    """ms per query token of the ShardQ per-rank problem (all H heads), from the largest-T ShardQ
    per-token row of a 2-GPU run (max over ranks / rows of the rank): the per-query cost is flat once
    positions pass top-k, so the W-rank problem of T / W rows costs about rate * T / W."""
    rows = [r for r in _rows(shardq_doc) if r["model"] == model and r["variant"] == "shardq/per_token"]
    if not rows:
        raise ValueError(f"no shardq/per_token row of {model} in the ShardQ results")
    r = max(rows, key=lambda r: r["tokens"])
    per_rank = -(-r["tokens"] // r["tp"])
    src = (f"results/bench_shardq.json {model} W={r['tp']} T={r['tokens']} shardq/per_token attn_ms {r['attn_ms']:.2f} "
           f"over {per_rank} rows (rev {shardq_doc['meta'].get('git_revision', '?')[:7]})")
    return r["attn_ms"] / per_rank, src


def tp_attn_single_gpu(bench_doc: dict, model: str, world_size: int) -> dict[int, tuple[float, str]]:
    """T -> (best measured ms of ``TP_PATHS``, source) of the TP per-rank problem (H / W heads, all T
    rows, pure prefill) in a one-GPU ``sparse-mla bench`` JSON (results/bench.json)."""
    out = {}
    for r in _rows(bench_doc):
        if r["model"] == model and r["tp"] == world_size and r["cached"] == 0:
            mqa = {name: p["ms"] for name, p in r["paths"].items() if name in TP_PATHS and p.get("supported")
                   and p.get("check_ok") and "ms" in p}
            if not mqa:
                continue
            name = min(mqa, key=mqa.get)
            out[r["new"]] = (mqa[name], f"results/bench.json {r['scenario']} {name} (rev "
                                        f"{bench_doc['meta'].get('git_revision', '?')[:7]})")
    return out


def projection_table(shardq_doc: dict, bench_doc: dict, links: Sequence[Link], *, chunks: Sequence[int] = (1, 4),
                     forms: Sequence[str] = FORMS, min_tokens: int = 8192) -> list[dict]:
    """PROJECTED (not measured) ShardQ vs TP at W = 4 / 8 for the points of ``PROJECTION_POINTS``.

    TP per-rank attention: the best path measured on one H200 at H / W heads (results/bench.json).
    ShardQ per-rank attention: ``shardq_attn_rate`` (2-GPU run, all H heads) x ceil(T / W) rows.
    The two come from different revisions (see the ``*_source`` fields); the 2-GPU figures predate
    the Gluon attention, so the ShardQ side is, if anything, pessimistic.
    """
    rows = []
    for model, W in PROJECTION_POINTS:
        cfg = get_model(model)
        rate, rate_src = shardq_attn_rate(shardq_doc, model)
        for T, (tp_ms, tp_src) in sorted(tp_attn_single_gpu(bench_doc, model, W).items()):
            if T < min_tokens:
                continue
            sq_attn = rate * -(-T // W)
            for link in links:
                for form in forms:
                    for n in chunks:
                        p = shardq_step_ms(cfg, W, T, tp_attn_ms=tp_ms, shardq_attn_ms=sq_attn, link=link, form=form,
                                           chunks=n)
                        rows.append(dict(projection=True, model=model, tp=W, tokens=T, link=link.name, form=form,
                                         chunks=n, tp_ms=tp_ms, shardq_attn_ms=sq_attn, xchg_ms=p.exchange_ms,
                                         shardq_ms=p.shardq_ms, speedup=p.speedup, tp_source=tp_src,
                                         shardq_attn_source=rate_src))
    return rows


# The calibration the package ships (sparse_mla/distributed/data/, package data): ``calibration_docs`` of the
# committed results/bench_shardq.json and results/bench.json. tests/distributed/test_cost_model.py checks that they
# are equal; after a new run, write them again with ``python -m sparse_mla.distributed.cost_model --write-data``.
DATA_FILES = ("shardq_2xh200.json", "tp_1xh200.json")
# What the model reads of each file: the meta keys its source strings name, the ShardQ rows' fields (``validate``,
# ``fit_link``, ``shardq_attn_rate``), the one-GPU rows' fields and path timings (``tp_attn_single_gpu``).
META_KEYS = ("command", "git_revision", "gpu", "date")
SHARDQ_ROW_KEYS = ("model", "tp", "heads", "d_qk", "d_v", "tokens", "variant", "path", "interpreted", "total_ms",
                   "attn_ms", "xchg_q_ms", "xchg_out_ms", "per_rank_attn_ms")
TP_ROW_KEYS = ("scenario", "model", "tp", "cached", "new")
TP_PATH_KEYS = ("supported", "check_ok", "ms")


def calibration_docs(shardq_doc: dict, bench_doc: dict) -> tuple[dict, dict]:
    """The parts of a 2-GPU ``sparse-mla bench --tp 2`` JSON and a one-GPU ``sparse-mla bench`` JSON the model
    reads: every ShardQ-run row, and the one-GPU rows of ``PROJECTION_POINTS`` without a cached prefix (paths
    ``TP_PATHS`` only), each doc with its ``meta`` provenance (``META_KEYS``)."""
    def meta(doc):
        return {k: doc["meta"][k] for k in META_KEYS if k in doc["meta"]}

    sq_rows = [{k: r[k] for k in SHARDQ_ROW_KEYS if k in r} for r in _rows(shardq_doc)]
    tp_rows = [dict({k: r[k] for k in TP_ROW_KEYS},
                    paths={n: {k: p[k] for k in TP_PATH_KEYS if k in p} for n, p in r["paths"].items() if n in TP_PATHS})
               for r in _rows(bench_doc) if (r["model"], r["tp"]) in PROJECTION_POINTS and r["cached"] == 0]
    return {"meta": meta(shardq_doc), "results": sq_rows}, {"meta": meta(bench_doc), "results": tp_rows}


def default_docs() -> tuple[dict, dict]:
    """The shipped calibration (``DATA_FILES``: ``calibration_docs`` of the committed results/bench_shardq.json and
    results/bench.json), read as package data: the same from a source checkout and from an installed wheel."""
    data = resources.files(__package__).joinpath("data")
    return tuple(json.loads(data.joinpath(name).read_text()) for name in DATA_FILES)


def calibrated_links(shardq_doc: dict) -> tuple[Link, Link]:
    """(link fitted on the glm-5 rows only, link fitted on all rows) of a 2-GPU ShardQ run."""
    res = _rows(shardq_doc)
    held_in = fit_link([r for r in res if r["model"] == "glm-5"], name="2xH200 box, fitted on glm-5 rows")
    all_rows = fit_link(res, name="2xH200 box, fitted on all rows")
    return held_in, all_rows


def model_vs_measured(results: list[dict], link: Link | None = None) -> tuple[list[dict], str]:
    """Modelled figures beside the measured ones for the ShardQ rows of a ``run_shardq_bench`` run
    (``validate`` on its rows): the exchange modelled with ``link``, by default the link fitted on
    the committed results/bench_shardq.json (all rows), so that a new run tests the model rather
    than refitting it (the package's copy of it, ``default_docs``). Returns (rows, a line naming the link); no rows
    for an interpreter run or a model of unknown layout.
    """
    rows = [r for r in results if not r.get("interpreted")]
    if not rows:
        return [], "interpreter run: no modelled figures"
    if link is None:
        link = calibrated_links(default_docs()[0])[1]
    try:
        out = validate({"results": rows}, link)
    except (KeyError, ValueError) as e:
        return [], f"rows the model cannot take ({e})"
    return out, (f"link {link.name}: {link.bandwidth_gbs:.0f} GB/s per direction, latency {link.latency_ms:.3f} ms, "
                 f"copies at {link.copy_gbs:.0f} GB/s; attention times are the run's own")


def format_validation(rows: list[dict]) -> str:
    lines = [f"{'model':14} {'W':>2} {'T':>6} {'variant':17} {'xchg meas':>9} {'model':>7} {'err':>6} "
             f"{'total meas':>10} {'model':>7} {'err':>6} {'speedup meas':>12} {'model':>6}"]
    for r in rows:
        lines.append(f"{r['model']:14} {r['tp']:>2} {r['tokens']:>6} {r['variant']:17} {r['measured_xchg_ms']:9.2f} "
                     f"{r['model_xchg_ms']:7.2f} {r['xchg_err']:+6.1%} {r['measured_total_ms']:10.2f} "
                     f"{r['model_total_ms']:7.2f} {r['total_err']:+6.1%} {r['measured_speedup']:12.2f} "
                     f"{r['model_speedup']:6.2f}")
    return "\n".join(lines)


def format_projection(rows: list[dict]) -> str:
    lines = ["PROJECTION (modelled, not measured)",
             f"{'model':14} {'W':>2} {'T':>6} {'link':>12} {'form':9} {'chunks':>6} {'TP ms':>7} {'SQ attn':>7} "
             f"{'xchg':>6} {'SQ ms':>7} {'speedup':>7}"]
    for r in rows:
        lines.append(f"{r['model']:14} {r['tp']:>2} {r['tokens']:>6} {r['link'][:12]:>12} {r['form']:9} "
                     f"{r['chunks']:>6} {r['tp_ms']:7.2f} {r['shardq_attn_ms']:7.2f} {r['xchg_ms']:6.2f} "
                     f"{r['shardq_ms']:7.2f} {r['speedup']:6.2f}x")
    return "\n".join(lines)


def write_data(results_dir: str = "results") -> None:
    """Write the package's calibration (``DATA_FILES``) from the committed runs under ``results_dir`` (a source
    checkout)."""
    with open(f"{results_dir}/bench_shardq.json") as f, open(f"{results_dir}/bench.json") as g:
        docs = calibration_docs(json.load(f), json.load(g))
    here = resources.files(__package__).joinpath("data")
    for name, doc in zip(DATA_FILES, docs):
        with open(str(here.joinpath(name)), "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")


def main() -> None:  # pragma: no cover - printing only
    import sys

    if sys.argv[1:] == ["--write-data"]:
        write_data()
        return
    sq, bench = default_docs()
    fit_glm, fit_all = calibrated_links(sq)
    for link, note in ((fit_glm, "deepseek-v3.2 rows held out"), (fit_all, "all rows")):
        print(f"\nValidation, link {link.name}: {link.bandwidth_gbs:.0f} GB/s per direction, latency "
              f"{link.latency_ms:.3f} ms, copies at {link.copy_gbs:.0f} GB/s (assumed) ({note})")
        print(format_validation(validate(sq, link)))
    peak = replace(NVLINK_H200_PEAK, name="NVLink peak")
    fitted = replace(fit_all, name="2xH200 fit")
    print()
    print(format_projection(projection_table(sq, bench, (fitted, peak))))
    for model, W in PROJECTION_POINTS:
        cfg = get_model(model)
        mb = extra_weight_bytes(cfg, W) / 2**20
        layers = NUM_LAYERS.get(model)
        tail = f", x {layers} layers = {mb * layers / 1024:.2f} GiB" if layers else ""
        print(f"reduced exchange, {model} W={W}: extra kv_b_proj memory per rank {mb:.1f} MiB per layer (bf16){tail}")


if __name__ == "__main__":  # pragma: no cover
    main()


__all__ = ["Link", "ExchangeBytes", "Prediction", "FORMS", "NVLINK_H200_PEAK", "exchange_widths", "exchange_bytes",
           "exchange_ms", "pipelined_ms", "shardq_step_ms", "extra_weight_bytes", "fit_link", "validate",
           "projection_table", "calibrated_links", "calibration_docs", "default_docs", "model_vs_measured"]
