"""Shared test helpers: random sparse MLA problems, adversarial index sentinels, error metrics.

CPU runs (TRITON_INTERPRET=1) use fp16: the interpreter's bf16 tl.dot is wrong (seen here:
off by ~4e10 on a 16x32 @ 32x16 product). bf16 is covered on the GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
DTYPE = torch.bfloat16 if HAS_CUDA else torch.float16


def cpu_only(what: str):
    """Marker of a test about the CPU machine itself (the Triton interpreter, gloo ranks on CPU tensors, the CPU
    bench): skipped where a CUDA GPU is present, whose runs compile the kernels (conftest.py leaves
    TRITON_INTERPRET unset there) and have GPU twins of these tests. ``what`` names it in the skip reason."""
    return pytest.mark.skipif(HAS_CUDA, reason=f"CPU machines only: {what}")
INT_MIN = -(2**31)
INT_MAX = 2**31 - 1

# Relative Frobenius error allowed against the fp32 reference, per dtype (bf16 level): the whole-tensor
# figure, kept for comparisons of whole results (benchmarks, sums); kernel and path tests use the per-row
# tolerances below.
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}
# Per (token, head) output row: ||row - ref|| / ||ref||. The kernels round P and the output to the dtype
# once each (unit roundoff u = 2^-8 bf16, 2^-11 fp16), so a row's error is about one u (observed on the CPU
# suite: at most 0.87 u in fp16); 3 u here. One token's head scaled by 1.05 is 13 u over in bf16.
ROW_TOLERANCE = {torch.bfloat16: 3 * 2**-8, torch.float16: 3 * 2**-11, torch.float32: 1e-5}
# The layer's o [T, H, v_head_dim] (sparse_mla.layer): one more rounding to the dtype than the kernels (the
# MQA paths' latent before W_UV, the MHA paths' decompressed K / V): 4 u (observed: 1.2 u in fp16).
LAYER_ROW_TOLERANCE = {torch.bfloat16: 4 * 2**-8, torch.float16: 4 * 2**-11, torch.float32: 2e-5}
# Whole-tensor 1 - cosine similarity (FlashMLA's extra bound): about (row error)^2, u^2 = 1.5e-5 bf16,
# 2.4e-7 fp16 (observed: 4e-8 in fp16).
COS_DIFF_TOLERANCE = {torch.bfloat16: 2e-5, torch.float16: 1e-6, torch.float32: 1e-9}
# lse: kernel and reference read the same dtype-rounded q / kv and both sum in fp32, so lse carries only
# fp32 rounding whatever q's dtype: FlashMLA's rule, abs 1e-6 plus 2.01 / 65536 relative (the old 2e-3 /
# 1e-2 absolute was ~40-200x the largest error observed, 4.6e-5 at |lse| ~ 5; this bound is 3x it).
LSE_ABS_TOLERANCE = 1e-6
LSE_REL_TOLERANCE = 2.01 / 65536


@dataclass
class Problem:
    q: torch.Tensor  # [T, H, D_qk]
    kv: torch.Tensor  # [N, D_qk]
    indices: torch.Tensor  # [T, K] int32
    topk_length: torch.Tensor | None
    sm_scale: float


def distinct_rows(T: int, K: int, N: int, *, causal_from: int | None = None, generator=None) -> torch.Tensor:
    """[T, K] int32 distinct rows per token; with causal_from=c, token t draws from [0, c + t] and
    pads with -1 where fewer than K rows exist."""
    out = torch.full((T, K), -1, dtype=torch.int32)
    for t in range(T):
        limit = N if causal_from is None else min(N, causal_from + t + 1)
        take = min(K, limit)
        out[t, :take] = torch.randperm(limit, generator=generator)[:take].to(torch.int32)
    return out


def neighbour_rows(T: int, K: int, N: int, keep: float, generator=None) -> torch.Tensor:
    """[T, K] distinct rows where each token keeps a fraction ``keep`` of its predecessor's list
    (so groups have unions between 1 and G lists)."""
    out = torch.empty((T, K), dtype=torch.int32)
    prev = torch.randperm(N, generator=generator)[:K]
    for t in range(T):
        n_keep = int(keep * K)
        kept = prev[torch.randperm(K, generator=generator)[:n_keep]]
        mask = torch.ones(N, dtype=torch.bool)
        mask[kept] = False
        fresh_pool = mask.nonzero()[:, 0]
        fresh = fresh_pool[torch.randperm(fresh_pool.numel(), generator=generator)[: K - n_keep]]
        row = torch.cat([kept, fresh])[torch.randperm(K, generator=generator)]
        out[t] = row.to(torch.int32)
        prev = row
    return out


def make_problem(T: int, H: int, K: int, N: int, *, d_qk: int = 576, dtype=None, seed: int = 0,
                 indices: torch.Tensor | None = None, topk_length: torch.Tensor | None = None) -> Problem:
    g = torch.Generator().manual_seed(seed)
    dtype = dtype or DTYPE
    q = torch.randn(T, H, d_qk, generator=g).to(dtype)
    kv = torch.randn(N, d_qk, generator=g).to(dtype)
    if indices is None:
        indices = distinct_rows(T, K, N, generator=g)
    sm_scale = d_qk**-0.5
    tl_ = None if topk_length is None else topk_length.to(DEVICE)
    return Problem(q.to(DEVICE), kv.to(DEVICE), indices.to(DEVICE), tl_, sm_scale)


def poisoned_out(T: int, H: int, dtype=None, d_v: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """NaN-filled out [T, H, d_v] and lse [T, H]: an element the kernel fails to write fails the test."""
    out = torch.full((T, H, d_v), float("nan"), dtype=dtype or DTYPE, device=DEVICE)
    lse = torch.full((T, H), float("nan"), dtype=torch.float32, device=DEVICE)
    return out, lse


def all_of(items, what: str = "") -> bool:
    """``all(items)`` that fails on an empty collection (an ``all`` over nothing proves nothing): use it in
    asserts over generated collections."""
    items = list(items)
    assert items, f"all() over an empty collection{': ' + what if what else ''}"
    return all(items)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ||x - ref|| / ||ref|| in fp32 (0 when both are 0)."""
    x, ref = x.float(), ref.float()
    denom = ref.norm().item()
    num = (x - ref).norm().item()
    return num / denom if denom > 0 else num


