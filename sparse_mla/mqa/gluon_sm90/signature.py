"""The run-time argument list of both Gluon kernels, written once.

Each entry: name, type for the ahead-of-time compile (pointers by dtype), and how a launch specializes it:
ALIGNED = 16-divisible (``sparse_mla.mqa.backends`` checks it; cp.async needs it), RUNTIME = never specialized
(``do_not_specialize``: integers that change between calls, index-side pointers), DEFAULT = Triton's rule (a float).
The ``def`` lines of ``split.sparse_mqa_sm90_kernel`` and ``pair.sparse_mqa_sm90_pair_kernel`` must start with these
names in this order (Triton reads a kernel's parameters from its source); ``check_kernel`` holds them to it.
"""

from __future__ import annotations

ALIGNED, RUNTIME, DEFAULT = "aligned", "runtime", "default"

KERNEL_ARGS = (
    ("q_ptr", "*{dt}", ALIGNED), ("kv_ptr", "*{dt}", ALIGNED), ("rows_ptr", "*i32", RUNTIME),
    ("bits_ptr", "*i32", RUNTIME), ("nrows_ptr", "*i32", RUNTIME), ("gstart_ptr", "*i32", RUNTIME),
    ("glen_ptr", "*i32", RUNTIME), ("route_ptr", "*i8", RUNTIME), ("out_ptr", "*{dt}", ALIGNED),
    ("lse_ptr", "*fp32", RUNTIME), ("stride_qt", "i32", ALIGNED), ("stride_qh", "i32", ALIGNED),
    ("stride_kvn", "i32", ALIGNED), ("row_stride", "i32", RUNTIME), ("stride_ot", "i32", ALIGNED),
    ("stride_oh", "i32", ALIGNED), ("stride_lt", "i32", RUNTIME), ("N", "i32", RUNTIME), ("H", "i32", RUNTIME),
    ("K", "i32", RUNTIME), ("qk_scale", "fp32", DEFAULT), ("m_blocks", "i32", RUNTIME),
    ("group_heads", "i32", RUNTIME), ("has_nrows", "i32", RUNTIME), ("has_route", "i32", RUNTIME),
    ("has_lse", "i32", RUNTIME), ("sink_ptr", "*fp32", RUNTIME), ("maxl_ptr", "*fp32", RUNTIME),
    ("stride_mt", "i32", RUNTIME), ("has_sink", "i32", RUNTIME), ("has_maxl", "i32", RUNTIME),
    ("num_work", "i32", RUNTIME), ("num_splits", "i32", RUNTIME),
)
ARG_NAMES = tuple(name for name, _, _ in KERNEL_ARGS)
DO_NOT_SPECIALIZE = [name for name, _, spec in KERNEL_ARGS if spec == RUNTIME]
ALIGNED_ARGS = tuple(name for name, _, spec in KERNEL_ARGS if spec == ALIGNED)


def aot_signature(dtype: str, kv_fp8: bool, kv_split: bool = False) -> dict[str, str]:
    """``triton.compile`` types of the run-time arguments for q's dtype ("bf16" / "fp16")."""
    sig = {name: ty.format(dt=dtype) for name, ty, _ in KERNEL_ARGS}
    if kv_fp8:
        sig["kv_ptr"] = "*u8"  # the cache's byte rows
    if kv_split:
        sig["out_ptr"] = "*fp32"  # the split partials (sparse_mla.mqa.split_combine)
    return sig


def check_kernel(kernel) -> None:
    """Raise unless ``kernel``'s parameters start with ``ARG_NAMES`` (then come its constexprs)."""
    names = tuple(kernel.arg_names[:len(ARG_NAMES)])
    if names != ARG_NAMES:
        raise AssertionError(f"{kernel.fn.__name__}: parameters {names} != signature.ARG_NAMES {ARG_NAMES}")
