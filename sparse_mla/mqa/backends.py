"""The one selection point of the sparse MQA attention backend (per-token and grouped launches).

Backends:

* ``"gluon_sm90"``: ``sparse_mla.mqa.gluon_sm90``, the warp-specialized Hopper kernel. Applies on a
  CUDA device of compute capability 9.0 (wgmma is sm_90a-only), with a Triton whose Gluon API the
  kernel is written against (``gluon_sm90.SUPPORTED_TRITON``), not under ``TRITON_INTERPRET=1``,
  bf16 / fp16, and 16-byte aligned q, kv, out (base pointers and row strides; cp.async moves 16 B). An FP8
  ``fp8_ds_mla`` cache (kv the uint8 rows [N, 656]) runs it with bf16 q on the "split" schedule (its producer
  dequantizes in registers); otherwise such a cache runs the Triton kernel (``fp8_kv_reason``).
* ``"triton"``: ``sparse_mla.mqa.triton_tl``, the portable kernel: every other case, and the
  CPU-tested twin every other backend is held to.

``choose_backend`` decides (``Choice(backend, reason)``; ``describe_for_device`` applies its rule without
tensors). ``SPARSE_MLA_MQA_BACKEND`` = ``auto`` (default) | ``triton`` | ``gluon_sm90`` forces one; forcing a
backend that does not apply raises ``ValueError`` with the reason. Each launch logs one debug line
(logger ``sparse_mla``) naming the backend and why; ``describe_backend`` gives the same text.
"""

from __future__ import annotations

import logging

import torch

from .. import env
from ..choices import Choice, deprecated_alias, line
from . import triton_tl

logger = logging.getLogger("sparse_mla")

BACKENDS = ("triton", "gluon_sm90")
ENV_VAR = env.MQA_BACKEND.name
LABEL = "attention backend"  # its row of sparse_mla.choices.DECISIONS


def fp8_kv_reason(dtype: torch.dtype, d_qk: int = 576) -> str | None:
    """Why the Gluon kernel cannot take an fp8_ds_mla cache with q of this dtype and head dim (D_qk), or None
    when it can (bf16 q, D_qk 576; such a cache runs the split schedule, ``gluon_sm90.schedule_for``)."""
    if dtype != torch.bfloat16:
        return f"kv is an fp8_ds_mla cache and q is {dtype}: the Gluon FP8 variant takes bf16 q (bf16 RoPE rows)"
    if d_qk != 576:
        return f"kv is an fp8_ds_mla cache and q has D_qk {d_qk}: the format's rows are 576 wide"
    return None


