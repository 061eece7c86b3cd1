"""ShardQ vs plain tensor parallelism for sparse MLA prefill, on one host's GPUs (NCCL).

Run on the 2-GPU H200 box (it re-launches itself under torchrun when started plainly):

    python scripts/bench_shardq.py                      # GLM-5 + DeepSeek-V3.2, prompts 8K..64K
    torchrun --nproc-per-node 2 scripts/bench_shardq.py --tokens 8192,32768 --check

Per model layout (GLM-5: 64 heads, DeepSeek-V3.2: 128 heads; D_qk 576, d_v 512) and prompt
length T (pure prefill: one request, T new tokens, cache = the prompt, causal top-k 2048), it
times, on W ranks:

* tp/per_token, tp/grouped: ``tp_sparse_mla_fwd``, each rank its H / W heads of every token;
* shardq/per_token, shardq/grouped: ``shardq_sparse_mla_fwd``, each rank all H heads of a zigzag
  slice of the tokens (grouped only where G = 128 // H >= 2);

with CUDA events: exchange of q, attention, exchange of out, and the total. Each iteration
flushes L2 (a 256 MiB write) and passes a barrier first. Reported, medians over iterations:
``total_ms`` (max over ranks), ``attn_ms`` (max over ranks) and ``attn_imbalance`` (max / min),
``xchg_q_ms`` (max over ranks) and ``xchg_out_ms`` (min over ranks: the rank that finished its
attention last waits least, so its figure is closest to the pure transfer + copies).
TFLOP/s = useful FLOPs of the whole layer (all H heads, all tokens: 2 * H * sum_t K_valid(t) *
(D_qk + d_v), per-token definition) / total_ms. ``union_g`` = union ratio (union rows / mean valid
rows) of the token-major groups the grouped path forms, measured on the last 4096 rows.

Top-k lists: ``sparse_mla.workloads.synthetic_topk`` (calibrated overlap preset, --overlap) when
that module is present, else a small local causal generator (neighbour blocks sharing most rows).
``--check`` compares each variant's output with tp/per_token (relative Frobenius error) and the
fp32 reference on 64 sampled rows. JSON with the command, git revision, GPU name and date goes to
$OUT/bench_shardq.json (default ./out). NVLink multicast stays off: NCCL_NVLS_ENABLE=0 is set in
the environment of every rank before NCCL starts.

CPU smoke test of the script logic (gloo, Triton interpreter, fp16, tiny sizes):

    python scripts/bench_shardq.py --device cpu --models glm-5 --tokens 40 --topk 16 --iters 1 --warmup 0 --min-tokens 0 --check
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ["NCCL_NVLS_ENABLE"] = "0"  # before any NCCL communicator exists (NVLink multicast off)

REPO = Path(__file__).resolve().parent.parent
MODELS = {"glm-5": (64, 576, (192 + 64) ** -0.5), "deepseek-v3.2": (128, 576, (128 + 64) ** -0.5)}  # heads, D_qk, sm_scale
D_V = 512


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="glm-5,deepseek-v3.2", help=f"comma list of {sorted(MODELS)}")
    ap.add_argument("--tokens", default="8192,16384,32768,65536", help="comma list of prompt lengths T")
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--overlap", default="mid", help="sparse_mla.workloads preset (high/mid/low/none/random)")
    ap.add_argument("--share", type=float, default=0.93,
                    help="local generator only: fraction of a query's rows shared with its block of 8")
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--check", action="store_true", help="compare outputs while timing")
    ap.add_argument("--nproc", type=int, default=2, help="ranks when the script launches torchrun itself")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu = gloo + Triton interpreter smoke test")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-tokens", type=int, default=1024, help="shardq_sparse_mla_fwd's min_tokens (TP below it)")
    return ap.parse_args(argv)


def relaunch_under_torchrun(args: argparse.Namespace) -> int:
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", BENCH_SHARDQ_COMMAND=" ".join([sys.executable, *sys.argv]))
    if args.device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           str(Path(__file__).resolve()), *sys.argv[1:]]
    print("launching:", " ".join(cmd), flush=True)
    return subprocess.call(cmd, env=env)


def git_revision() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                               text=True, check=True).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# ---------------------------------------------------------------------------------------------
# Workload
# ---------------------------------------------------------------------------------------------


def local_causal_topk(T: int, K: int, share: float, seed: int, device) -> tuple:
    """[T, K] int32 causal top-k of one prompt (rows = positions) and [T] int32 valid counts.

    Query t < K takes every row 0..t. Later queries split rows [0, n) into K strata, n =
    max(t0 + 1, K) with t0 = t rounded down to a multiple of 8 (so n <= t + 1: causal), and take
    one row per stratum (distinct by construction): the block of 8's shared pick with probability
    ``share``, else their own. Neighbours in a block share about ``share`` of their rows.
    """
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    out = torch.full((T, K), -1, dtype=torch.int32, device=device)
    j = torch.arange(K, device=device)
    chunk = 4096
    for c0 in range(0, T, chunk):
        t = torch.arange(c0, min(T, c0 + chunk), device=device)
        t0 = t - t % 8
        n = torch.clamp(t0 + 1, min=K)[:, None]
        lo = j[None, :] * n // K
        width = (j[None, :] + 1) * n // K - lo
        u_block = torch.rand(((t.numel() + 7) // 8 + 1, K), generator=g, device=device)
        u_own = torch.rand((t.numel(), K), generator=g, device=device)
        shared = torch.rand((t.numel(), K), generator=g, device=device) < share
        u = torch.where(shared, u_block[(t0 - c0) // 8], u_own)
        rows = lo + (u * width).long().clamp(max=width - 1)
        dense = (t + 1 <= K)[:, None]
        rows = torch.where(dense, torch.where(j[None, :] <= t[:, None], j[None, :], -1), rows)
        out[c0:c0 + t.numel()] = rows.to(torch.int32)
    valid = torch.clamp(torch.arange(T, device=device) + 1, max=K).to(torch.int32)
    return out, valid


def make_topk(T: int, K: int, args, device) -> tuple:
    try:
        from sparse_mla.workloads import synthetic_topk
    except ImportError:
        idx, valid = local_causal_topk(T, K, args.share, args.seed, device)
        return idx, valid, f"local(share={args.share})"
    idx, valid = synthetic_topk(0, T, K, args.overlap, seed=args.seed, device=device)
    return idx, valid, f"sparse_mla.workloads.synthetic_topk({args.overlap!r})"


def union_ratio_tail(indices, valid, G: int, rows: int = 4096) -> float:
    """Union rows / mean valid rows over token-major groups of G among the last ``rows`` rows."""
    import torch

    if G < 2:
        return 1.0
    T, K = indices.shape
    s = max(0, T - rows)
    s += (T - s) % G
    idx = indices[s:].long()
    ok = (idx >= 0) & (torch.arange(K, device=idx.device)[None, :] < valid[s:, None])
    keyed = torch.where(ok, idx, -1).view(-1, G * K).sort(dim=1).values
    distinct = ((keyed[:, 1:] != keyed[:, :-1]) & (keyed[:, 1:] >= 0)).sum(1) + (keyed[:, :1] >= 0).squeeze(1)
    mean_valid = ok.view(-1, G, K).sum(2).float().mean(1)
    return float((distinct.float() / mean_valid.clamp(min=1)).mean())


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def run_variant(fn, iters: int, warmup: int, flush, barrier) -> list[dict]:
    recs = []
    for i in range(warmup + iters):
        flush()
        barrier()
        timings: dict = {}
        fn(timings)
        if i >= warmup:
            recs.append(timings)
    return recs


def summarize(all_ranks: list[list[dict]]) -> dict:
    """all_ranks[r][i]: rank r's timings of iteration i -> medians over i of cross-rank figures."""
    n_iter = len(all_ranks[0])
    col = lambda key, red: [red(r[i][key] for r in all_ranks) for i in range(n_iter)]  # noqa: E731
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


