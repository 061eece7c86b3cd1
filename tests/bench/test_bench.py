"""The `sparse-mla bench` / `sparse-mla report` commands.

On a CPU machine, one tiny layer-level run through the Triton interpreter (fp16; 16 heads per rank, top-k 16):
a prompt that fits in the top-k (dense MHA eligible) and a continuation after a cached prefix (it is not).
Every supported path, the pad-64 baseline included, must be checked against the fp32 reference and timed;
unsupported paths carry their reason; the report prints the README table from the JSON (and the committed GPU
run's). Those tests are about the interpreter run (its banner, its fp16 tolerance) and are skipped on a CUDA
machine. Plus, on any machine: the CLI's option checks and trial defaults, ``run_scenario``'s argument checks and
error recording, ``best_path``, the timing quantiles, the union ratio and the pad-64 baseline's FlashMLA call on
the suite's device, and the JSON's provenance.
"""

import contextlib
import io
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from testlib.device import DEVICE, DTYPE, HAS_CUDA, cpu_only
from testlib.paths import REPO, RESULTS
from testlib.tolerances import LAYER_ROW_TOLERANCE, TOLERANCE, all_of, assert_rows_close
from typer.testing import CliRunner

import sparse_mla
import sparse_mla.cli as cli
from sparse_mla.bench.baselines import PAD64_NAME, PATH_COLUMNS
from sparse_mla.bench.check import CHECK_TOLERANCE
from sparse_mla.bench.common import load
from sparse_mla.cli import app
from sparse_mla.layer.dispatch import PATH_NAMES

RUNNER = CliRunner()
TINY = ["--dims", "16,512,32,64,32", "--tokens", "12,12", "--cached", "0,24", "--topk", "16"]
SCENARIOS = ("dims-16-512-32-64-32/tp1/12", "dims-16-512-32-64-32/tp1/24+12")
COMMITTED = RESULTS / "bench.json"
# The tests of the interpreter run (bench_json): its "NOT performance numbers" banner, timings_meaningful False,
# the fp16 tolerance, the scenarios the interpreter runs.
interpreter_bench = cpu_only("the bench's Triton-interpreter run (fp16, its banner and JSON)")


def flat(text: str) -> str:
    """CLI output without the error panel's borders and line wraps."""
    return " ".join(text.replace("│", " ").split())