def _capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def gluon_sm90_device_applies(device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """The device, Triton and dtype part of ``gluon_sm90_applies`` (no tensors needed)."""
    if env.interpreted():
        return False, "TRITON_INTERPRET=1 (the interpreter runs tl kernels only)"
    cap = _capability(device)
    if cap is None:
        return False, f"q is on {device}, not a CUDA device"
    if cap != (9, 0):
        return False, f"compute capability {cap[0]}.{cap[1]}: the kernel uses sm_90a wgmma (Hopper only)"
    from . import gluon_sm90

    if gluon_sm90.GLUON_IMPORT_ERROR is not None:
        return False, f"Gluon is not importable ({gluon_sm90.GLUON_IMPORT_ERROR})"
    if not gluon_sm90.triton_version_supported():
        import triton

        return False, (f"triton {triton.__version__}: the Gluon kernel is written against triton "
                       f"{', '.join(gluon_sm90.SUPPORTED_TRITON)}.x (its API changes between releases)")
    if dtype not in (torch.bfloat16, torch.float16):
        return False, f"dtype {dtype} (bf16 / fp16 only)"
    return True, "Hopper (sm_90) with triton " + ", ".join(gluon_sm90.SUPPORTED_TRITON)


def gluon_sm90_applies(q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor | None = None) -> tuple[bool, str]:
    """Whether the Gluon sm_90 kernel can run on these tensors, with the reason when it cannot.

    q [T, H, D_qk], kv [N, D_qk] (flattened rows), out [T, H, 512] or None (allocated contiguous).
    Plain Python over tensor metadata: no device sync, no CUDA query beyond the device capability.
    """
    ok, why = gluon_sm90_device_applies(q.device, q.dtype)
    if not ok:
        return ok, why
    if kv.dtype == torch.uint8:  # the validated byte rows [N, 656] of kv_format="fp8_ds_mla" (sparse_mla.kv_format)
        fp8_why = fp8_kv_reason(q.dtype, q.shape[-1])
        if fp8_why is not None:
            return False, fp8_why
    tensors = [("q", q, (0, 1)), ("kv", kv, (0, ))] + ([("out", out, (0, 1))] if out is not None else [])
    for name, t, dims in tensors:
        if t.stride(-1) != 1:
            return False, f"{name} has last-dim stride {t.stride(-1)} (cp.async needs contiguous rows)"
        if t.data_ptr() % 16:
            return False, f"{name} is not 16-byte aligned (cp.async moves 16 B)"
        bad = [d for d in dims if t.stride(d) % 16]
        if bad:
            return False, (f"{name} stride {t.stride(bad[0])} along dim {bad[0]} is not a multiple of 16 elements "
                           "(the compiled Gluon variants assume 16-divisible strides, gluon_sm90.signature.ALIGNED_ARGS)")
    return True, why


# The few-heads rule (``triton_small_tiles_win``), split schedule only: its 64-row tile loses to the Triton kernel's
# 16 / 32-row tiles below GLUON_MIN_PSEUDO_HEADS pseudo-heads per tile (results/gluon-v3.json: per token, 8K tokens,
# 16 heads 5.47 vs 4.14 ms), on steps of more than GLUON_FEW_HEADS_MAX_TOKENS tokens (on short ones Triton's few
# 16-row programs do not fill the GPU: results/bench-a704472.json, layer calls, weak evidence; 1K-8K tokens
# unmeasured). The pair schedule has no such rule: without it the layer bench's per-token calls at 16 heads run 2-5%
# faster and its grouped calls stay within 3.4% (results/bench-0cfdc34-rule.json vs -norule.json). Grouped tiles hold
# G * H = 128 pseudo-heads. Neither limit applies to an fp8_ds_mla cache (the Triton kernel's FP8 gather: 15.7 ms vs
# 4.65 ms on a bf16 cache, 16 heads, 8K tokens, results/bench-fp8-cf14b70.json).
GLUON_MIN_PSEUDO_HEADS = 32
GLUON_FEW_HEADS_MAX_TOKENS = 1024


def triton_small_tiles_win(pseudo_heads: int, num_tokens: int, kv_fp8: bool) -> bool:
    """Whether the automatic choice takes the Triton kernel although the Gluon one applies: fewer than
    ``GLUON_MIN_PSEUDO_HEADS`` pseudo-heads per tile on more than ``GLUON_FEW_HEADS_MAX_TOKENS`` tokens of a bf16 /
    fp16 cache when the Gluon kernel runs the split schedule (never on the pair schedule, never on an fp8_ds_mla
    cache). Part of the rule ``choose_backend`` and ``describe_for_device`` share."""
    if kv_fp8 or pseudo_heads >= GLUON_MIN_PSEUDO_HEADS or num_tokens <= GLUON_FEW_HEADS_MAX_TOKENS:
        return False
    from . import gluon_sm90

    return gluon_sm90.schedule_for(False) == "split"


def _forced() -> str:
    """``SPARSE_MLA_MQA_BACKEND`` now ("auto" when unset or blank).

    Raises:
        ValueError: an unknown backend name."""
    forced = env.get(env.MQA_BACKEND).strip() or "auto"
    if forced not in ("auto", *BACKENDS):
        raise ValueError(f"{ENV_VAR} must be one of auto, {', '.join(BACKENDS)}; got {forced!r}")
    return forced


def _rule(applies: tuple[bool, str], pseudo_heads: int, num_tokens: int, kv_fp8: bool) -> Choice:
    """The choice given whether the Gluon kernel applies (``gluon_sm90_applies``, with the reason), the rows of a
    tile, the tokens and the cache format: what ``choose_backend`` and ``describe_for_device`` both decide by."""
    forced = _forced()
    ok, why = applies
    if forced == "triton":
        return Choice("triton", f"forced by {ENV_VAR}=triton")
    if forced == "gluon_sm90":
        if not ok:
            raise ValueError(f"{ENV_VAR}=gluon_sm90 but the Gluon kernel does not apply: {why}")
        return Choice("gluon_sm90", f"forced by {ENV_VAR}=gluon_sm90")
    if not ok:
        return Choice("triton", f"gluon_sm90 does not apply: {why}")
    if triton_small_tiles_win(pseudo_heads, num_tokens, kv_fp8):
        return Choice("triton", f"{pseudo_heads} pseudo-heads per tile < {GLUON_MIN_PSEUDO_HEADS} on {num_tokens} > "
                                f"{GLUON_FEW_HEADS_MAX_TOKENS} tokens on the split schedule: the Triton kernel's smaller "
                                "tiles are faster there (H200, results/gluon-v3.json)")
    return Choice("gluon_sm90", why)


def choose_backend(q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor | None = None,
                   pseudo_heads: int | None = None) -> Choice:
    """``Choice(backend, reason)`` for a launch on these tensors, honouring ``SPARSE_MLA_MQA_BACKEND``.

    ``pseudo_heads``: rows of one attention tile (H per token; G * H grouped; default H). Automatic
    selection takes the Gluon kernel wherever it applies, except, on its split schedule, below
    ``GLUON_MIN_PSEUDO_HEADS`` pseudo-heads on more than ``GLUON_FEW_HEADS_MAX_TOKENS`` tokens of a bf16 /
    fp16 cache (``triton_small_tiles_win``).

    Raises:
        ValueError: the variable names an unknown backend, or forces one that does not apply here.
    """
    rows = q.shape[1] if pseudo_heads is None else pseudo_heads
    return _rule(gluon_sm90_applies(q, kv, out), rows, q.shape[0], kv.dtype == torch.uint8)


select_backend = deprecated_alias(choose_backend, "select_backend")


def describe_backend(q: torch.Tensor, kv: torch.Tensor) -> str:
    """One line for ``explain()``: which attention backend runs on such tensors, and why."""
    try:
        return line(LABEL, choose_backend(q, kv))
    except ValueError as exc:
        return line(LABEL, ("error", exc))


def describe_for_device(device: torch.device | None = None, dtype: torch.dtype = torch.bfloat16,
                        num_heads: int | None = None, num_tokens: int | None = None, kv_fp8: bool = False) -> str:
    """The same line without tensors, for contiguous 16-byte aligned ones on ``device`` (default: the
    current CUDA device, else the CPU), for the per-token launch of ``num_heads`` heads over ``num_tokens``
    tokens when given (grouped tiles hold 128 pseudo-heads), on an fp8_ds_mla cache when ``kv_fp8``; what
    ``sparse_mla.layer.explain`` prints. The choice is ``choose_backend``'s rule on these facts."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    ok, why = gluon_sm90_device_applies(device, dtype)
    if ok and kv_fp8:
        fp8_why = fp8_kv_reason(dtype)
        ok, why = ((True, why + f", fp8_ds_mla cache dequantized by the producer with {dtype} q (fp16 q: triton)")
                   if fp8_why is None else (False, fp8_why))
    try:
        grouped = _rule((ok, why), 128, num_tokens or 0, kv_fp8)
        if num_heads is None or num_tokens is None:
            return line(LABEL, grouped)
        per_token = _rule((ok, why), num_heads, num_tokens, kv_fp8)
    except ValueError as exc:
        return line(LABEL, ("error", exc))
    if per_token.name == grouped.name:
        return line(LABEL, per_token)
    return line(LABEL, (f"{grouped.name} for grouped tiles, {per_token.name} per token",
                        f"{per_token.reason}; {grouped.reason}"))


def kv_split_missing(backend: str, *, grouped: bool, kv_fp8: bool) -> str | None:
    """Why ``backend`` has no split-KV variant for such a launch, or None (the Triton kernel has one always; Gluon per
    ``gluon_sm90.SUPPORTS_KV_SPLIT`` and ``gluon_sm90.kv_split_missing``)."""
    if backend != "gluon_sm90":
        return None
    from . import gluon_sm90

    if not getattr(gluon_sm90, "SUPPORTS_KV_SPLIT", False):
        return "the Gluon kernel has no split-KV variant (gluon_sm90.SUPPORTS_KV_SPLIT is false)"
    return gluon_sm90.kv_split_missing(grouped, kv_fp8)


def require_kv_split_runs(*, grouped: bool, kv_fp8: bool) -> None:
    """Raise before any launch where a split launch cannot run: ``SPARSE_MLA_MQA_BACKEND=gluon_sm90`` forced and the
    Gluon kernel has no split variant for it (otherwise such a launch runs the Triton kernel's).

    Raises:
        ValueError: that case, with the reason."""
    if _forced() != "gluon_sm90":
        return
    missing = kv_split_missing("gluon_sm90", grouped=grouped, kv_fp8=kv_fp8)
    if missing is not None:
        raise ValueError(f"{ENV_VAR}=gluon_sm90 but {missing}; use kv_splits=1 or another backend")


def launch_backend(q, kv, pseudo_heads: int, *, grouped: bool, kv_split: bool, kv_fp8: bool) -> Choice:
    """``Choice(backend, reason)`` of a launch of ``pseudo_heads`` rows per tile on such tensors, as ``per_token`` / ``grouped``
    decide it (the split fallback included; kv_fp8: an fp8_ds_mla cache dequantized in the kernel). For
    ``explain_fwd``; "error" with the reason where the selection raises."""
    try:
        name, why = choose_backend(q, kv, None, pseudo_heads=pseudo_heads)
    except ValueError as exc:
        return Choice("error", str(exc))
    if kv_split:
        missing = kv_split_missing(name, grouped=grouped, kv_fp8=kv_fp8)
        if missing is not None:
            return Choice("triton", missing)
    return Choice(name, why)


def _split_fallback(name: str, why: str, kv_split, kv, grouped: bool) -> Choice:
    """``Choice(backend, reason)`` once split-KV partials are asked for: a backend without a split variant for the launch hands
    it to the Triton kernel; a forced gluon_sm90 without one raises."""
    if kv_split is None:
        return Choice(name, why)
    missing = kv_split_missing(name, grouped=grouped, kv_fp8=kv.dtype == torch.uint8)
    if missing is None:
        return Choice(name, why)
    if _forced() == "gluon_sm90":
        raise ValueError(f"{ENV_VAR}=gluon_sm90 but {missing}")
    return Choice("triton", missing)


def per_token(q, kv, indices, sm_scale: float, topk_length, out, lse, route=None, *,
              attn_sink=None, max_logits=None, kv_split=None) -> str:
    """Per-token sparse MQA on validated tensors (``sparse_mla.mqa.interface.sparse_mla_fwd``): picks the
    backend, logs it, launches, and returns the backend's name.

    attn_sink: [H] fp32 contiguous or None; max_logits: [T, H] fp32 (heads contiguous) or None, written
    when given. kv_split: ``sparse_mla.mqa.split_combine.SplitPartials`` or None: the launch writes its partials
    there (the caller combines). Semantics: ``sparse_mla.mqa.reference`` / ``triton_tl`` (module docstrings)."""
    name, why = _split_fallback(*choose_backend(q, kv, out), kv_split, kv, False)
    extra = {"attn_sink": attn_sink, "max_logits": max_logits}
    logger.debug("sparse MQA per-token: backend %s (%s)", name, why)
    if name == "gluon_sm90":
        from . import gluon_sm90

        gluon_sm90.launch(q, kv, indices, None, topk_length, None, None, route, out, lse, sm_scale,
                          grouped=False, num_lists=q.shape[0], group_heads=q.shape[1], kv_split=kv_split, **extra)
    else:
        triton_tl.sparse_mqa_per_token(q, kv, indices, sm_scale, topk_length, out, lse, route=route, kv_split=kv_split,
                                       **extra)
    return name


def grouped(q, kv, sm_scale: float, group_size: int, union_rows, union_bits, union_len, group_start, group_len,
            out, lse, *, attn_sink=None, max_logits=None, kv_split=None) -> str:
    """Grouped sparse MQA (128 pseudo-heads = G queries x H heads over each group's union rows) on
    validated tensors; picks the backend, logs it, launches, and returns the backend's name.
    attn_sink / max_logits / kv_split as in ``per_token`` (pseudo-head p of a group uses attn_sink[p % H])."""
    name, why = _split_fallback(*choose_backend(q, kv, out, pseudo_heads=group_size * q.shape[1]), kv_split, kv, True)
    extra = {"attn_sink": attn_sink, "max_logits": max_logits}
    logger.debug("sparse MQA grouped: backend %s (%s)", name, why)
    if name == "gluon_sm90":
        from . import gluon_sm90

        gluon_sm90.launch(q, kv, union_rows, union_bits, union_len, group_start, group_len, None, out, lse,
                          sm_scale, grouped=True, num_lists=group_start.shape[0], group_heads=group_size * q.shape[1],
                          kv_split=kv_split, **extra)
    else:
        triton_tl.sparse_mqa_grouped(q, kv, sm_scale, group_size, union_rows, union_bits, union_len, group_start,
                                     group_len, out, lse, kv_split=kv_split, **extra)
    return name
