"""The benchmark behind ``sparse-mla bench``: layer-level DSA prefill paths side by side.

``scenarios`` (model layout, TP, prompt shapes), ``inputs`` (layer inputs of a point), ``check``
(rel. error vs the fp32 reference), ``baselines`` (per-token padded to 64 heads), ``union_stats``
(kernel-level union ratio and build time), ``timing`` (do_bench trials), ``runner`` (one scenario),
``report`` (JSON, table, README markdown, plot); ``shardq`` (ShardQ vs TP under torchrun).
"""
