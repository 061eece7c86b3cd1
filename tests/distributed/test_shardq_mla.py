"""ShardQ at the MLA-layer level (sparse_mla/distributed/mla.py): the reduced exchange (q before
absorption, o after W_UV), the absorbed one, and the chunked exchange / attention pipeline.

Spawned gloo ranks run the Triton kernels through the interpreter in fp16 (as tests/distributed/test_shardq.py).
Each rank checks its head shard of o against the fp32 reference of the layer definition (absorb,
sparse_mla_ref, W_UV, all in fp32), against the TP baseline ``tp_mla_attention``, and the chunked
pipeline against the unchunked result, each (token, head) row within the layer's row tolerance; for the
absorbed exchange also what it shares with TP, the attention output (latent, before W_UV) of each (row,
head), within the kernels' fp16 row tolerance. Nothing is compared bitwise across calls whose matmuls
have other shapes (other head or row counts): BLAS and the kernels may round those differently.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from testlib.device import DTYPE, HAS_CUDA
from testlib.distributed import (
    GLOO,
    WRONG_ROW_FACTOR,
    Backend,
    Case,
    WrongRow,
    build_problem,
    case_named,
    expect_detected,
    gloo_only,
    spawn_ranks,
)
from testlib.tolerances import LAYER_ROW_TOLERANCE, TOLERANCE, assert_rows_close

from sparse_mla.distributed import cost_model, zigzag_partition
from sparse_mla.distributed.mla import EXCHANGES, shardq_mla_attention, tp_mla_attention
from sparse_mla.mqa.reference import sparse_mla_ref
from sparse_mla.workloads.models import get_model

NOPE, ROPE, V, R = 32, 64, 48, 512  # small qk_nope / v_head_dim (the kernels only see the 576-wide rows)
LOCAL = Backend("local", DTYPE, not HAS_CUDA)  # this process on the suite's device (cuda:0 or the interpreter)


def _layer_problem(case: Case, rank: int, W: int, seed: int = 0, backend: Backend = GLOO):
    """q_nope / q_pe of all heads, w_kv_b [H, NOPE + V, R], kv [N, R + ROPE], indices, topk_length,
    sm_scale in ``backend``'s dtype on its device for ``rank``; identical on every rank (seeded on the CPU)."""
    _, kv, indices, topk_length, _ = build_problem(case, seed, backend, rank)
    g = torch.Generator().manual_seed(seed + 1)
    T, H = indices.shape[0], case.heads
    dtype, dev = backend.dtype, backend.device(rank)
    q_nope = torch.randn(T, H, NOPE, generator=g).to(dtype).to(dev)
    q_pe = torch.randn(T, H, ROPE, generator=g).to(dtype).to(dev)
    w_kv_b = (torch.randn(H, NOPE + V, R, generator=g) / R**0.5).to(dtype).to(dev)
    return q_nope, q_pe, w_kv_b, kv, indices, topk_length, (NOPE + ROPE) ** -0.5


def _reference(q_nope, q_pe, w_kv_b, kv, indices, topk_length, sm_scale):
    """fp32 o [T, H, V] of the layer definition (sparse_mla.layer.reference, no window restriction)."""
    q_abs = torch.cat([torch.bmm(q_nope.float().transpose(0, 1), w_kv_b[:, :NOPE].float()).transpose(0, 1),
                       q_pe.float()], dim=-1)
    lat, _ = sparse_mla_ref(q_abs, kv.float(), indices, sm_scale, d_v=R, topk_length=topk_length)
    return torch.bmm(lat.transpose(0, 1), w_kv_b[:, NOPE:].float().transpose(1, 2)).transpose(0, 1)


MLA_CASES = [
    Case("requests_padding_topk_length", ((20, 5), (0, 7), (5, 8)), heads=8, topk=24, use_topk_length=True, pad_rows=3),
    Case("one_request", ((0, 19),), heads=8, topk=16),
]


def _recorder(latents: list, rank: int = 0, wrong_row: WrongRow | None = None):
    """attn_fn that runs sparse_mla_fwd and keeps a copy of each latent output [rows, heads, R] it computed; on rank
    ``wrong_row[0]`` it first scales latent row ``wrong_row[1:]`` of each call that has that row by
    WRONG_ROW_FACTOR (see test_shardq._spy)."""
    from sparse_mla.mqa.interface import sparse_mla_fwd

    def attn_fn(q, kv, indices, sm_scale, **kwargs):
        res = sparse_mla_fwd(q, kv, indices, sm_scale, **kwargs)
        if wrong_row is not None and wrong_row[0] == rank and wrong_row[1] < q.shape[0]:
            kwargs["out"][wrong_row[1:]] *= WRONG_ROW_FACTOR
        latents.append(kwargs["out"].clone())
        return res

    return attn_fn


