"""The core install: ``import sparse_mla`` (its subpackages but the CLI and the bench) and a kernel call work without
the CLI / bench stacks. A fresh interpreter blocks typer, rich, tqdm, safetensors and matplotlib with a meta-path
finder (as if ``pip install .`` had installed no extra) and runs the kernels: compiled on a CUDA GPU, through the
Triton interpreter on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys

from testlib.paths import REPO

BLOCKED = ("typer", "rich", "tqdm", "safetensors", "matplotlib")

SCRIPT = r'''
import importlib.abc, os, sys
BLOCKED = set(sys.argv[1].split(","))
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} blocked (not a core dependency)")
        return None
sys.meta_path.insert(0, Block())
import torch
cuda = torch.cuda.is_available()
if not cuda:
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
import sparse_mla
from sparse_mla.layer import PrefillStep, dsa_prefill, explain  # noqa: F401
import sparse_mla.distributed, sparse_mla.integration, sparse_mla.workloads  # noqa: F401,E401
from sparse_mla.integration import ops  # noqa: F401  (registers the torch custom ops)
dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float16)
g = torch.Generator().manual_seed(0)
q = torch.randn(4, 16, 576, generator=g).to(dt).to(dev)
kv = torch.randn(64, 576, generator=g).to(dt).to(dev)
idx = torch.stack([torch.randperm(64, generator=g)[:16] for _ in range(4)]).int().to(dev)
ref, _ = sparse_mla.sparse_mla_ref(q, kv, idx, 0.1)
for method in ("auto", "per_token", "grouped"):
    out = sparse_mla.sparse_mla_fwd(q, kv, idx, 0.1, method=method)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, (method, err)
print(str(explain(PrefillStep(16, 512, 128, 64, 128, 16, (0,), (4,)))).splitlines()[0])
leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
assert not leaked, leaked
print("core ok")
'''


def test_core_imports_and_runs_a_kernel_without_the_cli_and_bench_stacks():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", SCRIPT, ",".join(BLOCKED)], capture_output=True, text=True, env=env,
                       cwd=REPO, timeout=600)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-2000:]}\nstderr:\n{r.stderr[-4000:]}"
    assert r.stdout.strip().splitlines()[-1] == "core ok"
