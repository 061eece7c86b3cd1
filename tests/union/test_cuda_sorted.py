"""The sorted inspection builder (``sparse_mla.union.cuda_sorted``): its plan and choice on the CPU, its source through
NVRTC on the CPU, its source run on the CPU (``testlib.cuda_emulation``: one std::thread per CUDA thread, garbage
shared memory) and on a GPU, each against plain-Python sets, every output element (poisoned first): in one pass and
in several, with a window found per group or [0, N), and the fallback when a group's rows spread too wide.

Reference: ``build_group_union``'s definition (module docstring of tests/union/test_group_union.py).
"""

from __future__ import annotations

import pytest
import torch
from testlib import cuda_emulation
from testlib.adversarial import adversarial_indices, garbage_topk_length
from testlib.backends import cuda_smem_unavailable
from testlib.device import DEVICE
from testlib.union import check_union, lists_of_kind, union_reference

from sparse_mla import build_group_union
from sparse_mla.union import backends, cuda_sorted

H200 = backends.UnionDeviceFacts("cuda", (9, 0), 232448, False, None)
CPU = backends.UnionDeviceFacts("cpu", None, 0, True, None)


def test_plan_passes_fits_a_smaller_cap():
    """A device with 99 KiB per block (sm_86 / sm_89): build_sorted caps the pass there, fewer rows per pass."""
    plan = cuda_sorted.plan_passes(16, 2**31, 101376 - 512)
    assert plan.smem_bytes <= 101376 - 512 and plan.smem_bytes % 16 == 0 and plan.find_window


@pytest.mark.parametrize("G, N, pass_rows, smem, find_window", [
    pytest.param(8, 46080, 46080, 46080, False, id="G8-46K-one-pass-8-bit-fields"),
    pytest.param(16, 46080, 46080, 92160, False, id="G16-46K-one-pass-16-bit-fields"),
    pytest.param(8, 2**31, 114688, 114688, True, id="G8-unbounded-N-finds-windows"),
    pytest.param(16, 2**31, 57344, 114688, True, id="G16-unbounded-N-finds-windows"),
    pytest.param(3, 100, 112, 112, False, id="G3-N100-one-quad-granule"),
    pytest.param(8, 114689, 114688, 114688, True, id="G8-one-row-past-a-pass"),
])
def test_plan_passes(G, N, pass_rows, smem, find_window):
    """Rows per pass are whole 16-byte quads of fields, capped by PASS_SMEM_BYTES and by N."""
    plan = cuda_sorted.plan_passes(G, N)
    assert (plan.pass_rows, plan.smem_bytes, plan.find_window) == (pass_rows, smem, find_window)
    assert plan.smem_bytes <= cuda_sorted.PASS_SMEM_BYTES and plan.max_passes == cuda_sorted.MAX_PASSES
    assert cuda_sorted.field_bits(G) == (8 if G <= 8 else 16)


@pytest.mark.parametrize("mode, sorted_kernel, facts, expected", [
    pytest.param("auto", "1", H200, "cuda_sorted", id="opted-in-H200"),
    pytest.param("auto", "0", H200, "cuda_smem", id="default-H200-hash-builder"),
    pytest.param("cuda_smem", "1", H200, "cuda_smem", id="forced-hash-builder"),
    pytest.param("triton", "1", H200, "triton", id="forced-triton"),
    pytest.param("auto", "1", CPU, "triton", id="opted-in-cpu"),
])
def test_inspection_builder_choice(mode, sorted_kernel, facts, expected):
    assert backends.choose_inspection_builder(facts, 8, 2048, mode=mode, sorted_kernel=sorted_kernel).name == expected


def test_inspection_builder_refuses_a_bad_switch_value(monkeypatch):
    monkeypatch.setenv("SPARSE_MLA_UNION_SORTED", "yes")
    with pytest.raises(ValueError, match="SPARSE_MLA_UNION_SORTED must be 0 or 1"):
        backends.choose_inspection_builder(H200, 8, 2048)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("G", [8, 16])
def test_cuda_sorted_source_compiles_with_nvrtc(arch, G):
    """Both field widths compile without spills at the runtime's options (1024 threads x 2 CTAs: 32 registers)."""
    from testlib.nvrtc_compile import compile_cubin, load_nvrtc, nvrtc_version

    lib, where = load_nvrtc()
    if lib is None:
        pytest.skip(f"NVRTC cannot be loaded: {where}")
    opts = [*cuda_sorted.compile_options(G), f"--gpu-architecture={arch}", "--ptxas-options=-v"]
    res, log, cubin = compile_cubin(lib, cuda_sorted.source(), opts, "cuda_sorted.cu")
    assert res == 0, f"NVRTC {nvrtc_version(lib)} ({where}) failed for {arch}:\n{log}"
    assert cubin > 0 and cuda_sorted.KERNEL_NAME in log and "0 bytes spill stores" in log, log
    res, log, _ = compile_cubin(lib, cuda_sorted.source() + "\nint broken(", opts, "cuda_sorted.cu")
    assert res != 0 and "error" in log


