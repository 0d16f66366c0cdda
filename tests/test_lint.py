"""ruff and mypy stay clean."""

from __future__ import annotations

import subprocess
import sys

from taco_llm.typecheck_tree import build as build_typecheck_tree

from .support import ROOT


def test_ruff() -> None:
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_mypy() -> None:
    # mypy reads taco_llm through the symlink tree (pyproject's mypy_path), rebuilt for the current files.
    build_typecheck_tree()
    run = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
