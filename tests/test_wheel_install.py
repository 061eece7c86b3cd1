"""The built wheel works where the repository is not: built from a copy of the packaged files, installed into a fresh
virtual environment outside the checkout (``--system-site-packages``: torch, triton and the bench extra come from the
environment that runs the tests, the package itself only from the wheel), and run from a directory outside the
checkout. It checks what the package reads at run time ships in the wheel (the cost model's calibration, package
data) and that ``sparse-mla bench`` runs from the install (a Triton-interpreter scenario on the CPU). About 10-20 s."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from testlib.paths import PACKAGE, REPO

# The cost model's calibrated path, as a user runs it: the shipped calibration, the link fitted on it, the model
# against the 2-GPU run's rows, the W = 4 / 8 projection.
COST_MODEL = """
import sparse_mla
from sparse_mla.distributed import cost_model as cm
print("imported", sparse_mla.__file__)
sq, bench = cm.default_docs()
rows, note = cm.model_vs_measured(sq["results"])
assert len(rows) == 12 and "GB/s" in note, (len(rows), note)
proj = cm.projection_table(sq, bench, cm.calibrated_links(sq))
assert {(r["model"], r["tp"]) for r in proj} == set(cm.PROJECTION_POINTS), proj
print("cost model ok:", note)
"""
# One interpreter-sized layer scenario (16 heads, 12 tokens, top-k 16): seconds on a CPU.
BENCH = ["bench", "--dims", "16,512,32,64,32", "--tokens", "12", "--topk", "16", "--trials", "1"]


def _offline_backend() -> bool:
    """Whether this environment has pyproject.toml's build backend with its wheel builder: setuptools >= 70.1 has
    bdist_wheel, an older one needs the wheel package. Then the build needs no index; else pip's isolated build
    fetches the backend (CI has an index)."""
    if importlib.util.find_spec("setuptools") is None:
        return False
    version = tuple(int(p) for p in re.findall(r"\d+", importlib.metadata.version("setuptools"))[:2])
    return version >= (70, 1) or importlib.util.find_spec("wheel") is not None


def _run(cmd: list[str], cwd: Path, env: dict, timeout: int = 120) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{cmd}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict]:
    """(the venv's bin folder, the environment to run it with) after ``pip install --no-deps`` of the built wheel."""
    root = tmp_path_factory.mktemp("wheel")
    assert not root.resolve().is_relative_to(REPO.resolve()), "the venv must live outside the checkout"
    # Build from a copy of what the wheel is made of, so the build leaves nothing in the checkout (build/, egg-info).
    src = root / "src"
    shutil.copytree(PACKAGE, src / PACKAGE.name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    isolation = ["--no-build-isolation"] if _offline_backend() else []
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, "-w", str(root / "dist"), str(src)],
         root, env, timeout=300)
    (wheel,) = (root / "dist").glob("sparse_mla-*.whl")
    # No pip of its own (a Python without ensurepip can still make it): this environment's pip installs into it.
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(root / "venv")
    bin_dir = root / "venv" / ("Scripts" if os.name == "nt" else "bin")
    _run([sys.executable, "-m", "pip", "--python", str(bin_dir / "python"), "install", "-q", "--no-deps", "--no-index",
          str(wheel)], root, env)
    # the CPU run, on a GPU machine too: no device visible, the kernels through Triton's interpreter
    env.update(CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    return bin_dir, env


def test_installed_wheel_runs_the_calibrated_cost_model(installed, tmp_path):
    bin_dir, env = installed
    res = _run([str(bin_dir / "python"), "-c", COST_MODEL], tmp_path, env)
    imported = Path(res.stdout.split("imported ", 1)[1].split("\n", 1)[0]).resolve()
    # the installed copy, never the checkout (the test environment may hold an editable install of it)
    assert imported.is_relative_to(bin_dir.parent.resolve()), imported
    assert not imported.is_relative_to(REPO.resolve()), imported
    assert "cost model ok" in res.stdout, res.stdout


def test_installed_wheel_runs_sparse_mla_bench_on_the_cpu(installed, tmp_path):
    bin_dir, env = installed
    res = _run([str(bin_dir / "sparse-mla"), *BENCH, "--json", "b.json", "--plot", ""], tmp_path, env, timeout=300)
    doc = json.loads((tmp_path / "b.json").read_text())
    assert [r["scenario"] for r in doc["rows"]] == ["dims-16-512-32-64-32/tp1/12"], res.stdout
    assert all(r["failures"] == [] for r in doc["rows"]), doc["rows"]
    assert str(REPO) not in json.dumps(doc["meta"]), doc["meta"]  # provenance is the install's, not the checkout's
