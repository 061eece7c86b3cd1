"""Union builder backends (sparse_mla.union.backends): the Triton twin everywhere, the CUDA one on a GPU."""

from __future__ import annotations

import pytest

from testlib.device import DEVICE, HAS_CUDA


def cuda_smem_unavailable() -> str | None:
    """Why the CUDA union builder cannot run on this machine (None when it can)."""
    if not HAS_CUDA:
        return "no CUDA device"
    from sparse_mla.union import backends

    runnable, _, why = backends.cuda_smem_applies(backends.device_facts(DEVICE), 1, 1)
    return None if runnable else why


BACKEND_PARAMS = [
    pytest.param("triton", id="triton"),
    pytest.param("cuda_smem", id="cuda_smem", marks=[
        pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="the CUDA union builder needs a CUDA GPU")]),
]
