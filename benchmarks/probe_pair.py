"""Two measurements for the pair schedule, both with their baseline in the same run:

1. per token at 16 / 32 heads over token counts: the Gluon pair kernel against the Triton kernel (the backend
   selection's few-heads rule, ``backends.triton_small_tiles_win``, was fitted to the split schedule);
2. grouped tiles with O stored through the Q buffer (row-contiguous 16-byte pieces) against the direct store
   (``gluon_sm90.config.variant_constexprs`` keeps the direct store for grouped tiles).

    python benchmarks/probe_pair.py --json results/probe-pair.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_gluon import grouped_rows, per_token_rows, print_table, write_rows  # noqa: E402

from sparse_mla.mqa import gluon_sm90  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, help="where to write the results JSON")
    a = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for H in (16, 32):
        for T in (2048, 4096, 16384):
            for r in per_token_rows(H, T, 2048, max(32768, T + 4096), dev, ["gluon_sm90:pair", "triton"]):
                r["case"] += f" T{T}"
                rows.append(r)
    plain = gluon_sm90.config.variant_constexprs
    for via_smem in (False, True):
        gluon_sm90.config.variant_constexprs = (lambda *args, **kw: plain(*args, **kw) | {"O_VIA_SMEM": True}) \
            if via_smem else plain
        try:
            for H in (16, 32, 8):
                for r in grouped_rows(H, 16384, 8192, 2048, dev, ["gluon_sm90:pair"]):
                    r["case"] += " O via smem" if via_smem else " O direct"
                    rows.append(r)
        finally:
            gluon_sm90.config.variant_constexprs = plain
    write_rows(a.json, rows)
    print_table(rows)


if __name__ == "__main__":
    main()
