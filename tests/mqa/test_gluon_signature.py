"""The Gluon kernels' run-time argument list is written once (``sparse_mla.mqa.gluon_sm90.signature``): both kernel
``def``s start with ``ARG_NAMES`` in that order and are decorated with ``DO_NOT_SPECIALIZE``, and the launcher
passes that many arguments. CPU, ``ast`` and the plain-Python table only: nothing here imports Gluon."""

from __future__ import annotations

import ast
import importlib.util

import pytest
from testlib.paths import PACKAGE

GLUON = PACKAGE / "mqa" / "gluon_sm90"
KERNELS = [("split.py", "sparse_mqa_sm90_kernel"), ("pair.py", "sparse_mqa_sm90_pair_kernel")]


def _table():
    """signature.py loaded by path (importing the package would import Gluon)."""
    spec = importlib.util.spec_from_file_location("gluon_sm90_signature", GLUON / "signature.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _def(file: str, name: str) -> ast.FunctionDef:
    tree = ast.parse((GLUON / file).read_text())
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert len(defs) == 1, f"{file}: one def {name}"
    return defs[0]


def test_table_is_consistent():
    sig = _table()
    names = [n for n, _, _ in sig.KERNEL_ARGS]
    assert tuple(names) == sig.ARG_NAMES and len(set(names)) == len(names) == 33
    specs = {spec for _, _, spec in sig.KERNEL_ARGS}
    assert specs == {sig.ALIGNED, sig.RUNTIME, sig.DEFAULT}
    assert sig.ALIGNED_ARGS == ("q_ptr", "kv_ptr", "out_ptr", "stride_qt", "stride_qh", "stride_kvn", "stride_ot",
                                "stride_oh")
    assert len(sig.DO_NOT_SPECIALIZE) == 24 and not set(sig.DO_NOT_SPECIALIZE) & set(sig.ALIGNED_ARGS)
    bf16, fp8 = sig.aot_signature("bf16", False), sig.aot_signature("bf16", True)
    assert list(bf16) == names and bf16["q_ptr"] == bf16["kv_ptr"] == bf16["out_ptr"] == "*bf16"
    assert fp8["kv_ptr"] == "*u8" and fp8["q_ptr"] == "*bf16" and sig.aot_signature("fp16", False)["q_ptr"] == "*fp16"
    assert sig.aot_signature("fp16", False, kv_split=True)["out_ptr"] == "*fp32"  # split partials are fp32


@pytest.mark.parametrize("file,name", KERNELS, ids=[k for _, k in KERNELS])
def test_kernel_def_starts_with_the_table(file, name):
    """The run-time parameters are the table's names in order; the rest are constexprs; the decorator takes
    ``do_not_specialize=DO_NOT_SPECIALIZE`` (no list written by hand)."""
    sig = _table()
    fn = _def(file, name)
    params = [a.arg for a in fn.args.args]
    assert tuple(params[:len(sig.ARG_NAMES)]) == sig.ARG_NAMES
    for a in fn.args.args[len(sig.ARG_NAMES):]:
        assert a.annotation is not None and ast.unparse(a.annotation) == "gl.constexpr", a.arg
    assert [ast.unparse(d) for d in fn.decorator_list] == ["gluon.jit(do_not_specialize=DO_NOT_SPECIALIZE)"]


def test_launcher_passes_every_runtime_argument():
    """The one launch call (through the launch cache) passes len(ARG_NAMES) run-time arguments as its argument tuple
    (then the variant's constexprs by name)."""
    sig = _table()
    tree = ast.parse((GLUON / "launcher.py").read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Call)
             and ast.unparse(n.func) == "_launcher_for(schedule)"]
    assert len(calls) == 1
    key, grid, args, constexprs, options = calls[0].args
    assert isinstance(args, ast.Tuple) and len(args.elts) == len(sig.ARG_NAMES)
