"""The engine worker's layout shows which process runs what, and the hand-offs between them hold.

frontend/ runs in the worker's own process, core/ inside vLLM's EngineCore process; neither imports the
other, and what crosses is named in handoff.py (engine_worker/__init__.py says more).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from .support import ROOT

WORKER = ROOT / "engine_worker"
PACKAGE = "taco_llm.engine_worker"
FRONTEND = f"{PACKAGE}.frontend"
CORE = f"{PACKAGE}.core"
SHARED = ("handoff.py", "lookahead_settings.py", "vllm_internals.py")


def _module_name(path: Path) -> str:
    parts = path.relative_to(WORKER).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((PACKAGE, *parts))


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every module a file imports (relative imports resolved), with its line; for `from X import y` both
    X and X.y, since y may be a submodule."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _offenders(files: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line}: imports {module}"
            for path in files for line, module in imported_modules(path)
            if any(_inside(module, package) for package in forbidden)]


def test_the_import_check_resolves_relative_imports() -> None:
    modules = {module for _, module in imported_modules(WORKER / "frontend" / "args.py")}
    assert {f"{PACKAGE}.handoff", f"{FRONTEND}.offload_args", f"{PACKAGE}.vllm_internals"} <= modules
    modules = {module for _, module in imported_modules(WORKER / "core" / "lookahead" / "proposer.py")}
    assert {f"{PACKAGE}.handoff", f"{PACKAGE}.lookahead_settings", f"{CORE}.lookahead.index"} <= modules


def test_core_and_frontend_do_not_import_each_other() -> None:
    core = sorted((WORKER / "core").rglob("*.py"))
    frontend = sorted((WORKER / "frontend").rglob("*.py"))
    assert core and frontend
    offenders = _offenders(core, (FRONTEND,)) + _offenders(frontend, (CORE,))
    assert not offenders, ("core/ runs in vLLM's engine process and frontend/ in the worker's own: share "
                           "through handoff.py, lookahead_settings.py or vllm_internals.py instead:\n  "
                           + "\n  ".join(offenders))


def test_the_shared_modules_import_neither_side() -> None:
    offenders = _offenders([WORKER / name for name in SHARED], (FRONTEND, CORE))
    assert not offenders, "\n".join(offenders)
    # handoff.py holds only names and the settings dataclass: nothing of the project's at all.
    own = [module for _, module in imported_modules(WORKER / "handoff.py") if _inside(module, "taco_llm")]
    assert not own, f"handoff.py imports {own}"


# Run in a child: importing the worker class loads vLLM's worker, which is slow and loads modules that
# other tests' in-process vLLM checks do not expect.
_RESOLVE_CLASS_PATHS = """
import importlib, json
from taco_llm.engine_worker import handoff

paths = {"WORKER_CLASS": handoff.WORKER_CLASS, "PROPOSER_CLASS": handoff.PROPOSER_CLASS,
         "CONNECTOR": handoff.CONNECTOR_MODULE + "." + handoff.CONNECTOR_CLASS}
found = {}
for name, path in paths.items():
    module_name, _, attribute = path.rpartition(".")
    cls = getattr(importlib.import_module(module_name), attribute)
    found[name] = [path, isinstance(cls, type) and f"{cls.__module__}.{cls.__qualname__}"]
print(json.dumps(found))
"""


def test_each_class_path_imports_to_the_class_it_names() -> None:
    run = subprocess.run([sys.executable, "-c", _RESOLVE_CLASS_PATHS], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(found) == {"WORKER_CLASS", "PROPOSER_CLASS", "CONNECTOR"}
    for name, (path, defined_at) in found.items():
        # Defined there, not merely re-exported: the path names where vLLM will find the class.
        assert defined_at == path, f"handoff.{name} {path!r} imports to {defined_at!r}"
