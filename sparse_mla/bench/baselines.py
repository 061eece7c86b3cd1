"""Baselines the layer paths are measured against, which the package does not dispatch to.

``mqa_per_token_pad64``: what engines do on Hopper with FlashMLA's sparse prefill, whose kernels
take at least 64 heads: absorb q_nope through W_UK (as ``SparseMQA.run``), zero-pad the absorbed
query to 64 heads, run the per-token sparse MQA kernel on all 64, and project only the real H heads'
latent through W_UV. The attention of the padded query is FlashMLA's own ``flash_mla_sparse_fwd`` when
the ``flash_mla`` package is importable on a Hopper GPU (what engines run), else this package's fastest
per-token kernel on that device, through the backend selection point (``sparse_mla.mqa.backends``: the
Gluon kernel on Hopper, 0.73-0.78x of FlashMLA's speed per token; the Triton one elsewhere).
``pad64_baseline_kind`` says which, and the bench records it per scenario. Defined only for H < 64 (at
64 heads and more nothing is padded).
"""

from __future__ import annotations

import torch

from ..layer.config import PrefillStep, validate_dsa_prefill_args
from ..layer.dispatch import PATH_NAMES
from ..layer.paths import SparseMQA, absorbed_mqa

PAD64_NAME = "mqa_per_token_pad64"
PAD_HEADS = 64  # FlashMLA's sparse prefill head minimum on Hopper
PATH_COLUMNS = (*PATH_NAMES, PAD64_NAME)  # every path the benchmark times: the layer paths, then this baseline


def _flash_mla_module():
    """FlashMLA's Python package when importable, with its sparse-prefill call, else None."""
    try:
        import flash_mla  # FlashMLA's package (github.com/deepseek-ai/FlashMLA); optional, never a dependency
    except Exception:  # not installed, or built for another CUDA / torch
        return None
    return flash_mla if hasattr(flash_mla, "flash_mla_sparse_fwd") else None


def pad64_baseline_kind(device: torch.device) -> str:
    """Which kernel the pad-64 baseline runs on ``device``: "flash_mla" (FlashMLA installed, Hopper GPU), or
    "sparse_mla:<backend>" (this package's per-token kernel that the selection point picks for 64 heads)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9 and _flash_mla_module() is not None:
        return "flash_mla"
    from ..mqa.backends import gluon_sm90_device_applies

    ok, _ = gluon_sm90_device_applies(device, torch.bfloat16)
    return "sparse_mla:gluon_sm90" if ok else "sparse_mla:triton"


def _flash_mla_attention(q, kv_rows, indices, sm_scale, *, d_v, topk_length=None, **_):
    """``sparse_mla_fwd``-shaped adapter over FlashMLA's call: kv [N, 1, D], indices [T, 1, K]; returns out."""
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
            [T, H, qk_nope] bf16/fp16, q_pe, kv, w_kv_b, indices [T, K] int32, lengths, sm_scale.
        out: o [T, H, v_head_dim] in q's dtype on q's device (written and returned).

    Raises:
        ValueError: the step is not supported (``pad64_supports``) or invalid inputs
            (``validate_dsa_prefill_args``).
    """
    p = validate_dsa_prefill_args(**inputs)
    ok, why = pad64_supports(p.step)
    if not ok:
        raise ValueError(f"{PAD64_NAME}: {why}")
    attention = _flash_mla_attention if pad64_baseline_kind(p.q_nope.device) == "flash_mla" else None
    return absorbed_mqa(p, out, "per_token", q_heads=PAD_HEADS, attention=attention)


__all__ = ["PAD64_NAME", "PAD_HEADS", "PATH_COLUMNS", "pad64_supports", "pad64_baseline_kind", "mqa_per_token_pad64"]
