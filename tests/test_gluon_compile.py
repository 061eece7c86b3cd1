"""Every Gluon sm_90 kernel variant the package can launch compiles for sm_90, without a GPU.

Triton's front end, LLVM and ptxas run on a CPU, so API drift in ``triton.experimental.gluon`` and a
shared-memory overflow (over the H200's 227 KB per block) fail here, in CI, not on a user's GPU. The
kernels are written against ``gluon_sm90.SUPPORTED_TRITON``; CI compiles them with that Triton,
installed beside the test environment's own by ``make gluon-triton`` (``GLUON_TRITON_DIR``, default
``.cache/triton-gluon``), in a subprocess whose ``PYTHONPATH`` puts it first. Without that directory the
test is skipped on a developer machine and fails under CI (``CI`` set), so CI can never pass it silently.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TRITON_DIR = Path(os.environ.get("GLUON_TRITON_DIR", REPO / ".cache" / "triton-gluon"))
SMEM_LIMIT = 227 * 1024  # bytes of shared memory one block may use on the H100 / H200

_SCRIPT = r"""
import json, re, subprocess, sys
import triton
from sparse_mla.mqa import gluon_sm90 as g
ptxas = __import__("os").path.join(__import__("os").path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
rows = []
for v in g.all_variants():
    try:
        k = g.compile_variant(*v)
    except Exception as exc:
        rows.append(dict(variant=list(v), error=f"{type(exc).__name__}: {str(exc)[-2000:]}"))
        continue
    spills = None
    with open("/tmp/sparse_mla_gluon_check.ptx", "w") as f:
        f.write(k.asm["ptx"])
    r = subprocess.run([ptxas, "-arch=sm_90a", "-v", "/tmp/sparse_mla_gluon_check.ptx", "-o", "/dev/null"],
                       capture_output=True, text=True)
    found = re.findall(r"(\d+) bytes spill stores", r.stderr)
    spills = int(found[0]) if found else None
    rows.append(dict(variant=list(v), shared=k.metadata.shared, spills=spills, triton=triton.__version__))
print(json.dumps(rows))
"""


@pytest.fixture(scope="module")
def compiled():
    if not (TRITON_DIR / "triton" / "__init__.py").exists():
        msg = f"no triton for the Gluon kernels at {TRITON_DIR} (run `make gluon-triton`)"
        if os.environ.get("CI"):
            pytest.fail(msg + ": CI must compile the Gluon kernels")
        pytest.skip(msg)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TRITON_DIR), str(REPO)]))
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    assert r.returncode == 0, f"compile script failed:\n{r.stderr[-4000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_triton_is_a_supported_version(compiled):
    from sparse_mla.mqa import gluon_sm90

    versions = {row.get("triton") for row in compiled if "triton" in row}
    assert versions and all(gluon_sm90.triton_version_supported(v) for v in versions), versions


def test_every_variant_compiles_within_shared_memory(compiled):
    from sparse_mla.mqa import gluon_sm90

    assert len(compiled) == len(gluon_sm90.all_variants()) > 0
    errors = [row for row in compiled if "error" in row]
    assert not errors, "\n".join(f"{r['variant']}: {r['error']}" for r in errors)
    for row in compiled:
        assert 0 < row["shared"] <= SMEM_LIMIT, f"{row['variant']}: {row['shared']} B of shared memory > {SMEM_LIMIT}"


def test_default_schedule_does_not_spill(compiled):
    """The schedule the package launches by default keeps every partition in registers (ptxas -v)."""
    from sparse_mla.mqa import gluon_sm90

    rows = [r for r in compiled if r["variant"][3] == gluon_sm90.SCHEDULE]
    assert rows
    for row in rows:
        assert row["spills"] is not None, f"{row['variant']}: no 'spill stores' line in the ptxas -v report"
        assert row["spills"] == 0, f"{row['variant']}: {row['spills']} bytes of spill stores"
