"""The installed taco-llm version, for /version and GetModelInfo."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def package_version() -> str:
    try:
        return version("taco-llm")
    except PackageNotFoundError:
        return "0+unknown"
