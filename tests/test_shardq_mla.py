"""ShardQ at the MLA-layer level (sparse_mla/distributed/mla.py): the reduced exchange (q before
absorption, o after W_UV), the absorbed one, and the chunked exchange / attention pipeline.

Spawned gloo ranks run the Triton kernels through the interpreter in fp16 (as tests/test_shardq.py).
Each rank checks its head shard of o against the fp32 reference of the layer definition (absorb,
sparse_mla_ref, W_UV, all in fp32), against the TP baseline ``tp_mla_attention``, and the chunked
pipeline against the unchunked result.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from lib import LAYER_ROW_TOLERANCE, TOLERANCE, assert_rows_close
from test_shardq import GLOO, Case, _spawn, build_problem, cpu_only

from sparse_mla.distributed import cost_model
from sparse_mla.distributed.mla import shardq_mla_attention, tp_mla_attention
from sparse_mla.mqa.reference import sparse_mla_ref
from sparse_mla.workloads.models import get_model

NOPE, ROPE, V, R = 32, 64, 48, 512  # small qk_nope / v_head_dim (the kernels only see the 576-wide rows)


def _layer_problem(case: Case, rank: int, W: int, seed: int = 0):
    """q_nope / q_pe of all heads, w_kv_b [H, NOPE + V, R], kv [N, R + ROPE], indices, topk_length,
    sm_scale; identical on every rank (seeded on the CPU)."""
    _, kv, indices, topk_length, _ = build_problem(case, seed, GLOO, rank)
    g = torch.Generator().manual_seed(seed + 1)
    T, H = indices.shape[0], case.heads
    q_nope = torch.randn(T, H, NOPE, generator=g).half()
    q_pe = torch.randn(T, H, ROPE, generator=g).half()
    w_kv_b = (torch.randn(H, NOPE + V, R, generator=g) / R**0.5).half()
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


def _run_mla(rank: int, W: int, backend, case_ids: list[str]) -> None:
    for case in MLA_CASES:
        if case.id not in case_ids:
            continue
        q_nope, q_pe, w_kv_b, kv, indices, tl, scale = _layer_problem(case, rank, W)
        H_l = case.heads // W
        mine = slice(rank * H_l, (rank + 1) * H_l)
        qn, qp = q_nope[:, mine].contiguous(), q_pe[:, mine].contiguous()
        n_real = case.num_real
        ref = _reference(q_nope[:n_real], q_pe[:n_real], w_kv_b, kv, indices[:n_real],
                         None if tl is None else tl[:n_real], scale)[:, mine]
        kw = dict(topk_length=tl, method="per_token", num_real_tokens=n_real)
        tp = tp_mla_attention(qn, qp, w_kv_b, kv, indices, scale, rank=rank, world_size=W, **kw)
        where = f"case {case.id}, rank {rank} of {W}"
        assert_rows_close(tp[:n_real], ref, torch.float16, f"tp, {where}", row_tolerance=LAYER_ROW_TOLERANCE)
        results = {}
        for exchange in ("reduced", "absorbed"):
            for chunks in (1, 3, 64):  # 64 > rows per rank: empty pieces
                info, timings = {}, {}
                w = w_kv_b if exchange == "reduced" or chunks != 3 else w_kv_b[mine]  # absorbed: local slice works
                o = shardq_mla_attention(qn, qp, w, kv, indices, scale, exchange=exchange, chunks=chunks, min_tokens=1,
                                         info=info, timings=timings, **kw)
                what = f"shardq {exchange} chunks={chunks}, {where}"
                assert info["path"] == "shardq" and info["exchange"] == exchange, (what, info)
                assert (info["q_width"], info["o_width"]) == ((NOPE + ROPE, V) if exchange == "reduced" else (R + ROPE, R))
                assert timings["total_ms"] >= timings["attention_ms"] >= 0, (what, timings)
                assert o.shape == (indices.shape[0], H_l, V) and o.dtype == torch.float16
                assert torch.all(o[n_real:] == 0), f"{what}: padding rows must be 0"
                assert_rows_close(o[:n_real], ref, torch.float16, what, row_tolerance=LAYER_ROW_TOLERANCE)
                assert_rows_close(o[:n_real], tp[:n_real], torch.float16, what + " vs tp",
                                  row_tolerance=LAYER_ROW_TOLERANCE)
                results[(exchange, chunks)] = o
            for chunks in (3, 64):
                # Each row is computed from the same inputs whatever the chunking: the same bits.
                assert torch.equal(results[(exchange, chunks)], results[(exchange, 1)]), \
                    f"{exchange}: chunks={chunks} differs from chunks=1 ({where})"
        # The absorbed exchange with per-token attention is TP's computation row by row: same bits.
        assert torch.equal(results[("absorbed", 1)], tp), f"absorbed exchange vs tp not bitwise equal ({where})"
        # Bad input raises on every rank before any communication (no hang).
        with pytest.raises(ValueError, match="every head's kv_b_proj"):
            shardq_mla_attention(qn, qp, w_kv_b[mine], kv, indices, scale, exchange="reduced", **kw)
        with pytest.raises(ValueError, match="chunks"):
            shardq_mla_attention(qn, qp, w_kv_b, kv, indices, scale, chunks=0, **kw)
        with pytest.raises(ValueError, match="exchange"):
            shardq_mla_attention(qn, qp, w_kv_b, kv, indices, scale, exchange="latent", **kw)
        # Below min_tokens: the TP path, same result.
        info = {}
        o = shardq_mla_attention(qn, qp, w_kv_b, kv, indices, scale, min_tokens=10**6, info=info, **kw)
        assert info["path"] == "tp" and torch.equal(o, tp)
        dist.barrier()


@pytest.mark.slow
@cpu_only
@pytest.mark.parametrize("world_size", [2, 4], ids=["gloo-W2", "gloo-W4"])
def test_shardq_mla_exchanges_and_pipeline(world_size, tmp_path, monkeypatch):
    ids = [c.id for c in MLA_CASES] if world_size == 2 else [MLA_CASES[0].id]
    _spawn(monkeypatch, tmp_path, world_size, GLOO, _run_mla, ids)


def test_tp_mla_attention_single_process_matches_reference():
    case = MLA_CASES[1]
    q_nope, q_pe, w_kv_b, kv, indices, tl, scale = _layer_problem(case, 0, 1)
    o = tp_mla_attention(q_nope, q_pe, w_kv_b, kv, indices, scale, method="per_token")
    ref = _reference(q_nope, q_pe, w_kv_b, kv, indices, tl, scale)
    assert_rows_close(o, ref, torch.float16, "tp W=1", row_tolerance=LAYER_ROW_TOLERANCE)


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
@cpu_only
def test_shardq_layer_bench_on_gloo_ranks(tmp_path, monkeypatch):
    """sparse_mla.bench.shardq_layer on 2 gloo ranks: every variant runs, is checked against TP and the
    fp32 layer definition, and carries the cost model's figure."""
    from sparse_mla.bench.shardq_layer import format_rows

    out_file = tmp_path / "layer.json"
    _spawn(monkeypatch, tmp_path, 2, GLOO, _layer_bench_task, str(out_file), timeout_s=180.0)
    doc = json.loads(out_file.read_text())
    rows = doc["results"]
    assert [(r["variant"], r["chunks"]) for r in rows] == [("tp", 1), ("shardq-absorbed", 1), ("shardq-absorbed", 3),
                                                           ("shardq-reduced", 1), ("shardq-reduced", 3)]
    tol = TOLERANCE[torch.float16]
    for r in rows:
        assert r["check_ok"] and r["err_vs_ref"] < tol and r["err_vs_tp"] < tol, r
        assert r["total_ms"] >= r["attention_ms"] > 0 and r["interpreted"]
        assert ("model_ms" in r) == (r["variant"] != "tp")
    assert doc["meta"]["cost_model_link"]["bandwidth_gbs"] > 0 and doc["meta"]["chunks"] == [1, 3]
    assert "INTERPRETER" in format_rows(rows)
