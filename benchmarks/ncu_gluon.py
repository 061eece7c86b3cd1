"""One launch of the Gluon sparse MQA kernel (per token, T tokens, H heads, topk 2048, 32K rows) to profile
under Nsight Compute, e.g.

    ncu --kernel-name regex:sparse_mqa --launch-skip 2 --launch-count 1 --set full \
        python benchmarks/ncu_gluon.py --heads 64 --tokens 2048 [--schedule pair|split] [--kv-dtype fp8]

``--kernel flashmla`` launches FlashMLA's sparse prefill on the same tensors instead (``flashmla_sm90`` on PYTHONPATH,
benchmarks/flashmla/build.py; its kernel is ``sparse_attn_fwd_kernel``): profile both with one ncu command line,
``--kernel-name regex:"sparse_mqa|sparse_attn"``.
"""

from __future__ import annotations

import argparse
import os

import torch

from sparse_mla import sparse_mla_fwd
from sparse_mla.mqa import gluon_sm90


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--schedule", default=gluon_sm90.config.SCHEDULE, choices=gluon_sm90.SCHEDULES)
    ap.add_argument("--kernel", default="sparse_mla", choices=("sparse_mla", "flashmla"),
                    help="whose kernel runs: this package's (sparse_mla_fwd) or FlashMLA's sparse prefill (bf16 only)")
    ap.add_argument("--kv-dtype", default="bf16", choices=("bf16", "fp8"),
                    help="fp8: the cache as fp8_ds_mla rows (ue8m0 scales; an FP8 cache runs the split schedule "
                    "whatever --schedule says: gluon_sm90.schedule_for)")
    ap.add_argument("--d-qk", type=int, default=576, choices=(576, 512), help="q / kv row width (512: no RoPE part)")
    ap.add_argument("--sink", action="store_true", help="attn_sink [H] and topk_length [T] (all of topk), the "
                    "flash_mla_sparse_fwd form")
    a = ap.parse_args()
    os.environ["SPARSE_MLA_MQA_BACKEND"] = "gluon_sm90"
    gluon_sm90.config.SCHEDULE = a.schedule
    dev = torch.device("cuda")
    T, H, N, K = a.tokens, a.heads, 32768, 2048
    torch.manual_seed(0)
    D = a.d_qk
    q = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(N, D, device=dev, dtype=torch.bfloat16)
    idx = torch.rand(T, N, device=dev).topk(K, dim=1).indices.to(torch.int32)
    kw, sink_kw = {}, {}
    if a.sink:
        sink_kw = dict(attn_sink=torch.randn(H, device=dev), topk_length=torch.full((T,), K, device=dev,
                                                                                    dtype=torch.int32))
    if a.kv_dtype == "fp8":
        from sparse_mla.kv_format import FP8_DS_MLA

        kv, kw = FP8_DS_MLA.quantize(kv), {"kv_format": "fp8_ds_mla"}
    if a.kernel == "flashmla":
        if kw:
            raise SystemExit("--kernel flashmla takes a bf16 cache only (FlashMLA's sparse prefill)")
        from sparse_mla.bench.baselines import flash_mla_fwd

        fm = flash_mla_fwd()
        if fm is None:
            raise SystemExit("FlashMLA is not importable: build it with benchmarks/flashmla/build.py, put it on PYTHONPATH")
        call = lambda: fm(q, kv[:, None, :], idx[:, None, :], D ** -0.5, d_v=512, **sink_kw)  # noqa: E731
    else:
        call = lambda: sparse_mla_fwd(q, kv, idx, D ** -0.5, **kw, **sink_kw)  # noqa: E731
    for _ in range(3):
        call()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
