"""Engine-integration checks on a CUDA GPU: the GPU test file, then one realistic warmup + step.

Run from the repository root on the GPU machine (writes JSON to $OUT, default ./out):

    OUT=./out python benchmarks/gpu_integration.py                 # defaults: H 16, topk 2048, 4096 tokens
    OUT=./out python benchmarks/gpu_integration.py --skip-pytest --tokens 8192 --requests 8

1. ``pytest tests/integration/test_gpu_integration.py`` in a fresh process: per-test outcome and duration
   (warmup then no compilation, CUDA-graph replay == eager, no allocation per step, custom ops in a
   graph and under inductor, bf16 end to end against the fp32 reference).
2. A realistic engine step in this process: a strided paged cache (2 layers per page), requests
   with up to ``--context`` cached tokens, indexer-like overlapping top-k, block tables, a padded
   tail. ``warmup`` (seconds, variants compiled), then the step (converter + grouped
   ``sparse_mla_fwd`` with a workspace and preallocated outputs): new variants compiled (must be 0),
   allocator calls (must be 0), CUDA-graph replay vs eager (must be equal), the reference on the
   first ``--ref-tokens`` rows, and step times (eager vs graph replay: ``sparse_mla.bench.timing.median_ms``).

Prints a short table; writes ``$OUT/gpu_integration.json`` (``meta``: ``sparse_mla.bench.common.run_meta`` with the
arguments; ``rows``: the realistic step; ``pytest``) and the pytest junit XML. Exit code 1
when any check fails.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_pytest(out_dir: Path) -> dict:
    """pytest tests/integration/test_gpu_integration.py in a subprocess; per-test outcome from its junit XML."""
    junit = out_dir / "gpu_integration_junit.xml"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                           "tests/integration/test_gpu_integration.py", f"--junitxml={junit}"],
                          cwd=ROOT, capture_output=True, text=True)
    tests = []
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            outcome, detail = "passed", ""
            for tag in ("failure", "error", "skipped"):
                el = case.find(tag)
                if el is not None:
                    outcome = {"failure": "failed"}.get(tag, tag)
                    detail = (el.get("message") or "")[:400]
            tests.append({"name": case.get("name"), "outcome": outcome, "seconds": float(case.get("time", 0)),
                          "detail": detail})
    return {"returncode": proc.returncode, "seconds": time.perf_counter() - t0, "tests": tests,
            "output_tail": (proc.stdout + proc.stderr)[-4000:]}


def build_step(args, dev):
    """A paged cache, block tables, request-local top-k with neighbour overlap, q; the step's tensors."""
    from sparse_mla.integration.block_table import paged_kv_as_rows

    g = torch.Generator(device=dev).manual_seed(0)
    H, D, K, bs = args.heads, args.d_qk, args.topk, args.block_size
    n_pad = args.pad
    n_real = args.tokens - n_pad
    n_dec = args.decodes
    B = args.requests + n_dec
    rest = n_real - n_dec
    lens = [1] * n_dec + [rest // args.requests + (1 if i < rest % args.requests else 0) for i in range(args.requests)]
    blocks_per_req = -(-args.context // bs)
    num_blocks = B * blocks_per_req + 8
    storage = torch.randn(num_blocks, 2, bs, D, device=dev, generator=g).to(torch.bfloat16)
    rows, stride_rows = paged_kv_as_rows(storage[:, 1])
    perm = torch.randperm(num_blocks, device=dev, generator=g).to(torch.int32)
    table = torch.full((B + 1, blocks_per_req), -1, dtype=torch.int32, device=dev)
    req_id = torch.full((args.tokens,), -1, dtype=torch.int32, device=dev)
    topk = torch.full((args.tokens, K), -1, dtype=torch.int32, device=dev)
    t = 0
    for r, new in enumerate(lens):
        ctx = args.context if new > 1 else int(torch.randint(1, args.context + 1, (1,), generator=g, device=dev))
        ctx = max(ctx, new)
        table[r] = perm[r * blocks_per_req:(r + 1) * blocks_per_req]
        base = torch.rand(ctx, device=dev, generator=g)  # the request's "relevance" of each position
        pos = torch.arange(ctx, device=dev)
        for c0 in range(0, new, 256):
            n = min(256, new - c0)
            p = ctx - new + c0 + torch.arange(n, device=dev)  # query positions
            score = base[None, :] + args.noise * torch.rand(n, ctx, device=dev, generator=g)
            score = score.masked_fill(pos[None, :] > p[:, None], float("-inf"))
            k = min(K, ctx)
            val, idx = score.topk(k, dim=1)
            sel = torch.where(torch.isinf(val), -1, idx).to(torch.int32)
            topk[t + c0:t + c0 + n, :k] = sel
            req_id[t + c0:t + c0 + n] = r
        t += new
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist(), args.tokens], dtype=torch.int32, device=dev)
    q = torch.randn(args.tokens, H, D, device=dev, generator=g).to(torch.bfloat16)
    return dict(rows=rows, stride_rows=stride_rows, table=table, req_id=req_id, topk_local=topk, cu=cu, q=q,
                num_requests=B + 1)


