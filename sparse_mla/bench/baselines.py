"""Baselines the layer paths are measured against, which the package does not dispatch to.

``mqa_per_token_pad64``: what engines do on Hopper with FlashMLA's sparse prefill, whose kernels
take at least 64 heads: absorb q_nope through W_UK (as ``SparseMQA.run``), zero-pad the absorbed
query to 64 heads, run the per-token sparse MQA kernel on all 64, and project only the real H heads'
latent through W_UV. The attention of the padded query is FlashMLA's own ``flash_mla_sparse_fwd`` when
the ``flash_mla`` package is importable on a Hopper GPU (what engines run), else this package's fastest
per-token kernel on that device, through the backend selection point (``sparse_mla.mqa.backends``: the
Gluon kernel on Hopper, 0.96-0.98x of FlashMLA's speed per token in the same run: results/gluon-v14-full.json;
the Triton one elsewhere).
``pad64_baseline_kind`` says which, and the bench records it per scenario. Defined only for H < 64 (at
64 heads and more nothing is padded).

With an FP8 cache (``sparse-mla bench --kv-dtype fp8``) FlashMLA's sparse prefill cannot read it (bf16 only), so
engines first dequantize the rows into a bf16 workspace: ``dequantize_windows`` does that for every request's
window (the rows a step can select, as vLLM gathers them per request), with the indices remapped. The pad-64
baseline then runs on that workspace (dequantization included in its time), and ``mqa_per_token_dequant``
(``DEQUANT_NAME``) is the same at the real H heads: dequantize, then the bf16 per-token kernel the selection
point picks (the Gluon one on Hopper), against the FP8 paths that dequantize in the kernel's gather.

FlashMLA's sparse decode (the op bench's decode suite, ``sparse_mla.bench.op_decode``): ``flash_mla_decode`` calls it
where ``flash_mla_decode_kind`` says it runs (the ``flash_mla`` package, or the extension benchmarks/flashmla/build.py
builds with ``--decode``): FP8 cache only, bf16 q, 64 / 128 heads, Hopper.
"""

from __future__ import annotations

import torch

from ..layer.checks import validate_dsa_prefill_args
from ..layer.dispatch import PATH_NAMES
from ..layer.paths import SparseMQA, absorbed_mqa
from ..layer.problem import DSAPrefillProblem, PrefillStep

PAD64_NAME = "mqa_per_token_pad64"
DEQUANT_NAME = "mqa_per_token_dequant"  # FP8 cache runs only: dequantize the windows to bf16, then the bf16 kernel
PAD_HEADS = 64  # FlashMLA's sparse prefill head minimum on Hopper
PATH_COLUMNS = (*PATH_NAMES, PAD64_NAME)  # every path the benchmark times: the layer paths, then this baseline


def _flash_mla_module():
    """FlashMLA's sparse-prefill call when importable, as an object with ``flash_mla_sparse_fwd``: the ``flash_mla``
    package, or the ``flashmla_sm90`` extension that benchmarks/flashmla/build.py builds from FlashMLA's sources
    (same call); else None."""
    try:
        import flash_mla  # FlashMLA's package (github.com/deepseek-ai/FlashMLA); optional, never a dependency

        if hasattr(flash_mla, "flash_mla_sparse_fwd"):
            return flash_mla
    except Exception:  # not installed, or built for another CUDA / torch
        pass
    try:
        import flashmla_sm90
    except Exception:
        return None
    import types

    return types.SimpleNamespace(flash_mla_sparse_fwd=flashmla_sm90.sparse_prefill_fwd)


FLASHMLA_TOPK_MULTIPLE = 64  # FlashMLA's SM90 sparse prefill walks the lists in 64-row tiles (no remainder path)


def flash_mla_fwd():
    """FlashMLA's ``flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)`` when importable
    (``_flash_mla_module``), else None."""
    fm = _flash_mla_module()
    return None if fm is None else fm.flash_mla_sparse_fwd


