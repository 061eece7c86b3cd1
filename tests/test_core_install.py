"""A core install (`pip install sparse-mla`, no extras): every module outside the CLI and the benchmarks imports,
and the kernels run, with none of the bench extra's packages importable (a meta-path blocker in a fresh
interpreter stands in for their absence); none of them is imported on the way."""

from __future__ import annotations

import os
import subprocess
import sys

from testlib.paths import REPO

BENCH_EXTRA = ("typer", "click", "rich", "tqdm", "safetensors", "matplotlib")  # pyproject.toml `bench` (+ typer's click)

SCRIPT = """
import importlib, importlib.abc, importlib.util, os, pkgutil, sys
BLOCKED = set(sys.argv[1].split(","))


class Refuse(importlib.abc.Loader):
    def create_module(self, spec):
        raise ModuleNotFoundError(f"No module named {spec.name!r} (blocked: not a core dependency)", name=spec.name)

    def exec_module(self, module):
        pass


# An import of a blocked module fails; a find_spec probe of one (torch._dynamo's skip rules probe tqdm) gets a spec
# without origin, which the prober ignores.
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            return importlib.util.spec_from_loader(name, Refuse())


sys.meta_path.insert(0, Block())
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
import sparse_mla

names = sorted(m.name for m in pkgutil.walk_packages(sparse_mla.__path__, "sparse_mla."))
core = [n for n in names if not n.startswith(("sparse_mla.cli", "sparse_mla.__main__", "sparse_mla.bench"))]
for n in core:
    importlib.import_module(n)
device, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float16)
g = torch.Generator().manual_seed(0)
q = torch.randn(8, 16, 576, generator=g).to(device, dtype)
kv = torch.randn(64, 576, generator=g).to(device, dtype)
idx = torch.stack([torch.randperm(64, generator=g)[:16] for _ in range(8)]).int().to(device)
ref, _ = sparse_mla.sparse_mla_ref(q, kv, idx, 0.1)
for method in ("per_token", "grouped"):
    out = sparse_mla.sparse_mla_fwd(q, kv, idx, 0.1, method=method)
    err = float((out.float() - ref).norm() / ref.norm())
    assert err < 1e-2, (method, err)
leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
assert not leaked, leaked
print(f"core ok: {len(core)} modules")
"""


def test_core_install_needs_no_bench_extra():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    res = subprocess.run([sys.executable, "-c", SCRIPT, ",".join(BENCH_EXTRA)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "core ok" in res.stdout, res.stdout
