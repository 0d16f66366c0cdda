"""vLLM's non-public parts, all behind engine_worker/vllm_internals.py, checked against the installed vLLM
without starting an engine. After a vLLM upgrade this test fails once, listing everything that moved:
an import, a parameter, an attribute, a message text. A second test keeps vLLM's private modules out of
every other file."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
from pathlib import Path
from typing import Any

from .support import ROOT

DOOR = ROOT / "engine_worker" / "vllm_internals.py"

# Files that still import vLLM's private modules themselves, until their imports move to the door
# (the door already re-exports what they use). Temporary: empty it as each file is migrated.
NOT_YET_MIGRATED: frozenset[str] = frozenset()


def _resolve(path: str) -> Any:
    """"module:qualified.name" to the object."""
    module_name, _, qualname = path.partition(":")
    target: Any = importlib.import_module(module_name)
    for part in qualname.split(".") if qualname else ():
        target = getattr(target, part)
    return target


def _vllm_imports(tree: ast.AST) -> list[tuple[str, str | None, int]]:
    """(module, name or None for `import module`, line) of every vLLM import, nested ones included."""
    found: list[tuple[str, str | None, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                node.module == "vllm" or node.module.startswith("vllm.")):
            found += [(node.module, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names
                      if alias.name == "vllm" or alias.name.startswith("vllm.")]
    return found


def _string_constants(module_name: str) -> list[str]:
    """Every string literal in a module's source; an f-string's values show as {}."""
    tree = ast.parse(Path(inspect.getsourcefile(importlib.import_module(module_name)) or "").read_text())
    texts: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            texts.append(node.value)
        elif isinstance(node, ast.JoinedStr):
            texts.append("".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values))
    return texts


def _has_attribute(cls: type, name: str) -> bool:
    """Whether instances of cls have the attribute: on the class, a dataclass or pydantic field, an
    annotation, or assigned as `self.name` in the source of the class or a base."""
    if hasattr(cls, name) or name in getattr(cls, "model_fields", {}):
        return True
    if dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}:
        return True
    assignment = re.compile(rf"\bself\.{re.escape(name)}\s*(:[^=\n]+)?=[^=]")
    for klass in cls.__mro__:
        if name in vars(klass).get("__annotations__", {}):
            return True
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if assignment.search(source):
            return True
    return False


def _check_door_imports(problems: list[str]) -> None:
    for module_name, name, line in _vllm_imports(ast.parse(DOOR.read_text())):
        try:
            module = importlib.import_module(module_name)
        except Exception as error:
            problems.append(f"line {line}: import {module_name}: {type(error).__name__}: {error}")
            continue
        if name is not None and not hasattr(module, name):
            problems.append(f"line {line}: {module_name} has no {name}")


def _check_signatures(problems: list[str], signatures: dict[str, tuple[str, ...]]) -> None:
    for path, wanted in signatures.items():
        try:
            target = _resolve(path)
            # A Triton kernel (or vLLM's stand-in where Triton has no backend) wraps the function as .fn.
            parameters = inspect.signature(getattr(target, "fn", target)).parameters
        except Exception as error:
            problems.append(f"{path}: {type(error).__name__}: {error}")
            continue
        missing = [p for p in wanted if p not in parameters]
        if missing:
            problems.append(f"{path}: no parameter {', '.join(missing)} (has {', '.join(parameters)})")


def _check_attributes(problems: list[str], attributes: dict[str, tuple[str, ...]]) -> None:
    for path, names in attributes.items():
        try:
            cls = _resolve(path)
        except Exception as error:
            problems.append(f"{path}: {type(error).__name__}: {error}")
            continue
        missing = [n for n in names if not _has_attribute(cls, n)]
        if missing:
            problems.append(f"{path}: no attribute {', '.join(missing)}")


def _check_messages(problems: list[str], messages: dict[str, str], what: str) -> None:
    for text, module_name in messages.items():
        try:
            literals = _string_constants(module_name)
        except Exception as error:
            problems.append(f"{what} {text!r}: cannot read {module_name}: {error}")
            continue
        if not any(text in literal for literal in literals):
            problems.append(f"{what} {text!r} no longer appears in {module_name}")


def _check_context_overflow(problems: list[str], parameters: tuple[str, ...], module_name: str) -> None:
    """Each parameter must still be what vLLM names when it refuses a prompt as longer than the context."""
    try:
        source = Path(inspect.getsourcefile(importlib.import_module(module_name)) or "").read_text()
    except Exception as error:
        problems.append(f"context overflow: cannot read {module_name}: {error}")
        return
    named: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        message = node.args[0]
        parts = message.values if isinstance(message, ast.JoinedStr) else [message]
        text = "".join(p.value for p in parts if isinstance(p, ast.Constant) and isinstance(p.value, str))
        if "maximum context length" in text:
            named.update(k.value.value for k in node.keywords
                         if k.arg == "parameter" and isinstance(k.value, ast.Constant))
    missing = [p for p in parameters if p not in named]
    if missing:
        problems.append(f"{module_name} no longer refuses a too-long prompt with parameter {', '.join(missing)} "
                        f"(it names {sorted(named)})")


def _check_behaviour(problems: list[str]) -> None:
    """What only using the parts shows."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from taco_llm.engine_worker import vllm_internals as door

    def check(what: str, ok: bool) -> None:
        if not ok:
            problems.append(what)

    try:
        parser = AsyncEngineArgs.add_cli_args(door.FlexibleArgumentParser())
        check("option_strings() of vLLM's engine parser lacks --model / --speculative-config",
              {"--model", "--speculative-config"} <= door.option_strings(parser))
    except Exception as error:
        problems.append(f"FlexibleArgumentParser / option_strings: {type(error).__name__}: {error}")
    try:
        names = door.tool_parser_names()
        check(f"tool_parser_names() lacks hermes or mistral: {names}", {"hermes", "mistral"} <= set(names))
    except Exception as error:
        problems.append(f"tool_parser_names: {type(error).__name__}: {error}")
    try:
        check("NgramProposer has no propose", callable(getattr(door.NgramProposer, "propose", None)))
    except Exception as error:
        problems.append(f"NgramProposer: {type(error).__name__}: {error}")
    try:
        worker = door.PlatformWorker
        check(f"PlatformWorker {worker} has no init_device / execute_model",
              callable(getattr(worker, "init_device", None)) and callable(getattr(worker, "execute_model", None)))
    except Exception as error:
        problems.append(f"PlatformWorker: {type(error).__name__}: {error}")
    try:
        # vLLM's registry resolves a kernel by "module.attribute"; sampling_fix.py's name must resolve.
        module_name, _, attribute = door.EXPAND_KERNEL.rpartition(".")
        check(f"EXPAND_KERNEL {door.EXPAND_KERNEL} does not name a kernel",
              hasattr(importlib.import_module(module_name), attribute))
    except Exception as error:
        problems.append(f"EXPAND_KERNEL: {type(error).__name__}: {error}")
    try:
        # The lookahead proposer's propose(sampled, num_tokens_no_spec, token_ids_cpu, slot_mappings=):
        # how vLLM's model runner calls a `custom_class` proposer.
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        source = inspect.getsource(GPUModelRunner)
        call = re.search(r'method == "custom_class":\s*assert[^\n]*\n\s*draft_token_ids = [^\n]*\.propose\(\s*'
                         r"sampled_token_ids,\s*self\.input_batch\.num_tokens_no_spec,\s*"
                         r"self\.input_batch\.token_ids_cpu,\s*slot_mappings=slot_mappings,\s*\)", source)
        check("GPUModelRunner no longer calls a custom_class proposer as propose(sampled_token_ids, "
              "num_tokens_no_spec, token_ids_cpu, slot_mappings=)", call is not None)
    except Exception as error:
        problems.append(f"custom_class proposer call: {type(error).__name__}: {error}")
    try:
        missing = [name for name in door.__all__ if not hasattr(door, name)]
        check(f"the door's __all__ names what it lacks: {missing}", not missing)
    except Exception as error:
        problems.append(f"the door module: {type(error).__name__}: {error}")


