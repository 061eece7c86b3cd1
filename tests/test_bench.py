"""The `sparse-mla bench` / `sparse-mla report` commands on the CPU (Triton interpreter, fp16).

One tiny layer-level run (16 heads per rank, top-k 16): a prompt that fits in the top-k (dense
MHA eligible) and a continuation after a cached prefix (it is not). Every supported path, the
pad-64 baseline included, must be checked against the fp32 reference and timed; unsupported paths
carry their reason; the report prints the README table from the JSON.
"""

import json
import math

import pytest
from typer.testing import CliRunner

from sparse_mla.bench.baselines import PATH_COLUMNS
from sparse_mla.cli import app

RUNNER = CliRunner()
TINY = ["--dims", "16,512,32,64,32", "--tokens", "12,12", "--cached", "0,24", "--topk", "16"]
SCENARIOS = ("dims-16-512-32-64-32/tp1/12", "dims-16-512-32-64-32/tp1/24+12")


def flat(text: str) -> str:
    """CLI output without the error panel's borders and line wraps."""
    return " ".join(text.replace("│", " ").split())


@pytest.fixture(scope="module")
def bench_json(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    res = RUNNER.invoke(app, ["bench", *TINY, "--json", str(out / "b.json"), "--plot", str(out / "b.png")])
    assert res.exit_code == 0, res.output
    assert "NOT performance numbers" in res.output
    assert (out / "b.png").stat().st_size > 0
    return out / "b.json"


def test_bench_json_paths(bench_json):
    data = json.loads(bench_json.read_text())
    assert data["meta"]["timings_meaningful"] is False
    rows = data["results"]
    assert [r["scenario"] for r in rows] == list(SCENARIOS)
    for r in rows:
        assert set(r["paths"]) == set(PATH_COLUMNS)
        assert r["failures"] == []
        for name, rec in r["paths"].items():
            assert rec["reason"], name
            if rec["supported"]:
                assert math.isfinite(rec["ms"]) and rec["ms"] > 0, (r["scenario"], name)
                assert rec["trials_ms"] and rec["min_ms"] <= rec["ms"] <= rec["max_ms"]
                assert rec["rel_err"] < 1e-2 and rec["check_ok"], (r["scenario"], name, rec["rel_err"])
            else:
                assert "ms" not in rec
        assert r["chosen_path"] in r["paths"] and "ms" in r["paths"][r["chosen_path"]]
        assert r["chosen_ms"] == r["paths"][r["chosen_path"]]["ms"]
        assert r["paths"]["mqa_per_token"]["speedup_vs_per_token"] == pytest.approx(1.0)
        assert r["paths"]["mqa_per_token_pad64"]["supported"]  # H = 16 < 64
        assert math.isfinite(r["union_ratio"]) and r["group_size"] == 8
    dense, cached = rows
    assert dense["paths"]["dense_mha"]["supported"] and dense["chosen_path"] == "dense_mha"
    assert not cached["paths"]["dense_mha"]["supported"] and "topk" in cached["paths"]["dense_mha"]["reason"]


def test_report_prints_table(bench_json):
    res = RUNNER.invoke(app, ["report", str(bench_json)])
    assert res.exit_code == 0, res.output
    for name in SCENARIOS:
        assert f"| {name} |" in res.output
    assert "mqa_per_token_pad64 ms" in res.output


def test_report_rejects_other_json(tmp_path):
    f = tmp_path / "x.json"
    f.write_text(json.dumps({"meta": {}, "results": [{"scenario": "a"}]}))
    res = RUNNER.invoke(app, ["report", str(f)])
    assert res.exit_code == 2 and "not a `sparse-mla bench` JSON" in flat(res.output)


@pytest.mark.parametrize("args, option", [
    (["--dims", "16,512,32"], "--dims"),
    (["--dims", "16,512,32,64,x"], "--dims"),
    (["--dims", "0,512,32,64,32"], "--dims"),
    (["--tokens", "8,x"], "--tokens"),
    (["--tokens", "0"], "--tokens"),
    (["--tokens", "8,16", "--cached", "1,2,3"], "--cached"),
    (["--model", "glm-5", "--tp", "3"], "--tp"),
    (["--overlap", "medium"], "--overlap"),
    (["--trials", "0"], "--trials"),
], ids=["dims-short", "dims-nonint", "dims-zero-heads", "tokens-nonint", "tokens-zero", "cached-count", "tp-divide",
        "overlap", "trials"])
def test_bench_rejects_bad_options(args, option):
    res = RUNNER.invoke(app, ["bench", *args, "--json", "/nonexistent/never.json"])
    assert res.exit_code == 2, res.output
    assert f"Invalid value for {option}" in flat(res.output)


def test_bench_torchrun_checks_tp(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    res = RUNNER.invoke(app, ["bench", "--tp", "4"])
    assert res.exit_code == 2 and "Invalid value for --tp: under torchrun it must equal WORLD_SIZE = 2" in flat(res.output)
    res = RUNNER.invoke(app, ["bench", "--dims", "16,512,32,64,32"])
    assert res.exit_code == 2 and "Invalid value for --dims" in flat(res.output)
