"""The gateway's command-line flags, shared with `taco_llm serve` (argparse only: cheap to import)."""

from __future__ import annotations

import argparse

LOG_LEVELS = ["debug", "info", "warning", "error", "critical", "trace"]

# (flag, argparse keywords). `serve` offers the same flags and hands them on with `to_argv`.
GATEWAY_FLAGS: list[tuple[str, dict[str, object]]] = [
    ("--host", {"default": "127.0.0.1", "help": "host name to listen on"}),
    ("--port", {"type": int, "default": 8000, "help": "port to listen on"}),
    ("--uvicorn-log-level", {"choices": LOG_LEVELS, "default": "info", "help": "log level for uvicorn"}),
    ("--response-role", {"default": "assistant", "help": "the role name returned in chat completions"}),
    ("--return-tokens-as-token-ids", {"action": "store_true",
                                      "help": "show logprob tokens as 'token_id:N'"}),
    ("--root-path", {"default": "", "help": "FastAPI root_path behind a path-based routing proxy"}),
]


def add_gateway_args(parser: argparse.ArgumentParser) -> None:
    for flag, kwargs in GATEWAY_FLAGS:
        parser.add_argument(flag, **kwargs)  # type: ignore[arg-type]


def to_argv(args: argparse.Namespace) -> list[str]:
    """The gateway command line that reproduces the gateway flags in `args`."""
    argv: list[str] = []
    for flag, kwargs in GATEWAY_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if kwargs.get("action") == "store_true":
            if value:
                argv.append(flag)
        elif value != kwargs.get("default"):
            argv += [flag, str(value)]
    return argv
