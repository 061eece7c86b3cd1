"""The CUDA union kernel's source through NVRTC on the CPU (no GPU, no driver): a syntax error or a register
spill fails CI; ``explain`` names the union builder."""

from __future__ import annotations

import pytest
from testlib.backends import cuda_smem_unavailable

from sparse_mla.union import backends, cuda_smem


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_cuda_source_compiles_with_nvrtc(arch):
    """The kernel compiles with the options the runtime uses, without spills (32 registers at 1024 threads
    x 2 CTAs per SM); a broken source is reported as such (the check is not vacuous)."""
    from testlib.nvrtc_compile import compile_cubin, load_nvrtc, nvrtc_version

    lib, where = load_nvrtc()
    if lib is None:
        pytest.skip(f"NVRTC cannot be loaded: {where}")
    opts = [*cuda_smem.compile_options(), f"--gpu-architecture={arch}", "--ptxas-options=-v"]
    res, log, cubin = compile_cubin(lib, cuda_smem.source(), opts, "cuda_smem.cu")
    assert res == 0, f"NVRTC {nvrtc_version(lib)} ({where}) failed for {arch}:\n{log}"
    assert cubin > 0 and cuda_smem.KERNEL_NAME in log
    assert "0 bytes spill stores" in log, log
    for variant in (cuda_smem.compile_options(512, 1, 4), cuda_smem.compile_options(256, 4, 1)):
        res, log, _ = compile_cubin(lib, cuda_smem.source(), [*variant, f"--gpu-architecture={arch}"], "cuda_smem.cu")
        assert res == 0, f"{variant}:\n{log}"
    res, log, _ = compile_cubin(lib, cuda_smem.source() + "\nint broken(", opts, "cuda_smem.cu")
    assert res != 0 and "error" in log
    res, log, _ = compile_cubin(lib, cuda_smem.source(), [*cuda_smem.compile_options(1000), f"--gpu-architecture={arch}"])
    assert res != 0 and "multiple of 32" in log


def test_explain_names_the_union_builder(monkeypatch):
    """``sparse_mla.layer.explain`` prints which union builder the grouped path runs here, and why."""
    from sparse_mla.layer import PrefillStep, explain

    step = PrefillStep(16, 512, 128, 64, 128, 2048, (0,), (8192,))
    expected = "triton" if cuda_smem_unavailable() else "cuda_smem"
    d = explain(step)
    assert d.union_backend.startswith(f"union builder: {expected} (") and "(grouped MQA path) union builder" in str(d)
    monkeypatch.setenv(backends.ENV_VAR, "triton")
    assert explain(step).union_backend == "union builder: triton (forced by SPARSE_MLA_UNION_BACKEND=triton)"
    monkeypatch.setenv(backends.ENV_VAR, "nope")
    assert explain(step).union_backend.startswith("union builder: error (SPARSE_MLA_UNION_BACKEND must be one of")
