"""The public API: ``sorted(sparse_mla.__all__)`` is the committed list (adding or dropping a name is a decision made
here, on purpose), every name resolves from the module that owns it, and the subpackages keep their public names."""

from __future__ import annotations

import importlib

import pytest

import sparse_mla

PUBLIC = [
    "FP8_DS_MLA", "GroupUnion", "SparseMLAPrefill", "SparseMLAWorkspace", "__version__", "build_group_union",
    "default_group_size", "dsa_prefill", "dsa_prefill_ref", "flash_mla_sparse_fwd", "flash_mla_sparse_ref",
    "flash_mla_with_kvcache", "flash_mla_with_kvcache_ref", "get_mla_metadata", "shardq_sparse_mla_fwd",
    "sparse_mla_fwd", "sparse_mla_ref", "tp_sparse_mla_fwd", "zigzag_partition",
]

# Where each top-level name lives (the lazy ``_EXPORTS`` of sparse_mla/__init__.py).
OWNERS = {
    "sparse_mla_fwd": "sparse_mla.mqa.interface",
    "sparse_mla_ref": "sparse_mla.mqa.reference",
    "flash_mla_sparse_fwd": "sparse_mla.mqa.flashmla_compat",
    "flash_mla_sparse_ref": "sparse_mla.mqa.flashmla_compat",
    "get_mla_metadata": "sparse_mla.mqa.flashmla_decode",
    "flash_mla_with_kvcache": "sparse_mla.mqa.flashmla_decode",
    "flash_mla_with_kvcache_ref": "sparse_mla.mqa.flashmla_decode",
    "build_group_union": "sparse_mla.union.interface",
    "GroupUnion": "sparse_mla.union.interface",
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

SUBPACKAGES = {
    "sparse_mla.layer": [
        "PATHS", "PATH_NAMES", "PathDecision", "PathFallbackWarning", "PrefillStep", "SparseMLAPrefill", "THRESHOLDS",
        "choose_path", "dsa_prefill", "dsa_prefill_ref", "explain",
    ],
    "sparse_mla.integration": [
        "WarmupReport", "compiled_variant_counts", "convert_req_index_to_global", "convert_req_index_to_global_ref",
        "paged_kv_as_rows", "register_ops", "warmup", "workspace_buffers",
    ],
    "sparse_mla.distributed": [
        "DEFAULT_MIN_TOKENS", "shardq_mla_attention", "shardq_sparse_mla_fwd", "tp_mla_attention", "tp_sparse_mla_fwd",
        "zigzag_chunks", "zigzag_inverse", "zigzag_partition",
    ],
    "sparse_mla.workloads": [
        "MLAConfig", "MODELS", "OVERLAP_PRESETS", "OverlapModel", "SyntheticBatch", "TOPK_STATS_COLUMNS", "TopkTrace",
        "UnionStats", "check_trace", "get_model", "load_trace", "local_to_global", "resolve_overlap", "save_trace",
        "synthetic_batch", "synthetic_topk", "topk_stats", "topk_stats_table", "union_ratio",
    ],
}


def test_all_is_the_committed_list():
    assert sorted(sparse_mla.__all__) == PUBLIC
    assert sparse_mla.__dir__() == sorted(sparse_mla.__all__)


def test_exports_point_at_their_owners():
    assert sparse_mla._EXPORTS == OWNERS
    assert sorted([*OWNERS, "__version__"]) == PUBLIC


@pytest.mark.parametrize("name", sorted(OWNERS))
def test_every_name_resolves_from_its_owner(name):
    obj = getattr(sparse_mla, name)
    assert obj is getattr(importlib.import_module(OWNERS[name]), name)


def test_unknown_name_raises_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'interface'"):
        sparse_mla.interface  # noqa: B018 (the old module path is gone, no shim)


@pytest.mark.parametrize("package", sorted(SUBPACKAGES))
def test_subpackages_keep_their_public_names(package):
    mod = importlib.import_module(package)
    assert sorted(mod.__all__) == SUBPACKAGES[package]
    for name in mod.__all__:
        getattr(mod, name)
