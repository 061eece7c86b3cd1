"""cProfile of the host side of one short layer call (issue 14): 32K cached + 256 new tokens, 16 heads.

    python scripts/host_profile_step.py [--path mqa_per_token] [--new 256]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import torch

from sparse_mla.bench.inputs import make_inputs
from sparse_mla.layer import dsa_prefill
from sparse_mla.workloads.models import MODELS


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", default="mqa_per_token")
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--model", default="glm-5")
    args = ap.parse_args()
    dev = torch.device("cuda")
    model = MODELS[args.model]
    inputs = make_inputs(model, 32768, args.new, 2048, 16, "mid", 0, dev, torch.bfloat16)
    out = torch.empty(args.new, 16, model.v_head_dim, dtype=torch.bfloat16, device=dev)
    for _ in range(5):
        dsa_prefill(**inputs, path=args.path, out=out)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        dsa_prefill(**inputs, path=args.path, out=out)
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(45)
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
