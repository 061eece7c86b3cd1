"""The shared bench plumbing (``sparse_mla.bench.common``): the error metrics and their zero-reference rule, the
roofline floor, the JSON ``meta`` block and row key, the one loader of old and new bench files, the table renderer;
and that no other module under sparse_mla/bench or benchmarks/ defines its own copy of them."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from testlib.paths import REPO

from sparse_mla.bench import common, kinds
from sparse_mla.bench.common import load, max_row_err, read_json, rel_err, row_errs


# ------------------------------------------------------------------------------------------------- metrics
@pytest.mark.parametrize("out, ref, want", [
    pytest.param([[3.0, 4.0]], [[3.0, 0.0]], 4.0 / 3.0, id="relative"),
    pytest.param([[0.0, 0.0]], [[0.0, 0.0]], 0.0, id="zero-ref-zero-out"),
    pytest.param([[3.0, 4.0]], [[0.0, 0.0]], 5.0, id="zero-ref-absolute"),
    pytest.param([[float("nan"), 0.0]], [[1.0, 0.0]], math.inf, id="nan-out"),
    pytest.param([[float("inf"), 0.0]], [[0.0, 0.0]], math.inf, id="inf-out-zero-ref"),
])
def test_row_errs_zero_reference_rule(out, ref, want):
    """Per row: |out - ref| / |ref|; a row whose reference is all zero counts its absolute error (0 when out is zero
    too, never a division by a clamp); a NaN or inf row scores inf."""
    got = row_errs(torch.tensor(out), torch.tensor(ref))
    assert got.shape == (1,) and float(got[0]) == pytest.approx(want)


def test_max_row_err_over_rows_and_heads():
    """Rows are the last dimension's vectors of any shape ([T, H, D]); the worst row counts; no rows: 0."""
    ref = torch.zeros(2, 3, 4)
    ref[0, 1] = 1.0
    out = ref.clone()
    out[0, 1, 0] = 1.5  # |d| 0.5 over |ref| 2: 0.25
    out[1, 2, 3] = 0.125  # zero reference row: absolute 0.125
    assert row_errs(out, ref).shape == (6,)
    assert max_row_err(out, ref) == pytest.approx(0.25)
    out[1, 2, 3] = 0.5
    assert max_row_err(out, ref) == pytest.approx(0.5)
    assert max_row_err(torch.empty(0, 4), torch.empty(0, 4)) == 0.0


def test_rel_err_frobenius_and_same_zero_rule():
    """The whole-tensor error follows the per-row rule: relative, absolute where the reference is all zero, inf for
    a NaN; the chunked fp64 form (for a collective) gives the same figure."""
    ref = torch.tensor([[3.0, 0.0], [0.0, 4.0]])
    out = ref + torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    assert rel_err(out, ref) == pytest.approx(1.0 / 5.0)
    assert rel_err(torch.tensor([[3.0, 4.0]]), torch.zeros(1, 2)) == pytest.approx(5.0)
    assert rel_err(torch.zeros(3), torch.zeros(3)) == 0.0
    assert rel_err(torch.tensor([float("nan"), 1.0]), torch.ones(2)) == math.inf
    big, ref_big = torch.randn(37, 5, generator=torch.Generator().manual_seed(0)), torch.ones(37, 5)
    t = common.rel_err_tensor(big, ref_big, chunk=4)
    assert t.dtype == torch.float64 and t.dim() == 0 and float(t) == pytest.approx(rel_err(big, ref_big))


def test_floor_and_tflops():
    """The roofline floor is the longer of compute at PEAK_FLOPS and traffic at PEAK_BYTES (the H200's)."""
    assert (common.PEAK_FLOPS, common.PEAK_BYTES) == (790e12, 4.3e12)
    assert common.floor_ms(790e9, 0) == pytest.approx(1.0)
    assert common.floor_ms(0, 4.3e9) == pytest.approx(1.0)
    assert common.floor_ms(790e9, 8.6e9) == pytest.approx(2.0)
    assert common.tflops(1e12, 1000.0) == pytest.approx(1.0) and math.isnan(common.tflops(1e12, 0.0))


