"""Op-level benchmark: the attention calls an engine makes, side by side on the same tensors.

Per case (``OpCase``: heads H, lists, cached + new tokens, topk, d_qk, features) one set of inputs is drawn
(``case_inputs``) and every call below runs on it, is checked against the fp32 reference per (token, head) row on
sampled tokens, then timed (``sparse_mla.bench.timing``: do_bench medians, L2 flushed):

* ``per_token`` / ``grouped``: ``sparse_mla_fwd(method=...)`` with a preallocated workspace and outputs;
* ``auto``: the default ``sparse_mla_fwd`` call (no workspace: the package's cached one), into a preallocated ``out=``;
* ``drop_in``: ``sparse_mla.flash_mla_sparse_fwd``, FlashMLA's call (no cu_seqlens_q);
* ``flashmla``: FlashMLA's SM90 sparse prefill (``benchmarks/flashmla/build.py``; module ``flashmla_sm90`` or a
  ``flash_mla`` package) on q zero-padded to 64 heads when H < 64 (what Hopper engines run), on q itself at 64 /
  128 heads; where FlashMLA is not importable, ``pad64_sparse_mla``: this package's per-token call on the padded q,
  labelled so (``baseline_kind``). The padded q is built once, outside the timed call;
* ``split<S>`` (cases with ``kv_splits``, the few-token suite): the ``auto`` call with ``kv_splits=S`` forced, each
  into its own poisoned output; the row records the automatic S and why (``kv_splits_auto``, ``kv_splits_reason``:
  ``sparse_mla.mqa.interface.explain_fwd``) and the fastest forced S that passed its check (``best_split``): the data
  ``sparse_mla.mqa.kv_splits.KV_SPLIT_MODEL`` is fitted on. In such cases every call is also captured in a CUDA graph
  and replayed on a GPU (``graph_ms``: the device time without the host path; the replay's output checked:
  ``graph_err``, ``graph_ok``; ``graph_vs_flashmla``).

Suites (``SUITES``; ``sparse-mla bench --op-suite NAME`` runs them too): the prefill-shaped ones here, "few-token"
(1-256 new tokens over 32K / 128K cached rows, and 64 requests x 2 tokens), and "decode" (FlashMLA's decode call,
``sparse_mla.bench.op_decode``, whose rows carry ``api`` = "flash_mla_with_kvcache"). ``CPU_SUITES``: the few-token
and decode suites at interpreter sizes. Tables: ``sparse_mla.bench.op_tables`` (re-exported here).

Lists (``OpCase.lists``): "uniform" = the per-token protocol (query i takes ``topk`` distinct uniform rows of
[0, cached + i]); an overlap preset of ``sparse_mla.workloads.topk`` ("high", "mid", "low", "none", "random");
"v4:<preset>" = DeepSeek-V4.x lists (``sparse_mla.workloads.windowed``: top-``topk`` compressed rows + a 128-token
window per query, ``topk_length`` given).

Figures per call: ``ms`` (median), ``tflops`` (useful FLOPs 2 H sum(valid) (d_qk + 512) over the time),
``floor_ms`` (of the path the call ran, ``common.floor_ms`` at the H200's peaks: per token the useful FLOPs against
the bytes moved; grouped the same over the union rows at 128 pseudo-heads), ``max_row_err`` (``common.max_row_err``
over sampled (token, head) rows), ``vs_flashmla`` (the baseline's time over this call's), with ``host=True`` ``host_us`` (CPU
time per call of back-to-back calls, the GPU kept busy); the JSON's meta holds ``replay_status()``.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass

import torch

from . import op_decode
from .baselines import PAD_HEADS, flash_mla_fwd, flash_mla_takes
from .common import REP_MS, SMS, floor_ms, max_row_err, run_meta, tflops, timing_note, write_json
from .op_tables import CAPTION, COMPACT_COLUMNS, WIDE_COLUMNS, format_rows, markdown_rows, row_cells, tables  # noqa: F401
from .timing import graph_figures, host_time_us

CALLS = ("per_token", "grouped", "auto", "drop_in", "flashmla")
CHECK_TOKENS = 96  # tokens sampled for the per-row check
ROW_TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3}  # per (token, head) row: |out - ref| / |ref|


@dataclass(frozen=True)
class OpCase:
    """One op-level point. ``requests`` > 1 splits the new tokens into that many equal requests, each over its own
    ``cached`` prefix (cu_seqlens_q given when ``cu_seqlens``)."""

    heads: int
    lists: str = "mid"
    cached: int = 16384
    new: int = 8192
    topk: int = 2048
    d_qk: int = 576
    cu_seqlens: bool = False
    requests: int = 1
    sink: bool = False
    topk_length: bool = False
    seed: int = 0
    batch: tuple[tuple[int, int], ...] | None = None  # per-request (cached, new): overrides cached / new / requests
    kv_fp8: bool = False  # the cache as fp8_ds_mla rows (the bf16 cache's rows quantized; d_qk 576)
    kv_splits: tuple[int, ...] = ()  # forced split counts timed beside the automatic one (calls split<S>)

    def requests_lens(self) -> tuple[list[int], list[int]]:
        """Per-request cached and new token counts."""
        if self.batch is not None:
            return [c for c, _ in self.batch], [n for _, n in self.batch]
        per = [self.new // self.requests + (1 if b < self.new % self.requests else 0) for b in range(self.requests)]
        return [self.cached] * self.requests, per

    @property
    def name(self) -> str:
        if self.batch is not None:
            shape = f"mixed{len(self.batch)}x{sum(n for _, n in self.batch)}"
        else:
            shape = f"{self.cached}+{self.new}" if self.cached else f"{self.new}"
        bits = [f"H{self.heads}", self.lists, shape, f"k{self.topk}"]
        if self.d_qk != 576:
            bits.append(f"d{self.d_qk}")
        if self.requests > 1 and self.batch is None:
            bits.append(f"B{self.requests}")
        if self.cu_seqlens:
            bits.append("cu")
        if self.sink:
            bits.append("sink")
        if self.topk_length:
            bits.append("len")
        if self.kv_fp8:
            bits.append("fp8")
        return "/".join(bits)


def _uniform_lists(cached: int, new: int, topk: int, device, gen: torch.Generator) -> torch.Tensor:
    """Query i takes ``topk`` distinct uniform rows of [0, cached + i] (fewer, then -1, while that range is short)."""
    n = cached + new
    out = torch.empty(new, topk, dtype=torch.int32, device=device)
    step = max(1, (1 << 27) // max(n, 1))
    for t0 in range(0, new, step):
        t1 = min(new, t0 + step)
        keys = torch.rand(t1 - t0, n, device=device, generator=gen)
        limit = cached + torch.arange(t0, t1, device=device)[:, None]
        keys = torch.where(torch.arange(n, device=device)[None, :] <= limit, keys, -1.0)
        val, idx = keys.topk(min(topk, n), dim=1)
        idx = torch.where(val >= 0, idx, -1).to(torch.int32)
        out[t0:t1, : idx.shape[1]] = idx
        out[t0:t1, idx.shape[1]:] = -1
    return out


_LISTS: dict = {}  # the last case's lists, reused while only the heads change (a sweep's inner loop)


def _case_lists(case: OpCase, device) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """(indices [T, K'] int32, N, topk_length or None) of ``case``, drawn once per list-defining fields."""
    key = (case.lists, tuple(map(tuple, case.requests_lens())), case.topk, case.topk_length, case.seed, str(device))
    if key not in _LISTS:
        _LISTS.clear()
        _LISTS[key] = _draw_lists(case, device)
    return _LISTS[key]


def _draw_lists(case: OpCase, device) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    from ..workloads.topk import synthetic_batch
    from ..workloads.windowed import window_topk_lists

    gen = torch.Generator(device=device)
    gen.manual_seed(case.seed + 1)
    cached, per = case.requests_lens()
    topk_length = None
    if case.lists == "uniform":
        parts, off = [], 0
        for c, n in zip(cached, per):
            idx = _uniform_lists(c, n, case.topk, device, gen)
            parts.append(torch.where(idx >= 0, idx + off, -1))
            off += c + n
        indices, N = torch.cat(parts), off
    elif case.lists.startswith("v4:"):
        parts, lens, off = [], [], 0
        for b, (c, n) in enumerate(zip(cached, per)):
            idx, ln, rows = window_topk_lists(c, n, case.topk, 128, case.lists[3:], seed=case.seed + b, device=device)
            parts.append(torch.where(idx >= 0, idx + off, -1))
            lens.append(ln)
            off += rows
        indices, N, topk_length = torch.cat(parts), off, torch.cat(lens)
    else:
        batch = synthetic_batch(cached, per, case.topk, case.lists, seed=case.seed, device=device)
        indices, N = batch.indices, batch.num_kv_rows
        if case.topk_length:
            topk_length = batch.valid
    if case.topk_length and topk_length is None:
        topk_length = (indices >= 0).sum(1).to(torch.int32)
    return indices, N, topk_length


def case_inputs(case: OpCase, device, dtype: torch.dtype) -> dict:
    """q [T, H, d_qk], kv [N, d_qk], indices [T, K'] int32, topk_length, attn_sink, cu_seqlens_q, sm_scale, T, N."""
    _, per = case.requests_lens()
    indices, N, topk_length = _case_lists(case, device)
    gen = torch.Generator(device=device)
    gen.manual_seed(case.seed)
    T = indices.shape[0]
    q = torch.randn(T, case.heads, case.d_qk, device=device, generator=gen).to(dtype)
    kv = torch.randn(N, case.d_qk, device=device, generator=gen).to(dtype)
    kv_fp8 = None
    if case.kv_fp8:
        from ..kv_format import FP8_DS_MLA

        kv_fp8 = FP8_DS_MLA.quantize(kv)
        kv = FP8_DS_MLA.dequantize(kv_fp8, dtype)  # the reference and bf16_auto read the dequantized cache
    sink = torch.randn(case.heads, device=device, generator=gen) if case.sink else None
    cu = None
    if case.cu_seqlens:
        cu = torch.tensor([0, *torch.tensor(per).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return dict(q=q, kv=kv, indices=indices, topk_length=topk_length, attn_sink=sink, cu_seqlens_q=cu,
                sm_scale=case.d_qk ** -0.5, T=T, N=N, kv_fp8=kv_fp8)


def baseline_kind(device, topk: int | None = None, dtype: torch.dtype = torch.bfloat16) -> str:
    """"flashmla" (FlashMLA runs the call here: ``baselines.flash_mla_takes``) or "pad64_sparse_mla" (this package's
    per-token call on the same padded q)."""
    return "flashmla" if flash_mla_takes(device, topk, dtype) else "pad64_sparse_mla"


def useful_flops(inp: dict, heads: int, d_qk: int) -> float:
    """2 H sum over queries of the valid rows (d_qk + 512)."""
    return 2.0 * heads * float(_valid_rows(inp).sum()) * (d_qk + 512)


def _valid_rows(inp: dict) -> torch.Tensor:
    idx = inp["indices"]
    v = (idx >= 0) & (idx < inp["N"])
    if inp["topk_length"] is not None:
        v &= torch.arange(idx.shape[1], device=idx.device)[None, :] < inp["topk_length"][:, None].long()
    return v.sum(1)


def floors(inp: dict, heads: int, d_qk: int, union_rows: int | None) -> dict:
    """Floors (ms, ``common.floor_ms``) of the per-token and the grouped path: the FLOPs each computes against the
    bytes it must move (every distinct row it reads once, q, and out). Per token the FLOPs are the useful ones;
    grouped, 128 pseudo-heads over every union row. Also ``gather_no_reuse``: each query's rows gathered from HBM
    with no L2 reuse (informational: a 32K-row cache fits in the H200's L2, so kernels beat it)."""
    idx = inp["indices"]
    rows = float(_valid_rows(inp).sum())
    valid = (idx >= 0) & (idx < inp["N"])
    distinct = int(torch.unique(idx[valid]).numel()) if valid.any() else 0
    T, H = inp["q"].shape[0], heads
    io = distinct * d_qk * (1 if inp.get("kv_fp8") is not None else 2) + T * H * (d_qk + 512) * 2
    out = {"per_token": floor_ms(useful_flops(inp, heads, d_qk), io), "gather_no_reuse": floor_ms(0, rows * d_qk * 2)}
    if union_rows is not None:
        out["grouped"] = floor_ms(2.0 * 128 * union_rows * (d_qk + 512), io)
    return out


def union_figures(inp: dict, heads: int) -> dict:
    """Union ratio (union rows / mean valid rows per query, over groups of 128 // H token-major queries)."""
    from .. import build_group_union, default_group_size

    G = default_group_size(heads)
    if G < 2:
        return {"group_size": G, "union_rows": None, "union_ratio": None}
    u = build_group_union(inp["indices"], G, topk_length=inp["topk_length"], num_kv_rows=inp["N"])
    rows = int(u.lengths.sum())
    per_q = float(_valid_rows(inp).float().mean())
    n_groups = u.lengths.numel()
    return {"group_size": G, "union_rows": rows, "union_ratio": rows / max(n_groups, 1) / max(per_q, 1.0)}


def make_calls(case: OpCase, inp: dict) -> dict:
    """name -> (zero-argument callable returning out [T, H, 512], path it runs)."""
    from .. import SparseMLAWorkspace, flash_mla_sparse_fwd, sparse_mla_fwd

    q, kv, idx = inp["q"], inp["kv"], inp["indices"]
    T, H, _ = q.shape
    common = dict(topk_length=inp["topk_length"], attn_sink=inp["attn_sink"], cu_seqlens_q=inp["cu_seqlens_q"])
    if inp.get("kv_fp8") is not None:
        return _fp8_calls(inp, common)
    out_pt = torch.full((T, H, 512), math.nan, dtype=q.dtype, device=q.device)  # poisoned: unwritten rows fail the check
    out_g, out_a = out_pt.clone(), out_pt.clone()
    ws = SparseMLAWorkspace.for_problem(max(T, 1), idx.shape[1], H, inp["N"], q.device)
    calls = {
        "per_token": lambda: sparse_mla_fwd(q, kv, idx, inp["sm_scale"], method="per_token", out=out_pt, **common),
        "grouped": lambda: sparse_mla_fwd(q, kv, idx, inp["sm_scale"], method="grouped", workspace=ws, out=out_g,
                                          **common),
        "auto": lambda: sparse_mla_fwd(q, kv, idx, inp["sm_scale"], out=out_a, **common),
        "drop_in": lambda: flash_mla_sparse_fwd(q, kv[:, None], idx[:, None], inp["sm_scale"], d_v=512,
                                                attn_sink=inp["attn_sink"], topk_length=inp["topk_length"])[0],
    }
    if H > 64:
        calls.pop("grouped")
    for s in case.kv_splits:  # the auto call with S forced, each into its own poisoned output
        calls[f"split{s}"] = _split_call(q, kv, idx, inp["sm_scale"], out_pt.clone(), s, common)
    heads = PAD_HEADS if H <= PAD_HEADS else 128  # FlashMLA's SM90 kernel takes 64 or 128 heads
    qp = torch.zeros(T, heads, q.shape[2], dtype=q.dtype, device=q.device)
    qp[:, :H] = q
    sinkp = None
    if inp["attn_sink"] is not None:
        sinkp = torch.full((heads,), -math.inf, device=q.device)
        sinkp[:H] = inp["attn_sink"]
    fm = flash_mla_fwd() if baseline_kind(q.device, idx.shape[1], q.dtype) == "flashmla" else None
    if fm is not None:
        kv3, idx3 = kv[:, None], idx[:, None]
        calls["flashmla"] = lambda: fm(qp, kv3, idx3, inp["sm_scale"], 512, sinkp, inp["topk_length"])[0][:, :H]
    else:
        outp = torch.full((T, heads, 512), math.nan, dtype=q.dtype, device=q.device)
        calls["flashmla"] = lambda: sparse_mla_fwd(qp, kv, idx, inp["sm_scale"], method="per_token", out=outp,
                                                   topk_length=inp["topk_length"], attn_sink=sinkp)[:, :H]
    return calls


def _split_call(q, kv, idx, sm_scale: float, out: torch.Tensor, s: int, common: dict):
    from .. import sparse_mla_fwd

    return lambda: sparse_mla_fwd(q, kv, idx, sm_scale, out=out, kv_splits=s, **common)


def _fp8_calls(inp: dict, common: dict) -> dict:
    """FP8-cache calls: the default (``kv_dequant="auto"``), each route forced, and the engines' route (the cache
    dequantized whole, then FlashMLA on q padded to 64 heads, or this package's per-token call when FlashMLA is not
    importable); ``bf16_auto`` is the default call on the bf16 cache the FP8 one was quantized from."""
    from .. import sparse_mla_fwd
    from ..kv_staging import dequantize_rows

    q, kv8, idx, kvb = inp["q"], inp["kv_fp8"], inp["indices"], inp["kv"]
    T, H, _ = q.shape
    fp8 = dict(kv_format="fp8_ds_mla", **common)
    calls = {
        "auto": lambda: sparse_mla_fwd(q, kv8, idx, inp["sm_scale"], **fp8),
        "in_kernel": lambda: sparse_mla_fwd(q, kv8, idx, inp["sm_scale"], kv_dequant="in_kernel", **fp8),
        "staged": lambda: sparse_mla_fwd(q, kv8, idx, inp["sm_scale"], kv_dequant="staged", **fp8),
        "bf16_auto": lambda: sparse_mla_fwd(q, kvb, idx, inp["sm_scale"], **common),
    }
    heads = PAD_HEADS if H <= PAD_HEADS else 128
    qp = torch.zeros(T, heads, q.shape[2], dtype=q.dtype, device=q.device)
    qp[:, :H] = q
    fm = flash_mla_fwd() if baseline_kind(q.device, idx.shape[1], q.dtype) == "flashmla" else None
    rows_buf = torch.empty(kv8.shape[0], kvb.shape[1], dtype=q.dtype, device=q.device)  # the engines' workspace

    def engines():
        rows = dequantize_rows(kv8, q.dtype, out=rows_buf)
        if fm is not None:
            return fm(qp, rows[:, None], idx[:, None], inp["sm_scale"], 512, None, inp["topk_length"])[0][:, :H]
        return sparse_mla_fwd(qp, rows, idx, inp["sm_scale"], method="per_token", topk_length=inp["topk_length"])[:, :H]

    calls["flashmla"] = engines
    return calls


def check_rows(out: torch.Tensor, inp: dict, sample: torch.Tensor) -> float:
    """``common.max_row_err`` of the sampled tokens' (token, head) rows against the fp32 reference."""
    from .. import sparse_mla_ref

    idx = inp["indices"][sample]
    tl = None if inp["topk_length"] is None else inp["topk_length"][sample]
    ref, _ = sparse_mla_ref(inp["q"][sample], inp["kv"], idx, inp["sm_scale"], topk_length=tl, attn_sink=inp["attn_sink"])
    return max_row_err(out[sample], ref)


def run_case(case: OpCase, *, calls: tuple[str, ...] = CALLS, trials: int = 1, host: bool = False,
             device: str = "cuda", dtype: torch.dtype = torch.bfloat16, rep_ms: int = REP_MS, graph: bool | None = None) -> dict:
    """Inputs, check, timings of one case; returns its JSON row. ``graph`` (default: for a case with ``kv_splits``):
    on a GPU, each call also captured in a CUDA graph and replayed (``timing.graph_figures``: ``graph_ms``, the
    device time without the host path, ``graph_err`` / ``graph_ok`` of the replay's output)."""
    from .timing import time_trials

    on_gpu = torch.device(device).type == "cuda"
    inp = case_inputs(case, device, dtype)
    T = inp["T"]
    uf = union_figures(inp, case.heads)
    fl = floors(inp, case.heads, case.d_qk, uf["union_rows"])
    flops = useful_flops(inp, case.heads, case.d_qk)
    sample = torch.linspace(0, T - 1, min(CHECK_TOKENS, T), device=device).round().long().unique()
    row = {"case": case.name, **asdict(case), "tokens": T, "kv_rows": inp["N"], "useful_tflop": flops / 1e12,
           "baseline": baseline_kind(device, inp["indices"].shape[1], dtype), **uf, "floor_ms": fl, "calls": {}}
    fns = make_calls(case, inp)
    if case.kv_splits:
        row["explain_fwd"] = explain_splits(inp)
        row["kv_splits_auto"], row["kv_splits_reason"] = op_decode.auto_splits(row["explain_fwd"])
    for name in (tuple(fns) if case.kv_fp8 else (*calls, *(n for n in fns if n.startswith("split")))):
        if name not in fns:
            continue
        fn = fns[name]
        rec: dict = {}
        try:
            out = fn()
            rec["max_row_err"] = check_rows(out, inp, sample)
            rec["ok"] = rec["max_row_err"] <= ROW_TOL[dtype]
            t = time_trials(fn, on_gpu=on_gpu, trials=trials, rep_ms=rep_ms)
            rec.update(ms=t["ms"], p20_ms=t["p20_ms"], p80_ms=t["p80_ms"], trials_ms=t["trials_ms"])
            rec["tflops"] = tflops(flops, t["ms"])
            if host and on_gpu:
                rec["host_us"] = host_time_us(fn)
            if (bool(case.kv_splits) if graph is None else graph) and on_gpu:
                rec.update(graph_figures(fn, lambda o: check_rows(o, inp, sample), ROW_TOL[dtype], trials=trials,
                                         rep_ms=rep_ms))
        except Exception as exc:  # recorded, not hidden: a failing call is a row with its error
            rec["error"] = f"{type(exc).__name__}: {exc}"
        row["calls"][name] = rec
    base = row["calls"].get("flashmla", {})
    bf16 = row["calls"].get("bf16_auto", {}).get("ms")
    for rec in row["calls"].values():
        for key, ms in (("vs_flashmla", "ms"), ("graph_vs_flashmla", "graph_ms")):
            if base.get(ms) and rec.get(ms):
                rec[key] = base[ms] / rec[ms]
        if bf16 and rec.get("ms"):
            rec["vs_bf16_cache"] = rec["ms"] / bf16
    row["explain"] = explain_call(case, inp)
    if case.kv_splits:
        row["best_split"] = op_decode.best_split(row)
    return row


def explain_splits(inp: dict) -> str:
    """``explain_fwd`` of the default call on the case's tensors (method, kv splits and backend, with reasons)."""
    from ..mqa.interface import explain_fwd

    return explain_fwd(inp["q"], inp["kv"], inp["indices"], inp["sm_scale"], cu_seqlens_q=inp["cu_seqlens_q"])


def explain_call(case: OpCase, inp: dict) -> str:
    """What the default call decided for this case (``sparse_mla.mqa.selection``) and why."""
    from ..mqa.selection import explain_method

    return explain_method(case.heads, inp["T"], has_cu_seqlens=inp["cu_seqlens_q"] is not None)


# ------------------------------------------------------------------------------------------- suites
def suite(name: str, cpu: bool = False) -> list:
    """The named case list (``SUITES``; ``cpu``: its interpreter form, ``CPU_SUITES``).

    Raises:
        ValueError: an unknown name, or (``cpu``) a suite without an interpreter form; the message lists the names.
    """
    table = CPU_SUITES if cpu else SUITES
    if name not in table:
        if cpu and name in SUITES:
            raise ValueError(f"suite {name!r} has GPU sizes only (no CUDA GPU here); suites with an interpreter form: "
                             f"{', '.join(CPU_SUITES)}")
        raise ValueError(f"suite must be one of {', '.join(SUITES)}, got {name!r}")
    return table[name]()


def _grouped() -> list[OpCase]:
    return [OpCase(h, "mid", 16384, 8192, cu_seqlens=cu) for h in (8, 16, 32, 64) for cu in (False, True)]


def _nooverlap() -> list[OpCase]:
    return [OpCase(h, "uniform", 24576, 8192) for h in (8, 16, 32, 64)]


def _protocol() -> list[OpCase]:
    out = []
    for h in (128, 64):
        out += [OpCase(h, "uniform", 24576, 8192), OpCase(h, "uniform", 24576, 8192, sink=True, topk_length=True),
                OpCase(h, "uniform", 24576, 8192, d_qk=512)]
    return out


def _v4() -> list[OpCase]:
    return [OpCase(h, "v4:mid", 16384, 8192, topk=512, d_qk=512, sink=True, topk_length=True) for h in (8, 16)]


def _dp() -> list[OpCase]:
    """Every head on one rank (data-parallel attention, issue 43's table): the protocol's per-token cases, DeepSeek-V4
    lists (D_qk 512, attn_sink, 512 compressed + 128 window rows) and 128K cached + 8K new, at 128 and 64 heads."""
    out = _protocol()
    out += [OpCase(h, "v4:mid", 16384, 8192, topk=512, d_qk=512, sink=True, topk_length=True) for h in (64, 128)]
    return out + [OpCase(128, "uniform", 131072, 8192)]


def _short() -> list[OpCase]:
    return [OpCase(h, "mid", 32768, t) for h in (16, 64) for t in (1, 16, 64, 256, 1024)]


def _mixed() -> list[OpCase]:
    """32 requests of 64-512 new tokens over 1K-32K cached (seeded draw), with cu_seqlens_q."""
    g = torch.Generator().manual_seed(7)
    news = torch.randint(64, 513, (32,), generator=g).tolist()
    cached = torch.randint(1024, 32769, (32,), generator=g).tolist()
    batch = tuple(zip(cached, news))
    return [OpCase(h, "mid", batch=batch, cu_seqlens=True) for h in (16, 64)]


def _fp8() -> list[OpCase]:
    """FP8 cache (fp8_ds_mla): 16 heads "mid" 16K + 8K and 128 heads on uniform lists, T 8192; and a short step."""
    return [OpCase(16, "mid", 16384, 8192, kv_fp8=True), OpCase(128, "uniform", 24576, 8192, kv_fp8=True),
            OpCase(16, "mid", 32768, 256, kv_fp8=True)]


def _sweep() -> list[OpCase]:
    """The grid the op's grouping rule is fitted on (``sparse_mla.mqa.selection``): new tokens 1K-64K over a
    32K context (cached = 32K - new, pure prompts beyond), H 8-64, lists mid (with and without cu_seqlens_q),
    low, none, random."""
    out = []
    for new in (1024, 2048, 4096, 8192, 16384, 32768, 65536):
        for preset in ("mid", "low", "none", "random"):
            if new == 65536 and preset != "mid":
                continue
            for h in (8, 16, 32, 64):
                for cu in ((False, True) if preset == "mid" else (False, )):
                    out.append(OpCase(h, preset, max(0, 32768 - new), new, cu_seqlens=cu))
    return out


def few_token_cases(cached=(32768, 131072), tokens=(1, 4, 16, 64, 256), heads=(16, 64), topk: int = 2048,
                    requests: int = 64, request_tokens: int = 2, request_cached: int = 32768,
                    splits: tuple[int, ...] = op_decode.SPLITS) -> list[OpCase]:
    """The few-token suite (defaults: the H200's): T new tokens over each cached length, then ``requests`` requests of
    ``request_tokens`` tokens over ``request_cached`` rows each (cu_seqlens_q); "mid" lists; every case times
    ``kv_splits=S`` forced for S in ``splits`` beside the automatic S."""
    out = [OpCase(h, "mid", c, t, topk=topk, kv_splits=tuple(splits)) for c in cached for h in heads for t in tokens]
    return out + [OpCase(h, "mid", request_cached, requests * request_tokens, topk=topk, cu_seqlens=True,
                         requests=requests, kv_splits=tuple(splits)) for h in heads]


def cpu_few_token_cases() -> list[OpCase]:
    """The few-token suite at interpreter sizes (1 / 4 tokens over 48 rows and 4 requests x 2 tokens, 16 heads)."""
    return few_token_cases(cached=(48,), tokens=(1, 4), heads=(16,), topk=16, requests=4, request_cached=24,
                           splits=(1, 2, 4))


SUITES = {"grouped": _grouped, "nooverlap": _nooverlap, "protocol": _protocol, "v4": _v4, "dp": _dp, "short": _short,
          "mixed": _mixed, "fp8": _fp8, "sweep": _sweep, "few-token": few_token_cases, **op_decode.SUITES}
CPU_SUITES = {"few-token": cpu_few_token_cases, **op_decode.CPU_SUITES}


def replay_status() -> dict:
    """``sparse_mla.call_cache.status`` of both entry points: which warm calls replayed, and why the others not."""
    from .. import call_cache, flash_mla_sparse_fwd, sparse_mla_fwd

    return {f.__name__: call_cache.status(f) for f in (sparse_mla_fwd, flash_mla_sparse_fwd)}


def provenance(rep_ms: int = REP_MS, trials: int = 1) -> dict:
    """The op JSON's meta (``common.run_meta``, kind "op"), its timing note of ``trials`` trials at ``rep_ms``."""
    return run_meta("op", timing=timing_note(trials=trials, rep_ms=rep_ms, interpreted=not torch.cuda.is_available()))


def run_any(case, *, calls: tuple[str, ...] = CALLS, **kw) -> dict:
    """``run_case`` of an ``OpCase``, ``op_decode.run_decode_case`` of a ``DecodeCase`` (``calls`` do not apply:
    a decode case runs all of its calls)."""
    if isinstance(case, op_decode.DecodeCase):
        return op_decode.run_decode_case(case, **kw)
    return run_case(case, calls=calls, **kw)


def case_line(row: dict) -> str:
    """One progress line of a row: its case and each call's ms (host us), ERR where it raised."""
    cells = "  ".join(f"{n} {r['ms']:.3f}" + (f" ({r['host_us']:.0f}us)" if "host_us" in r else "") + ("!" if r.get("ok")
                      is False else "") if "ms" in r else f"{n} ERR" for n, r in row["calls"].items())
    split = f"  [S {row['kv_splits_auto']}]" if "kv_splits_auto" in row else ""
    return f"{row['case']:42s} {cells}{split}"


def run_suites(cases: list, *, json_path: str | None = None, budget_s: float = 0, echo=print, **kw) -> list[dict]:
    """Run ``cases`` (``run_any``; ``kw``: its calls / trials / host / device / dtype / rep_ms), echo a line per case,
    and rewrite ``json_path`` (the op JSON: meta = ``provenance()`` + ``replay_status()``, rows) after every case.
    ``budget_s`` > 0: start no case after that many seconds."""
    rows, t0 = [], time.time()
    meta = provenance(kw.get("rep_ms", REP_MS), kw.get("trials", 1))
    for i, case in enumerate(cases):
        if budget_s and time.time() - t0 > budget_s:
            echo(f"budget reached after {i} of {len(cases)} cases")
            break
        rows.append(run_any(case, **kw))
        echo(case_line(rows[-1]))
        if json_path:
            write_json(json_path, {**meta, "replay": replay_status()}, rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m sparse_mla.bench.op", description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", action="append", help=f"case list(s): {', '.join(SUITES)} (repeatable)")
    ap.add_argument("--calls", default=",".join(CALLS), help="comma-separated calls to time (prefill-shaped cases; "
                    "the split<S> calls of a case with kv_splits and every decode call always run)")
    ap.add_argument("--trials", type=int, default=1)
    ap.add_argument("--rep-ms", type=int, default=REP_MS)
    ap.add_argument("--host", action="store_true", help="also measure host time per call")
    ap.add_argument("--graph", action=argparse.BooleanOptionalAction, default=None,
                    help="also time each call as a CUDA-graph replay (default: decode cases and cases with kv_splits)")
    ap.add_argument("--budget-s", type=float, default=0, help="stop starting cases after this many seconds (0: none)")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--fit", metavar="JSON", action="append", help="runs nothing: fit kv_splits.KV_SPLIT_MODEL on the "
                    "forced-split rows of op JSONs (few-token / decode suites; op_decode.kv_split_points; repeatable)")
    ap.add_argument("--sms", type=int, default=SMS, help=f"with --fit: the SM count of the GPU measured (H200: {SMS})")
    args = ap.parse_args(argv)
    if args.fit:
        print(op_decode.fit(args.fit, args.sms))
        return 0
    try:
        cases = [c for s in (args.suite or ["grouped"]) for c in suite(s)]
    except ValueError as e:
        ap.error(str(e))
    if not torch.cuda.is_available():
        print("python -m sparse_mla.bench.op times its suites on a CUDA GPU; on a CPU, `sparse-mla bench --op-suite "
              f"NAME` runs a small form of {', '.join(CPU_SUITES)} through the interpreter", file=sys.stderr)
        return 2
    calls = tuple(c for c in args.calls.split(",") if c)
    run_suites(cases, json_path=args.json, budget_s=args.budget_s, echo=lambda line: print(line, flush=True),
               calls=calls, trials=args.trials, host=args.host, rep_ms=args.rep_ms, graph=args.graph)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
