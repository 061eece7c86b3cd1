"""Build FlashMLA's SM90 sparse prefill kernel (and its sparse decode) as torch extensions, for side-by-side benchmarks.

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

The sparse decode (FP8 cache), best effort: built on the H200 once (CUDA 13.0, torch 2.11, 37 s; its outputs matched
``flash_mla_with_kvcache_ref`` in a smoke run of the decode suite), not part of any test. With ``--decode`` (default: whenever the tree has its sources, i.e. FlashMLA 9241ae3 or a tree with the same
``csrc/params.h``), a second extension ``flashmla_sm90_decode`` from ``DECODE_SOURCES`` (the V3.2 layout's two
instantiations of csrc/sm90/decode/sparse_fp8, the schedule-metadata and combine kernels of csrc/smxx/decode) and this
folder's binding ``sm90_sparse_decode.cpp``, built in ``BUILD_DIR/decode`` and copied next to ``flashmla_sm90``, so the
same ``PYTHONPATH`` finds both. Its function ``sparse_decode_fwd(q, k_cache, indices, topk_length=None,
attn_sink=None, tile_scheduler_metadata=None, num_splits=None, d_v=512, sm_scale=None)`` -> [out, lse,
tile_scheduler_metadata, num_splits] is FlashMLA's ``flash_mla_cuda.sparse_decode_fwd`` without the second cache
(``sparse_mla.bench.baselines.flash_mla_decode`` calls it). Its kernels also get FlashMLA's
``--ptxas-options=--register-usage-level=10`` (``--decode-ptxas-options``; '' for none). A decode build that fails
leaves the prefill extension built (exit status 1 with ``--decode``, a warning otherwise); ``--no-decode`` builds the
prefill extension alone, exactly as before.

    python benchmarks/flashmla/build.py --src /path/to/FlashMLA --build-dir .flashmla/build --decode
    PYTHONPATH=.flashmla/build sparse-mla bench --op-suite decode
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
KERNEL_SOURCES = ("csrc/sm90/prefill/sparse/fwd.cu",
                  "csrc/sm90/prefill/sparse/instantiations/phase1_k512.cu",
                  "csrc/sm90/prefill/sparse/instantiations/phase1_k512_topklen.cu",
                  "csrc/sm90/prefill/sparse/instantiations/phase1_k576.cu",
                  "csrc/sm90/prefill/sparse/instantiations/phase1_k576_topklen.cu")
DECODE_SOURCES = ("csrc/sm90/decode/sparse_fp8/instantiations/v32_persistent_h64.cu",
                  "csrc/sm90/decode/sparse_fp8/instantiations/v32_persistent_h128.cu",
                  "csrc/smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu",
                  "csrc/smxx/decode/combine/combine.cu")
DECODE_PTXAS_OPTIONS = "--register-usage-level=10"  # FlashMLA's setup.py passes it for all its kernels
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

    missing = missing_sources(src, KERNEL_SOURCES)
    if missing:
        raise FileNotFoundError(f"not a FlashMLA source tree with CUTLASS headers ({src}): missing {missing}")
    build_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
    return load(name="flashmla_sm90", sources=[str(HERE / "sm90_sparse_prefill.cpp")] + [str(src / s) for s in KERNEL_SOURCES],
                extra_include_paths=_includes(src), extra_cflags=["-O3", "-std=c++20", "-DNDEBUG"],
                extra_cuda_cflags=NVCC_FLAGS, build_directory=str(build_dir), verbose=verbose)


def missing_sources(src: Path, sources: tuple[str, ...]) -> list[str]:
    """The files of ``sources`` (and the CUTLASS headers) that the tree ``src`` lacks."""
    missing = [s for s in sources if not (src / s).is_file()]
    if not (src / "csrc/cutlass/include/cute").is_dir():
        missing.append("csrc/cutlass/include/cute (CUTLASS headers)")
    return missing


def _includes(src: Path) -> list[str]:
    return [str(src / p) for p in ("csrc", "csrc/sm90", "csrc/kerutils/include", "csrc/cutlass/include",
                                   "csrc/cutlass/tools/util/include")]


def build_decode(src: Path, build_dir: Path, verbose: bool = False, ptxas_options: str = DECODE_PTXAS_OPTIONS):
    """Compile and load FlashMLA's SM90 sparse decode (``flashmla_sm90_decode``) in ``build_dir/decode``, copy the
    library into ``build_dir``; returns the module.

    Raises:
        FileNotFoundError: a decode source or the CUTLASS headers are missing under ``src``.
    """
    from torch.utils.cpp_extension import load

    missing = missing_sources(src, DECODE_SOURCES)
    if missing:
        raise FileNotFoundError(f"FlashMLA's sparse decode sources are not in {src}: missing {missing}")
    sub = build_dir / "decode"
    sub.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
    flags = NVCC_FLAGS + ([f"--ptxas-options={ptxas_options}"] if ptxas_options else [])
    mod = load(name="flashmla_sm90_decode", sources=[str(HERE / "sm90_sparse_decode.cpp")] + [str(src / s) for s in DECODE_SOURCES],
               extra_include_paths=_includes(src), extra_cflags=["-O3", "-std=c++20", "-DNDEBUG"],
               extra_cuda_cflags=flags, build_directory=str(sub), verbose=verbose)
    lib = Path(mod.__file__)
    if lib.parent.resolve() != build_dir.resolve():
        shutil.copy2(lib, build_dir / lib.name)
    return mod


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", type=Path, required=True, help="FlashMLA source tree (with csrc/cutlass/include)")
    ap.add_argument("--build-dir", type=Path, default=Path(".flashmla/build"), help="where the .so goes")
    ap.add_argument("--decode", action=argparse.BooleanOptionalAction, default=None,
                    help="also build FlashMLA's SM90 sparse decode (flashmla_sm90_decode, best effort); "
                         "default: when the tree has its sources, a failure then only warns")
    ap.add_argument("--decode-ptxas-options", default=DECODE_PTXAS_OPTIONS,
                    help="ptxas options of the decode kernels (FlashMLA's; '' for none)")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    src, build_dir = args.src.resolve(), args.build_dir.resolve()
    t0 = time.time()
    mod = build(src, build_dir, args.verbose)
    print(f"built {mod.__file__} in {time.time() - t0:.0f} s", file=sys.stderr)
    if args.decode is False:
        return 0
    missing = missing_sources(src, DECODE_SOURCES)
    if missing and args.decode is None:
        print(f"no sparse decode sources in {src} ({missing[0]} missing): built the prefill extension only",
              file=sys.stderr)
        return 0
    t0 = time.time()
    try:
        mod = build_decode(src, build_dir, args.verbose, args.decode_ptxas_options)
    except Exception as e:  # best effort: the prefill extension stays built
        print(f"FlashMLA's sparse decode did not build ({type(e).__name__}: {e}); the prefill extension is built",
              file=sys.stderr)
        return 1 if args.decode else 0
    print(f"built {mod.__file__} in {time.time() - t0:.0f} s (copied into {build_dir})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