def _need_gpu():
    why = cuda_smem_unavailable()
    if why is not None:
        pytest.skip(f"the CUDA union builders cannot run here: {why}")


def _case(G, T, K, N, kind, padded, with_topk_length):
    """(indices [T, K] int32 CPU, topk_length or None): rows drawn below 4096, shifted to end just below N."""
    g = torch.Generator().manual_seed(G * 1000 + T + K)
    base_n = min(N, 4096)
    idx = lists_of_kind(kind, T, K, base_n, g)
    if padded:
        idx = adversarial_indices(T, K, base_n, base=idx, generator=g)
    topk_length = None
    if with_topk_length:
        idx, topk_length = garbage_topk_length(idx.contiguous(), base_n, generator=g)
    if N > base_n:  # sentinels in [base_n, N - base_n) would be valid rows far below the window: padding instead
        shifted = torch.where((idx >= 0) & (idx < base_n), idx + (N - base_n), idx)
        idx = torch.where((idx >= base_n) & (idx < N - base_n), -7, shifted)
    return idx.contiguous(), topk_length


def _check(rows, bits, lengths, idx, G, topk_length, N):
    T, K = idx.shape
    expected = union_reference(idx, G, topk_length, N)
    assert lengths.shape == (len(expected), )
    for gi, (urows, ubits) in enumerate(expected):
        n = len(urows)
        assert int(lengths[gi]) == n, f"group {gi}: length {int(lengths[gi])} != {n}"
        assert rows[gi, :n].tolist() == urows and bits[gi, :n].tolist() == ubits, f"group {gi}"
        assert bool((rows[gi, n:] == -1).all()) and bool((bits[gi, n:] == 0).all()), f"group {gi}: tail"


# (G, T, K, N, list kind, padded, topk_length)
GPU_CASES = [
    pytest.param(1, 5, 12, 100, "neighbour", True, False, id="G1-padded"),
    pytest.param(2, 7, 12, 100, "disjoint", True, False, id="G2-T7-short-last"),
    pytest.param(5, 12, 10, 100, "neighbour", True, True, id="G5-topklen-garbage"),
    pytest.param(8, 13, 12, 100, "identical", False, False, id="G8-identical"),
    pytest.param(8, 300, 64, 5000, "neighbour", True, True, id="G8-T300-K64"),
    pytest.param(16, 37, 40, 3000, "disjoint", True, False, id="G16-disjoint"),
    pytest.param(16, 16, 12, 300, "all_invalid", False, False, id="G16-all-invalid"),
    pytest.param(9, 50, 33, 2**31 - 1, "neighbour", True, False, id="G9-N-int32max-windows"),
]


# the GPU cases in one pass, three of them in passes of 16 / 64 bytes (16 or 8 / 64 or 32 rows)
EMULATED = [pytest.param(*p.values, 1 << 16, id=f"{p.id}-one-pass") for p in GPU_CASES] + [
    pytest.param(5, 12, 10, 100, "neighbour", True, True, 16, id="G5-topklen-passes-of-16B"),
    pytest.param(16, 37, 40, 3000, "disjoint", True, False, 64, id="G16-disjoint-passes-of-64B"),
    pytest.param(9, 20, 33, 2**31 - 1, "neighbour", True, False, 64, id="G9-N-int32max-passes-of-64B"),
]


