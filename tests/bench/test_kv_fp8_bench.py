"""The benches on an FP8 ``fp8_ds_mla`` cache: ``sparse-mla bench --kv-dtype fp8`` and ``python -m
sparse_mla.bench.kv_fp8``."""

from __future__ import annotations

import json

import pytest
from testlib.fp8 import FP8


def test_bench_kv_dtype_fp8(tmp_path):
    """`sparse-mla bench --kv-dtype fp8` on one tiny scenario: every supported path checked against the reference
    on the dequantized cache, compared to the unquantized one (a larger error: the quantization's), the
    dequantize-then-bf16 baseline among the paths, the report's extra columns."""
    from typer.testing import CliRunner

    from sparse_mla.bench.baselines import DEQUANT_NAME, PATH_COLUMNS
    from sparse_mla.cli import app

    runner = CliRunner()
    out = tmp_path / "b.json"
    res = runner.invoke(app, ["bench", "--dims", "16,512,32,64,32", "--tokens", "12", "--cached", "24", "--topk", "16",
                              "--kv-dtype", "fp8", "--json", str(out), "--plot", ""])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["meta"]["kv_format"] == FP8
    (row,) = data["rows"]
    assert row["kv_format"] == FP8 and row["failures"] == [] and row["pad64_baseline"].startswith("dequant+")
    assert set(row["paths"]) == {*PATH_COLUMNS, DEQUANT_NAME}
    timed = [name for name, rec in row["paths"].items() if rec["supported"]]
    assert DEQUANT_NAME in timed and "mqa_per_token" in timed and "mqa_grouped" in timed
    for name in timed:
        rec = row["paths"][name]
        assert rec["check_ok"] and rec["rel_err"] < row["check_tol"], (name, rec["rel_err"])
        assert rec["rel_err_vs_bf16_cache"] > 5 * rec["rel_err"], (name, rec)  # the cache's own quantization error
    assert row["max_rel_err_vs_bf16_cache"] == max(row["paths"][n]["rel_err_vs_bf16_cache"] for n in timed)
    rep = runner.invoke(app, ["report", "--markdown", str(out)])
    assert rep.exit_code == 0 and "kv cache fp8_ds_mla" in rep.output and f"{DEQUANT_NAME} ms" in rep.output


def test_kernel_bench_module_smoke(tmp_path):
    """`python -m sparse_mla.bench.kv_fp8` (the GPU A/B of bf16 vs FP8 caches) runs on the CPU on tiny sizes and
    checks every variant."""
    from sparse_mla.bench import kv_fp8

    out = tmp_path / "k.json"
    rows = kv_fp8.main(["--heads", "16", "--grouped-heads", "16", "--tokens", "9", "--topk", "16", "--rows", "64",
                        "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["rows"] == rows and {r["case"] for r in rows} == {"per_token H16", "grouped H16 G8"}
    variants = {r["variant"] for r in rows}
    assert {"bf16", "bf16 triton", "fp8", "dequant+bf16"} <= variants
    for r in rows:
        assert r["check_ok"], r
        if r["variant"].startswith(("fp8", "dequant")):
            assert r["max_row_err_vs_bf16_cache"] > r["max_row_err"], r


def test_kernel_bench_variants_filter(tmp_path, capsys):
    """`--variants` keeps only the named rows; an unknown name is refused with the list of rows."""
    from sparse_mla.bench import kv_fp8

    out = tmp_path / "k.json"
    rows = kv_fp8.main(["--heads", "16", "--grouped-heads", "", "--tokens", "5", "--topk", "8", "--rows", "32",
                        "--variants", "bf16,fp8", "--json", str(out)])
    assert [r["variant"] for r in rows] == ["bf16", "fp8"] and all(r["check_ok"] for r in rows)
    with pytest.raises(SystemExit):
        kv_fp8.main(["--variants", "bf16,fp9", "--json", str(out)])
    assert "unknown ['fp9']" in capsys.readouterr().err
