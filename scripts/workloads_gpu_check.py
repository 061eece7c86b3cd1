"""GPU check of the synthetic top-k generator: speed, contract and union ratios on CUDA.

Run on a GPU box from the repository root:

    OUT=./out python scripts/workloads_gpu_check.py            # all presets, T = 16K, 32K, 64K
    OUT=./out python scripts/workloads_gpu_check.py --quick    # T = 16K only

For each preset and each prefill (cached 0, new T; and cached 28672, new 4096, the calibration
point), it times ``synthetic_topk`` on the GPU (synchronized wall time, after one warm-up
call), checks the contract (int32 [T, 2048], valid = min(topk, p + 1), -1 padding, causal,
distinct rows) and measures the union ratio for G = 2, 4, 8, 16. At the calibration point the
ratios must be within 0.02 of the CPU-calibrated table in ``sparse_mla/workloads/topk.py``.
Prints a table, writes ``$OUT/workloads_gpu.json`` and exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

import torch

from sparse_mla.workloads import OVERLAP_PRESETS, synthetic_topk, union_ratio

TOPK = 2048
GROUPS = (2, 4, 8, 16)
# cached 28672, new 4096, topk 2048 (topk.py docstring; CPU generator, seed 0)
CALIBRATED = {
    "high": (1.150, 1.198, 1.200, 1.204),
    "mid": (1.150, 1.327, 1.401, 1.548),
    "low": (1.150, 1.447, 1.701, 1.844),
    "none": (2.000, 4.000, 8.000, 14.997),
    "random": (1.933, 3.617, 6.362, 10.023),
}


def contract_errors(pos: torch.Tensor, valid: torch.Tensor, cached: int) -> list[str]:
    errs = []
    new = pos.shape[0]
    if pos.dtype != torch.int32 or pos.shape != (new, TOPK) or valid.dtype != torch.int32:
        errs.append(f"bad dtype/shape {pos.dtype} {tuple(pos.shape)} {valid.dtype}")
        return errs
    p = torch.arange(new, device=pos.device) + cached
    if not torch.equal(valid.long(), torch.clamp(p + 1, max=TOPK)):
        errs.append("valid != min(topk, p + 1)")
    pad = torch.arange(TOPK, device=pos.device)[None, :] >= valid[:, None]
    if bool((pos[pad] != -1).any()):
        errs.append("padding is not -1")
    if bool((pos[~pad] < 0).any()):
        errs.append("negative entry inside the valid part")
    if bool((pos > p[:, None]).any()):
        errs.append("not causal")
    s = torch.where(pad, torch.iinfo(torch.int32).max, pos).sort(dim=1).values
    if bool(((s[:, 1:] == s[:, :-1]) & ~pad[:, 1:]).any()):
        errs.append("repeated row within a list")
    return errs


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except Exception:
        return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="T = 16K only")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    out_dir = os.environ.get("OUT", "./out")
    os.makedirs(out_dir, exist_ok=True)
    cases = [(28672, 4096)] + [(0, T) for T in ((16384,) if args.quick else (16384, 32768, 65536))]
    synthetic_topk(1000, 512, TOPK, "mid", device=dev)  # warm-up
    rows, failed = [], False
    heads = "  ".join(f"{'G=' + str(g):>6s}" for g in GROUPS)
    print(f"{'preset':7s} {'cached':>6s} {'new':>6s} {'gen_s':>7s}  {heads}  check")
    for cached, new in cases:
        for name in OVERLAP_PRESETS:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            pos, valid = synthetic_topk(cached, new, TOPK, name, seed=0, device=dev)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            errs = contract_errors(pos, valid, cached)
            ratios = [union_ratio(pos, valid, g).ratio_mean for g in GROUPS]
            if (cached, new) == (28672, 4096):
                for g, r, ref in zip(GROUPS, ratios, CALIBRATED[name]):
                    if abs(r - ref) > 0.02:
                        errs.append(f"G={g} ratio {r:.3f} vs calibrated {ref:.3f}")
            failed |= bool(errs)
            print(f"{name:7s} {cached:6d} {new:6d} {dt:7.3f}  " + "  ".join(f"{r:6.3f}" for r in ratios)
                  + "  " + ("ok" if not errs else "FAIL: " + "; ".join(errs)), flush=True)
            rows.append({"preset": name, "cached": cached, "new": new, "topk": TOPK, "gen_seconds": dt,
                         "union_ratio": dict(zip(map(str, GROUPS), ratios)), "errors": errs})
            del pos, valid
    report = {"gpu": torch.cuda.get_device_name(), "commit": git_commit(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "torch": torch.__version__, "rows": rows}
    path = os.path.join(out_dir, "workloads_gpu.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}; {'FAILED' if failed else 'all checks passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
