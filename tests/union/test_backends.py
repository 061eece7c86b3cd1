"""The union builder's backend choice (``sparse_mla.union.backends``, plain Python on the CPU) and the CUDA
builder's table plan."""

from __future__ import annotations

import pytest
import torch
from testlib.backends import cuda_smem_unavailable
from testlib.device import DEVICE
from testlib.problems import neighbour_rows
from testlib.union import (
    check_union,
)

from sparse_mla.union import backends, cuda_smem

H200 = backends.UnionDeviceFacts("cuda", (9, 0), 232448, False, None)
A100 = backends.UnionDeviceFacts("cuda", (8, 0), 166912, False, None)


@pytest.mark.parametrize("mode, facts, G, K, guard, complete, expected, reason", [
    pytest.param("auto", H200, 8, 2048, 5.8, False, "cuda_smem", "16384-slot table (96 KiB", id="H200-G8-guard"),
    pytest.param("auto", H200, 16, 2048, 11.6, False, "cuda_smem", "32768-slot table (192 KiB", id="H200-G16-guard"),
    pytest.param("auto", H200, 8, 2048, None, False, "cuda_smem", "all G * K entries", id="H200-G8-noguard"),
    pytest.param("auto", H200, 16, 2048, None, False, "triton", "larger unions would run per token", id="H200-G16-noguard"),
    pytest.param("auto", H200, 16, 2048, None, True, "triton", "complete union", id="H200-G16-complete"),
    pytest.param("auto", H200, 8, 2048, None, True, "cuda_smem", "holds all G * K = 16384", id="H200-G8-complete"),
    pytest.param("auto", A100, 16, 2048, 11.6, False, "triton", "16384-slot table", id="A100-G16-guard-capped"),
    pytest.param("auto", A100, 8, 2048, 5.8, False, "cuda_smem", "overlap guard keeps", id="A100-G8-guard"),
    pytest.param("auto", backends.UnionDeviceFacts("cuda", (7, 5), 65536, False, None), 8, 64, None, False, "triton",
                 "compute capability 7.5 < 8.0", id="sm75"),
    pytest.param("auto", backends.UnionDeviceFacts("cuda", (9, 0), 232448, False, "ImportError: No module named 'cupy'"),
                 8, 64, None, False, "triton", "sparse-mla[cuda12]", id="no-cupy"),
    pytest.param("auto", backends.UnionDeviceFacts("cpu", None, 0, True, None), 8, 64, None, False, "triton",
                 "TRITON_INTERPRET=1", id="cpu-interpreter"),
    pytest.param("auto", backends.UnionDeviceFacts("cpu", None, 0, False, None), 8, 64, None, False, "triton",
                 "not a CUDA device", id="cpu"),
    pytest.param("auto", H200, 17, 64, None, False, "triton", "G = 17 outside 1..16", id="G17"),
    pytest.param("auto", H200, 16, 2**27, None, False, "triton", "entries per group", id="huge-K"),
    pytest.param("triton", H200, 8, 2048, 5.8, False, "triton", "forced by SPARSE_MLA_UNION_BACKEND=triton",
                 id="forced-triton"),
    pytest.param("cuda_smem", H200, 16, 2048, None, False, "cuda_smem", "larger unions would run per token",
                 id="forced-cuda-smem-beyond-capacity"),
    pytest.param(" ", H200, 8, 2048, 5.8, False, "cuda_smem", "", id="blank-is-auto"),
])
def test_choose_union_backend(mode, facts, G, K, guard, complete, expected, reason):
    name, why = backends.choose_union_backend(facts, G, K, mode=mode, guard_ratio=guard, complete=complete)
    assert name == expected and reason in why, (name, why)


