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
    ("--api-key", {"action": "append", "default": [], "metavar": "[TENANT=]KEY",
                   "help": "require 'Authorization: Bearer KEY' on every route but /health; repeatable. "
                           "TENANT=KEY gives the key to tenant TENANT ([A-Za-z0-9_.-]+; a value whose KEY "
                           "part is empty or starts with '=' is a plain key, taken whole) "
                           "(default: the VLLM_API_KEY environment variable, if set, taken whole)"}),
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
    ("--shutdown-timeout", {"type": int, "default": 5, "metavar": "SECONDS",
                            "help": "on SIGTERM, stop accepting and let the streams under way finish for this "
                                    "long before closing them, as vLLM's flag of that name (default: 5)"}),
    ("--middleware", {"action": "append", "default": [], "metavar": "MODULE.ATTR",
                      "help": "extra ASGI middleware by import path; repeatable. A function becomes "
                              "@app.middleware('http'), a class is added with app.add_middleware()"}),
]

# Tenants and their rate limits (docs/security.md); `taco_llm serve` hands the ones given to the gateway.
TENANT_FLAGS: list[tuple[str, dict[str, object]]] = [
    ("--api-keys-file", {"default": None, "metavar": "PATH",
                         "help": "YAML or JSON: tenant name -> its keys, as a list or {keys: [...], "
                                 "requests_per_minute: N, tokens_per_minute: N} (default: none)"}),
    ("--tenant-isolation", {"action": argparse.BooleanOptionalAction, "default": True,
                            "help": "with named tenants, salt each tenant's prompts apart (cache_salt set "
                                    "by the gateway), so tenants never share KV blocks (default: on)"}),
    ("--rate-limit-requests-per-minute", {"type": int, "default": 0, "metavar": "N",
                                          "help": "requests per minute per tenant (per key for keys without "
                                                  "a tenant), per gateway process (default: 0, no limit)"}),
    ("--rate-limit-tokens-per-minute", {"type": int, "default": 0, "metavar": "N",
                                        "help": "prompt + completion tokens per minute per tenant (per key "
                                                "for keys without a tenant), per gateway process; counted "
                                                "when a request ends (default: 0, no limit)"}),
]


ROUTING_POLICIES = ["cache_aware", "least_load", "round_robin"]
# --stream-stall-timeout's default, seconds. It must outlast the longest single engine step, since a
# worker's engine_stalled_ms grows through each step: 30 s is four times the longest step measured for the
# default model on a loaded 2-core machine (6.5-6.9 s). A long prefill or a wait in the engine's queue is
# many steps and never trips it (failover.py). A large model on a CPU, whose prefill chunks can take tens
# of seconds each, needs it raised.
DEFAULT_STREAM_STALL_TIMEOUT = 30.0

# The fleet's flags: how the gateway finds its workers, routes to them, survives their failures, and
# how many processes relay their streams. `taco_llm serve` takes the same ones and hands them on.
ROUTING_FLAGS: list[tuple[str, dict[str, object]]] = [
    ("--routing", {"choices": ROUTING_POLICIES, "default": "cache_aware",
                   "help": "how a worker is chosen: cache_aware (prefix affinity weighed against load), "
                           "least_load (the workers' running and waiting requests and KV-cache usage) or "
                           "round_robin (default: cache_aware)"}),
    ("--registry-url", {"default": None, "metavar": "URL",
                        "help": "Redis where workers register (taco_llm worker --registry-url): workers "
                                "that register join the pool, and leave when their key expires"}),
    ("--health-interval", {"type": float, "default": 0.5, "metavar": "SECONDS",
                           "help": "how often each worker's health and load are read (default: 0.5)"}),
    ("--max-retries", {"type": int, "default": 2,
                       "help": "times a request that has produced no token yet is sent to another worker "
                               "after its worker fails (default: 2)"}),
    ("--retry-backoff", {"type": float, "default": 0.05, "metavar": "SECONDS",
                         "help": "wait before the first retry; it doubles with each retry (default: 0.05)"}),
    ("--max-migrations", {"type": int, "default": 2,
                          "help": "times a stream under way is continued on another worker when its worker "
                                  "fails (default: 2; 0: never)"}),
    ("--stream-stall-timeout", {"type": float, "default": DEFAULT_STREAM_STALL_TIMEOUT, "metavar": "SECONDS",
                                "help": "a stream that has waited this long for its worker's next message "
                                        "(its first included), from a worker that shows no progress (no "
                                        "message on another stream, and no recent GetLoad report with "
                                        "engine_stalled_ms below it), is cancelled and retried or migrated "
                                        "as a worker fault "
                                        f"(default: {DEFAULT_STREAM_STALL_TIMEOUT:g}; 0: wait for ever)"}),
    ("--cache-aware-balance-abs-threshold", {"type": int, "default": 16,
                                             "help": "cache_aware routes by load alone while the busiest and "
                                                     "the idlest worker differ by more than this many "
                                                     "requests... (default: 16)"}),
    ("--cache-aware-balance-rel-threshold", {"type": float, "default": 1.5,
                                             "help": "...and the busiest has more than this many times the "
                                                     "idlest's load (default: 1.5)"}),
    ("--shared-prefix-view", {"action": argparse.BooleanOptionalAction, "default": True,
                              "help": "cache_aware matches registered workers that publish their prefix cache "
                                      "(taco_llm worker --publish-prefix-cache) on what they publish in "
                                      "--registry-url's Redis, which every gateway replica reads alike, instead "
                                      "of on what this gateway alone sent them (default: on)"}),
    ("--cache-aware-offload-discount", {"type": float, "default": 0.75,
                                        "help": "what a prefix held by a worker's shared cache service is "
                                                "worth next to one on the worker itself (default: 0.75)"}),
    ("--api-server-count", {"type": int, "default": 1, "metavar": "N",
                            "help": "gateway processes serving the port, as vLLM's flag (default: 1)"}),
    ("--stream-interval", {"type": int, "default": 1, "metavar": "TOKENS",
                           "help": "at most one streamed chunk per this many tokens of a choice, but for the "
                                   "first token and the end, as vLLM's flag (default: 1: each token as it comes; "
                                   "a busy gateway merges the tokens that are waiting anyway)"}),
    ("--otlp-traces-endpoint", {"default": None, "metavar": "URL",
                                "help": "send OpenTelemetry traces over OTLP/gRPC to this collector "
                                        "(e.g. http://127.0.0.1:4317), as vLLM's flag of that name"}),
]


