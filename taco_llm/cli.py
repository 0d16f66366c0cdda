"""The `taco_llm` command: `serve` (worker + gateway), and each part alone."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .serve_args import LookaheadRedis, ServeArgs
    from .supervisor import ChildSpec

USAGE = """usage: taco_llm <command> [options]

commands:
  serve [MODEL] [options]      an engine worker and the OpenAI gateway together (default: the bundled model)
  worker [MODEL] [options]     an engine worker alone: vLLM behind the gRPC service in protos/
  gateway --engine HOST:PORT   the OpenAI-compatible HTTP gateway alone, in front of running workers
  cache-service [options]      the cache service alone: prefix-KV blocks shared by workers (protos/)

`taco_llm COMMAND -h` lists a command's options.
"""


def serve(argv: Sequence[str]) -> int:
    from taco_llm.gateway.__main__ import parse as check_gateway_args

    from .preflight import check_worker_argv
    from .serve_args import ServeArgsError, parse, ports_in_use, worker_environments
    from .supervisor import STOP_GRACE_SECONDS, gateway_model, probe_host, probe_ssl_context
    from .supervisor import serve as run

    try:
        args = parse(argv)
        environments, device_warnings = worker_environments(args)
    except ServeArgsError as error:
        for line in str(error).splitlines():
            print(f"taco_llm serve: error: {line}", file=sys.stderr)
        return 2
    for warning in [*args.warnings, *device_warnings]:
        print(f"taco_llm serve: warning: {warning}", file=sys.stderr)
    problems = check_worker_argv(args.worker_argv, workers=args.num_workers)
    if problems:  # now, in seconds, rather than from the engine a minute later
        for problem in problems:
            print(f"taco_llm serve: error: {problem}", file=sys.stderr)
        return 2
    check_gateway_args(gateway_argv(args))  # refuses a bad gateway flag now, before any engine starts
    redis_problem = check_lookahead_redis(args.lookahead_redis, args.num_workers)
    if redis_problem:
        print(f"taco_llm serve: error: {redis_problem}", file=sys.stderr)
        return 2
    taken = ports_in_use(args)
    if taken:  # now, rather than from a worker once its engine has loaded
        for problem in taken:
            print(f"taco_llm serve: error: {problem}", file=sys.stderr)
        return 2
    specs = child_specs(args, environments)
    scheme = "https" if args.ssl_certfile else "http"
    base_url = f"{scheme}://{probe_host(args.host)}:{args.port}"
    # The gateway has checked the files (check_gateway_args), so this loads them without surprises.
    context = probe_ssl_context(args.ssl_certfile, args.ssl_keyfile) if args.ssl_certfile else None
    return run(specs, gateway_ready=lambda: gateway_model(base_url, args.api_key, context), base_url=base_url,
               ready_timeout=args.ready_timeout, stop_grace=args.shutdown_timeout + STOP_GRACE_SECONDS)


def child_specs(args: ServeArgs, environments: list[dict[str, str]]) -> list[ChildSpec]:
    """serve's processes: the cache service (when one is needed), the workers, the gateway. environments:
    what each worker adds to its environment (its devices or cores: serve_args.worker_environments)."""
    from .supervisor import ChildSpec, probe_host

    python = sys.executable
    specs: list[ChildSpec] = []
    shared: list[str] = []
    if args.cache_service_argv is not None:
        from taco_llm.cache_service.config import parse as check_cache_service_args

        cache_argv = ["--grpc-host", "127.0.0.1", "--grpc-port", str(args.cache_service_port),
                      *args.cache_service_argv]
        if args.lookahead_redis is not None:
            redis_spec, redis_url = lookahead_redis_spec(args.lookahead_redis)
            specs.append(redis_spec)
            cache_argv += ["--redis-url", redis_url]
        check_cache_service_args(cache_argv)  # a bad value is refused now, naming its flag
        # First, and stopped last: the workers reconnect to it with backoff meanwhile.
        specs.append(ChildSpec("cache service", "cache", [python, "-m", "taco_llm.cache_service", *cache_argv]))
        shared = ["--cache-service", f"127.0.0.1:{args.cache_service_port}"]
    workers: list[list[str]] = []
    for i, port in enumerate(args.grpc_ports):
        argv = [*args.worker_argv, "--grpc-host", args.grpc_host, "--grpc-port", str(port), *shared]
        if args.metrics_port is not None:
            argv += ["--metrics-port", str(args.metrics_port + i)]
        workers.append(argv)
    if args.single_process:
        one = json.dumps({"worker": workers[0], "gateway": gateway_argv(args)})
        specs.append(ChildSpec("engine worker and gateway", "gateway", [python, "-m", "taco_llm.single_process", one]))
        return specs
    for i, argv in enumerate(workers):
        name = "engine worker" if args.num_workers == 1 else f"engine worker {i}"
        specs.append(ChildSpec(name, "worker", [python, "-m", "taco_llm.engine_worker", *argv], env=environments[i],
                               health_address=f"{probe_host(args.grpc_host)}:{args.grpc_ports[i]}"))
    specs.append(ChildSpec("gateway", "gateway", [python, "-m", "taco_llm.gateway", *gateway_argv(args)]))
    return specs


def check_lookahead_redis(redis: LookaheadRedis | None, num_workers: int) -> str | None:
    """Why the Redis serve would start for the shared lookahead index cannot start, or None."""
    import shutil

    if redis is None:
        return None
    if shutil.which("redis-server") is None:
        return (f"--num-workers {num_workers} with --lookahead-cache-config-dir: the workers share one lookahead "
                "index through a Redis serve starts, and redis-server is not on PATH; install Redis, or give "
                "--redis-url")
    if redis.data_dir is not None:
        try:
            os.makedirs(redis.data_dir, exist_ok=True)
        except OSError as error:
            return f"--lookahead-redis-dir {redis.data_dir}: cannot be made ({error.strerror})"
        if not os.access(redis.data_dir, os.W_OK | os.X_OK):
            return f"--lookahead-redis-dir {redis.data_dir}: not writable"
    return None


def lookahead_redis_spec(redis: LookaheadRedis) -> tuple[ChildSpec, str]:
    """The redis-server serve starts for the shared lookahead index, and the URL the cache service reaches it
    by. It listens on a Unix socket in a directory of its own, not on a TCP port: only the cache service
    beside it is to reach it, and no port can clash."""
    import atexit
    import shutil
    import tempfile

    from .supervisor import ChildSpec

    runtime = tempfile.mkdtemp(prefix="taco_llm_lookahead_redis_")
    atexit.register(shutil.rmtree, runtime, ignore_errors=True)
    socket = os.path.join(runtime, "redis.sock")
    argv = [shutil.which("redis-server") or "redis-server", "--port", "0", "--unixsocket", socket,
            "--unixsocketperm", "700", "--save", "", "--daemonize", "no", "--loglevel", "warning"]
    if redis.data_dir is not None:
        argv += ["--dir", os.path.abspath(redis.data_dir), "--appendonly", "yes"]
    else:
        argv += ["--dir", runtime, "--appendonly", "no"]
    # Started first and stopped last, like the cache service: it is restarted if it dies (empty, unless
    # --lookahead-redis-dir keeps its file), and the workers go on drafting from their own indexes meanwhile.
    return ChildSpec("lookahead Redis", "cache", argv), f"unix://{socket}"


def gateway_argv(args: ServeArgs) -> list[str]:
    """The gateway's flags: one --engine per worker (it health-checks them, so a restarted worker rejoins),
    then the gateway flags serve was given (--registry-url among them, when given)."""
    from .supervisor import probe_host

    if "--registry-url" in args.worker_argv and probe_host(args.grpc_host) != args.grpc_host:
        # Workers on a wildcard host register this host's IP; a static 127.0.0.1 entry beside it would
        # count each worker twice. The registry alone then says who is in the fleet.
        return list(args.gateway_argv)
    host = probe_host(args.grpc_host)
    engines = [item for port in args.grpc_ports for item in ("--engine", f"{host}:{port}")]
    return [*engines, *args.gateway_argv]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        return serve(rest)
    if command == "worker":
        from taco_llm.engine_worker.__main__ import main as worker_main

        return worker_main(rest)
    if command == "gateway":
        from taco_llm.gateway.__main__ import main as gateway_main

        return gateway_main(rest)
    if command == "cache-service":
        from taco_llm.cache_service.__main__ import main as cache_service_main

        return cache_service_main(rest)
    print(f"taco_llm: unknown command {command!r}\n\n{USAGE}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
