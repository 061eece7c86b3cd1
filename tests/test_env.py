"""The environment switches: every ``SPARSE_MLA_*`` name in the package is a row of ``sparse_mla.env.SWITCHES``,
nothing outside ``sparse_mla/env.py`` reads one (or TRITON_INTERPRET) from ``os.environ``, the table's modules
and values match their owners, and the README's "Environment switches" is ``env.markdown_table()``. Plain Python
and ``ast`` over the committed files (``testlib.paths.package_files``): no kernel is imported."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from testlib.paths import PACKAGE, README, REPO, package_files

from sparse_mla import env

NAME = re.compile(r"SPARSE_MLA_[A-Z0-9_]*[A-Z0-9]")


def _modules():
    for f in package_files():
        yield f, ast.parse(f.read_text())


def test_every_switch_name_in_the_package_is_in_the_table():
    """(a) every SPARSE_MLA_* name in a string of the package (code, messages, docstrings) is a switch."""
    known = {s.name for s in env.SWITCHES}
    unknown = set()
    for f, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                unknown |= {(f.relative_to(REPO).as_posix(), n) for n in NAME.findall(node.value) if n not in known}
    assert not unknown, sorted(unknown)
    assert len(known) == len(env.SWITCHES), "a switch is listed twice"


def _env_reads(tree: ast.Module):
    """(line, variable) of every value read of os.environ / os.getenv with a constant name: ``os.environ.get(X)``,
    ``os.getenv(X)``, ``os.environ[X]`` as a load (writes, pops, setdefault and ``X in os.environ`` are not reads
    of a value)."""
    def is_environ(n):
        return isinstance(n, ast.Attribute) and n.attr == "environ" and isinstance(n.value, ast.Name) and n.value.id == "os"
    for node in ast.walk(tree):
        arg = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            if (node.func.attr == "get" and is_environ(node.func.value)) or (
                    node.func.attr == "getenv" and isinstance(node.func.value, ast.Name) and node.func.value.id == "os"):
                arg = node.args[0]
        elif isinstance(node, ast.Subscript) and is_environ(node.value) and isinstance(node.ctx, ast.Load):
            arg = node.slice
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            yield node.lineno, arg.value


def test_only_env_reads_the_switches_and_triton_interpret():
    """(b) no module but sparse_mla/env.py reads a SPARSE_MLA_* switch or TRITON_INTERPRET from the environment."""
    reads = []
    for f, tree in _modules():
        if f == PACKAGE / "env.py":
            continue
        for line, name in _env_reads(tree):
            if name.startswith("SPARSE_MLA_") or name == "TRITON_INTERPRET":
                reads.append(f"{f.relative_to(REPO).as_posix()}:{line} reads {name}")
    assert not reads, reads


def test_owners_name_their_switch_and_its_values():
    """Each owner's constant is the table's name, and the values the table documents are the ones it accepts."""
    from sparse_mla.layer import dispatch
    from sparse_mla.mqa import backends as mqa_backends
    from sparse_mla.union import backends as union_backends

    assert dispatch.ENV_VAR == env.PATH.name
    assert mqa_backends.ENV_VAR == env.MQA_BACKEND.name
    assert union_backends.ENV_VAR == env.UNION_BACKEND.name
    values = lambda s: tuple(v.strip() for v in s.values.split(","))  # noqa: E731
    assert values(env.PATH) == ("auto", *dispatch.PATH_NAMES)
    assert set(values(env.MQA_BACKEND)) == {"auto", *mqa_backends.BACKENDS}
    assert set(values(env.UNION_BACKEND)) == {"auto", *union_backends.BACKENDS}
    consts = {s.name: k for k, s in vars(env).items() if isinstance(s, env.Switch)}
    for s in env.SWITCHES:
        assert s.when in ("per call", "at import"), s
        path = PACKAGE.parent / s.owner.replace(".", "/")
        src = (path.with_suffix(".py") if path.with_suffix(".py").exists() else path / "__init__.py").read_text()
        assert f"env.{consts[s.name]}" in src, f"{s.owner} does not read {s.name} through sparse_mla.env"


def _defines_kernels(tree: ast.Module) -> bool:
    """Whether a module decorates a function with triton.jit / gluon.jit (with or without arguments)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            for d in node.decorator_list:
                d = d.func if isinstance(d, ast.Call) else d
                if isinstance(d, ast.Attribute) and d.attr == "jit" and isinstance(d.value, ast.Name) and \
                        d.value.id in ("triton", "gluon"):
                    return True
    return False


def test_kernel_modules_are_the_modules_that_define_kernels():
    """``env.KERNEL_MODULES`` (what ``kernels_imported`` looks for) covers every module with a kernel, and each of
    its entries holds one."""
    def name(f: Path) -> str:
        parts = f.relative_to(PACKAGE.parent).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    with_kernels = {name(f) for f, tree in _modules() if _defines_kernels(tree)}
    covered = lambda m, k: m == k or m.startswith(k + ".")  # noqa: E731
    assert {m for m in with_kernels if not any(covered(m, k) for k in env.KERNEL_MODULES)} == set()
    assert [k for k in env.KERNEL_MODULES if not any(covered(m, k) for m in with_kernels)] == []


@pytest.mark.parametrize("value,on", [("1", True), ("true", True), ("ON", True), ("yes", True), ("y", True),
                                      ("0", False), ("", False), ("2", False), ("off", False), ("false", False)])
def test_interpreted_parses_triton_interpret_as_triton_does(monkeypatch, value, on):
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert env.interpreted() is on


def test_get_reads_per_call_and_defaults(monkeypatch):
    monkeypatch.delenv(env.MQA_BACKEND.name, raising=False)
    assert env.get(env.MQA_BACKEND) == "auto"
    monkeypatch.setenv(env.MQA_BACKEND.name, "triton")
    assert env.get(env.MQA_BACKEND) == "triton"


def test_markdown_table_has_one_row_per_switch():
    table = env.markdown_table().splitlines()
    assert len(table) == 2 + len(env.SWITCHES)
    for s, row in zip(env.SWITCHES, table[2:]):
        assert row.startswith(f"| `{s.name}` |") and ("not for production" in row) == s.tuning


README_TABLE_MARK = '<!-- python -c "import sparse_mla.env as e; print(e.markdown_table())" -->\n'


def test_readme_table_is_markdown_table():
    """(c) the README's "Environment switches" table is ``env.markdown_table()``, verbatim (the table is generated
    from ``SWITCHES``, never typed: regenerate it with the command in the comment above it)."""
    text = README.read_text()
    section = text.split("\n## Environment switches\n", 1)[1].split("\n## ", 1)[0]
    assert README_TABLE_MARK in section, "the README's switches table lost its generating comment"
    table = section.split(README_TABLE_MARK, 1)[1].split("\n\n", 1)[0] + "\n"
    assert table == env.markdown_table()
