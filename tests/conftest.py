"""Test set-up: without a CUDA GPU the kernels run through Triton's interpreter on the CPU.

TRITON_INTERPRET must be set before any kernel module is imported (Triton reads it when a kernel
is decorated), so it is set here, before the tests import sparse_mla's kernels.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(autouse=True)
def _replays_checked(monkeypatch):
    """On a GPU every warm call's replay (``sparse_mla.call_cache``) is held to its full path: CHECKED re-runs the
    full path without launching and raises if its launches differ. Each test starts with no plans, so a test's
    patches of selection rules or kernels are seen by its first call of each shape."""
    if HAS_CUDA:
        from sparse_mla import call_cache

        call_cache.invalidate()
        monkeypatch.setattr(call_cache, "CHECKED", True)


@pytest.fixture(params=["triton", pytest.param("cuda_smem", marks=pytest.mark.gpu)])
def union_backend(request, monkeypatch) -> str:
    """Forces ``build_group_union`` / ``sparse_mla_fwd`` onto one union builder (SPARSE_MLA_UNION_BACKEND):
    the Triton twin everywhere, the CUDA shared-memory builder where it can run (skipped elsewhere)."""
    from testlib.backends import cuda_smem_unavailable

    from sparse_mla.union import backends

    if request.param == "cuda_smem":
        why = cuda_smem_unavailable()
        if why is not None:
            pytest.skip(f"the CUDA union builder cannot run here: {why}")
    monkeypatch.setenv(backends.ENV_VAR, request.param)
    return request.param


@pytest.fixture
def hopper(monkeypatch):
    """Pretend the tensors live on an sm_90 GPU with a supported triton, outside the interpreter, so the attention
    backend selection (``sparse_mla.mqa.backends``) takes its Hopper branches as plain Python on a CPU."""
    from sparse_mla.mqa import backends, gluon_sm90

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    monkeypatch.setattr(backends, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(gluon_sm90, "triton_version_supported", lambda version=None: True)
    if gluon_sm90.GLUON_IMPORT_ERROR is not None:
        monkeypatch.setattr(gluon_sm90, "GLUON_IMPORT_ERROR", None)