def realistic(args, dev) -> dict:
    from sparse_mla import SparseMLAWorkspace, sparse_mla_fwd, sparse_mla_ref
    from sparse_mla.bench.common import rel_err
    from sparse_mla.bench.timing import capture_graph, median_ms
    from sparse_mla.integration.block_table import convert_req_index_to_global
    from sparse_mla.integration.warmup import compiled_variant_counts, warmup

    s = build_step(args, dev)
    T, H, K = args.tokens, args.heads, args.topk
    ws = SparseMLAWorkspace.for_problem(args.max_tokens, K, H, s["rows"].shape[0], dev)
    rep = warmup(H, args.d_qk, K, torch.bfloat16, dev, args.max_tokens, max_requests=args.max_requests, kv=s["rows"],
                 workspace=ws, block_size=args.block_size)
    idx = torch.empty_like(s["topk_local"])
    out = torch.empty(T, H, 512, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(T, H, device=dev)

    def step():
        convert_req_index_to_global(s["req_id"], s["table"], s["topk_local"], args.block_size,
                                    kv_block_stride_rows=s["stride_rows"], out=idx)
        sparse_mla_fwd(s["q"], s["rows"], idx, args.d_qk**-0.5, method="grouped", cu_seqlens_q=s["cu"], workspace=ws,
                       out=out, lse=lse)

    torch.cuda.synchronize()
    counts0, mem0 = compiled_variant_counts(), torch.cuda.memory_stats()
    step()
    torch.cuda.synchronize()
    counts1, mem1 = compiled_variant_counts(), torch.cuda.memory_stats()
    new_variants = {k: counts1[k] - counts0[k] for k in counts1 if counts1[k] != counts0[k]}
    allocs = mem1["allocation.all.allocated"] - mem0["allocation.all.allocated"]
    eager_out, eager_lse = out.clone(), lse.clone()
    routed = int(ws.group_len.gt(0).sum()) * ws.group_size
    grouped = ws.group_len > 0
    mean_valid = max(1.0, float((idx >= 0).sum(1).float().mean()))
    union_ratio = float(ws.union_len[grouped].float().mean()) / mean_valid if bool(grouped.any()) else 0.0

    graph, _ = capture_graph(step)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    # grouped unions are built with atomics: row order, hence fp32 summation order, varies per run
    fin = torch.isfinite(eager_lse)
    graph_equal = bool(torch.equal(torch.isfinite(lse), fin)
                       and (out.float() - eager_out.float()).norm() <= 5e-3 * eager_out.float().norm()
                       and (lse[fin] - eager_lse[fin]).abs().max() <= 1e-2)

    eager_ms, graph_ms = median_ms(step), median_ms(graph.replay)
    n_ref = min(args.ref_tokens, T)
    ref_out, ref_lse = sparse_mla_ref(s["q"][:n_ref], s["rows"], idx[:n_ref], args.d_qk**-0.5)
    err = rel_err(eager_out[:n_ref], ref_out)
    pad_ok = bool(torch.all(eager_out[T - args.pad:] == 0) and torch.all(eager_lse[T - args.pad:] == float("-inf")))
    return {
        "warmup_seconds": rep.seconds, "warmup_calls": rep.calls, "warmup_new_variants": rep.new_variants,
        "step_new_variants": new_variants, "step_allocations": allocs, "graph_replay_equals_eager": graph_equal,
        "rel_err_vs_ref": err, "ref_tokens": n_ref, "padded_rows_zero": pad_ok,
        "eager_step_ms": eager_ms, "graph_step_ms": graph_ms,
        "grouped_token_fraction": routed / T, "union_ratio": union_ratio,
        "ok": not new_variants and allocs == 0 and graph_equal and err < 1e-2 and pad_ok,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-pytest", action="store_true")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--d-qk", type=int, default=576)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=4096, help="rows of the step, padded rows included")
    ap.add_argument("--requests", type=int, default=4, help="prefill requests (plus --decodes decode requests)")
    ap.add_argument("--decodes", type=int, default=3)
    ap.add_argument("--pad", type=int, default=8, help="CUDA-graph padding rows at the end (req_id -1)")
    ap.add_argument("--context", type=int, default=8192, help="cached tokens of a prefill request")
    ap.add_argument("--noise", type=float, default=0.3, help="per-token top-k noise (lower = more neighbour overlap)")
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--max-requests", type=int, default=64)
    ap.add_argument("--ref-tokens", type=int, default=256)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    out_dir = Path(os.environ.get("OUT", "./out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    from sparse_mla.bench.common import fmt, print_rows, run_meta, timing_note, write_json

    meta = run_meta(timing="step times: " + timing_note(), args=vars(args))
    extra, ok = {}, True
    if not args.skip_pytest:
        extra["pytest"] = run_pytest(out_dir)
        ok &= extra["pytest"]["returncode"] == 0
        print_rows("tests/integration/test_gpu_integration.py", extra["pytest"]["tests"], {
            "test": lambda t: t["name"], "outcome": lambda t: t["outcome"], "s": lambda t: fmt(t["seconds"], ".1f"),
            "detail": lambda t: t["detail"][:120]}, left=(0, 1, 3))
        if extra["pytest"]["returncode"] != 0:
            print(extra["pytest"]["output_tail"])
    r = realistic(args, torch.device("cuda"))
    ok &= r["ok"]
    print(f"\nrealistic step: T {args.tokens}, H {args.heads}, topk {args.topk}, "
          f"{args.requests} prefill + {args.decodes} decode requests, {args.pad} padded rows")
    for k in ("warmup_seconds", "warmup_calls", "warmup_new_variants", "step_new_variants", "step_allocations",
              "graph_replay_equals_eager", "rel_err_vs_ref", "padded_rows_zero", "eager_step_ms", "graph_step_ms",
              "grouped_token_fraction", "union_ratio", "ok"):
        v = r[k]
        print(f"  {k:<28} {v:.4g}" if isinstance(v, float) else f"  {k:<28} {v}")
    write_json(out_dir / "gpu_integration.json", meta, [r], **extra)
    print(f"\n{'PASS' if ok else 'FAIL'}; JSON: {out_dir / 'gpu_integration.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