# ------------------------------------------------------------------------------------------------- meta and rows
def test_run_meta_block(monkeypatch):
    """One meta block: kind (when given), command, git_revision (never git_rev), version, GPU, UTC date, torch and
    triton versions, the timing note of the one do_bench budget; extras last, overriding nothing they do not name."""
    import triton

    monkeypatch.setenv("GIT_REV", "f" * 40)
    meta = common.run_meta("op", command="python x.py", dtype="bf16")
    assert list(meta)[:9] == ["kind", "command", "git_revision", "sparse_mla_version", "gpu", "date", "torch", "triton",
                              "timing"]
    assert meta["git_revision"] == "f" * 40 and "git_rev" not in meta and meta["command"] == "python x.py"
    assert meta["torch"] == torch.__version__ and meta["triton"] == triton.__version__ and meta["dtype"] == "bf16"
    assert meta["date"].endswith("+00:00")
    assert f"warmup={common.WARMUP_MS} ms, rep={common.REP_MS} ms" in meta["timing"]
    assert "kind" not in common.run_meta(timing="t") and common.run_meta(timing="t")["timing"] == "t"
    if not torch.cuda.is_available():
        assert meta["gpu"].startswith("none")
    assert "TRITON_INTERPRET" in common.timing_note(interpreted=True)


def test_write_json_then_load(tmp_path, monkeypatch):
    """write_json writes {"meta", "rows", extras}; read_json gives them back with the kind told by the stamp."""
    monkeypatch.setenv("GIT_REV", "abc")
    path = tmp_path / "sub" / "x.json"
    rows = [{"case": "c", "calls": {}}]
    common.write_json(path, common.run_meta("op", timing="t"), rows, summary=[1])
    doc = json.loads(path.read_text())
    assert list(doc) == ["meta", "rows", "summary"]
    kind, meta, got = read_json(path)
    assert (kind, meta["git_revision"], got) == ("op", "abc", rows)


OLD_FILES = [  # (the file as an older writer left it, kind, git_revision, rows)
    pytest.param({"meta": {"git_revision": "r1"}, "results": [{"scenario": "s", "heads": 16, "paths": {},
                                                               "chosen_path": None, "chosen_ms": None}]},
                 "layer", "r1", 1, id="layer-results"),
    pytest.param({"meta": {"git_revision": "r2"}, "results": [{"kind": "check", "H": 16}]}, None, "r2", 1,
                 id="tune-results"),
    pytest.param({"command": "sweep", "git_rev": "r3", "gpu": "H200", "rows": [{"model": "m"}], "skipped": []},
                 None, "r3", 1, id="flat-git_rev"),
    pytest.param({"gpu": "H200", "commit": "r4", "args": {}, "realistic": {"ok": True}}, None, "r4", 0,
                 id="flat-commit"),
    pytest.param({"command": "u", "git_revision": "r5", "checks": [{"ok": True}], "timings": [{"case": "a"}, {"case": "b"}]},
                 None, "r5", 2, id="flat-timings"),
    pytest.param({"meta": {"device": "H200", "sms": 132}, "rows": [{"heads": 16}]}, None, None, 1, id="meta-device"),
]


@pytest.mark.parametrize("doc, kind, rev, n_rows", OLD_FILES)
def test_loader_copes_with_old_keys(doc, kind, rev, n_rows, tmp_path):
    """Files written before the one meta block and row key: rows under "results" / "timings", meta at the top
    level, git_rev / commit / device for git_revision / gpu; the kind told by the rows' keys where unstamped."""
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc))
    got_kind, meta, rows = read_json(path)
    assert got_kind == kind and len(rows) == n_rows
    assert meta.get("git_revision") == rev and "git_rev" not in meta and "commit" not in meta
    assert "rows" not in meta and "results" not in meta
    if "device" in json.dumps(doc):
        assert meta["gpu"] == "H200"


def test_loader_reads_every_committed_result():
    """Every JSON under results/ loads; those of a kind `sparse-mla report` renders (stamped or told by shape) have
    rows of that kind."""
    paths = sorted((REPO / "results").rglob("*.json"))
    assert paths
    for path in paths:
        kind, meta, rows = read_json(path)
        assert isinstance(meta, dict) and isinstance(rows, list), path
        assert "git_rev" not in meta, path
        if kind in kinds.KINDS:
            assert common.rows_fit(rows, kind), path


