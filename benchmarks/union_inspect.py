"""``build_group_union`` (the inspection API) per builder on the same lists: the sorting CUDA kernel
(``SPARSE_MLA_UNION_SORTED=1``, ``sparse_mla/union/cuda_sorted.cu``), the CUDA hash builder + torch sort
(``SPARSE_MLA_UNION_BACKEND=cuda_smem``) and the Triton builder + torch sort, with every output tensor compared
between them (issue 43, item 5: <= 1 ms at 46K tokens, G 8). Lists: ``synthetic_batch`` causal prompts, top-2048.

    python benchmarks/union_inspect.py --json out/union-inspect.json [--cases 46080:8:mid,16384:8:mid,8192:16:mid]
"""

from __future__ import annotations

import argparse
import os

import torch

from sparse_mla import build_group_union, env
from sparse_mla.bench.common import print_rows, run_meta, timing_note, write_json
from sparse_mla.bench.timing import median_ms
from sparse_mla.workloads import synthetic_batch

BUILDERS = {  # name -> (SPARSE_MLA_UNION_BACKEND, SPARSE_MLA_UNION_SORTED)
    "cuda_sorted": ("auto", "1"),
    "cuda_smem_sort": ("cuda_smem", "0"),
    "triton_sort": ("triton", "0"),
}
DEFAULT_CASES = "46080:8:mid,16384:8:mid,8192:16:mid,16384:8:none,46080:16:mid"


def time_case(tokens: int, G: int, lists: str, topk: int = 2048) -> dict:
    dev = torch.device("cuda")
    b = synthetic_batch([0], [tokens], topk, lists, seed=0, device=dev)
    row: dict = dict(tokens=tokens, G=G, lists=lists, topk=topk)
    outs = {}
    for name, (backend, sorted_kernel) in BUILDERS.items():
        os.environ[env.UNION_BACKEND.name], os.environ[env.UNION_SORTED.name] = backend, sorted_kernel
        fn = lambda: build_group_union(b.indices, G, topk_length=b.valid, num_kv_rows=tokens)  # noqa: E731
        try:
            outs[name] = fn()
            torch.cuda.synchronize()
            row[f"{name}_ms"] = median_ms(fn, warmup_ms=30, rep_ms=200)
        except Exception as exc:  # recorded: e.g. the hash table cannot hold G * K entries at G 16
            row[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:300]
    for switch in (env.UNION_BACKEND, env.UNION_SORTED):
        os.environ.pop(switch.name, None)
    names = list(outs)
    if names:
        first = outs[names[0]]
        row["mean_union"] = float(first.lengths.float().mean())
        row["equal"] = all(torch.equal(first.rows, u.rows) and torch.equal(first.member_mask, u.member_mask)
                           and torch.equal(first.lengths, u.lengths) for u in outs.values())
        row["compared"] = names
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True, help="write the rows here")
    ap.add_argument("--cases", default=DEFAULT_CASES, help="comma-separated tokens:G:lists")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    rows = []
    for spec in a.cases.split(","):
        tokens, G, lists = spec.split(":")
        rows.append(time_case(int(tokens), int(G), lists))
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    write_json(a.json, run_meta(timing=timing_note(warmup_ms=30, rep_ms=200)), rows)
    ms = lambda k: (lambda r: f"{r[k]:.3f}" if k in r else "-")  # noqa: E731
    print_rows("build_group_union", rows, {
        "tokens": lambda r: str(r["tokens"]), "G": lambda r: str(r["G"]), "lists": lambda r: r["lists"],
        **{name: ms(f"{name}_ms") for name in BUILDERS}, "equal": lambda r: str(r.get("equal"))})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
