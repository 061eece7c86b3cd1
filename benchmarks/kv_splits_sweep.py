"""Few-token steps: ``sparse_mla_fwd`` per token at forced split counts S and the automatic one, same tensors.

    python benchmarks/kv_splits_sweep.py --json results/kv-splits-sweep.json

Per (H, T): T new tokens over ``--cached`` rows, each query's top-k ``--topk`` distinct uniform rows; every call is
checked against the fp32 reference per (token, head) row on up to 8 tokens (``sparse_mla.bench.common.max_row_err``),
then timed (``sparse_mla.bench.timing.median_ms``: do_bench median, ms). S = 1 is the unsplit kernel (the default before split-KV); "auto" is ``kv_splits=None`` with the S it
chose (``explain_fwd``). Rows feed ``sparse_mla.mqa.kv_splits.fit_kv_split_model`` (``--fit``).
"""

from __future__ import annotations

import argparse
import sys

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="16,64,128")
    ap.add_argument("--tokens", default="1,4,16,64,256")
    ap.add_argument("--splits", default="1,2,4,8,16")
    ap.add_argument("--cached", type=int, default=32768)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--json", default=None)
    ap.add_argument("--fit", action="store_true", help="fit KV_SPLIT_MODEL on the forced-S times and print it")
    args = ap.parse_args(argv)
    from sparse_mla import sparse_mla_fwd, sparse_mla_ref
    from sparse_mla.bench.common import max_row_err, run_meta, write_json
    from sparse_mla.bench.timing import median_ms
    from sparse_mla.mqa.interface import explain_fwd
    from sparse_mla.mqa.kv_splits import fit_kv_split_model, num_sms, work_items

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    N, K = args.cached, args.topk
    kv = torch.randn(N, 576, device=dev, generator=g).to(torch.bfloat16)
    rows, points = [], []
    for H in map(int, args.heads.split(",")):
        for T in map(int, args.tokens.split(",")):
            q = torch.randn(T, H, 576, device=dev, generator=g).to(torch.bfloat16)
            idx = torch.rand(T, N, device=dev, generator=g).topk(K, dim=1).indices.to(torch.int32)
            scale = 576 ** -0.5
            sample = torch.arange(min(T, 8), device=dev)
            ref, _ = sparse_mla_ref(q[sample], kv, idx[sample], scale)
            row = {"heads": H, "tokens": T, "topk": K, "cached": N, "ms": {}, "err": {}}
            for s in [*map(int, args.splits.split(",")), None]:
                out = torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16, device=dev)
                fn = lambda s=s, out=out: sparse_mla_fwd(q, kv, idx, scale, out=out, kv_splits=s)  # noqa: E731
                fn()
                key = "auto" if s is None else str(s)
                row["ms"][key] = median_ms(fn)
                row["err"][key] = max_row_err(out[sample], ref)
            row["auto_explain"] = explain_fwd(q, kv, idx, scale)
            rows.append(row)
            times = {int(k): v for k, v in row["ms"].items() if k != "auto"}
            points.append(dict(num_lists=T, pseudo_heads=H, rows_per_list=K, times=times))
            best = min(times, key=times.get)
            print(f"H{H:<4d} T{T:<5d} " + "  ".join(f"S{k} {v:.4f}" for k, v in row["ms"].items())
                  + f"  best S{best} {times[1] / times[best]:.2f}x over S1  auto/S1 {times[1] / row['ms']['auto']:.2f}x"
                  + f"  max err {max(row['err'].values()):.1e}", flush=True)
    extra = {}
    if args.fit:
        model, slowdown = fit_kv_split_model(points, num_sms(dev))
        extra["fit"] = {"model": model.__dict__, "mean_slowdown": slowdown}
        print(f"fit: {model} mean slowdown {slowdown:.3f} (work items e.g. {work_items(1, 16)} at T 1, H 16)")
    if args.json:
        write_json(args.json, run_meta(sms=num_sms(dev)), rows, **extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
