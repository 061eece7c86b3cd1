"""The multi-process harness of the distributed tests (``spawn_ranks``: spawned ranks with a file rendezvous, gloo
on the CPU interpreter or NCCL on GPUs) and the ShardQ problems they share (``Case``, ``build_problem``: several
requests with cached prefixes, request-local causal top-k through a block table)."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from testlib.device import INT_MAX, INT_MIN, cpu_only

D_QK, D_V = 576, 512
SENTINELS = (-1, INT_MIN, None, INT_MAX)  # None = N, the first row past the cache


@dataclass(frozen=True)
class Backend:
    """How the spawned ranks run: torch.distributed backend, q / kv dtype, and whether the Triton
    kernels run through the interpreter on CPU tensors (else compiled, rank r on cuda:r)."""

    name: str
    dtype: torch.dtype
    interpret: bool

    def device(self, rank: int) -> torch.device:
        return torch.device("cpu") if self.interpret else torch.device("cuda", rank)


GLOO = Backend("gloo", torch.float16, True)  # fp16: the interpreter's bf16 tl.dot is wrong (tests/testlib/__init__.py)
NCCL = Backend("nccl", torch.bfloat16, False)
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL ranks need 2 CUDA GPUs (one per rank)")
# On a GPU box the NCCL variant runs the compiled kernels; the gloo variants run the interpreter,
# which Triton 3.6 (the H200 image) cannot run on sparse_mqa's runtime loop bounds: CPU CI covers them.
gloo_only = cpu_only("gloo ranks running the Triton interpreter")


@dataclass(frozen=True)
class Case:
    id: str
    requests: tuple[tuple[int, int], ...]  # (cached, new) per request
    heads: int = 16
    topk: int = 40
    method: str = "per_token"
    min_tokens: int = 1
    pad_rows: int = 0  # CUDA-graph padding rows after the real ones
    use_topk_length: bool = False
    paged: bool = False
    return_lse: bool = True
    noise: float = 3.0  # per-query score noise: large = little neighbour overlap
    world_sizes: tuple[int, ...] = (2, 4)  # W = 4 runs 4 interpreters on few cores: only where W matters

    @property
    def num_real(self) -> int:
        return sum(n for _, n in self.requests)


def build_problem(case: Case, seed: int = 0, backend: Backend = GLOO, rank: int = 0):
    """q [T, H, 576], kv [N, 576] (or paged [N / 8, 8, 576]) in ``backend.dtype``, indices [T, K]
    int32, topk_length [T] int32 or None; on ``backend.device(rank)``, the same values on every
    rank (drawn seeded on the CPU).

    Each request's context (cached + new positions) sits at random global rows (a block table); a
    query at position p picks the top-k positions in [0, p] by a per-key score plus per-query
    noise (small noise = neighbours share rows, as a real indexer does). Slots past the valid
    count hold the invalid sentinels -1, INT_MIN, N, INT_MAX, or, with topk_length, valid-looking
    rows that must be ignored; one query gets topk_length 0.
    """
    g = torch.Generator().manual_seed(seed)
    K = case.topk
    ctx = [c + n for c, n in case.requests]
    N = -(-(sum(ctx) + 9) // 8) * 8
    T = case.num_real + case.pad_rows
    perm = torch.randperm(N, generator=g)
    idx_rows, lengths, base = [], [], 0
    for (cached, new), L in zip(case.requests, ctx):
        block_table = perm[base:base + L]
        base += L
        score = torch.rand(L, generator=g)
        for i in range(new):
            pos = cached + i
            s = score[: pos + 1] + case.noise * torch.rand(pos + 1, generator=g)
            cnt = min(K, pos + 1)
            picked = block_table[s.topk(cnt).indices]
            row = torch.empty(K, dtype=torch.int64)
            row[:cnt] = picked
            for j in range(cnt, K):
                sentinel = SENTINELS[j % 4]
                row[j] = N if sentinel is None else sentinel
            if case.use_topk_length:
                past = torch.arange(cnt, K)
                row[cnt:] = torch.where(past % 5 == 4, perm[past % N], row[cnt:])  # must be ignored
            else:
                row = row[torch.randperm(K, generator=g)]  # padding anywhere in the row
            idx_rows.append(row)
            lengths.append(cnt)
    for _ in range(case.pad_rows):  # padding rows: garbage that must never be read
        idx_rows.append(torch.randint(0, N, (K,), generator=g))
        lengths.append(K)
    indices = torch.stack(idx_rows).to(torch.int32)
    topk_length = None
    if case.use_topk_length:
        topk_length = torch.tensor(lengths, dtype=torch.int32)
        topk_length[case.num_real // 2] = 0  # a query with no valid row
    q = torch.randn(T, case.heads, D_QK, generator=g).to(backend.dtype)
    kv = torch.randn(N, D_QK, generator=g).to(backend.dtype)
    if case.paged:
        kv = kv.view(N // 8, 8, D_QK)
    dev = backend.device(rank)
    topk_length = None if topk_length is None else topk_length.to(dev)
    return q.to(dev), kv.to(dev), indices.to(dev), topk_length, D_QK**-0.5


# A wrong result to inject: (rank, row, head) of the attention output [rows, heads, d_v] that rank's attn_fn
# scales by WRONG_ROW_FACTOR after computing it (tests that the comparisons catch one wrong row).
WrongRow = tuple[int, int, int]


WRONG_ROW_FACTOR = 1.01


@contextlib.contextmanager
def case_named(case_id: str, rank: int, W: int, backend: Backend):
    """Re-raise a failure inside the block as an AssertionError naming the case, the rank and the backend."""
    try:
        yield
    except Exception as e:
        raise AssertionError(f"case {case_id!r} failed on rank {rank} of {W} ({backend.name}): {e}") from e


def expect_detected(W: int, case_id: str, run, *args) -> None:
    """Run ``run(*args)`` (a case with a wrong row injected, its collectives before its checks) on every rank:
    some rank's checks must fail (AssertionError); the ranks then agree (a collective) and each raises if none
    did."""
    try:
        run(*args)
        caught = False
    except AssertionError:
        caught = True
    seen = [None] * W
    dist.all_gather_object(seen, caught)
    assert any(seen), f"case {case_id!r}: one row scaled by {WRONG_ROW_FACTOR} went undetected on all {W} ranks"


def _worker(rank: int, world_size: int, init_file: str, backend: Backend, task, task_args: tuple, error_dir: str) -> None:
    """One spawned rank: joins the group (file rendezvous), runs ``task(rank, W, backend, *task_args)``. On an
    exception it writes ``error_dir/rank<r>.json`` (time, traceback) before leaving the group (which makes the
    peers' collectives fail, later) and re-raising, for ``spawn_ranks``'s report."""
    try:
        # The kernels read TRITON_INTERPRET when first imported; this process has imported none yet.
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        assert interpreted == backend.interpret, f"{backend.name} workers must {'' if backend.interpret else 'not '}" \
            "inherit TRITON_INTERPRET=1"
        torch.set_num_threads(1)
        if not backend.interpret:
            torch.cuda.set_device(rank)
        dist.init_process_group(backend.name, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=120))
        task(rank, world_size, backend, *task_args)
    except BaseException:
        record = {"rank": rank, "time": time.time(), "traceback": traceback.format_exc()}
        (Path(error_dir) / f"rank{rank}.json").write_text(json.dumps(record))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def rank_failures(error_dir: Path, world_size: int) -> str:
    """The failures the ranks recorded (``_worker``), the first to fail first, in full (a peer that failed
    later, e.g. on a connection its failed peer closed, shows its last lines); "" when none was recorded."""
    records = sorted((json.loads(f.read_text()) for f in error_dir.glob("rank*.json")), key=lambda r: r["time"])
    if not records:
        return ""
    first = records[0]
    parts = [f"rank {first['rank']} of {world_size} failed first:\n{first['traceback']}"]
    for r in records[1:]:
        tail = "\n".join(r["traceback"].rstrip().splitlines()[-6:])
        parts.append(f"rank {r['rank']} failed {r['time'] - first['time']:.2f} s later (last lines):\n{tail}")
    return "\n".join(parts)


def spawn_ranks(monkeypatch, tmp_path, world_size: int, backend: Backend, task, *task_args, timeout_s: float = 240.0) -> None:
    """Run ``task`` on ``world_size`` spawned ranks of ``backend``. A rank's exception fails the test with the
    ranks' recorded failures (``rank_failures``: the first failing rank's traceback, with its case name, first),
    a hang fails it after ``timeout_s``."""
    if backend.interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # inherited by the spawned workers
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # W processes share few cores
            monkeypatch.setenv(var, "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # compiled kernels on the GPUs
        monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off
    error_dir = tmp_path / "rank_errors"
    error_dir.mkdir()
    ctx = mp.start_processes(_worker, args=(world_size, str(tmp_path / "rendezvous"), backend, task, task_args,
                                            str(error_dir)), nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1.0):  # raises once a rank failed, after stopping the others
            if time.monotonic() > deadline:
                for proc in ctx.processes:
                    if proc.is_alive():
                        proc.terminate()
                pytest.fail(f"{task.__name__} on W = {world_size} {backend.name} ranks did not finish within {timeout_s} s "
                            f"(a collective hung?)\n{rank_failures(error_dir, world_size)}", pytrace=False)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        pytest.fail(f"{task.__name__} on W = {world_size} {backend.name} ranks: "
                    f"{rank_failures(error_dir, world_size) or e}", pytrace=False)
