"""Paths of the repository the tests run in."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "results"
README = REPO / "README.md"
PACKAGE = REPO / "sparse_mla"


def package_files() -> list[Path]:
    """The package's .py files as committed or staged (``git ls-files``): the structure tests check what a clone
    holds, not untracked work in progress; every .py file under sparse_mla/ outside a git checkout."""
    try:
        out = subprocess.run(["git", "-C", str(REPO), "ls-files", "--cached", "--", "sparse_mla"], capture_output=True,
                             text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return sorted(PACKAGE.rglob("*.py"))
    if "sparse_mla/__init__.py" not in out:  # a copy of the tree without its git index (a device machine's)
        return sorted(PACKAGE.rglob("*.py"))
    return sorted(REPO / f for f in out if f.endswith(".py") and (REPO / f).exists())