CHUNKS = (1, 3, 64)  # 64 > rows per rank: empty pieces


def _run_mla(rank: int, W: int, backend, case_ids: list[str]) -> None:
    for case in MLA_CASES:
        if case.id in case_ids:
            with case_named(case.id, rank, W, backend):
                _run_mla_case(case, rank, W, backend)


def _run_mla_case(case: Case, rank: int, W: int, backend, wrong_row: WrongRow | None = None) -> None:
    """One case on this rank: every call that communicates first (each is a collective), then the checks, so a
    failing check leaves no peer inside a collective. ``wrong_row``: scale one latent row of this rank's
    ShardQ attention (``_recorder``)."""
    q_nope, q_pe, w_kv_b, kv, indices, tl, scale = _layer_problem(case, rank, W)
    H_l = case.heads // W
    mine = slice(rank * H_l, (rank + 1) * H_l)
    qn, qp = q_nope[:, mine].contiguous(), q_pe[:, mine].contiguous()
    n_real = case.num_real
    kw = dict(topk_length=tl, method="per_token", num_real_tokens=n_real)
    where = f"case {case.id}, rank {rank} of {W}"

    tp_lat, results = [], {}
    tp = tp_mla_attention(qn, qp, w_kv_b, kv, indices, scale, rank=rank, world_size=W, attn_fn=_recorder(tp_lat), **kw)
    for exchange in EXCHANGES:
        for chunks in CHUNKS:
            info, timings, lat = {}, {}, []
            w = w_kv_b if exchange == "reduced" or chunks != 3 else w_kv_b[mine]  # absorbed: local slice works
            o = shardq_mla_attention(qn, qp, w, kv, indices, scale, exchange=exchange, chunks=chunks, min_tokens=1,
                                     info=info, timings=timings, attn_fn=_recorder(lat, rank, wrong_row), **kw)
            results[(exchange, chunks)] = o, info, timings, lat
    # TP's latents of all heads, [n_real, H, R] (head = s * H / W + h), to compare with ShardQ's rows.
    shards = [torch.empty_like(tp_lat[0]) for _ in range(W)]
    dist.all_gather(shards, tp_lat[0])
    tp_lat_all = torch.cat(shards, dim=1)
    # Bad input raises on every rank before any communication (no hang).
    with pytest.raises(ValueError, match="every head's kv_b_proj"):
        shardq_mla_attention(qn, qp, w_kv_b[mine], kv, indices, scale, exchange="reduced", **kw)
    with pytest.raises(ValueError, match="chunks"):
        shardq_mla_attention(qn, qp, w_kv_b, kv, indices, scale, chunks=0, **kw)
    with pytest.raises(ValueError, match="exchange"):
        shardq_mla_attention(qn, qp, w_kv_b, kv, indices, scale, exchange="latent", **kw)
    # Below min_tokens: the TP path, no communication.
    info_tp = {}
    o_below = shardq_mla_attention(qn, qp, w_kv_b, kv, indices, scale, min_tokens=10**6, info=info_tp, **kw)
    dist.barrier()

    ref = _reference(q_nope[:n_real], q_pe[:n_real], w_kv_b, kv, indices[:n_real],
                     None if tl is None else tl[:n_real], scale)[:, mine]
    assert_rows_close(tp[:n_real], ref, torch.float16, f"tp, {where}", row_tolerance=LAYER_ROW_TOLERANCE)
    rows = zigzag_partition(n_real, W)[rank]  # this rank's rows of every ShardQ call, all heads
    for (exchange, chunks), (o, info, timings, lat) in results.items():
        what = f"shardq {exchange} chunks={chunks}, {where}"
        assert info["path"] == "shardq" and info["exchange"] == exchange, (what, info)
        assert (info["q_width"], info["o_width"]) == ((NOPE + ROPE, V) if exchange == "reduced" else (R + ROPE, R))
        assert timings["total_ms"] >= timings["attention_ms"] >= 0, (what, timings)
        assert o.shape == (indices.shape[0], H_l, V) and o.dtype == torch.float16
        assert torch.all(o[n_real:] == 0), f"{what}: padding rows must be 0"
        assert_rows_close(o[:n_real], ref, torch.float16, what, row_tolerance=LAYER_ROW_TOLERANCE)
        assert_rows_close(o[:n_real], tp[:n_real], torch.float16, what + " vs tp", row_tolerance=LAYER_ROW_TOLERANCE)
        if chunks != 1:  # the same rows from the same inputs in other pieces: within the row tolerance of chunks=1
            assert_rows_close(o, results[(exchange, 1)][0], torch.float16, f"{what} vs chunks=1",
                              row_tolerance=LAYER_ROW_TOLERANCE)
        if exchange == "absorbed" and chunks == 1:
            # What equals plain TP: the attention outputs of the same (row, head), before W_UV. Both are the
            # per-token kernel on the same absorbed q row (TP's own absorption, exchanged), over H heads here
            # and H / W in TP; the kernel's head tiles differ, so within the fp16 row tolerance, not bitwise.
            (lat_rows,) = lat
            assert_rows_close(lat_rows, tp_lat_all[rows], torch.float16, f"{what}: attention output vs tp's")
    # The TP path below min_tokens is tp_mla_attention itself: the same call on the same inputs.
    assert info_tp["path"] == "tp" and torch.equal(o_below, tp), where


