"""Prints the project's requirements from pyproject.toml, one per line, for `pip install -r`: its
dependencies and those of the optional groups named by --extras. `make deps` installs them apart from the
project itself, which the image needs to keep vLLM and torch in a layer that a change to the project's
own files does not rebuild. Standard library only: it runs before anything is installed."""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path


def requirements(pyproject: Path, extras: list[str]) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    optional: dict[str, list[str]] = project.get("optional-dependencies", {})
    unknown = [name for name in extras if name not in optional]
    if unknown:
        raise SystemExit(f"--extras: {', '.join(unknown)} not in {pyproject}'s optional-dependencies "
                         f"({', '.join(optional)})")
    return [*project.get("dependencies", []), *(r for name in extras for r in optional[name])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--extras", default="", help="optional dependency groups, comma-separated")
    parser.add_argument("--pyproject", type=Path, default=Path(__file__).resolve().parent.parent / "pyproject.toml")
    args = parser.parse_args()
    extras = [name.strip() for name in args.extras.split(",") if name.strip()]
    print("\n".join(requirements(args.pyproject, extras)))


if __name__ == "__main__":
    main()
