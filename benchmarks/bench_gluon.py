"""Attention-kernel benchmark of the Gluon sm_90 backend against the Triton backend (same run, same tensors).

Protocol (docs/notes/attention-gluon.md, FlashMLA figures): T 8192, topk 2048, 32K kv rows, query i takes
2048 distinct uniform rows of [0, 24576 + i], unsorted; do_bench median, L2 flushed. Per-token at 128 / 64 heads
(and 32 / 16 for reference); grouped attention alone (union given, built once by the Triton builder) on the
"mid" synthetic top-k of 16K cached + 8K new tokens at 16 heads (G = 8), 32 heads (G = 4), 8 heads (G = 16).
Every row: time, TFLOP/s (per-token: useful FLOPs 2 * H * valid * 1088; grouped: computed tile FLOPs
2 * 128 * union rows * 1088 per group, and useful), the roofline floor (``sparse_mla.bench.common.floor_ms``: compute
and gather at the H200's peaks), and the max per-(token, head) row error (``common.max_row_err``) against the fp32
reference on sampled tokens.

    python benchmarks/bench_gluon.py --json out/gluon.json [--quick] [--backends gluon_sm90:pair,triton] [--ablate 2,8]
    git show REV:sparse_mla/mqa/gluon_sm90/pair.py > /tmp/base.py
    python benchmarks/bench_gluon.py --json out/ab.json --quick --pair base=/tmp/base.py \
        --backends gluon_sm90:pair@base,gluon_sm90:pair,flashmla --trials 2
    python benchmarks/bench_gluon.py --json out/l2.json --heads 128,64 --forms plain,sink,d512 \
        --backends gluon_sm90:pair,gluon_sm90:pair+l2,flashmla --trials 2
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

from sparse_mla import SparseMLAWorkspace, sparse_mla_ref
from sparse_mla.bench.common import floor_ms, fmt, max_row_err, print_rows, run_meta, tflops, timing_note, write_json
from sparse_mla.bench.timing import median_ms
from sparse_mla.mqa import backends, gluon_sm90
from sparse_mla.union.planning import plan_groups
from sparse_mla.union.triton_tl import build_union
from sparse_mla.workloads import synthetic_batch

D_QK, D_V = 576, 512
# do_bench budget of this script: longer than common's default so that the kernel figures compared across revisions
# (docs/notes/attention-gluon.md, results/gluon-*.json) keep the protocol they were measured with.
WARMUP_MS, REP_MS = 50, 300


def causal_uniform(T, K, N, P0, dev):
    idx = torch.empty(T, K, device=dev, dtype=torch.int32)
    ar = torch.arange(N, device=dev)
    for i0 in range(0, T, 1024):
        n = min(1024, T - i0)
        r = torch.rand(n, N, device=dev)
        lim = P0 + torch.arange(i0, i0 + n, device=dev)
        r[ar[None, :] > lim[:, None]] = -1.0
        idx[i0:i0 + n] = r.topk(K, dim=1).indices.to(torch.int32)
    return idx


_UNMARKED: set = set()  # --pair schedules from before the kv copies' L2 hint (nothing for +l2 to hint)


def use(name):
    """'gluon_sm90:<schedule>[+l2]' or a backend name: set the backend (and the Gluon schedule) for the next calls;
    ``+l2`` gathers kv rows with FlashMLA's cp.async L2 hints (``SPARSE_MLA_GLUON_KV_L2=evict_last``), a separately
    compiled variant, so ``gluon_sm90:pair`` and ``gluon_sm90:pair+l2`` are a same-process A/B. A name without
    ``+l2`` runs without the hints, whatever the environment says: each row names its variant."""
    backend, _, schedule = name.partition(":")
    schedule, plus, hint = schedule.partition("+")
    if plus and (backend != "gluon_sm90" or hint != "l2"):
        raise SystemExit(f"--backends: only gluon_sm90:<schedule>+l2 takes a '+' suffix, got {name!r}")
    if plus and schedule in _UNMARKED:
        raise SystemExit(f"--backends: {name!r}: that --pair file predates the L2 hint, so +l2 would time it unhinted")
    os.environ[backends.ENV_VAR] = backend
    if schedule:
        gluon_sm90.config.SCHEDULE = schedule
    gluon_sm90.config.KV_L2 = "evict_last" if plus else "off"


def register_pair(name, path):
    """Load a pair-schedule module from ``path`` (e.g. ``git show REV:sparse_mla/mqa/gluon_sm90/pair.py``) beside the
    package's own and make it launchable as the schedule ``pair@<name>`` (backend ``gluon_sm90:pair@<name>``), for a
    same-process A/B of kernel revisions on the same tensors. The file's relative imports resolve to this checkout's
    ``common.py`` / ``config``: it times that revision's pair.py with today's helpers, not the whole old package."""
    import importlib.util

    from sparse_mla.mqa.gluon_sm90 import launcher
    from sparse_mla.mqa.gluon_sm90.signature import check_kernel

    if not name.isidentifier() or not os.path.isfile(path):
        raise SystemExit(f"--pair wants NAME=FILE with an identifier NAME and an existing FILE, got {name}={path}")

    src = open(path).read()
    if "KV_EVICT" not in src:  # a pair.py from before the kv copies' L2 hint: the parameter, unused, for today's launcher
        marker = "KV_SPLIT: gl.constexpr, num_warps: gl.constexpr,"
        if src.count(marker) != 1:
            raise SystemExit(f"--pair {name}: {path} has no KV_EVICT parameter and no kernel line {marker!r} to add it to")
        src = src.replace(marker, "KV_SPLIT: gl.constexpr, KV_EVICT: gl.constexpr, num_warps: gl.constexpr,")
        _UNMARKED.add(f"pair@{name}")
        path = os.path.join(tempfile.mkdtemp(prefix="bench_gluon_"), os.path.basename(path))
        with open(path, "w") as f:
            f.write(src)
    spec = importlib.util.spec_from_file_location(f"sparse_mla.mqa.gluon_sm90._ab_pair_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    check_kernel(mod.sparse_mqa_sm90_pair_kernel)
    own, schedule_name = launcher._kernel_for, f"pair@{name}"
    launcher._kernel_for = lambda schedule: mod.sparse_mqa_sm90_pair_kernel if schedule == schedule_name else own(schedule)


FLASHMLA_HEADS = (64, 128)  # the head counts FlashMLA's SM90 sparse prefill takes (others crash it: pad instead)


def flashmla_call(q, kv, idx, sm, attn_sink=None, topk_length=None):
    """A call of FlashMLA's sparse prefill on these tensors (``flashmla_sm90``, benchmarks/flashmla/build.py), looked
    up once, outside the timed call; it returns out."""
    from sparse_mla.bench.baselines import flash_mla_fwd

    fm = flash_mla_fwd()
    if fm is None:
        raise RuntimeError("FlashMLA is not importable: build it (benchmarks/flashmla/build.py) and put it on PYTHONPATH")
    kv3, idx3 = kv[:, None, :], idx[:, None, :]
    return lambda: fm(q, kv3, idx3, sm, D_V, attn_sink, topk_length)[0]


def write_rows(path, rows, **meta):
    """The rows with the run's meta (``common.run_meta``: command, git revision, GPU, date, versions, timing; then
    ``meta``) as JSON (``common.write_json``)."""
    write_json(path, run_meta(timing=timing_note(warmup_ms=WARMUP_MS, rep_ms=REP_MS), **meta), rows)


def timed(fn):
    """Median ms of ``fn`` (``timing.median_ms`` at this script's budget)."""
    return median_ms(fn, warmup_ms=WARMUP_MS, rep_ms=REP_MS)


def print_table(rows, extra=()):
    """The end-of-run table of the rows (``common.print_rows``): case, backend, ms, TFLOP/s, floor, row error; then
    the ``extra`` row keys."""
    cols = {"case": lambda r: r["case"], "backend": lambda r: r["backend"], "ms": lambda r: fmt(r.get("ms"), ".3f"),
            "TFLOP/s": lambda r: fmt(r.get("tflops"), ".1f"), "floor ms": lambda r: fmt(r.get("floor_ms"), ".3f"),
            "row err": lambda r: fmt(r.get("max_row_err"), ".1e")}
    cols.update({k: (lambda r, k=k: str(r.get(k, "-"))) for k in extra})
    print_rows("attention kernels: ms per call", rows, cols, left=(0, 1))


def per_token_rows(H, T, K, N, dev, names, d_qk=D_QK, sink=False):
    """Per-token rows at H heads; d_qk 576 or 512; sink: attn_sink [H] with topk_length [T] (all of topk) and
    max_logits, the ``flash_mla_sparse_fwd`` form."""
    torch.manual_seed(0)
    q = (torch.randn(T, H, d_qk, device=dev) * 0.5).to(torch.bfloat16)
    kv = (torch.randn(N, d_qk, device=dev) * 0.5).to(torch.bfloat16)
    idx = causal_uniform(T, K, N, N - T, dev)
    sm = d_qk ** -0.5
    flops = 2 * T * H * K * (d_qk + D_V)
    toks = torch.randperm(T, device=dev)[:32]
    sink_t = torch.randn(H, device=dev) if sink else None
    tl_t = torch.full((T,), K, device=dev, dtype=torch.int32) if sink else None
    maxl = torch.empty(T, H, device=dev, dtype=torch.float32) if sink else None
    ref, _ = sparse_mla_ref(q[toks], kv, idx[toks], sm, attn_sink=sink_t)
    out = torch.empty(T, H, D_V, device=dev, dtype=torch.bfloat16)
    lse = torch.empty(T, H, device=dev, dtype=torch.float32)
    gather = T * K * d_qk * 2
    case = f"per_token H{H}" + ("" if d_qk == D_QK else f" d{d_qk}") + (" sink/len" if sink else "")
    rows = []
    for name in names:
        if name == "flashmla" and H not in FLASHMLA_HEADS:
            continue
        if name == "flashmla":
            fn = flashmla_call(q, kv, idx, sm, sink_t, tl_t)
            err = max_row_err(fn()[toks], ref)
        else:
            use(name)
            out.fill_(float("nan"))
            fn = lambda: backends.per_token(q, kv, idx, sm, tl_t, out, lse, attn_sink=sink_t,  # noqa: E731
                                            max_logits=maxl)
            fn()
            torch.cuda.synchronize()
            err = max_row_err(out[toks], ref)
        ms = timed(fn)
        rows.append(dict(case=case, backend=name, ms=ms, tflops=tflops(flops, ms), floor_ms=floor_ms(flops, gather),
                         max_row_err=err))
        print(rows[-1], flush=True)
    return rows


def grouped_rows(H, cached, new, K, dev, names):
    G = 128 // H
    b = synthetic_batch([cached], [new], K, "mid", seed=0, device=dev)
    idx = b.indices
    T, N = idx.shape[0], cached + new
    torch.manual_seed(1)
    q = (torch.randn(T, H, D_QK, device=dev) * 0.5).to(torch.bfloat16)
    kv = (torch.randn(N, D_QK, device=dev) * 0.5).to(torch.bfloat16)
    sm = D_QK ** -0.5
    ws = SparseMLAWorkspace(T, K, G, N, dev)
    ng = -(-T // G)
    gs, gl_, ul, route = ws.group_start[:ng], ws.group_len[:ng], ws.union_len[:ng], ws.route[:T]
    plan_groups(T, G, None, gs, gl_, route)
    build_union(idx, b.valid, N, G, gs, gl_, route, ws.union_tables, ws.union_table_bits, ws.union_rows,
                ws.union_bits, ul)
    torch.cuda.synchronize()
    urows = int(ul.clamp(min=0).sum())
    valid = int(b.valid.sum())
    computed = 2 * 128 * urows * (D_QK + D_V)
    useful = 2 * H * valid * (D_QK + D_V)
    toks = torch.randperm(T, device=dev)[:64]
    ref, _ = sparse_mla_ref(q[toks], kv, idx[toks], sm, topk_length=b.valid[toks])
    out = torch.empty(T, H, D_V, device=dev, dtype=torch.bfloat16)
    lse = torch.empty(T, H, device=dev, dtype=torch.float32)
    rows = []
    for name in (n for n in names if n != "flashmla"):  # FlashMLA has no grouped tile (the op bench pads it)
        use(name)
        out.fill_(float("nan"))
        fn = lambda: backends.grouped(q, kv, sm, G, ws.union_rows, ws.union_bits, ul, gs, gl_, out, lse)  # noqa: E731
        fn()
        torch.cuda.synchronize()
        err = max_row_err(out[toks], ref)
        ms = timed(fn)
        rows.append(dict(case=f"grouped H{H} G{G} {cached}+{new} mid", backend=name, ms=ms,
                         tflops=tflops(computed, ms), useful_tflops=tflops(useful, ms),
                         union_ratio=urows / (valid / G), floor_ms=floor_ms(computed, urows * D_QK * 2),
                         max_row_err=err))
        print(rows[-1], flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, help="where to write the results JSON")
    ap.add_argument("--quick", action="store_true", help="128/64-head per-token and 16-head grouped only")
    ap.add_argument("--backends", default="gluon_sm90:pair,gluon_sm90:split,triton",
                    help="comma-separated backends to time (gluon_sm90:<schedule> picks the Gluon schedule; "
                    "flashmla: FlashMLA's sparse prefill, per token at 64 / 128 heads only; gluon_sm90:pair@NAME: a --pair "
                    "kernel; gluon_sm90:<schedule>+l2: kv copies with FlashMLA's L2 hints)")
    ap.add_argument("--pair", action="append", default=[], metavar="NAME=FILE",
                    help="a pair.py of another revision, timed as gluon_sm90:pair@NAME beside the package's own "
                    "(repeatable)")
    ap.add_argument("--trials", type=int, default=1, help="time every case this many times (backends interleaved)")
    ap.add_argument("--ablate", default="", help="comma-separated ABLATE masks of the split schedule to time at "
                    "64 heads per token (timing only: results are wrong by design)")
    ap.add_argument("--forms", default="plain", help="comma-separated per-token forms: plain, d512 (D_qk 512), sink "
                    "(attn_sink + topk_length + max_logits), d512sink")
    ap.add_argument("--heads", default="", help="comma-separated per-token head counts (default: 128,64 with "
                    "--quick, else 128,64,32,16; none: no per-token rows); grouped rows only without it or with none")
    a = ap.parse_args()
    dev = torch.device("cuda")
    names = a.backends.split(",")
    for spec in a.pair:
        name, _, path = spec.partition("=")
        register_pair(name, path)
    names = names * a.trials
    rows = []
    for mask in [int(x) for x in a.ablate.split(",") if x]:
        gluon_sm90.config.ABLATE = mask
        try:
            for r in per_token_rows(64, 8192, 2048, 32768, dev, ["gluon_sm90:split"]):
                r["case"] = f"ablate {mask} per_token H64"
                rows.append(r)
        finally:
            gluon_sm90.config.ABLATE = 0
    heads = [] if a.heads == "none" else [int(h) for h in a.heads.split(",") if h] or ((128, 64) if a.quick else
                                                                                     (128, 64, 32, 16))
    forms = {"plain": (D_QK, False), "d512": (512, False), "sink": (D_QK, True), "d512sink": (512, True)}
    for form in a.forms.split(","):
        if form not in forms:
            raise SystemExit(f"--forms takes {', '.join(forms)}, got {form!r}")
    for H in (() if a.ablate else heads):
        for form in a.forms.split(","):
            rows += per_token_rows(H, 8192, 2048, 32768, dev, names, *forms[form])
    for H in (() if a.ablate or a.heads not in ("", "none") else (16, ) if a.quick else (16, 32, 8)):
        rows += grouped_rows(H, 16384, 8192, 2048, dev, names)
    write_rows(a.json, rows)
    print_table(rows)


if __name__ == "__main__":
    main()
