"""The op bench's few-token and decode suites (issue 39: the H200 run needs no new code).

On the suite's device (the interpreter in fp16 on a CPU, tiny shapes): the suites' case lists are what the H200 run
needs (their full sizes are checked, never run here); a few-token case (one request, and requests with
cu_seqlens_q) and a decode case (cache in q's dtype and FP8) run, every call checked against the fp32 reference with
the forced-split calls among them; an unwritten output fails the check; FlashMLA's decode baseline, emulated by
stand-ins over this package's drop-in (both forms: the flash_mla package's call, the extension's
``sparse_decode_fwd``), runs on q padded to 64 heads and reuses its schedule metadata; ``sparse-mla report`` renders
the rows (compact tables fit 80 columns); ``sparse-mla bench --op-suite`` parses, refuses what does not apply and
names the suites on a bad one, and writes the op JSON.
"""

from __future__ import annotations

import json
import math
import re
import types

import pytest
import torch
from testlib.device import DEVICE, DTYPE, cpu_only
from typer.testing import CliRunner

import sparse_mla
from sparse_mla.bench import op, op_decode, op_tables
from sparse_mla.cli import app

RUNNER = CliRunner()
TINY_FEW = [op.OpCase(16, "mid", 48, 4, topk=16, kv_splits=(1, 2, 4)),
            op.OpCase(16, "mid", 24, 8, topk=16, cu_seqlens=True, requests=4, kv_splits=(1, 2))]
TINY_DECODE = [op_decode.DecodeCase(2, 2, 4, fp8=False, cached=48, page=16, topk=16, kv_splits=(1, 2, 4)),
               op_decode.DecodeCase(3, 1, 4, fp8=True, cached=32, page=16, topk=16, kv_splits=(1, 4))]


def flat(text: str) -> str:
    return " ".join(text.replace("│", " ").split())


def test_few_token_suite_is_the_h200_grid():
    cases = op.suite("few-token")
    single = [c for c in cases if c.requests == 1]
    assert {(c.cached, c.new, c.heads) for c in single} == {(c, t, h) for c in (32768, 131072) for t in (1, 4, 16, 64, 256)
                                                           for h in (16, 64)}
    batched = [c for c in cases if c.requests > 1]
    assert [(c.heads, c.requests, c.new, c.cached, c.cu_seqlens) for c in batched] == [(16, 64, 128, 32768, True),
                                                                                        (64, 64, 128, 32768, True)]
    assert all(c.requests_lens() == ([32768] * 64, [2] * 64) for c in batched)
    assert all(c.lists == "mid" and c.topk == 2048 and c.kv_splits == (1, 2, 4, 8, 16) and not c.kv_fp8 for c in cases)
    assert len({c.name for c in cases}) == len(cases) == 22


def test_decode_suite_is_the_h200_grid():
    cases = op.suite("decode")
    assert all(isinstance(c, op_decode.DecodeCase) for c in cases)
    assert {(c.b, c.s_q, c.h_q, c.fp8) for c in cases} == {(b, s, h, f) for b in (1, 2, 8, 32, 64, 128) for s in (1, 2)
                                                            for h in (16, 64, 128) for f in (False, True)}
    assert all(c.cached == 32768 and c.page == 64 and c.topk == 2048 and c.kv_splits == (1, 2, 4, 8, 16) and c.d_qk == 576
               for c in cases)
    assert all(c.topk % 64 == 0 and c.cached % c.page == 0 for c in cases)  # what FlashMLA's decode takes
    assert len({c.name for c in cases}) == len(cases) == 72


def test_every_suite_builds_and_unknown_names_are_named():
    for name in op.SUITES:
        assert op.suite(name), name
    for name in op.CPU_SUITES:  # interpreter forms: a few hundred rows per case at most
        cases = op.suite(name, cpu=True)
        assert cases and all(getattr(c, "cached", 0) <= 64 and c.topk <= 16 for c in cases), name
    with pytest.raises(ValueError, match="suite must be one of grouped, .*few-token, decode, got 'nope'"):
        op.suite("nope")
    with pytest.raises(ValueError, match="GPU sizes only .* few-token, decode"):
        op.suite("sweep", cpu=True)
    with pytest.raises(SystemExit):
        op.main(["--suite", "nope"])
    if not torch.cuda.is_available():  # a clear message and exit status 2, not a CUDA traceback
        assert op.main(["--suite", "few-token"]) == 2
    with pytest.raises(ValueError, match="multiple of page"):
        op_decode.DecodeCase(1, 1, 16, cached=100, page=64)


