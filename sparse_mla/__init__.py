"""sparse-mla: exact DeepSeek Sparse Attention (DSA) prefill on Hopper, in Triton.

Public entry points (semantics: ``sparse_mla.mqa.reference``; docs/DESIGN.md):

* ``sparse_mla_fwd``: sparse MLA prefill, per-token or grouped (union of G queries' top-k).
* ``build_group_union``: the per-group union of top-k lists with membership bits.
* ``sparse_mla_ref``: the fp32 reference.
* ``flash_mla_sparse_fwd``: drop-in for FlashMLA's ``flash_mla_sparse_fwd`` (its shapes, outputs
  (out, max_logits, lse) and conventions; any head count), with its fp32 reference ``flash_mla_sparse_ref``.
* ``get_mla_metadata`` / ``flash_mla_with_kvcache``: drop-in for FlashMLA's sparse decode call (paged bf16 / fp16 or
  ``fp8_ds_mla`` cache, indices [b, s_q, topk], lse [b, h_q, s_q]; any head count), with its fp32 reference
  ``flash_mla_with_kvcache_ref``.
* ``SparseMLAWorkspace``: preallocated scratch for the grouped path.
* ``dsa_prefill`` / ``SparseMLAPrefill``: the layer-level prefill (dense MHA, masked MHA, grouped
  or per-token sparse MQA, chosen by a measured dispatcher), with its fp32 reference ``dsa_prefill_ref``.
* ``FP8_DS_MLA``: the FP8 ``fp8_ds_mla`` latent cache format (``kv_format="fp8_ds_mla"`` on the calls above;
  ``sparse_mla.kv_format``): layout, checks, quantize / dequantize.

Attributes load lazily, so that a caller (the CLI, a test's conftest) can set TRITON_INTERPRET=1
after ``import sparse_mla`` but before the first kernel module is imported.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "sparse_mla_fwd": "sparse_mla.mqa.interface",
    "build_group_union": "sparse_mla.union.interface",
    "GroupUnion": "sparse_mla.union.interface",
    "sparse_mla_ref": "sparse_mla.mqa.reference",
    "flash_mla_sparse_fwd": "sparse_mla.mqa.flashmla_compat",
    "flash_mla_sparse_ref": "sparse_mla.mqa.flashmla_compat",
    "get_mla_metadata": "sparse_mla.mqa.flashmla_decode",
    "flash_mla_with_kvcache": "sparse_mla.mqa.flashmla_decode",
    "flash_mla_with_kvcache_ref": "sparse_mla.mqa.flashmla_decode",
    "SparseMLAWorkspace": "sparse_mla.union.workspace",
    "default_group_size": "sparse_mla.union.grouping",
    "dsa_prefill": "sparse_mla.layer",
    "SparseMLAPrefill": "sparse_mla.layer",
    "dsa_prefill_ref": "sparse_mla.layer",
    "FP8_DS_MLA": "sparse_mla.kv_format",
    "shardq_sparse_mla_fwd": "sparse_mla.distributed",
    "tp_sparse_mla_fwd": "sparse_mla.distributed",
    "zigzag_partition": "sparse_mla.distributed",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'sparse_mla' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
