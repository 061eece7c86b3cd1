"""The benchmark behind ``sparse-mla bench``: layer-level DSA prefill paths side by side, and the op-level benches.

``common`` (the plumbing every bench and benchmarks/ script shares: device peaks, error metrics, timing budget, the
JSON meta block and rows, the loader of bench files old and new, the table renderer), ``scenarios`` (model layout,
TP, prompt shapes), ``inputs`` (layer inputs of a point), ``check`` (rel. error vs the fp32 reference on sampled
chunks), ``baselines`` (per-token padded to 64 heads), ``union_stats`` (kernel-level union ratio and build time),
``timing`` (do_bench trials, CUDA-graph replays), ``runner`` (one scenario), ``report`` (the layer bench's JSON
meta, table, README markdown, plot); ``shardq`` / ``shardq_layer`` (ShardQ vs TP under torchrun); ``op`` /
``op_decode`` / ``op_tables`` (op-level calls against FlashMLA); ``kv_fp8`` (FP8 against bf16 cache); ``kinds``
(``sparse-mla report`` of every kind).
"""