@pytest.fixture(scope="module")
def rows():
    """Real rows of the tiny cases on the suite's device (~10 s through the interpreter)."""
    few = [op.run_case(c, device=str(DEVICE), dtype=DTYPE, trials=1, rep_ms=1) for c in TINY_FEW]
    dec = [op_decode.run_decode_case(c, device=str(DEVICE), dtype=DTYPE, trials=1, rep_ms=1) for c in TINY_DECODE]
    return few + dec


def _assert_checked(rec: dict, name: str, tol: float) -> None:
    assert "error" not in rec, (name, rec)
    assert math.isfinite(rec["max_row_err"]) and rec["max_row_err"] <= tol and rec["ok"], (name, rec)
    assert math.isfinite(rec["ms"]) and rec["ms"] > 0, name


def test_few_token_rows(rows):
    for case, row in zip(TINY_FEW, rows):
        splits = [f"split{s}" for s in case.kv_splits]
        assert set(splits) | {"per_token", "grouped", "auto", "drop_in", "flashmla"} == set(row["calls"]), row["case"]
        for name, rec in row["calls"].items():
            _assert_checked(rec, f"{row['case']} {name}", op.ROW_TOL[DTYPE])
        assert isinstance(row["kv_splits_auto"], int) and row["kv_splits_reason"], row
        assert row["explain_fwd"].splitlines()[1] == f"kv splits: {row['kv_splits_auto']} ({row['kv_splits_reason']})"
        assert row["best_split"] in case.kv_splits and tuple(row["kv_splits"]) == case.kv_splits


def test_decode_rows(rows):
    for case, row in zip(TINY_DECODE, rows[len(TINY_FEW):]):
        assert row["api"] == op_tables.DECODE_API and row["case"] == case.name and row["tokens"] == case.b * case.s_q
        # FlashMLA's decode takes none of these (not Hopper, or top-16: not a multiple of its 64-row tile)
        assert set(row["calls"]) == {"drop_in", *(f"split{s}" for s in case.kv_splits)}
        assert row["baseline"] == ("none: not FP8" if not case.fp8 else "none: topk % 64")
        for name, rec in row["calls"].items():
            _assert_checked(rec, f"{row['case']} {name}", op_decode.ROW_TOL[DTYPE])
            assert rec["lse_err"] <= op_decode.LSE_TOL, (name, rec)
        assert isinstance(row["kv_splits_auto"], int) and row["best_split"] in case.kv_splits
        assert row["floor_ms"] > 0 and row["useful_tflop"] > 0


