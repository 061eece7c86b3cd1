"""Paths of the repository the tests run in."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "results"
README = REPO / "README.md"
PACKAGE = REPO / "sparse_mla"


def package_files() -> list[Path]:
    """Every .py file of the package (what the structure tests check; a module must be committed before CI sees it,
    so they hold on a fresh clone as on a copy of the tree without its git index)."""
    return sorted(PACKAGE.rglob("*.py"))
