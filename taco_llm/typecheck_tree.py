"""Builds build/typecheck/taco_llm/: the installed package's layout as symlinks, for mypy.

setuptools installs the top-level folders gateway/, protos/, engine_worker/ and cache_service/ as
taco_llm.gateway, taco_llm.protos, ... (pyproject.toml's [tool.setuptools.package-dir]). An editable
install maps those names with an import hook, which mypy cannot follow, so mypy (`mypy_path =
"build/typecheck"`, `packages = ["taco_llm"]`) reads this tree instead: links to taco_llm/'s own
entries and to each mapped folder, where the installed package has them. mypy follows the links and
reports errors under build/typecheck/taco_llm/...

`python -m taco_llm.typecheck_tree` rebuilds it from scratch (`make lint` and tests/test_lint.py run it
before mypy), so a module added or removed since the last run is never missed or stale.
"""

from __future__ import annotations

import os
import shutil
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "typecheck"
PACKAGE = "taco_llm"


def package_dirs() -> dict[str, str]:
    """pyproject's mapping of installed package names to folders, e.g. {"taco_llm.gateway": "gateway"}."""
    with (ROOT / "pyproject.toml").open("rb") as file:
        mapping: dict[str, str] = tomllib.load(file)["tool"]["setuptools"]["package-dir"]
    return mapping


def _link(target: Path, link: Path) -> None:
    # Relative, so that the tree stays valid wherever the checkout is moved.
    link.symlink_to(os.path.relpath(target, link.parent), target_is_directory=target.is_dir())


def build(tree: Path = TREE) -> Path:
    """Replaces `tree` with the links; returns the linked package folder."""
    # rmtree unlinks the symlinks themselves; it never follows them into the real folders.
    shutil.rmtree(tree, ignore_errors=True)
    package = tree / PACKAGE
    package.mkdir(parents=True)
    for entry in sorted((ROOT / PACKAGE).iterdir()):
        if entry.name != "__pycache__":
            _link(entry, package / entry.name)
    for name, folder in package_dirs().items():
        parent, _, child = name.rpartition(".")
        if parent != PACKAGE:
            raise ValueError(f"package-dir {name!r}: only direct subpackages of {PACKAGE} are linked")
        _link(ROOT / folder, package / child)
    return package


def main() -> int:
    print(f"linked {build().relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
