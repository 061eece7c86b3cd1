"""The automatic choices share one vocabulary (``sparse_mla.choices``): every registered chooser is a ``choose_*``
function returning ``Choice(name, reason)``, docs/decisions.md holds the registry's table verbatim, the explain
outputs print each choice under its registered label, ``NEVER`` is defined once, and the former names are
deprecated aliases of the new ones. Plain Python on the CPU (explain_fwd launches nothing)."""

from __future__ import annotations

import ast
import importlib
import math
import warnings

import pytest
import torch
from testlib.device import DEVICE
from testlib.fp8 import FP8, fp8_problem
from testlib.paths import PACKAGE, REPO, package_files
from testlib.problems import make_problem

from sparse_mla import choices
from sparse_mla.choices import DECISIONS, LABELS, Choice

FWD = "sparse_mla.mqa.interface.explain_fwd"
LAYER = "sparse_mla.layer.explain"


def _resolve(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_decisions_md_is_the_registry_table():
    """docs/decisions.md lists every registered choice: it holds ``markdown_table()`` verbatim."""
    text = (REPO / "docs" / "decisions.md").read_text()
    assert choices.markdown_table() in text, "re-render docs/decisions.md's table from sparse_mla.choices"
    for d in DECISIONS:
        assert f"| `{d.label}` |" in text
    assert len(set(LABELS)) == len(LABELS), "a label is registered twice"


@pytest.mark.parametrize("decision", [d for d in DECISIONS if d.chooser], ids=lambda d: d.label)
def test_every_chooser_is_a_choose_function(decision):
    fn = _resolve(decision.chooser)
    assert callable(fn) and fn.__name__.startswith("choose_") and fn.__name__ == decision.chooser.rpartition(".")[2]
    assert "Raises" in (fn.__doc__ or ""), f"{decision.chooser}: the docstring gives the errors raised"


def test_choosers_return_a_choice(monkeypatch):
    from sparse_mla.kv_staging import choose_kv_dequant
    from sparse_mla.layer import PrefillStep, choose_path
    from sparse_mla.mqa.backends import ENV_VAR, choose_backend
    from sparse_mla.mqa.kv_splits import choose_kv_splits
    from sparse_mla.mqa.selection import choose_method
    from sparse_mla.union.backends import UnionDeviceFacts, choose_union_backend

    monkeypatch.delenv(ENV_VAR, raising=False)
    q, kv = torch.zeros(4, 16, 576, dtype=torch.float16), torch.zeros(64, 576, dtype=torch.float16)
    got = [
        choose_method("auto", 16, 4096),
        choose_kv_dequant("auto", 1000, 4096 * 2048, 1152, group_size=8),
        choose_kv_splits(None, num_lists=4, pseudo_heads=16, rows_per_list=2048, sms=132),
        choose_backend(q, kv),
        choose_union_backend(UnionDeviceFacts("cpu", None, 0, True, None), 8, 2048),
        choose_path(PrefillStep(16, 512, 128, 64, 128, 2048, (0, ), (4096, ))),
    ]
    for c in got:
        assert isinstance(c, Choice) and isinstance(c.reason, str) and c.reason, c
        name, reason = c  # still a 2-tuple
        assert choices.line("method", c) == f"method: {name} ({reason})"


def test_never_is_defined_once():
    """The sentinel ``NEVER`` is assigned in sparse_mla/choices.py only (the others import it)."""
    homes = []
    for f in package_files():
        for node in ast.walk(ast.parse(f.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            if any(isinstance(t, ast.Name) and t.id == "NEVER" for t in targets):
                homes.append(f.relative_to(PACKAGE).as_posix())
    assert homes == ["choices.py"]
    from sparse_mla.layer import dispatch
    from sparse_mla.mqa import selection

    assert dispatch.NEVER is selection.NEVER is choices.NEVER == 2**31


def _labels(text: str) -> list[str]:
    return [ln.split(": ", 1)[0] for ln in text.splitlines()]


def test_explain_fwd_prints_the_registered_choices():
    """Per token: method, kv splits, attention backend; grouped on an FP8 cache: every choice registered for
    explain_fwd, in the registry's order."""
    from sparse_mla.mqa.interface import explain_fwd

    mine = [d.label for d in DECISIONS if FWD in d.explained_by]
    p = make_problem(8, 16, 64, 200, seed=1)
    assert _labels(explain_fwd(p.q, p.kv, p.indices, method="per_token")) == ["method", "kv splits",
                                                                             "attention backend"]
    q, cache, idx = fp8_problem(16, 16, 64, 200, seed=2)
    text = explain_fwd(q, cache, idx, 0.1, method="grouped", kv_format=FP8)
    assert _labels(text) == mine, text
    assert "overlap guard: " in text and "default table for G = 8" in text
    off = explain_fwd(q, cache, idx, 0.1, method="grouped", kv_format=FP8, overlap_guard=math.inf)
    assert "overlap guard: off (" in off


def test_layer_explain_prints_registered_labels():
    from sparse_mla.layer import PrefillStep, explain

    text = str(explain(PrefillStep(16, 512, 128, 64, 128, 2048, (4096, ), (4096, ))))
    first = text.splitlines()[0]
    assert first.startswith("path: ")
    for d in DECISIONS:
        if LAYER in d.explained_by and d.label != "path":
            assert f") {d.label}: " in text, (d.label, text)


def test_line_refuses_an_unregistered_label():
    with pytest.raises(KeyError, match="not a decision label"):
        choices.line("kernel", Choice("x", "y"))
    with pytest.raises(KeyError, match="not decision labels"):
        choices.explain_lines({"kernel": Choice("x", "y")})


@pytest.mark.parametrize("old, new, args", [
    ("sparse_mla.mqa.selection.resolve_method", "sparse_mla.mqa.selection.choose_method", ("auto", 16, 4096)),
    ("sparse_mla.mqa.backends.select_backend", "sparse_mla.mqa.backends.choose_backend",
     (torch.zeros(4, 16, 576, dtype=torch.float16), torch.zeros(64, 576, dtype=torch.float16))),
    ("sparse_mla.union.backends.select_union_backend", "sparse_mla.union.backends.choose_union_backend",
     (DEVICE, 8, 64)),
], ids=["resolve_method", "select_backend", "select_union_backend"])
def test_former_names_are_deprecated_aliases(old, new, args):
    with pytest.warns(DeprecationWarning, match=new.rpartition(".")[2]):
        got = _resolve(old)(*args)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert got == _resolve(new)(*args)
