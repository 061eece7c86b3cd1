"""Engine integration: paged caches and block tables, torch custom ops, warmup (CUDA graphs).

* ``paged_kv_as_rows``: a paged latent cache (any block stride) as ``kv`` rows [N, D_qk].
* ``convert_req_index_to_global`` (Triton) / ``convert_req_index_to_global_ref`` (torch): the
  indexer's request-local top-k -> global rows through a block table.
* ``sparse_mla.integration.ops``: ``torch.ops.sparse_mla.fwd`` / ``fwd_out`` /
  ``convert_req_index`` custom ops that ``torch.compile`` traces (``register_ops()`` loads them).
* ``warmup``: compile every kernel variant a configuration can use, before CUDA-graph capture;
  ``compiled_variant_counts`` counts the compiled variants.
* ``sparse_mla.integration.transformers`` (the ``hf`` extra; import it by that path): ``apply(model)`` / ``undo(model)``
  run the attention of transformers' DeepseekV32 / GlmMoeDsa / Glm5Next / DeepseekV4 models on ``sparse_mla_fwd``
  (one module per family in ``sparse_mla.integration.hf``; docs/integration.md).

Attributes load lazily (as in ``sparse_mla``), so TRITON_INTERPRET=1 can still be set after import.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "paged_kv_as_rows": "sparse_mla.integration.block_table",
    "convert_req_index_to_global": "sparse_mla.integration.block_table",
    "convert_req_index_to_global_ref": "sparse_mla.integration.block_table",
    "register_ops": "sparse_mla.integration.ops",
    "workspace_buffers": "sparse_mla.integration.ops",
    "warmup": "sparse_mla.integration.warmup",
    "WarmupReport": "sparse_mla.integration.warmup",
    "compiled_variant_counts": "sparse_mla.integration.warmup",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'sparse_mla.integration' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
