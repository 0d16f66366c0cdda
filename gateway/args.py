"""The gateway's own command-line flags (`taco_llm serve` lists them in taco_llm/flags.py as gateway flags)."""

from __future__ import annotations

import argparse

LOG_LEVELS = ["debug", "info", "warning", "error", "critical", "trace"]

# (flag, argparse keywords)
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

