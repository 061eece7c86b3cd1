"""What the grouped path's overlap probe and guard cost, and whether ``method="auto"`` gets the faster method (issue 43,
item 4): per case, ``sparse_mla_fwd`` per token, grouped (probe + guard, the default), grouped with the probe
switched off (guard kept), grouped with ``overlap_guard=math.inf`` (no probe, no guard) and auto, on the same tensors
(``sparse_mla.bench.op`` cases: 16K cached + 8K new, top-2048). The GPU is warmed first and each trial times the
calls in a fresh shuffled order, so drift across a trial does not fall on one call. Every call's output is compared
with per token's (exact up to bf16 rounding of the same definition).

    python benchmarks/probe_cost.py --json out/probe-cost.json [--heads 8,16,32,64] [--lists mid,low,high] [--trials 3]

``auto_vs_best`` = auto / the faster of per token and grouped (the acceptance: <= 1.01).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import statistics
import time

import torch

from sparse_mla import SparseMLAWorkspace, sparse_mla_fwd
from sparse_mla.bench import op
from sparse_mla.bench.common import print_rows, run_meta, timing_note, write_json
from sparse_mla.bench.timing import median_ms
from sparse_mla.union import probe as union_probe

CALLS = ("per_token", "grouped", "grouped_noprobe", "grouped_noguard", "auto")


@contextlib.contextmanager
def _no_probe():
    """The grouped path without the overlap probe (``probe_buffers`` returning None: no probe is planned or run)."""
    real = union_probe.probe_buffers
    union_probe.probe_buffers = lambda *a, **k: None
    try:
        yield
    finally:
        union_probe.probe_buffers = real


def _calls(inp: dict, heads: int) -> dict:
    q, kv, idx = inp["q"], inp["kv"], inp["indices"]
    T = q.shape[0]
    # one workspace per grouped call: a warm call replays the launches recorded for its tensors (sparse_mla.call_cache),
    # so two calls sharing a workspace would replay whichever of them recorded first, probe or not
    ws = {k: SparseMLAWorkspace.for_problem(T, idx.shape[1], heads, inp["N"], q.device)
          for k in ("grouped", "grouped_noprobe", "grouped_noguard")}
    out = torch.empty(T, heads, 512, dtype=q.dtype, device=q.device)
    kw = dict(topk_length=inp["topk_length"], out=out)

    def grouped_noprobe():
        with _no_probe():
            return sparse_mla_fwd(q, kv, idx, inp["sm_scale"], method="grouped", workspace=ws["grouped_noprobe"],
                                  **kw)

    return {
        "per_token": lambda: sparse_mla_fwd(q, kv, idx, inp["sm_scale"], method="per_token", **kw),
        "grouped": lambda: sparse_mla_fwd(q, kv, idx, inp["sm_scale"], method="grouped", workspace=ws["grouped"],
                                          **kw),
        "grouped_noprobe": grouped_noprobe,
        "grouped_noguard": lambda: sparse_mla_fwd(q, kv, idx, inp["sm_scale"], method="grouped",
                                                  workspace=ws["grouped_noguard"], overlap_guard=math.inf, **kw),
        "auto": lambda: sparse_mla_fwd(q, kv, idx, inp["sm_scale"], **kw),
    }


def _warm(device: torch.device, seconds: float) -> None:
    """Matrix products for ``seconds``: the GPU at its working clocks and power before the first timed case."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    end = time.time() + seconds
    while time.time() < end:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def run(heads: list[int], lists: list[str], trials: int, warm_s: float, seed: int = 0) -> list[dict]:
    dev = torch.device("cuda")
    _warm(dev, warm_s)
    rng = random.Random(seed)
    rows = []
    for preset in lists:
        for h in heads:
            case = op.OpCase(h, preset, 16384, 8192)
            inp = op.case_inputs(case, dev, torch.bfloat16)
            fns = _calls(inp, h)
            ref = fns["per_token"]().float().clone()
            diff = {k: float((fns[k]().float() - ref).abs().max()) for k in CALLS[1:]}
            times: dict[str, list[float]] = {k: [] for k in CALLS}
            for _ in range(trials):
                order = list(CALLS)
                rng.shuffle(order)
                for k in order:
                    times[k].append(median_ms(fns[k], warmup_ms=25, rep_ms=150))
            row = dict(case=case.name, heads=h, lists=preset, trials_ms=times, max_abs_diff_vs_per_token=diff,
                       **{f"{k}_ms": statistics.median(v) for k, v in times.items()})
            row["auto_vs_best"] = row["auto_ms"] / min(row["per_token_ms"], row["grouped_ms"])
            row["probe_cost"] = row["grouped_ms"] / row["grouped_noprobe_ms"]
            rows.append(row)
            print(f"{case.name}: " + ", ".join(f"{k} {row[k + '_ms']:.3f}" for k in CALLS)
                  + f"; auto / best {row['auto_vs_best']:.3f}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True, help="write the rows here")
    ap.add_argument("--heads", default="8,16,32,64", help="comma-separated heads per rank")
    ap.add_argument("--lists", default="mid,low,high", help="comma-separated overlap presets")
    ap.add_argument("--trials", type=int, default=3, help="timings per call, each trial in a shuffled order")
    ap.add_argument("--warm-s", type=float, default=12.0, help="seconds of GPU warm-up before the first case")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    rows = run([int(h) for h in a.heads.split(",")], a.lists.split(","), a.trials, a.warm_s)
    write_json(a.json, run_meta(timing=timing_note(trials=a.trials, warmup_ms=25, rep_ms=150) + "; call order shuffled per trial"),
               rows)
    print_rows("probe cost and auto", rows, {
        "case": lambda r: r["case"], "per token": lambda r: f"{r['per_token_ms']:.3f}",
        "grouped": lambda r: f"{r['grouped_ms']:.3f}", "no probe": lambda r: f"{r['grouped_noprobe_ms']:.3f}",
        "no guard": lambda r: f"{r['grouped_noguard_ms']:.3f}", "auto": lambda r: f"{r['auto_ms']:.3f}",
        "auto / best": lambda r: f"{r['auto_vs_best']:.3f}"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