@pytest.mark.parametrize("G, T, K, N, kind, padded, with_topk_length, smem_cap", EMULATED)
def test_emulated_sorted_unions_match_sets(G, T, K, N, kind, padded, with_topk_length, smem_cap):
    """The kernel's source on the CPU (64 threads: two warps), outputs poisoned first; small ``smem_cap`` forces a
    found window covered in several passes."""
    lib, why = cuda_emulation.build_sorted(64, G)
    if lib is None:
        pytest.skip(why)
    idx, topk_length = _case(G, T, K, N, kind, padded, with_topk_length)
    n_groups = -(-T // G)
    rows = torch.full((n_groups, G * K), 0x5A5A5A5A, dtype=torch.int32)
    bits, lengths = rows.clone(), torch.full((n_groups, ), 0x5A5A5A5A, dtype=torch.int32)
    cfg = cuda_sorted.launch_config(idx, G, topk_length, N, rows, bits, lengths, smem_cap, 1 << 20, threads=64)
    cuda_emulation.emulate_sorted(lib, cfg)
    _check(rows, bits, lengths, idx, G, topk_length, N)


def test_emulated_sorted_full_block_and_fallback():
    """1024 threads (the runtime's block) on one DSA-like group; then a window wider than max_passes allows: every
    group of the launch reports -2 and writes nothing else."""
    lib, why = cuda_emulation.build_sorted(1024, 8)
    if lib is None:
        pytest.skip(why)
    idx, _ = _case(8, 9, 256, 4000, "neighbour", True, False)
    rows = torch.full((2, 8 * 256), 0x5A5A5A5A, dtype=torch.int32)
    bits, lengths = rows.clone(), torch.full((2, ), 0x5A5A5A5A, dtype=torch.int32)
    cfg = cuda_sorted.launch_config(idx, 8, None, 4000, rows, bits, lengths, cuda_sorted.PASS_SMEM_BYTES,
                                    cuda_sorted.MAX_PASSES, threads=1024)
    assert not cfg.plan.find_window
    cuda_emulation.emulate_sorted(lib, cfg)
    _check(rows, bits, lengths, idx, 8, None, 4000)
    lib64, _ = cuda_emulation.build_sorted(64, 8)
    rows.fill_(7), bits.fill_(7)
    cfg = cuda_sorted.launch_config(idx, 8, None, 2**31, rows, bits, lengths, 16, 1, threads=64)
    cuda_emulation.emulate_sorted(lib64, cfg)
    assert lengths.tolist() == [-2, -2] and bool((rows == 7).all()) and bool((bits == 7).all())


@pytest.mark.gpu
@pytest.mark.parametrize("G, T, K, N, kind, padded, with_topk_length", GPU_CASES)
@pytest.mark.parametrize("smem_cap", [None, 16, 64], ids=["default", "passes-of-16B", "passes-of-64B"])
def test_sorted_unions_match_sets(G, T, K, N, kind, padded, with_topk_length, smem_cap):
    """On the GPU, through CuPy: every output element against the reference; small ``smem_cap`` forces several
    passes."""
    _need_gpu()
    idx, topk_length = _case(G, T, K, N, kind, padded, with_topk_length)
    built = cuda_sorted.build_sorted(idx.to(DEVICE), G, None if topk_length is None else topk_length.to(DEVICE), N,
                                     smem_cap=smem_cap, max_passes=None if smem_cap is None else 1 << 20)
    assert built is not None
    _check(*(t.cpu() for t in built), idx, G, topk_length, N)


@pytest.mark.gpu
def test_build_group_union_runs_the_sorted_kernel_and_falls_back(monkeypatch):
    """With SPARSE_MLA_UNION_SORTED=1 (and SPARSE_MLA_UNION_BACKEND unset) build_group_union takes the sorted kernel;
    a group whose window needs more passes than allowed makes the call fall back to the hash builder + sort, with the
    same (checked) result."""
    _need_gpu()
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    monkeypatch.setenv("SPARSE_MLA_UNION_SORTED", "1")
    calls = []
    real = cuda_sorted.build_sorted

    def spy(*a, **k):
        out = real(*a, **k)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(cuda_sorted, "build_sorted", spy)
    g = torch.Generator().manual_seed(5)
    idx = lists_of_kind("neighbour", 40, 24, 4000, g)
    check_union(idx, 8, num_kv_rows=4000)
    assert calls == [True]
    monkeypatch.setattr(cuda_sorted, "PASS_SMEM_BYTES", 16)  # 16 rows per pass at G = 8 (8-bit fields)
    monkeypatch.setattr(cuda_sorted, "MAX_PASSES", 1)  # windows of the neighbour lists span more
    check_union(idx, 8, num_kv_rows=4000)
    assert calls == [True, False]


@pytest.mark.gpu
def test_sorted_at_full_size_matches_the_hash_builder():
    """DSA-sized lists (G 8 and 16, K 2048, causal 'mid' rows over 6144): the sorted kernel and the hash builder +
    sort give identical tensors."""
    _need_gpu()
    from sparse_mla.workloads import synthetic_batch

    b = synthetic_batch([4096], [2048], 2048, "mid", seed=3, device=DEVICE)
    real = cuda_sorted.build_sorted
    for G in (8, 16):
        ran = []
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SPARSE_MLA_UNION_SORTED", "1")
            mp.delenv(backends.ENV_VAR, raising=False)
            mp.setattr(cuda_sorted, "build_sorted", lambda *a, _ran=ran, **k: _ran.append(real(*a, **k)) or _ran[-1])
            fast = build_group_union(b.indices, G, topk_length=b.valid, num_kv_rows=6144)
        assert len(ran) == 1 and ran[0] is not None, "the sorted kernel did not build this call"
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(backends.ENV_VAR, "cuda_smem" if G == 8 else "triton")
            slow = build_group_union(b.indices, G, topk_length=b.valid, num_kv_rows=6144)
        assert torch.equal(fast.lengths, slow.lengths)
        assert torch.equal(fast.rows, slow.rows) and torch.equal(fast.member_mask, slow.member_mask)
