"""The `taco_llm` command: `serve` (worker + gateway), and each part alone."""

from __future__ import annotations

import sys
from collections.abc import Sequence

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

    from .serve_args import ServeArgsError, parse
    from .supervisor import probe_host, probe_ssl_context
    from .supervisor import serve as run

    try:
        args = parse(argv)
    except ServeArgsError as error:
        for line in str(error).splitlines():
            print(f"taco_llm serve: error: {line}", file=sys.stderr)
        return 2
    for warning in args.warnings:
        print(f"taco_llm serve: warning: {warning}", file=sys.stderr)
    engine_address = f"{probe_host(args.grpc_host)}:{args.grpc_port}"
    gateway_argv = ["--engine", engine_address, *args.gateway_argv]
    check_gateway_args(gateway_argv)  # refuses a bad gateway flag now, before the engine starts
    worker_argv = [*args.worker_argv, "--grpc-host", args.grpc_host, "--grpc-port", str(args.grpc_port)]
    scheme = "https" if args.ssl_certfile else "http"
    base_url = f"{scheme}://{probe_host(args.host)}:{args.port}"
    # The gateway has checked the files (check_gateway_args), so this loads them without surprises.
    context = probe_ssl_context(args.ssl_certfile, args.ssl_keyfile) if args.ssl_certfile else None
    cache_argv = None
    if args.cache_service_argv is not None:
        from taco_llm.cache_service.config import parse as check_cache_service_args

        cache_argv = ["--grpc-host", "127.0.0.1", "--grpc-port", str(args.cache_service_port),
                      *args.cache_service_argv]
        check_cache_service_args(cache_argv)  # a bad value is refused now, naming its flag
        worker_argv += ["--cache-service", f"127.0.0.1:{args.cache_service_port}"]
    return run(worker_argv, gateway_argv, base_url, args.ready_timeout, args.api_key, context, cache_argv,
               single_process=args.single_process)


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