def test_vllm_internals_are_where_the_door_expects_them() -> None:
    problems: list[str] = []
    _check_door_imports(problems)
    try:
        from taco_llm.engine_worker import vllm_internals as door
    except Exception as error:  # the imports above say which
        problems.append(f"taco_llm.engine_worker.vllm_internals does not import: {type(error).__name__}: {error}")
    else:
        _check_signatures(problems, door.SIGNATURES)
        _check_attributes(problems, door.ATTRIBUTES)
        _check_context_overflow(problems, door.CONTEXT_OVERFLOW_PARAMETERS, door.CONTEXT_OVERFLOW_MODULE)
        _check_messages(problems, door.REPEATED_MESSAGES, "the message")
        _check_behaviour(problems)
    assert not problems, "vLLM's internals moved:\n  " + "\n  ".join(problems)


def test_only_the_door_imports_vllms_private_modules() -> None:
    from taco_llm.engine_worker.vllm_internals import PUBLIC_MODULES

    offenders: list[str] = []
    for folder in ("engine_worker", "taco_llm"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if path == DOOR or relative in NOT_YET_MIGRATED:
                continue
            for module_name, _, line in _vllm_imports(ast.parse(path.read_text())):
                if module_name not in PUBLIC_MODULES:
                    offenders.append(f"{relative}:{line}: {module_name}")
    assert not offenders, ("vLLM's private modules imported outside engine_worker/vllm_internals.py (add the "
                           "symbol to the door and import it from there):\n  " + "\n  ".join(offenders))


def test_the_exemptions_are_still_needed() -> None:
    """A migrated file leaves NOT_YET_MIGRATED, so the list only shrinks."""
    from taco_llm.engine_worker.vllm_internals import PUBLIC_MODULES

    done = [relative for relative in sorted(NOT_YET_MIGRATED)
            if all(module in PUBLIC_MODULES
                   for module, _, _ in _vllm_imports(ast.parse((ROOT / relative).read_text())))]
    assert not done, f"no longer import vLLM's private modules, drop them from NOT_YET_MIGRATED: {done}"
