"""The suite's shared helpers, one module per job (imported as ``testlib.<module>``; ``tests/`` is on the path).

* ``device``: the device and dtype the suite runs on, int32 sentinels, the ``cpu_only`` marker.
* ``tolerances``: the per-dtype tolerance tables and the comparisons to the fp32 reference.
* ``problems``: random sparse MLA problems, NaN-poisoned outputs, the checked ``sparse_mla_fwd`` call.
* ``adversarial``: adversarial index patterns, garbage past ``topk_length``, union hash collisions.
* ``grids``: recording the launch grids of a huge problem without running it.
* ``backends``: the union builder backends a test can force.
* ``sm90``: compiling kernels for sm_90 with the Gluon kernels' Triton, in a subprocess.
* ``paths``: the repository, its results/ and README.
* ``hf_models``: tiny transformers DSA models with the real head dims and per-layer attention probes (import it
  after ``pytest.importorskip("transformers")``).
* ``flashmla_cases``, ``cuda_emulation``, ``nvrtc_compile``: FlashMLA's cases, the CUDA union kernel on the CPU,
  NVRTC through ctypes.

CPU runs (TRITON_INTERPRET=1) use fp16: the interpreter's bf16 tl.dot is wrong (seen here: off by ~4e10 on a
16x32 @ 32x16 product). bf16 is covered on the GPU.
"""