def test_decode_inputs_are_paged_regions():
    """Each request's lists fall in its own region of the paged cache: physical rows of its blocks (the block
    permutation), distinct per list, and the fixture's cache holds every row (the FP8 cache is the same rows
    quantized)."""
    c = op_decode.DecodeCase(3, 2, 4, fp8=True, cached=64, page=16, topk=16)
    inp = op_decode.decode_inputs(c, DEVICE, DTYPE)
    assert inp["k_cache"].shape == (12, 16, 1, 656) and inp["indices"].shape == (3, 2, 16)
    rows_b = op_decode.decode_inputs(op_decode.DecodeCase(3, 2, 4, cached=64, page=16, topk=16), DEVICE, DTYPE)["k_cache"]
    from sparse_mla.kv_format import FP8_DS_MLA

    assert torch.equal(FP8_DS_MLA.quantize(rows_b.reshape(-1, 576)), inp["k_cache"].reshape(-1, 656))
    idx = inp["indices"].long()
    assert (idx >= 0).all() and (idx < 3 * 64).all()
    regions = []
    for b in range(3):
        blocks = set((idx[b] // 16).flatten().tolist())
        regions.append(blocks)
        for t in range(2):
            assert idx[b, t].unique().numel() == 16
    assert not (regions[0] & regions[1]) and not (regions[1] & regions[2]) and not (regions[0] & regions[2])


def test_decode_check_sees_an_unwritten_output(monkeypatch):
    """The drop-in's outputs start NaN in the checked call: a call that writes nothing fails its check (it is
    recorded, not raised)."""
    from sparse_mla.mqa import flashmla_decode

    monkeypatch.setattr(flashmla_decode, "sparse_mla_fwd", lambda *a, **kw: None)
    row = op_decode.run_decode_case(op_decode.DecodeCase(2, 1, 4, cached=32, page=16, topk=16, kv_splits=(2,)),
                                    device=str(DEVICE), dtype=DTYPE, trials=1, rep_ms=1)
    for rec in row["calls"].values():
        assert rec["max_row_err"] == math.inf and rec["ok"] is False
    assert row["best_split"] is None


@pytest.mark.parametrize("kind", ["flash_mla", "flashmla_sm90"])
def test_decode_baseline_through_a_stand_in(kind, monkeypatch):
    """FlashMLA's sparse decode where importable, emulated by this package's drop-in (same call): the ``flash_mla``
    package's ``get_mla_metadata`` / ``flash_mla_with_kvcache``, or the extension's ``sparse_decode_fwd`` whose
    metadata the second call gets back. q is padded from 4 to 64 heads, the padded heads are cut off, the output is
    checked and timed like the others, and the row says which baseline ran."""
    from sparse_mla.bench import baselines

    seen = []

    def sparse_decode_fwd(q, k_cache, indices, topk_length, attn_sink, sched, splits, d_v, sm_scale):
        seen.append((tuple(q.shape), sched))
        out, lse = sparse_mla.flash_mla_with_kvcache(q, k_cache, None, None, d_v, None, None, sm_scale, False, True,
                                                     indices, attn_sink, topk_length=topk_length)
        return out, lse, torch.zeros(1) if sched is None else sched, torch.ones(1) if splits is None else splits

    def with_kvcache(q, *args, **kw):
        seen.append((tuple(q.shape), args[4]))
        return sparse_mla.flash_mla_with_kvcache(q, *args, **kw)

    mod = (types.SimpleNamespace(get_mla_metadata=sparse_mla.get_mla_metadata, flash_mla_with_kvcache=with_kvcache)
           if kind == "flash_mla" else types.SimpleNamespace(sparse_decode_fwd=sparse_decode_fwd))
    monkeypatch.setattr(baselines, "_flash_mla_decode_module", lambda: (kind, mod))
    monkeypatch.setattr(op_decode, "flash_mla_decode_kind", lambda *a: (kind, "stand-in"))
    case = op_decode.DecodeCase(2, 1, 4, fp8=True, cached=32, page=16, topk=16, kv_splits=(1,))
    row = op_decode.run_decode_case(case, device=str(DEVICE), dtype=DTYPE, trials=2, rep_ms=1)
    assert row["baseline"] == f"{kind} pad64"
    rec = row["calls"]["flashmla"]
    _assert_checked(rec, "flashmla", op_decode.ROW_TOL[DTYPE])
    assert row["calls"]["drop_in"]["vs_flashmla"] == pytest.approx(rec["ms"] / row["calls"]["drop_in"]["ms"])
    assert [s for s, _ in seen] == [(2, 1, 64, 576)] * 3  # checked once, timed twice: always the padded q
    if kind == "flash_mla":
        assert seen[0][1] is seen[1][1] is seen[2][1]  # one metadata object for the call
    else:
        assert seen[0][1] is None and seen[1][1] is not None and seen[2][1] is seen[1][1]  # made once, then passed


def test_split_helpers():
    assert op_decode.auto_splits("method: per_token (x)\nkv splits: 4 (12 work items on 132 SMs: S = 4 (a))\nb") == \
        (4, "12 work items on 132 SMs: S = 4 (a)")
    assert op_decode.auto_splits("no line") == (None, "no line")
    row = {"calls": {"split1": {"ok": True, "ms": 2.0}, "split2": {"ok": False, "ms": 1.0}, "split4": {"ok": True, "ms": 1.5},
                     "split8": {"error": "x"}, "auto": {"ok": True, "ms": 0.1}}}
    assert op_decode.best_split(row) == 4
    assert op_tables.split_calls([row, {"calls": {"split16": {}}}]) == ["split1", "split2", "split4", "split8", "split16"]


def test_graph_figures_and_their_cells():
    """Where a call cannot be captured (here: no CUDA), the record says so and fails; the tables show the replays'
    ms (device time) in the decode table's graph columns and, where measured, in the kv-splits table, "!" after a
    replay whose output failed its check, ERR where the capture raised."""
    from sparse_mla.bench.timing import graph_figures

    if not torch.cuda.is_available():
        rec = graph_figures(lambda: torch.zeros(1), lambda o: 0.0, 1e-2, trials=1)
        assert rec["graph_ok"] is False and rec["graph_error"] and "graph_ms" not in rec

    def rec(ms, graph_ms=None, graph_ok=True):
        out = {"ms": ms, "ok": True, "max_row_err": 1e-3}
        if graph_ms is not None:
            out.update(graph_ms=graph_ms, graph_ok=graph_ok)
        return out

    row = {"case": "b1x1/H16/32768/k2048/fp8", "api": op_tables.DECODE_API, "kv_splits_auto": 8, "best_split": 2,
           "calls": {"drop_in": rec(0.112, 0.0321), "flashmla": rec(0.0217, 0.0123), "split1": rec(0.169, 0.05),
                     "split2": rec(0.185, 0.0312, graph_ok=False), "split4": {**rec(0.175), "graph_error": "E: x",
                                                                               "graph_ok": False}}}
    row["calls"]["drop_in"]["graph_vs_flashmla"] = 0.0123 / 0.0321
    head, (cells,) = op_tables.decode_cells([row])
    fig = dict(zip(head, cells))
    assert (fig["drop_in"], fig["graph"], fig["base"], fig["base gr"], fig["vs base"]) == ("0.112", "0.0321", "0.0217",
                                                                                          "0.0123", "0.38x")
    head, (cells,) = op_tables.split_cells([row])
    assert dict(zip(head, cells)) == {"case": row["case"], "S": "8", "auto": "0.0321", "split1": "0.05",
                                      "split2": "0.0312!", "split4": "ERR", "best": "2"}
    assert op_tables._failed(row)
    assert op_decode.best_split(row) == 1  # by time per call: not every split has a replay that passed


def test_fit_points_from_the_rows(rows, tmp_path, capsys):
    """Every tiny row ran per token with S = 1 among its forced splits: one ``fit_kv_split_model`` point each (lists,
    heads, topk, the checked split times), and ``python -m sparse_mla.bench.op --fit JSON`` fits and prints a model."""
    points = op_decode.kv_split_points(rows)
    assert [p["case"] for p in points] == [r["case"] for r in rows]
    for p, r in zip(points, rows):
        assert (p["num_lists"], p["rows_per_list"]) == (r["tokens"], 16)
        assert p["pseudo_heads"] == r.get("h_q", r.get("heads")) and set(p["times"]) == set(r["kv_splits"])
    path = tmp_path / "op.json"
    path.write_text(json.dumps(_doc(rows)))
    assert op.main(["--fit", str(path), "--sms", "132"]) == 0
    assert re.search(rf"^{len(rows)} points of .* on 132 SMs: KVSplitModel\(min_rows_per_split=", capsys.readouterr().out)


def _doc(rows: list[dict]) -> dict:
    return {"meta": {"kind": "op", "gpu": "none", "git_revision": "abc1234", "date": "2026-12-05"}, "rows": rows}


def test_report_renders_the_rows(rows, tmp_path):
    """`sparse-mla report` of the op JSON with few-token and decode rows: the op, decode and kv-splits tables, each
    compact one within 80 columns with every row's figures whole on one line; --wide and --markdown too."""
    path = tmp_path / "op.json"
    path.write_text(json.dumps(_doc(rows)))
    res = RUNNER.invoke(app, ["report", str(path)], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    out = res.output
    lines = out.splitlines()
    assert max(map(len, lines)) <= 80 and "…" not in out, out
    assert "sparse-mla op bench" in out and "sparse-mla decode bench" in out and "kv splits" in out
    for _, cells in (op_tables.row_cells(rows), op_tables.decode_cells(rows), op_tables.split_cells(rows)):
        for cell in cells:
            pattern = r"\s+".join(re.escape(c) for c in cell[1:])
            assert any(re.search(rf"(^|\s){pattern}(\s|$)", line) for line in lines), (cell, out)
    assert len(op_tables.split_cells(rows)[1]) == len(rows) and len(op_tables.row_cells(rows)[1]) == len(TINY_FEW)
    assert len(op_tables.decode_cells(rows)[1]) == len(TINY_DECODE)
    wide = RUNNER.invoke(app, ["report", "--wide", str(path)], env={"COLUMNS": "80"})
    assert wide.exit_code == 0 and "why S" in wide.output and "lse err" in wide.output, wide.output
    md = RUNNER.invoke(app, ["report", "--markdown", str(path)], env={"COLUMNS": "80"})
    assert md.exit_code == 0 and md.output.count("\n|---|") == 3, md.output
    for row in rows:
        assert f"| {row['case']} |" in md.output


@pytest.mark.parametrize("args, option, match", [
    (["--op-suite", "nope"], "--op-suite", "suite must be one of grouped"),
    (["--op-suite", "decode", "--tokens", "8"], "--tokens", "not with --op-suite"),
    (["--op-suite", "decode", "--model", "glm-5"], "--model", "not with --op-suite"),
    (["--op-suite", "few-token", "--kv-dtype", "fp8"], "--kv-dtype", "not with --op-suite"),
    (["--op-suite", "few-token", "--plot", "x.png"], "--plot", "not with --op-suite"),
], ids=["unknown", "tokens", "model", "kv-dtype", "plot"])
def test_bench_op_suite_rejects(args, option, match):
    res = RUNNER.invoke(app, ["bench", *args, "--json", "/nonexistent/never.json"], env={"COLUMNS": "200"})
    assert res.exit_code == 2, res.output
    assert f"Invalid value for {option}: {match}" in flat(res.output), res.output
    if option == "--op-suite":
        assert "few-token" in flat(res.output) and "decode" in flat(res.output)


@cpu_only("the interpreter forms of the op suites")
def test_bench_op_suite_gpu_only_suite_on_cpu():
    res = RUNNER.invoke(app, ["bench", "--op-suite", "sweep"], env={"COLUMNS": "200"})
    assert res.exit_code == 2 and "GPU sizes only" in flat(res.output), res.output


def test_bench_op_suite_writes_the_op_json(monkeypatch, tmp_path):
    """`sparse-mla bench --op-suite` runs the suite's cases (here one tiny decode case standing in for the suite,
    on either machine), writes the op JSON that `report` renders and prints its tables."""
    case = op_decode.DecodeCase(2, 1, 4, cached=32, page=16, topk=16, kv_splits=(1, 2))
    for table in (op.SUITES, op.CPU_SUITES):
        monkeypatch.setitem(table, "decode", lambda: [case])
    out = tmp_path / "o.json"
    res = RUNNER.invoke(app, ["bench", "--op-suite", "decode", "--trials", "1", "--seed", "3", "--json", str(out)],
                        env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["meta"]["kind"] == "op" and [r["case"] for r in doc["rows"]] == [case.name]
    assert doc["rows"][0]["seed"] == 3 and set(doc["rows"][0]["calls"]) >= {"drop_in", "split1", "split2"}
    assert "sparse-mla decode bench" in res.output and "kv splits" in res.output and f"wrote {out}" in res.output
    rep = RUNNER.invoke(app, ["report", str(out)], env={"COLUMNS": "80"})
    assert rep.exit_code == 0 and case.name in rep.output, rep.output
