"""results/ holds one current file per claim: every file outside results/history/ is cited by the README or docs/, at
most MAX_CURRENT of them, no patches; every results/ path the README, docs/, the results / benchmarks READMEs and the
code cite exists; the two indexes (results/README.md, results/history/README.md) list exactly the files there."""

from __future__ import annotations

import re

from testlib.paths import README, REPO, RESULTS

MAX_CURRENT = 30
HISTORY = RESULTS / "history"
# A results/ path as the docs and comments write it. Not a citation: ``git show commit:results/X`` (an older file),
# ``results/X@commit`` (a file as committed then; the "@" is checked after the match), a path with {a,b}
# alternatives, and an output path of a usage line (``--json results/X`` in a script's docstring: what it writes).
CITED = re.compile(r"(?<![:\w/])(?<!--json )results/[\w.*{},/-]*\w")


def _docs() -> list:
    return [README, REPO / "benchmarks" / "README.md", *sorted((REPO / "docs").rglob("*.md")),
            *sorted(RESULTS.rglob("README.md"))]


def _code() -> list:
    return [p for p in sorted([*(REPO / "sparse_mla").rglob("*.py"), *(REPO / "benchmarks").rglob("*.py"),
                               *(REPO / "tests").rglob("*.py")]) if p != REPO / "tests" / "test_results.py"]


def _citations(path) -> list[str]:
    text = path.read_text()
    return [m.group(0) for m in CITED.finditer(text) if text[m.end():m.end() + 1] != "@" and "{" not in m.group(0)]


def _current() -> list:
    return sorted(p for p in RESULTS.iterdir() if p.name != "README.md" and p != HISTORY)


def _history() -> list:
    return sorted(p for p in HISTORY.rglob("*") if p.is_file() and p.name != "README.md")


def test_cited_result_files_exist():
    """Every results/ path cited in the README, docs/, the results / benchmarks READMEs and the package, benchmark
    and test code exists (a glob must match a file)."""
    missing = [f"{f.relative_to(REPO)}: {c}" for f in [*_docs(), *_code()] for c in _citations(f)
               if not (c.endswith("/README") or list(REPO.glob(c)) or (REPO / c).is_dir())]
    assert not missing, missing


def test_every_current_file_is_cited_by_the_readme_or_docs():
    """A file outside results/history/ holds a claim of the README or docs/ (a cited glob or folder counts); one no
    document cites belongs in history/."""
    cited = {c for f in [README, *sorted((REPO / "docs").rglob("*.md"))] for c in _citations(f)}
    uncited = [p.name for p in _current()
               if not any(p.match(str(REPO / c)) or p == REPO / c or (REPO / c).is_relative_to(p) for c in cited)]
    assert not uncited, f"not cited by README.md or docs/: {uncited} (move them under results/history/)"


def test_results_layout():
    """At most MAX_CURRENT current files, all plain files; no patches anywhere under results/ (diffs live in
    docs/notes/)."""
    current = _current()
    assert len(current) <= MAX_CURRENT, [p.name for p in current]
    assert all(p.is_file() for p in current), [p.name for p in current if not p.is_file()]
    patches = [str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*") if p.suffix in (".patch", ".diff")]
    assert not patches, patches


def test_indexes_list_exactly_the_files():
    """results/README.md lists each current file, results/history/README.md each file under history/ (path relative
    to it), both as the first cell of a table row, and neither lists a file that is not there."""
    for index, files, root in ((RESULTS / "README.md", _current(), RESULTS), (HISTORY / "README.md", _history(), HISTORY)):
        listed = re.findall(r"^\| `([^`]+)` \|", index.read_text(), re.M)
        assert sorted(listed) == sorted(str(p.relative_to(root)) for p in files), index