def main() -> int:
    args = parse_args(sys.argv[1:])
    if "LOCAL_RANK" not in os.environ:
        return relaunch_under_torchrun(args)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before sparse_mla's kernels are imported

    import functools

    import torch
    import torch.distributed as dist

    from sparse_mla import SparseMLAWorkspace, default_group_size, sparse_mla_fwd, sparse_mla_ref
    from sparse_mla.distributed import shardq_sparse_mla_fwd, tp_sparse_mla_fwd

    local_rank = int(os.environ["LOCAL_RANK"])
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device, dtype, backend = torch.device("cuda", local_rank), torch.bfloat16, "nccl"
    else:
        device, dtype, backend = torch.device("cpu"), torch.float16, "gloo"
    dist.init_process_group(backend)
    W, rank = dist.get_world_size(), dist.get_rank()
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    flush_buf = torch.empty(256 * 2**20 if device.type == "cuda" else 1, dtype=torch.uint8, device=device)

    def flush():
        flush_buf.zero_()

    def barrier():
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()

    K = args.topk
    rows_out = []
    header = (f"{'model':<14} {'T':>6} {'variant':<17} {'total ms':>9} {'attn ms':>8} {'imbal':>6} {'xq ms':>6} "
              f"{'xo ms':>6} {'TFLOP/s':>8} {'union_g':>7} {'check':>8}")
    say(f"W = {W} ranks, {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
        f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}")
    say(header)
    topk_source = None
    for model in args.models.split(","):
        H, D, scale = MODELS[model]
        Hl = H // W
        for T in (int(x) for x in args.tokens.split(",")):
            # Same top-k and cache on every rank (generated on rank 0, broadcast); q per rank = its head shard.
            indices = torch.empty(T, K, dtype=torch.int32, device=device)
            valid = torch.empty(T, dtype=torch.int32, device=device)
            kv = torch.empty(T, D, dtype=dtype, device=device)
            if rank == 0:
                idx0, val0, topk_source = make_topk(T, K, args, device)
                indices.copy_(idx0)
                valid.copy_(val0)
                del idx0, val0
                kv.copy_(torch.randn(T, D, generator=torch.Generator(device=device).manual_seed(args.seed + 1),
                                     device=device, dtype=torch.float32).to(dtype))
            for t in (indices, valid, kv):
                dist.broadcast(t, src=0)
            gq = torch.Generator(device=device).manual_seed(args.seed + 100 + rank)
            q_local = torch.randn(T, Hl, D, generator=gq, device=device, dtype=torch.float32).to(dtype)
            flops = 2 * H * int(valid.long().sum()) * (D + D_V)
            G_tp, G_sq = default_group_size(Hl), default_group_size(H)
            max_rows = -(-T // (2 * W)) * 2
            ws_tp = SparseMLAWorkspace(T, K, G_tp, T, device)
            ws_sq = SparseMLAWorkspace(max_rows, K, G_sq, T, device) if G_sq >= 2 else None
            out = torch.empty(T, Hl, D_V, dtype=dtype, device=device)
            common = dict(topk_length=valid, out=out)
            grouped_tp = functools.partial(sparse_mla_fwd, workspace=ws_tp)
            variants = {
                "tp/per_token": (functools.partial(tp_sparse_mla_fwd, method="per_token", **common), 1),
                "tp/grouped": (functools.partial(tp_sparse_mla_fwd, method="grouped", attn_fn=grouped_tp, **common), G_tp),
                "shardq/per_token": (functools.partial(shardq_sparse_mla_fwd, method="per_token",
                                                       min_tokens=args.min_tokens, **common), 1),
            }
            if ws_sq is not None:
                grouped_sq = functools.partial(sparse_mla_fwd, workspace=ws_sq)
                variants["shardq/grouped"] = (functools.partial(shardq_sparse_mla_fwd, method="grouped", attn_fn=grouped_sq,
                                                                min_tokens=args.min_tokens, **common), G_sq)
            baseline = None
            if args.check:
                g = torch.Generator().manual_seed(7)
                sample = torch.randint(0, T, (min(64, T),), generator=g).to(device)
                ref, _ = sparse_mla_ref(q_local[sample], kv, indices[sample], scale, topk_length=valid[sample])
            for name, (fn, G) in variants.items():
                info: dict = {}
                extra = {"info": info} if name.startswith("shardq") else {}

                def call(timings, fn=fn, extra=extra, args_=(q_local, kv, indices, scale)):
                    fn(*args_, timings=timings, **extra)

                out.fill_(float("nan"))
                recs = run_variant(call, args.iters, args.warmup, flush, barrier)
                if name.startswith("shardq") and info.get("path") != "shardq":
                    raise RuntimeError(f"{name}: expected the ShardQ path, got {info}")
                gathered: list = [None] * W
                dist.all_gather_object(gathered, recs)
                row = dict(model=model, heads=H, heads_per_rank=Hl, tokens=T, topk=K, variant=name, group_size=G,
                           **summarize(gathered))
                row["tflops"] = flops / (row["total_ms"] * 1e-3) / 1e12 if row["total_ms"] > 0 else float("nan")
                row["union_g"] = union_ratio_tail(indices, valid, G) if "grouped" in name else 1.0
                if args.check:
                    errs = torch.tensor([float("nan"), float("nan")], device=device)
                    if baseline is None:
                        baseline = out.clone()
                    x = out.float()
                    errs[0] = (x - baseline.float()).norm() / baseline.float().norm()
                    errs[1] = (x[sample] - ref).norm() / ref.norm()
                    bad = torch.isnan(out).any().float()
                    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
                    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
                    row.update(err_vs_tp=float(errs[0]), err_vs_ref=float(errs[1]), nan=bool(bad))
                rows_out.append(row)
                chk = f"{row['err_vs_ref']:.1e}" if args.check else "-"
                if args.check and (row["nan"] or row["err_vs_ref"] > 1e-2 or row["err_vs_tp"] > 1e-2):
                    chk = "FAIL"
                say(f"{model:<14} {T:>6} {name:<17} {row['total_ms']:>9.3f} {row['attn_ms']:>8.3f} "
                    f"{row['attn_imbalance']:>6.2f} {row['xchg_q_ms']:>6.2f} {row['xchg_out_ms']:>6.2f} "
                    f"{row['tflops']:>8.1f} {row['union_g']:>7.2f} {chk:>8}")
            del ws_tp, ws_sq, out, baseline, variants, common
            q_local = indices = valid = kv = None  # free before the next config
            if device.type == "cuda":
                torch.cuda.empty_cache()

    if rank == 0:
        best = {}
        for r in rows_out:
            key = (r["model"], r["tokens"], r["variant"].split("/")[0])
            best[key] = min(best.get(key, float("inf")), r["total_ms"])
        say("\nShardQ speedup over the best TP variant (total ms, both best-of-methods):")
        for (model, T, kind), ms in sorted(best.items()):
            if kind == "shardq":
                say(f"  {model:<14} T={T:>6}: {best[(model, T, 'tp')] / ms:.2f}x")
        out_dir = Path(os.environ.get("OUT", "./out"))
        out_dir.mkdir(parents=True, exist_ok=True)
        doc = {
            "command": os.environ.get("BENCH_SHARDQ_COMMAND", " ".join([sys.executable, *sys.argv])),
            "git_revision": git_revision(),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "triton": __import__("triton").__version__,
            "world_size": W,
            "backend": backend,
            "dtype": str(dtype),
            "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
            "topk_source": topk_source,
            "args": vars(args),
            "flops_formula": "2 * H * sum_t K_valid(t) * (D_qk + d_v), all heads, all tokens",
            "results": rows_out,
        }
        path = out_dir / "bench_shardq.json"
        path.write_text(json.dumps(doc, indent=1))
        say(f"wrote {path}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    t_start = time.time()
    rc = main()
    if "LOCAL_RANK" in os.environ and os.environ.get("RANK", "0") == "0":
        print(f"elapsed {time.time() - t_start:.1f} s", flush=True)
    sys.exit(rc)