def test_loader_rejects_non_objects():
    with pytest.raises(ValueError, match="not a bench JSON"):
        load([1, 2], "x.json")


# ------------------------------------------------------------------------------------------------- tables
def test_table_renderer_text_and_markdown():
    """make_table + render_text: numbers right-justified, names left, nothing cut at 80 columns; markdown_cells: a
    header, a rule, a line per row; print_rows: a table of dict rows from column getters."""
    head, cells = ["case", "ms", "TFLOP/s"], [["per_token H128", "1.234", "512.0"], ["grouped H16 G8", "0.5", "99.1"]]
    text = common.render_text(common.make_table("t", head, cells))
    lines = text.splitlines()
    assert max(map(len, lines)) <= 80 and "…" not in text
    assert re.search(r"per_token H128\s+1\.234\s+512\.0", text) and re.search(r"grouped H16 G8\s+0\.5\s+99\.1", text)
    assert [len(line) for line in lines if "H128" in line or "G8" in line][0] == [
        len(line) for line in lines if "H128" in line or "G8" in line][1]  # right-justified numbers: same width
    md = common.markdown_cells(head, cells)
    assert md.splitlines() == ["| case | ms | TFLOP/s |", "|---|---|---|", "| per_token H128 | 1.234 | 512.0 |",
                               "| grouped H16 G8 | 0.5 | 99.1 |"]
    assert common.fmt(None, ".3f") == common.fmt(float("nan"), ".3f") == "-" and common.fmt(1.5, ".2f") == "1.50"


def test_print_rows(capsys):
    common.print_rows("rows", [{"a": "x", "b": 1.0}, {"a": "y", "b": None}],
                      {"name": lambda r: r["a"], "value": lambda r: common.fmt(r["b"], ".2f")})
    out = capsys.readouterr().out
    assert "rows" in out and re.search(r"x\s+1\.00", out) and re.search(r"y\s+-", out)


# ------------------------------------------------------------------------------------------------- one home
PLUMBING = [  # what only sparse_mla/bench/common.py (and timing.py, which times with its budget) may spell out
    (r"\b790(\.0|e12)\b|\b(PEAK_TFLOPS|MATMUL_TFLOPS)\b", "the H200's FLOP/s peak"),
    (r"\b4\.3e12\b|\b(HBM_TBS|COPY_TBPS)\b", "the H200's byte/s peak"),
    (r"\bgit_rev\b(?!ision)", "the revision key"),
    (r"datetime\.now", "the meta block's date"),
    (r"get_device_name", "the meta block's GPU"),
    (r"do_bench\(", "the timing budget"),
    (r"json\.dump\(|write_text\(json\.dumps", "the JSON document"),
    (r"\.norm\(dim=-1\)", "the per-row error"),
]


@pytest.mark.parametrize("pattern, what", PLUMBING, ids=[w for _, w in PLUMBING])
def test_one_home_for_the_plumbing(pattern, what):
    """The bench modules and the benchmark scripts use common.py (and timing.py) rather than their own copies."""
    files = [*(REPO / "sparse_mla" / "bench").glob("*.py"), *(REPO / "benchmarks").glob("*.py")]
    home = {"common.py", "timing.py"}
    offenders = [f"{p.relative_to(REPO)}:{i}" for p in files if p.name not in home
                 for i, line in enumerate(p.read_text().splitlines(), 1)
                 if re.search(pattern, line.split("#")[0]) and not line.lstrip().startswith(("#", '"', "'"))]
    assert not offenders, f"{what} outside sparse_mla/bench/common.py: {offenders}"


@pytest.mark.parametrize("script", sorted(p.name for p in (REPO / "benchmarks").glob("*.py")))
def test_benchmark_script_help_on_cpu(script):
    """Every script under benchmarks/ imports and answers --help on a machine without a GPU."""
    run = subprocess.run([sys.executable, str(Path("benchmarks") / script), "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0 and "usage:" in run.stdout, run.stderr[-2000:]