def _run_mla_with_a_wrong_row(rank: int, W: int, backend, wrong_row: WrongRow) -> None:
    case = MLA_CASES[0]
    expect_detected(W, case.id, _run_mla_case, case, rank, W, backend, wrong_row)


@pytest.mark.slow
@gloo_only
@pytest.mark.parametrize("world_size", [2, 4], ids=["gloo-W2", "gloo-W4"])
def test_shardq_mla_exchanges_and_pipeline(world_size, tmp_path, monkeypatch):
    ids = [c.id for c in MLA_CASES] if world_size == 2 else [MLA_CASES[0].id]
    spawn_ranks(monkeypatch, tmp_path, world_size, GLOO, _run_mla, ids)


@pytest.mark.slow
@gloo_only
def test_shardq_mla_comparisons_catch_one_wrong_row(tmp_path, monkeypatch):
    """The checks of test_shardq_mla_exchanges_and_pipeline fail when rank 1's ShardQ attention scales the first
    row of each call's latent output at one head by 1.01 (its o row is then off by 1e-2, the row tolerance 2e-3)."""
    spawn_ranks(monkeypatch, tmp_path, 2, GLOO, _run_mla_with_a_wrong_row, (1, 0, 2))


def test_tp_mla_attention_single_process_matches_reference():
    """W = 1 in this process, on the suite's device and dtype (bf16 compiled kernels on a GPU)."""
    case = MLA_CASES[1]
    q_nope, q_pe, w_kv_b, kv, indices, tl, scale = _layer_problem(case, 0, 1, backend=LOCAL)
    o = tp_mla_attention(q_nope, q_pe, w_kv_b, kv, indices, scale, method="per_token")
    ref = _reference(q_nope, q_pe, w_kv_b, kv, indices, tl, scale)
    assert_rows_close(o, ref, DTYPE, "tp W=1", row_tolerance=LAYER_ROW_TOLERANCE)


def test_shardq_mla_needs_a_process_group():
    case = MLA_CASES[1]
    q_nope, q_pe, w_kv_b, kv, indices, _, scale = _layer_problem(case, 0, 1)
    if dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    with pytest.raises(RuntimeError, match="process group"):
        shardq_mla_attention(q_nope, q_pe, w_kv_b, kv, indices, scale)


def test_reduced_exchange_widths_match_the_cost_model():
    """The widths the module sends are the cost model's for the real layouts."""
    for name in ("deepseek-v3.2", "glm-5"):
        cfg = get_model(name)
        assert cost_model.exchange_widths(cfg, "reduced") == (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
                                                              cfg.v_head_dim)


def _layer_bench_task(rank: int, W: int, backend, out_file: str) -> None:
    from sparse_mla.bench.shardq_layer import run_shardq_layer_bench

    doc = run_shardq_layer_bench([("glm-5", W)], [40], topk=16, trials=1, chunks=(1, 3))
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(doc, f)
    else:
        assert doc is None


@pytest.mark.slow
@gloo_only
def test_shardq_layer_bench_on_gloo_ranks(tmp_path, monkeypatch):
    """sparse_mla.bench.shardq_layer on 2 gloo ranks: every variant runs, is checked against TP and the
    fp32 layer definition, and carries the cost model's figure."""
    from sparse_mla.bench.shardq_layer import format_rows

    out_file = tmp_path / "layer.json"
    spawn_ranks(monkeypatch, tmp_path, 2, GLOO, _layer_bench_task, str(out_file), timeout_s=180.0)
    doc = json.loads(out_file.read_text())
    rows = doc["rows"]
    assert [(r["variant"], r["chunks"]) for r in rows] == [("tp", 1), ("shardq-absorbed", 1), ("shardq-absorbed", 3),
                                                           ("shardq-reduced", 1), ("shardq-reduced", 3)]
    tol = TOLERANCE[torch.float16]
    for r in rows:
        assert r["check_ok"] and r["err_vs_ref"] < tol and r["err_vs_tp"] < tol, r
        assert r["total_ms"] >= r["attention_ms"] > 0 and r["interpreted"]
        assert ("model_ms" in r) == (r["variant"] != "tp")
    assert doc["meta"]["cost_model_link"]["bandwidth_gbs"] > 0 and doc["meta"]["chunks"] == [1, 3]
    assert "INTERPRETER" in format_rows(rows)