@pytest.fixture(scope="module")
def bench_json(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    res = RUNNER.invoke(app, ["bench", *TINY, "--trials", "2", "--json", str(out / "b.json"), "--plot", str(out / "b.png")])
    assert res.exit_code == 0, res.output
    # the banner marks the interpreter run (CPU) and only it
    assert ("NOT performance numbers" in res.output) == (not torch.cuda.is_available()), res.output
    assert (out / "b.png").stat().st_size > 0
    return out / "b.json"


@interpreter_bench
def test_bench_json_paths(bench_json):
    data = json.loads(bench_json.read_text())
    assert data["meta"]["timings_meaningful"] is False and data["meta"]["trials"] == 2
    assert data["meta"]["kv_format"] is None  # the default run: the cache in the run's dtype, no FP8 fields below
    assert "p20_ms" in data["meta"]["fields"]["paths"] and "best_path" in data["meta"]["fields"]
    rows = data["rows"]
    assert [r["scenario"] for r in rows] == list(SCENARIOS)
    for r in rows:
        assert set(r["paths"]) == set(PATH_COLUMNS)
        assert "kv_format" not in r and all("rel_err_vs_bf16_cache" not in rec for rec in r["paths"].values())
        assert r["failures"] == []
        for name, rec in r["paths"].items():
            assert rec["reason"], name
            if rec["supported"]:
                assert math.isfinite(rec["ms"]) and rec["ms"] > 0, (r["scenario"], name)
                assert len(rec["trials_ms"]) == 2 and rec["min_ms"] <= rec["ms"] <= rec["max_ms"]
                assert rec["p20_ms"] <= rec["ms"] <= rec["p80_ms"]
                # the library's fp16 tolerance (the interpreter runs fp16), not the bf16 one
                assert r["check_tol"] == TOLERANCE[torch.float16] == CHECK_TOLERANCE[torch.float16]
                assert rec["rel_err"] < r["check_tol"] and rec["check_ok"], (r["scenario"], name, rec["rel_err"])
            else:
                assert "ms" not in rec
        assert r["chosen_path"] in r["paths"] and "ms" in r["paths"][r["chosen_path"]]
        assert r["chosen_ms"] == r["paths"][r["chosen_path"]]["ms"]
        assert r["paths"]["mqa_per_token"]["speedup_vs_per_token"] == pytest.approx(1.0)
        assert r["paths"]["mqa_per_token_pad64"]["supported"]  # H = 16 < 64
        assert math.isfinite(r["union_ratio"]) and r["group_size"] == 8
        assert {"ms", "p20_ms", "p80_ms", "trials_ms"} <= set(r["union_build"])
        checked = {n: r["paths"][n]["ms"] for n in PATH_NAMES if r["paths"][n].get("check_ok")}
        assert r["best_path"] == min(checked, key=checked.get)
    dense, cached = rows
    assert dense["paths"]["dense_mha"]["supported"] and dense["chosen_path"] == "dense_mha"
    assert not cached["paths"]["dense_mha"]["supported"] and "topk" in cached["paths"]["dense_mha"]["reason"]


@pytest.mark.parametrize("cached, new", [pytest.param(0, 40, id="pure-40"), pytest.param(30, 21, id="cached-30+21")])
def test_union_stats_ratio_from_sets(cached, new):
    """The bench's union ratio (group plan + union builder + the post-processing in bench.union_stats) equals
    the figure computed from Python sets of the same lists: mean union rows of the full groups of
    G = 128 // H queries / mean valid rows per query of those groups."""
    from sparse_mla.bench.inputs import make_inputs
    from sparse_mla.bench.union_stats import union_stats
    from sparse_mla.workloads.models import MODELS

    H, K = 16, 16
    G = 128 // H
    inp = make_inputs(MODELS["glm-5"], cached, new, K, H, "mid", 3, DEVICE, DTYPE)
    got = union_stats(inp, H, on_gpu=HAS_CUDA, trials=1)
    rows = [{r for r in row if r >= 0} for row in inp["indices"].tolist()]  # lists are -1 padded, in-window
    groups = [set().union(*rows[g:g + G]) for g in range(0, new // G * G, G)]
    valid = [len(r) for r in rows[: new // G * G]]
    expected = (sum(map(len, groups)) / len(groups)) / (sum(valid) / len(valid))
    assert got["group_size"] == G and got["union_ratio"] == pytest.approx(expected, rel=1e-12)
    assert 1.0 < expected < G  # neighbours share rows, but not all of them


@interpreter_bench
def test_report_prints_table(bench_json):
    res = RUNNER.invoke(app, ["report", "--markdown", str(bench_json)])
    assert res.exit_code == 0, res.output
    for name in SCENARIOS:
        assert f"| {name} |" in res.output
    assert "mqa_per_token_pad64 ms" in res.output


def test_report_renders_committed_results():
    """The committed GPU run (written before p20_ms / p80_ms existed) still renders."""
    rows = load(json.loads(COMMITTED.read_text()))[2]
    res = RUNNER.invoke(app, ["report", "--markdown", str(COMMITTED)])
    assert res.exit_code == 0, res.output
    assert "Triton interpreter" not in res.output
    for r in rows:
        assert f"| {r['scenario']} |" in res.output


def test_report_renders_committed_shardq_results():
    """A `--tp W` run's JSON (ShardQ vs TP) prints its own table rather than a schema error."""
    shardq = COMMITTED.parent / "bench_shardq.json"
    res = RUNNER.invoke(app, ["report", str(shardq)], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    for s in json.loads(shardq.read_text())["summary"]:
        assert f"{s['speedup']:.2f}x" in res.output


def test_report_rejects_other_json(tmp_path):
    f = tmp_path / "x.json"
    f.write_text(json.dumps({"meta": {}, "results": [{"scenario": "a"}]}))
    res = RUNNER.invoke(app, ["report", str(f)])
    assert res.exit_code == 2 and "not a JSON that `sparse-mla report` renders" in flat(res.output)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs the git command")
def test_git_revision_is_the_imported_package_own(tmp_path, monkeypatch):
    """The bench JSON records the revision of the package that runs, never that of the repository around the
    working directory: a source copy of the package, untracked inside another repository and run from there, is
    "unknown"; once that repository tracks the copy, its HEAD; a copy outside any repository, "unknown". Beside
    it, sparse_mla_version is the package's __version__."""
    import sparse_mla
    from sparse_mla.bench.common import git_revision
    from sparse_mla.bench.report import provenance

    monkeypatch.delenv("GIT_REV", raising=False)
    other = tmp_path / "other"
    copy = other / "vendor" / "sparse_mla"
    shutil.copytree(Path(sparse_mla.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=other, check=True,
                              capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    (other / "README").write_text("another project\n")
    git("add", "README")
    git("commit", "-q", "-m", "another project")
    env = {k: v for k, v in os.environ.items() if k != "GIT_REV"}
    env["PYTHONPATH"] = str(other / "vendor")
    run = subprocess.run([sys.executable, "-c", "import sparse_mla, sparse_mla.bench.common as r; "
                          "print(sparse_mla.__file__); print(r.git_revision())"], cwd=other, env=env, check=True,
                         capture_output=True, text=True)
    imported, rev = run.stdout.split()
    assert Path(imported) == copy / "__init__.py" and rev == "unknown", run.stdout
    git("add", "vendor")
    git("commit", "-q", "-m", "vendor sparse_mla")
    assert git_revision(copy) == git("rev-parse", "HEAD")
    loose = tmp_path / "loose"
    loose.mkdir()
    shutil.copy(copy / "__init__.py", loose)
    assert git_revision(loose) == "unknown"
    meta = provenance(interpreted=True, trials=1)
    assert meta["git_revision"] == git_revision() and meta["sparse_mla_version"] == sparse_mla.__version__


@pytest.mark.parametrize("args, option", [
    (["--dims", "16,512,32"], "--dims"),
    (["--dims", "16,512,32,64,x"], "--dims"),
    (["--dims", "0,512,32,64,32"], "--dims"),
    (["--tokens", "8,x"], "--tokens"),
    (["--tokens", "0"], "--tokens"),
    (["--tokens", "8,16", "--cached", "1,2,3"], "--cached"),
    (["--model", "glm-5", "--tp", "3"], "--tp"),
    (["--dims", "16,512,32,64,32", "--tp", "3"], "--tp"),
    (["--overlap", "medium"], "--overlap"),
    (["--trials", "0"], "--trials"),
], ids=["dims-short", "dims-nonint", "dims-zero-heads", "tokens-nonint", "tokens-zero", "cached-count", "tp-divide",
        "tp-divide-dims", "overlap", "trials"])
def test_bench_rejects_bad_options(args, option):
    res = RUNNER.invoke(app, ["bench", *args, "--json", "/nonexistent/never.json"])
    assert res.exit_code == 2, res.output
    assert f"Invalid value for {option}" in flat(res.output), res.output


def test_bench_torchrun_checks_tp(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    res = RUNNER.invoke(app, ["bench", "--tp", "4"])
    assert res.exit_code == 2 and "Invalid value for --tp: under torchrun it must equal WORLD_SIZE = 2" in flat(res.output)
    res = RUNNER.invoke(app, ["bench", "--dims", "16,512,32,64,32"])
    assert res.exit_code == 2 and "Invalid value for --dims" in flat(res.output)
    res = RUNNER.invoke(app, ["bench", "--dtype", "fp16"])
    assert res.exit_code == 2 and "Invalid value for --dtype: is for the single-GPU" in flat(res.output)


@pytest.fixture
def trace_file(tmp_path):
    """An engine dump with no rows: [0, 4] top-k lists."""
    f = tmp_path / "empty.pt"
    torch.save({"topk": torch.empty(0, 4, dtype=torch.int32), "valid": torch.empty(0, dtype=torch.int32)}, f)
    return str(f)


@pytest.mark.parametrize("option, value", [("--tokens", "8"), ("--cached", "0"), ("--topk", "16"), ("--overlap", "high")])
def test_bench_rejects_options_a_trace_overrides(trace_file, option, value):
    res = RUNNER.invoke(app, ["bench", "--topk-trace", trace_file, option, value, "--json", "/nonexistent/never.json"])
    assert res.exit_code == 2 and f"Invalid value for {option}: not with --topk-trace" in flat(res.output)


def test_bench_labels_an_empty_trace(trace_file):
    res = RUNNER.invoke(app, ["bench", "--topk-trace", trace_file, "--json", "/nonexistent/never.json"])
    assert res.exit_code == 2 and "Invalid value for --topk-trace: a scenario needs new >= 1" in flat(res.output)


def test_default_trials():
    assert cli.default_trials(None, on_gpu=True, torchrun=False) == cli.TRIALS_GPU == 5
    assert cli.default_trials(None, on_gpu=True, torchrun=True) == cli.TRIALS_TORCHRUN == 3
    assert cli.default_trials(None, on_gpu=False, torchrun=False) == cli.default_trials(None, on_gpu=False, torchrun=True) == 1
    assert cli.default_trials(7, on_gpu=True, torchrun=True) == 7


class _Stop(Exception):
    pass


def test_bench_default_trials_reach_the_runners(monkeypatch):
    """As on a GPU (the device check stubbed): the single-GPU runner gets 5 trials, ShardQ under torchrun 3."""
    import sparse_mla.bench.runner as runner
    import sparse_mla.bench.shardq as shardq

    seen = {}

    def fake_run_scenario(sc, **kw):
        seen["single"] = kw["trials"]
        raise _Stop

    def fake_shardq(models, tokens, **kw):
        seen["torchrun"] = kw["trials"]
        return None  # as on a rank other than 0: nothing to write

    monkeypatch.setattr(cli, "_kernel_device", lambda: True)
    monkeypatch.setattr(runner, "run_scenario", fake_run_scenario)
    monkeypatch.setattr(shardq, "run_shardq_bench", fake_shardq)
    res = RUNNER.invoke(app, ["bench", "--json", "/nonexistent/never.json"])
    assert isinstance(res.exception, _Stop) and seen["single"] == 5
    monkeypatch.setenv("WORLD_SIZE", "2")
    res = RUNNER.invoke(app, ["bench"])
    assert res.exit_code == 0, res.output
    assert seen["torchrun"] == 3


@pytest.fixture(scope="module")
def tiny_scenario():
    from sparse_mla.bench.scenarios import build_scenarios, model_from_dims

    return build_scenarios([(model_from_dims("16,512,32,64,32"), 1)], [(0, 12)], 16)[0]


@pytest.mark.parametrize("kw, match", [
    ({"trials": 0}, "trials"), ({"trials": 1.5}, "trials"), ({"tol": 0.0}, "tol"), ({"tol": float("nan")}, "tol"),
])
def test_run_scenario_checks_arguments_first(monkeypatch, tiny_scenario, kw, match):
    import sparse_mla.bench.runner as runner

    monkeypatch.setattr(runner, "make_inputs", lambda *a: pytest.fail("inputs made before the argument checks"))
    with pytest.raises(ValueError, match=match):
        runner.run_scenario(tiny_scenario, dtype=torch.float16, device=torch.device("cpu"), **kw)


def test_measure_records_runtime_errors_only():
    from sparse_mla.bench.runner import _measure

    out = torch.empty(2, 2)
    kw = {"useful": 1, "on_gpu": False, "trials": 1, "tol": 1e-2}

    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory")

    rec = _measure(oom, (True, "ok"), out, [], **kw)
    assert rec["supported"] and rec["error"].startswith("OutOfMemoryError") and "ms" not in rec

    def bug():
        raise TypeError("a bug")

    with pytest.raises(TypeError, match="a bug"):
        _measure(bug, (True, "ok"), out, [], **kw)
    assert _measure(bug, (False, "no"), out, [], **kw) == {"supported": False, "reason": "no"}


def test_best_path_is_a_checked_dispatcher_path():
    from sparse_mla.bench.runner import best_path

    grouped, per_token = "mqa_grouped", "mqa_per_token"
    paths = {name: {"supported": False, "reason": "-"} for name in PATH_COLUMNS}
    paths[PAD64_NAME] = {"supported": True, "ms": 0.1, "check_ok": True}  # fastest, but a baseline
    paths[grouped] = {"supported": True, "ms": 0.2, "check_ok": False}  # faster, but wrong
    paths[per_token] = {"supported": True, "ms": 0.5, "check_ok": True}
    assert best_path(paths) == per_token
    paths[per_token]["check_ok"] = False
    assert best_path(paths) is None
    paths[grouped] = {"supported": True, "error": "OutOfMemoryError: ..."}
    assert best_path(paths) is None


def test_time_trials_quantiles(monkeypatch):
    """On a GPU: ms = median of the trial medians, p20_ms / p80_ms = medians of the trial quantiles."""
    import triton.testing

    from sparse_mla.bench.timing import time_trials

    trials = [(2.0, 1.0, 3.0), (4.0, 3.5, 9.0), (3.0, 2.5, 3.1)]
    calls = []

    def fake_do_bench(fn, *, warmup, rep, quantiles):
        calls.append(quantiles)
        return list(trials[len(calls) - 1])

    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    t = time_trials(lambda: None, on_gpu=True, trials=3)
    assert calls == [[0.5, 0.2, 0.8]] * 3
    assert t == {"ms": 3.0, "p20_ms": 2.5, "p80_ms": 3.1, "min_ms": 2.0, "max_ms": 4.0, "trials_ms": [2.0, 4.0, 3.0]}
    t = time_trials(lambda: None, on_gpu=False, trials=2)
    assert t["p20_ms"] <= t["ms"] <= t["p80_ms"] and len(t["trials_ms"]) == 2
    assert t["ms"] == statistics.median(t["trials_ms"])
    with pytest.raises(ValueError, match="trials"):
        time_trials(lambda: None, on_gpu=False, trials=0)


# ---------------------------------------------------------------------------------------------
# First-run polish: help screens, topk-stats at 80 columns, the CPU bench plot


@pytest.mark.parametrize("help_flag", ["--help", "-h"])
@pytest.mark.parametrize("args, usage", [
    pytest.param([], "Usage: sparse-mla [OPTIONS] COMMAND [ARGS]...", id="app"),
    pytest.param(["bench"], "Usage: sparse-mla bench [OPTIONS]", id="bench"),
    pytest.param(["report"], "Usage: sparse-mla report [OPTIONS] JSON", id="report"),
    pytest.param(["topk-stats"], "Usage: sparse-mla topk-stats [OPTIONS] FILE", id="topk-stats"),
])
def test_help_screens(args, usage, help_flag):
    """-h as well as --help: usage lines name arguments plainly (FILE / JSON, not {file}), no `--help <bool>`, no
    option shown as a bare Python type (`<str>`, `<int>`, `<bool>` for a flag), and every option but the flags
    (--help, --version, --wide, --markdown) shows its default."""
    res = RUNNER.invoke(app, [*args, help_flag], env={"COLUMNS": "80"}, prog_name="sparse-mla")
    assert res.exit_code == 0, res.output
    out = res.output
    assert usage in out, out
    assert "<bool>" not in out and "<str>" not in out and "<int>" not in out and "{" not in out, out
    assert all(len(line) <= 80 for line in out.splitlines()), max(out.splitlines(), key=len)
    flags = ("--help", "--version", "--wide", "--markdown")
    options = [line for line in out.splitlines() if line.startswith("│ --") and not any(f in line for f in flags)]
    assert len(options) == out.count("[default:"), out


def test_topk_stats_fits_80_columns(tmp_path):
    """sparse-mla topk-stats at 80 columns: nothing cut (no ellipsis), every line fits, the figures are the
    library's (``topk_stats_table``)."""
    from sparse_mla.workloads import synthetic_topk
    from sparse_mla.workloads.stats import topk_stats_table
    from sparse_mla.workloads.traces import TopkTrace, save_trace

    traces = []
    for layer in (0, 61):
        pos, valid = synthetic_topk(0, 300, 64, "mid", seed=layer)
        traces.append(TopkTrace(layer=layer, topk=pos, valid=valid))
    path = tmp_path / "trace.pt"
    save_trace(path, traces)
    res = RUNNER.invoke(app, ["topk-stats", str(path), "--group-sizes", "2,8,16"], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert "…" not in res.output and all(len(line) <= 80 for line in lines), res.output
    rows = topk_stats_table(str(path), (2, 8, 16))
    for r in rows:
        cells = [str(r["layer"]), str(r["G"]), str(r["groups"]), f"{r['union_rows']:.1f}", f"{r['ratio_mean']:.3f}",
                 f"{r['ratio_p90']:.3f}", f"{r['ratio_max']:.3f}"]
        assert any(all(c in line for c in cells) for line in lines), (cells, res.output)
    assert sum("│    61 │" in line for line in lines) == 1 + 3  # the lists table and three G rows


@interpreter_bench
def test_cpu_bench_plot(bench_json, tmp_path):
    """The interpreter run's plot: the title says so, each panel has two or more bars per path (two
    scenarios: not single points), the chosen path of every scenario is marked."""
    from sparse_mla.bench.report import bench_rows, plot

    meta, rows = bench_rows(json.loads(bench_json.read_text()), str(bench_json))
    drawn = plot(str(tmp_path / "p.png"), rows, interpreted=True)
    assert "interpreter" in drawn["title"] and "NOT performance numbers" in drawn["title"]
    (panel,) = drawn["panels"]  # one layout (--dims)
    assert panel["kind"] == "bars" and panel["x"] == ["12", "24+12"]
    assert panel["chosen"] == [r["chosen_path"] for r in rows] and all_of(c is not None for c in panel["chosen"])
    gpu = plot(str(tmp_path / "g.png"), load(json.loads(COMMITTED.read_text()))[2], interpreted=False)
    assert "interpreter" not in gpu["title"]
    assert all_of(p["kind"] == "lines" and len(p["x"]) >= 2 for p in gpu["panels"])


def test_pad64_baseline_runs_flash_mla_when_installed(monkeypatch):
    """With a ``flash_mla`` package importable on a Hopper GPU the pad-64 baseline calls its
    ``flash_mla_sparse_fwd`` (FlashMLA's shapes: kv [N, 1, D], indices [T, 1, K]); emulated here, on the suite's
    device and dtype, by a stand-in module over this package's compatible entry point, it must give the output of
    the pad-64 run on this package's kernel (what runs without flash_mla), and the bench records which baseline
    ran."""
    import types

    import sparse_mla
    from sparse_mla.bench import baselines
    from sparse_mla.bench.inputs import make_inputs
    from sparse_mla.workloads.models import MODELS

    calls = []

    def fake_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
        calls.append((tuple(q.shape), tuple(kv.shape), tuple(indices.shape)))
        return sparse_mla.flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=d_v, attn_sink=attn_sink,
                                               topk_length=topk_length)

    inp = make_inputs(MODELS["glm-5"], 40, 24, 32, 16, "mid", 5, DEVICE, DTYPE)
    T, H = inp["q_nope"].shape[:2]
    assert baselines.pad64_baseline_kind(torch.device("cpu")) == "sparse_mla:triton"
    monkeypatch.setattr(baselines, "_flash_mla_module", lambda: None)  # as without flash_mla, whatever is installed
    assert baselines.pad64_baseline_kind(DEVICE).startswith("sparse_mla:")
    default = baselines.mqa_per_token_pad64(inp, torch.empty(T, H, 256, dtype=DTYPE, device=DEVICE))
    monkeypatch.setattr(baselines, "_flash_mla_module", lambda: types.SimpleNamespace(flash_mla_sparse_fwd=fake_fwd))
    monkeypatch.setattr(baselines, "pad64_baseline_kind", lambda device, *a, **kw: "flash_mla")
    flash = baselines.mqa_per_token_pad64(inp, torch.empty(T, H, 256, dtype=DTYPE, device=DEVICE))
    assert calls == [((T, 64, 576), (64, 1, 576), (T, 1, 32))]
    assert_rows_close(flash, default, DTYPE, "pad64 through the flash_mla stand-in", LAYER_ROW_TOLERANCE)


# ---------------------------------------------------------------------------------------------
# The CLI: --version, the CLI without the bench extra, compact tables at 80 columns, `report` of every JSON kind.


def test_version():
    """--version: the package's version and the torch / Triton it runs on, exit 0."""
    import triton

    res = RUNNER.invoke(app, ["--version"], prog_name="sparse-mla")
    assert res.exit_code == 0, res.output
    assert res.output.strip() == f"sparse-mla {sparse_mla.__version__} (torch {torch.__version__}, triton {triton.__version__})"


_BLOCKER = """
import importlib.abc, sys
BLOCKED = set(sys.argv[1].split(","))
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name.split(".")[0])
sys.meta_path.insert(0, Block())
sys.argv = ["sparse-mla", *sys.argv[2:]]
import runpy
runpy.run_module("sparse_mla", run_name="__main__")
"""


@pytest.mark.parametrize("blocked, args", [
    pytest.param("typer", ["--version"], id="no-typer"),
    pytest.param("tqdm", ["bench", "--dims", "16,512,32,64,32", "--tokens", "12", "--topk", "16"], id="no-tqdm"),
])
def test_cli_without_the_bench_extra(blocked, args):
    """`python -m sparse_mla` (and so `sparse-mla`) on a core install: exit 1 with a message naming the extra."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])  # this tree's sparse_mla
    res = subprocess.run([sys.executable, "-c", _BLOCKER, blocked, *args], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "pip install 'sparse-mla[bench]'" in res.stderr and f"({blocked} is not installed)" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr, res.stderr


def test_safetensors_trace_without_safetensors(monkeypatch, tmp_path):
    """A .safetensors trace on a core install: an ImportError naming the extra (read and write)."""
    from sparse_mla.workloads.traces import TopkTrace, load_trace, save_trace

    path = tmp_path / "t.safetensors"
    trace = TopkTrace(layer=None, topk=torch.zeros(2, 4, dtype=torch.int32), valid=torch.full((2,), 4, dtype=torch.int32))
    save_trace(path, trace)
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ImportError, match=r"pip install 'sparse-mla\[bench\]'"):
        load_trace(path)
    with pytest.raises(ImportError, match=r"pip install 'sparse-mla\[bench\]'"):
        save_trace(tmp_path / "u.safetensors", trace)


# Tables at 80 columns (compact by default, --wide, --markdown) and `report` of every JSON kind (bench.kinds)


def _shardq_layer_rows() -> list[dict]:
    """Rows as ``shardq_layer._bench_point`` writes them (the real ones need 2 ranks: tests/test_shardq_mla.py)."""
    rows = []
    for variant, chunks in (("tp", 1), ("shardq-absorbed", 1), ("shardq-absorbed", 4), ("shardq-reduced", 2)):
        r = dict(model="deepseek-v3.2", tp=8, heads=128, tokens=65536, topk=2048, overlap="mid", variant=variant,
                 chunks=chunks, form=variant.split("-")[1] if "-" in variant else "none", trials=3, warmup=2,
                 interpreted=False, total_ms=102.125, attention_ms=73.75, exposed_exchange_ms=28.5, err_vs_tp=1.3e-05,
                 err_vs_ref=1.9e-03, nan=False, check_ok=True, speedup_vs_tp=0.7129)
        if variant != "tp":
            r.update(model_ms=101.25, model_xchg_ms=27.5, model_err=-0.0125)
        rows.append(r)
    rows[-1]["check_ok"] = False
    return rows


@pytest.fixture(scope="module")
def op_rows():
    """Two real ``bench.op.run_case`` rows on tiny cases (the grouped-capable H16, and H128 without grouped)."""
    from sparse_mla.bench import op

    cases = [op.OpCase(16, "mid", 16, 8, topk=8), op.OpCase(128, "uniform", 16, 4, topk=8, sink=True, topk_length=True)]
    return [op.run_case(c, device=str(DEVICE), dtype=DTYPE, trials=1, rep_ms=1) for c in cases]


def _docs(op_rows) -> dict[str, dict]:
    """One document of every kind, as its writer leaves it minus the kind stamp (the committed files have none)."""
    shardq_layer = {"meta": {"gpu": "NVIDIA H200", "git_revision": "0" * 40, "world_size": 8}, "results": _shardq_layer_rows()}
    op_doc = {"meta": {"gpu": "none", "git_revision": "abc1234", "date": "2026-12-01"}, "rows": op_rows}
    return {"layer": json.loads(COMMITTED.read_text()), "layer-fp8": json.loads((RESULTS / "bench-fp8.json").read_text()),
            "shardq": json.loads((RESULTS / "bench_shardq.json").read_text()),
            "kv_fp8": json.loads((RESULTS / "kv-fp8-gluon-fewheads.json").read_text()),
            "shardq_layer": shardq_layer, "op": op_doc}


def _compact_cells(name: str, doc: dict) -> list[list[str]]:
    """The cells of every compact table of a document (the figures the terminal must show whole)."""
    from sparse_mla.bench import kv_fp8, op, report, shardq, shardq_layer
    from sparse_mla.distributed.cost_model import model_vs_measured

    if name.startswith("layer"):
        return report.table_cells(load(doc)[2])[1]
    if name == "shardq":
        rows = load(doc)[2]
        return (shardq.shardq_cells(rows)[1] + shardq.summary_cells(rows)[1]
                + shardq.cost_model_cells(model_vs_measured(rows)[0])[1])
    module = {"kv_fp8": kv_fp8, "shardq_layer": shardq_layer, "op": op}[name]
    return module.row_cells(load(doc)[2])[1]


def _assert_fits(out: str, cells: list[list[str]], width: int = 80) -> None:
    """No line wider than ``width``, nothing cut (no ellipsis), every row's figures whole and in order on one line
    (only the first column, a name, may fold)."""
    lines = out.splitlines()
    assert lines and max(len(line) for line in lines) <= width, max(lines, key=len)
    assert "…" not in out, out
    for row in cells:
        pattern = r"\s+".join(re.escape(c) for c in row[1:])
        assert any(re.search(rf"(^|\s){pattern}(\s|$)", line) for line in lines), (row, out)


KIND_NAMES = ["layer", "layer-fp8", "shardq", "kv_fp8", "shardq_layer", "op"]


@pytest.mark.parametrize("name", KIND_NAMES)
def test_compact_tables_fit_80_columns(name, op_rows):
    """`sparse-mla report JSON` at 80 columns, for a JSON of every kind: the provenance line and the compact
    tables fit, no number is truncated (the 14-column layer table and the 456-column ShardQ one did not)."""
    doc = _docs(op_rows)[name]
    cells = _compact_cells(name, doc)
    assert cells
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"{name}.json"
        path.write_text(json.dumps(doc))
        res = RUNNER.invoke(app, ["report", str(path)], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    _assert_fits(res.output, cells)


def test_bench_module_tables_fit_80_columns(op_rows):
    """The text tables the bench modules print themselves (their default width is 80)."""
    from sparse_mla.bench import kv_fp8, op, shardq_layer

    docs = _docs(op_rows)
    for module, rows in ((kv_fp8, docs["kv_fp8"]["rows"]), (shardq_layer, load(docs["shardq_layer"])[2]),
                         (op, op_rows)):
        _assert_fits(module.format_rows(rows), module.row_cells(rows)[1])
        wide = module.format_rows(rows, wide=True)
        head, cells = module.row_cells(rows, wide=True)
        assert len(head) > len(module.row_cells(rows)[0]) and all(h in wide for h in head)
        _assert_fits(wide, cells, width=10**4)  # the wide table is never cut either, only wider


def test_bench_table_compact_and_wide(bench_json):
    """`print_table` of the CLI's own bench rows: compact by default, every path with --wide."""
    from sparse_mla.bench import report

    rows = json.loads(bench_json.read_text())["rows"]
    with contextlib.redirect_stdout(io.StringIO()) as out:
        report.print_table(rows, interpreted=True, width=80)
    _assert_fits(out.getvalue(), report.table_cells(rows)[1])
    head = next(line for line in out.getvalue().splitlines() if "scenario" in line)
    assert head.split() == " ".join(report.table_cells(rows)[0]).split() and "pad64" not in head
    with contextlib.redirect_stdout(io.StringIO()) as out:
        report.print_table(rows, interpreted=True, width=80, wide=True)
    head = next(line for line in out.getvalue().splitlines() if "scenario" in line)
    assert all(report.SHORT[p] in head for p in PATH_COLUMNS)
    _assert_fits(out.getvalue(), report.table_cells(rows, wide=True)[1], width=10**4)


@pytest.mark.parametrize("stamped", [True, False], ids=["meta.kind", "shape"])
@pytest.mark.parametrize("name", KIND_NAMES)
def test_report_renders_every_kind(name, stamped, op_rows, tmp_path):
    """`report` of every JSON kind, told by its meta.kind stamp or (the committed files) by its shape, in the
    three forms: compact, --wide (more columns), --markdown (a markdown table; for the layer bench the README's)."""
    from sparse_mla.bench import kinds

    doc = _docs(op_rows)[name]
    kind = name.split("-")[0]
    if stamped:
        doc["meta"]["kind"] = kind
    assert kinds.detect(doc, "x")[0] == kind
    path = tmp_path / "doc.json"
    path.write_text(json.dumps(doc))
    outs = {}
    for form in ([], ["--wide"], ["--markdown"]):
        res = RUNNER.invoke(app, ["report", *form, str(path)], env={"COLUMNS": "80"})
        assert res.exit_code == 0, (form, res.output)
        outs[tuple(form)] = res.output
    assert len(max(outs[("--wide",)].splitlines(), key=len)) > len(max(outs[()].splitlines(), key=len)) or kind == "op"
    md = outs[("--markdown",)]
    assert md.startswith(f"<!-- `sparse-mla report --markdown {path}`: ") and "\n|---|" in md
    if kind == "layer":
        from sparse_mla.bench.report import markdown_table

        assert markdown_table(load(doc)[2]) in md  # the README's table, unchanged


def test_writers_stamp_kind(bench_json, tmp_path):
    """Every writer stamps meta.kind: the layer bench, the ShardQ benches (through provenance), kv_fp8, op."""
    from sparse_mla.bench import kinds, kv_fp8, op, report
    from sparse_mla.bench.common import ROW_KEYS

    assert json.loads(bench_json.read_text())["meta"]["kind"] == "layer"
    assert report.provenance(True, 1)["kind"] == "layer"
    for kind in ("shardq", "shardq_layer"):
        assert report.provenance(True, 1, kind=kind)["kind"] == kind
    assert op.provenance()["kind"] == "op"
    out = tmp_path / "k.json"
    kv_fp8.main(["--heads", "16", "--grouped-heads", "", "--tokens", "5", "--topk", "8", "--rows", "32",
                 "--variants", "bf16", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert doc["meta"]["kind"] == "kv_fp8" and kinds.detect(doc, str(out))[0] == "kv_fp8"
    assert set(kinds.KINDS) == set(ROW_KEYS) == {"layer", "shardq", "shardq_layer", "kv_fp8", "op"}


@pytest.mark.parametrize("doc, match", [
    pytest.param([1, 2], "not a bench JSON", id="a-list"),
    pytest.param({"meta": {"kind": "sweep"}, "rows": [{"case": "a"}]}, "unknown kind 'sweep'", id="unknown-kind"),
    pytest.param({"meta": {"kind": "op"}, "rows": [{"case": "a"}]}, "meta.kind is 'op', but its rows[] rows", id="bad-rows"),
    pytest.param({"meta": {}, "results": []}, "not a JSON that `sparse-mla report` renders", id="no-rows"),
    pytest.param(json.loads((RESULTS / "history" / "gluon-v1.json").read_text()), "fit none of the known shapes",
                 id="gluon-script"),
    pytest.param({"meta": {"kind": "layer"}, "results": [{"scenario": "s", "heads": 16, "paths": {}, "chosen_path": None,
                                                          "chosen_ms": None}]}, "cannot be rendered", id="truncated-rows"),
])
def test_report_unknown_json_is_a_clear_error(doc, match, tmp_path):
    """A JSON that `report` cannot render: exit 2 (a usage error), the message says why and names the kinds it
    renders where the kind is unknown; no traceback."""
    path = tmp_path / "x.json"
    path.write_text(json.dumps(doc))
    res = RUNNER.invoke(app, ["report", str(path)], env={"COLUMNS": "80"})
    assert res.exit_code == 2, res.output
    out = flat(res.output)
    assert match in out and "Traceback" not in out, out
    if "kind" not in match and "rendered" not in match:  # where the kind is unknown: the list of the known ones
        assert "report renders: layer (sparse-mla bench), shardq (" in out, out


@pytest.mark.parametrize("on_gpu", [True, False])
def test_torchrun_bench_default_tokens_follow_the_device(monkeypatch, on_gpu):
    """Under torchrun without --tokens: the GPU prompt lengths on a GPU, interpreter sizes (with the banner) on a CPU
    (the GPU lengths through the interpreter ran for many minutes without output)."""
    from sparse_mla import cli
    from sparse_mla.bench import scenarios, shardq

    seen = {}

    def fake_shardq(models, tokens, **kw):
        seen["tokens"] = list(tokens)
        return None  # as on a rank other than 0

    monkeypatch.setattr(cli, "_kernel_device", lambda: on_gpu)
    monkeypatch.setattr(shardq, "run_shardq_bench", fake_shardq)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    res = RUNNER.invoke(app, ["bench"])
    assert res.exit_code == 0, res.output
    assert seen["tokens"] == list(scenarios.SHARDQ_TOKENS if on_gpu else scenarios.CPU_SHARDQ_TOKENS)
    assert ("No CUDA GPU" in res.output) is (not on_gpu)
