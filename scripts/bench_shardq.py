"""ShardQ vs plain tensor parallelism: a thin launcher of ``sparse_mla.bench.shardq.run_shardq_bench``
(what it times and reports: that module's docstring; ``sparse-mla bench --tp W`` under torchrun
runs the same thing from the CLI).

Run on a 2-GPU box (it re-launches itself under torchrun when started plainly):

    python scripts/bench_shardq.py                      # GLM-5 + DeepSeek-V3.2, prompts 8K..64K
    torchrun --standalone --nproc-per-node 2 scripts/bench_shardq.py --tokens 8192,32768

CPU smoke test (gloo, Triton interpreter, fp16, tiny sizes; CUDA hidden from the ranks):

    python scripts/bench_shardq.py --device cpu --models glm-5 --tokens 40 --topk 16 --trials 1 --min-tokens 0

Writes $OUT/bench_shardq.json and .png (default ./out).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="glm-5,deepseek-v3.2", help="comma list of sparse_mla.workloads.MODELS names")
    ap.add_argument("--tokens", default="8192,16384,32768,65536", help="comma list of prompt lengths T")
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--overlap", default="mid", help="sparse_mla.workloads preset (high/mid/low/none/random)")
    ap.add_argument("--trials", type=int, default=8, help="timed iterations per variant")
    ap.add_argument("--no-check", action="store_true", help="skip the output comparisons")
    ap.add_argument("--nproc", type=int, default=2, help="ranks when the script launches torchrun itself")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu = gloo + Triton interpreter smoke test")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-tokens", type=int, default=1024, help="shardq_sparse_mla_fwd's min_tokens (TP below it)")
    return ap.parse_args(argv)


def main() -> int:
    args = parse_args(sys.argv[1:])
    if "LOCAL_RANK" not in os.environ:  # re-launch under torchrun, W = --nproc ranks
        env = dict(os.environ, NCCL_NVLS_ENABLE="0")
        if args.device == "cpu":
            env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               str(Path(__file__).resolve()), *sys.argv[1:]]
        print("launching:", " ".join(cmd), flush=True)
        return subprocess.call(cmd, env=env)

    from sparse_mla.bench.shardq import plot_shardq, print_shardq_table, run_shardq_bench

    W = int(os.environ["WORLD_SIZE"])
    doc = run_shardq_bench([(m, W) for m in args.models.split(",")], [int(x) for x in args.tokens.split(",")],
                           topk=args.topk, overlap=args.overlap, trials=args.trials, seed=args.seed,
                           check=not args.no_check, min_tokens=args.min_tokens)
    if doc is not None:  # rank 0
        out_dir = Path(os.environ.get("OUT", "./out"))
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "bench_shardq.json").write_text(json.dumps(doc, indent=1))
        plot_shardq(str(out_dir / "bench_shardq.png"), doc["results"])
        print_shardq_table(doc["results"])
        print(f"wrote {out_dir / 'bench_shardq.json'} and {out_dir / 'bench_shardq.png'}", flush=True)
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
