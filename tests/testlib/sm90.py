"""Compiling kernels for sm_90 on a CPU, with the Triton the Gluon kernels are written against."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testlib.paths import REPO

# The Triton the GPU runs (the Gluon kernels' pinned version), installed beside the test environment's own by
# ``make gluon-triton``; sm_90 compiles run with it in a subprocess whose PYTHONPATH puts it first.
SM90_TRITON_DIR = Path(os.environ.get("GLUON_TRITON_DIR", REPO / ".cache" / "triton-gluon"))


def _sm90_triton_dir() -> Path | None:
    """``SM90_TRITON_DIR`` when it holds a Triton; else the environment's own Triton's folder when that is a
    supported version (a GPU image that ships it); else None."""
    if (SM90_TRITON_DIR / "triton" / "__init__.py").exists():
        return SM90_TRITON_DIR
    import triton

    from sparse_mla.mqa.gluon_sm90 import triton_version_supported

    return Path(triton.__file__).resolve().parent.parent if triton_version_supported() else None


def run_sm90_compile(script: str, what: str) -> list:
    """Run ``script`` (Python that compiles kernels for sm_90 and prints a JSON list as its last line) with
    ``SM90_TRITON_DIR``'s Triton and return that list. Without that Triton: skipped on a developer machine,
    failed under CI (``CI`` set), so CI can never pass a compile check silently. ``what`` names the kernels."""
    triton_dir = _sm90_triton_dir()
    if triton_dir is None:
        msg = f"no triton for sm_90 compiles at {SM90_TRITON_DIR} (run `make gluon-triton`)"
        if os.environ.get("CI"):
            pytest.fail(msg + f": CI must compile {what}")
        pytest.skip(msg)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(triton_dir), str(REPO)]))
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    assert r.returncode == 0, f"compile script for {what} failed:\n{r.stderr[-4000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def hinted_kernels(schedule: str) -> int:
    """Compiled variants of ``schedule``'s Gluon kernel in this process (Triton 3.6's JIT cache: ``device_caches``)
    whose PTX has the L2-hinted kv copies (``sparse_mla.mqa.gluon_sm90.l2_hints``)."""
    from sparse_mla.mqa.gluon_sm90 import l2_hints, launcher

    fn = launcher._kernel_for(schedule)
    return sum(l2_hints.HINTED_COPY in k.asm.get("ptx", "") for caches in fn.device_caches.values()
               for k in caches[0].values())
