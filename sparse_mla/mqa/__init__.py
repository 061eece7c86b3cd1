"""Sparse MQA attention (the absorbed form of sparse MLA): the op, laid out by backend.

* ``reference``: the fp32 definition (``sparse_mla_ref``) every backend reproduces.
* ``triton_tl``: the portable Triton kernel (``tl``): the path on every GPU Triton supports and the
  CPU-tested twin (``TRITON_INTERPRET=1``) that every fast backend is held to.
* ``gluon_sm90``: the warp-specialized Gluon kernel for Hopper (sm_90; cp.async gathers, mbarrier
  ring, wgmma), written against the Triton versions in ``gluon_sm90.SUPPORTED_TRITON``.
* ``backends``: the one selection point that picks the backend by device, dtype, layout and Triton
  version, and says why.

* ``interface``: the public function ``sparse_mla_fwd`` (``sparse_mla.sparse_mla_fwd``); ``checks``: its argument
  checks; ``selection``: per-token or grouped for ``method="auto"``.
* ``flashmla_compat``: ``flash_mla_sparse_fwd``, the drop-in for FlashMLA's call, with its reference.
* ``flashmla_decode``: ``get_mla_metadata`` / ``flash_mla_with_kvcache``, the drop-in for FlashMLA's sparse decode
  call, with its reference.
"""
