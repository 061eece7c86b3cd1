"""The ShardQ cost model (sparse_mla/distributed/cost_model.py): arithmetic, and its validation
against the committed 2-GPU measurement (results/bench_shardq.json)."""

from __future__ import annotations

import json
import math

import pytest
from testlib.paths import RESULTS

from sparse_mla.distributed import cost_model as cm
from sparse_mla.workloads.models import get_model

DS, GLM = get_model("deepseek-v3.2"), get_model("glm-5")


def test_exchange_widths_per_form():
    assert cm.exchange_widths(DS, "absorbed") == (576, 512)
    assert cm.exchange_widths(DS, "reduced") == (192, 128)
    assert cm.exchange_widths(GLM, "absorbed") == (576, 512)
    assert cm.exchange_widths(GLM, "reduced") == (256, 256)
    with pytest.raises(ValueError, match="form"):
        cm.exchange_widths(DS, "latent")


def test_exchange_bytes_by_hand():
    # W = 2, T = 8: zigzag chunks of 2 rows, each rank 4 rows; it sends the other rank's 4 rows.
    b = cm.exchange_bytes(576, 128, 2, 8, 2)
    assert b.link == 4 * 64 * 576 * 2
    assert b.copy == 4 * 8 * 64 * 576 * 2
    # Uneven split: T = 7, W = 2 -> chunks 1, 2, 2, 2 -> rank rows 3 and 4; the 3-row rank sends 4.
    assert cm.exchange_bytes(10, 4, 2, 7, 2).link == 4 * 2 * 10 * 2
    # W = 1: nothing moves.
    assert cm.exchange_bytes(576, 128, 1, 100, 2) == cm.ExchangeBytes(0, 0)
    # W = 8: (W - 1) / W of the rank's T * H / W rows cross.
    b8 = cm.exchange_bytes(192, 128, 8, 8192, 2)
    assert b8.link == 8192 * 7 // 8 * 16 * 192 * 2
    with pytest.raises(ValueError, match="divisible"):
        cm.exchange_bytes(576, 10, 4, 8, 2)
    with pytest.raises(ValueError, match="tokens"):
        cm.exchange_bytes(576, 8, 4, -1, 2)


def test_reduced_form_cuts_bytes_by_the_width_ratio():
    for cfg in (DS, GLM):
        a = [cm.exchange_bytes(w, cfg.num_heads, 8, 32768, 2).link for w in cm.exchange_widths(cfg, "absorbed")]
        r = [cm.exchange_bytes(w, cfg.num_heads, 8, 32768, 2).link for w in cm.exchange_widths(cfg, "reduced")]
        assert sum(r) / sum(a) == pytest.approx(sum(cm.exchange_widths(cfg, "reduced")) / 1088)
    # DeepSeek-V3.2: (192 + 128) / (576 + 512) = 0.294
    assert (192 + 128) / 1088 == pytest.approx(0.294, abs=1e-3)


def test_exchange_ms_is_latency_plus_bytes_over_bandwidth():
    link = cm.Link("t", bandwidth_gbs=100.0, latency_ms=0.5, copy_gbs=1000.0)
    # 1e8 B over 100 GB/s = 1 ms; 1e9 B of copies at 1000 GB/s = 1 ms.
    assert cm.exchange_ms(cm.ExchangeBytes(10**8, 10**9), link) == pytest.approx(2.5)
    assert cm.exchange_ms(cm.ExchangeBytes(0, 0), link) == 0.0
    for bad in (dict(bandwidth_gbs=0.0, latency_ms=0.0), dict(bandwidth_gbs=1.0, latency_ms=-1.0),
                dict(bandwidth_gbs=math.inf, latency_ms=0.0)):
        with pytest.raises(ValueError, match="Link"):
            cm.Link("bad", **bad)


def test_pipeline_fill_steady_drain():
    # One chunk: the sum.
    assert cm.pipelined_ms(2.0, 10.0, 3.0, 1) == pytest.approx(15.0)
    # Attention-bound: q_c + a_c + o_c + (n - 1) a_c -> attn + (xq + xo) / n.
    assert cm.pipelined_ms(2.0, 10.0, 3.0, 5) == pytest.approx(0.4 + 2.0 + 0.6 + 4 * 2.0)
    # Link-bound: (n - 1) (q_c + o_c) in the steady state.
    assert cm.pipelined_ms(20.0, 10.0, 20.0, 4) == pytest.approx(5 + 2.5 + 5 + 3 * 10.0)
    # Latency is paid once per chunk and exchange.
    assert cm.pipelined_ms(2.0, 10.0, 3.0, 2, latency_ms=1.0) == pytest.approx(1.5 + 5.0 + 2.0 + max(5.0, 3.5))
    # Never below the busiest resource, never above no overlap (for latency 0).
    for xq, a, xo in [(1.0, 10.0, 1.0), (8.0, 2.0, 9.0), (3.0, 3.0, 3.0)]:
        for n in (1, 2, 3, 8, 64):
            t = cm.pipelined_ms(xq, a, xo, n)
            assert max(a, xq + xo) - 1e-9 <= t <= xq + a + xo + 1e-9
    with pytest.raises(ValueError, match="chunks"):
        cm.pipelined_ms(1.0, 1.0, 1.0, 0)


