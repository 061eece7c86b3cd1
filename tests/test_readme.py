"""The README's "Use" section runs as written: its python blocks, in order, in a fresh interpreter whose
environment does not set TRITON_INTERPRET (the first block does that itself on a machine without CUDA),
as a new user would paste them."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from testlib.paths import README


def use_blocks() -> list[str]:
    """The ```python blocks between the "## Use" heading and the next "## " heading."""
    text = README.read_text()
    section = text.split("\n## Use\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_use_section_has_the_documented_blocks():
    blocks = use_blocks()
    assert len(blocks) == 5, [b.splitlines()[0] for b in blocks]
    joined = "\n".join(blocks)
    for call in ("sparse_mla_fwd(", "sparse_mla_ref(", "flash_mla_sparse_fwd(", "flash_mla_with_kvcache(",
                 "convert_req_index_to_global(", "dsa_prefill(", "explain(", 'kv_format="fp8_ds_mla"'):
        assert call in joined, call


@pytest.mark.slow
def test_use_section_runs_as_written(tmp_path):
    """~20 s on a CPU (the masked-MHA step of the dsa_prefill block runs through the interpreter)."""
    script = tmp_path / "readme_use.py"
    script.write_text("\n".join(use_blocks()))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    err = float(re.search(r"relative error (\S+)", res.stdout).group(1))
    assert err < 1e-2, res.stdout
    err8, err8_bf16 = (float(v) for v in re.search(r"fp8 cache: error (\S+) against its reference, (\S+) against",
                                                    res.stdout).groups())
    assert err8 < 1e-2 < err8_bf16 < 0.1, res.stdout  # the kernel's error, then the cache's quantization (~3e-2)
    assert "path: " in res.stdout and "mqa_per_token: yes" in res.stdout, res.stdout


def test_readme_is_short():
    """The README is for users (what it is, why, install, use, results, switches, layout): at most 250 lines."""
    assert len(README.read_text().splitlines()) <= 250


def test_results_table_is_the_report_of_the_committed_json(monkeypatch):
    """The README's results table is ``sparse-mla report --markdown results/bench.json`` verbatim, its comment
    line included (regenerate it with that command after a new run)."""
    from typer.testing import CliRunner

    from sparse_mla.cli import app

    monkeypatch.chdir(README.parent)  # the command as the README writes it, from the repository
    res = CliRunner().invoke(app, ["report", "--markdown", "results/bench.json"], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    section = README.read_text().split("\n## Results (H200)\n", 1)[1].split("\n## ", 1)[0]
    assert res.output.strip() + "\n" in section, "README table differs from `sparse-mla report --markdown results/bench.json`"