def flash_mla_takes(device: torch.device, topk: int | None = None, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether FlashMLA's SM90 sparse prefill runs this call here: FlashMLA importable, a Hopper GPU, bf16, topk a
    multiple of its 64-row tile."""
    device = torch.device(device)
    return (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9 and dtype == torch.bfloat16
            and (topk is None or topk % FLASHMLA_TOPK_MULTIPLE == 0) and _flash_mla_module() is not None)


def _flash_mla_decode_module():
    """FlashMLA's sparse decode when importable, as (kind, module): ("flash_mla", the ``flash_mla`` package with 9241ae3's
    ``get_mla_metadata`` / ``flash_mla_with_kvcache``), ("flashmla_sm90" or "flashmla_sm90_decode", the extension of
    benchmarks/flashmla/build.py with ``sparse_decode_fwd``); else (None, None)."""
    try:
        import flash_mla

        if hasattr(flash_mla, "flash_mla_with_kvcache") and hasattr(flash_mla, "get_mla_metadata"):
            return "flash_mla", flash_mla
    except Exception:  # not installed, or built for another CUDA / torch
        pass
    from importlib import import_module

    for name in ("flashmla_sm90", "flashmla_sm90_decode"):
        try:
            mod = import_module(name)
        except Exception:
            continue
        if hasattr(mod, "sparse_decode_fwd"):
            return name, mod
    return None, None


FLASHMLA_DECODE_D_QK = 576  # the V3.2 FP8 layout (656-byte rows): the layout this package's FP8 cache shares


def flash_mla_decode_kind(device: torch.device, dtype: torch.dtype, fp8: bool, d_qk: int = 576,
                          topk: int | None = None) -> tuple[str | None, str]:
    """(kind, why): which FlashMLA sparse decode runs the call here (``_flash_mla_decode_module``'s kind), or None
    and, in a few words, why not: it takes only the FP8 cache (V3.2 layout: "not FP8"), topk a multiple of its 64-row
    tile ("topk % 64"), bf16 q ("not bf16 q"), on a Hopper GPU ("not Hopper"), and must be importable ("not
    importable": neither the flash_mla package nor the extension that benchmarks/flashmla/build.py --decode builds)."""
    device = torch.device(device)
    if not fp8 or d_qk != FLASHMLA_DECODE_D_QK:
        return None, "not FP8"
    if topk is not None and topk % FLASHMLA_TOPK_MULTIPLE:
        return None, "topk % 64"
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return None, "not Hopper"
    if dtype != torch.bfloat16:
        return None, "not bf16 q"
    kind, _ = _flash_mla_decode_module()
    if kind is None:
        return None, "not importable"
    return kind, "importable"


def flash_mla_decode(q: torch.Tensor, k_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float, *,
                     topk_length: torch.Tensor | None = None, attn_sink: torch.Tensor | None = None):
    """A zero-argument call of FlashMLA's sparse decode on these tensors (q [b, s_q, 64 | 128, 576] bf16, k_cache
    [num_blocks, page_block_size, 1, 656] FP8 bytes, indices [b, s_q, topk] int32 physical rows) returning (out
    [b, s_q, h_q, 512], lse [b, h_q, s_q]); its schedule metadata is made by the first call and reused after, as an
    engine reuses it across a step's layers (FlashMLA's ``get_mla_metadata()`` object, or the tensors the
    extension returns). None where FlashMLA's decode is not importable.

    FlashMLA's call: ``flash_mla_with_kvcache(q, k_cache, None, None, 512, meta, None, sm_scale, False, True,
    indices, attn_sink, None, None, topk_length, None)``; the extension's: ``sparse_decode_fwd(q, k_cache, indices,
    topk_length, attn_sink, tile_scheduler_metadata, num_splits, d_v, sm_scale)`` -> [out, lse,
    tile_scheduler_metadata, num_splits]."""
    kind, mod = _flash_mla_decode_module()
    if kind is None:
        return None
    if kind == "flash_mla":
        meta, _ = mod.get_mla_metadata()
        return lambda: mod.flash_mla_with_kvcache(q, k_cache, None, None, 512, meta, None, sm_scale, False, True, indices,
                                                  attn_sink, None, None, topk_length, None)
    sched: list = [None, None]

    def call():
        out, lse, sched[0], sched[1] = mod.sparse_decode_fwd(q, k_cache, indices, topk_length, attn_sink, sched[0],
                                                             sched[1], 512, sm_scale)
        return out, lse

    return call


def pad64_baseline_kind(device: torch.device, kv_format: str | None = None, *, topk: int | None = None,
                        dtype: torch.dtype = torch.bfloat16) -> str:
    """Which kernel the pad-64 baseline runs on ``device``: "flash_mla" (FlashMLA installed, Hopper GPU, and a call
    its SM90 sparse prefill takes: bf16, topk a multiple of its 64-row tile), or "sparse_mla:<backend>" (this
    package's per-token kernel that the selection point picks for 64 heads); with an FP8 ``kv_format``, prefixed
    "dequant+" (the windows are dequantized to bf16 first, ``dequantize_windows``)."""
    prefix = "" if kv_format is None else "dequant+"
    if flash_mla_takes(device, topk, dtype):
        return prefix + "flash_mla"
    from ..mqa.backends import gluon_sm90_device_applies

    ok, _ = gluon_sm90_device_applies(device, torch.bfloat16)
    return prefix + ("sparse_mla:gluon_sm90" if ok else "sparse_mla:triton")


def _flash_mla_attention(q, kv_rows, indices, sm_scale, *, d_v, topk_length=None, kv_format=None, **_):
    """``sparse_mla_fwd``-shaped adapter over FlashMLA's call: kv [N, 1, D], indices [T, 1, K]; returns out.
    bf16 / fp16 rows only (FlashMLA's sparse prefill): an FP8 cache is dequantized before (``dequantize_windows``)."""
    if kv_format is not None:
        raise ValueError(f"FlashMLA's sparse prefill takes bf16 rows, not kv_format={kv_format!r}: dequantize first")
    out, _max_logits, _lse = _flash_mla_module().flash_mla_sparse_fwd(
        q, kv_rows[:, None, :], indices[:, None, :], sm_scale, d_v=d_v, topk_length=topk_length)
    return out


def pad64_supports(step: PrefillStep) -> tuple[bool, str]:
    """(ok, reason): the per-token MQA path supports the step and H < 64."""
    ok, why = SparseMQA("per_token").supports(step)
    if not ok:
        return False, why
    if step.num_heads >= PAD_HEADS:
        return False, f"H = {step.num_heads} >= {PAD_HEADS}: nothing to pad (the same as mqa_per_token)"
    return True, f"per-token sparse MQA on q zero-padded from {step.num_heads} to {PAD_HEADS} heads (FlashMLA's minimum)"


def mqa_per_token_pad64(inputs: dict, out: torch.Tensor) -> torch.Tensor:
    """The padded baseline of one step, validated like ``dsa_prefill`` and written into ``out``.

    Args:
        inputs: ``dsa_prefill`` keyword arguments (``sparse_mla.bench.inputs``): q_nope
            [T, H, qk_nope] bf16/fp16, q_pe, kv, w_kv_b, indices [T, K] int32, lengths, sm_scale (and
            kv_format for an FP8 cache: then the windows are dequantized first, ``dequantize_windows``).
        out: o [T, H, v_head_dim] in q's dtype on q's device (written and returned).

    Raises:
        ValueError: the step is not supported (``pad64_supports``) or invalid inputs
            (``validate_dsa_prefill_args``).
    """
    p = validate_dsa_prefill_args(**inputs)
    ok, why = pad64_supports(p.step)
    if not ok:
        raise ValueError(f"{PAD64_NAME}: {why}")
    if p.kv_format is not None:
        p = dequantize_windows(p)
    kind = pad64_baseline_kind(p.q_nope.device, topk=p.step.topk, dtype=p.q_nope.dtype)
    attention = _flash_mla_attention if kind == "flash_mla" else None
    return absorbed_mqa(p, out, "per_token", q_heads=PAD_HEADS, attention=attention)


def dequantize_windows(p: DSAPrefillProblem) -> DSAPrefillProblem:
    """The same step on a workspace of plain rows in q's dtype (``sparse_mla.layer.staging.stage_windows``): every
    request window's rows of the FP8 cache dequantized and each valid index moved onto them; what an engine does
    before a bf16-only kernel.

    Raises:
        ValueError: p has no kv_format (nothing to dequantize).
    """
    from ..layer.staging import stage_windows

    return stage_windows(p)


def dequant_supports(step: PrefillStep) -> tuple[bool, str]:
    """(ok, reason) of the dequantize-then-bf16 baseline: an FP8 cache and a step the per-token MQA path takes."""
    if step.kv_format is None:
        return False, "the cache is already in q's dtype: nothing to dequantize"
    ok, why = SparseMQA("per_token").supports(step)
    if not ok:
        return False, why
    return True, ("every window's rows dequantized to a bf16 workspace (torch), then the bf16 per-token kernel "
                  "(what engines run before a bf16-only kernel)")


def mqa_per_token_dequant(inputs: dict, out: torch.Tensor) -> torch.Tensor:
    """The dequantize-then-bf16 baseline of one FP8-cache step (module docstring), written into ``out``.

    Args:
        inputs: ``dsa_prefill`` keyword arguments with ``kv`` an FP8 cache and ``kv_format`` set.
        out: o [T, H, v_head_dim] in q's dtype on q's device (written and returned).

    Raises:
        ValueError: not an FP8 cache, or a step the per-token MQA path does not take (``dequant_supports``);
            invalid inputs (``validate_dsa_prefill_args``).
    """
    p = validate_dsa_prefill_args(**inputs)
    ok, why = dequant_supports(p.step)
    if not ok:
        raise ValueError(f"{DEQUANT_NAME}: {why}")
    return absorbed_mqa(dequantize_windows(p), out, "per_token")


__all__ = ["PAD64_NAME", "PAD_HEADS", "PATH_COLUMNS", "DEQUANT_NAME", "pad64_supports", "pad64_baseline_kind",
           "flash_mla_decode", "flash_mla_decode_kind",
           "mqa_per_token_pad64", "dequantize_windows", "dequant_supports", "mqa_per_token_dequant"]
