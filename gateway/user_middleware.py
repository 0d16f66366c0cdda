"""`--middleware module.attr`: a user's own ASGI middleware, imported by path as vLLM does."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from fastapi import FastAPI


class MiddlewareError(ValueError):
    """A --middleware path that does not name a usable middleware."""


def load_middleware(path: str) -> Any:
    module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise MiddlewareError(f"--middleware {path!r}: expected an import path, module.attr")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # any import failure is the user's module's, reported by name
        raise MiddlewareError(f"--middleware {path}: cannot import {module_name}: "
                              f"{type(error).__name__}: {error}") from None
    try:
        found = getattr(module, attr)
    except AttributeError:
        raise MiddlewareError(f"--middleware {path}: {module_name} has no attribute {attr!r}") from None
    if not (inspect.isclass(found) or inspect.iscoroutinefunction(found)):
        raise MiddlewareError(f"--middleware {path}: must be a class (ASGI middleware) or an async function "
                              f"(an http middleware), got {type(found).__name__}")
    return found


def install(app: FastAPI, middleware: Any) -> None:
    if inspect.isclass(middleware):
        app.add_middleware(middleware)  # type: ignore[arg-type]
    else:
        app.middleware("http")(middleware)
