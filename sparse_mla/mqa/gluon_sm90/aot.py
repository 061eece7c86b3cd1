"""Ahead-of-time compile of one variant for sm_<arch> on a CPU (no GPU needed)."""

from __future__ import annotations

import triton

from . import config, l2_hints
from .gluon_api import GLUON_IMPORT_ERROR
from .signature import ALIGNED_ARGS, ARG_NAMES, aot_signature


def compile_variant(grouped: bool, has_pe: bool, dtype: str, schedule: str, kv_fp8: bool = False, kv_split: bool = False,
                    arch: int = 90, wide_n: bool = False):
    """Compile one variant for ``sm_<arch>`` without a GPU (Triton's front end, LLVM and ptxas run on
    the CPU); returns the CompiledKernel (``.metadata.shared`` bytes, ``.n_regs`` / ``.n_spills``
    where the backend fills them, ``.asm["ptx"]``). ``wide_n``: kv rows N typed int64, as a launch over a cache of
    2**31 rows or more specializes it (``launcher._N_ARG``). Raises whatever Triton raises on an API drift or a
    resource overflow."""
    if GLUON_IMPORT_ERROR is not None:
        raise RuntimeError(f"Gluon is not importable: {GLUON_IMPORT_ERROR}")
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from .launcher import _kernel_for

    signature = aot_signature(dtype, kv_fp8, kv_split)
    if wide_n:
        signature["N"] = "i64"
    cx = config.variant_constexprs(grouped, has_pe, schedule, kv_fp8, kv_split)
    signature.update({k: "constexpr" for k in cx})
    attrs = {(ARG_NAMES.index(n), ): [["tt.divisibility", 16]] for n in ALIGNED_ARGS}
    src = GluonASTSource(_kernel_for(schedule), signature, constexprs=cx, attrs=attrs)
    if cx["KV_EVICT"]:  # its kv copies get the L2 hints, as at launch
        l2_hints.install()
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": cx["num_warps"]})
