"""The gateway's own command-line flags (`taco_llm serve` lists them in taco_llm/flags.py as gateway flags)."""

from __future__ import annotations

import argparse
import json

LOG_LEVELS = ["debug", "info", "warning", "error", "critical", "trace"]
# The stdlib ssl module's VerifyMode values, by number (as vLLM takes them) or by name.
CERT_REQS = {"0": 0, "1": 1, "2": 2, "CERT_NONE": 0, "CERT_OPTIONAL": 1, "CERT_REQUIRED": 2,
             "none": 0, "optional": 1, "required": 2}


def json_string_list(text: str) -> list[str]:
    """A JSON list of strings, as vLLM's CORS flags take: '["https://a.example", "https://b.example"]'."""
    try:
        value = json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not a JSON list of strings ({error}): {text!r}") from None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text!r}")
    return value


def cert_reqs(text: str) -> int:
    try:
        return CERT_REQS[text]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not 0 (CERT_NONE), 1 (CERT_OPTIONAL) or 2 (CERT_REQUIRED)") from None


# (flag, argparse keywords)
GATEWAY_FLAGS: list[tuple[str, dict[str, object]]] = [
    ("--host", {"default": "127.0.0.1", "help": "host name to listen on"}),
    ("--port", {"type": int, "default": 8000, "help": "port to listen on"}),
    ("--uvicorn-log-level", {"choices": LOG_LEVELS, "default": "info", "help": "log level for uvicorn"}),
    ("--response-role", {"default": "assistant", "help": "the role name returned in chat completions"}),
    ("--return-tokens-as-token-ids", {"action": "store_true",
                                      "help": "show logprob tokens as 'token_id:N'"}),
    ("--root-path", {"default": "", "help": "FastAPI root_path behind a path-based routing proxy"}),
    ("--api-key", {"default": None,
                   "help": "require 'Authorization: Bearer KEY' on every route but /health "
                           "(default: the VLLM_API_KEY environment variable, if set)"}),
    ("--allowed-origins", {"type": json_string_list, "default": [],
                           "help": "CORS origins, as a JSON list (default: none)"}),
    ("--allowed-methods", {"type": json_string_list, "default": ["*"],
                           "help": "CORS methods, as a JSON list (default: [\"*\"])"}),
    ("--allowed-headers", {"type": json_string_list, "default": ["*"],
                           "help": "CORS headers, as a JSON list (default: [\"*\"])"}),
    ("--allow-credentials", {"action": "store_true", "help": "CORS: allow credentials"}),
    ("--ssl-keyfile", {"default": None, "help": "the TLS private key file (PEM)"}),
    ("--ssl-certfile", {"default": None, "help": "the TLS certificate file (PEM); turns on HTTPS"}),
    ("--ssl-ca-certs", {"default": None, "help": "CA certificates that client certificates are verified against"}),
    ("--ssl-cert-reqs", {"type": cert_reqs, "default": 0,
                         "help": "client certificates: 0 not asked for, 1 optional, 2 required "
                                 "(the ssl module's CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED)"}),
    ("--middleware", {"action": "append", "default": [], "metavar": "MODULE.ATTR",
                      "help": "extra ASGI middleware by import path; repeatable. A function becomes "
                              "@app.middleware('http'), a class is added with app.add_middleware()"}),
]


def add_gateway_args(parser: argparse.ArgumentParser) -> None:
    for flag, kwargs in GATEWAY_FLAGS:
        parser.add_argument(flag, **kwargs)  # type: ignore[arg-type]