def row_rel_errors(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per row of the last dim (a (token, head) row of an out [T, H, D]): ||x - ref|| / ||ref|| in fp32,
    [*x.shape[:-1]]. A row whose reference is 0 gets its absolute error ||x|| (it must be exactly 0)."""
    x, ref = x.float(), ref.float().to(x.device)
    num = (x - ref).norm(dim=-1)
    den = ref.norm(dim=-1)
    return torch.where(den > 0, num / torch.where(den > 0, den, 1.0), num)


def cos_diff(x: torch.Tensor, ref: torch.Tensor) -> float:
    """1 - cosine similarity of the flattened tensors, as FlashMLA computes it: 1 - 2 <x, r> / (|x|^2 + |r|^2)
    in fp64 (0 for two zero tensors)."""
    a, r = x.double().flatten(), ref.double().to(x.device).flatten()
    den = (a * a + r * r).sum().item()
    return 0.0 if den == 0 else 1 - 2 * (a * r).sum().item() / den


def assert_rows_close(x: torch.Tensor, ref: torch.Tensor, dtype, what: str = "out", row_tolerance=None) -> None:
    """Every (token, head) row of ``x`` [..., D] within ``ROW_TOLERANCE[dtype]`` (or ``row_tolerance[dtype]``)
    relative error of its reference row (a row whose reference is 0 must be exactly 0), no NaN, and the whole tensor's cosine
    difference within ``COS_DIFF_TOLERANCE[dtype]``. The message names the worst row and the whole-tensor
    relative error (an extra figure, not the criterion)."""
    assert x.shape == ref.shape, f"{what}: shape {tuple(x.shape)} != reference {tuple(ref.shape)}"
    nan = torch.isnan(x)
    if nan.any():
        raise AssertionError(f"{what}: NaN at {int(nan.sum())} elements, first at {nan.nonzero()[0].tolist()} "
                             "(an unwritten or NaN-producing element)")
    if x.numel() == 0:
        return
    errs = row_rel_errors(x, ref)
    zero_ref = ref.float().to(x.device).norm(dim=-1) == 0
    if (zero_ref & (errs > 0)).any():
        where = (zero_ref & (errs > 0)).nonzero()[0].tolist()
        raise AssertionError(f"{what}: row {where} must be exactly 0 (no valid entry), got norm {errs[tuple(where)].item():.3e}")
    worst = errs.argmax()
    pos = [int(i) for i in torch.unravel_index(worst, errs.shape)]
    tol = (row_tolerance or ROW_TOLERANCE)[dtype]
    assert errs.max().item() < tol, (f"{what}: row {pos} relative error {errs.max().item():.2e} >= {tol:.1e} "
                                     f"({int((errs >= tol).sum())} rows over; whole tensor {rel_err(x, ref):.2e})")
    cd = cos_diff(x, ref)
    assert abs(cd) <= COS_DIFF_TOLERANCE[dtype], f"{what}: cosine difference {cd:.2e} > {COS_DIFF_TOLERANCE[dtype]:.0e}"


def assert_lse_close(lse: torch.Tensor, ref_lse: torch.Tensor, what: str = "lse") -> None:
    """lse -inf exactly where the reference is, no NaN, and each finite entry within
    ``LSE_ABS_TOLERANCE + LSE_REL_TOLERANCE * |ref|`` (dtype-independent: see LSE_REL_TOLERANCE)."""
    ref_lse = ref_lse.to(lse.device)
    assert not torch.isnan(lse).any(), f"NaN in {what}"
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty), f"{what} must be -inf exactly where the query has no valid row"
    assert torch.all(lse[empty] < 0), f"{what}: +inf where the reference is -inf"
    fin = ~empty
    if fin.any():
        diff = (lse[fin] - ref_lse[fin]).abs()
        bound = LSE_ABS_TOLERANCE + LSE_REL_TOLERANCE * ref_lse[fin].abs()
        over = diff > bound
        assert not over.any(), (f"{what}: {int(over.sum())} entries off by more than {LSE_ABS_TOLERANCE:g} + "
                                f"{LSE_REL_TOLERANCE:g} |lse|; worst abs error {diff.max().item():.2e}")


def assert_matches_reference(out, lse, ref_out, ref_lse, dtype) -> None:
    """out: every (token, head) row within the dtype's row tolerance (``assert_rows_close``), rows of
    queries with no valid row exactly 0, no NaN; lse (when given): ``assert_lse_close``."""
    empty = torch.isinf(ref_lse).to(out.device)
    assert torch.all(out[empty] == 0), "a query with no valid row must give out = 0"
    assert_rows_close(out, ref_out, dtype, "out")
    if lse is not None:
        assert_lse_close(lse, ref_lse)


# ---------------------------------------------------------------------------------------------
# Adversarial index patterns and checked calls (added for the core-kernel tests).

# Per-token patterns cycled by ``adversarial_indices``; each is a way a row can be padding.
PATTERNS = ("clean", "pad_end", "pad_middle", "sentinels", "all_invalid")


def adversarial_indices(T: int, K: int, N: int, *, patterns=PATTERNS, generator=None,
                        base: torch.Tensor | None = None) -> torch.Tensor:
    """[T, K] int32 (CPU): distinct valid rows in [0, N), then token t gets ``patterns[t % len]``:

    * ``clean``: untouched.
    * ``pad_end``: the last third is -1 (FlashMLA's padding).
    * ``pad_middle``: every third entry is -1, valid entries on both sides.
    * ``sentinels``: INT_MIN, -2, N, N + 1 and INT_MAX at spread positions (all padding: < 0 or >= N;
      values >= N that do not fit int32 are replaced by negative ones).
    * ``all_invalid``: no valid entry (out must be 0, lse -inf).

    ``base`` (a [T, K] list of distinct rows) replaces the random draw, e.g. ``neighbour_rows``.
    """
    idx = distinct_rows(T, K, N, generator=generator) if base is None else base.clone().to(torch.int32).cpu()
    for t in range(T):
        kind = patterns[t % len(patterns)]
        if kind == "clean":
            continue
        if kind == "pad_end":
            idx[t, K - max(1, K // 3):] = -1
        elif kind == "pad_middle":
            idx[t, 1::3] = -1
        elif kind == "sentinels":
            pos = torch.linspace(0, K - 1, 5).round().long()
            high = [v for v in (N, N + 1, INT_MAX) if v <= INT_MAX]  # >= N, where int32 has such values
            vals = [INT_MIN, -2] + high + [-3, -4, -5][: 3 - len(high)]
            idx[t, pos] = torch.tensor(vals, dtype=torch.int32)
        elif kind == "all_invalid":
            high = N if N <= INT_MAX else -7
            idx[t] = torch.tensor([-1, INT_MIN, high, INT_MAX if N <= INT_MAX else -8], dtype=torch.int32).repeat(K // 4 + 1)[:K]
        else:
            raise ValueError(f"unknown pattern {kind!r}")
    return idx


def garbage_topk_length(indices: torch.Tensor, N: int, *, generator=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices', topk_length) [T, K], [T] int32 (CPU): lengths cycle through 0, 1, K // 2, K - 1, K and
    everything past a length is garbage that would change the result if read: rows >= N, INT_MAX,
    repeats of the token's own earlier rows, and valid rows outside its list."""
    T, K = indices.shape
    idx = indices.clone()
    choices = [0, 1, K // 2, K - 1, K]
    lengths = torch.tensor([choices[t % len(choices)] for t in range(T)], dtype=torch.int32)
    for t in range(T):
        n = int(lengths[t])
        for j in range(n, K):
            r = (j - n) % 4
            if r == 0:
                idx[t, j] = N + j
            elif r == 1:
                idx[t, j] = INT_MAX
            elif r == 2 and n > 0 and int(idx[t, 0]) >= 0:
                idx[t, j] = idx[t, 0]  # a repeat: counted twice if read
            else:
                idx[t, j] = int(torch.randint(0, N, (1,), generator=generator))
    return idx, lengths


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    """[B + 1] int32 on DEVICE: request boundaries of requests with the given lengths."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=DEVICE)


def assert_same_result(out, lse, out2, lse2, dtype) -> None:
    """Two kernels on one input (e.g. grouped vs per-token): every (token, head) row of out within the
    row tolerance of the other's, lse -inf at the same places and within the lse tolerance elsewhere.
    (Each kernel rounds once to the dtype, so the two may differ by up to twice one's error: the row
    tolerance is already 2x the observed single-kernel error.)"""
    assert not torch.isnan(out2).any(), "NaN in the second result"
    assert_rows_close(out, out2, dtype, "out vs the other kernel")
    if lse is not None and lse2 is not None:
        assert_lse_close(lse, lse2, "lse vs the other kernel")


def poisoned_views(T: int, H: int, *, pad_tokens: int = 0, pad_heads: int = 0, dtype=None, d_v: int = 512):
    """NaN-filled buffers out_big [T + pad_tokens, H + pad_heads, d_v] and lse_big [T + pad_tokens, H],
    and the views a call writes: out = out_big[:T, pad_heads:] (head stride kept, so non-contiguous when
    pad_heads > 0) and lse = lse_big[:T] (contiguous). Everything outside the views must stay NaN."""
    out_big = torch.full((T + pad_tokens, H + pad_heads, d_v), float("nan"), dtype=dtype or DTYPE, device=DEVICE)
    lse_big = torch.full((T + pad_tokens, H), float("nan"), dtype=torch.float32, device=DEVICE)
    return out_big, lse_big, out_big[:T, pad_heads:], lse_big[:T]


def assert_outside_untouched(out_big: torch.Tensor, lse_big: torch.Tensor, T: int, pad_heads: int) -> None:
    """The rows / heads of ``poisoned_views`` buffers outside the written views are still all NaN."""
    assert torch.isnan(out_big[T:]).all(), "out rows past T were written (a padded tile stored past its rows)"
    assert torch.isnan(out_big[:, :pad_heads]).all(), "out heads outside the view were written"
    assert torch.isnan(lse_big[T:]).all(), "lse rows past T were written"


def run_checked(p: Problem, *, return_lse: bool = True, pad_tokens: int = 0, pad_heads: int = 0, **kwargs):
    """``sparse_mla_fwd`` on ``p`` into NaN-poisoned out= / lse= views (``poisoned_views``), compared to
    ``sparse_mla_ref``; the poisoned padding around the views must stay NaN.

    kwargs go to ``sparse_mla_fwd`` (method, cu_seqlens_q, workspace, overlap_guard, ...). Returns
    (out, lse) as written by the kernel (lse None with return_lse=False).
    """
    from sparse_mla import sparse_mla_fwd, sparse_mla_ref

    T, H, _ = p.q.shape
    out_big, lse_big, out, lse = poisoned_views(T, H, pad_tokens=pad_tokens, pad_heads=pad_heads, dtype=p.q.dtype)
    res = sparse_mla_fwd(p.q, p.kv, p.indices, p.sm_scale, topk_length=p.topk_length, return_lse=return_lse,
                         out=out, lse=lse if return_lse else None, **kwargs)
    if return_lse:
        assert isinstance(res, tuple) and res[0] is out and res[1] is lse, "must return the given out= / lse="
    else:
        assert res is out, "return_lse=False must return the out= tensor alone"
    ref_out, ref_lse = sparse_mla_ref(p.q, p.kv, p.indices, p.sm_scale, topk_length=p.topk_length)
    assert_matches_reference(out, lse if return_lse else None, ref_out, ref_lse, p.q.dtype)
    assert_outside_untouched(out_big, lse_big, T, pad_heads)
    return out, (lse if return_lse else None)


def union_hash_slot(rows: torch.Tensor, log_slots: int) -> torch.Tensor:
    """The home slot of each row in the union builder's hash table (mirrors ``_build_union_hash_kernel``:
    Fibonacci hashing, ``(row * 0x9E3779B1 mod 2**32) >> (32 - log_slots)``)."""
    return ((rows.long() * 0x9E3779B1) % 2**32) >> (32 - log_slots)


def colliding_rows(n: int, log_slots: int, slot: int, limit: int) -> torch.Tensor:
    """[n] int32: the n smallest rows in [0, limit) whose home slot is ``slot`` (all collide, so the
    builder probes a chain of n slots; with slot = 2**log_slots - 1 the chain wraps to slot 0)."""
    cand = torch.arange(limit, dtype=torch.int64)
    hits = cand[union_hash_slot(cand, log_slots) == slot]
    if hits.numel() < n:
        raise ValueError(f"only {hits.numel()} rows below {limit} hash to slot {slot}; raise limit")
    return hits[:n].to(torch.int32)


def compact_reference(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                      topk_length: torch.Tensor | None = None):
    """``sparse_mla_ref`` on a cache holding only the rows ``indices`` uses (valid ones remapped), so a
    huge kv is never converted to fp32 as a whole. Same result as the reference on the full kv."""
    from sparse_mla import sparse_mla_ref

    N = kv.shape[0]
    idx = indices.reshape(indices.shape[0], -1).long()
    valid = (idx >= 0) & (idx < N)
    used, inverse = torch.unique(torch.where(valid, idx, 0), return_inverse=True)
    small = kv.reshape(N, -1)[used]
    remapped = torch.where(valid, inverse, -1).to(torch.int32)
    return sparse_mla_ref(q, small, remapped, sm_scale, topk_length=topk_length)


# CUDA launch limits per grid dimension (x, y, z).
CUDA_GRID_LIMITS = (2**31 - 1, 65535, 65535)


def record_launch_grids(monkeypatch) -> list[tuple[str, tuple[int, ...]]]:
    """Replace every Triton / Gluon kernel (module globals named ``*_kernel``) of sparse_mla.mqa (both
    backends) and sparse_mla.union.triton_tl with a stub that records ``(name, grid)`` and runs nothing; returns the record list.
    Lets a CPU test check the grids a huge problem would launch without executing it."""
    import importlib

    grids: list[tuple[str, tuple[int, ...]]] = []

    class _Stub:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            grids.append((self.name, tuple(grid)))
            return lambda *args, **kwargs: None

    for mod_name in ("sparse_mla.mqa.triton_tl", "sparse_mla.mqa.gluon_sm90", "sparse_mla.union.triton_tl"):
        mod = importlib.import_module(mod_name)
        for name in [n for n in vars(mod) if n.endswith("_kernel") and not n.startswith("__")]:
            monkeypatch.setattr(mod, name, _Stub(name))
    return grids


def assert_grids_within_cuda_limits(grids) -> None:
    assert grids, "no kernel was launched"
    for name, grid in grids:
        for dim, (n, limit) in enumerate(zip(grid, CUDA_GRID_LIMITS)):
            assert 1 <= n <= limit, f"{name}: grid dim {dim} = {n} outside [1, {limit}] (CUDA launch fails)"


# ---------------------------------------------------------------------------------------------
# Union builder backends (sparse_mla.union.backends): the Triton twin everywhere, the CUDA one on a GPU.

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



REPO = Path(__file__).resolve().parents[1]
# The Triton the GPU runs (the Gluon kernels' pinned version), installed beside the test environment's own by
# ``make gluon-triton``; sm_90 compiles run with it in a subprocess whose PYTHONPATH puts it first.
SM90_TRITON_DIR = Path(os.environ.get("GLUON_TRITON_DIR", REPO / ".cache" / "triton-gluon"))


def run_sm90_compile(script: str, what: str) -> list:
    """Run ``script`` (Python that compiles kernels for sm_90 and prints a JSON list as its last line) with
    ``SM90_TRITON_DIR``'s Triton and return that list. Without that Triton: skipped on a developer machine,
    failed under CI (``CI`` set), so CI can never pass a compile check silently. ``what`` names the kernels."""
    if not (SM90_TRITON_DIR / "triton" / "__init__.py").exists():
        msg = f"no triton for sm_90 compiles at {SM90_TRITON_DIR} (run `make gluon-triton`)"
        if os.environ.get("CI"):
            pytest.fail(msg + f": CI must compile {what}")
        pytest.skip(msg)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SM90_TRITON_DIR), str(REPO)]))
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    assert r.returncode == 0, f"compile script for {what} failed:\n{r.stderr[-4000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])