@pytest.mark.parametrize("mode, facts, G, K, complete, match", [
    pytest.param("cuda_smem", backends.UnionDeviceFacts("cpu", None, 0, False, None), 8, 64, False, "not a CUDA device",
                 id="forced-on-cpu"),
    pytest.param("cuda_smem", backends.UnionDeviceFacts("cuda", (9, 0), 232448, False, "ImportError: x"), 8, 64, False,
                 "CuPy is not importable", id="forced-without-cupy"),
    pytest.param("cuda_smem", H200, 16, 2048, True, "complete union", id="forced-complete-beyond-capacity"),
    pytest.param("gluon", H200, 8, 64, False, "must be one of auto, triton, cuda_smem", id="unknown"),
])
def test_choose_union_backend_errors(mode, facts, G, K, complete, match):
    with pytest.raises(ValueError, match=match):
        backends.choose_union_backend(facts, G, K, mode=mode, complete=complete)


def test_choose_union_backend_env_and_log(monkeypatch, caplog):
    """On this machine's device: the variable is read per call; one debug line per build names the backend."""
    import logging

    monkeypatch.setenv(backends.ENV_VAR, "triton")
    assert backends.choose_union_backend(DEVICE, 8, 64) == ("triton", "forced by SPARSE_MLA_UNION_BACKEND=triton")
    monkeypatch.setenv(backends.ENV_VAR, "bogus")
    with pytest.raises(ValueError, match="bogus"):
        backends.choose_union_backend(DEVICE, 8, 64)
    monkeypatch.delenv(backends.ENV_VAR)
    expected, _ = backends.choose_union_backend(DEVICE, 4, 12, complete=True)
    assert expected == ("triton" if cuda_smem_unavailable() else "cuda_smem")
    caplog.set_level(logging.DEBUG, logger="sparse_mla")
    check_union(neighbour_rows(9, 12, 80, 0.5, torch.Generator().manual_seed(5)), 4, num_kv_rows=80)
    lines = [r.getMessage() for r in caplog.records if r.name == "sparse_mla" and "union builder" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(f"union builder: backend {expected} ("), lines
    assert f"union builder: {expected} (" in backends.describe_union_backend(DEVICE, 4, 12)


def test_plan_table():
    """Table sizes: every union the caller keeps fits at load <= 3/4, capped by the device's shared memory;
    where overflow is possible S - capacity >= THREADS; the override is checked."""
    p = cuda_smem.plan_table(8, 2048, 5.8, 232448)
    assert (p.slots, p.capacity, p.smem_bytes, p.exact, p.keeps_guarded) == (16384, 12288, 98304, False, True)
    assert cuda_smem.guard_limit(8, 2048, 5.8) == 11879 <= p.capacity
    p = cuda_smem.plan_table(16, 2048, 11.6, 232448)
    assert (p.slots, p.keeps_guarded, p.exact) == (32768, True, False)
    assert [cuda_smem.plan_table(G, 2048, 0.725 * G, 232448).slots for G in (1, 2, 4)] == [4096, 8192, 8192]
    p = cuda_smem.plan_table(16, 2048, 11.6, 166912)  # A100: capped at 16384 slots
    assert (p.slots, p.keeps_guarded) == (16384, False)
    for G in range(1, 17):
        for K in (1, 7, 64, 100, 2048, 4096):
            for guard in (None, 0.725 * G):
                p = cuda_smem.plan_table(G, K, guard, 232448)
                assert p.capacity == p.slots * 3 // 4 and p.smem_bytes + cuda_smem.STATIC_SMEM_BYTES <= 232448
                assert p.keeps_guarded or p.slots == 1 << cuda_smem.MAX_LOG_SLOTS
                assert p.exact or p.slots - p.capacity >= cuda_smem.THREADS
                assert p.exact == (G * K <= p.capacity)
                assert p.slots >= min(cuda_smem.SMALL_TABLE_SLOTS, 2 * G * K)  # small tables: load <= 1/2
    assert cuda_smem.plan_table(8, 20, None, 232448, slots=64).capacity == 48
    for bad in (48, 32, 1 << 16):
        with pytest.raises(ValueError, match="power of two"):
            cuda_smem.plan_table(8, 20, None, 232448, slots=bad)
    assert cuda_smem.max_log_slots(49152) == 12 and cuda_smem.max_log_slots(100) == 0


