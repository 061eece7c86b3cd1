"""Build FlashMLA's SM90 sparse prefill kernel as a torch extension, for side-by-side benchmarks.

FlashMLA's 2026-09-30 release removed Hopper; its last Hopper commit (ba89a346; 9241ae3 has the same SM90 sparse
prefill) is what Hopper engines run. This script compiles only that kernel (csrc/sm90/prefill/sparse: fwd.cu and
the four phase-1 instantiations) plus this folder's binding (``sm90_sparse_prefill.cpp``, which adds ba89a346's
optional ``out=``), from a FlashMLA source tree you supply with CUTLASS's headers at ``csrc/cutlass/include``
(FlashMLA's submodule, commit 147f5673). None of FlashMLA's or CUTLASS's code is part of this repository.

    python benchmarks/flashmla/build.py --src /path/to/FlashMLA --build-dir .flashmla/build
    PYTHONPATH=.flashmla/build python -m sparse_mla.bench.op   # the op bench finds ``flashmla_sm90``

About 70 s on the H200 machine (16 cores). The module is ``flashmla_sm90`` with one function,
``sparse_prefill_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, out=None)``
-> [out, max_logits, lse] (FlashMLA's call: q [s_q, 64 | 128, d_qk] bf16, kv [s_kv, 1, d_qk], indices [s_q, 1, topk]).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
KERNEL_SOURCES = ("csrc/sm90/prefill/sparse/fwd.cu",
                  "csrc/sm90/prefill/sparse/instantiations/phase1_k512.cu",
                  "csrc/sm90/prefill/sparse/instantiations/phase1_k512_topklen.cu",
                  "csrc/sm90/prefill/sparse/instantiations/phase1_k576.cu",
                  "csrc/sm90/prefill/sparse/instantiations/phase1_k576_topklen.cu")
NVCC_FLAGS = ["-O3", "-std=c++20", "-DNDEBUG", "-D_USE_MATH_DEFINES", "-Wno-deprecated-declarations",
              "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
              "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "--expt-relaxed-constexpr", "--expt-extended-lambda",
              "--use_fast_math", "-lineinfo", "-gencode", "arch=compute_90a,code=sm_90a"]


def build(src: Path, build_dir: Path, verbose: bool = False):
    """Compile and load the extension; returns the module (``flashmla_sm90``).

    Raises:
        FileNotFoundError: a kernel source or the CUTLASS headers are missing under ``src``.
    """
    from torch.utils.cpp_extension import load

    missing = [s for s in KERNEL_SOURCES if not (src / s).is_file()]
    if not (src / "csrc/cutlass/include/cute").is_dir():
        missing.append("csrc/cutlass/include/cute (CUTLASS headers)")
    if missing:
        raise FileNotFoundError(f"not a FlashMLA source tree with CUTLASS headers ({src}): missing {missing}")
    build_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
    includes = [src / "csrc", src / "csrc/sm90", src / "csrc/kerutils/include", src / "csrc/cutlass/include",
                src / "csrc/cutlass/tools/util/include"]
    return load(name="flashmla_sm90", sources=[str(HERE / "sm90_sparse_prefill.cpp")] + [str(src / s) for s in KERNEL_SOURCES],
                extra_include_paths=[str(p) for p in includes], extra_cflags=["-O3", "-std=c++20", "-DNDEBUG"],
                extra_cuda_cflags=NVCC_FLAGS, build_directory=str(build_dir), verbose=verbose)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", type=Path, required=True, help="FlashMLA source tree (with csrc/cutlass/include)")
    ap.add_argument("--build-dir", type=Path, default=Path(".flashmla/build"), help="where the .so goes")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.time()
    mod = build(args.src.resolve(), args.build_dir.resolve(), args.verbose)
    print(f"built {mod.__file__} in {time.time() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