# The limits on one request's size and shape (gateway/request_limits.py); `taco_llm serve` hands the ones
# given to the gateway.
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024
DEFAULT_MAX_HEADER_BYTES = 64 * 1024
DEFAULT_MAX_JSON_DEPTH = 64
DEFAULT_MAX_PROMPTS_PER_BATCH = 128
REQUEST_LIMIT_FLAGS: list[tuple[str, dict[str, object]]] = [
    ("--max-request-body-bytes", {"type": int, "default": DEFAULT_MAX_REQUEST_BODY_BYTES, "metavar": "BYTES",
                                  "help": "a larger request body is refused with 413 as it arrives, never "
                                          "read whole (default: 33554432, 32 MiB)"}),
    ("--max-header-bytes", {"type": int, "default": DEFAULT_MAX_HEADER_BYTES, "metavar": "BYTES",
                            "help": "larger request headers (all of them together) are refused with 431 "
                                    "(default: 65536, 64 KiB)"}),
    ("--max-json-depth", {"type": int, "default": DEFAULT_MAX_JSON_DEPTH, "metavar": "LEVELS",
                          "help": "a JSON body nested deeper is refused with 400 before it is parsed into a "
                                  "request (default: 64)"}),
    ("--max-prompts-per-batch", {"type": int, "default": DEFAULT_MAX_PROMPTS_PER_BATCH, "metavar": "N",
                                 "help": "a completion with more prompts in its `prompt` list, or a "
                                         "/v1/chat/completions/batch with more conversations, is refused with "
                                         "400; each is an engine request (default: 128)"}),
]


# Stored responses (/v1/responses with `store`, gateway/response_store.py); `taco_llm serve` hands the
# ones given to the gateway.
DEFAULT_RESPONSES_TTL = 24 * 3600.0
DEFAULT_RESPONSES_MAX_BYTES = 256 * 1024 * 1024
RESPONSES_FLAGS: list[tuple[str, dict[str, object]]] = [
    ("--responses-store-url", {"default": None, "metavar": "URL",
                               "help": "Redis where stored responses (/v1/responses) are kept, read alike by "
                                       "every gateway replica (default: --registry-url's Redis; without "
                                       "either, this gateway process's memory)"}),
    ("--responses-ttl", {"type": float, "default": DEFAULT_RESPONSES_TTL, "metavar": "SECONDS",
                         "help": "a stored response is forgotten this long after it was last written "
                                 "(default: 86400, a day)"}),
    ("--responses-max-bytes", {"type": int, "default": DEFAULT_RESPONSES_MAX_BYTES, "metavar": "BYTES",
                               "help": "all stored responses together take at most this much: the ones "
                                       "nearest to expiring are evicted first (default: 268435456, 256 MiB)"}),
]


def add_flag_group(parser: argparse.ArgumentParser, title: str | None,
                   flags: list[tuple[str, dict[str, object]]]) -> None:
    """`flags` (GATEWAY_FLAGS, ROUTING_FLAGS, ...) on `parser`, under `title` in the help (None: ungrouped)."""
    group = parser if title is None else parser.add_argument_group(title)
    for flag, kwargs in flags:
        group.add_argument(flag, **kwargs)  # type: ignore[arg-type]