def test_shardq_step_prediction():
    link = cm.Link("t", bandwidth_gbs=200.0, latency_ms=0.1, copy_gbs=4000.0)
    p = cm.shardq_step_ms(DS, 2, 8192, tp_attn_ms=[8.0, 8.2], shardq_attn_ms=[7.0, 9.0], link=link)
    qb, ob = cm.exchange_bytes(576, 128, 2, 8192, 2), cm.exchange_bytes(512, 128, 2, 8192, 2)
    assert (p.q_bytes, p.o_bytes) == (qb, ob)
    xq, xo = cm.exchange_ms(qb, link), cm.exchange_ms(ob, link)
    assert p.shardq_ms == pytest.approx(xq + 9.0 + xo)
    assert p.tp_ms == 8.2 and p.speedup == pytest.approx(8.2 / p.shardq_ms)
    lse = cm.shardq_step_ms(DS, 2, 8192, tp_attn_ms=8.2, shardq_attn_ms=9.0, link=link, return_lse=True)
    assert lse.o_bytes.link == ob.link + cm.exchange_bytes(1, 128, 2, 8192, 4).link
    assert lse.shardq_ms > p.shardq_ms
    red = cm.shardq_step_ms(DS, 2, 8192, tp_attn_ms=8.2, shardq_attn_ms=9.0, link=link, form="reduced")
    assert red.exchange_ms < p.exchange_ms / 3
    with pytest.raises(ValueError, match="shardq_attn_ms"):
        cm.shardq_step_ms(DS, 2, 8192, tp_attn_ms=1.0, shardq_attn_ms=[], link=link)


def test_extra_weight_bytes():
    # DeepSeek-V3.2: kv_b_proj [128 * (128 + 128), 512] bf16 = 32 MiB; W = 8 holds 1/8, needs 7/8 more.
    assert cm.extra_weight_bytes(DS, 8) == 28 * 2**20
    assert cm.extra_weight_bytes(GLM, 4) == 64 * (192 + 256) * 512 * 2 * 3 // 4
    assert cm.extra_weight_bytes(DS, 1) == 0


def test_fit_link_recovers_synthetic_parameters():
    true = cm.Link("true", bandwidth_gbs=300.0, latency_ms=0.2, copy_gbs=cm.H200_HBM_GBS * cm.COPY_EFFICIENCY)
    rows = []
    for T in (8192, 16384, 65536):
        r = dict(model="deepseek-v3.2", tp=2, heads=128, d_qk=576, d_v=512, tokens=T, path="shardq")
        r["xchg_q_ms"] = cm.exchange_ms(cm.exchange_bytes(576, 128, 2, T, 2), true)
        r["xchg_out_ms"] = cm.exchange_ms(cm.exchange_bytes(512, 128, 2, T, 2), true)
        rows.append(r)
    fit = cm.fit_link(rows)
    assert fit.bandwidth_gbs == pytest.approx(300.0, rel=1e-9)
    assert fit.latency_ms == pytest.approx(0.2, rel=1e-9)


def test_shipped_calibration_is_the_committed_runs():
    """The package data default_docs reads (sparse_mla/distributed/data/) is calibration_docs of the committed
    results/bench_shardq.json and results/bench.json: a new committed run needs
    ``python -m sparse_mla.distributed.cost_model --write-data``."""
    sq, bench = (json.loads((RESULTS / name).read_text()) for name in ("bench_shardq.json", "bench.json"))
    assert cm.default_docs() == cm.calibration_docs(sq, bench)


def test_model_against_committed_two_gpu_measurement(capsys):
    """Link fitted on the glm-5 rows, deepseek-v3.2 rows held out. The attention time is an input
    (the run's own per-rank figures), so the total error mostly measures the exchange model;
    the exchange error on the held-out rows is the real check. Prints the table."""
    sq, _ = cm.default_docs()
    fit_glm, fit_all = cm.calibrated_links(sq)
    rows = cm.validate(sq, fit_glm)
    with capsys.disabled():
        print("\n" + cm.format_validation(rows))
    assert len(rows) == 12
    held_out = [r for r in rows if r["model"] == "deepseek-v3.2"]
    assert held_out and max(abs(r["xchg_err"]) for r in held_out) < 0.15
    assert max(abs(r["total_err"]) for r in rows) < 0.15
    assert max(abs(r["speedup_err"]) for r in rows) < 0.15
    # The fitted link is a plausible NVLink-class figure (faster than PCIe 5 x16, below NVLink peak).
    assert 64 < fit_all.bandwidth_gbs < cm.H200_NVLINK_GBS_PER_DIRECTION


def test_projection_rows_are_marked_and_consistent():
    sq, bench = cm.default_docs()
    fit = cm.calibrated_links(sq)[1]
    rows = cm.projection_table(sq, bench, (fit, cm.NVLINK_H200_PEAK))
    assert rows and all(r["projection"] for r in rows)
    assert {(r["model"], r["tp"]) for r in rows} == set(cm.PROJECTION_POINTS)
    by = {(r["model"], r["tokens"], r["link"], r["form"], r["chunks"]): r for r in rows}
    for (m, T, link, form, n), r in by.items():
        if form == "absorbed":  # fewer bytes never slower; overlap never slower without latency change
            assert by[(m, T, link, "reduced", n)]["shardq_ms"] <= r["shardq_ms"]
        assert r["speedup"] == pytest.approx(r["tp_ms"] / r["shardq_ms"])
    assert "PROJECTION" in cm.format_projection(rows)


def test_model_vs_measured_for_the_bench_table():
    sq, _ = cm.default_docs()
    rows, note = cm.model_vs_measured(sq["results"])
    assert len(rows) == 12 and "GB/s" in note
    interp = [dict(r, interpreted=True) for r in sq["results"]]
    assert cm.model_vs_measured(interp) == ([], "interpreter run: no modelled figures")
    odd = [dict(sq["results"][2], d_qk=512)]  # a shardq row whose widths are not the absorbed ones
    rows, note = cm.model_vs_measured(odd)
    assert rows == [] and "cannot take" in note
