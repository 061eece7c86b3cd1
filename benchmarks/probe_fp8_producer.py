"""Where the FP8 Gluon kernel's time goes: the kv_fp8 bench's bf16 and fp8 rows with parts of the consumer
switched off (``gluon_sm90.config.ABLATE``: 2 no P.V, 8 no Q.K^T, 31 every consumer step off), so the producer's own
pace shows. Timing-only (the ablated results are wrong by design).

    python benchmarks/probe_fp8_producer.py --json out/probe_fp8.json [--heads 64] [--masks 0,10,31]
"""

from __future__ import annotations

import argparse
import sys

import torch

from sparse_mla.bench.common import fmt, print_rows, run_meta, timing_note, write_json
from sparse_mla.bench.kv_fp8 import run_case
from sparse_mla.mqa import gluon_sm90


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--grouped-heads", type=int, default=16)
    ap.add_argument("--masks", default="0,10,31")
    ap.add_argument("--json", default="out/probe_fp8.json")
    a = ap.parse_args()
    rows = []
    for mask in [int(m) for m in a.masks.split(",")]:
        gluon_sm90.config.ABLATE = mask
        for kind, H in (("per_token", a.heads), ("grouped", a.grouped_heads)):
            for r in run_case(kind, H, 8192, 2048, 32768, dtype=torch.bfloat16, device=torch.device("cuda"), trials=2,
                              scale_format="ue8m0", sweep=False):
                if r["variant"] in ("bf16", "fp8"):
                    r["ablate"] = mask
                    rows.append(r)
    gluon_sm90.config.ABLATE = 0
    meta = run_meta(command="python benchmarks/probe_fp8_producer.py " + " ".join(sys.argv[1:]),
                    timing=timing_note(trials=2), fp8_producer_regs=gluon_sm90.config.FP8_PRODUCER_REGS)
    write_json(a.json, meta, rows)
    print_rows("FP8 producer probe: ms per call", rows, {
        "ablate": lambda r: str(r["ablate"]), "case": lambda r: r["case"], "variant": lambda r: r["variant"],
        "ms": lambda r: fmt(r.get("ms"), ".3f")}, left=(1, 2))


if __name__ == "__main__":
    main()
