"""`taco_llm serve --config FILE.yaml`: options read from a YAML mapping, as vLLM's `--config` reads them.

Keys are flag names without the dashes, in snake or kebab case (`max_model_len`, `max-model-len`). The
file's options go in before the command line's, so that a flag given on the command line wins.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import yaml

CONFIG_FLAG = "--config"


class ConfigFileError(ValueError):
    """A config file that cannot be used; the message names the file and, where it is one, the key."""


def _read_mapping(path: str) -> dict[Any, Any]:
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except OSError as error:
        raise ConfigFileError(f"{CONFIG_FLAG} {path}: cannot read it: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise ConfigFileError(f"{CONFIG_FLAG} {path}: not a text file") from None
    except yaml.YAMLError as error:
        where = getattr(error, "problem_mark", None)
        at = f" (line {where.line + 1}, column {where.column + 1})" if where is not None else ""
        problem = getattr(error, "problem", None) or str(error)
        raise ConfigFileError(f"{CONFIG_FLAG} {path}: not valid YAML{at}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"{CONFIG_FLAG} {path}: expected a mapping of option names to values, "
                              f"got a YAML {type(data).__name__}")
    return data


def config_argv(path: str, is_flag: Callable[[str], bool], repeated: frozenset[str] = frozenset(),
                json_valued: frozenset[str] = frozenset()) -> list[str]:
    """The file's options as command-line arguments.

    `is_flag` says whether a `--name` exists; `repeated` flags take one value per occurrence (a YAML
    list becomes the flag repeated); `json_valued` flags take their whole value as JSON (a YAML list
    or mapping becomes one JSON argument). Other lists become one flag with several values, other
    mappings one JSON argument (vLLM's config flags take JSON).
    """
    argv: list[str] = []
    for key, value in _read_mapping(path).items():
        if not isinstance(key, str) or not key.strip():
            raise ConfigFileError(f"{CONFIG_FLAG} {path}: option names must be text, got {key!r}")
        name = key.strip().replace("_", "-")
        flag = f"--{name}"
        if flag == CONFIG_FLAG:
            raise ConfigFileError(f"{CONFIG_FLAG} {path}: key {key!r}: a config file cannot name another one")
        if not is_flag(flag):
            raise ConfigFileError(f"{CONFIG_FLAG} {path}: unknown key {key!r}: there is no flag {flag}")
        if value is None:
            raise ConfigFileError(f"{CONFIG_FLAG} {path}: key {key!r} has no value")
        if flag in json_valued:
            argv += [flag, value if isinstance(value, str) else json.dumps(value)]
        elif isinstance(value, bool):
            if value:
                argv.append(flag)
            elif is_flag(f"--no-{name}"):
                argv.append(f"--no-{name}")
        elif isinstance(value, list):
            if flag in repeated:
                for item in value:
                    argv += [flag, str(item)]
            elif value:
                argv += [flag, *(json.dumps(v) if isinstance(v, dict | list) else str(v) for v in value)]
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def expand_config(argv: Sequence[str], is_flag: Callable[[str], bool], repeated: frozenset[str] = frozenset(),
                  json_valued: frozenset[str] = frozenset()) -> list[str]:
    """argv with `--config FILE` replaced by the file's options, placed after the model tag (if any)
    and before every other flag, so that the command line wins."""
    argv = list(argv)
    places = [i for i, a in enumerate(argv) if a == CONFIG_FLAG or a.startswith(f"{CONFIG_FLAG}=")]
    if not places:
        return argv
    if len(places) > 1:
        raise ConfigFileError(f"{CONFIG_FLAG} is given {len(places)} times; give one file")
    at = places[0]
    if argv[at] == CONFIG_FLAG:
        if at + 1 >= len(argv) or argv[at + 1].startswith("-"):
            raise ConfigFileError(f"{CONFIG_FLAG} needs a file name")
        path, rest = argv[at + 1], argv[:at] + argv[at + 2:]
    else:
        path, rest = argv[at].split("=", 1)[1], argv[:at] + argv[at + 1:]
    options = config_argv(path, is_flag, repeated, json_valued)
    head = rest[:1] if rest and not rest[0].startswith("-") else []
    return head + options + rest[len(head):]
