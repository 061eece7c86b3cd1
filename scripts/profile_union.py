#!/usr/bin/env python
"""Union builder on the H200: predicated CAS (only still-probing lanes issue the atomic) vs the
every-lane ``tl.atomic_cas`` form, both checked equal, timed with do_bench, and the grouped
attention timed next to them for the "union <= 10% of attention" target.

Run on the GPU box from the repository root:

    OUT=out GIT_REV=<sha> PYTHONPATH=. python3 scripts/profile_union.py [--ncu]

Writes $OUT/union_profile.json (command, git revision, GPU, date, per case: ms of each variant,
the union ratio, the grouped attention's ms). With --ncu (and ncu on the PATH) it also profiles one
launch of each variant (--clock-control none) into $OUT/union_ncu.txt.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", default="16,32,64")
    ap.add_argument("--overlaps", default="high,mid,low,none")
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--one", default="", help="internal: run one variant once (for ncu): overlap,pred")
    args = ap.parse_args()
    import triton.testing

    from sparse_mla import SparseMLAWorkspace, default_group_size, sparse_mla_fwd
    from sparse_mla.bench.report import git_revision
    from sparse_mla.union.triton_tl import build_union, plan_groups
    from sparse_mla.workloads import synthetic_batch

    dev = torch.device("cuda")
    T, K = args.tokens, 2048

    def setup(overlap: str, H: int):
        b = synthetic_batch([0], [T], K, overlap, seed=0, device=dev)
        G = default_group_size(H)
        ws = SparseMLAWorkspace(T, K, G, b.num_kv_rows, dev)
        cu = torch.tensor([0, T], dtype=torch.int32, device=dev)
        return b, G, ws, cu

    def union(b, G, ws, cu, pred: bool) -> None:
        plan_groups(T, G, cu, ws.group_start, ws.group_len, ws.route[:T])
        build_union(b.indices, b.valid, b.num_kv_rows, G, ws.group_start, ws.group_len, ws.route[:T], ws.union_tables,
                    ws.union_table_bits, ws.union_rows, ws.union_bits, ws.union_len, predicated_cas=pred)

    def canonical(ws, n):
        ul = ws.union_len[:n].long()
        inu = torch.arange(ws.union_rows.shape[1], device=dev)[None] < ul[:, None]
        keys, order = torch.where(inu, ws.union_rows[:n], 2**31 - 1).sort(1)
        return ul.clone(), keys, torch.where(inu, ws.union_bits[:n], 0).gather(1, order)

    if args.one:
        ov, pred = args.one.split(",")
        b, G, ws, cu = setup(ov, 16)
        union(b, G, ws, cu, pred == "1")
        torch.cuda.synchronize()
        return 0

    rows = []
    print(f"{'overlap':8s} {'H':>3s} {'G':>3s} {'ratio':>6s} {'all-lane ms':>12s} {'pred ms':>8s} {'x':>6s} "
          f"{'attn ms':>8s} {'pred/attn':>9s} {'per-token ms':>12s}", flush=True)
    for ov in args.overlaps.split(","):
        for H in (int(h) for h in args.heads.split(",")):
            b, G, ws, cu = setup(ov, H)
            n = T // G
            res = {}
            for pred in (False, True):
                union(b, G, ws, cu, pred)
                res[pred] = canonical(ws, n)
                assert int(ws.union_tables.ne(-1).sum()) == 0 and int(ws.union_table_bits.ne(0).sum()) == 0, "tables not clean"
            same = all(torch.equal(x, y) for x, y in zip(res[False], res[True]))
            ms_all = triton.testing.do_bench(lambda: union(b, G, ws, cu, False), warmup=25, rep=100)
            ms_pred = triton.testing.do_bench(lambda: union(b, G, ws, cu, True), warmup=25, rep=100)
            ratio = float(res[True][0].double().mean() / b.valid[: n * G].double().view(n, G).mean(1).mean())
            q = torch.randn(T, H, 576, device=dev, dtype=torch.bfloat16)
            kv = torch.randn(b.num_kv_rows, 576, device=dev, dtype=torch.bfloat16)
            out = torch.empty(T, H, 512, device=dev, dtype=torch.bfloat16)
            ms_grouped = triton.testing.do_bench(lambda: sparse_mla_fwd(q, kv, b.indices, 0.07, topk_length=b.valid,
                                                                        method="grouped", cu_seqlens_q=cu, workspace=ws,
                                                                        out=out), warmup=25, rep=100)
            ms_pt = triton.testing.do_bench(lambda: sparse_mla_fwd(q, kv, b.indices, 0.07, topk_length=b.valid,
                                                                   method="per_token", out=out), warmup=25, rep=100)
            attn = ms_grouped - ms_pred  # the grouped call = union build (predicated, the default) + attention
            rows.append(dict(overlap=ov, heads=H, group_size=G, tokens=T, topk=K, union_ratio=ratio, same_union=same,
                             union_all_lanes_ms=ms_all, union_predicated_ms=ms_pred, grouped_total_ms=ms_grouped,
                             grouped_attention_ms=attn, per_token_ms=ms_pt))
            print(f"{ov:8s} {H:3d} {G:3d} {ratio:6.2f} {ms_all:12.3f} {ms_pred:8.3f} {ms_all / ms_pred:6.2f} {attn:8.3f} "
                  f"{ms_pred / attn:9.2f} {ms_pt:12.3f}{'' if same else '  UNION MISMATCH'}", flush=True)
            q = kv = out = ws = None  # free before the next case
            torch.cuda.empty_cache()
    out_dir = os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)
    doc = {"command": " ".join([sys.executable, *sys.argv]), "git_revision": git_revision(),
           "gpu": torch.cuda.get_device_name(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "triton": triton.__version__,
           "timing": "triton.testing.do_bench median, L2 flushed; grouped_attention_ms = grouped_total_ms - union_predicated_ms",
           "rows": rows}
    with open(os.path.join(out_dir, "union_profile.json"), "w") as f:
        json.dump(doc, f, indent=1)
    if args.ncu and shutil.which("ncu"):
        with open(os.path.join(out_dir, "union_ncu.txt"), "w") as f:
            for pred in ("0", "1"):
                cmd = ["ncu", "--clock-control", "none", "-k", "regex:_build_union_kernel", "-c", "1",
                       "--section", "SpeedOfLight", "--section", "MemoryWorkloadAnalysis", "--section", "WarpStateStats",
                       "--section", "LaunchStats", "--section", "Occupancy",
                       sys.executable, os.path.abspath(__file__), "--one", f"mid,{pred}"]
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
                f.write(f"### predicated_cas={pred}\n{r.stdout[-20000:]}\n{r.stderr[-3000:]}\n")
    return 0 if all(r["same_union"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
