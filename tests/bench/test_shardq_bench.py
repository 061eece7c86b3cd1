"""``sparse_mla.bench.shardq``: the ShardQ benchmark's own logic on 2 gloo ranks at tiny sizes (every variant timed
and checked, the table and the plot), its argument checks, and its torchrun requirement."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist
from testlib.distributed import (
    GLOO,
    Backend,
    gloo_only,
    spawn_ranks,
)
from testlib.tolerances import TOLERANCE

from sparse_mla.bench.shardq import VARIANTS, plot_shardq, print_shardq_table, run_shardq_bench

BENCH_ARGS = dict(topk=16, overlap="mid", trials=1, seed=0, min_tokens=0)


def _bench_task(rank: int, W: int, backend: Backend, out_file: str) -> None:
    with pytest.raises(ValueError, match="tp must equal"):  # on every rank, before any communication
        run_shardq_bench([("glm-5", 2 * W)], [40], **BENCH_ARGS)
    doc = run_shardq_bench([("glm-5", W)], [40], check=True, **BENCH_ARGS)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(doc, f)
    else:
        assert doc is None, "only rank 0 gets the results"


@pytest.mark.slow
@gloo_only
def test_run_shardq_bench_on_gloo_ranks(tmp_path, monkeypatch, capsys):
    """run_shardq_bench on 2 gloo ranks: every variant timed and checked, rows / summary / meta
    complete; the table and the plot render from the rows."""
    out_file = tmp_path / "bench.json"
    spawn_ranks(monkeypatch, tmp_path, 2, GLOO, _bench_task, str(out_file), timeout_s=120.0)
    doc = json.loads(out_file.read_text())
    rows = doc["rows"]
    assert [r["variant"] for r in rows] == list(VARIANTS)  # glm-5 at W = 2: G = 4 (TP), 2 (ShardQ)
    for r in rows:
        assert (r["model"], r["tp"], r["tokens"], r["heads"], r["heads_per_rank"]) == ("glm-5", 2, 40, 64, 32)
        for key in ("total_ms", "attn_ms", "xchg_q_ms", "xchg_out_ms", "tflops", "union_g"):
            assert math.isfinite(r[key]) and r[key] >= 0, (r["variant"], key, r[key])
        tol = TOLERANCE[torch.float16]  # gloo ranks run the interpreter in fp16: the library's fp16 tolerance
        assert r["err_vs_ref"] < tol and r["err_vs_tp"] < tol and not r["nan"] and r["check_ok"], r
        assert (r["xchg_q_ms"] > 0) == (r["path"] == "shardq")
    (s,) = doc["summary"]
    assert s["tokens"] == 40 and s["speedup"] > 0 and s["tp_best_variant"].startswith("tp/")
    meta = doc["meta"]
    assert meta["world_size"] == 2 and meta["backend"] == "gloo" and meta["nccl_nvls_enable"] == "0"
    assert meta["check_limit"] == TOLERANCE[torch.float16]
    assert meta["dtype"] == "torch.float16" and "synthetic_topk" in meta["topk_source"] and meta["git_revision"]
    print_shardq_table(rows)
    assert "shardq/grouped" in capsys.readouterr().out
    plot_shardq(str(tmp_path / "bench.png"), rows)
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("change,match", [
    (dict(models=[]), "models"),
    (dict(models=[("glm-6", 2)]), "unknown model"),
    (dict(models=[("glm-5",)]), r"models\[0\]"),
    (dict(models=[("glm-5", 4)]), "tp must equal"),
    (dict(models=[("deepseek-v3.2", 2), ("glm-5", "2")]), r"models\[1\] tp"),
    (dict(tokens=[]), "tokens"),
    (dict(tokens=[40, 0]), r"tokens\[1\]"),
    (dict(tokens=[512], min_tokens=1024), r"tokens\[0\] = 512 < min_tokens = 1024"),
    (dict(topk=0), "topk"),
    (dict(trials=0), "trials"),
    (dict(trials=True), "trials"),
    (dict(seed=-1), "seed"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(overlap="medium"), "overlap preset"),
    (dict(overlap=None), "overlap"),
], ids=lambda v: str(v) if isinstance(v, str) else None)
def test_run_shardq_bench_rejects_bad_arguments(change, match, monkeypatch):
    """Every bad argument: a ValueError naming it, before any process group or kernel launch."""
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it; no process group is started
    kwargs = dict(models=[("glm-5", 2)], tokens=[40], **BENCH_ARGS)
    kwargs.update(change)
    with pytest.raises(ValueError, match=match):
        run_shardq_bench(kwargs.pop("models"), kwargs.pop("tokens"), **kwargs)
    assert not dist.is_initialized()


def test_run_shardq_bench_needs_torchrun_and_two_ranks(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        run_shardq_bench([("glm-5", 2)], [40], **BENCH_ARGS)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="world size >= 2"):
        run_shardq_bench([("glm-5", 1)], [40], **BENCH_ARGS)


