"""Op-level decode benchmark: FlashMLA's sparse decode call, this package's drop-in
(``sparse_mla.flash_mla_with_kvcache``) beside FlashMLA's own kernel, on the same paged cache. A suite of
``sparse_mla.bench.op`` (``--suite decode``; ``sparse-mla bench --op-suite decode``), its rows in the op JSON.

Per case (``DecodeCase``: b requests of s_q query tokens at h_q heads, each request's ``cached`` rows in its own
region of one paged cache of ``page`` rows per block, the blocks scattered by a seeded permutation; the cache in q's
dtype or FP8 ``fp8_ds_mla``; "mid" top-``topk`` lists of physical rows; no attn_sink, no topk_length) one set of
inputs (``decode_inputs``), and the calls (``decode_calls``):

* ``drop_in``: ``flash_mla_with_kvcache`` as an engine calls it (kv_splits=None: S from the shape); the row records
  that S and why (``kv_splits_auto``, ``kv_splits_reason``: ``sparse_mla.mqa.interface.explain_fwd``);
* ``split<S>``: the same call with ``kv_splits=S`` forced, S in ``case.kv_splits`` (what
  ``sparse_mla.mqa.kv_splits.KV_SPLIT_MODEL`` is fitted on); ``best_split``: the fastest that passed its check (by
  device time where measured);
* ``flashmla``: FlashMLA's sparse decode where it runs (``baselines.flash_mla_decode``: the ``flash_mla`` package, or
  the ``flashmla_sm90`` / ``flashmla_sm90_decode`` extension of benchmarks/flashmla/build.py): FP8 cache, bf16 q on
  Hopper, q zero-padded to 64 heads below 64 (as engines do; the padded q is built once, outside the timed call);
  ``baseline`` says which ran, or why none.

Each call's first run (this package's calls: into NaN-poisoned outputs) is checked against
``flash_mla_with_kvcache_ref`` on up to ``CHECK_REQUESTS`` sampled requests (``max_row_err``: max over their
(token, head) rows, ``common.max_row_err``; ``lse_err``: max |lse - ref|), then timed as the op bench times
(``sparse_mla.bench.timing``); ``vs_flashmla`` is the baseline's time over a call's. On a GPU each call is also
captured in a CUDA graph and replayed, as engines run decode steps (``graph_ms``: the device time, without the host
path that dominates a small call's ``ms``; the replay's output checked too: ``graph_err``, ``graph_ok``;
``graph_vs_flashmla``).
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import asdict, dataclass

import torch

from .baselines import PAD_HEADS, flash_mla_decode, flash_mla_decode_kind
from .common import REP_MS, floor_ms, max_row_err, read_json, tflops
from .timing import graph_figures, host_time_us, time_trials

SPLITS = (1, 2, 4, 8, 16)  # the forced split counts timed beside the automatic one
CHECK_REQUESTS = 8  # requests sampled for the check
ROW_TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3}  # per (request, token, head) row: |out - ref| / |ref|
LSE_TOL = 2e-3  # max |lse - ref| (natural log; both fp32 sums of the same products)
D_V = 512
API = "flash_mla_with_kvcache"  # every row's ``api`` (op_tables.DECODE_API)


@dataclass(frozen=True)
class DecodeCase:
    """One decode point: ``b`` requests of ``s_q`` query tokens (MTP: token t sees the rows before it and itself),
    ``h_q`` heads, each request over ``cached`` rows (a whole number of ``page``-row blocks), FP8 cache or not."""

    b: int
    s_q: int
    h_q: int
    fp8: bool = False
    cached: int = 32768
    page: int = 64
    topk: int = 2048
    lists: str = "mid"
    kv_splits: tuple[int, ...] = SPLITS
    d_qk: int = 576
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.b, self.s_q, self.h_q, self.page, self.topk) < 1:
            raise ValueError(f"b, s_q, h_q, page, topk must be >= 1, got {self}")
        if self.cached % self.page or self.cached <= self.s_q:
            raise ValueError(f"cached must be a multiple of page ({self.page}) and exceed s_q, got {self.cached}")

    @property
    def name(self) -> str:
        return f"b{self.b}x{self.s_q}/H{self.h_q}/{self.cached}/k{self.topk}" + ("/fp8" if self.fp8 else "")


def decode_cases(batches=(1, 2, 8, 32, 64, 128), s_qs=(1, 2), heads=(16, 64, 128), cached: int = 32768, page: int = 64,
                 topk: int = 2048, splits: tuple[int, ...] = SPLITS) -> list[DecodeCase]:
    """The decode suite (defaults: the H200's), the cache in q's dtype then FP8 at each point; smaller sizes for
    the interpreter (``cpu_decode_cases``)."""
    return [DecodeCase(b, s, h, fp8, cached, page, topk, kv_splits=tuple(splits))
            for b in batches for s in s_qs for h in heads for fp8 in (False, True)]


def cpu_decode_cases() -> list[DecodeCase]:
    """The decode suite at interpreter sizes (2 requests of 1 / 2 tokens over 48 rows, 4 heads, top-16)."""
    return decode_cases(batches=(2,), heads=(4,), cached=48, page=16, topk=16, splits=(1, 2, 4))


_MEMO: dict = {}  # the last lists and cache, reused while only the heads / the cache format change


def _memo(key: tuple, make):
    if key not in _MEMO:
        for k in [k for k in _MEMO if k[0] == key[0]]:
            del _MEMO[k]  # one of each kind at a time (the caches of 128 requests hold GBs)
        _MEMO[key] = make()
    return _MEMO[key]


def _lists(case: DecodeCase, device) -> torch.Tensor:
    """indices [b, s_q, topk] int32: each request's synthetic lists over its own region, as physical rows of the
    paged cache (logical block j of the cache stored at block perm[j])."""
    from ..workloads.topk import synthetic_batch

    batch = synthetic_batch([case.cached - case.s_q] * case.b, [case.s_q] * case.b, case.topk, case.lists,
                            seed=case.seed, device=device)
    idx = batch.indices.long()
    gen = torch.Generator(device=device)
    gen.manual_seed(case.seed + 7)
    perm = torch.randperm(case.b * case.cached // case.page, generator=gen, device=device)
    phys = perm[idx.clamp_min(0) // case.page] * case.page + idx.clamp_min(0) % case.page
    return torch.where(idx >= 0, phys, -1).to(torch.int32).view(case.b, case.s_q, case.topk)


def _rows(case: DecodeCase, device, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator(device=device)
    gen.manual_seed(case.seed + 3)
    return torch.randn(case.b * case.cached, case.d_qk, generator=gen, device=device).to(dtype)


def decode_inputs(case: DecodeCase, device, dtype: torch.dtype) -> dict:
    """q [b, s_q, h_q, d], k_cache [num_blocks, page, 1, row] (q's dtype, or the FP8 bytes of the same rows),
    indices [b, s_q, topk] int32 physical rows, sm_scale, T = b s_q query rows, N cache rows."""
    from ..kv_format import FP8_DS_MLA

    dev = str(device)
    idx = _memo(("lists", case.b, case.s_q, case.cached, case.page, case.topk, case.lists, case.seed, dev),
                lambda: _lists(case, device))
    rows_key = ("rows", case.b * case.cached, case.d_qk, case.seed, str(dtype), dev)
    rows = _memo(rows_key, lambda: _rows(case, device, dtype))
    if case.fp8:
        rows = _memo(("fp8", *rows_key[1:]), lambda: FP8_DS_MLA.quantize(rows))
    gen = torch.Generator(device=device)
    gen.manual_seed(case.seed)
    q = torch.randn(case.b, case.s_q, case.h_q, case.d_qk, generator=gen, device=device).to(dtype)
    k_cache = rows.view(case.b * case.cached // case.page, case.page, 1, rows.shape[-1])
    return dict(q=q, k_cache=k_cache, indices=idx, sm_scale=case.d_qk ** -0.5, T=case.b * case.s_q,
                N=case.b * case.cached)


@contextlib.contextmanager
def poisoned_outputs():
    """Every output ``flash_mla_with_kvcache`` allocates inside starts NaN (an element it forgets to write fails the
    check)."""
    from ..mqa import flashmla_decode

    made = flashmla_decode._empty
    flashmla_decode._empty = lambda shape, dtype, device: torch.full(shape, math.nan, dtype=dtype, device=device)
    try:
        yield
    finally:
        flashmla_decode._empty = made


def decode_calls(case: DecodeCase, inp: dict) -> tuple[dict, str]:
    """(name -> zero-argument callable returning (out [b, s_q, h_q, 512], lse [b, h_q, s_q]), the baseline: the kind
    of FlashMLA's decode that runs, "pad64" appended where q is padded, or "none: <why>" (``flash_mla_decode_kind``))."""
    from .. import flash_mla_with_kvcache, get_mla_metadata

    q, kc, idx, scale = inp["q"], inp["k_cache"], inp["indices"], inp["sm_scale"]

    def drop_in(splits: int | None):
        meta, _ = get_mla_metadata()
        return lambda: flash_mla_with_kvcache(q, kc, None, None, D_V, meta, None, scale, False, case.fp8, idx, None,
                                              None, None, None, None, kv_splits=splits)

    calls = {"drop_in": drop_in(None), **{f"split{s}": drop_in(s) for s in case.kv_splits}}
    kind, why = flash_mla_decode_kind(q.device, q.dtype, case.fp8, case.d_qk, case.topk)
    if kind is None:
        return calls, f"none: {why}"
    H = case.h_q
    heads = PAD_HEADS if H <= PAD_HEADS else 128  # FlashMLA's SM90 decode takes 64 or 128 heads
    qp = q
    if heads != H:
        qp = torch.zeros(case.b, case.s_q, heads, case.d_qk, dtype=q.dtype, device=q.device)
        qp[:, :, :H] = q
    fm = flash_mla_decode(qp, kc, idx, scale)

    def flashmla():
        out, lse = fm()
        return out[:, :, :H], lse[:, :H]

    calls["flashmla"] = flashmla
    return calls, kind if heads == H else f"{kind} pad{heads}"


def reference(case: DecodeCase, inp: dict, sample: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``flash_mla_with_kvcache_ref`` of the sampled requests: (out [b', s_q, h_q, 512], lse [b', h_q, s_q]) fp32."""
    from .. import flash_mla_with_kvcache_ref

    return flash_mla_with_kvcache_ref(inp["q"][sample], inp["k_cache"], None, None, D_V, None, None, inp["sm_scale"],
                                      False, case.fp8, inp["indices"][sample].contiguous())


def check_decode(out: torch.Tensor, lse: torch.Tensor, ref: tuple[torch.Tensor, torch.Tensor],
                 sample: torch.Tensor) -> tuple[float, float]:
    """(``common.max_row_err`` over the sampled requests' rows, max |lse - ref|; both inf where out is non-finite,
    the lse's where an infinite lse differs)."""
    row = max_row_err(out[sample], ref[0])
    if row == math.inf:
        return math.inf, math.inf
    l, rl = lse[sample].float(), ref[1]
    d = torch.where(torch.isfinite(rl), (l - rl).abs(), torch.where(l == rl, 0.0, math.inf))
    d = torch.where(torch.isnan(d), math.inf, d)
    return row, float(d.max()) if d.numel() else 0.0


def auto_splits(explain: str) -> tuple[int | None, str]:
    """(S, reason) from ``explain_fwd``'s "kv splits: S (reason)" line; (None, the text) when it has none."""
    m = re.search(r"^kv splits: (\d+) \((.*)\)$", explain, flags=re.M)
    return (int(m.group(1)), m.group(2)) if m else (None, explain)


def split_times(row: dict) -> dict[int, float]:
    """{S: ms} of the row's forced-split calls (``split<S>``) that passed their check: the CUDA-graph replays' times
    (the device time) where every one of them has a replay that passed, else the times per call."""
    ok = {int(n[5:]): rec for n, rec in row["calls"].items()
          if n.startswith("split") and n[5:].isdigit() and rec.get("ok") and rec.get("ms") is not None}
    key = "graph_ms" if ok and all(rec.get("graph_ok") for rec in ok.values()) else "ms"
    return {s: rec[key] for s, rec in ok.items()}


def best_split(row: dict) -> int | None:
    """The fastest forced S of the row (``split_times``); None when no forced split passed its check."""
    times = split_times(row)
    return min(times, key=times.get) if times else None


def kv_split_points(rows: list[dict]) -> list[dict]:
    """The points ``sparse_mla.mqa.kv_splits.fit_kv_split_model`` takes, of op JSON rows (few-token and decode) whose
    forced splits ran per token (``explain_fwd``'s method line) with S = 1 among them: num_lists = the query rows,
    pseudo_heads = the heads, rows_per_list = topk, times = ``split_times``; the others are left out."""
    points = []
    for r in rows:
        times = split_times(r) if "calls" in r else {}
        if 1 in times and str(r.get("explain_fwd", "")).startswith("method: per_token"):
            points.append({"case": r["case"], "num_lists": r["tokens"], "pseudo_heads": r.get("h_q", r.get("heads")),
                           "rows_per_list": r["topk"], "times": times})
    return points


def fit(paths: list[str], sms: int) -> str:
    """``fit_kv_split_model`` on the ``kv_split_points`` of op JSONs, as a line of text."""
    from ..mqa.kv_splits import fit_kv_split_model

    points = []
    for path in paths:
        points += kv_split_points(read_json(path)[2])
    model, loss = fit_kv_split_model(points, sms)
    return (f"{len(points)} points of {', '.join(paths)} on {sms} SMs: {model} (mean time of its choice / the best "
            f"measured S: {loss:.3f})")


def _explain(case: DecodeCase, inp: dict) -> str:
    """``explain_fwd`` of the call the drop-in makes: the b s_q query rows over the cache's rows, per token unless a
    request's s_q rows fill a group (``flashmla_decode.flash_mla_with_kvcache``'s rule)."""
    from ..mqa.interface import explain_fwd
    from ..union.grouping import default_group_size

    T, q = inp["T"], inp["q"]
    kc = inp["k_cache"]
    cu = torch.arange(0, (case.b + 1) * case.s_q, case.s_q, dtype=torch.int32, device=q.device)
    method = "per_token" if case.s_q < default_group_size(case.h_q) else "auto"
    return explain_fwd(q.reshape(T, case.h_q, case.d_qk), kc.reshape(-1, kc.shape[-1]), inp["indices"].view(T, -1),
                       inp["sm_scale"], method=method, kv_format="fp8_ds_mla" if case.fp8 else None, cu_seqlens_q=cu)


def _floor_ms(case: DecodeCase, inp: dict) -> tuple[float, float]:
    """(useful FLOPs 2 h_q sum(valid) (d + 512), floor ms: ``common.floor_ms`` of those FLOPs and the distinct rows'
    bytes plus q and out)."""
    idx = inp["indices"]
    valid = idx >= 0
    flops = 2.0 * case.h_q * float(valid.sum()) * (case.d_qk + D_V)
    row_bytes = inp["k_cache"].shape[-1] * inp["k_cache"].element_size()
    distinct = int(torch.unique(idx[valid]).numel()) if valid.any() else 0
    io = distinct * row_bytes + inp["T"] * case.h_q * (case.d_qk + D_V) * inp["q"].element_size()
    return flops, floor_ms(flops, io)


def run_decode_case(case: DecodeCase, *, trials: int = 1, host: bool = False, device: str = "cuda",
                    dtype: torch.dtype = torch.bfloat16, rep_ms: int = REP_MS, graph: bool | None = None) -> dict:
    """Inputs, checks, timings of one decode case; returns its JSON row (``case`` and ``calls`` as the op bench's,
    ``api`` = "flash_mla_with_kvcache"). On a GPU unless ``graph`` is False, each call is also captured in a CUDA graph and
    replayed, as engines run decode steps (``timing.graph_figures``: ``graph_ms``, the device time without the host
    path, and ``graph_err`` / ``graph_ok`` of the replay's output; ``graph_vs_flashmla``)."""
    on_gpu = torch.device(device).type == "cuda"
    inp = decode_inputs(case, device, dtype)
    sample = torch.linspace(0, case.b - 1, min(CHECK_REQUESTS, case.b), device=device).round().long().unique()
    ref = reference(case, inp, sample)
    flops, floor = _floor_ms(case, inp)
    explain = _explain(case, inp)
    S, why = auto_splits(explain)
    fns, kind = decode_calls(case, inp)
    row = {"case": case.name, "api": API, **asdict(case), "tokens": inp["T"], "kv_rows": inp["N"],
           "useful_tflop": flops / 1e12, "floor_ms": floor, "baseline": kind, "kv_splits_auto": S,
           "kv_splits_reason": why, "explain_fwd": explain, "calls": {}}
    for name, fn in fns.items():
        rec: dict = {}
        try:
            with poisoned_outputs() if name != "flashmla" else contextlib.nullcontext():
                out, lse = fn()
            rec["max_row_err"], rec["lse_err"] = check_decode(out, lse, ref, sample)
            rec["ok"] = rec["max_row_err"] <= ROW_TOL[dtype] and rec["lse_err"] <= LSE_TOL
            t = time_trials(fn, on_gpu=on_gpu, trials=trials, rep_ms=rep_ms)
            rec.update(ms=t["ms"], p20_ms=t["p20_ms"], p80_ms=t["p80_ms"], trials_ms=t["trials_ms"])
            rec["tflops"] = tflops(flops, t["ms"])
            if host and on_gpu:
                rec["host_us"] = host_time_us(fn)
            if graph is not False and on_gpu:
                rec.update(graph_figures(fn, lambda o: check_decode(*o, ref, sample)[0], ROW_TOL[dtype], trials=trials,
                                         rep_ms=rep_ms))
        except Exception as exc:  # recorded, not hidden: a failing call is a row with its error
            rec["error"] = f"{type(exc).__name__}: {exc}"
        row["calls"][name] = rec
    base = row["calls"].get("flashmla", {})
    for rec in row["calls"].values():
        for key, ms in (("vs_flashmla", "ms"), ("graph_vs_flashmla", "graph_ms")):
            if base.get(ms) and rec.get(ms):
                rec[key] = base[ms] / rec[ms]
    row["best_split"] = best_split(row)
    return row


SUITES = {"decode": decode_cases}
CPU_SUITES = {"decode": cpu_decode_cases}

__all__ = ["DecodeCase", "SPLITS", "decode_cases", "cpu_decode_cases", "decode_inputs", "decode_calls",
           "run_decode_case", "check_decode", "auto_splits", "split_times", "best_split", "kv_split_points", "fit",
           "poisoned_outputs", "SUITES", "CPU_SUITES"]


if __name__ == "__main__":  # a library of the op bench, not a command
    import sys

    print("sparse_mla.bench.op_decode holds the decode cases of the op bench: run `python -m sparse_mla.bench.op --suite "
          "decode` (GPU) or `sparse-mla bench --op-suite decode` (CPU)", file=sys.stderr)
    raise SystemExit(2)
